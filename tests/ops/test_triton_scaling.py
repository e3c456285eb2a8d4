"""Scale-safe Triton kernels (run through Triton's interpreter on CPU): ``tssa``, ``causal_tssa``
and the causal step divide ``w`` by a power of two (per sequence, head and feature for ``tssa``,
per sequence and head for the causal kernels) and keep a ``1 / c`` term in the gain, so that any
finite ``w`` up to float32's range gives finite outputs, states and gradients equal to the
PyTorch path's; one huge feature leaves tssa's other features exact (float64 reference)."""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'whiteformer[triton]')")

from whiteformer import ops  # noqa: E402
from whiteformer.ops._kernels import ENV_BACKEND, fused  # noqa: E402
from whiteformer.ops._kernels.triton import _tiles  # noqa: E402
from whiteformer.ops._kernels.triton.causal_tssa import causal_tssa_triton  # noqa: E402
from whiteformer.ops._kernels.triton.causal_tssa_step import causal_tssa_step_triton  # noqa: E402
from whiteformer.ops._kernels.triton.tssa import tssa_triton  # noqa: E402
from whiteformer.ops.causal_tssa.parallel import causal_tssa_parallel  # noqa: E402
from whiteformer.ops.reference import tssa_reference  # noqa: E402
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
        assert (k.double() == ref_k.amax(-1)).all()  # one scale per head; the PyTorch path's per feature
        units = (k.double().unsqueeze(-1) ** 2, 1.0, k.double().unsqueeze(-1) ** 2)
        ref_units = (ref_k ** 2, 1.0, ref_k ** 2)
        for a, r, u, ru in zip(sums, ref_sums, units, ref_units):
            _close(a.double() * u, r * ru, tol, "causal final sums (in w's units)")


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
    assert (k.double() == causal_tssa_parallel(w.double(), temp.double())[-1].amax(-1)).all()


def _huge_feature(dtype, shape=(1, 3, 9, 4), seed=5):
    """Ordinary w (B, H, N, p) but for one feature of one head holding 1e30 at its last token, the
    temperature and a float64 dL/dout."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g, dtype=torch.float64)
    w[0, 1, -1, 0] = 1e30
    return w.to(dtype), torch.rand(shape[1], 1, generator=g) + 0.5, torch.randn(*shape, generator=g, dtype=torch.float64)


def _close_per_feature(got, ref, tol, what):
    """Finite, and within ``tol`` of ``ref`` relative to its largest |entry| over the tokens per
    (sequence, head, feature): an ordinary feature beside a huge one is held to its own size (up
    to a few smallest normal numbers: the huge feature's dL/dw ~ 1e-60 is 0 or ~1e-38 there)."""
    got, ref = got.detach().double(), ref.detach().double()
    assert torch.isfinite(got).all(), f"{what}: {(~torch.isfinite(got)).sum().item()} entries not finite"
    norm = ref.abs().amax(dim=-2, keepdim=True).clamp_min(1e-300)
    err = ((got - ref).abs() - 4 * torch.finfo(torch.float32).tiny).clamp_min(0) / norm
    assert err.max().item() <= tol, f"{what}: max error {err.max().item():.2e} relative to the feature's largest |ref|"


def _against_reference(fn, ref, w, temp, g_out, tol, what):
    """Output, dL/dw and dL/dtemp of ``fn`` (w in its dtype) against ``ref`` in float64."""
    w_, t_ = w.clone().requires_grad_(), temp.clone().requires_grad_()
    out = fn(w_, t_)
    grads = torch.autograd.grad((out.double() * g_out).sum(), (w_, t_))
    w64, t64 = w.double().requires_grad_(), temp.double().requires_grad_()
    ref_out = ref(w64, t64)
    ref_grads = torch.autograd.grad((ref_out * g_out).sum(), (w64, t64))
    _close_per_feature(out, ref_out, tol, f"{what} out")
    _close_per_feature(grads[0], ref_grads[0], 10 * tol, f"{what} dw")
    _close(grads[1], ref_grads[1], 10 * tol, f"{what} dtemp")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_one_huge_feature_leaves_the_others_exact(dtype, masked):
    """One feature of a head at 1e30, the others O(1): with one scale per head the others' squares
    underflowed to 0 once divided by it, and their gains 1 / (1 + dots) were wrong (relative error
    ~1.9); with a scale per feature, tssa's output and gradients match the float64 reference."""
    w, temp, g_out = _huge_feature(dtype)
    keep = None
    if masked:
        keep = torch.ones(1, 9, dtype=torch.bool)
        keep[0, 3] = False
    _against_reference(lambda w_, t_: tssa_triton(w_, t_, keep)[0], lambda w_, t_: tssa_reference(w_, t_, keep),
                       w, temp, g_out, 4 * TOL[dtype], "tssa")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_huge_feature_in_a_packed_row(monkeypatch, dtype):
    """The public op on a packed row (``cu_seqlens``, the kernels' padded layout): a document with
    one huge feature beside an ordinary one, each matching its own float64 reference. The kernel
    takes every row, as on a GPU (on CPU tensors, rows past 2^32 go to the PyTorch path)."""
    monkeypatch.setenv(ENV_BACKEND, "triton")
    monkeypatch.setattr(fused, "rows_beyond_kernel_range", lambda w: None)
    w, temp, g_out = _huge_feature(dtype, shape=(1, 3, 11, 4))
    lens = (6, 5)
    cu = torch.tensor([0, 6, 11], dtype=torch.int32)

    def per_document(w_, t_):
        return torch.cat([tssa_reference(d, t_) for d in w_.split(lens, dim=2)], dim=2)

    _against_reference(lambda w_, t_: ops.tssa(w_, t_, cu_seqlens=cu), per_document, w, temp, g_out,
                       4 * TOL[dtype], "packed tssa")
