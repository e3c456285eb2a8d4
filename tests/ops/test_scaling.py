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
