"""The Llama-style decoder under ``torch.distributed`` on 2 CPU processes (gloo).

- Context parallelism: the all-TSSA decoder (``tost_decoder_base``) on a sequence split over the
  ranks gives the unsplit model's rows of the logits, its loss (on every rank) and, averaged over the
  group, its gradients: padded batches (uneven chunks, an empty chunk), ``loss_chunk``, and packed
  ``cu_seqlens`` documents spanning ranks, with gradient checkpointing too; a rank failing its
  input checks makes the other raise, not hang. A model with a softmax layer (``decoder_base``, a
  ``keep_softmax`` hybrid) refuses at ``set_context_parallel`` with one ValueError, as the GPT shell does.
- FSDP2 (``shard_model``, what ``whiteformer train --fsdp`` runs): softmax, TSSA and hybrid decoders
  trained data-parallel with sharded parameters take the same optimizer steps as one process on the
  whole batch; the full state dict gathered from the shards loads into a plain model (and back into
  the shards) with the same logits.

Each test spawns its processes once and runs all its cases in them (slow start-up)."""
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from test_context_parallel import check_lm_split

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")

V = 37
TINY = dict(vocab_size=V, dim=16, depth=2, num_heads=2, num_kv_heads=1, intermediate_size=24)
VARIANTS = {
    "decoder_base": dict(TINY, qkv_bias=True),
    "tost_decoder_base": dict(TINY, qkv_bias=True),
    "hybrid": dict(TINY, keep_softmax=[1], tie_embeddings=False),
}
TOL = dict(rtol=1e-10, atol=1e-11)


def _init(rank: int, world: int, store: str) -> None:
    os.environ["WHITEFORMER_DISABLE_KERNELS"] = "1"  # the unsplit op: the PyTorch path, no C++ build
    torch.set_num_threads(1)
    # a collective that one rank skips fails the test after a minute instead of hanging it
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def _shut_down() -> None:
    from whiteformer.app.train.distributed import cleanup

    dist.barrier()
    cleanup()


def _model(variant: str):
    """A float64 decoder, the same on every rank, its gains and biases away from their init."""
    from whiteformer.models import create_model

    torch.manual_seed(0)
    name = "tost_decoder_base" if variant == "hybrid" else variant
    model = create_model(name, **VARIANTS[variant]).double()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("bias", "ln_1.weight", "ln_2.weight", "ln_f.weight", "temp")):
                p.add_(0.3 * torch.randn_like(p))
    return model


def _check_split(model, group, sizes) -> None:
    """:func:`check_lm_split` on token ids of the decoder's vocabulary (packed: 3 documents, the
    second spanning the ranks' boundary)."""
    n = sum(sizes)
    g = torch.Generator().manual_seed(n)
    idx, targets = torch.randint(0, V, (2, 2, n), generator=g)
    check_lm_split(model, group, sizes, idx, targets, [0, 3, 7, n])


def _context_parallel_worker(rank: int, world: int, store: str) -> None:
    _init(rank, world, store)
    group = dist.group.WORLD
    model = _model("tost_decoder_base")
    for checkpointed in (False, True):  # the blocks' recomputation in backward runs the collectives again
        model.set_grad_checkpointing(checkpointed)
        for sizes in ([5, 4], [9, 0]):  # uneven chunks; rank 1 without tokens
            _check_split(model, group, sizes)
    # rank 1's token ids out of range: its own error there, one naming rank 1 on rank 0 (not a hang)
    idx = torch.randint(0, V, (2, 4)) + V * (rank == 1)
    model.set_context_parallel(group)
    try:
        match = "token ids in" if rank == 1 else "rank 1 of the group failed its input checks.*token ids in"
        with pytest.raises(ValueError, match=match):
            model(idx, idx % V)
    finally:
        model.set_context_parallel(None)
    for variant, block in (("decoder_base", 0), ("hybrid", 1)):
        softmax = _model(variant)
        with pytest.raises(ValueError, match=f"^DecoderLM cannot run context-parallel: block {block} is softmax "
                                             "attention, which would need ring attention"):
            softmax.set_context_parallel(group)
        assert softmax.context_parallel_group is None  # refused before any layer was switched
        assert all(getattr(m, "context_parallel_group", None) is None for m in softmax.modules())
    _shut_down()


def test_context_parallel_split_equals_unsplit(tmp_path):
    mp.spawn(_context_parallel_worker, args=(2, str(tmp_path / "store")), nprocs=2, join=True)


def _whole_state(sharded):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True))


def _check_fsdp(variant: str, rank: int, world: int) -> None:
    """Two AdamW steps of the sharded model on this rank's half of the batch == two steps of the
    plain model on the whole batch; the gathered state dict loads into a plain model and back into
    the shards with the same logits."""
    import copy

    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from whiteformer.app.train.distributed import shard_model

    plain = _model(variant).train()
    sharded = shard_model(copy.deepcopy(plain))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (plain, sharded)]
    g = torch.Generator().manual_seed(7)
    half = slice(rank * 2, rank * 2 + 2)
    for step in range(2):
        idx = torch.randint(0, V, (2 * world, 9), generator=g)
        targets = torch.randint(0, V, (2 * world, 9), generator=g)
        losses = []
        for model, opt, rows in ((plain, opts[0], slice(None)), (sharded, opts[1], half)):
            opt.zero_grad()
            loss = model(idx[rows], targets[rows])[1]
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        mean = losses[1].clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / world, losses[0], rtol=1e-9, atol=1e-10)
    whole = _whole_state(sharded)
    ref = plain.state_dict()
    assert whole.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(whole[k], ref[k], rtol=1e-8, atol=1e-10, msg=f"{variant}: {k}")

    loaded = _model(variant).eval()  # another init, then the gathered weights
    loaded.load_state_dict(whole)
    assert (loaded.lm_head.weight is loaded.transformer.wte.weight) == loaded.tie_embeddings
    idx = torch.randint(0, V, (2, 7), generator=g)
    with torch.no_grad():
        want = plain.eval()(idx)[0]
        torch.testing.assert_close(loaded(idx)[0], want, **TOL)
        fresh = shard_model(_model(variant)).eval()  # shards of another init, set from the whole model
        set_model_state_dict(fresh, loaded.state_dict(), options=StateDictOptions(full_state_dict=True))
        torch.testing.assert_close(fresh(idx)[0], want, **TOL)


def _fsdp_worker(rank: int, world: int, store: str) -> None:
    _init(rank, world, store)
    for variant in VARIANTS:
        _check_fsdp(variant, rank, world)
    _shut_down()


def test_fsdp_steps_equal_one_process_and_the_state_dict_round_trips(tmp_path):
    mp.spawn(_fsdp_worker, args=(2, str(tmp_path / "store")), nprocs=2, join=True)
