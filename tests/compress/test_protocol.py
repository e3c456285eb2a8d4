"""IrrAtt's comparison protocols: equal total QK rank (the paper's Table 1) and
equal QK FLOPs (ours), and the rank allocation (cap at the head dim, re-spend what the cap frees),
on MHSA blocks with planted per-head QK ranks."""
import pytest
import torch

from whiteformer.attention import MHSA
from whiteformer.compress import compress, compress_attention, qk_rank_for_budget
from whiteformer.compress.btd import _cap_and_respend
from whiteformer.compress.truncatt import allocate_ranks_spectral

DT = torch.float64
F, P = 64, 16   # 4 heads of dim 16
N = 50
CPK = dict(cp_kwargs=dict(n_iter_max=25))  # a short CP-ALS keeps the tests fast


def planted(ranks, decay=None, scales=None, seed=0) -> MHSA:
    """MHSA whose QK slice of head h is ``U_h diag(s) V_h^T`` of rank ``ranks[h]`` (flat s = 1, or
    ``decay**i``), times ``scales[h]``."""
    H = len(ranks)
    g = torch.Generator().manual_seed(seed)
    attn = MHSA(F, num_heads=H, qkv_bias=False).to(DT)
    W = torch.zeros(3 * F, F, dtype=DT)
    for h, r in enumerate(ranks):
        u = torch.linalg.qr(torch.randn(F, P, generator=g, dtype=DT))[0]
        v = torch.linalg.qr(torch.randn(F, P, generator=g, dtype=DT))[0]
        s = torch.zeros(P, dtype=DT)
        s[:r] = 1.0 if decay is None else decay ** torch.arange(r, dtype=DT)
        s = s * (1.0 if scales is None else scales[h])
        W[h * P:(h + 1) * P] = (u * s.sqrt()).T
        W[F + h * P:F + (h + 1) * P] = (v * s.sqrt()).T
    W[2 * F:] = torch.randn(F, F, generator=g, dtype=DT) / 8
    with torch.no_grad():
        attn.qkv.weight.copy_(W)
    return attn


SPECTRA = [pytest.param(None, id="flat"), pytest.param(0.7, id="decaying")]
RANKS = [(2, 4, 10, 16), (1, 3, 12, 16)]


@pytest.mark.parametrize("decay", SPECTRA)
@pytest.mark.parametrize("ranks", RANKS)
def test_equal_total_rank_irratt_error_not_above_truncatt(decay, ranks):
    attn = planted(ranks, decay)
    total = 24  # TruncAtt 4 x 6
    _, tr = compress_attention(attn, qk="truncatt", qk_rank=total, protocol="rank", num_tokens=N, **CPK)
    assert tr.qk_ranks == (6, 6, 6, 6) and tr.qk_total_rank == total
    for fusion in ("general", "identity"):
        _, ir = compress_attention(attn, qk="irratt", qk_rank=total, fusion=fusion, protocol="rank", num_tokens=N,
                                   **CPK)
        assert ir.qk_total_rank == total and max(ir.qk_ranks) <= P
        assert ir.qk_rel_error <= tr.qk_rel_error + 1e-9, (fusion, ir.qk_ranks)
        assert len(set(ir.head_ranks)) > 1  # irregular ranks, as planted
    _, c = compress_attention(attn, qk="cp", qk_rank=total, protocol="rank", num_tokens=N, **CPK)
    assert c.qk_ranks == (total,)


@pytest.mark.parametrize("decay", SPECTRA)
@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("allocation", ["btd", "spectral"])
def test_equal_flops_identity_irratt_never_worse_than_truncatt(decay, ranks, allocation):
    attn = planted(ranks, decay)
    for ratio in (0.25, 0.5):
        _, tr = compress_attention(attn, qk="truncatt", qk_flops_ratio=ratio, num_tokens=N)
        _, ir = compress_attention(attn, qk="irratt", qk_flops_ratio=ratio, fusion="identity",
                                   rank_allocation=allocation, num_tokens=N, **CPK)
        assert ir.qk_macs <= ratio * tr.qk_macs_orig and ir.qk_macs >= tr.qk_macs
        assert ir.qk_rel_error <= tr.qk_rel_error + 1e-9, (ratio, ir.qk_ranks)


def test_rank_protocol_gives_every_method_truncatt_total_rank():
    attn = planted((2, 4, 10, 16), 0.7)
    ratio = 0.25
    r = qk_rank_for_budget("truncatt", ratio, num_tokens=N, dim=F, num_heads=4)
    for qk, fusion, expect in (("truncatt", "general", (r,) * 4), ("cp", "general", (4 * r,))):
        _, rep = compress_attention(attn, qk=qk, qk_flops_ratio=ratio, protocol="rank", num_tokens=N, fusion=fusion,
                                    **CPK)
        assert rep.qk_ranks == expect and rep.qk_total_rank == 4 * r
    _, g = compress_attention(attn, qk="irratt", qk_flops_ratio=ratio, protocol="rank", num_tokens=N, **CPK)
    _, gf = compress_attention(attn, qk="irratt", qk_flops_ratio=ratio, protocol="flops", num_tokens=N, **CPK)
    assert g.qk_total_rank == 4 * r and g.qk_macs > ratio * g.qk_macs_orig  # the paper: fusion paid on top
    assert gf.qk_total_rank < 4 * r and gf.qk_macs <= ratio * gf.qk_macs_orig  # ours: fusion paid from the budget


@pytest.mark.parametrize("fusion", ["identity", "general"])
def test_capped_heads_respend_their_rank(fusion):
    # head 0 dominates: Algorithm 1 gives it more CP terms than its dim P
    attn = planted((16, 16, 16, 16), decay=0.9, scales=(10, 1, 0.1, 0.1))
    _, rep = compress_attention(attn, qk="irratt", qk_rank=40, fusion=fusion, num_tokens=N, **CPK)
    assert max(rep.details["cp_head_ranks"]) > P
    assert max(rep.head_ranks) <= P and sum(rep.head_ranks) == 40


def test_allocate_from_start_takes_next_largest_singular_values():
    spectra = [torch.tensor([5.0, 4.0, 1.0]), torch.tensor([3.0, 2.5, 0.5]), torch.tensor([0.9, 0.8, 0.1])]
    # from (1, 0, 0) the next values are 4, 3, 2.5, 1 | 0.9: four more units -> (3, 2, 0)
    assert allocate_ranks_spectral(spectra, 5, start=(1, 0, 0)) == (3, 2, 0)
    assert allocate_ranks_spectral(spectra, 5, start=(0, 0, 3)) == (2, 0, 3)
    with pytest.raises(ValueError, match="start"):
        allocate_ranks_spectral(spectra, 2, start=(3, 0, 0))


def test_cap_and_respend_keeps_total_and_lowers_error():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(6, 6, 3, generator=g, dtype=DT)
    a, b = ([torch.randn(6, r, generator=g, dtype=DT) for r in (5, 1, 0)] for _ in range(2))
    a2, b2, ranks = _cap_and_respend(X, a, b, (5, 1, 0), cap=3)
    assert ranks[0] == 3 and sum(ranks) == 6 and max(ranks) <= 3
    assert all(x.shape[1] == r and y.shape[1] == r for x, y, r in zip(a2, b2, ranks))


def test_protocol_errors_and_model_level_option():
    attn = planted((2, 4, 10, 16))
    with pytest.raises(ValueError, match="protocol"):
        compress_attention(attn, qk="truncatt", qk_rank=4, protocol="params")
    with pytest.raises(ValueError, match="multiple of num_heads"):
        compress_attention(attn, qk="truncatt", qk_rank=10, protocol="rank")
    with pytest.raises(ValueError, match=r"\[0, 16\]"):
        compress_attention(attn, qk="irratt", qk_rank=(20, 2, 1, 1), fusion="general")

    from whiteformer import create_model
    model = create_model("deit_t_p16", img_size=16, patch_size=8, embed_dim=32, depth=1, num_heads=2,
                         num_classes=3)
    with pytest.raises(ValueError, match="protocol"):
        compress(model, qk="cp", qk_flops_ratio=0.5, protocol="equal")
    _, rep = compress(model, qk="cp", qk_flops_ratio=0.5, protocol="rank", vo=None)
    assert rep.config["protocol"] == "rank" and rep.blocks[0]["qk_total_rank"] == 2 * 8


@pytest.mark.parametrize("ratio", [0, 1.5, float("nan"), "0.5", True])
def test_a_flops_ratio_outside_0_1_is_refused_before_any_block_is_compressed(monkeypatch, ratio):
    """compress() checks qk_flops_ratio at its door, before calibrating or counting a block, as
    qk_rank_for_budget does for a direct call."""
    import whiteformer.compress.model as compress_model
    from whiteformer import create_model

    message = r"^qk_flops_ratio must be a number in \(0, 1\], got "
    with pytest.raises(ValueError, match=message):
        qk_rank_for_budget("truncatt", ratio, num_tokens=10, dim=16, num_heads=2, head_dim=8)
    model = create_model("deit_t_p16", img_size=16, patch_size=8, embed_dim=32, depth=1, num_heads=2,
                         num_classes=3)
    monkeypatch.setattr(compress_model, "collect_block_inputs", None)  # no block work before the check
    with pytest.raises(ValueError, match=message):
        compress(model, qk="truncatt", qk_flops_ratio=ratio, calib=torch.randn(2, 3, 16, 16))
