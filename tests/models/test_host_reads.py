"""Host reads of the language models: a packed or padded forward reads its inputs to the host a
fixed number of times, whatever the depth (the token layout is built once and handed to every
block), and ``generate`` reads at most once per generated token (its stopping check) beyond a
constant. On a GPU each such read is a stream synchronisation.

Counted: ``.tolist()``, ``.item()``, ``.cpu()``, ``.numpy()`` and a tensor turned into a Python
bool / int / float / index, by a ``TorchFunctionMode`` (only the calls made by the library, not those
inside torch). The ops run their PyTorch path (``WHITEFORMER_BACKEND=torch``): the C++ CPU
kernel also reads, per call, its own flag of rows past its range, a read of host memory only.
Under context parallelism (2 processes, gloo), the layout's exchange of the chunks
(``chunk_layout``) happens once per forward whatever the depth."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.overrides import TorchFunctionMode

from whiteformer.models import create_model
from whiteformer.ops._kernels import ENV_BACKEND

READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}
VOCAB = 64
MODELS = {"tost_lm_base": {"max_len": 512}, "gpt_base": {"max_len": 512}}


class HostReads(TorchFunctionMode):
    """Counts the tensor-to-host reads made while it is active (``count``, ``calls`` their names)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))

    @property
    def count(self) -> int:
        return len(self.calls)


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "torch")


def _model(name: str, depth: int):
    torch.manual_seed(0)
    return create_model(name, vocab_size=VOCAB, dim=32, depth=depth, num_heads=2, **MODELS[name]).eval()


def _packed(documents: int = 40, seed: int = 0):
    """One row of ``documents`` packed documents of 1-12 tokens: idx (1, T), targets, cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 13, (documents,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
    idx = torch.randint(0, VOCAB, (1, int(cu[-1])), generator=g)
    return idx, torch.randint(0, VOCAB, idx.shape, generator=g), cu


def _reads(fn) -> HostReads:
    with torch.no_grad(), HostReads() as reads:
        fn()
    return reads


@pytest.mark.parametrize("name", list(MODELS))
def test_packed_forward_reads_the_same_at_every_depth(name):
    idx, targets, cu = _packed()
    counts = {}
    for depth in (2, 8):
        model = _model(name, depth)
        counts[depth] = _reads(lambda: model(idx, targets, cu_seqlens=cu)).calls
    assert counts[2] == counts[8], counts
    assert "tolist" in counts[2]  # the one read of cu_seqlens (the count is not vacuous)
    assert counts[2].count("tolist") <= 2, counts[2]  # cu_seqlens and the token ids' range, once each


@pytest.mark.parametrize("name", list(MODELS))
def test_padded_forward_and_prefill_read_the_same_at_every_depth(name):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (3, 17), generator=g)
    mask = torch.ones(3, 17, dtype=torch.long)  # transformers' 0/1 integer mask, left padding
    mask[0, :5] = 0
    mask[2, :2] = 0
    counts = {}
    for depth in (2, 8):
        model = _model(name, depth)
        counts[depth] = (_reads(lambda: model(idx, idx, attn_mask=mask)).count,
                         _reads(lambda: model.prefill(idx, mask)).count)
    assert counts[2] == counts[8], counts


@pytest.mark.parametrize("name", list(MODELS))
def test_generate_reads_at_most_once_per_token_at_every_depth(name):
    """The stopping check (one flag per generated token) is the only read that grows with the
    tokens; none grows with the depth. The eos id is one greedy decoding never produces, so every
    run generates all its tokens."""
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    counts = {}
    for depth in (2, 8):
        model = _model(name, depth)
        free = model.generate(prompt, 8, temperature=0.0, eos_token_id=None)
        eos = next(i for i in range(VOCAB) if not bool((free == i).any()))
        for n in (4, 8):
            reads = _reads(lambda: model.generate(prompt, n, temperature=0.0, eos_token_id=eos))
            counts[depth, n] = reads.count
        assert torch.equal(model.generate(prompt, 8, temperature=0.0, eos_token_id=eos), free)
    assert counts[2, 4] == counts[8, 4] and counts[2, 8] == counts[8, 8], counts
    assert 0 < counts[2, 8] - counts[2, 4] <= 4, counts  # one per token more (the last token needs none)


# ---- context parallelism: the layout's exchange once per forward ----

def _cp_worker(rank: int, world: int, store: str) -> None:
    os.environ["WHITEFORMER_DISABLE_KERNELS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    import whiteformer.ops.layout as layout_module
    from whiteformer.app.train.distributed import cleanup
    from whiteformer.ops.context_parallel import group_chunk

    exchanges = []
    exchange = layout_module.chunk_layout

    def counted(*args, **kwargs):
        exchanges.append(kwargs.get("name"))
        return exchange(*args, **kwargs)

    layout_module.chunk_layout = counted
    group = dist.group.WORLD
    idx, targets, cu = _packed(documents=30, seed=3)
    part = group_chunk(idx.shape[1], group)
    mask = torch.ones(2, 12, dtype=torch.bool)
    if rank == 0:  # padding on rank 0's chunk only
        mask[0, :3] = False
    counts = {}
    for depth in (2, 8):
        model = _model("tost_lm_base", depth).set_context_parallel(group)
        exchanges.clear()
        _, loss = model(idx[:, part], targets[:, part], cu_seqlens=cu)
        loss.backward()
        packed = list(exchanges)
        exchanges.clear()
        ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
        model(ids, attn_mask=mask)
        counts[depth] = (packed, list(exchanges))
    assert counts[2] == counts[8] == (["idx"], ["idx"]), counts
    dist.barrier()
    cleanup()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_context_parallel_layout_exchanged_once_per_forward(tmp_path):
    mp.spawn(_cp_worker, args=(2, str(tmp_path / "store")), nprocs=2, join=True)
