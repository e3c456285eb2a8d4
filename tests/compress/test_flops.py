"""MACs formulas of the IrrAtt paper (Sec. 2.2-3.4), their agreement with
torch.utils.flop_counter on the explicit path, the QK FLOPs budget and IrrAtt vs TruncAtt at an
equal budget."""
import pytest
import torch

from whiteformer.compress import (
    CPSlimAtt,
    HeadFactors,
    IrrAtt,
    LowRankLinear,
    TruncAtt,
    btd_ll1,
    qk_rank_for_budget,
    truncatt,
)
from whiteformer.compress.cp import cp
from whiteformer.compress.flops import (
    count_flops,
    cp_qk_macs,
    irratt_qk_macs,
    mhsa_macs,
    mhsa_qk_macs,
    mhsa_vo_macs,
    truncatt_qk_macs,
    vo_truncatt_macs,
)
from whiteformer.compress.truncatt import allocate_ranks_spectral, head_spectra

DT = torch.float64


def test_formulas():
    N, F, H, D = 197, 384, 6, 64
    assert mhsa_macs(N, F, H, D) == 4 * N * F * D * H + 2 * H * N * N * D
    assert mhsa_qk_macs(N, F, H, D) == N * D * H * (2 * F + N)
    assert mhsa_qk_macs(N, F, H, D) + mhsa_vo_macs(N, F, H, D) == mhsa_macs(N, F, H, D)
    assert truncatt_qk_macs(N, F, [D] * H) == mhsa_qk_macs(N, F, H, D)
    assert truncatt_qk_macs(N, F, 7, num_heads=H) == truncatt_qk_macs(N, F, [7] * H)
    assert truncatt_qk_macs(N, F, [1, 2, 3]) == N * 6 * (2 * F + N)
    assert cp_qk_macs(N, F, H, 96) == 2 * N * F * 96 + N * (N + 1) * H * 96
    assert irratt_qk_macs(N, F, [5, 0, 3], H, "identity") == 2 * N * F * 8 + N * N * 8
    assert irratt_qk_macs(N, F, [5, 0, 3], H, "general") == 2 * N * F * 8 + N * N * 8 + N * N * H * 2
    assert vo_truncatt_macs(N, F, [D] * H) == mhsa_vo_macs(N, F, H, D)


@pytest.mark.parametrize("model,rows", [
    # the IrrAtt paper's Table 1, "MHSA FLOPs CR, %" (QK method, QK rank, VO TruncAtt rank 32), N = 197
    ((384, 6), [("truncatt", 16, 37.5), ("truncatt", 22, 42.2), ("truncatt", 32, 50.0), ("cp", 96, 50.3),
                ("cp", 132, 59.7), ("cp", 192, 75.5), ("irratt", 96, 38.5), ("irratt", 132, 43.1),
                ("irratt", 192, 51.0)]),
    ((768, 12), [("truncatt", 13, 35.2), ("cp", 168, 49.7), ("irratt", 168, 37.0)]),
])
def test_table1_mhsa_flops_cr(model, rows):
    F, H = model
    N, D = 197, 64
    vo = vo_truncatt_macs(N, F, 32, num_heads=H)
    for method, r, want in rows:
        if method == "truncatt":
            qk = truncatt_qk_macs(N, F, r, num_heads=H)
        elif method == "cp":
            qk = cp_qk_macs(N, F, H, r)
        else:  # IrrAtt with general head fusion, B = H blocks
            qk = irratt_qk_macs(N, F, [r // H] * H, H, "general")
        assert 100 * (qk + vo) / mhsa_macs(N, F, H, D) == pytest.approx(want, abs=0.2)


LAYERS = [
    lambda: TruncAtt(24, num_heads=3, qk_ranks=4, vo_ranks=8),
    lambda: TruncAtt(24, num_heads=3, qk_ranks=(1, 0, 6), vo_ranks=(2, 5, 1)),
    lambda: CPSlimAtt(24, num_heads=3, rank=7, vo_ranks=(3, 3, 2)),
    lambda: IrrAtt(24, num_heads=3, ranks=[2, 5, 1, 3], fusion="general", vo_ranks=4),
    lambda: IrrAtt(24, num_heads=3, ranks=(2, 6, 0), fusion="identity", vo_ranks=(1, 2, 3)),
]


@pytest.mark.parametrize("make", LAYERS)
@pytest.mark.parametrize("B,N", [(1, 1), (1, 9), (2, 5)])
def test_flop_counter_matches_formulas(make, B, N):
    layer = make()
    x = torch.randn(B, N, 24)
    assert count_flops(layer, x) == 2 * B * layer.macs(N)
    assert layer.fused_attn  # restored
    assert count_flops(layer, x, torch.ones(B, N, dtype=torch.bool)) == 2 * B * layer.macs(N)


def test_flop_counter_lowrank_linear():
    lin = LowRankLinear(24, 40, 5)
    with pytest.raises(ValueError, match="in_features must be a positive integer, got 0"):
        LowRankLinear(0, 40, 5)
    with pytest.raises(ValueError, match="rank must be a positive integer, got True"):
        LowRankLinear(24, 40, True)
    assert count_flops(lin, torch.randn(2, 7, 24)) == 2 * 2 * lin.macs(7)


def test_budget_rank_selection():
    N, F, H, D = 197, 384, 6, 64
    orig = mhsa_qk_macs(N, F, H, D)
    assert qk_rank_for_budget("truncatt", 0.5, num_tokens=N, dim=F, num_heads=H) == 32
    assert qk_rank_for_budget("truncatt", 1.0, num_tokens=N, dim=F, num_heads=H) == 64
    for ratio in (0.3, 0.5, 0.75):
        R = qk_rank_for_budget("cp", ratio, num_tokens=N, dim=F, num_heads=H)
        assert cp_qk_macs(N, F, H, R) <= ratio * orig < cp_qk_macs(N, F, H, R + 1)
        for fusion in ("identity", "general"):
            L = qk_rank_for_budget("irratt", ratio, num_tokens=N, dim=F, num_heads=H, fusion=fusion)
            cost = lambda t: 2 * N * F * t + N * N * t + (N * N * H * H if fusion == "general" else 0)  # noqa
            assert cost(L) <= ratio * orig < cost(L + 1)
    with pytest.raises(ValueError, match="method"):
        qk_rank_for_budget("svd", 0.5, num_tokens=N, dim=F, num_heads=H)
    with pytest.raises(ValueError, match="too small"):
        qk_rank_for_budget("cp", 1e-4, num_tokens=N, dim=F, num_heads=H)
    for name, value in (("num_tokens", 0), ("dim", True), ("num_heads", 0), ("head_dim", 2.0)):
        with pytest.raises(ValueError, match=f"^{name} must be a positive integer"):
            qk_rank_for_budget("cp", 0.5, **{"num_tokens": N, "dim": F, "num_heads": H, name: value})


def heads_with_different_spectra(F=48, H=4, p=12, seed=0):
    """QK factors whose heads decay at very different rates (some nearly low rank)."""
    g = torch.Generator().manual_seed(seed)
    P, K = [], []
    for h, decay in enumerate((0.3, 0.6, 0.85, 1.0)[:H]):
        u = torch.linalg.qr(torch.randn(F, p, generator=g, dtype=DT))[0]
        v = torch.linalg.qr(torch.randn(F, p, generator=g, dtype=DT))[0]
        s = decay ** torch.arange(p, dtype=DT)
        P.append(u * s.sqrt())
        K.append(v * s.sqrt())
    return HeadFactors(torch.stack(P), torch.stack(K))


def test_irratt_error_not_larger_than_truncatt_at_equal_qk_budget():
    F, H, p, N = 48, 4, 12, 16
    Y = heads_with_different_spectra(F, H, p)
    ratio = 0.25
    r = qk_rank_for_budget("truncatt", ratio, num_tokens=N, dim=F, num_heads=H)
    e_trunc = truncatt(Y, r).rel_error
    budget = truncatt_qk_macs(N, F, r, num_heads=H)

    # identity fusion: the same MACs for the same total rank
    total = qk_rank_for_budget("irratt", ratio, num_tokens=N, dim=F, num_heads=H, fusion="identity")
    assert total == H * r
    spectral = allocate_ranks_spectral(head_spectra(Y), total, max_rank=p)
    assert irratt_qk_macs(N, F, spectral, H, "identity") <= budget
    assert truncatt(Y, spectral).rel_error <= e_trunc + 1e-12
    assert len(set(spectral)) > 1  # the heads really get different ranks

    cpres = cp(Y, total, n_iter_max=60, seed=0)
    btd_ranks = tuple(int(c) for c in torch.bincount(cpres.C.abs().argmax(0), minlength=H))  # Algorithm 1
    btd_ranks = tuple(min(x, p) for x in btd_ranks)
    assert irratt_qk_macs(N, F, btd_ranks, H, "identity") <= budget
    assert truncatt(Y, btd_ranks).rel_error <= e_trunc

    # general fusion pays N^2 H B for C: a smaller total rank within the same budget
    total_g = qk_rank_for_budget("irratt", ratio, num_tokens=N, dim=F, num_heads=H, fusion="general")
    res = btd_ll1(Y, total_g, cp_kwargs=dict(n_iter_max=60), n_iter_max=4)
    nonempty = [L for L in res.ranks if L > 0]
    assert irratt_qk_macs(N, F, nonempty, H, "general") <= budget
    assert res.rel_error <= e_trunc
