"""Fused TSSA / causal TSSA kernels: forward and hand-derived gradients
against the references (float64 tight, float32 within 1e-5), gradcheck, strides, the dispatcher
(kernel used when available; torch path for other dtypes, devices, dropout, the environment
variable), torch.compile and the memory kept for backward."""

import warnings

import pytest
import torch

from whiteformer.attention import TSSA, CausalTSSA
from whiteformer.ops import causal_tssa, tssa
from whiteformer.ops._kernels import ENV_DISABLE, fused, fused_supported, kernels_disabled
from whiteformer.ops._kernels import build as kcpu

# the dispatcher modules
from whiteformer.ops.causal_tssa import dispatch as causal_mod  # noqa: E402
from whiteformer.ops.reference import causal_tssa_reference, tssa_reference
from whiteformer.ops.tssa import dispatch as tssa_mod  # noqa: E402


@pytest.fixture(scope="module")
def kernel():
    """The compiled extension (built once per machine, ~1 min); skips where it cannot be built."""
    if kcpu.load_extension() is None:
        pytest.skip(f"fused TSSA kernel unavailable (no C++ compiler / ninja?): {kcpu.build_error()}")
    return kcpu.load_extension()


@pytest.fixture(autouse=True)
def _kernels_enabled(monkeypatch):
    monkeypatch.delenv(ENV_DISABLE, raising=False)
    monkeypatch.setattr(fused, "CHUNK", 0)
    monkeypatch.setattr(fused, "CAUSAL_MODE", -1)


def _inputs(shape, dtype, grad=True, scale=1.0):
    w = (torch.randn(*shape, dtype=dtype) * scale).requires_grad_(grad)
    temp = (torch.rand(shape[1], 1, dtype=dtype) * 0.5 + 0.5).requires_grad_(grad)
    return w, temp


def _mask(b, n):
    m = torch.rand(b, n) > 0.3
    m[:, 0] = True
    m[0] = True
    return m


def _pos_logit_bias(bias, mask, n, p):
    """The logit bias the dispatcher passes: p * pos_bias at each real token's position."""
    if mask is None:
        return p * bias[:, :n, 0]
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    return p * bias[:, pos, 0].transpose(0, 1)


def _fused_and_ref(kind, w, temp, mask, bias=None):
    if kind == "tssa":
        return fused.tssa_fused(w, temp, mask), tssa_reference(w, temp, mask, return_pi=True)
    lb = None if bias is None else _pos_logit_bias(bias, mask, w.shape[2], w.shape[3])
    out, pi, *_ = fused.causal_tssa_fused(w, temp, lb, mask)
    return (out, pi), causal_tssa_reference(w, temp, bias, mask, return_pi=True)


def _grads(outs, params, g_out, g_pi):
    out, pi = outs
    return torch.autograd.grad((out * g_out).sum() + (pi * g_pi).sum(), params)


# shapes: N = 1, H = 1, p = 1, the compile-time head dims (32, 48, 64) and generic ones
SHAPES = [(2, 3, 7, 5), (1, 4, 1, 3), (2, 1, 6, 1), (2, 2, 20, 32), (1, 3, 9, 48), (2, 2, 5, 64)]


@pytest.mark.parametrize("kind", ["tssa", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("chunk, mode", [(0, -1), (3, 0), (2, 1)])
def test_float64_forward_and_grads_match_reference(kernel, monkeypatch, kind, shape, masked, chunk, mode):
    monkeypatch.setattr(fused, "CHUNK", chunk)  # tiny chunks: several chunks / checkpoints
    monkeypatch.setattr(fused, "CAUSAL_MODE", mode)  # 0: two-stage pipeline, 1: one pass
    w, temp = _inputs(shape, torch.float64, scale=2.0)
    mask = _mask(shape[0], shape[2]) if masked else None
    bias = (torch.randn(shape[1], shape[2] + 2, 1, dtype=torch.float64) * 0.3).requires_grad_(True)
    params = (w, temp) if kind == "tssa" else (w, temp, bias)
    g_out, g_pi = torch.randn(shape, dtype=torch.float64), torch.randn(shape[:3], dtype=torch.float64)
    got, ref = _fused_and_ref(kind, w, temp, mask, bias)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for a, b in zip(_grads(got, params, g_out, g_pi), _grads(ref, params, g_out, g_pi)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def _assert_rel(a, b, tol=1e-5):
    """max |a - b| <= tol * max |b| (relative to the tensor's scale)."""
    err = (a.double() - b.double()).abs().max().item()
    scale = b.double().abs().max().item()
    assert err <= tol * scale, f"relative error {err / scale:.2e} > {tol:.0e}"


@pytest.mark.parametrize("kind", ["tssa", "causal"])
@pytest.mark.parametrize("shape, chunk", [((2, 8, 600, 48), 0), ((1, 4, 300, 64), 0), ((2, 3, 50, 7), 4)])
@pytest.mark.parametrize("masked", [False, True])
def test_float32_within_1e5_of_float64_reference(kernel, monkeypatch, kind, shape, chunk, masked):
    monkeypatch.setattr(fused, "CHUNK", chunk)
    w, temp = _inputs(shape, torch.float32)
    mask = _mask(shape[0], shape[2]) if masked else None
    bias = (torch.randn(shape[1], shape[2], 1) * 0.1).requires_grad_(True)
    params = (w, temp) if kind == "tssa" else (w, temp, bias)
    g_out, g_pi = torch.randn(shape), torch.randn(shape[:3])
    got, _ = _fused_and_ref(kind, w, temp, mask, bias)
    w64, t64, b64 = (p.detach().double().requires_grad_(True) for p in (w, temp, bias))
    _, ref = _fused_and_ref(kind, w64, t64, mask, b64)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    for a, b in zip(got, ref):
        _assert_rel(a, b)
    params64 = (w64, t64) if kind == "tssa" else (w64, t64, b64)
    for a, b in zip(_grads(got, params, g_out, g_pi), _grads(ref, params64, g_out.double(), g_pi.double())):
        _assert_rel(a, b)


def test_gradcheck(kernel, monkeypatch):
    monkeypatch.setattr(fused, "CHUNK", 2)
    w, temp = _inputs((2, 3, 5, 4), torch.float64)
    mask = torch.tensor([[True] * 5, [False, True, True, False, True]])
    assert torch.autograd.gradcheck(lambda w, t: fused.tssa_fused(w, t), (w, temp))
    assert torch.autograd.gradcheck(lambda w, t: fused.tssa_fused(w, t, mask), (w, temp))
    lb = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    for mode in (0, 1):
        monkeypatch.setattr(fused, "CAUSAL_MODE", mode)
        # all outputs, including the final running sums (the recurrent state)
        assert torch.autograd.gradcheck(lambda w, t, b: fused.causal_tssa_fused(w, t, b), (w, temp, lb))
        assert torch.autograd.gradcheck(lambda w, t, b: fused.causal_tssa_fused(w, t, b, mask), (w, temp, lb))


@pytest.mark.parametrize("threads", [1, 2])
def test_causal_chunk_parallel_schedule(kernel, monkeypatch, threads):
    """Mode 0 (chunks taken by whichever thread is free) gives the one-pass result, any thread count."""
    monkeypatch.setattr(fused, "CHUNK", 4)
    w, temp = _inputs((1, 3, 37, 5), torch.float64, grad=False)
    lb = torch.randn(1, 3, 37, dtype=torch.float64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        monkeypatch.setattr(fused, "CAUSAL_MODE", 0)
        chunked = fused.causal_tssa_fused(w, temp, lb)
        monkeypatch.setattr(fused, "CAUSAL_MODE", 1)
        one_pass = fused.causal_tssa_fused(w, temp, lb)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(chunked, one_pass):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("shape, dtype", [((2, 3, 37, 48), torch.float32), ((2, 3, 37, 5), torch.float64)])
@pytest.mark.parametrize("masked", [False, True])
def test_tssa_schedules_agree_bitwise(kernel, monkeypatch, shape, dtype, masked):
    """The non-causal forward and backward run row by row (B >= threads) or each pass over all
    (b, chunk) items in parallel (B < threads): both give the same bits for every batch row (the
    float32 p = 48 case takes the AVX-512 row code where built)."""
    monkeypatch.setattr(fused, "CHUNK", 8)
    w, temp = _inputs(shape, dtype)
    mask = _mask(shape[0], shape[2]) if masked else None
    g_out, g_pi = torch.randn(shape, dtype=dtype), torch.randn(shape[:3], dtype=dtype)

    def run(rows, threads):
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(threads)
            ws = w[rows].detach().requires_grad_(True)
            outs = fused.tssa_fused(ws, temp, None if mask is None else mask[rows])
            grads = torch.autograd.grad((outs[0] * g_out[rows]).sum() + (outs[1] * g_pi[rows]).sum(), (ws,))
        finally:
            torch.set_num_threads(before)
        return (*outs, *grads)

    by_row = run(slice(0, 2), 1)  # B 2 >= 1 thread: row by row
    for b in range(2):
        chunked = run(slice(b, b + 1), 2)  # B 1 < 2 threads: the passes over all items
        for x, y in zip(by_row, chunked):
            assert torch.equal(x[b:b + 1], y)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("masked", [False, True])
def test_causal_backward_schedules_agree(kernel, monkeypatch, threads, masked):
    """The backward's two schedules (mode 1: one reverse sweep per sequence carrying the sums over
    later tokens; mode 0: chunks swept in parallel from the chunk sums) give the same gradients of
    every output, the final state included, at any thread count."""
    monkeypatch.setattr(fused, "CHUNK", 4)
    w, temp = _inputs((2, 3, 37, 5), torch.float64)
    lb = torch.randn(2, 3, 37, dtype=torch.float64, requires_grad=True)
    mask = _mask(2, 37) if masked else None
    outs = [torch.randn(s, dtype=torch.float64) for s in ((2, 3, 37, 5), (2, 3, 37), (2, 3, 5), (2, 3), (2, 3, 5))]
    grads = {}
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for mode in (0, 1):
            monkeypatch.setattr(fused, "CAUSAL_MODE", mode)
            res = fused.causal_tssa_fused(w, temp, lb, mask)[:5]
            loss = sum((r * g).sum() for r, g in zip(res, outs))
            grads[mode] = torch.autograd.grad(loss, (w, temp, lb))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(grads[0], grads[1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kind", ["tssa", "causal"])
@pytest.mark.parametrize("grad", [False, True])
def test_direct_call_matches_custom_op(kernel, monkeypatch, kind, grad):
    """An eager call runs the extension directly (no custom-op dispatch); the custom op that a traced
    graph runs gives the same outputs and gradients, bit for bit."""
    w, temp = _inputs((2, 3, 9, 48), torch.float32, grad=grad)
    mask = _mask(2, 9)
    lb = torch.randn(2, 3, 9, requires_grad=grad)
    g = [torch.randn(2, 3, 9, 48), torch.randn(2, 3, 9)]

    def run():
        outs = fused.tssa_fused(w, temp, mask) if kind == "tssa" else fused.causal_tssa_fused(w, temp, lb, mask)[:2]
        if not grad:
            return outs
        params = (w, temp) if kind == "tssa" else (w, temp, lb)
        return outs + torch.autograd.grad(sum((o * x).sum() for o, x in zip(outs, g)), params)

    direct = run()
    monkeypatch.setattr(fused, "_eager", lambda *t: False)
    for a, b in zip(direct, run()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["tssa", "causal"])
def test_large_outputs_match_torch_path(kernel, kind):
    """Outputs of 8 MB and more (a fresh block gets huge pages; a block already in memory, as on the
    second call, non-temporal stores, also forced below their usual size) hold the values of the
    PyTorch path, forward and backward."""
    from whiteformer.ops.causal_tssa.parallel import causal_tssa_parallel
    from whiteformer.ops.tssa.parallel import tssa_parallel

    w, temp = _inputs((1, 8, 6000, 48), torch.float32)
    g = torch.randn(w.shape)
    ref = tssa_parallel(w, temp, None)[0] if kind == "tssa" else causal_tssa_parallel(w, temp, None, None)[0]
    want = (ref, *torch.autograd.grad((ref * g).sum(), (w, temp)))
    try:
        for threshold in (-1, -1, 0):
            kernel.set_stream_min_bytes(threshold)
            out = fused.tssa_fused(w, temp)[0] if kind == "tssa" else fused.causal_tssa_fused(w, temp)[0]
            for a, b in zip((out, *torch.autograd.grad((out * g).sum(), (w, temp))), want):
                _assert_rel(a, b)
    finally:
        kernel.set_stream_min_bytes(-1)


def test_jit_trace_records_the_custom_op(kernel):
    """torch.jit.trace sees the custom op, not a direct call it could only record as a constant: the
    traced function follows a new input."""
    w, temp = _inputs((1, 2, 6, 4), torch.float32, grad=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the host read of the overflow flags
        traced = torch.jit.trace(lambda x: fused.tssa_fused(x, temp)[0], (w,), check_trace=False)
    assert "whiteformer::tssa_fused_fwd" in str(traced.graph)
    w2 = torch.randn_like(w)
    torch.testing.assert_close(traced(w2), fused.tssa_fused(w2, temp)[0])


def test_cpu_custom_ops_pass_opcheck(kernel):
    """Schemas, fake (meta) implementations and autograd registrations of the CPU custom ops agree
    with the kernel."""
    w = torch.randn(1, 2, 5, 3, dtype=torch.float64)
    temp = torch.rand(2, 1, dtype=torch.float64) + 0.5
    mask = torch.tensor([[True, False, True, True, True]])
    lb = torch.randn(1, 2, 5, dtype=torch.float64)
    tests = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(fused._tssa_fwd, (w, temp, mask, 2), test_utils=tests)
    for mode in (0, 1):
        torch.library.opcheck(fused._causal_fwd, (w, temp, lb, mask, mode, 2), test_utils=tests)


def test_double_backward(kernel):
    """create_graph=True (e.g. gradient penalties) recomputes differentiably: gradgradcheck."""
    w, temp = _inputs((2, 3, 4, 3), torch.float64)
    mask = torch.tensor([[True] * 4, [False, True, True, True]])
    lb = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda w, t: fused.tssa_fused(w, t, mask), (w, temp))
    assert torch.autograd.gradgradcheck(lambda w, t, b: fused.causal_tssa_fused(w, t, b, mask), (w, temp, lb))


def test_clamped_energies_match_reference(kernel):
    """Zero features (F.normalize's eps clamp) and leading zero tokens (causal 1e-12 clamp)."""
    w, temp = _inputs((1, 2, 6, 4), torch.float64)
    w = w.detach().clone()
    w[:, 0, :, 1] = 0.0  # a feature with no energy
    w[:, :, :2] = 0.0  # causal prefix energy 0 for the first tokens
    w.requires_grad_(True)
    bias = torch.zeros(2, 6, 1, dtype=torch.float64, requires_grad=True)
    g_out, g_pi = torch.randn(w.shape, dtype=torch.float64), torch.randn(w.shape[:3], dtype=torch.float64)
    for kind in ("tssa", "causal"):
        got, ref = _fused_and_ref(kind, w, temp, None, bias)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        for a, b in zip(_grads(got, (w, temp), g_out, g_pi), _grads(ref, (w, temp), g_out, g_pi)):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_causal_state_matches_torch_path(kernel, monkeypatch):
    w, temp = _inputs((2, 3, 11, 5), torch.float32, grad=False)
    bias = torch.randn(3, 16, 1) * 0.3
    mask = _mask(2, 11)
    out, pi, state = causal_tssa(w, temp, bias, mask, return_pi=True, return_state=True)
    monkeypatch.setenv(ENV_DISABLE, "1")
    out_t, pi_t, state_t = causal_tssa(w, temp, bias, mask, return_pi=True, return_state=True)
    torch.testing.assert_close(out, out_t, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pi, pi_t, rtol=1e-5, atol=1e-6)
    for a, b in zip(state[:3], state_t[:3]):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(state.t, state_t.t)


def test_causal_fallback_scale_is_per_feature(kernel):
    """The C++ causal kernel returns its sums' scale per feature (B, H, p): 1 on its own rows, the
    fallback's (one power of two per feature) on a row it hands over, here one feature of 1e30
    beside ordinary ones, whose rows and sums match the float64 PyTorch path."""
    from whiteformer.ops.causal_tssa.parallel import causal_tssa_parallel

    w, temp = _inputs((3, 3, 9, 4), torch.float32, grad=False)
    w[1, 1, 0, 0] = 1e30
    out, pi, sum_sq, sum_pi, sum_sq_pi, scale = fused.causal_tssa_fused(w, temp, fallback=causal_tssa_parallel)
    big = torch.zeros(3, 3, 4, dtype=torch.bool)
    big[1, 1, 0] = True
    ref = causal_tssa_parallel(w.double(), temp.double())
    norm = ref[0].abs().amax(dim=-2, keepdim=True)
    assert ((out.double() - ref[0]) / norm).abs().max() < 4e-5
    assert scale.shape == (3, 3, 4) and (scale[big] == 2.0 ** 99).all() and (scale[~big] == 1).all()
    for got, want in ((sum_sq, ref[2]), (sum_pi, ref[3]), (sum_sq_pi, ref[4])):
        torch.testing.assert_close(got.double() * (scale.double() ** 2 if got.dim() == 3 else 1),
                                   want * (ref[5] ** 2 if want.dim() == 3 else 1), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- strides


def test_strided_inputs(kernel):
    b, h, n, p = 2, 3, 10, 48
    x = torch.randn(b, n, h * p, dtype=torch.float64)
    w = x.view(b, n, h, p).transpose(1, 2)  # a layer's (B, N, H, p) view: used without a copy
    assert not w.is_contiguous() and w.stride(-1) == 1
    temp = torch.rand(h, 1, dtype=torch.float64) + 0.5
    out, _ = fused.tssa_fused(w, temp)
    assert out.stride() == w.stride()  # output in the same layout (the layer's merge is a view)
    torch.testing.assert_close(out, tssa_reference(w.contiguous(), temp), rtol=1e-10, atol=1e-12)
    out_c, _, *_ = fused.causal_tssa_fused(w, temp)
    torch.testing.assert_close(out_c, causal_tssa_reference(w.contiguous(), temp), rtol=1e-10, atol=1e-12)
    # features not contiguous (a transposed view): copied by the dispatcher
    wt = torch.randn(b, h, p, n, dtype=torch.float64).transpose(-1, -2)
    assert wt.stride(-1) != 1
    torch.testing.assert_close(tssa(wt, temp), tssa_reference(wt.contiguous(), temp), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(causal_tssa(wt, temp), causal_tssa_reference(wt.contiguous(), temp),
                               rtol=1e-10, atol=1e-12)
    # gradients through strided views and a non-contiguous upstream gradient
    wg = w.detach().requires_grad_(True)
    g = torch.randn(b, h, p, n, dtype=torch.float64).transpose(-1, -2)
    (gw,) = torch.autograd.grad((fused.tssa_fused(wg, temp)[0] * g).sum(), wg)
    w2 = w.detach().contiguous().requires_grad_(True)
    (gw_ref,) = torch.autograd.grad((tssa_reference(w2, temp) * g).sum(), w2)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("masked", [False, True])
def test_strided_float32_rows_within_1e5_of_float64_reference(kernel, masked):
    """A layer's (B, N, H, p) view of float32 rows with p = 48 (the AVX-512 row code where built;
    the heads of a token adjacent in memory, so the kernel visits BLK tokens at a time): forward and
    gradients (w, temp; through out and Pi) within 1e-5 of the float64 reference."""
    b, h, n, p = 2, 8, 70, 48
    w = torch.randn(b, n, h * p).view(b, n, h, p).transpose(1, 2).requires_grad_(True)
    temp = (torch.rand(h, 1) * 0.5 + 0.5).requires_grad_(True)
    mask = _mask(b, n) if masked else None
    g_out, g_pi = torch.randn(b, h, n, p), torch.randn(b, h, n)
    got = fused.tssa_fused(w, temp, mask)
    w64, t64 = (x.detach().double().requires_grad_(True) for x in (w, temp))
    ref = tssa_reference(w64, t64, mask, return_pi=True)
    for a, r in zip(got, ref):
        _assert_rel(a, r)
    for a, r in zip(_grads(got, (w, temp), g_out, g_pi), _grads(ref, (w64, t64), g_out.double(), g_pi.double())):
        _assert_rel(a, r)


@pytest.mark.parametrize("p", [32, 48, 64])
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("strided", [False, True])
def test_causal_float32_rows_within_1e5_of_float64(kernel, monkeypatch, p, mode, masked, strided):
    """Causal TSSA on float32 rows of 32 / 48 / 64 features (the AVX-512 row code where built), both
    backward schedules (mode 1: one reverse sweep per sequence; 0: chunks swept in parallel), chunks
    of 40 tokens (blocks of 16 cut at chunk ends) and N = 100 (a short last chunk), with a logit bias
    and padded tokens, in the (B, H, N, p) layout or a layer's (B, N, H, p) view: forward and
    gradients (w, temp, bias; through out, Pi and the final running sums) within 1e-5 of float64
    (the reference for out and Pi, the float64 kernel with the sums)."""
    monkeypatch.setattr(fused, "CHUNK", 40)
    monkeypatch.setattr(fused, "CAUSAL_MODE", mode)
    b, h, n = 2, 4, 100
    w, temp = _inputs((b, h, n, p), torch.float32)
    if strided:
        w = w.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)
    bias = (torch.randn(h, n, 1) * 0.1).requires_grad_(True)
    mask = _mask(b, n) if masked else None
    w64, t64, b64 = (x.detach().double().requires_grad_(True) for x in (w, temp, bias))
    got, _ = _fused_and_ref("causal", w, temp, mask, bias)
    _, ref = _fused_and_ref("causal", w64, t64, mask, b64)
    g_out, g_pi = torch.randn(b, h, n, p), torch.randn(b, h, n)
    for a, r in zip(got, ref):
        _assert_rel(a, r)
    for a, r in zip(_grads(got, (w, temp, bias), g_out, g_pi), _grads(ref, (w64, t64, b64), g_out.double(),
                                                                         g_pi.double())):
        _assert_rel(a, r)
    # through every output, the final running sums (the recurrent state) included
    lb, lb64 = (_pos_logit_bias(x, mask, n, p) for x in (bias, b64))
    res = fused.causal_tssa_fused(w, temp, lb, mask)[:5]
    res64 = fused.causal_tssa_fused(w64, t64, lb64, mask)[:5]
    outs = [torch.randn(r.shape, dtype=torch.float64) for r in res64]
    loss = sum((r * g.to(r.dtype)).sum() for r, g in zip(res, outs))
    loss64 = sum((r * g).sum() for r, g in zip(res64, outs))
    for a, r in zip(torch.autograd.grad(loss, (w, temp, bias)), torch.autograd.grad(loss64, (w64, t64, b64))):
        _assert_rel(a, r)


# ----------------------------------------------------------------------------- dispatch


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls the dispatchers make to the fused functions."""
    counter = {"tssa": 0, "causal": 0}

    def wrap(fn, key):
        def inner(*args, **kwargs):
            counter[key] += 1
            return fn(*args, **kwargs)
        return inner

    monkeypatch.setattr(tssa_mod, "tssa_fused", wrap(fused.tssa_fused, "tssa"))
    monkeypatch.setattr(causal_mod, "causal_tssa_fused", wrap(fused.causal_tssa_fused, "causal"))
    return counter


def test_dispatcher_uses_kernel_when_available(kernel, calls):
    for dtype in (torch.float32, torch.float64):
        w, temp = _inputs((2, 2, 6, 4), dtype, grad=False)
        assert fused_supported(w)
        torch.testing.assert_close(tssa(w, temp), tssa_reference(w, temp))
        torch.testing.assert_close(causal_tssa(w, temp), causal_tssa_reference(w, temp))
    assert calls == {"tssa": 2, "causal": 2}


def test_dispatcher_falls_back(kernel, calls, monkeypatch):
    w, temp = _inputs((2, 2, 6, 4), torch.float32, grad=False)
    # half precision, dropout in training: the torch path
    tssa(w.half(), temp)
    causal_tssa(w.bfloat16(), temp)
    tssa(w, temp, attn_drop=0.5, training=True)
    causal_tssa(w, temp, attn_drop=0.5, training=True)
    assert calls == {"tssa": 0, "causal": 0}
    # other devices never reach the CPU kernel
    assert not fused_supported(torch.empty(1, 1, 1, 1, device="meta"))
    # the environment variable
    monkeypatch.setenv(ENV_DISABLE, "1")
    assert kernels_disabled() and not fused_supported(w)
    torch.testing.assert_close(tssa(w, temp), tssa_reference(w, temp), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(causal_tssa(w, temp), causal_tssa_reference(w, temp), rtol=1e-5, atol=1e-6)
    assert calls == {"tssa": 0, "causal": 0}
    monkeypatch.setenv(ENV_DISABLE, "0")
    tssa(w, temp)
    assert calls["tssa"] == 1


def test_no_compiler_falls_back_to_torch_path(calls, monkeypatch):
    """Where the extension cannot be built (load_extension() gives None), the torch path runs."""
    monkeypatch.setattr(kcpu, "load_extension", lambda: None)
    assert not kcpu.fast_path_available()
    w, temp = _inputs((2, 2, 6, 4), torch.float32, grad=False)
    assert not fused_supported(w)
    torch.testing.assert_close(tssa(w, temp), tssa_reference(w, temp), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(causal_tssa(w, temp), causal_tssa_reference(w, temp), rtol=1e-5, atol=1e-6)
    assert calls == {"tssa": 0, "causal": 0}


def test_saved_for_backward_is_w_plus_small_stats(kernel):
    """Only w, Pi and O(B H p) statistics (+ causal checkpoints every 256 tokens) are kept."""
    w, temp = _inputs((1, 4, 2048, 48), torch.float32)
    for fn in (tssa, causal_tssa):
        sizes = {}

        def pack(t, sizes=sizes):
            st = t.untyped_storage()
            sizes[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(w, temp)
        saved = sum(sizes.values())
        assert w.nbytes <= saved <= 1.1 * w.nbytes, (fn.__name__, saved / w.nbytes)
        out.sum().backward()


@pytest.mark.compile
def test_layers_compile_fullgraph_with_kernel(kernel, monkeypatch):
    counter = {"n": 0}
    real = fused._ext

    def counting_ext():
        counter["n"] += 1
        return real()

    monkeypatch.setattr(fused, "_ext", counting_ext)
    torch._dynamo.reset()
    for layer in (TSSA(16, num_heads=2).eval(), CausalTSSA(16, num_heads=2, max_len=8).eval()):
        x = torch.randn(2, 5, 16)
        mask = torch.tensor([[True] * 5, [False, True, True, True, True]])
        compiled = torch.compile(layer, fullgraph=True)
        before = counter["n"]
        torch.testing.assert_close(compiled(x, mask), layer(x, mask), rtol=1e-5, atol=1e-6)
        assert counter["n"] >= before + 2  # the compiled graph and the eager call both ran the kernel
