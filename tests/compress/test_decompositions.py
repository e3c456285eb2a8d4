"""Decompositions of the attention compression toolkit (IrrAtt paper): TruncAtt SVD, CP-ALS + EPC,
BTD-(L, L, 1), activation-aware whitening, spectral rank allocation."""
import itertools
import math

import pytest
import torch

from whiteformer.compress import HeadFactors, Whitening, btd_ll1, cp, truncatt
from whiteformer.compress.btd import assign_cp_terms, btd_from_cp
from whiteformer.compress.cp import cp_sensitivity
from whiteformer.compress.truncatt import allocate_ranks_spectral, head_spectra

DT = torch.float64


def rel(a, b):
    return float((a - b).norm() / b.norm())


def random_factors(H=3, I=17, J=16, p=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return HeadFactors(torch.randn(H, I, p, generator=g, dtype=DT), torch.randn(H, J, p, generator=g, dtype=DT))


def planted_head_ranks(ranks, F=24, seed=0, decay=None):
    """Dense tensor (F, F, H) whose head h has rank ranks[h] (optionally decaying spectra)."""
    g = torch.Generator().manual_seed(seed)
    slices = []
    for h, r in enumerate(ranks):
        u = torch.linalg.qr(torch.randn(F, F, generator=g, dtype=DT))[0][:, :r]
        v = torch.linalg.qr(torch.randn(F, F, generator=g, dtype=DT))[0][:, :r]
        s = torch.ones(r, dtype=DT) if decay is None else decay[h] ** torch.arange(r, dtype=DT)
        slices.append((u * s) @ v.T)
    return torch.stack(slices, dim=-1)


# ----------------------------------------------------------------------------- TruncAtt


def test_truncatt_from_factors_matches_dense_svd():
    Y = random_factors()
    dense = Y.to_tensor()
    r_fac = truncatt(Y, (1, 2, 4))
    r_den = truncatt(dense, (1, 2, 4))
    assert r_fac.ranks == (1, 2, 4)
    assert [a.shape for a in r_fac.A] == [(17, 1), (17, 2), (17, 4)]
    torch.testing.assert_close(r_fac.to_tensor(), r_den.to_tensor(), rtol=1e-9, atol=1e-9)
    # reported error is the true relative Frobenius error, and it is Eckart-Young optimal per head
    assert math.isclose(r_fac.rel_error, rel(r_fac.to_tensor(), dense), rel_tol=1e-8)
    for h, r in enumerate((1, 2, 4)):
        s = torch.linalg.svdvals(dense[:, :, h])
        err_h = (dense[:, :, h] - r_fac.to_tensor()[:, :, h]).norm() ** 2
        assert math.isclose(float(err_h), float((s[r:] ** 2).sum()), rel_tol=1e-7, abs_tol=1e-9)


def test_truncatt_full_rank_is_exact_and_keeps_dtype():
    Y = random_factors().to(torch.float32)
    res = truncatt(Y, 4)
    assert res.A[0].dtype == torch.float32
    assert res.rel_error < 1e-6
    assert rel(res.to_tensor(), Y.to_tensor()) < 1e-5


def test_spectral_allocation_recovers_planted_head_ranks():
    ranks = (1, 3, 5, 2)
    Y = planted_head_ranks(ranks)
    alloc = allocate_ranks_spectral(head_spectra(Y), sum(ranks))
    assert alloc == ranks
    assert truncatt(Y, alloc).rel_error < 1e-10
    assert truncatt(Y, 2).rel_error > 0.1  # equal ranks cannot fit this tensor


def test_spectral_allocation_is_optimal_among_all_splits():
    Y = random_factors(H=3, p=4, seed=3).to_tensor()
    spectra = head_spectra(Y)
    best = min(
        (sum(float((s[r:] ** 2).sum()) for s, r in zip(spectra, split)), split)
        for split in itertools.product(range(5), repeat=3) if sum(split) == 5
    )
    alloc = allocate_ranks_spectral(spectra, 5, max_rank=4)
    assert truncatt(Y, alloc).rel_error ** 2 * float((Y ** 2).sum()) == pytest.approx(best[0], rel=1e-8)


def test_activation_aware_truncatt_minimises_logits_error():
    F, H, p = 12, 2, 6
    g = torch.Generator().manual_seed(1)
    Y = HeadFactors(torch.randn(H, F + 1, p, generator=g, dtype=DT), torch.randn(H, F, p, generator=g, dtype=DT))
    # anisotropic calibration tokens with a mean (the query side sees [x, 1])
    X = torch.randn(200, F, generator=g, dtype=DT) * torch.logspace(1, -1, F, dtype=DT) + 0.5
    Xq = torch.cat([X, torch.ones(200, 1, dtype=DT)], dim=1)

    def logits_err(res):
        E = Y.to_tensor() - res.to_tensor()
        full = torch.einsum("ni,ijh,mj->hnm", Xq, Y.to_tensor(), X)
        return float(torch.einsum("ni,ijh,mj->hnm", Xq, E, X).norm() / full.norm())

    plain = truncatt(Y, 2)
    aware = truncatt(Y, 2, calib=X)
    assert aware.rel_error == pytest.approx(logits_err(aware), rel=1e-4)  # error reported on the logits
    assert logits_err(aware) < 0.9 * logits_err(plain)
    # a precomputed Whitening gives the same result
    wh = Whitening.from_calibration(X, Y.shape)
    torch.testing.assert_close(truncatt(Y, 2, calib=wh).to_tensor(), aware.to_tensor())


def test_whitening_roundtrip():
    X = torch.randn(50, 6, dtype=DT)
    wh = Whitening.from_calibration(X, (7, 6, 2))
    A = torch.randn(7, 3, dtype=DT)
    torch.testing.assert_close(wh.unwhiten_q(wh.whiten_q(A)), A)
    B = torch.randn(6, 3, dtype=DT)
    torch.testing.assert_close(wh.unwhiten_k(wh.whiten_k(B)), B)


# ----------------------------------------------------------------------------- CP


def planted_cp(I=12, J=10, H=6, R=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    A, B, C = (torch.randn(n, R, generator=g, dtype=DT) for n in (I, J, H))
    return torch.einsum("ir,jr,hr->ijh", A, B, C), (A, B, C)


def test_cp_recovers_planted_rank_and_factors():
    Y, (A, B, C) = planted_cp()
    res = cp(Y, 4, epc=False, n_iter_max=300, tol=1e-14)
    assert res.rel_error < 1e-6
    assert rel(res.to_tensor(), Y) < 1e-6
    # components equal up to permutation and scaling: each true a_r o b_r o c_r is matched
    for est, true in ((res.A, A), (res.B, B), (res.C, C)):
        cos = (est / est.norm(dim=0)).T @ (true / true.norm(dim=0))
        assert torch.all(cos.abs().max(dim=0).values > 0.999)


def test_cp_from_factors_equals_dense():
    Y = random_factors(H=4, I=9, J=8, p=3, seed=2)
    r1 = cp(Y, 5, epc=False, n_iter_max=50)
    r2 = cp(Y.to_tensor(), 5, epc=False, n_iter_max=50)
    assert r1.rel_error == pytest.approx(r2.rel_error, rel=1e-6)
    torch.testing.assert_close(r1.to_tensor(), r2.to_tensor(), rtol=1e-6, atol=1e-8)
    assert r1.rel_error == pytest.approx(rel(r1.to_tensor(), Y.to_tensor()), rel=1e-8)


def test_cp_als_agrees_with_tensorly():
    tl = pytest.importorskip("tensorly")
    from tensorly.decomposition import parafac

    Y = random_factors(H=5, I=10, J=9, p=3, seed=4).to_tensor()
    ours = cp(Y, 4, epc=False, n_iter_max=300, tol=1e-12).rel_error
    cpt = parafac(tl.tensor(Y.numpy()), rank=4, init="svd", n_iter_max=300, tol=1e-12)
    theirs = float(tl.norm(Y.numpy() - tl.cp_to_tensor(cpt)) / tl.norm(Y.numpy()))
    assert abs(ours - theirs) <= 0.05 * theirs + 1e-3


def test_cp_epc_keeps_error_and_reduces_norms():
    # an over-parametrised CP (R = 16 for 4 heads of rank 3): ALS leaves large, partly cancelling terms
    Y = random_factors(H=4, I=10, J=10, p=3, seed=5)
    als = cp(Y, 16, epc=False, n_iter_max=200, tol=0)
    res = cp(Y, 16, epc=True, n_iter_max=200, tol=0, epc_iter_max=50)
    Y = Y.to_tensor()
    assert res.epc and res.als_rel_error == pytest.approx(als.rel_error, rel=1e-10)
    assert abs(res.rel_error - res.als_rel_error) <= 0.01 * res.als_rel_error
    assert res.rel_error == pytest.approx(rel(res.to_tensor(), Y), rel=1e-6)
    assert res.sensitivity < 0.9 * res.als_sensitivity
    assert res.factor_norm_sq() < 0.9 * als.factor_norm_sq()
    assert res.sensitivity == pytest.approx(cp_sensitivity([res.A, res.B, res.C]))


# ----------------------------------------------------------------------------- BTD-(L, L, 1)


def planted_btd(ranks=(1, 2, 4, 3), F=20, mix=0.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    H = len(ranks)
    C = torch.eye(H, dtype=DT) + mix * torch.rand(H, H, generator=g, dtype=DT)
    Y = torch.zeros(F, F, H, dtype=DT)
    for b, L in enumerate(ranks):
        A = torch.randn(F, L, generator=g, dtype=DT)
        B = torch.randn(F, L, generator=g, dtype=DT)
        Y += (A @ B.T)[:, :, None] * C[:, b]
    return Y


def test_algorithm1_assignment():
    C = torch.tensor([[0.1, -3.0, 0.2], [2.0, 1.0, 0.1], [0.5, 0.0, -0.4]], dtype=DT)
    head, scale = assign_cp_terms(C)
    assert head.tolist() == [1, 0, 2]
    assert scale.tolist() == [2.0, -3.0, -0.4]
    A, B = torch.randn(5, 3, dtype=DT), torch.randn(4, 3, dtype=DT)
    ba, bb, Cb, ranks = btd_from_cp([A, B, C])
    assert ranks == (1, 1, 1) and torch.equal(Cb, torch.eye(3, dtype=DT))
    torch.testing.assert_close(ba[0][:, 0], A[:, 1] * -3.0)


def test_btd_recovers_planted_block_ranks():
    ranks = (1, 2, 4, 3)
    Y = planted_btd(ranks)
    res = btd_ll1(Y, sum(ranks), cp_kwargs=dict(n_iter_max=500, tol=1e-13), n_iter_max=20)
    assert res.ranks == ranks
    assert res.rel_error < 1e-6
    assert rel(res.to_tensor(), Y) == pytest.approx(res.rel_error, abs=1e-8)


def test_btd_refinement_never_increases_error():
    Y = random_factors(H=4, I=12, J=12, p=4, seed=6)
    res = btd_ll1(Y, 8, cp_kwargs=dict(n_iter_max=30), n_iter_max=6)
    hist = res.history
    assert len(hist) >= 2 and hist[0] == res.init_rel_error
    assert all(b <= a + 1e-12 for a, b in zip(hist, hist[1:]))
    assert res.rel_error == pytest.approx(rel(res.to_tensor(), Y.to_tensor()), rel=1e-6)
    assert sum(res.ranks) == 8 and len(res.ranks) == 4
    # starting from per-head SVD (C = I) the refinement can only improve on TruncAtt with those ranks
    ranks = (1, 3, 2, 2)
    res2 = btd_ll1(Y, ranks=ranks, n_iter_max=4)
    assert res2.init_rel_error == pytest.approx(truncatt(Y, ranks).rel_error, rel=1e-8)
    assert res2.rel_error <= res2.init_rel_error + 1e-12


def test_btd_activation_aware_reports_logits_error():
    Y = random_factors(H=3, I=9, J=8, p=3, seed=7)
    X = torch.randn(100, 8, dtype=DT) * torch.linspace(2, 0.2, 8, dtype=DT)
    res = btd_ll1(Y, 5, calib=X, cp_kwargs=dict(n_iter_max=40), n_iter_max=3)
    Xq = torch.cat([X, torch.ones(100, 1, dtype=DT)], 1)
    full = torch.einsum("ni,ijh,mj->hnm", Xq, Y.to_tensor(), X)
    err = torch.einsum("ni,ijh,mj->hnm", Xq, Y.to_tensor() - res.to_tensor(), X)
    assert float(err.norm() / full.norm()) == pytest.approx(res.rel_error, rel=1e-3)


# ----------------------------------------------------------------------------- errors


def test_decomposition_bad_inputs():
    Y = random_factors()
    with pytest.raises(ValueError, match="out of range"):
        truncatt(Y, 5)  # p = 4
    with pytest.raises(ValueError, match="one rank per head"):
        truncatt(Y, (1, 2))
    with pytest.raises(ValueError, match="out of range"):
        truncatt(Y, (1, -1, 2))
    with pytest.raises(ValueError, match="3-D"):
        truncatt(torch.randn(4, 4), 1)
    with pytest.raises(TypeError, match="HeadFactors"):
        cp([[1.0]], 2)
    with pytest.raises(ValueError, match="positive int"):
        cp(Y, 0)
    with pytest.raises(ValueError, match="NaN"):
        cp(torch.full((3, 3, 2), float("nan")), 1)
    with pytest.raises(ValueError, match="not both"):
        btd_ll1(Y, 4, ranks=(1, 1, 2))
    with pytest.raises(ValueError, match="needs the total rank"):
        btd_ll1(Y)
    with pytest.raises(TypeError, match="cp_result must be a CPResult, got tuple"):
        btd_ll1(Y, cp_result=(Y.P, Y.K))
    with pytest.raises(ValueError, match="must agree"):
        truncatt(HeadFactors(torch.randn(2, 5, 3), torch.randn(3, 5, 3)), 1)
    with pytest.raises(ValueError, match=r"HeadFactors.P must be a 3-D tensor \(H, I, p\), got shape \(5, 3\)"):
        cp(HeadFactors(torch.randn(5, 3), torch.randn(2, 5, 3)), 1)
    with pytest.raises(TypeError, match="HeadFactors.K must be a floating tensor"):
        btd_ll1(HeadFactors(torch.randn(2, 5, 3), torch.ones(2, 5, 3, dtype=torch.long)), 2)
    with pytest.raises(ValueError, match="does not fit"):
        truncatt(Y, 2, calib=torch.randn(10, 5))
    with pytest.raises(ValueError, match="exceeds"):
        allocate_ranks_spectral(head_spectra(Y), 13)
