"""Packed documents in language-model training (``data_args.pack=true``): a packed batch gives
every document the logits and the loss it has run alone, on every kernel backend, both as the
token-weighted mean (what training optimises) and per document; no target crosses a document
boundary; the context-parallel split keeps the whole row's documents."""
import importlib

import pytest
import torch
import torch.nn.functional as F

from kernel_backends import BACKENDS, use_backend
from whiteformer.app.data import build_dataset
from whiteformer.app.data.packing import PackedWindows
from whiteformer.app.train.build import make_task
from whiteformer.app.train.distributed import DistInfo
from whiteformer.models import create_model

BLOCK = 12


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A text file of documents of 1 to 17 characters, each ended by a newline (empty ones too)."""
    g = torch.Generator().manual_seed(1)
    words = ["".join("abcdefg"[int(i)] for i in torch.randint(0, 7, (int(n),), generator=g))
             for n in torch.randint(0, 17, (300,), generator=g)]
    path = tmp_path_factory.mktemp("docs") / "docs.txt"
    path.write_text("\n".join(words) + "\n")
    return path


def _task(corpus, batch_size=3, dist=None):
    tr, va = (build_dataset("text", split, path=str(corpus), pack=True, eod="\n") for split in ("train", "val"))
    return make_task(tr, va, dist, batch_size=batch_size, block_size=BLOCK, eval_batches=2)


def _model(vocab_size, dtype, name="tost_lm_base"):
    torch.manual_seed(0)
    positions = dict(pos_emb=True, **({"pos_bias": True} if name.startswith("tost") else {}))
    model = create_model(name, vocab_size=vocab_size, dim=16, depth=1, num_heads=2, max_len=BLOCK,
                         **positions).to(dtype)
    with torch.no_grad():  # layer scales and position biases away from their tiny / zero init
        for p in model.parameters():
            if p.dim() == 1 or p.shape[-1] == 1:
                p.normal_(0, 0.5)
    return model


@pytest.fixture
def pytorch_paths(monkeypatch):
    """Counts the calls of causal TSSA's PyTorch paths (the kernels' fallbacks)."""
    dispatch = importlib.import_module("whiteformer.ops.causal_tssa.dispatch")  # the package name is also the op's
    calls = []
    for name in ("causal_tssa_parallel", "_causal_varlen"):
        def spy(*args, _fn=getattr(dispatch, name), _name=name, **kwargs):
            calls.append(_name)
            return _fn(*args, **kwargs)
        monkeypatch.setattr(dispatch, name, spy)
    return calls


@pytest.mark.parametrize("backend,name", [(b, "tost_lm_base") for b in sorted(BACKENDS)] + [("torch", "gpt_base")])
def test_packed_batch_equals_documents_alone(backend, name, corpus, monkeypatch, pytorch_paths):
    """Every kernel backend of causal TSSA; GPT (softmax attention) has the PyTorch path only."""
    use_backend(backend, monkeypatch)
    task = _task(corpus)
    x, y = task.train_batch(0)
    assert isinstance(x, PackedWindows) and x.idx.shape == y.shape == (1, 3 * BLOCK)
    bounds = x.cu_seqlens.tolist()
    assert len(bounds) > 6  # several documents per window
    model = _model(task.train_ds.vocab_size, torch.float32 if backend == "triton" else torch.float64, name)

    logits, loss = model(x.idx, targets=y, cu_seqlens=x.cu_seqlens)
    task_loss, stats = task.loss(model, x, y)
    torch.testing.assert_close(task_loss, loss.float())
    assert stats["count"] == (y != -1).sum() == 3 * BLOCK - (len(bounds) - 1)

    per_token = F.cross_entropy(logits[0], y[0], ignore_index=-1, reduction="none")
    total, count, doc_means, alone_means = 0.0, 0, [], []
    for a, b in zip(bounds, bounds[1:]):
        doc, t = x.idx[:, a:b], y[:, a:b]
        assert torch.equal(t[0, :-1], doc[0, 1:]) and t[0, -1] == -1  # no target crosses a boundary
        alone, loss_alone = model(doc, targets=t) if b - a > 1 else (model(doc)[0], None)
        torch.testing.assert_close(logits[:, a:b], alone)
        if loss_alone is not None:
            total, count = total + loss_alone * (b - a - 1), count + b - a - 1
            doc_means.append(per_token[a:b - 1].mean())
            alone_means.append(loss_alone)
    torch.testing.assert_close(loss, total / count)  # the token-weighted mean
    torch.testing.assert_close(torch.stack(doc_means), torch.stack(alone_means))  # each document's mean
    params = list(model.parameters())
    for got, want in zip(torch.autograd.grad(loss, params), torch.autograd.grad(total / count, params)):
        torch.testing.assert_close(got, want)
    if name == "tost_lm_base":
        assert bool(pytorch_paths) == (backend == "torch")  # the kernels ran, packed and alone


def test_packed_evaluation_counts_document_targets(corpus):
    task = _task(corpus)
    model = _model(task.train_ds.vocab_size, torch.float64)
    res = task.evaluate(model)
    total = count = 0.0
    model.eval()
    starts = task.eval_starts(task.eval_ds)
    for i in range(0, len(starts), task.local_batch):
        x, y = task._batch(task.eval_ds, starts[i:i + task.local_batch])
        n = float((y != -1).sum())
        with torch.no_grad():
            total, count = total + float(model(x.idx, targets=y, cu_seqlens=x.cu_seqlens)[1]) * n, count + n
    assert res["n"] == count < len(starts) * BLOCK
    assert res["loss"] == pytest.approx(total / count, rel=1e-6)


@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_chunks_share_the_whole_rows_documents(corpus, cp):
    """Each rank of a context-parallel group gets a contiguous chunk of its data-parallel group's
    packed row, with the ``cu_seqlens`` of the whole row (a document may span ranks)."""
    whole = [_task(corpus, batch_size=4, dist=DistInfo(rank=r, world_size=2)).train_batch(5) for r in range(2)]
    for dp in range(2):
        chunks = [_task(corpus, batch_size=4, dist=DistInfo(rank=dp * cp + r, world_size=2 * cp, cp_size=cp))
                  .train_batch(5) for r in range(cp)]
        x, y = whole[dp]
        assert torch.equal(torch.cat([c[0].idx for c in chunks], dim=1), x.idx)
        assert torch.equal(torch.cat([c[1] for c in chunks], dim=1), y)
        assert all(torch.equal(c[0].cu_seqlens, x.cu_seqlens) for c in chunks)
