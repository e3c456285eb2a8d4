"""Triton kernels of TSSA, causal TSSA and the causal TSSA step, run on CPU tensors
through Triton's interpreter: forward and every gradient against the references (float32 to
1e-5 of the largest entry, float16/bfloat16 to their rounding), float64 gradcheck, masks, causal
no-leakage, chunk boundaries (N not a multiple of the chunk, N < chunk, N = 1), many (b, h).

Triton reads ``TRITON_INTERPRET`` when it decorates a kernel (its own library at ``import
triton``, ours when the kernel modules are imported): tests/conftest.py sets it before anything
imports triton. Shapes are tiny: the interpreter runs every program instance in Python
(~10-50 ms each on this CPU).
"""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'whiteformer[triton]')")

from whiteformer.ops import CausalTSSAState, causal_tssa_step  # noqa: E402
from whiteformer.ops._kernels.triton import _tiles  # noqa: E402
from whiteformer.ops._kernels.triton.causal_tssa import causal_tssa_triton  # noqa: E402
from whiteformer.ops._kernels.triton.causal_tssa_step import causal_tssa_step_triton  # noqa: E402
from whiteformer.ops._kernels.triton.tssa import tssa_triton  # noqa: E402
from whiteformer.ops.causal_tssa.state import position_logit_bias  # noqa: E402
from whiteformer.ops.reference import causal_tssa_reference, tssa_reference  # noqa: E402

if not _tiles.kernels_interpreted() and not torch.cuda.is_available():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it)",
                allow_module_level=True)

# relative tolerance (of the largest reference entry) per dtype: float32 1e-5 as the issue asks;
# half types: a few units of their rounding (outputs and gradients are returned in that dtype)
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    monkeypatch.setattr(_tiles, "BLOCK_N_MAX", 2)
    monkeypatch.setattr(_tiles, "CHUNK", 4)


def _close(got, ref, dtype, what):
    ref = ref.double()
    err = float((got.detach().double() - ref.detach()).abs().max())
    scale = float(ref.detach().abs().max())
    assert err <= TOL[dtype] * scale + 1e-12, f"{what}: max err {err:.3g} vs max |ref| {scale:.3g} ({dtype})"


def _mask(b, n):
    g = torch.Generator().manual_seed(n)
    m = torch.rand(b, n, generator=g) > 0.35
    m[:, 0] = True
    m[-1, n // 2:] = False  # right padding on one sequence
    m[-1, 0] = True
    return m


def _logit_bias(bias, mask, n, p):
    """What the dispatcher passes: p * pos_bias at each real token's position (float32 or wider)."""
    bias = bias if bias.dtype == torch.float64 else bias.float()
    if mask is None:
        return p * bias[:, :n, 0]
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    return p * bias[:, pos, 0].transpose(0, 1)


def _check(kernel_outs, ref_fn, params, dtype):
    """Forward outputs and the gradients of a random linear loss vs the float64 reference on the
    same (rounded) inputs."""
    grads_out = [torch.randn(o.shape, dtype=o.dtype) for o in kernel_outs]
    loss = sum((o.double() * g.double()).sum() for o, g in zip(kernel_outs, grads_out))
    got = torch.autograd.grad(loss, params)
    ref_params = [p.detach().double().requires_grad_(True) for p in params]
    ref_outs = ref_fn(*ref_params)
    for i, (o, r) in enumerate(zip(kernel_outs, ref_outs)):
        _close(o, r, dtype, f"output {i}")
    ref_loss = sum((r * g.double()).sum() for r, g in zip(ref_outs, grads_out))
    for i, (g, r) in enumerate(zip(got, torch.autograd.grad(ref_loss, ref_params))):
        _close(g, r, dtype, f"gradient of input {i}")


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (B, H, N, p): N not a multiple of the block (4), N < block, N = 1, N a multiple, p = 1
SHAPES = [(2, 3, 7, 5), (2, 2, 3, 16), (1, 3, 1, 4), (2, 2, 8, 1)]


def _inputs(shape, dtype):
    w = torch.randn(*shape).to(dtype).requires_grad_(True)
    temp = (torch.rand(shape[1], 1) + 0.5).to(dtype).requires_grad_(True)
    return w, temp


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_tssa_forward_and_grads(dtype, shape, masked):
    w, temp = _inputs(shape, dtype)
    mask = _mask(shape[0], shape[2]) if masked else None
    out, pi = tssa_triton(w, temp, mask)
    assert out.dtype == dtype and pi.dtype == dtype and pi.shape == shape[:3]
    _check((out, pi), lambda w_, t_: tssa_reference(w_, t_, mask, return_pi=True), (w, temp), dtype)
    if masked:
        assert not out[~mask[:, None, :, None].expand_as(out)].any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_causal_forward_and_grads(dtype, shape, masked):
    w, temp = _inputs(shape, dtype)
    b, h, n, p = shape
    bias = (torch.randn(h, n + 3, 1) * 0.3).to(dtype).requires_grad_(True)
    mask = _mask(b, n) if masked else None

    def kernel():
        out, pi, *_ = causal_tssa_triton(w, temp, _logit_bias(bias, mask, n, p), mask)
        return out, pi

    _check(kernel(), lambda w_, t_, b_: causal_tssa_reference(w_, t_, b_, mask, return_pi=True), (w, temp, bias),
           dtype)


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_causal_grads_of_one_head_on_half_sub_blocks(monkeypatch, masked):
    """One head at a full tile cannot split into head groups: the causal dw kernel walks
    sub-blocks of half the tokens (BLOCK_N 1 of 2) and the gradients still match the reference."""
    monkeypatch.setattr(_tiles, "TILE_ELEMS", 8)  # 1 head of 4: BLOCK_N 2, the dw kernel 1
    t = _tiles.tiles(1, 4, torch.float32)
    assert t.block_n == 2 and t.group_meta(1) == (1, dict(t.meta(), BLOCK_N=1))
    w, temp = _inputs((2, 1, 11, 4), torch.float32)
    bias = (torch.randn(1, 14, 1) * 0.3).requires_grad_(True)
    mask = _mask(2, 11) if masked else None

    def kernel():
        out, pi, *_ = causal_tssa_triton(w, temp, _logit_bias(bias, mask, 11, 4), mask)
        return out, pi

    _check(kernel(), lambda w_, t_, b_: causal_tssa_reference(w_, t_, b_, mask, return_pi=True), (w, temp, bias),
           torch.float32)


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_causal_grads_in_head_groups(monkeypatch, masked):
    """The causal dw kernel (no softmax over heads) runs in head groups (grid (B, NC, groups)) and
    the gradients still match the reference."""
    monkeypatch.setattr(_tiles, "TILE_ELEMS", 16)  # 5 heads of 4: BLOCK_H 8, groups of 2 heads
    t = _tiles.tiles(5, 4, torch.float32)
    assert t.group_meta(5)[0] == 3 and t.group_meta(5)[1]["BLOCK_H"] == 2
    w, temp = _inputs((2, 5, 7, 4), torch.float32)
    bias = (torch.randn(5, 10, 1) * 0.3).requires_grad_(True)
    mask = _mask(2, 7) if masked else None

    def kernel():
        out, pi, *_ = causal_tssa_triton(w, temp, _logit_bias(bias, mask, 7, 4), mask)
        return out, pi

    _check(kernel(), lambda w_, t_, b_: causal_tssa_reference(w_, t_, b_, mask, return_pi=True), (w, temp, bias),
           torch.float32)


def _token_errors(got, ref):
    """Per (b, h, token): max |got - ref| / max |ref| over the features."""
    return (got.double() - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-300)


def test_causal_gradient_after_tiny_first_tokens(monkeypatch):
    """A sequence whose first token is 1e-6 of the later ones (energies 1e-12 of theirs): each
    token's float32 dw is as accurate as the PyTorch path's against float64 (a token's own ratio
    gradient 1 / E - w^2 / E^2 is never formed as two cancelling terms of size 1 / E, and W holds
    only the later tokens; one sub-block holds the sequence)."""
    from whiteformer.ops import causal_tssa
    from whiteformer.ops._kernels import ENV_BACKEND

    monkeypatch.setattr(_tiles, "BLOCK_N_MAX", 8)
    monkeypatch.setattr(_tiles, "CHUNK", 8)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 2, 8, 3, generator=g, dtype=torch.float64) * 1e3
    w[:, :, 0] *= 1e-6
    temp = torch.rand(2, 1, generator=g, dtype=torch.float64) + 0.5
    g_out, g_pi = torch.randn(w.shape, generator=g, dtype=torch.float64), torch.randn(w.shape[:3], generator=g,
                                                                                      dtype=torch.float64)

    def dw(fn, dtype):
        x = w.to(dtype).requires_grad_(True)
        out, pi = fn(x, temp.to(dtype))[:2]
        return torch.autograd.grad((out * g_out.to(dtype)).sum() + (pi * g_pi.to(dtype)).sum(), x)[0]

    ref = dw(lambda x, t: causal_tssa_reference(x, t, return_pi=True), torch.float64)
    kernel = _token_errors(dw(causal_tssa_triton, torch.float32), ref)
    monkeypatch.setenv(ENV_BACKEND, "torch")
    torch_path = _token_errors(dw(lambda x, t: causal_tssa(x, t, return_pi=True), torch.float32), ref)
    assert torch_path.max() < 1e-4
    assert kernel.max() <= max(2 * torch_path.max().item(), 1e-5), (
        f"worst token error {kernel.max().item():.2e} vs the PyTorch path's {torch_path.max().item():.2e}")


def test_causal_without_bias_and_final_state_grads():
    """The returned running sums (the state for generation) and their gradients match the
    PyTorch path's state (float64)."""
    from whiteformer.ops.causal_tssa.parallel import causal_tssa_parallel

    w, temp = _inputs((2, 3, 6, 3), torch.float64)
    mask = _mask(2, 6)
    out, pi, e, m, q, k = causal_tssa_triton(w, temp, None, mask)
    ref_out, ref_pi, *st, ref_k = causal_tssa_parallel(w, temp, None, mask)
    for a, r in ((out, ref_out), (pi, ref_pi), (e, st[0]), (m, st[1]), (q, st[2]), (k.unsqueeze(-1).expand_as(ref_k), ref_k)):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)
    gs = [torch.randn_like(t) for t in (e, m, q)]
    got = torch.autograd.grad(sum((t * g).sum() for t, g in zip((e, m, q), gs)), (w, temp))
    ref = torch.autograd.grad(sum((t * g).sum() for t, g in zip(st, gs)), (w, temp))
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)


HEAD_DIMS = [16, 32, 64, 128, 256]  # the head dims of real models; small N: every sub-block / chunk boundary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("p", HEAD_DIMS)
def test_head_dims_forward_and_grads(p, dtype):
    """Each head dim's tiles (BLOCK_P, and BLOCK_N from the budget, capped at 2 here with chunks of
    4 tokens), N = 7 across three chunks, a mask with a left-padded sequence, the position bias."""
    b, h, n = 2, 3, 7
    w, temp = _inputs((b, h, n, p), dtype)
    temp = (temp.detach() * 8 / p).requires_grad_(True)  # logits O(1): sum_j ratio_j grows with p
    mask = _mask(b, n)
    mask[0, :2] = False  # left padding: the first kept token is not the first token
    _check(tssa_triton(w, temp, mask), lambda w_, t_: tssa_reference(w_, t_, mask, return_pi=True), (w, temp),
           dtype)
    bias = (torch.randn(h, n + 3, 1) * 0.3).to(dtype).requires_grad_(True)

    def kernel():  # p * bias enters the logits: the scaled temp keeps them O(1)
        out, pi, *_ = causal_tssa_triton(w, temp, _logit_bias(bias, mask, n, p), mask)
        return out, pi

    _check(kernel(), lambda w_, t_, b_: causal_tssa_reference(w_, t_, b_, mask, return_pi=True), (w, temp, bias),
           dtype)


@pytest.mark.parametrize("p", HEAD_DIMS)
def test_head_dims_float64_gradcheck(p):
    w, temp = _inputs((1, 2, 5, p), torch.float64)
    mask = torch.tensor([[False, True, True, False, True]])
    bias = (torch.randn(2, 5, 1, dtype=torch.float64) * 0.3).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda w_, t_: tssa_triton(w_, t_, mask), (w, temp), fast_mode=True)
    assert torch.autograd.gradcheck(
        lambda w_, t_, b_: causal_tssa_triton(w_, t_, _logit_bias(b_, mask, 5, p), mask), (w, temp, bias),
        fast_mode=True)
    x = torch.randn(2, 3, p, dtype=torch.float64, requires_grad=True)
    state = [torch.rand(2, 3, p, dtype=torch.float64, requires_grad=True),
             torch.rand(2, 3, dtype=torch.float64, requires_grad=True),
             torch.rand(2, 3, p, dtype=torch.float64, requires_grad=True)]
    t3 = (torch.rand(3, 1, dtype=torch.float64) + 0.5).requires_grad_(True)
    assert torch.autograd.gradcheck(causal_tssa_step_triton, (x, *state, t3, None), fast_mode=True)


def test_tiles_follow_the_head_dim(monkeypatch):
    """The rule of _tiles: a power-of-two BLOCK_N within the value budget (and its cap), more warps
    for larger tiles, one token at most per sub-block once heads x features reach the budget."""
    monkeypatch.undo()  # the default tiles, not the tests' tiny ones
    for p in HEAD_DIMS:
        for heads in (1, 3, 8, 12, 32):
            t = _tiles.tiles(heads, p, torch.float32)
            assert t.block_p == p and t.block_h >= heads and t.block_n & (t.block_n - 1) == 0
            assert t.block_n == 1 or t.block_h * t.block_n * t.block_p <= _tiles.TILE_ELEMS
            assert t.block_n <= min(_tiles.BLOCK_N_MAX, t.chunk) and t.chunk % t.block_n == 0
            elems = t.block_h * t.block_n * t.block_p
            assert t.num_warps == _tiles.warps_for(elems) and _tiles.MIN_WARPS <= t.num_warps <= _tiles.MAX_WARPS
    assert _tiles.tiles(8, 64, torch.float64).block_n * 2 == _tiles.tiles(8, 64, torch.float32).block_n


def test_float64_gradcheck():
    w, temp = _inputs((1, 2, 5, 2), torch.float64)
    bias = (torch.randn(2, 5, 1, dtype=torch.float64) * 0.3).requires_grad_(True)
    mask = torch.tensor([[True, True, False, True, True]])
    assert torch.autograd.gradcheck(lambda w_, t_: tssa_triton(w_, t_, mask), (w, temp), fast_mode=True)
    assert torch.autograd.gradcheck(
        lambda w_, t_, b_: causal_tssa_triton(w_, t_, _logit_bias(b_, mask, 5, 2), mask), (w, temp, bias),
        fast_mode=True)
    x = torch.randn(2, 3, 2, dtype=torch.float64, requires_grad=True)
    state = [torch.rand(2, 3, 2, dtype=torch.float64), torch.rand(2, 3, dtype=torch.float64),
             torch.rand(2, 3, 2, dtype=torch.float64)]
    state = [s.requires_grad_(True) for s in state]
    t3 = (torch.rand(3, 1, dtype=torch.float64) + 0.5).requires_grad_(True)
    lb = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(causal_tssa_step_triton, (x, *state, t3, lb), fast_mode=True)


@pytest.mark.parametrize("n", [1, 6])
def test_causal_no_leakage(n):
    """Changing tokens after t changes nothing at or before t, forward and gradient."""
    w, temp = _inputs((2, 2, n + 3, 3), torch.float32)
    out = causal_tssa_triton(w, temp)[0]
    w2 = w.detach().clone()
    w2[:, :, n:] = torch.randn_like(w2[:, :, n:]) * 5
    out2 = causal_tssa_triton(w2, temp)[0]
    assert torch.equal(out[:, :, :n], out2[:, :, :n])
    grad = torch.autograd.grad(out[:, :, :n].sum(), w)[0]
    assert not grad[:, :, n:].any() and grad[:, :, :n].abs().sum() > 0


def test_many_sequences_and_heads():
    """B*H = 32 programs per kernel (indexing across sequences and heads)."""
    w, temp = _inputs((4, 8, 3, 4), torch.float32)
    mask = _mask(4, 3)
    _check(tssa_triton(w, temp, mask), lambda w_, t_: tssa_reference(w_, t_, mask, return_pi=True), (w, temp),
           torch.float32)
    _check(causal_tssa_triton(w, temp, None, mask)[:2],
           lambda w_, t_: causal_tssa_reference(w_, t_, None, mask, return_pi=True), (w, temp), torch.float32)


@pytest.mark.parametrize("dtype, h", [(d, 3) for d in DTYPES] + [(torch.float32, 1)], ids=str)
def test_step_matches_recurrence_and_sequence(dtype, h):
    """The fused step: outputs, new state and gradients match the PyTorch step; stepping through
    a sequence reproduces the chunked kernel (one head too: a padded head tile)."""
    b, p, n = 2, 5, 5
    w, temp = _inputs((b, h, n, p), dtype)
    bias = (torch.randn(h, n, 1) * 0.3).to(dtype).requires_grad_(True)
    sd = torch.float32
    state = CausalTSSAState(torch.zeros(b, h, p, dtype=sd), torch.zeros(b, h, dtype=sd), torch.zeros(b, h, p, dtype=sd), 0)
    outs = []
    for t in range(n):
        o, pi, e, m, q, k = causal_tssa_step_triton(w[:, :, t], *state[:3], temp,
                                                    position_logit_bias(bias, p, 1, start=t), state.scale)
        ro, rpi, rstate = causal_tssa_step(w[:, :, t], state, temp, bias, return_pi=True)
        _close(o, ro, dtype, f"step {t} out")
        _close(pi, rpi, dtype, f"step {t} pi")
        for a, r in ((e, rstate.sum_sq), (m, rstate.sum_pi), (q, rstate.sum_sq_pi)):
            _close(a, r, torch.float32, f"step {t} state")
        assert (k.unsqueeze(-1) == rstate.scale).all()  # one per head, taken for every feature
        state = CausalTSSAState(e, m, q, t + 1, k)
        outs.append(o)
    seq = torch.stack(outs, dim=2)
    full = causal_tssa_triton(w, temp, _logit_bias(bias, None, n, p))[0]
    _close(seq, full, dtype, "stepped vs chunked")
    g = torch.randn_like(seq)
    got = torch.autograd.grad((seq * g).sum(), (w, temp, bias))
    ref = torch.autograd.grad((causal_tssa_reference(w, temp, bias) * g).sum(), (w, temp, bias))
    for a, r in zip(got, ref):
        _close(a, r, dtype, "gradient through the steps")
