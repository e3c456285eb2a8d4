"""Scale-safe Triton kernels (run through Triton's interpreter on CPU): ``tssa``, ``causal_tssa``
and the causal step divide ``w`` by the per-(sequence, head) power of two of
:mod:`whiteformer.ops.scaling` and keep a ``1 / c`` term in the gain, so that any finite ``w`` up
to float32's range gives finite outputs, states and gradients equal to the PyTorch path's."""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'whiteformer[triton]')")

from whiteformer.ops._kernels.triton import _tiles  # noqa: E402
from whiteformer.ops._kernels.triton.causal_tssa import causal_tssa_triton  # noqa: E402
from whiteformer.ops._kernels.triton.causal_tssa_step import causal_tssa_step_triton  # noqa: E402
from whiteformer.ops._kernels.triton.tssa import tssa_triton  # noqa: E402
from whiteformer.ops.causal_tssa.parallel import causal_tssa_parallel  # noqa: E402
from whiteformer.ops.tssa.parallel import tssa_parallel  # noqa: E402

if not _tiles.kernels_interpreted() and not torch.cuda.is_available():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it)",
                allow_module_level=True)

SCALES = [1e19, 1e30, 3e38 / 4]  # |w| up to ~4x the scale: w^2 overflows float32 from ~1.8e19
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    monkeypatch.setattr(_tiles, "BLOCK_N_MAX", 2)
    monkeypatch.setattr(_tiles, "CHUNK", 4)


def _inputs(scale, dtype, seed=0, shape=(2, 3, 7, 4), spread=1e-12):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).clamp(-3e38, 3e38)
    w[1, :, :2] *= spread  # a sequence whose first tokens lie far below the rest
    temp = torch.rand(shape[1], 1, generator=g) + 0.5
    keep = torch.ones(shape[0], shape[2], dtype=torch.bool)
    keep[0, -2:] = False
    return w.to(dtype), temp, keep


def _close(got, ref, tol, what):
    """Finite, and within ``tol`` of ``ref`` relative to its largest |entry| per (sequence, head),
    or within the smallest normal number of ``got``'s dtype (outputs near 1 / |w| ~ 1e-38 are
    subnormal there: the dtype's own rounding)."""
    tiny = torch.finfo(got.dtype).tiny
    got, ref = got.detach().double(), ref.detach().double()
    assert torch.isfinite(got).all(), f"{what}: {(~torch.isfinite(got)).sum().item()} entries not finite"
    dims = tuple(range(2, ref.dim()))
    norm = ref.abs().amax(dim=dims, keepdim=True) if dims else ref.abs()
    err = ((got - ref).abs() - tiny).clamp_min(0) / norm.clamp_min(1e-300)
    assert err.max().item() <= tol, f"{what}: max error {err.max().item():.2e} relative to the largest |ref|"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scale", SCALES)
def test_forward_matches_the_torch_path(dtype, scale):
    w, temp, keep = _inputs(scale, dtype)
    tol = 4 * TOL[dtype]
    w64 = w.double()
    for masked in (None, keep):
        out, pi = tssa_triton(w, temp, masked)
        ref, ref_pi = tssa_parallel(w64, temp.double(), masked)
        _close(out, ref, tol, "tssa out")
        _close(pi, ref_pi, tol, "tssa pi")
        out, pi, *sums, k = causal_tssa_triton(w, temp, None, masked)
        ref, ref_pi, *ref_sums, ref_k = causal_tssa_parallel(w64, temp.double(), None, masked)
        _close(out, ref, tol, "causal out")
        _close(pi, ref_pi, tol, "causal pi")
        assert (k.double() == ref_k).all()
        for a, r in zip(sums, ref_sums):
            _close(a, r, tol, "causal final sums")


@pytest.mark.parametrize("scale", SCALES)
def test_gradients_match_the_torch_path(scale):
    """Against the PyTorch path in float32 (the same representable range: beyond ~1e20 some
    gradient terms underflow float32 on both paths alike). dtemp to 2e-2: the chunked kernel's
    backward is that far from the PyTorch path for large dots even unscaled (|w| ~ 1e8-1e9)."""
    w, temp, keep = _inputs(scale, torch.float32, seed=1, spread=0.1)
    g = torch.Generator().manual_seed(2)
    g_out = torch.randn(w.shape, generator=g)
    for kernel, ref in ((tssa_triton, lambda *a: tssa_parallel(*a)),
                        (lambda w_, t_, m_: causal_tssa_triton(w_, t_, None, m_),
                         lambda w_, t_, m_: causal_tssa_parallel(w_, t_, None, m_))):
        grads = []
        for fn in (kernel, ref):
            w_, t_ = w.clone().requires_grad_(), temp.clone().requires_grad_()
            grads.append(torch.autograd.grad((fn(w_, t_, keep)[0] * g_out).sum(), (w_, t_)))
        _close(grads[0][0], grads[1][0], 1e-4, "dw")
        _close(grads[0][1], grads[1][1], 2e-2, "dtemp")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scale", [1.0] + SCALES)
def test_steps_continue_the_chunked_kernel(dtype, scale):
    """Prefill with the chunked kernel, then steps through the fused step kernel: the outputs of
    the whole sequence (float64 reference), the states' scales equal the PyTorch path's."""
    w, temp, _ = _inputs(scale, dtype, seed=3)
    ref = causal_tssa_parallel(w.double(), temp.double())[0]
    head, _, *sums, k = causal_tssa_triton(w[:, :, :3], temp)
    outs = [head]
    for t in range(3, w.shape[2]):
        o, _, *sums, k = causal_tssa_step_triton(w[:, :, t], *sums, temp, None, k)
        outs.append(o.unsqueeze(2))
    _close(torch.cat(outs, dim=2), ref, 4 * TOL[dtype], "prefill + steps")
    assert (k.double() == causal_tssa_parallel(w.double(), temp.double())[-1]).all()
