"""Scale-safe TSSA: inputs anywhere in the dtype's finite range give finite outputs matching
float64, on the PyTorch path and with the C++ kernel (large inputs take the rescaled path), for
``tssa``, ``causal_tssa`` (masked and packed too) and the first ``causal_tssa_step``."""
import pytest
import torch

from whiteformer.ops import causal_tssa, causal_tssa_step, tssa
from whiteformer.ops._kernels import ENV_BACKEND
from whiteformer.ops.scaling import SAFE_MAX, head_scale

SCALES = [1e19, 1e30, 3e38 / 4]  # |w| up to 4x the scale (randn): w^2 overflows float32 from ~1.8e19
TOL = {torch.float32: dict(rtol=1e-5, atol=0), torch.bfloat16: dict(rtol=2e-2, atol=0)}


@pytest.fixture(params=["torch", "cpu"])
def backend(request, monkeypatch):
    if request.param == "cpu":
        from whiteformer.ops._kernels.build import fast_path_available

        if not fast_path_available():
            pytest.skip("C++ kernel not built on this machine")
    monkeypatch.setenv(ENV_BACKEND, request.param)
    return request.param


def _close(out, ref, dtype):
    assert torch.isfinite(out).all()
    scale = ref.abs().max()
    torch.testing.assert_close(out.double() / scale, ref / scale, rtol=0, atol=TOL[dtype]["rtol"] * 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", SCALES)
def test_large_inputs_match_float64(backend, dtype, scale):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(2, 3, 9, 4, generator=g) * scale).clamp(-3e38, 3e38).to(dtype)
    temp = torch.rand(3, 1, generator=g) + 0.5
    keep = torch.tensor([[True] * 9, [True] * 5 + [False] * 4])
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    w64, t64 = w.double(), temp.double()
    for op in (tssa, causal_tssa):
        _close(op(w, temp), op(w64, t64), dtype)
        real = keep[:, None, :, None].expand(2, 3, 9, 4)
        _close(op(w, temp, attn_mask=keep)[real], op(w64, t64, attn_mask=keep)[real], dtype)
        _close(op(w[:1], temp, cu_seqlens=cu), op(w64[:1], t64, cu_seqlens=cu), dtype)
    out, state = causal_tssa_step(w[:, :, 0], None, temp)
    _close(out, causal_tssa(w64[:, :, :1], t64)[:, :, 0], dtype)


def test_large_inputs_have_finite_gradients(backend):
    w = (torch.randn(2, 3, 9, 4) * 1e30).requires_grad_()
    for op in (tssa, causal_tssa):
        op(w, torch.ones(3, 1)).sum().backward()
        assert torch.isfinite(w.grad).all()
        w.grad = None


def test_ordinary_inputs_are_not_rescaled():
    """Up to SAFE_MAX the scale is exactly 1 (the formula unchanged); above it a power of two."""
    x = torch.tensor([[[[SAFE_MAX, -1.0]]], [[[3.0 * SAFE_MAX, 0.5]]]])
    c = head_scale(x, 2)
    assert c.flatten().tolist() == [1.0, 2.0 * SAFE_MAX]


@pytest.fixture
def cpu_kernel(monkeypatch):
    from whiteformer.ops._kernels.build import fast_path_available

    if not fast_path_available():
        pytest.skip("C++ kernel not built on this machine")
    monkeypatch.setenv(ENV_BACKEND, "cpu")


@pytest.mark.parametrize("mode", [0, 1])  # the causal kernel's two schedules
def test_kernel_signals_inputs_past_its_range(cpu_kernel, monkeypatch, mode):
    """The C++ kernels flag an input whose |w| exceeds SAFE_MAX from the sums of squares they form
    (a padded token's value takes no part); up to SAFE_MAX they run."""
    from whiteformer.ops._kernels import fused

    monkeypatch.setattr(fused, "CAUSAL_MODE", mode)
    monkeypatch.setattr(fused, "CHUNK", 4)
    g = torch.Generator().manual_seed(0)
    temp = torch.rand(3, 1, generator=g) + 0.5
    for at in [(0, 0, 0, 0), (1, 2, 5, 3), (1, 1, 8, 0)]:
        w = torch.randn(2, 3, 9, 4, generator=g)
        w[at] = 2.0 * SAFE_MAX
        assert fused.tssa_fused(w, temp, in_range_only=True) is None
        assert fused.causal_tssa_fused(w, temp, in_range_only=True) is None
        w[at] = -SAFE_MAX  # the largest |w| the kernels take
        assert fused.tssa_fused(w, temp, in_range_only=True) is not None
        assert fused.causal_tssa_fused(w, temp, in_range_only=True) is not None
        keep = torch.ones(2, 9, dtype=torch.bool)
        keep[at[0], at[2]] = False
        w[at] = 1e30  # at a padded token
        out, pi = fused.tssa_fused(w, temp, keep, in_range_only=True)
        torch.testing.assert_close(out, tssa(w.double(), temp.double(), attn_mask=keep).float())
        out, *_ = fused.causal_tssa_fused(w, temp, None, keep, in_range_only=True)
        torch.testing.assert_close(out, causal_tssa(w.double(), temp.double(), attn_mask=keep).float())


def test_ordinary_inputs_make_no_range_pass(cpu_kernel, monkeypatch):
    """On the C++ kernels an ordinary input is not scanned for its largest |w| before the call (the
    kernel signals large ones itself); a large one still takes the rescaled path, and is finite."""
    import whiteformer.ops.scaling as scaling

    scans = []
    max_abs = scaling._max_abs
    monkeypatch.setattr(scaling, "_max_abs", lambda x, trailing: scans.append(x.shape) or max_abs(x, trailing))
    w, temp = torch.randn(2, 3, 9, 4), torch.ones(3, 1)
    keep = torch.tensor([[True] * 9, [True] * 5 + [False] * 4])
    for op in (tssa, causal_tssa):
        op(w, temp)
        op(w, temp, attn_mask=keep)
    assert scans == []
    for op in (tssa, causal_tssa):
        assert torch.isfinite(op(w * 1e30, temp)).all()
    assert scans
