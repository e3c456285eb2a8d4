"""The fused C++ causal TSSA kernel's float32 gradient is as accurate as the PyTorch path's on
many random short rows (1-8 real tokens, magnitudes 1e-3 to 1e3), where a token's own ratio
w^2 / E dominates: both against the float64 reference."""
import pytest
import torch

from whiteformer.ops import causal_tssa
from whiteformer.ops._kernels import ENV_BACKEND

ROWS = 400  # per configuration; 4 configurations


@pytest.fixture
def cpp_kernel():
    from whiteformer.ops._kernels.build import fast_path_available

    if not fast_path_available():
        pytest.skip("C++ kernel not built on this machine")


def _rows(h, p, seed, n=8):
    """w (ROWS, h, n, p) with one magnitude per row, right padding leaving 1..n real tokens."""
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** (torch.rand(ROWS, 1, 1, 1, generator=g, dtype=torch.float64) * 6 - 3)
    w = (torch.randn(ROWS, h, n, p, generator=g, dtype=torch.float64) * mag).float()
    lengths = torch.randint(1, n + 1, (ROWS, 1), generator=g)
    keep = torch.arange(n)[None, :] < lengths
    temp = torch.rand(h, 1, generator=g) + 0.5
    g_out = torch.randn(ROWS, h, n, p, generator=g)
    g_pi = torch.randn(ROWS, h, n, generator=g)
    return w, keep, temp, g_out, g_pi


def _row_errors(monkeypatch, backend, w, keep, temp, g_out, g_pi):
    """Per row: max |dw - dw64| / max |dw64| (dw of <out, g_out> + <pi, g_pi>)."""
    w64 = w.double().requires_grad_()
    out, pi = causal_tssa(w64, temp.double(), attn_mask=keep, return_pi=True)
    ref, = torch.autograd.grad((out * g_out.double()).sum() + (pi * g_pi.double()).sum(), w64)
    monkeypatch.setenv(ENV_BACKEND, backend)
    w32 = w.clone().requires_grad_()
    out, pi = causal_tssa(w32, temp, attn_mask=keep, return_pi=True)
    got, = torch.autograd.grad((out * g_out).sum() + (pi * g_pi).sum(), w32)
    dims = (1, 2, 3)
    return (got.double() - ref).abs().amax(dim=dims) / ref.abs().amax(dim=dims).clamp_min(1e-300)


@pytest.mark.parametrize("h, p, seed", [(1, 1, 0), (2, 3, 1), (3, 5, 2), (4, 8, 3)])
def test_cpp_gradient_on_short_rows_matches_the_torch_paths_error(cpp_kernel, monkeypatch, h, p, seed):
    args = _rows(h, p, seed)
    cpp = _row_errors(monkeypatch, "cpu", *args)
    torch_path = _row_errors(monkeypatch, "torch", *args)
    assert torch_path.max() < 2e-5  # the PyTorch path's float32 error on these rows
    assert cpp.max() <= max(2 * torch_path.max().item(), 1e-5), (
        f"worst C++ row error {cpp.max().item():.2e} (row {int(cpp.argmax())}) vs the PyTorch path's "
        f"{torch_path.max().item():.2e}")
