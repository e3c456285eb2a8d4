"""ECAttention (ECAttention paper): operators vs reference, basis, fallback, padding, sketches, layer."""

import pytest
import torch

from whiteformer.attention import ECAttention, build
from whiteformer.ops import (
    cholesky_fallback_count,
    cholesky_stats,
    eca_compress,
    eca_expand,
    eca_omega,
    orthonormal_basis,
    reset_cholesky_fallback_count,
)
from whiteformer.ops.reference import eca_compress_reference, eca_expand_reference, orthonormal_basis_reference

F64 = torch.float64


def _orth(c, cols, dtype=F64):
    return torch.linalg.qr(torch.randn(c, c, dtype=dtype)).Q[:, :cols].contiguous()


def _grads(out, inputs, seed_tensor):
    return torch.autograd.grad((out * seed_tensor).sum(), inputs, allow_unused=False)


def _coding_rate(z, eps=0.5):
    """R(Z) of Eq. (1) for z (N, C)."""
    n, d = z.shape
    return 0.5 * torch.logdet(torch.eye(d, dtype=z.dtype) + d / (n * eps**2) * z.T @ z)


# ----------------------------------------------------------------------------- basis
def test_basis_matches_reference_and_is_orthonormal_up_to_eps():
    Y = torch.randn(3, 10, 4, dtype=F64)
    for eps in (1e-1, 1e-2):
        Q = orthonormal_basis(Y, eps)
        torch.testing.assert_close(Q, orthonormal_basis_reference(Y, eps))
        Yn = Y / Y.norm(dim=-2, keepdim=True)
        G = Yn.mT @ Yn + eps * torch.eye(4, dtype=F64)
        # exact: Q^T Q = I - eps (L^T L)^{-1}, G = L L^T; so ||Q^T Q - I|| = eps / (lambda_min + eps)
        L = torch.linalg.cholesky(G)
        torch.testing.assert_close(Q.mT @ Q, torch.eye(4, dtype=F64) - eps * torch.linalg.inv(L.mT @ L))
        torch.testing.assert_close(Q @ Q.mT, Yn @ torch.linalg.inv(G) @ Yn.mT)  # ridge projector
        dev = torch.linalg.matrix_norm(Q.mT @ Q - torch.eye(4, dtype=F64), ord=2)
        lam = torch.linalg.eigvalsh(Yn.mT @ Yn)[..., 0]
        torch.testing.assert_close(dev, eps / (lam + eps))
        assert (dev < 10 * eps).all() and (dev > 0.1 * eps).all()
    # tiny eps on well-conditioned Y: orthonormal basis of range(Y)
    Q = orthonormal_basis(Y, 1e-12)
    torch.testing.assert_close(Q.mT @ Q, torch.eye(4, dtype=F64).expand(3, 4, 4), atol=1e-9, rtol=0)
    torch.testing.assert_close(Q @ Q.mT @ Y, Y, atol=1e-9, rtol=0)


def test_basis_half_input_computed_in_float32():
    Y = torch.randn(2, 8, 3)
    Q = orthonormal_basis(Y.half())
    assert Q.dtype == torch.float16
    torch.testing.assert_close(Q.float(), orthonormal_basis(Y.half().float()), atol=2e-3, rtol=0)


def test_qr_fallback_counted_and_batch_neighbours_unaffected():
    good = torch.randn(6, 3, dtype=F64)
    bad = torch.randn(6, 3, dtype=F64)
    bad[:, 1] = 0.0  # zero column: Yn^T Yn singular, eps = 0 -> Cholesky must fail
    reset_cholesky_fallback_count()
    Q = orthonormal_basis(torch.stack([good, bad]), eps=0.0)
    assert cholesky_fallback_count() == 1
    st = cholesky_stats()
    assert st["calls"] == 1 and st["matrices"] == 2 and st["fallback_matrices"] == 1 and st["fail_rate"] == 1.0
    assert torch.isfinite(Q).all()
    torch.testing.assert_close(Q[0], orthonormal_basis(good, eps=0.0))  # Cholesky result, unchanged
    assert cholesky_fallback_count() == 1  # the good matrix alone does not fall back
    torch.testing.assert_close(Q[1], torch.linalg.qr(bad / bad.norm(dim=0).clamp_min(1e-12)).Q)
    torch.testing.assert_close(Q[1].T @ Q[1], torch.eye(3, dtype=F64))
    # with eps = 1e-2 the same matrix factorises: no fallback (paper Table 10)
    orthonormal_basis(bad, eps=1e-2)
    assert cholesky_fallback_count() == 1
    reset_cholesky_fallback_count()
    assert cholesky_fallback_count() == 0 and cholesky_stats()["calls"] == 0


def test_fallback_does_not_poison_gradients_of_other_matrices():
    good = torch.randn(6, 3, dtype=F64, requires_grad=True)
    bad = torch.randn(6, 3, dtype=F64)
    bad[:, 2] = 0.0
    w = torch.randn(6, 3, dtype=F64)
    Q = orthonormal_basis(torch.stack([good, bad]), eps=0.0)
    (g_batch,) = torch.autograd.grad((Q[0] * w).sum(), good)
    (g_alone,) = torch.autograd.grad((orthonormal_basis(good, eps=0.0) * w).sum(), good)
    assert torch.isfinite(g_batch).all()
    torch.testing.assert_close(g_batch, g_alone)


def test_fallback_inside_operator():
    x = torch.randn(2, 6, 5, dtype=F64)
    x[0, :, 3] = 0.0  # feature 3 unused by sequence 0: its code subspace is rank-deficient
    U = torch.eye(5, 6, dtype=F64)  # head 0 sees features 0-2, head 1 features 3-4 (+ a zero one)
    omega = eca_omega(6, 3, seed=1, dtype=F64)
    reset_cholesky_fallback_count()
    out = eca_compress(x, U, omega, 1.0, num_heads=2, eps=0.0)
    assert cholesky_fallback_count() == 1 and cholesky_stats()["fallback_matrices"] >= 1
    assert torch.isfinite(out).all()


# ----------------------------------------------------------------------------- operators vs reference
EXPAND_SHAPES = [(2, 7, 8, 3), (1, 1, 4, 1), (3, 4, 6, 4), (2, 16, 12, 12)]  # (B, N, C, R), R <= min(N, C)


@pytest.mark.parametrize("B,N,C,R", EXPAND_SHAPES)
def test_expand_matches_reference(B, N, C, R):
    x = torch.randn(B, N, C, dtype=F64, requires_grad=True)
    omega = eca_omega(N, R, seed=3, dtype=F64)
    out, ref = eca_expand(x, omega), eca_expand_reference(x, omega)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    torch.testing.assert_close(_grads(out, [x], g)[0], _grads(ref, [x], g)[0])


def test_expand_float32_matches_reference():
    x = torch.randn(2, 9, 8)
    omega = torch.randn(9, 4)
    torch.testing.assert_close(eca_expand(x, omega), eca_expand_reference(x, omega), atol=1e-5, rtol=1e-4)


COMPRESS_SHAPES = [(2, 7, 8, 2, 3), (1, 1, 4, 2, 1), (2, 5, 12, 3, 4), (3, 20, 16, 4, 4)]  # (B, N, C, H, r)


@pytest.mark.parametrize("B,N,C,H,r", COMPRESS_SHAPES)
@pytest.mark.parametrize("per_head_temp", [False, True])
def test_compress_matches_reference(B, N, C, H, r, per_head_temp):
    x = torch.randn(B, N, C, dtype=F64, requires_grad=True)
    U = _orth(C, C).requires_grad_(True)
    temp = (0.5 + torch.rand(H if per_head_temp else 1, dtype=F64)).requires_grad_(True)
    omega = eca_omega(N, r, seed=5, stream=1, dtype=F64)
    out, pi = eca_compress(x, U, omega, temp, H, return_pi=True)
    ref, pi_ref = eca_compress_reference(x, U, omega, temp, H, return_pi=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(pi, pi_ref)
    torch.testing.assert_close(pi.sum(1), torch.ones(B, N, dtype=F64))
    g, gp = torch.randn_like(out), torch.randn_like(pi)
    grads = torch.autograd.grad((out * g).sum() + (pi * gp).sum(), [x, U, temp])
    grads_ref = torch.autograd.grad((ref * g).sum() + (pi_ref * gp).sum(), [x, U, temp])
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b)


def test_compress_overcomplete_U_and_float_temperature():
    x = torch.randn(2, 6, 4, dtype=F64)
    U = torch.randn(4, 12, dtype=F64)  # H*p = 12 > C (non-square bases)
    omega = eca_omega(6, 2, seed=9, dtype=F64)
    torch.testing.assert_close(eca_compress(x, U, omega, 0.3, 3), eca_compress_reference(x, U, omega, 0.3, 3))


def test_memberships_follow_eq7_not_pseudocode():
    # a token lying in head 0's subspace must get pi_0 ~ 1 (softmax over heads of squared norms / 2 eta)
    C, H = 8, 2
    U = torch.eye(C, dtype=F64)
    x = torch.zeros(1, 6, C, dtype=F64)
    x[0, :3, :4] = 3.0 * torch.randn(3, 4, dtype=F64)  # tokens 0-2 in head 0's span
    x[0, 3:, 4:] = 3.0 * torch.randn(3, 4, dtype=F64)  # tokens 3-5 in head 1's span
    omega = eca_omega(6, 3, seed=2, dtype=F64)
    _, pi = eca_compress(x, U, omega, 0.5, H, return_pi=True)
    assert (pi[0, 0, :3] > 0.99).all() and (pi[0, 1, 3:] > 0.99).all()


def test_gradcheck_float64():
    x = torch.randn(1, 4, 4, dtype=F64, requires_grad=True)
    U = _orth(4, 4).requires_grad_(True)
    temp = torch.tensor([0.7], dtype=F64, requires_grad=True)
    omega = eca_omega(4, 2, seed=11, dtype=F64)
    assert torch.autograd.gradcheck(lambda a: eca_expand(a, omega), (x,))
    assert torch.autograd.gradcheck(lambda a, u, t: eca_compress(a, u, omega, t, 2), (x, U, temp))
    Y = torch.randn(5, 3, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda y: orthonormal_basis(y, 1e-2), (Y,))


# ----------------------------------------------------------------------------- padding
MASKS = [
    [[True] * 8, [True] * 5 + [False] * 3],  # right padding
    [[False] * 2 + [True] * 6, [True] * 8],  # left padding
    [[True, False, True, True, False, True, True, True], [True] * 8],  # holes
]


@pytest.mark.parametrize("mask", MASKS)
def test_ops_padding_equivalence(mask):
    mask = torch.tensor(mask)
    x = torch.randn(2, 8, 8, dtype=F64)
    U = _orth(8, 8)
    om_e, om_c = eca_omega(8, 4, seed=1, dtype=F64), eca_omega(8, 2, seed=1, stream=1, dtype=F64)
    e = eca_expand(x, om_e, attn_mask=mask)
    c, pi = eca_compress(x, U, om_c, 0.8, 2, attn_mask=mask, return_pi=True)
    torch.testing.assert_close(e, eca_expand_reference(x, om_e, attn_mask=mask))
    torch.testing.assert_close(c, eca_compress_reference(x, U, om_c, 0.8, 2, attn_mask=mask))
    for b in range(2):
        xb = x[b:b + 1, mask[b]]
        n = xb.shape[1]
        torch.testing.assert_close(e[b, mask[b]], eca_expand(xb, om_e[:n])[0])
        cb, pib = eca_compress(xb, U, om_c[:n], 0.8, 2, return_pi=True)
        torch.testing.assert_close(c[b, mask[b]], cb[0])
        torch.testing.assert_close(pi[b][:, mask[b]], pib[0])
    pad = ~mask
    assert (e[pad] == 0).all() and (c[pad] == 0).all() and (pi.transpose(1, 2)[pad] == 0).all()


def test_padded_tokens_do_not_influence_real_ones_and_get_no_gradient():
    mask = torch.tensor([[True] * 6 + [False] * 2])
    x = torch.randn(1, 8, 8, dtype=F64, requires_grad=True)
    U = _orth(8, 8)
    om = eca_omega(8, 2, seed=4, dtype=F64)
    out = eca_compress(x, U, om, 1.0, 2, attn_mask=mask) + eca_expand(x, om, attn_mask=mask)
    (g,) = torch.autograd.grad(out.square().sum(), x)
    assert (g[0, 6:] == 0).all()
    x2 = x.detach().clone()
    x2[0, 6:] = 1e3 * torch.randn(2, 8, dtype=F64)
    out2 = eca_compress(x2, U, om, 1.0, 2, attn_mask=mask) + eca_expand(x2, om, attn_mask=mask)
    torch.testing.assert_close(out2, out.detach())


def test_all_padded_sequence_is_finite():
    mask = torch.tensor([[False] * 4, [True] * 4])
    layer = ECAttention(8, num_heads=2, rank=2)
    x = torch.randn(2, 4, 8)
    y, st = layer(x, mask, return_pi=True)
    assert torch.isfinite(y).all()
    assert (y[0] == 0).all()  # no real token: zero update
    assert (st["pi"][0] == 0).all()


@pytest.mark.parametrize("mask", MASKS)
def test_layer_padding_equivalence(mask):
    mask = torch.tensor(mask)
    layer = ECAttention(8, num_heads=2, rank=2, expand_rank=4).double()
    x = torch.randn(2, 8, 8, dtype=F64)
    y, st = layer(x, mask, return_pi=True)
    for b in range(2):
        yb, stb = layer(x[b:b + 1, mask[b]], return_pi=True)
        torch.testing.assert_close(y[b, mask[b]], yb[0])
        torch.testing.assert_close(st["pi"][b][:, mask[b]], stb["pi"][0])
    assert (y[~mask] == 0).all()  # padded tokens get no update


# ----------------------------------------------------------------------------- sketches
def test_eca_omega_properties():
    a = eca_omega(50, 7, seed=123, stream=0)
    torch.testing.assert_close(eca_omega(50, 7, seed=123, stream=0), a, rtol=0, atol=0)
    torch.testing.assert_close(eca_omega(20, 7, seed=123, stream=0), a[:20], rtol=0, atol=0)
    assert not torch.allclose(eca_omega(50, 7, seed=124), a)
    assert not torch.allclose(eca_omega(50, 7, seed=123, stream=1), a)
    assert a.dtype == torch.float32 and eca_omega(3, 2, 0, dtype=F64).dtype == F64
    big = eca_omega(4000, 16, seed=7)
    assert abs(big.mean().item()) < 0.05 and abs(big.std().item() - 1.0) < 0.05
    corr = big.T @ big / 4000
    assert (corr - torch.eye(16)).abs().max() < 0.1


def test_layer_same_N_same_omega_different_layers_differ():
    torch.manual_seed(0)
    l1, l2 = ECAttention(16, num_heads=2, rank=3), ECAttention(16, num_heads=2, rank=3)
    assert isinstance(l1.seed, int) and l1.seed != l2.seed and int(l1.omega_seed) == l1.seed
    o = l1.omega_for(10, "expand")
    assert o.shape == (10, 6) and l1.omega_for(10, "compress").shape == (10, 3)
    torch.testing.assert_close(l1.omega_for(10, "expand"), o, rtol=0, atol=0)
    torch.testing.assert_close(l1.omega_for(7, "expand"), o[:7], rtol=0, atol=0)
    assert not torch.allclose(l2.omega_for(10, "expand"), o)
    assert l1.omega_for(10, "expand", dtype=F64).dtype == F64
    # defaults reproducible under torch.manual_seed; explicit seed stored
    torch.manual_seed(0)
    assert ECAttention(16, num_heads=2, rank=3).seed == l1.seed
    assert ECAttention(16, num_heads=2, rank=3, seed=42).seed == 42
    x = torch.randn(2, 10, 16)
    torch.testing.assert_close(l1(x), l1(x), rtol=0, atol=0)
    assert not torch.allclose(l1(x), l2(x))


def test_state_dict_carries_seed():
    l1, l2 = ECAttention(16, num_heads=2, rank=3), ECAttention(16, num_heads=2, rank=3)
    x = torch.randn(2, 10, 16)
    l2(x)  # fill l2's sketch cache with its own seed
    l2.load_state_dict(l1.state_dict())
    assert l2.seed == l1.seed
    torch.testing.assert_close(l2(x), l1(x))


def test_seed_set_without_load_state_dict():
    """accelerate's load_checkpoint_and_dispatch (set_module_tensor_to_device) replaces the buffer
    directly, and a buffer may be written in place: the sketches follow omega_seed either way."""
    l1, l2 = ECAttention(16, num_heads=2, rank=3), ECAttention(16, num_heads=2, rank=3)
    x = torch.randn(2, 10, 16)
    want = l1(x)
    assert not torch.allclose(l2(x), want)  # (its own seed, the sketches cached)
    l2.load_state_dict({k: v for k, v in l1.state_dict().items() if k != "omega_seed"}, strict=False)
    l2._buffers["omega_seed"] = l1.omega_seed.clone()  # a new tensor in place of the buffer
    torch.testing.assert_close(l2(x), want)
    l3 = ECAttention(16, num_heads=2, rank=3)
    l3.load_state_dict({k: v for k, v in l1.state_dict().items() if k != "omega_seed"}, strict=False)
    l3(x)
    with torch.no_grad():
        l3.omega_seed.fill_(l1.seed)  # the buffer written in place
    torch.testing.assert_close(l3(x), want)
    assert l2.seed == l3.seed == l1.seed


def test_resample_omega_in_training_only():
    x = torch.randn(2, 10, 16)
    layer = ECAttention(16, num_heads=2, rank=3, resample_omega=True).train()
    assert not torch.allclose(layer(x), layer(x))
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x), rtol=0, atol=0)
    fixed = ECAttention(16, num_heads=2, rank=3).train()
    torch.testing.assert_close(fixed(x), fixed(x), rtol=0, atol=0)


# ----------------------------------------------------------------------------- layer
def _layer_reference(layer, x, mask=None):
    N = x.shape[1]
    om_e = layer.omega_for(N, "expand", dtype=x.dtype)
    om_c = layer.omega_for(N, "compress", dtype=x.dtype)
    e = eca_expand_reference(x, om_e, layer.eps, attn_mask=mask)
    c, pi = eca_compress_reference(x, layer.U, om_c, layer.temperature, layer.num_heads, layer.eps,
                                   attn_mask=mask, return_pi=True)
    return layer.alpha * e - layer.beta * c, pi  # the update; the caller adds x (Eq. 4)


@pytest.mark.parametrize("B,N,C,H,r", [(2, 9, 8, 2, 2), (1, 4, 8, 2, 2), (2, 16, 16, 4, 3), (2, 1, 4, 1, 1)])
def test_layer_matches_reference_forward_and_grads(B, N, C, H, r):
    layer = ECAttention(C, num_heads=H, rank=r).double()
    with torch.no_grad():  # move away from the init to exercise general values
        layer.alpha_raw.add_(0.3)
        layer.temperature.fill_(0.6)
    x = torch.randn(B, N, C, dtype=F64, requires_grad=True)
    y, st = layer(x, return_pi=True)
    y_ref, pi_ref = _layer_reference(layer, x)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(st["pi"], pi_ref)
    g = torch.randn_like(y)
    params = [x, layer.U, layer.temperature, layer.alpha_raw, layer.beta_raw]
    for a, b in zip(_grads(y, params, g), _grads(y_ref, params, g)):
        torch.testing.assert_close(a, b)


def test_layer_init_and_parametrisation():
    layer = ECAttention(16, num_heads=4, rank=2)
    assert layer.alpha.item() == pytest.approx(0.1, abs=1e-6) and layer.beta.item() == pytest.approx(0.1, abs=1e-6)
    assert layer.U.shape == (16, 16) and layer.temperature.shape == (1,) and layer.expand_rank == 8
    torch.testing.assert_close(layer.U.T @ layer.U, torch.eye(16), atol=1e-5, rtol=0)
    assert layer.no_weight_decay() == {"temperature", "alpha_raw", "beta_raw"}
    raw = ECAttention(16, num_heads=4, rank=2, alpha_init=-0.2, beta_init=0.3, positive=False)
    assert raw.alpha is raw.alpha_raw and raw.alpha.item() == pytest.approx(-0.2)
    assert raw.beta.item() == pytest.approx(0.3)
    assert build("eca", 16, num_heads=4, rank=2).__class__ is ECAttention


def test_ablations_expand_only_and_compress_only():
    x = torch.randn(2, 10, 16, dtype=F64)
    e_only = ECAttention(16, num_heads=2, rank=3, compress=False).double()
    assert e_only.U is None and e_only.beta is None and e_only.temperature is None
    om = e_only.omega_for(10, "expand", dtype=F64)
    torch.testing.assert_close(e_only(x), e_only.alpha * eca_expand_reference(x, om))
    with pytest.raises(ValueError, match="return_pi"):
        e_only(x, return_pi=True)
    c_only = ECAttention(16, num_heads=2, rank=3, expand=False).double()
    assert c_only.alpha is None
    om = c_only.omega_for(10, "compress", dtype=F64)
    ref = -c_only.beta * eca_compress_reference(x, c_only.U, om, c_only.temperature, 2)
    torch.testing.assert_close(c_only(x), ref)


def test_expansion_increases_coding_rate_of_low_rank_input():
    C, N = 16, 64
    basis = _orth(C, 6)
    s = torch.tensor([10.0, 8.0, 0.9, 0.8, 0.7, 0.6], dtype=F64)
    z = (torch.randn(N, 6, dtype=F64) @ torch.diag(s) @ basis.T).unsqueeze(0)  # rank 6, 2 dominant directions
    omega = eca_omega(N, 2, seed=0, dtype=F64)

    def eff_rank(t):
        sv = torch.linalg.svdvals(t[0])
        return int((sv > 0.1 * sv[0]).sum())

    rates, ranks = [_coding_rate(z[0])], [eff_rank(z)]
    for _ in range(3):
        z = z + 1.0 * eca_expand(z, omega)
        rates.append(_coding_rate(z[0]))
        ranks.append(eff_rank(z))
    assert all(b > a + 1e-3 for a, b in zip(rates, rates[1:]))
    assert ranks[0] == 2 and ranks[-1] == 6


def test_float64_and_half_precision():
    layer = ECAttention(16, num_heads=2, rank=3)
    x = 1e3 * torch.randn(2, 12, 16)
    y = layer(x.half())
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), layer(x.half().float()), rtol=2e-2, atol=2.0)
    yb, st = layer.to(torch.bfloat16)(x.bfloat16(), return_pi=True)
    assert yb.dtype == torch.bfloat16 and torch.isfinite(yb).all() and torch.isfinite(st["pi"]).all()
    for op_out in (eca_expand(x.half(), eca_omega(12, 4, 0, dtype=torch.float16)),
                   eca_compress(x.half(), _orth(16, 16, torch.float32).half(), eca_omega(12, 3, 0), 1.0, 2)):
        assert op_out.dtype == torch.float16 and torch.isfinite(op_out).all()
    layer64 = ECAttention(16, num_heads=2, rank=3).double()
    assert layer64(x.double()).dtype == F64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_built_under_a_half_default_dtype(dtype):
    """transformers' from_config(config, dtype=torch.bfloat16) builds under that default dtype; the
    orthogonal init of U (a QR, which has no half kernel on CPU) is computed in float32."""
    torch.manual_seed(0)
    want = ECAttention(16, num_heads=2, rank=3).U.detach()
    previous = torch.get_default_dtype()
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    try:
        layer = ECAttention(16, num_heads=2, rank=3)
    finally:
        torch.set_default_dtype(previous)
    assert layer.U.dtype == dtype
    torch.testing.assert_close(layer.U.float(), want.to(dtype).float(), rtol=0, atol=0)  # the same basis, rounded
    y = layer(torch.randn(2, 12, 16, dtype=dtype))
    assert y.dtype == dtype and torch.isfinite(y).all()


def test_autocast_bf16_computes_in_float32():
    layer = ECAttention(16, num_heads=2, rank=3)
    x = torch.randn(2, 12, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, layer(x))


# ----------------------------------------------------------------------------- bad inputs
def test_bad_operator_inputs_raise():
    x = torch.randn(2, 6, 8)
    om = torch.randn(6, 2)
    U = torch.randn(8, 8)
    with pytest.raises(ValueError, match="x must have 3"):
        eca_expand(x[0], om)
    with pytest.raises(ValueError, match="no tokens"):
        eca_expand(x[:, :0], om[:0])
    with pytest.raises(TypeError, match="floating"):
        eca_expand(x.long(), om)
    with pytest.raises(ValueError, match="omega must have shape"):
        eca_expand(x, torch.randn(5, 2))
    with pytest.raises(ValueError, match="rank.*number of tokens.*eps = 0"):
        eca_expand(x, torch.randn(6, 7), eps=0.0)
    with pytest.raises(ValueError, match="rank.*feature dimension"):
        eca_expand(torch.randn(2, 12, 4), torch.randn(12, 5))
    with pytest.raises(ValueError, match="eps"):
        eca_expand(x, om, eps=-1.0)
    with pytest.raises(ValueError, match="attn_mask"):
        eca_expand(x, om, attn_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask"):
        eca_expand(x, om, attn_mask=torch.ones(2, 6))
    with pytest.raises(ValueError, match="U must have shape"):
        eca_compress(x, torch.randn(7, 8), om, 1.0, 2)
    with pytest.raises(ValueError, match="U must have shape"):
        eca_compress(x, torch.randn(8, 9), om, 1.0, 2)
    with pytest.raises(ValueError, match="rank.*head dimension"):
        eca_compress(x, U, torch.randn(6, 5), 1.0, 2)
    with pytest.raises(ValueError, match="temperature"):
        eca_compress(x, U, om, torch.ones(3), 2)
    with pytest.raises(ValueError, match="temperature"):
        eca_compress(x, U, om, 0.0, 2)
    with pytest.raises(TypeError, match="temperature must be a torch.Tensor, got bool"):
        eca_compress(x, U, om, True, 2)
    with pytest.raises(ValueError, match="num_heads"):
        eca_compress(x, U, om, 1.0, 0)
    with pytest.raises(ValueError, match="rank"):
        orthonormal_basis(torch.randn(3, 4))
    with pytest.raises(ValueError, match="Y must have at least 2"):
        orthonormal_basis(torch.randn(3))
    with pytest.raises(ValueError, match="num_tokens"):
        eca_omega(0, 2, seed=0)


def test_bad_layer_arguments_raise():
    with pytest.raises(ValueError, match="divisible"):
        ECAttention(10, num_heads=4)
    with pytest.raises(ValueError, match="rank.*head dimension"):
        ECAttention(16, num_heads=4, rank=5)
    assert ECAttention(16, num_heads=2, rank=8).expand_rank == 16  # num_heads * rank ...
    assert ECAttention(16, num_heads=2, rank=9, compress=False).expand_rank == 16  # ... capped at dim
    with pytest.raises(ValueError, match="expand_rank"):
        ECAttention(16, num_heads=2, rank=2, expand_rank=17)
    with pytest.raises(ValueError, match="both be False"):
        ECAttention(16, num_heads=2, rank=2, expand=False, compress=False)
    with pytest.raises(ValueError, match="alpha_init"):
        ECAttention(16, num_heads=2, rank=2, alpha_init=0.0)
    with pytest.raises(ValueError, match="eps"):
        ECAttention(16, num_heads=2, rank=2, eps=-1e-3)
    with pytest.raises(ValueError, match="seed"):
        ECAttention(16, num_heads=2, rank=2, seed=-1)
    layer = ECAttention(16, num_heads=2, rank=3)
    with pytest.raises(ValueError, match="x must have 3"):
        layer(torch.randn(10, 16))
    with pytest.raises(ValueError, match="last dimension 16"):
        layer(torch.randn(2, 10, 8))
    with pytest.raises(ValueError, match="no tokens"):
        layer(torch.randn(2, 0, 16))
    with pytest.raises(ValueError, match="rank.*number of tokens"):
        ECAttention(16, num_heads=2, rank=3, eps=0.0)(torch.randn(2, 5, 16))  # expand_rank 6 > N 5
    with pytest.raises(ValueError, match="attn_mask"):
        layer(torch.randn(2, 10, 16), torch.ones(2, 9, dtype=torch.bool))


# ----------------------------------------------------------------------------- compile
def test_layer_compile_fullgraph_matches_eager():
    layer = ECAttention(8, num_heads=2, rank=2).eval()
    x = torch.randn(2, 6, 8)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x, mask), layer(x, mask), rtol=1e-5, atol=1e-5)


def test_sketch_rank_above_token_count_with_eps_is_a_ridge_projector():
    """The paper's ECA-B/B+/L sketch K*r = 320 columns over 196 tokens: allowed when eps > 0.
    With R > N the regularised basis still removes (almost all of) range(Z) from each token."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    y = eca_expand(x, torch.randn(5, 8, dtype=torch.float64), eps=1e-6)
    assert torch.isfinite(y).all()
    # every token lies in range(Z), so its null-space part is ~0 when the sketch covers range(Z)
    assert y.abs().max() < 1e-2 * x.abs().max()
    layer = ECAttention(16, num_heads=2, rank=3)  # expand_rank 6 > N = 5, eps = 1e-2
    assert torch.isfinite(layer(torch.randn(2, 5, 16))).all()


# ----------------------------------------------------------------------------- contract
def test_layer_returns_the_update_and_a_prenorm_block_adds_it_once():
    layer = ECAttention(16, num_heads=2, rank=3).double()
    x = torch.randn(2, 10, 16, dtype=F64)
    y_ref, _ = _layer_reference(layer, x)
    torch.testing.assert_close(layer(x), y_ref)
    assert ECAttention.learned_scale is True  # alpha, beta are its layer scale


def test_default_rank_is_min_20_head_dim():
    layer = build("eca", 64, num_heads=4)  # p = 16 < 20
    assert layer.rank == 16 and layer.expand_rank == 64 and layer.head_dim == 16
    assert layer(torch.randn(2, 20, 64)).shape == (2, 20, 64)
    wide = ECAttention(384, num_heads=8)  # p = 48
    assert wide.rank == 20 and wide.expand_rank == 160


def test_head_dim_argument():
    layer = ECAttention(24, num_heads=4, head_dim=12, rank=5)  # p independent of dim / K
    assert layer.U.shape == (24, 48) and layer.head_dim == 12 and layer.rank == 5
    assert layer.expand_rank == 20
    y, st = layer(torch.randn(2, 30, 24), return_pi=True)
    assert y.shape == (2, 30, 24) and st["pi"].shape == (2, 4, 30)
    torch.testing.assert_close(st["pi"].sum(1), torch.ones(2, 30))
    assert ECAttention(10, num_heads=4, head_dim=8).rank == 8  # dim need not divide
    assert ECAttention(64, num_heads=4, head_dim=64).expand_rank == 64  # K r = 80 capped at dim
    with pytest.raises(ValueError, match="head_dim"):
        ECAttention(16, num_heads=2, head_dim=0)
    layer64 = ECAttention(8, num_heads=2, head_dim=6, rank=2).double()
    x = torch.randn(2, 9, 8, dtype=F64, requires_grad=True)
    y, st = layer64(x, return_pi=True)
    y_ref, pi_ref = _layer_reference(layer64, x)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(st["pi"], pi_ref)


def test_layer_on_meta_device():
    with torch.device("meta"):
        layer = ECAttention(32, num_heads=4)
        y, st = layer(torch.empty(2, 12, 32), return_pi=True)
    assert isinstance(layer.seed, int) and layer.U.is_meta
    assert y.is_meta and y.shape == (2, 12, 32) and st["pi"].shape == (2, 4, 12)
