"""Baseline attentions (MHSA, XCA, MSSA, ClassAttention): ops vs plain references (forward and
gradients), layouts of the official implementations (timm / XCiT / CRATE), masks, numerics, bad inputs."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from whiteformer.attention import build
from whiteformer.attention.baselines import MHSA, MSSA, XCA, ClassAttention
from whiteformer.ops import class_attention, mhsa, mhsa_explicit, mssa, xca
from whiteformer.ops.reference import (
    class_attention_reference,
    mhsa_reference,
    mssa_reference,
    xca_reference,
)

SHAPES = [(1, 1, 1, 4), (2, 3, 7, 8), (3, 2, 5, 3)]
F64 = torch.float64


def _masks(B, N):
    """None, right padding, and an irregular mask with one fully padded sequence (when B > 1)."""
    right = torch.ones(B, N, dtype=torch.bool)
    for b in range(B):
        right[b, max(1, N - b * 2):] = False
    irregular = torch.rand(B, N) > 0.4
    irregular[:, 0] = True
    if B > 1:
        irregular[-1] = False
    return [None, right, irregular]


def _inputs(shape, n=3, dtype=F64):
    return [torch.randn(*shape, dtype=dtype, requires_grad=True) for _ in range(n)]


def _assert_same_with_grads(out, ref, inputs, atol=1e-10):
    torch.testing.assert_close(out, ref, atol=atol, rtol=0)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, g, retain_graph=True)
    if not ref.requires_grad:  # everything padded: the reference is a constant zero
        want = [torch.zeros_like(t) for t in inputs]
    else:
        want = torch.autograd.grad(ref, inputs, g, allow_unused=True, materialize_grads=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=atol, rtol=0)


# ----------------------------------------------------------------------------- ops vs references


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("op", [mhsa, mhsa_explicit])
def test_mhsa_matches_reference(shape, causal, op):
    q, k, v = _inputs(shape)
    for m in _masks(shape[0], shape[2]):
        out = op(q, k, v, m, causal=causal)
        _assert_same_with_grads(out, mhsa_reference(q, k, v, m, causal=causal), [q, k, v])
    out = op(q, k, v, scale=0.7)
    torch.testing.assert_close(out, mhsa_reference(q, k, v, scale=0.7), atol=1e-10, rtol=0)


@pytest.mark.parametrize("shape", SHAPES)
def test_xca_matches_reference(shape):
    q, k, v = _inputs(shape)
    temp = (torch.rand(shape[1], 1, 1, dtype=F64) + 0.5).requires_grad_()
    for m in _masks(shape[0], shape[2]):
        out = xca(q, k, v, temp, m)
        _assert_same_with_grads(out, xca_reference(q, k, v, temp, m), [q, k, v, temp])


@pytest.mark.parametrize("shape", SHAPES)
def test_mssa_matches_reference(shape):
    (w,) = _inputs(shape, 1)
    for m in _masks(shape[0], shape[2]):
        _assert_same_with_grads(mssa(w, m), mssa_reference(w, m), [w])


@pytest.mark.parametrize("shape", SHAPES)
def test_class_attention_matches_reference(shape):
    B, H, N, p = shape
    q = torch.randn(B, H, 1, p, dtype=F64, requires_grad=True)
    k, v = _inputs(shape, 2)
    masks = _masks(B, N)
    cls_padded = torch.ones(B, N, dtype=torch.bool)
    cls_padded[0, 0] = False  # the class token itself padded: its output is 0
    for m in masks + [cls_padded]:
        out = class_attention(q, k, v, m)
        _assert_same_with_grads(out, class_attention_reference(q, k, v, m), [q, k, v])
    assert class_attention(q, k, v, cls_padded)[0].abs().max() == 0


def test_reference_is_the_textbook_formula():
    """Guard the oracle itself on a case computed by hand: one head, two tokens."""
    q = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]], dtype=F64)
    k = torch.tensor([[[[2.0, 0.0], [0.0, 0.0]]]], dtype=F64)
    v = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]], dtype=F64)
    a = torch.softmax(torch.tensor([2.0, 0.0], dtype=F64) / 2 ** 0.5, 0)
    want = torch.stack([a, torch.tensor([0.5, 0.5], dtype=F64)])
    torch.testing.assert_close(mhsa_reference(q, k, v)[0, 0], want)
    torch.testing.assert_close(mhsa(q, k, v)[0, 0], want)


def test_ops_gradcheck_float64():
    B, H, N, p = 2, 2, 4, 3
    q, k, v = _inputs((B, H, N, p))
    temp = (torch.rand(H, 1, 1, dtype=F64) + 0.5).requires_grad_()
    m = torch.tensor([[True, True, False, True], [True, True, True, False]])
    for mask in (None, m):
        assert torch.autograd.gradcheck(lambda a, b, c: mhsa(a, b, c, mask, causal=True), (q, k, v))
        assert torch.autograd.gradcheck(lambda a, b, c: mhsa_explicit(a, b, c, mask), (q, k, v))
        assert torch.autograd.gradcheck(lambda a, b, c, t: xca(a, b, c, t, mask), (q, k, v, temp))
        assert torch.autograd.gradcheck(lambda a: mssa(a, mask), (q,))
        assert torch.autograd.gradcheck(lambda a, b, c: class_attention(a[:, :, :1], b, c, mask), (q, k, v))


def test_fully_masked_sequence_gives_zeros_and_finite_grads():
    q, k, v = _inputs((2, 2, 5, 4))
    m = torch.zeros(2, 5, dtype=torch.bool)
    m[0, :3] = True
    temp = torch.ones(2, 1, 1, dtype=F64, requires_grad=True)
    outs = [
        mhsa(q, k, v, m), mhsa(q, k, v, m, causal=True), mhsa_explicit(q, k, v, m, causal=True),
        xca(q, k, v, temp, m), mssa(q, m), class_attention(q[:, :, :1], k, v, m),
    ]
    for out in outs:
        assert out[1].abs().max() == 0
        assert torch.isfinite(out).all()
        grads = torch.autograd.grad(out.sum(), [q, k, v], allow_unused=True)
        assert all(g is None or torch.isfinite(g).all() for g in grads)


def test_mhsa_explicit_flops_are_visible():
    from torch.utils.flop_counter import FlopCounterMode

    B, H, N, p = 2, 3, 7, 8
    q, k, v = (torch.randn(B, H, N, p) for _ in range(3))
    with FlopCounterMode(display=False) as fc:
        mhsa_explicit(q, k, v)
    assert fc.get_total_flops() == 4 * B * H * N * N * p


# ----------------------------------------------------------------------------- official layouts


def _timm_attention(x, mod, heads):
    """Literal timm ``Attention.forward`` (non-fused path), with an optional LayerNorm on q and k."""
    B, N, C = x.shape
    qkv = mod.qkv(x).reshape(B, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    q, k = mod.q_norm(q), mod.k_norm(k)
    attn = (q * (C // heads) ** -0.5) @ k.transpose(-2, -1)
    x = (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, N, C)
    return mod.proj(x)


def test_mhsa_matches_timm_attention_layout():
    m = MHSA(32, num_heads=4, qkv_bias=True).double()
    names = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert names == {"qkv.weight": (96, 32), "qkv.bias": (96,), "proj.weight": (32, 32), "proj.bias": (32,)}
    assert "qkv.bias" not in dict(MHSA(32, num_heads=4).named_parameters())
    for N in (1, 7):
        x = torch.randn(2, N, 32, dtype=F64)
        torch.testing.assert_close(m(x), _timm_attention(x, m, 4))
    m.fused_attn = False
    torch.testing.assert_close(m(x), _timm_attention(x, m, 4))


def test_mhsa_qk_norm_like_timm():
    m = MHSA(16, num_heads=2, qk_norm=True).double()
    assert {"q_norm.weight", "q_norm.bias", "k_norm.weight", "k_norm.bias"} <= set(dict(m.named_parameters()))
    with torch.no_grad():
        m.q_norm.weight.uniform_(0.5, 2)
        m.k_norm.bias.normal_()
    x = torch.randn(2, 5, 16, dtype=F64)
    torch.testing.assert_close(m(x), _timm_attention(x, m, 2))


def test_mhsa_causal_and_mask_with_causal():
    m = MHSA(16, num_heads=2, causal=True).double()
    x = torch.randn(2, 6, 16, dtype=F64)
    y = m(x)
    # A causal output does not change when the future changes.
    x2 = x.clone()
    x2[:, 4:] += 1
    torch.testing.assert_close(m(x2)[:, :4], y[:, :4])
    assert not torch.allclose(m(x2)[:, 4:], y[:, 4:])
    # Right padding with causal == each sequence alone.
    keep = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    ym = m(x, keep)
    torch.testing.assert_close(ym[1, :3], m(x[1:, :3])[0])
    assert ym[1, 3:].abs().max() == 0
    torch.testing.assert_close(ym[0], y[0])


def _xcit_xca(x, mod, heads):
    """Literal XCiT ``XCA.forward``."""
    B, N, C = x.shape
    qkv = mod.qkv(x).reshape(B, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
    q, k, v = (t.transpose(-2, -1) for t in qkv.unbind(0))
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    attn = ((q @ k.transpose(-2, -1)) * mod.temperature).softmax(dim=-1)
    return mod.proj((attn @ v).permute(0, 3, 1, 2).reshape(B, N, C))


def test_xca_matches_xcit_layout():
    m = XCA(32, num_heads=4, qkv_bias=True).double()
    names = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert names == {"temperature": (4, 1, 1), "qkv.weight": (96, 32), "qkv.bias": (96,),
                     "proj.weight": (32, 32), "proj.bias": (32,)}
    assert torch.equal(m.temperature, torch.ones(4, 1, 1, dtype=F64))
    assert m.no_weight_decay() == {"temperature"}
    with torch.no_grad():
        m.temperature.uniform_(0.5, 3)
    for N in (1, 7):
        x = torch.randn(2, N, 32, dtype=F64)
        torch.testing.assert_close(m(x), _xcit_xca(x, m, 4))


def _crate_attention(x, mod, heads):
    """Literal CRATE ``Attention.forward`` (model/crate.py)."""
    B, N, _ = x.shape
    w = mod.qkv(x).reshape(B, N, heads, -1).transpose(1, 2)
    attn = (w @ w.transpose(-1, -2) * w.shape[-1] ** -0.5).softmax(dim=-1)
    return mod.to_out((attn @ w).transpose(1, 2).reshape(B, N, -1))


def test_mssa_matches_crate_layout():
    m = MSSA(24, num_heads=3).double()
    names = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert names == {"qkv.weight": (24, 24), "to_out.0.weight": (24, 24), "to_out.0.bias": (24,)}
    assert m.dim_head == 8 and m.scale == 8 ** -0.5
    m2 = MSSA(24, num_heads=2, dim_head=5).double()
    assert tuple(m2.qkv.weight.shape) == (10, 24) and tuple(m2.to_out[0].weight.shape) == (24, 10)
    m1 = MSSA(8, num_heads=1)  # official: no output projection when heads == 1 and dim_head == dim
    assert isinstance(m1.to_out, nn.Identity) and len(list(m1.parameters())) == 1
    for mod, h in ((m, 3), (m2, 2)):
        for N in (1, 7):
            x = torch.randn(2, N, 24, dtype=F64)
            torch.testing.assert_close(mod(x), _crate_attention(x, mod, h))


def _xcit_class_attention(x, mod, heads):
    """Literal XCiT/CaiT ``ClassAttention.forward``."""
    B, N, C = x.shape
    qkv = mod.qkv(x).reshape(B, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    attn = ((q[:, :, 0:1] * k).sum(dim=-1) * (C // heads) ** -0.5).softmax(dim=-1)
    cls = mod.proj((attn.unsqueeze(2) @ v).transpose(1, 2).reshape(B, 1, C))
    return torch.cat([cls, x[:, 1:]], dim=1)


def test_class_attention_matches_xcit_layout_and_passes_tokens_through():
    m = ClassAttention(32, num_heads=4, qkv_bias=True).double()
    names = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert names == {"qkv.weight": (96, 32), "qkv.bias": (96,), "proj.weight": (32, 32), "proj.bias": (32,)}
    for N in (1, 7):
        x = torch.randn(2, N, 32, dtype=F64)
        y = m(x)
        torch.testing.assert_close(y, _xcit_class_attention(x, m, 4))
        assert torch.equal(y[:, 1:], x[:, 1:])
    keep = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    ym = m(x, keep)
    assert torch.equal(ym[:, 1:], x[:, 1:].masked_fill(~keep[:, 1:, None], 0.0))  # padded tokens: 0
    torch.testing.assert_close(ym[1, :1], m(x[1:, :4])[0, :1])
    assert not torch.allclose(ym[1, :1], y[1, :1])


def test_official_state_dicts_load_unchanged():
    """Checkpoints keyed as timm / XCiT / CRATE / ToST load with strict=True."""
    src = {
        "mhsa": {"qkv.weight": (96, 32), "qkv.bias": (96,), "proj.weight": (32, 32), "proj.bias": (32,)},
        "xca": {"temperature": (4, 1, 1), "qkv.weight": (96, 32), "qkv.bias": (96,),
                "proj.weight": (32, 32), "proj.bias": (32,)},
        "mssa": {"qkv.weight": (32, 32), "to_out.0.weight": (32, 32), "to_out.0.bias": (32,)},
        "class_attention": {"qkv.weight": (96, 32), "qkv.bias": (96,), "proj.weight": (32, 32),
                            "proj.bias": (32,)},
    }
    for name, keys in src.items():
        kw = {} if name == "mssa" else {"qkv_bias": True}
        m = build(name, 32, num_heads=4, **kw)
        sd = {k: torch.randn(s) for k, s in keys.items()}
        m.load_state_dict(sd, strict=True)
        assert all(torch.equal(m.state_dict()[k], sd[k]) for k in sd)


# ----------------------------------------------------------------------------- masks, dtypes, dropout


@pytest.mark.parametrize("name", ["mhsa", "xca", "mssa", "class_attention"])
def test_layer_padded_batch_equals_each_sequence_alone(name):
    m = build(name, 16, num_heads=2).double()
    x = torch.randn(3, 6, 16, dtype=F64, requires_grad=True)
    keep = torch.tensor([[True] * 6, [True] * 2 + [False] * 4, [False] * 6])
    y = m(x, keep)
    for b in range(2):
        n = int(keep[b].sum())
        torch.testing.assert_close(y[b, :n], m(x[b:b + 1, :n])[0])
    assert y[~keep].abs().max() == 0
    if name == "class_attention":  # real tokens 1: pass through
        assert torch.equal(y[:, 1:][keep[:, 1:]], x[:, 1:][keep[:, 1:]])
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("name", ["mhsa", "xca", "mssa", "class_attention"])
def test_half_precision_is_finite_and_close(name):
    m = build(name, 32, num_heads=4)
    # class_attention concatenates its bf16 class token with the untouched float32 tokens 1:
    autocast_dtype = torch.float32 if name == "class_attention" else torch.bfloat16
    big = (torch.rand(2, 7, 32) * 2 - 1) * 1e3
    x = torch.randn(2, 7, 32)
    y32 = m(x)
    m.half()
    assert torch.isfinite(m(big.half())).all()
    torch.testing.assert_close(m(x.half()).float(), y32, atol=2e-2, rtol=2e-2)
    m.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yb, yb_big = m(x), m(big)
    assert yb.dtype == autocast_dtype and torch.isfinite(yb_big).all()
    torch.testing.assert_close(yb.float(), y32, atol=0.1, rtol=0.1)


def test_half_statistics_are_float32():
    """Logits of unit-free size ~1e5 overflow float16; the ops compute them in float32."""
    q = torch.randn(1, 2, 6, 8) * 150
    k = torch.randn(1, 2, 6, 8) * 150
    v = torch.randn(1, 2, 6, 8)
    want = mhsa_reference(q.double(), k.double(), v.double()).float()
    for op in (mhsa, mhsa_explicit):
        out = op(q.half(), k.half(), v.half())
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), mhsa_reference(q.half(), k.half(), v.half()).float(),
                                   atol=2e-2, rtol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mhsa_explicit(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert out.dtype == torch.bfloat16
    assert (out.float() - want).abs().max() < 0.1
    t = torch.ones(2, 1, 1)
    xh = xca(q.half(), k.half(), v.half(), t)
    torch.testing.assert_close(xh.float(), xca_reference(q, k, v, t), atol=2e-2, rtol=0)


def test_attn_dropout_only_in_training():
    m = build("mhsa", 16, num_heads=2, attn_drop=0.5)
    x = torch.randn(2, 5, 16)
    m.eval()
    torch.testing.assert_close(m(x), m(x))
    m.train()
    assert not torch.allclose(m(x), m(x))


# ----------------------------------------------------------------------------- bad inputs


def test_ops_bad_inputs():
    q = torch.randn(2, 2, 5, 4)
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        mhsa(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="k must have the shape of q"):
        mhsa(q, q[:, :, :3], q)
    with pytest.raises(TypeError, match="v must have the dtype of q"):
        mhsa(q, q, q.double())
    with pytest.raises(TypeError, match="floating"):
        mhsa_explicit(q.long(), q.long(), q.long())
    with pytest.raises(ValueError, match="no tokens"):
        mssa(q[:, :, :0])
    with pytest.raises(ValueError, match=r"attn_mask must have shape \(B, N\)"):
        mhsa(q, q, q, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool or 0/1 integer"):
        mssa(q, torch.ones(2, 5))
    with pytest.raises(ValueError, match="temperature must have shape"):
        xca(q, q, q, torch.ones(3, 1, 1))
    with pytest.raises(ValueError, match="q_cls must hold one query token"):
        class_attention(q, q, q)
    with pytest.raises(ValueError, match="k must have shape"):
        class_attention(q[:, :, :1], q[:, :1], q)
    with pytest.raises(ValueError, match="dropout_p"):
        mhsa(q, q, q, dropout_p=1.5)
    with pytest.raises(TypeError, match="scale"):
        mhsa(q, q, q, scale="x")


def test_layers_bad_inputs():
    with pytest.raises(ValueError, match="divisible by num_heads"):
        MHSA(30, num_heads=4)
    with pytest.raises(ValueError, match="num_heads must be a positive integer"):
        XCA(32, num_heads=0)
    with pytest.raises(ValueError, match="dim_head must be a positive integer"):
        MSSA(32, num_heads=4, dim_head=0)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        MSSA(30, num_heads=4)
    MSSA(30, num_heads=4, dim_head=8)  # an explicit head dim need not divide dim
    m = ClassAttention(16, num_heads=2)
    with pytest.raises(ValueError, match="last dimension 16"):
        m(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="3 dimensions"):
        m(torch.randn(3, 16))
    with pytest.raises(TypeError, match="bool"):
        m(torch.randn(2, 3, 16), torch.ones(2, 3, dtype=torch.float32))
