"""Compressed attention layers (TruncAtt, CP SlimAtt, IrrAtt, VO TruncAtt), compress_attention on a
timm-layout MHSA block, MLP compression and the rank-constrained head fusion (IrrAtt paper)."""
import numpy as np
import pytest
import torch
import torch.nn as nn

from whiteformer.attention import build, list_attention
from whiteformer.compress import (
    CPSlimAtt,
    IrrAtt,
    LowRankLinear,
    TruncAtt,
    compress_attention,
    compress_linear,
    compress_mlp,
    qk_factors,
    vo_factors,
)
from whiteformer.compress.constraints import fusion_head_ranks, fusion_penalty, project_fusion
from whiteformer.compress.reference import attention_from_tensors

DT = torch.float64


class Attention(nn.Module):
    """Tiny timm-layout MHSA (qkv (3, H, p) rows, proj), with the library's (B, N) keep-mask contract."""

    def __init__(self, dim, num_heads=4, qkv_bias=True, proj_bias=True):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.q_norm, self.k_norm = nn.Identity(), nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x, attn_mask=None):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        logits = (q * self.scale) @ k.transpose(-2, -1)
        if attn_mask is not None:
            allowed = attn_mask[:, None, None, :] | ~attn_mask[:, None, :, None]
            logits = logits.masked_fill(~allowed, float("-inf"))
        y = self.proj((logits.softmax(-1) @ v).transpose(1, 2).reshape(B, N, C))
        return y if attn_mask is None else y.masked_fill(~attn_mask[..., None], 0.0)


def make_attn(F=32, H=4, qkv_bias=True, proj_bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    m = Attention(F, H, qkv_bias, proj_bias)
    with torch.no_grad():
        if qkv_bias:
            m.qkv.bias.normal_(0, 1.0)  # large biases: the key-dependent query-bias term matters
        if proj_bias:
            m.proj.bias.normal_()
    return m.to(dtype)


def rel(a, b):
    return float((a - b).norm() / b.norm())


def randomize(layer, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return layer


LAYERS = {
    "truncatt_equal": lambda: TruncAtt(16, num_heads=4, qk_ranks=3, vo_ranks=2),
    "truncatt_irregular": lambda: TruncAtt(16, num_heads=4, qk_ranks=(1, 0, 4, 2), vo_ranks=(4, 1, 0, 3)),
    "cp_slimatt": lambda: CPSlimAtt(16, num_heads=4, rank=6, vo_ranks=(2, 3, 1, 2)),
    "irratt_general": lambda: IrrAtt(16, num_heads=4, ranks=[3, 1, 2], fusion="general", vo_ranks=2),
    "irratt_general_equal": lambda: IrrAtt(16, num_heads=4, ranks=2, fusion="general"),
    "irratt_identity": lambda: IrrAtt(16, num_heads=4, ranks=(5, 0, 1, 2), fusion="identity"),
}


# ----------------------------------------------------------------------------- exactness at full rank


@pytest.mark.parametrize("qkv_bias,proj_bias", [(True, True), (False, True), (True, False), (False, False)])
@pytest.mark.parametrize("qk,kw", [
    ("truncatt", dict(qk_rank=8, vo_rank=8)),
    (None, dict(vo_rank=8)),
    (None, {}),
    ("irratt", dict(qk_rank=(8, 8, 8, 8), fusion="identity", vo_rank=8)),
    ("irratt", dict(qk_rank=(8, 8, 8, 8), fusion="general", allow_growth=True)),  # fusion: N^2 H B MACs more
])
def test_full_rank_reproduces_block(qk, kw, qkv_bias, proj_bias):
    attn = make_attn(32, 4, qkv_bias, proj_bias)
    layer, report = compress_attention(attn, qk=qk, **kw)
    x = torch.randn(3, 9, 32)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, 6:] = False
    for fused in (True, False):
        layer.fused_attn = fused
        assert rel(layer(x), attn(x)) <= 1e-4
        assert rel(layer(x, mask), attn(x, mask)) <= 1e-4
    assert report.qk_rel_error < 1e-6 and report.vo_rel_error < 1e-6


def test_query_bias_key_term_is_needed():
    """Dropping the key-dependent term x_j . W^K b^Q would change the outputs (it is kept exactly)."""
    attn = make_attn(32, 4)
    x = torch.randn(2, 7, 32)
    layer, _ = compress_attention(attn, qk="truncatt", qk_rank=8)
    with torch.no_grad():
        layer.q.bias.zero_()
    assert rel(layer(x), attn(x)) > 1e-3


def test_qk_vo_factors_layout():
    attn = make_attn(12, 3).double()
    x = torch.randn(2, 5, 12, dtype=DT)
    yqk = qk_factors(attn).to_tensor() * attn.scale
    yvo, bias = vo_factors(attn)
    ref = attention_from_tensors(x, yqk, yvo.to_tensor(), bias)
    torch.testing.assert_close(ref, attn(x))


# ----------------------------------------------------------------------------- layers vs reference


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("N", [1, 6])
def test_layer_matches_reference_forward_and_grads(name, N):
    layer = randomize(LAYERS[name]().double())
    x = torch.randn(2, N, 16, dtype=DT, requires_grad=True)
    mask = torch.ones(2, N, dtype=torch.bool)
    mask[0, N // 2 + 1:] = False
    for m in (None, mask):
        x.grad = None
        ref = attention_from_tensors(x, layer.qk_tensor(), layer.vo_tensor(), layer.proj.bias, m)
        gx_ref, *gp_ref = torch.autograd.grad(ref.pow(2).sum(), [x, *layer.parameters()])
        for fused in (True, False):
            layer.fused_attn = fused
            out = layer(x, m)
            torch.testing.assert_close(out, ref)
            gx, *gp = torch.autograd.grad(out.pow(2).sum(), [x, *layer.parameters()])
            torch.testing.assert_close(gx, gx_ref)
            for a, b in zip(gp, gp_ref):
                torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", list(LAYERS))
def test_gradcheck(name):
    layer = randomize(LAYERS[name]().double(), seed=1)
    x = torch.randn(1, 3, 16, dtype=DT, requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    assert torch.autograd.gradcheck(lambda t: layer(t, mask), (x,))
    layer.fused_attn = False
    assert torch.autograd.gradcheck(lambda t: layer(t), (x,))


@pytest.mark.parametrize("name", ["truncatt_irregular", "cp_slimatt", "irratt_general"])
def test_padding_mask_equivalence(name):
    layer = randomize(LAYERS[name]())
    x = torch.randn(2, 7, 16)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 4:] = False
    out = layer(x, mask)
    torch.testing.assert_close(out[1, :4], layer(x[1:, :4])[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[0], layer(x[:1])[0], rtol=1e-5, atol=1e-5)
    assert torch.all(out[1, 4:] == 0)


@pytest.mark.parametrize("name", ["truncatt_irregular", "cp_slimatt", "irratt_general"])
def test_half_precision(name):
    layer = randomize(LAYERS[name]())
    x = torch.randn(2, 5, 16) * 1e3
    y16 = layer.half()(x.half())
    assert y16.dtype == torch.float16 and torch.isfinite(y16).all()
    layer.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yb = layer(x / 1e3)
    assert yb.dtype == torch.float32 and torch.isfinite(yb).all()
    assert rel(yb, layer(x / 1e3)) < 0.05
    yb16 = layer.bfloat16()(x.bfloat16() / 1e3)
    assert yb16.dtype == torch.bfloat16 and torch.isfinite(yb16).all()


@pytest.mark.compile
@pytest.mark.parametrize("name", ["truncatt_irregular", "cp_slimatt", "irratt_general"])
@torch.no_grad()  # an inference graph only: keeps the compile time small
def test_compile_fullgraph(name):
    torch._dynamo.reset()
    layer = randomize(LAYERS[name]()).eval()
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x, mask), layer(x, mask), rtol=1e-5, atol=1e-5)


def test_registry_builds_layers():
    assert {"truncatt", "cp_slimatt", "irratt"} <= set(list_attention())
    m = build("irratt", 16, num_heads=4, ranks=[2, 2, 3], fusion="general")
    assert isinstance(m, IrrAtt) and m(torch.randn(1, 3, 16)).shape == (1, 3, 16)
    assert build("truncatt", 16, num_heads=2).qk_ranks == (8, 8)
    assert build("cp_slimatt", 16, num_heads=2, rank=5).fusion.shape == (2, 5)


def test_layer_bad_inputs():
    layer = TruncAtt(16, num_heads=4, qk_ranks=2)
    with pytest.raises(ValueError, match="3 dimensions"):
        layer(torch.randn(4, 16))
    with pytest.raises(ValueError, match="last dimension 16"):
        layer(torch.randn(1, 3, 8))
    with pytest.raises(ValueError, match="no tokens"):
        layer(torch.randn(1, 0, 16))
    with pytest.raises(TypeError, match="floating"):
        layer(torch.ones(1, 3, 16, dtype=torch.long))
    with pytest.raises(TypeError, match="bool or 0/1 integer"):
        layer(torch.randn(1, 3, 16), torch.ones(1, 3))
    with pytest.raises(ValueError, match="shape"):
        layer(torch.randn(1, 3, 16), torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="divisible"):
        TruncAtt(15, num_heads=4)
    with pytest.raises(ValueError, match="one rank per head"):
        TruncAtt(16, num_heads=4, qk_ranks=(1, 2))
    with pytest.raises(ValueError, match="out of range"):
        TruncAtt(16, num_heads=4, qk_ranks=17)
    with pytest.raises(ValueError, match="fusion"):
        IrrAtt(16, num_heads=4, fusion="diag")
    with pytest.raises(ValueError, match="out of range"):
        IrrAtt(16, num_heads=4, ranks=[2, 0, 1], fusion="general")
    with pytest.raises(ValueError, match="rank out of range"):
        CPSlimAtt(16, num_heads=4, rank=0)
    with pytest.raises(ValueError, match="ranks must not all be zero"):
        IrrAtt(16, num_heads=4, ranks=[], fusion="general")
    with pytest.raises(ValueError, match="attn_drop"):
        TruncAtt(16, num_heads=4, attn_drop=1.5)


# ----------------------------------------------------------------------------- compress_attention


def test_irratt_identity_equal_ranks_equals_truncatt():
    attn = make_attn(32, 4)
    x = torch.randn(2, 6, 32)
    t, rt = compress_attention(attn, qk="truncatt", qk_rank=3, vo_rank=5)
    i1, ri = compress_attention(attn, qk="irratt", qk_rank=(3, 3, 3, 3), fusion="identity", vo_rank=5)
    torch.testing.assert_close(i1(x), t(x))
    assert ri.qk_macs == rt.qk_macs and ri.qk_rel_error == pytest.approx(rt.qk_rel_error)
    # BTD-initialised general fusion from equal per-head ranks starts at TruncAtt, C = I exactly gives TruncAtt
    i2, _ = compress_attention(attn, qk="irratt", qk_rank=(3, 3, 3, 3), fusion="general",
                               btd_kwargs=dict(n_iter_max=0))
    torch.testing.assert_close(i2.fusion.data, torch.eye(4))
    torch.testing.assert_close(i2.qk_tensor(), t.qk_tensor(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qk,kw", [
    ("truncatt", dict(qk_rank=4)),
    ("cp", dict(qk_rank=20, cp_kwargs=dict(n_iter_max=30))),
    ("irratt", dict(qk_rank=16, cp_kwargs=dict(n_iter_max=30), btd_kwargs=dict(n_iter_max=3))),
    ("irratt", dict(qk_rank=16, fusion="identity", cp_kwargs=dict(n_iter_max=30))),
    ("irratt", dict(qk_rank=16, fusion="identity", rank_allocation="spectral")),
])
def test_compress_attention_report_is_consistent(qk, kw):
    attn = make_attn(32, 4)
    layer, rep = compress_attention(attn, qk=qk, vo_rank=6, num_tokens=10, **kw)
    F, H, p = 32, 4, 8
    qk_true = qk_factors(attn).to_tensor() * attn.scale
    assert rep.qk_rel_error == pytest.approx(rel(layer.qk_tensor(), qk_true), rel=1e-3)
    vo_true = vo_factors(attn)[0].to_tensor()
    assert rep.vo_rel_error == pytest.approx(rel(layer.vo_tensor(), vo_true), rel=1e-3)
    assert rep.vo_ranks == (6,) * 4 and rep.qk_macs == layer.qk_macs(10)
    assert rep.qk_macs_orig == 10 * p * H * (2 * F + 10)
    assert rep.params == sum(p.numel() for p in layer.parameters())
    assert rep.params_orig == sum(p.numel() for p in attn.parameters())
    assert 0 < rep.flops_ratio < 1 and not rep.activation_aware
    if qk == "irratt":
        assert sum(rep.head_ranks) == 16 or rep.fusion == "identity"
    assert set(rep.to_dict()) >= {"qk_flops_ratio", "flops_ratio", "qk_ranks"}


@pytest.mark.parametrize("qk,fusion", [("truncatt", "general"), ("cp", "general"), ("irratt", "general"),
                                       ("irratt", "identity")])
def test_budget_is_respected(qk, fusion):
    attn = make_attn(32, 4)
    layer, rep = compress_attention(attn, qk=qk, qk_flops_ratio=0.4, num_tokens=12, fusion=fusion,
                                    cp_kwargs=dict(n_iter_max=20), btd_kwargs=dict(n_iter_max=2))
    assert rep.qk_flops_ratio <= 0.4
    assert rep.qk_macs == layer.qk_macs(12)


def test_activation_aware_compression_lowers_logits_error():
    attn = make_attn(32, 4)
    calib = torch.randn(4, 20, 32) * torch.logspace(0.5, -1, 32) + 0.3
    plain, _ = compress_attention(attn, qk="truncatt", qk_rank=2, vo_rank=3)
    aware, rep = compress_attention(attn, qk="truncatt", qk_rank=2, vo_rank=3, calib=calib)
    assert rep.activation_aware

    def logits(m_qk):
        x = calib.reshape(-1, 32).double()
        xq = torch.cat([x, torch.ones(len(x), 1, dtype=DT)], 1)
        return torch.einsum("ni,ijh,mj->hnm", xq, m_qk.double(), x)

    true = logits(qk_factors(attn).to_tensor() * attn.scale)
    e_plain, e_aware = rel(logits(plain.qk_tensor()), true), rel(logits(aware.qk_tensor()), true)
    assert e_aware < 0.9 * e_plain
    assert rep.qk_rel_error == pytest.approx(e_aware, rel=1e-3)
    y = attn(calib)
    assert rel(aware(calib), y) < rel(plain(calib), y)


def test_compress_attention_bad_inputs():
    attn = make_attn(32, 4)
    with pytest.raises(TypeError, match="timm-layout MHSA"):
        compress_attention(nn.Linear(4, 4), qk="truncatt", qk_rank=1)
    with pytest.raises(TypeError, match="nn.Module"):
        compress_attention("attn", qk="truncatt", qk_rank=1)
    bad = make_attn(32, 4)
    bad.num_heads = 5
    with pytest.raises(ValueError, match="divisible"):
        compress_attention(bad, qk="truncatt", qk_rank=1)
    bad = make_attn(32, 4)
    bad.proj = nn.Linear(32, 16)
    with pytest.raises(ValueError, match="proj must be"):
        compress_attention(bad, qk="truncatt", qk_rank=1)
    bad = make_attn(32, 4)
    bad.qkv = nn.Linear(32, 64)
    with pytest.raises(ValueError, match="qkv must map"):
        compress_attention(bad, qk="truncatt", qk_rank=1)
    bad = make_attn(32, 4)
    bad.q_norm = nn.LayerNorm(8)
    with pytest.raises(ValueError, match="q_norm"):
        compress_attention(bad, qk="truncatt", qk_rank=1)
    bad = make_attn(32, 4)
    bad.causal = True
    with pytest.raises(ValueError, match="causal"):
        compress_attention(bad, qk="truncatt", qk_rank=1)
    with pytest.raises(ValueError, match="out of range"):
        compress_attention(attn, qk="truncatt", qk_rank=9)
    with pytest.raises(ValueError, match="out of range"):
        compress_attention(attn, qk="truncatt", qk_rank=0)
    with pytest.raises(ValueError, match="out of range"):
        compress_attention(attn, qk=None, vo_rank=9)
    with pytest.raises(ValueError, match="one rank per head"):
        compress_attention(attn, qk="truncatt", qk_rank=(1, 2, 3))
    with pytest.raises(ValueError, match="exactly one of"):
        compress_attention(attn, qk="truncatt")
    with pytest.raises(ValueError, match="exactly one of"):
        compress_attention(attn, qk="truncatt", qk_rank=2, qk_flops_ratio=0.5)
    with pytest.raises(ValueError, match="qk must be one of"):
        compress_attention(attn, qk="svd", qk_rank=2)
    with pytest.raises(ValueError, match="too small"):
        compress_attention(attn, qk="truncatt", qk_flops_ratio=0.01)
    with pytest.raises(ValueError, match="qk_flops_ratio must be"):
        compress_attention(attn, qk="truncatt", qk_flops_ratio=1.5)
    with pytest.raises(ValueError, match="exceeds"):
        compress_attention(attn, qk="irratt", qk_rank=33, fusion="identity")
    with pytest.raises(ValueError, match="qk_rank must be a positive integer, got 0"):
        compress_attention(attn, qk="irratt", qk_rank=0, fusion="identity")
    # a NumPy integer is an integer total rank (it was refused as "not a positive total rank")
    _, rep = compress_attention(attn, qk="irratt", qk_rank=np.int64(8), fusion="identity", rank_allocation="spectral")
    assert rep.qk_total_rank == 8
    with pytest.raises(ValueError, match="calib has feature size 16"):
        compress_attention(attn, qk="truncatt", qk_rank=2, calib=torch.randn(5, 16))
    with pytest.raises(ValueError, match=r"calib must be a tensor of tokens \(\.\.\., F\), got list"):
        compress_attention(attn, qk="truncatt", qk_rank=2, calib=[[0.0] * 32])


# ----------------------------------------------------------------------------- MLP and fusion constraints


class Mlp(nn.Module):
    def __init__(self, F=16, hidden=40):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(F, hidden), nn.GELU(), nn.Linear(hidden, F)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_compress_linear_and_mlp():
    torch.manual_seed(0)
    lin = nn.Linear(12, 20)
    x = torch.randn(30, 12)
    full = compress_linear(lin, 12)
    torch.testing.assert_close(full(x), lin(x), rtol=1e-5, atol=1e-5)
    low = compress_linear(lin, 4)
    s = torch.linalg.svdvals(lin.weight.double())
    err = (low.weight() - lin.weight).norm() ** 2
    assert float(err) == pytest.approx(float((s[4:] ** 2).sum()), rel=1e-4)  # Eckart-Young
    assert low.macs(30) == 30 * 4 * (12 + 20)
    calib = torch.randn(200, 12) * torch.logspace(1, -1, 12)
    aware = compress_linear(lin, 4, calib=calib)
    assert rel(aware(calib), lin(calib)) < rel(low(calib), lin(calib))
    mlp = Mlp()
    small = compress_mlp(mlp, (6, 8), calib=torch.randn(5, 16))
    assert isinstance(small.fc1, LowRankLinear) and small.fc1.rank == 6 and small.fc2.rank == 8
    assert isinstance(mlp.fc1, nn.Linear)  # original untouched
    same = compress_mlp(mlp, 16, allow_growth=True)  # full rank: more MACs than the dense MLP
    y = torch.randn(3, 16)
    torch.testing.assert_close(same(y), mlp(y), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="out of range"):
        compress_linear(lin, 13)
    for bad in (0, "2", 2.0):  # the LowRankLinear it builds checks the rank
        with pytest.raises(ValueError, match="rank must be a positive integer"):
            compress_linear(lin, bad)
    with pytest.raises(TypeError, match="linear must be an nn.Linear, got Mlp"):
        compress_linear(Mlp(), 2)
    with pytest.raises(TypeError, match="Mlp"):
        compress_mlp(nn.Linear(3, 3), 2)
    # the MLP's calibration inputs are checked before fc1 runs on them
    with pytest.raises(ValueError, match=r"calib must be a tensor of inputs \(\.\.\., 16\)"):
        compress_mlp(mlp, 4, calib=torch.randn(5, 7))
    with pytest.raises(ValueError, match=r"calib must be a tensor of inputs \(\.\.\., 16\), got list"):
        compress_mlp(mlp, 4, calib=[[0.0] * 16])


def test_rank_constrained_fusion_projection():
    torch.manual_seed(0)
    S = torch.randn(4, 10)
    P = project_fusion(S)
    assert torch.all(P >= 0)
    torch.testing.assert_close(P @ P.T, torch.eye(4))
    assert sum(fusion_head_ranks(P)) == 10 and min(fusion_head_ranks(P)) >= 1
    assert float(fusion_penalty(P)) < 1e-10 and float(fusion_penalty(S)) > 1
    torch.testing.assert_close(project_fusion(P), P)  # a projection
    with pytest.raises(ValueError, match="at least as many columns"):
        project_fusion(torch.randn(4, 3))
