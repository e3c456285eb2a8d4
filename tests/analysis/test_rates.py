"""Coding rates (whiteformer.analysis.rates) against the papers' formulas written literally."""
import math

import pytest
import torch

from whiteformer.analysis import (
    coding_rate,
    compression_rate,
    logdet_f,
    rate_reduction,
    subspace_compression_rate,
    variational_compression_rate,
)

D64 = torch.float64


# ----------------------------------------------------------------------------- literal formulas
def lit_R(Z, eps):
    """ToST Eq. 1 with tokens as columns: Zp = Z^T (d x N), logdet(I_d + d/(N eps^2) Zp Zp^T)."""
    N, d = Z.shape
    Zp = Z.T
    return 0.5 * torch.logdet(torch.eye(d, dtype=D64) + d / (N * eps**2) * Zp @ Zp.T)


def lit_Rc(Z, Pi, eps):
    """ToST Eq. 1 compression term, Diag(pi_k) in the d x d form."""
    N, d = Z.shape
    Zp = Z.T
    out = 0.0
    for k in range(Pi.shape[1]):
        pk = Pi[:, k]
        nk = pk.sum()
        if nk == 0:
            continue
        M = Zp @ torch.diag(pk) @ Zp.T
        out = out + 0.5 * nk / N * torch.logdet(torch.eye(d, dtype=D64) + d / (nk * eps**2) * M)
    return out


def lit_Rc_onehot(Z, labels, K, eps):
    """Classical MCR² (Yu et al. 2020): per-class sub-matrices Z_k."""
    N, d = Z.shape
    out = 0.0
    for k in range(K):
        Zk = Z[labels == k]
        nk = Zk.shape[0]
        if nk == 0:
            continue
        out = out + nk / (2 * N) * torch.logdet(torch.eye(d, dtype=D64) + d / (nk * eps**2) * Zk.T @ Zk)
    return out


def lit_Rc_subspace(Z, Us, eps):
    """ECA Eq. 2: 1/2 sum_k logdet(I + p/(n eps^2) (U_k^T Zp)^T (U_k^T Zp))."""
    N = Z.shape[0]
    out = 0.0
    for Uk in Us:
        p = Uk.shape[1]
        Ak = Uk.T @ Z.T  # p x N
        out = out + 0.5 * torch.logdet(torch.eye(N, dtype=D64) + p / (N * eps**2) * Ak.T @ Ak)
    return out


def lit_Rvar(Z, Pi, Us, f):
    """ToST Eq. 4 / DMSA Eq. 15."""
    N = Z.shape[0]
    Zp = Z.T
    out = 0.0
    for k, Uk in enumerate(Us):
        pk = Pi[:, k]
        nk = pk.sum()
        M = Uk.T @ Zp @ torch.diag(pk) @ Zp.T @ Uk / nk
        out = out + 0.5 * nk / N * f(torch.diagonal(M)).sum()
    return out


def lit_Rcf(Z, Pi, f):
    """ToST Eq. 2 with F(M) = sum_i f(lambda_i(M)) over all d eigenvalues."""
    N = Z.shape[0]
    Zp = Z.T
    out = 0.0
    for k in range(Pi.shape[1]):
        pk = Pi[:, k]
        nk = pk.sum()
        ev = torch.linalg.eigvalsh(Zp @ torch.diag(pk) @ Zp.T / nk).clamp_min(0)
        out = out + 0.5 * nk / N * f(ev).sum()
    return out


def soft_pi(*shape, temp=1.0):
    return torch.softmax(temp * torch.randn(*shape, dtype=D64), -1)


def rand_orth(d, m=None):
    return torch.linalg.qr(torch.randn(d, d if m is None else m, dtype=D64))[0]


# ----------------------------------------------------------------------------- R(Z)
@pytest.mark.parametrize("N,d", [(1, 5), (4, 9), (9, 4), (7, 7), (50, 12)])
@pytest.mark.parametrize("eps", [0.1, 0.5, 2.0])
def test_coding_rate_literal_and_gram_identity(N, d, eps):
    Z = torch.randn(N, d, dtype=D64)
    R = coding_rate(Z, eps)
    assert R.shape == ()
    torch.testing.assert_close(R, lit_R(Z, eps))
    # the N x N form of the determinant identity gives the same value
    RN = 0.5 * torch.logdet(torch.eye(N, dtype=D64) + d / (N * eps**2) * Z @ Z.T)
    torch.testing.assert_close(R, RN)


def test_coding_rate_rotation_invariance_and_batched():
    Z = torch.randn(3, 2, 20, 8, dtype=D64)
    Q = rand_orth(8)
    R = coding_rate(Z, 0.3)
    assert R.shape == (3, 2)
    torch.testing.assert_close(coding_rate(Z @ Q, 0.3), R)
    loop = torch.stack([torch.stack([lit_R(Z[b, h], 0.3) for h in range(2)]) for b in range(3)])
    torch.testing.assert_close(R, loop)


def test_coding_rate_zero_features_is_zero():
    assert coding_rate(torch.zeros(5, 4, dtype=D64), 0.5).item() == 0.0


def test_coding_rate_dtypes():
    Z = torch.randn(2, 30, 16)
    ref = coding_rate(Z.double(), 0.5)
    r32 = coding_rate(Z, 0.5)
    assert r32.dtype == torch.float32
    torch.testing.assert_close(r32.double(), ref, rtol=1e-4, atol=1e-4)
    r64 = coding_rate(Z, 0.5, dtype=torch.float64)
    assert r64.dtype == torch.float64
    torch.testing.assert_close(r64, ref)
    for half in (torch.float16, torch.bfloat16):
        rh = coding_rate(Z.to(half), 0.5)
        assert rh.dtype == torch.float32 and torch.isfinite(rh).all()
        torch.testing.assert_close(rh.double(), coding_rate(Z.to(half).double(), 0.5), rtol=1e-4, atol=1e-4)
    big = (torch.randn(40, 16) * 1e3).half()
    assert torch.isfinite(coding_rate(big, 0.1)).all()


# ----------------------------------------------------------------------------- R_c(Z, Pi)
@pytest.mark.parametrize("N,d,K", [(1, 4, 2), (6, 10, 3), (25, 6, 4)])
def test_compression_rate_soft_literal(N, d, K):
    Z = torch.randn(N, d, dtype=D64)
    Pi = soft_pi(N, K)
    torch.testing.assert_close(compression_rate(Z, Pi, 0.4), lit_Rc(Z, Pi, 0.4))
    per = compression_rate(Z, Pi, 0.4, reduction="none")
    assert per.shape == (K,)
    torch.testing.assert_close(per.sum(), lit_Rc(Z, Pi, 0.4))
    torch.testing.assert_close(rate_reduction(Z, Pi, 0.4), lit_R(Z, 0.4) - lit_Rc(Z, Pi, 0.4))


@pytest.mark.parametrize("N,d", [(8, 20), (40, 6)])
def test_one_hot_pi_is_classical_mcr2(N, d):
    K = 3
    Z = torch.randn(N, d, dtype=D64)
    labels = torch.arange(N) % K
    Pi = torch.nn.functional.one_hot(labels, K).to(D64)
    torch.testing.assert_close(compression_rate(Z, Pi, 0.5), lit_Rc_onehot(Z, labels, K, 0.5))
    dR = rate_reduction(Z, Pi, 0.5)
    torch.testing.assert_close(dR, lit_R(Z, 0.5) - lit_Rc_onehot(Z, labels, K, 0.5))
    assert dR.item() >= -1e-10  # logdet concavity: R >= R_c for a partition


def test_empty_group_contributes_zero_and_grad_finite():
    Z = torch.randn(6, 4, dtype=D64)
    Pi = torch.zeros(6, 3, dtype=D64)
    Pi[:, 0] = 1.0  # groups 1, 2 empty
    per = compression_rate(Z, Pi, 0.5, reduction="none")
    assert per[1].item() == 0.0 and per[2].item() == 0.0
    # the only group holds all tokens: R_c = R
    torch.testing.assert_close(per[0], lit_R(Z, 0.5))
    Pi.requires_grad_(True)
    Zg = Z.clone().requires_grad_(True)
    compression_rate(Zg, Pi, 0.5).backward()
    assert torch.isfinite(Pi.grad).all() and torch.isfinite(Zg.grad).all()


def test_compression_rate_batched_equals_loop_and_broadcast():
    Z = torch.randn(2, 3, 9, 5, dtype=D64)
    Pi = soft_pi(2, 3, 9, 4)
    out = compression_rate(Z, Pi, 0.5)
    assert out.shape == (2, 3)
    loop = torch.stack([torch.stack([lit_Rc(Z[b, h], Pi[b, h], 0.5) for h in range(3)]) for b in range(2)])
    torch.testing.assert_close(out, loop)
    # Pi shared over heads broadcasts against Z's batch dims
    Pi1 = soft_pi(2, 1, 9, 4)
    out1 = compression_rate(Z, Pi1, 0.5)
    loop1 = torch.stack([torch.stack([lit_Rc(Z[b, h], Pi1[b, 0], 0.5) for h in range(3)]) for b in range(2)])
    torch.testing.assert_close(out1, loop1)


def test_compression_rate_rotation_invariance():
    Z = torch.randn(12, 7, dtype=D64)
    Pi = soft_pi(12, 3)
    Q = rand_orth(7)
    torch.testing.assert_close(compression_rate(Z @ Q, Pi, 0.5), compression_rate(Z, Pi, 0.5))
    torch.testing.assert_close(rate_reduction(Z @ Q, Pi, 0.5), rate_reduction(Z, Pi, 0.5))


@pytest.mark.parametrize("N,d", [(5, 9), (20, 6)])
def test_spectral_f_matches_eq2_and_default(N, d):
    Z = torch.randn(N, d, dtype=D64)
    Pi = soft_pi(N, 3)
    f_sqrt = torch.sqrt
    torch.testing.assert_close(compression_rate(Z, Pi, 0.5, f=f_sqrt), lit_Rcf(Z, Pi, f_sqrt))
    # f(0) != 0 counts the zero eigenvalues of the d x d matrix as well (N < d case)
    f_aff = lambda x: x + 1.0  # noqa: E731
    torch.testing.assert_close(compression_rate(Z, Pi, 0.5, f=f_aff), lit_Rcf(Z, Pi, f_aff))
    # with f = log(1 + d/eps^2 x), Eq. 2 is Eq. 1
    torch.testing.assert_close(compression_rate(Z, Pi, 0.5, f=logdet_f(d, 0.5)), compression_rate(Z, Pi, 0.5))


# ----------------------------------------------------------------------------- R_c(Z | U)
@pytest.mark.parametrize("N,d,K,p", [(1, 8, 2, 4), (10, 12, 3, 4), (30, 6, 2, 3)])
def test_subspace_compression_rate_literal(N, d, K, p):
    Z = torch.randn(N, d, dtype=D64)
    U = torch.randn(d, K * p, dtype=D64)
    Us = [U[:, k * p:(k + 1) * p] for k in range(K)]
    got = subspace_compression_rate(Z, U, 0.3, num_heads=K)
    torch.testing.assert_close(got, lit_Rc_subspace(Z, Us, 0.3))
    # (K, d, p) form is the same
    torch.testing.assert_close(subspace_compression_rate(Z, torch.stack(Us), 0.3), got)
    per = subspace_compression_rate(Z, U, 0.3, num_heads=K, reduction="none")
    assert per.shape == (K,)
    torch.testing.assert_close(per[1], lit_Rc_subspace(Z, Us[1:2], 0.3))


def test_subspace_compression_rate_batched_and_per_sample_bases():
    Z = torch.randn(3, 10, 8, dtype=D64)
    Ub = torch.randn(3, 2, 8, 4, dtype=D64)  # one set of bases per sample
    out = subspace_compression_rate(Z, Ub, 0.5)
    loop = torch.stack([lit_Rc_subspace(Z[b], list(Ub[b]), 0.5) for b in range(3)])
    torch.testing.assert_close(out, loop)


def test_subspace_rate_on_planted_subspaces_is_r_times_orthonormal_rate():
    # Z on span(U_1): the code of U_1 carries everything, the other codes are zero
    d, p = 12, 4
    Uo = rand_orth(d)
    U = Uo[:, : 2 * p]
    Z = torch.randn(15, p, dtype=D64) @ U[:, :p].T
    per = subspace_compression_rate(Z, U, 0.5, num_heads=2, reduction="none")
    assert abs(per[1].item()) < 1e-10
    A = Z @ U[:, :p]
    torch.testing.assert_close(per[0], 0.5 * torch.logdet(torch.eye(p, dtype=D64) + p / (15 * 0.25) * A.T @ A))


# ----------------------------------------------------------------------------- R^var (ToST Eq. 4)
@pytest.mark.parametrize("N,d,K,p", [(1, 6, 2, 3), (12, 8, 3, 8), (20, 5, 2, 2)])
def test_variational_literal(N, d, K, p):
    Z = torch.randn(N, d, dtype=D64)
    Pi = soft_pi(N, K)
    U = torch.randn(d, K * p, dtype=D64)
    Us = [U[:, k * p:(k + 1) * p] for k in range(K)]
    f = logdet_f(d, 0.5)
    torch.testing.assert_close(variational_compression_rate(Z, Pi, U, 0.5), lit_Rvar(Z, Pi, Us, f))
    torch.testing.assert_close(variational_compression_rate(Z, Pi, torch.stack(Us), 0.5), lit_Rvar(Z, Pi, Us, f))
    g = lambda x: torch.log1p(x)  # noqa: E731
    torch.testing.assert_close(variational_compression_rate(Z, Pi, U, f=g), lit_Rvar(Z, Pi, Us, g))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("fname", ["logdet", "sqrt", "log1p"])
def test_theorem1_upper_bound_and_tightness(seed, fname):
    """ToST Theorem 1: R_c,f <= R^var for orthogonal U_k, equality when U_k diagonalises
    each group covariance Z^T Diag(pi_k) Z."""
    g = torch.Generator().manual_seed(seed)
    N, d, K = 15, 6, 3
    Z = torch.randn(N, d, dtype=D64, generator=g)
    Pi = torch.softmax(torch.randn(N, K, dtype=D64, generator=g), -1)
    f = {"logdet": logdet_f(d, 0.5), "sqrt": torch.sqrt, "log1p": torch.log1p}[fname]
    Rcf = compression_rate(Z, Pi, 0.5, f=f)
    torch.testing.assert_close(Rcf, lit_Rcf(Z, Pi, f))
    Urand = torch.stack([torch.linalg.qr(torch.randn(d, d, dtype=D64, generator=g))[0] for _ in range(K)])
    Rvar = variational_compression_rate(Z, Pi, Urand, 0.5, f=f)
    assert Rvar.item() > Rcf.item() + 1e-6  # random rotations are not tight
    Ueig = torch.stack([torch.linalg.eigh(Z.T @ torch.diag(Pi[:, k]) @ Z)[1] for k in range(K)])
    torch.testing.assert_close(variational_compression_rate(Z, Pi, Ueig, 0.5, f=f), Rcf)
    # random rotation of the eigenbasis inside the feature space again gives a strict bound
    Q = torch.linalg.qr(torch.randn(d, d, dtype=D64, generator=g))[0]
    assert variational_compression_rate(Z, Pi, Ueig @ Q, 0.5, f=f).item() > Rcf.item() + 1e-6


@pytest.mark.parametrize("seed", range(3))
def test_corollary1_low_rank_bases(seed):
    """ToST Corollary 1: U_k in O(d, p) with image(Z^T Diag(pi_k) Z) in image(U_k)."""
    g = torch.Generator().manual_seed(seed)
    d, p, K, nper = 12, 3, 3, 8
    Uo = torch.linalg.qr(torch.randn(d, d, dtype=D64, generator=g))[0]
    bases = [Uo[:, k * p:(k + 1) * p] for k in range(K)]
    Z = torch.cat([torch.randn(nper, p, dtype=D64, generator=g) @ B.T for B in bases])
    labels = torch.arange(K).repeat_interleave(nper)
    Pi = torch.nn.functional.one_hot(labels, K).to(D64)
    Rc = compression_rate(Z, Pi, 0.5)
    # any orthonormal basis of each group's span: upper bound
    rot = [B @ torch.linalg.qr(torch.randn(p, p, dtype=D64, generator=g))[0] for B in bases]
    assert variational_compression_rate(Z, Pi, torch.stack(rot), 0.5).item() >= Rc.item() - 1e-10
    # p eigenvectors of each group covariance: tight
    Ueig = torch.stack([torch.linalg.eigh(Z.T @ torch.diag(Pi[:, k]) @ Z)[1][:, -p:] for k in range(K)])
    torch.testing.assert_close(variational_compression_rate(Z, Pi, Ueig, 0.5), Rc)


def test_dmsa_decoupled_form():
    """DMSA Eq. 15: sigmoid memberships (rows not on the simplex), per-sample sparsified bases U_k^S."""
    B, N, d, K, p = 2, 7, 8, 4, 2
    Z = torch.randn(B, N, d, dtype=D64)
    Pi = torch.sigmoid(torch.randn(B, N, K, dtype=D64))
    S = torch.randn(d, K * p, dtype=D64)
    mask = torch.tensor([[1.0, 0.0, 0.5, 0.5], [0.0, 0.0, 1.0, 0.0]], dtype=D64)  # ST(.) head mask per image
    US = S.reshape(d, K, p).permute(1, 0, 2)[None] * mask[:, :, None, None]  # (B, K, d, p)
    with pytest.raises(ValueError, match="simplex"):
        variational_compression_rate(Z, Pi, US, 0.5)
    out = variational_compression_rate(Z, Pi, US, 0.5, decoupled=True)
    f = logdet_f(d, 0.5)
    loop = torch.stack([lit_Rvar(Z[b], Pi[b], list(US[b]), f) for b in range(B)])
    torch.testing.assert_close(out, loop)


def test_variational_batched_equals_loop():
    Z = torch.randn(2, 3, 10, 6, dtype=D64)
    Pi = soft_pi(2, 3, 10, 3)
    U = torch.randn(6, 3 * 2, dtype=D64)
    Us = [U[:, 2 * k: 2 * k + 2] for k in range(3)]
    f = logdet_f(6, 0.5)
    out = variational_compression_rate(Z, Pi, U, 0.5)
    loop = torch.stack([torch.stack([lit_Rvar(Z[b, h], Pi[b, h], Us, f) for h in range(3)]) for b in range(2)])
    torch.testing.assert_close(out, loop)
    assert variational_compression_rate(Z, Pi, U, 0.5, reduction="none").shape == (2, 3, 3)


# ----------------------------------------------------------------------------- gradients
def test_gradcheck_rates():
    Z = torch.randn(4, 3, dtype=D64, requires_grad=True)
    Pi = soft_pi(4, 2).requires_grad_(True)
    U = torch.randn(3, 4, dtype=D64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: coding_rate(z, 0.7), (Z,))
    assert torch.autograd.gradcheck(lambda z, pi: compression_rate(z, pi, 0.7), (Z, Pi))
    assert torch.autograd.gradcheck(lambda z, u: subspace_compression_rate(z, u, 0.7, num_heads=2), (Z, U))
    assert torch.autograd.gradcheck(lambda z, pi, u: variational_compression_rate(z, pi, u, 0.7), (Z, Pi, U))


# ----------------------------------------------------------------------------- bad inputs
def test_bad_inputs():
    Z = torch.randn(2, 6, 4)
    Pi = torch.softmax(torch.randn(2, 6, 3), -1)
    U = torch.randn(4, 6)
    with pytest.raises(TypeError, match="Z must be a torch.Tensor"):
        coding_rate([[1.0]], 0.5)
    with pytest.raises(TypeError, match="floating"):
        coding_rate(torch.ones(3, 2, dtype=torch.int64), 0.5)
    with pytest.raises(ValueError, match="at least 2 dims"):
        coding_rate(torch.randn(5), 0.5)
    with pytest.raises(ValueError, match="Z has no tokens"):
        coding_rate(torch.randn(2, 0, 4), 0.5)
    with pytest.raises(ValueError, match="NaN"):
        coding_rate(torch.tensor([[float("nan"), 1.0]]), 0.5)
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="eps"):
            coding_rate(Z, bad)
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        coding_rate(Z, "0.5")
    with pytest.raises(TypeError, match="dtype"):
        coding_rate(Z, 0.5, dtype=torch.float16)
    # membership
    with pytest.raises(ValueError, match="N = 6 rows"):
        compression_rate(Z, Pi[:, :5], 0.5)
    with pytest.raises(ValueError, match="broadcastable"):
        compression_rate(Z, torch.softmax(torch.randn(3, 6, 3), -1), 0.5)
    with pytest.raises(ValueError, match="simplex"):
        compression_rate(Z, Pi * 2, 0.5)
    neg = Pi.clone()
    neg[0, 0, 0] = -0.5
    neg[0, 0, 1] += 0.5
    with pytest.raises(ValueError, match="non-negative"):
        compression_rate(Z, neg, 0.5)
    with pytest.raises(ValueError, match="simplex"):
        rate_reduction(Z, Pi + 0.1, 0.5)
    with pytest.raises(ValueError, match="non-negative"):
        variational_compression_rate(Z, neg, U, 0.5, decoupled=True)
    with pytest.raises(ValueError, match="reduction"):
        compression_rate(Z, Pi, 0.5, reduction="mean")
    with pytest.raises(TypeError, match="callable"):
        compression_rate(Z, Pi, 0.5, f=3)
    # bases
    with pytest.raises(ValueError, match="num_heads"):
        subspace_compression_rate(Z, U, 0.5)
    with pytest.raises(ValueError, match="not K\\*p"):
        subspace_compression_rate(Z, U, 0.5, num_heads=4)
    with pytest.raises(ValueError, match="d = 4"):
        subspace_compression_rate(Z, torch.randn(5, 6), 0.5, num_heads=2)
    with pytest.raises(ValueError, match="d = 4"):
        subspace_compression_rate(Z, torch.randn(2, 5, 3), 0.5)
    with pytest.raises(ValueError, match="K = 2 bases but Pi has K = 3"):
        variational_compression_rate(Z, Pi, torch.randn(2, 4, 3), 0.5)
    with pytest.raises(ValueError, match="not K\\*p"):
        variational_compression_rate(Z, Pi, torch.randn(4, 4), 0.5)  # K = 3 from Pi, 4 columns
    with pytest.raises(ValueError, match="broadcastable"):
        subspace_compression_rate(Z, torch.randn(3, 2, 4, 3), 0.5)
    with pytest.raises(TypeError, match="U must be a torch.Tensor"):  # not an AttributeError on U.dim()
        variational_compression_rate(Z, Pi, [[1.0]], 0.5)
