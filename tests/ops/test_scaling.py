"""Scale-safe TSSA: inputs anywhere in the dtype's finite range give finite outputs matching
float64, on the PyTorch path and with the C++ kernel (large inputs take the rescaled path), for
``tssa``, ``causal_tssa`` (masked and packed too) and the first ``causal_tssa_step``."""
import pytest
import torch

from kernel_backends import use_backend
from whiteformer.ops import causal_tssa, causal_tssa_step, tssa
from whiteformer.ops._kernels import ENV_BACKEND
from whiteformer.ops.reference import causal_tssa_reference, tssa_reference
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
def test_kernel_hands_rows_past_its_range_to_the_fallback(cpu_kernel, monkeypatch, mode):
    """The C++ kernels flag each batch row holding a |w| above SAFE_MAX, from the sums of squares they
    form (a padded token's value takes no part). Only those rows run the
    rescaled fallback; every other row keeps the kernel's own result, exactly as if run alone."""
    from whiteformer.ops._kernels import fused
    from whiteformer.ops.causal_tssa.parallel import causal_tssa_parallel
    from whiteformer.ops.tssa.parallel import tssa_parallel

    monkeypatch.setattr(fused, "CAUSAL_MODE", mode)
    monkeypatch.setattr(fused, "CHUNK", 4)
    g = torch.Generator().manual_seed(0)
    temp = torch.rand(3, 1, generator=g) + 0.5
    keep = torch.ones(4, 9, dtype=torch.bool)
    keep[3, 6:] = False
    w = torch.randn(4, 3, 9, 4, generator=g)
    w[0] *= 4.0 * SAFE_MAX
    w[1, 2, 5, 3] = -SAFE_MAX / 2  # within the kernels' range
    w[2] *= 1e30
    w[3, 1, 7, 2] = 1e30  # at a padded token
    past = [0, 2]
    ops = {"tssa": lambda x, t, m, fb=None: fused.tssa_fused(x, t, m, fallback=fb),
           "causal_tssa": lambda x, t, m, fb=None: fused.causal_tssa_fused(x, t, None, m, fallback=fb)}
    fallbacks = {"tssa": tssa_parallel, "causal_tssa": causal_tssa_parallel}
    for name, run in ops.items():
        rows = []
        got = run(w, temp, keep, lambda x, *args: rows.append(x.shape[0]) or fallbacks[name](x, *args))
        assert rows == [len(past)], name
        ref = run(w.double(), temp.double(), keep, fallbacks[name])
        for b in range(4):
            if b in past:
                _close(got[0][b], ref[0][b], torch.float32)
            else:
                alone = run(w[b:b + 1], temp, keep[b:b + 1])
                for g_out, a_out in zip(got, alone):
                    assert torch.equal(g_out[b], a_out[0]), (name, b)
        # gradients: each row's own, through the kernel or the fallback
        x = w.clone().requires_grad_()
        (grad,) = torch.autograd.grad(run(x, temp, keep, fallbacks[name])[0].sum(), x)
        assert torch.isfinite(grad).all(), name
        for b in range(4):
            x = w[b:b + 1].clone().requires_grad_()
            (alone,) = torch.autograd.grad(run(x, temp, keep[b:b + 1], fallbacks[name])[0].sum(), x)
            torch.testing.assert_close(grad[b], alone[0], msg=f"{name}, row {b}")


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


@pytest.mark.parametrize("name", ["cpu", "triton"])
def test_only_rows_past_the_range_leave_the_kernel(name, monkeypatch):
    """A batch row past SAFE_MAX takes the rescaled PyTorch path; every other row keeps the kernel's
    result, exactly as if run alone (a C++ kernel flags the rows itself, a registered backend's kernel
    is checked per row before the call)."""
    use_backend(name, monkeypatch)
    g = torch.Generator().manual_seed(3)
    w, temp = torch.randn(3, 3, 9, 4, generator=g), torch.rand(3, 1, generator=g) + 0.5
    bias = 0.1 * torch.randn(3, 16, 1, generator=g)
    w[1] *= 1e30
    for op, args in ((tssa, ()), (causal_tssa, (bias,))):
        out = op(w, temp, *args)
        for b in (0, 2):
            assert torch.equal(out[b], op(w[b:b + 1], temp, *args)[0]), (op.__name__, b)
        _close(out[1], op(w[1:2].double(), temp.double(), *(a.double() for a in args))[0], torch.float32)


# ------------------------------------------------------------------- one huge feature beside ordinary ones
def _one_huge_feature(dtype, token, b=1):
    """w (b, 3, 9, 4) of ordinary values (randn) but for one entry of 1e30 (head 1, token ``token``,
    feature 0): the scale belongs to that feature alone; temp (3, 1)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(b, 3, 9, 4, generator=g)
    w[0, 1, token, 0] = 1e30
    return w.to(dtype), torch.ones(3, 1)


def _close_columns(out, ref, dtype, what, dims=(-2,)):
    """Finite, and within ``dtype``'s error of ``ref`` relative to each (row, head, feature)
    column's largest |ref| over the tokens (a column of 1e-30 is checked as closely as one of 1);
    ``dims=(-2, -1)``: relative to each (row, head)'s largest |ref| (for gradients, whose huge
    column holds values below float32's range and float32's rounding of sums of terms ~1e-30)."""
    assert torch.isfinite(out).all(), what
    norm = ref.abs().amax(dim=dims, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    err = ((out.double() - ref) / norm).abs().max().item()
    assert err <= 4 * TOL[dtype]["rtol"], f"{what}: error {err:.2e} of the column's largest |result|"


HEAD = (-2, -1)


def _forward_and_grads(op, w, temp, **kw):
    """op's output and the gradient of w for a fixed random upstream gradient."""
    w = w.detach().requires_grad_()
    out = op(w, temp, **kw)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (grad,) = torch.autograd.grad((out.double() * g).sum(), w)
    return out.detach(), grad


# ops and the token of the huge entry (causal_tssa: test_causal_huge_feature_anywhere_matches_float64)
HUGE = [(tssa, tssa_reference, 8), (tssa, tssa_reference, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op,ref,token", HUGE, ids=["tssa-last", "tssa-mid"])
def test_one_huge_feature_matches_float64(backend, dtype, op, ref, token):
    """One feature holding 1e30 beside ordinary ones: each feature has its own scale, so the ordinary
    features keep their squares (one scale per head underflowed them to 0: error ~2 of the result).
    Forward and gradients against the float64 reference, plain, padded and packed."""
    w, temp = _one_huge_feature(dtype, token, b=2)
    w64, t64 = w.double(), temp.double()
    for kw, what in (({}, "plain"),):
        out, grad = _forward_and_grads(op, w, temp, **kw)
        out64, grad64 = _forward_and_grads(ref, w64, t64, **kw)
        _close_columns(out, out64, dtype, f"{what} forward")
        _close_columns(grad, grad64, dtype, f"{what} gradient", HEAD)
    keep = torch.tensor([[False] * token + [True] * (9 - token), [True] * 6 + [False] * 3])
    real = keep[:, None, :, None].expand(2, 3, 9, 4)
    out, grad = _forward_and_grads(op, w, temp, attn_mask=keep)
    out64, grad64 = _forward_and_grads(ref, w64, t64, attn_mask=keep)
    _close_columns(out.masked_fill(~real, 0), out64, dtype, "masked forward")
    _close_columns(grad.masked_fill(~real, 0), grad64.masked_fill(~real, 0), dtype, "masked gradient", HEAD)
    cu = torch.tensor([0, token, 9], dtype=torch.int32)  # the huge entry at the start of the 2nd document
    out, grad = _forward_and_grads(op, w[:1], temp, cu_seqlens=cu)
    out64, grad64 = _forward_and_grads(ref, w64[:1], t64, cu_seqlens=cu)
    _close_columns(out, out64, dtype, "packed forward")
    _close_columns(grad, grad64, dtype, "packed gradient", HEAD)


PREFIX_LIMIT = ("the PyTorch path of causal_tssa scales each feature over all its tokens in float32: tokens "
                "before a far (> 2^63x) larger one in their feature underflow in its units")


def _prefix_limited(request, backend, dtype, token):
    """Strict xfail where the huge entry follows ordinary tokens on a PyTorch path: the torch backend,
    and bfloat16, which the C++ kernel does not take (exact there: the rows it flags run in float64)."""
    if token > 0 and (backend == "torch" or dtype != torch.float32):
        request.applymarker(pytest.mark.xfail(strict=True, reason=PREFIX_LIMIT))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("token", [0, 4, 8], ids=["first", "mid", "last"])
def test_causal_huge_feature_anywhere_matches_float64(request, backend, dtype, token):
    """causal_tssa with one feature of one head holding 1e30 at the first, a middle or the last token
    (row 0; row 1 ordinary, so the C++ kernel keeps it and hands row 0 to its float64 fallback): forward
    and gradients against the float64 reference, plain, masked (a padded token before the huge one) and
    packed (the huge entry in the 2nd document, after one of its tokens when in the middle)."""
    _prefix_limited(request, backend, dtype, token)
    w, temp = _one_huge_feature(dtype, token, b=2)
    w64, t64 = w.double(), temp.double()
    out, grad = _forward_and_grads(causal_tssa, w, temp)
    out64, grad64 = _forward_and_grads(causal_tssa_reference, w64, t64)
    _close_columns(out, out64, dtype, "plain forward")
    _close_columns(grad, grad64, dtype, "plain gradient", HEAD)
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[0, 1 if token != 1 else 2] = False
    keep[1, 6:] = False
    real = keep[:, None, :, None].expand(2, 3, 9, 4)
    out, grad = _forward_and_grads(causal_tssa, w, temp, attn_mask=keep)
    out64, grad64 = _forward_and_grads(causal_tssa_reference, w64, t64, attn_mask=keep)
    _close_columns(out.masked_fill(~real, 0), out64, dtype, "masked forward")
    _close_columns(grad.masked_fill(~real, 0), grad64.masked_fill(~real, 0), dtype, "masked gradient", HEAD)
    cu = torch.tensor([0, 3, 9], dtype=torch.int32)
    out, grad = _forward_and_grads(causal_tssa, w[:1], temp, cu_seqlens=cu)
    out64, grad64 = _forward_and_grads(causal_tssa_reference, w64[:1], t64, cu_seqlens=cu)
    _close_columns(out, out64, dtype, "packed forward")
    _close_columns(grad, grad64, dtype, "packed gradient", HEAD)


@pytest.mark.parametrize("token", [0, 4, 8], ids=["first", "mid", "last"])
def test_causal_huge_feature_temp_and_pos_bias_gradients(request, backend, token):
    """The gradients of temp and pos_bias through the rows with the huge entry, against the float64
    reference."""
    _prefix_limited(request, backend, torch.float32, token)
    w, _ = _one_huge_feature(torch.float32, token, b=2)
    g = torch.Generator().manual_seed(2)
    temp, pos_bias = torch.rand(3, 1, generator=g) + 0.5, 0.1 * torch.randn(3, 16, 1, generator=g)

    def grads(op, dtype):
        t, pb = temp.to(dtype).requires_grad_(), pos_bias.to(dtype).requires_grad_()
        out = op(w.to(dtype), t, pb)
        up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        return torch.autograd.grad((out.double() * up).sum(), (t, pb))

    for got, ref, what in zip(grads(causal_tssa, torch.float32), grads(causal_tssa_reference, torch.float64),
                              ("temp", "pos_bias")):
        _close_columns(got, ref, torch.float32, f"{what} gradient", (-2, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("token", [0, 4, 5], ids=["first", "mid", "last"])
def test_causal_prefill_with_huge_feature_then_steps(request, backend, dtype, token):
    """A prefill of 6 tokens holding the huge entry (at its first, a middle or its last token), then 3
    steps from its state: every output against the float64 reference on the 9 tokens, and the state
    in float32 with a power-of-two scale per feature (B, H, p)."""
    _prefix_limited(request, backend, dtype, token)
    w, temp = _one_huge_feature(dtype, token, b=2)
    out, state = causal_tssa(w[:, :, :6], temp, return_state=True)
    assert state.scale.shape == (2, 3, 4) and state.sum_sq.dtype == torch.float32
    assert torch.isfinite(state.sum_sq).all() and torch.isfinite(state.sum_sq_pi).all()
    assert (state.scale == torch.exp2(torch.log2(state.scale).round())).all()
    outs = [out]
    for t in range(6, 9):
        out_t, state = causal_tssa_step(w[:, :, t], state, temp)
        outs.append(out_t.unsqueeze(-2))
    ref = causal_tssa_reference(w.double(), temp.double())
    _close_columns(torch.cat(outs, dim=-2), ref, dtype, "prefill + steps")


def test_scale_is_per_feature():
    """feature_scale and document_scale: a power of two per feature over the tokens (per document),
    1 for the ordinary features beside a huge one."""
    from whiteformer.ops.layout import segments
    from whiteformer.ops.scaling import document_scale, feature_scale

    w, _ = _one_huge_feature(torch.float32, 8)
    c = feature_scale(w)
    assert c.shape == (1, 3, 1, 4)
    assert c[0, :, 0].tolist() == [[1.0] * 4, [2.0 ** 99, 1.0, 1.0, 1.0], [1.0] * 4]
    cu = torch.tensor([0, 8, 9], dtype=torch.int32)
    d = document_scale(w[0], segments(cu, [8, 1], w.device))
    assert d.shape == (3, 2, 4)
    assert (d[:, 0] == 1).all() and d[1, 1].tolist() == [2.0 ** 99, 1.0, 1.0, 1.0] and (d[[0, 2], 1] == 1).all()
