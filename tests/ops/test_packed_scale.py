"""Packed documents stay independent at extreme scales: a document packed beside one whose |w| is
near the dtype's range (1e30 in float32, 1e4 in float16, bfloat16's range) gets the result it has
alone, on every kernel backend and on both packed layouts (the native per-document path and the
kernels' padded layout), for ``tssa`` and ``causal_tssa`` (outputs, memberships and the state each
document ends with). Many generated rows: random numbers, lengths and order of documents, the
extreme one anywhere among them."""
import pytest
import torch

from kernel_backends import BACKENDS, use_backend
from whiteformer.ops import causal_tssa, tssa

#: |w| of the extreme document (randn times this; its largest entries are ~4x larger)
EXTREME = {torch.float32: 1e30, torch.float16: 1e4, torch.bfloat16: 3e38 / 4}
#: the bound of the scaling tests: deviation / the document's largest |result|
TOL = {torch.float32: 4e-5, torch.float16: 4e-3, torch.bfloat16: 8e-2}
ROWS = {"torch": 8, "cpu": 8, "triton": 3}  # generated packed rows per test (the interpreter is slow)


@pytest.fixture(params=sorted(BACKENDS))
def backend(request, monkeypatch):
    return use_backend(request.param, monkeypatch)


@pytest.fixture(params=["native", "padded"])
def layout(request, monkeypatch, backend):
    """The packed layout: ``native`` (per-document sums on the packed tokens, any backend) or
    ``padded`` (a padded batch of documents through the fused kernels; the torch backend has none)."""
    import whiteformer.ops.layout as token_layout

    if request.param == "padded" and backend == "torch":
        pytest.skip("the PyTorch path has no padded layout")
    if request.param == "native" and backend == "triton":
        pytest.skip("a native packed row runs the PyTorch path (the torch and cpu backends test it)")
    monkeypatch.setattr(token_layout, "PADDED_WASTE_MAX", 0.0 if request.param == "native" else float("inf"))
    return request.param


def _row(g: torch.Generator, dtype, heads=3, p=4):
    """A packed row: 2-6 documents of 0-11 tokens (one non-empty extreme document at a random
    place; the others at scales 1e-2..1e2), w (1, H, total, p) in ``dtype``, temp, cu_seqlens, the
    extreme document's index."""
    s = int(torch.randint(2, 7, (1,), generator=g))
    lengths = torch.randint(0, 12, (s,), generator=g).tolist()
    big = int(torch.randint(0, s, (1,), generator=g))
    lengths[big] = max(lengths[big], 1)
    scales = [EXTREME[dtype] if d == big else 10.0 ** float(torch.empty(1).uniform_(-2, 2, generator=g))
              for d in range(s)]
    w = torch.cat([torch.randn(1, heads, n, p, generator=g) * c for n, c in zip(lengths, scales)], dim=2)
    w = w.clamp(-3e38, 3e38).to(dtype)
    temp = torch.rand(heads, 1, generator=g) + 0.5
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return w, temp, cu, big


def _close(got, alone, dtype, what):
    assert torch.isfinite(got).all(), what
    scale = alone.double().abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    err = ((got.double() - alone.double()).abs().max() / scale).item()
    assert err <= TOL[dtype], f"{what}: {err:.3g} of its largest |value| away from the document alone"


@pytest.mark.parametrize("dtype", list(EXTREME), ids=str)
def test_packed_beside_extreme_equals_alone(backend, layout, dtype):
    if backend == "cpu" and dtype != torch.float32:
        pytest.skip("the C++ kernels take float32/float64 only (half inputs run the PyTorch path)")
    g = torch.Generator().manual_seed(1234 + list(EXTREME).index(dtype))
    for row in range(ROWS[backend]):
        w, temp, cu, big = _row(g, dtype)
        bounds = cu.tolist()
        out, pi = tssa(w, temp, return_pi=True, cu_seqlens=cu)
        c_out, c_pi, state = causal_tssa(w, temp, return_pi=True, return_state=True, cu_seqlens=cu)
        for d, (a, b) in enumerate(zip(bounds, bounds[1:])):
            if a == b:
                continue
            doc = w[:, :, a:b]
            what = f"row {row}, document {d} of {len(bounds) - 1} (extreme: {big})"
            alone, alone_pi = tssa(doc, temp, return_pi=True)
            _close(out[:, :, a:b], alone, dtype, f"tssa out, {what}")
            _close(pi[:, :, a:b], alone_pi, dtype, f"tssa pi, {what}")
            alone, alone_pi, alone_state = causal_tssa(doc, temp, return_pi=True, return_state=True)
            _close(c_out[:, :, a:b], alone, dtype, f"causal_tssa out, {what}")
            _close(c_pi[:, :, a:b], alone_pi, dtype, f"causal_tssa pi, {what}")
            if d != big:  # the extreme document's sums of squares exceed the statistics' range
                for field in ("sum_sq", "sum_pi", "sum_sq_pi"):
                    _close(getattr(state, field)[d], getattr(alone_state, field)[0], dtype,
                           f"causal_tssa state {field}, {what}")


@pytest.mark.parametrize("op", [tssa, causal_tssa], ids=["tssa", "causal_tssa"])
def test_packed_gradients_beside_extreme_equal_alone(backend, layout, op):
    """The gradient of each ordinary document's tokens (float32, beside one at 1e30) is the one it
    has alone."""
    g = torch.Generator().manual_seed(99)
    for row in range(2):
        w, temp, cu, big = _row(g, torch.float32)
        bounds = cu.tolist()
        w.requires_grad_()
        out = op(w, temp, cu_seqlens=cu)
        weights = torch.randn(out.shape, generator=g)
        (grad,) = torch.autograd.grad((out * weights).sum(), w)
        for d, (a, b) in enumerate(zip(bounds, bounds[1:])):
            if a == b or d == big:
                continue
            doc = w.detach()[:, :, a:b].clone().requires_grad_()
            (alone,) = torch.autograd.grad((op(doc, temp) * weights[:, :, a:b]).sum(), doc)
            _close(grad[:, :, a:b], alone, torch.float32, f"{op.__name__} grad, row {row}, document {d}")
