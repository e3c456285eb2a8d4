"""DMSA (DMST paper, Eq. (18), Algorithm 1, Tables II-III, Sec. III-C): operator vs reference,
gradients, masks, rotary encoding, sparsemax, ablation options, layer, errors, half precision."""
import itertools

import pytest
import torch
from einops import rearrange
from entmax import sparsemax as entmax_sparsemax

from whiteformer.attention import DMSA, build
from whiteformer.ops import dmsa, rotary, sparsemax
from whiteformer.ops.reference import dmsa_reference, rotary_reference

F64 = torch.float64
OPTION_SETS = [
    dict(sparsity=sp, activation=act, mode=mode, gate_activation=ga)
    for sp, act, mode, ga in itertools.product(
        ("heads", "tokens", "both"), ("sigmoid", "relu", "gelu", "sparsemax"), ("membership", "channel"),
        ("sparsemax", "sigmoid"))
    if not (sp == "tokens" and ga != "sparsemax")
]


def _inputs(B, H, N, p, dtype=F64, grad=True):
    s = torch.randn(B, H, N, p, dtype=dtype, requires_grad=grad)
    logits = torch.randn(B, N, H, dtype=dtype, requires_grad=grad)
    return s, logits


def _loss(out, stats):
    # random projection of every output so all gradients are exercised
    g = torch.Generator().manual_seed(1)
    tot = 0.0
    for t in (out, stats["pi"], stats["gate"]):
        tot = tot + (t * torch.randn(t.shape, generator=g, dtype=t.dtype)).sum()
    return tot


def _grads(fn, tensors):
    for t in tensors:
        t.grad = None
    out, stats = fn()
    _loss(out, stats).backward()
    return out, stats, [t.grad.clone() for t in tensors]


def _assert_close_all(a, b, **tol):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, **tol)


def _right_mask(lengths, N):
    return torch.arange(N)[None, :] < torch.tensor(lengths)[:, None]


# ----------------------------------------------------------------------------- sparsemax


def test_sparsemax_matches_entmax_forward_and_grad():
    z = torch.randn(4, 6, 5, dtype=F64, requires_grad=True)
    z2 = z.detach().clone().requires_grad_(True)
    for dim in (0, 1, -1):
        a, b = sparsemax(z, dim=dim), entmax_sparsemax(z2, dim=dim)
        torch.testing.assert_close(a, b)
        g = torch.randn_like(a)
        (ga,) = torch.autograd.grad(a, z, g)
        (gb,) = torch.autograd.grad(b, z2, g)
        torch.testing.assert_close(ga, gb)
    assert (sparsemax(z, dim=-1) == 0).any()


def test_sparsemax_mask_equals_kept_entries_alone():
    z = torch.randn(3, 7, dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 0, 1, 1, 0, 1, 1], [0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    out = sparsemax(z, dim=-1, mask=mask)
    for b in range(3):
        if mask[b].any():
            torch.testing.assert_close(out[b, mask[b]], entmax_sparsemax(z[b, mask[b]], dim=-1))
    assert (out[~mask] == 0).all() and (out[1] == 0).all()
    out.sum().backward()  # all-masked row and masked entries: finite, zero gradient
    assert torch.isfinite(z.grad).all() and (z.grad[~mask] == 0).all()


def test_sparsemax_integer_mask_and_mask_errors_name_mask():
    """A 0/1 integer mask means the bool one; a mask that does not broadcast to z, one holding
    other values, or a float one is an error naming ``mask``."""
    z = torch.randn(3, 7, dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1, 1, 0, 1, 1], [0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    expected = sparsemax(z, mask=mask.bool())
    for m in (mask, mask.int(), mask.to(torch.uint8)):
        torch.testing.assert_close(sparsemax(z, mask=m), expected)
    torch.testing.assert_close(sparsemax(z, mask=mask[:1].bool()), sparsemax(z, mask=mask[:1].bool().expand(3, 7)))
    for bad, err in ((mask.bool()[:, :5], ValueError), (mask.bool()[:, :, None], ValueError),
                     (mask * 2, ValueError), (-mask, ValueError), (-mask.to(torch.int8), ValueError),
                     (mask.float(), TypeError)):
        with pytest.raises(err, match="mask"):
            sparsemax(z, mask=bad)


# ----------------------------------------------------------------------------- operator vs reference


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 1, 4), (2, 4, 7, 3), (3, 2, 5, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_op_matches_reference(shape, dtype):
    s, logits = _inputs(*shape, dtype=dtype)
    a = _grads(lambda: dmsa(s, logits, return_stats=True), [s, logits])
    b = _grads(lambda: dmsa_reference(s, logits, return_stats=True), [s, logits])
    tol = {} if dtype == F64 else dict(rtol=1e-5, atol=1e-6)
    _assert_close_all([a[0], a[1]["pi"], a[1]["gate"], *a[2]], [b[0], b[1]["pi"], b[1]["gate"], *b[2]], **tol)
    assert a[0].dtype == dtype and a[0].shape == shape


@pytest.mark.parametrize("opts", OPTION_SETS, ids=lambda o: "-".join(o.values()))
def test_op_options_match_reference_with_mask(opts):
    s, logits = _inputs(3, 4, 6, 3)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [0, 1, 1, 0, 1, 1]], dtype=torch.bool)
    for m in (None, mask):
        a = _grads(lambda: dmsa(s, logits, m, return_stats=True, **opts), [s, logits])
        b = _grads(lambda: dmsa_reference(s, logits, m, return_stats=True, **opts), [s, logits])
        _assert_close_all([a[0], a[1]["pi"], a[1]["gate"], *a[2]], [b[0], b[1]["pi"], b[1]["gate"], *b[2]])


@pytest.mark.parametrize("opts", [
    dict(), dict(sparsity="tokens"), dict(sparsity="both", activation="sparsemax"),
    dict(mode="channel", activation="gelu"), dict(gate_activation="sigmoid", activation="relu"),
])
def test_gradcheck(opts):
    s, logits = _inputs(2, 3, 4, 2)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    for m in (None, mask):
        assert torch.autograd.gradcheck(lambda a, b: dmsa(a, b, m, **opts), (s, logits))


def test_matches_algorithm_1_written_out():
    # Appendix B with the heads gate: w = S * ST(mean_n PI), Pi = sigmoid(PI), TSSA dots/out
    s, logits = _inputs(2, 4, 5, 3, grad=False)
    gate = entmax_sparsemax(logits.mean(1), dim=1)
    w = s * gate[:, :, None, None]
    pi = torch.sigmoid(logits.transpose(1, 2))
    dots = (pi / (pi.sum(-1, keepdim=True) + 1e-8)).unsqueeze(-2) @ w**2
    expect = -(w * pi[..., None]) / (1 + dots)
    torch.testing.assert_close(dmsa(s, logits), expect)


# ----------------------------------------------------------------------------- gate / memberships


def test_gate_sums_to_one_with_exact_zeros():
    s, _ = _inputs(2, 4, 3, 2, grad=False)
    # token-means per head: [1.0, 0.8, -2, -3] and [-1, -1, 0.5, -4] -> gates [.6, .4, 0, 0], [0, 0, 1, 0]
    means = torch.tensor([[1.0, 0.8, -2.0, -3.0], [-1.0, -1.0, 0.5, -4.0]], dtype=F64)
    logits = means[:, None, :] + torch.tensor([-0.3, 0.1, 0.2], dtype=F64)[None, :, None]
    out, stats = dmsa(s, logits, return_stats=True)
    gate = stats["gate"]
    torch.testing.assert_close(gate, torch.tensor([[0.6, 0.4, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]], dtype=F64))
    torch.testing.assert_close(gate.sum(-1), torch.ones(2, dtype=F64))
    assert (gate[0, 2:] == 0).all() and (gate[1, [0, 1, 3]] == 0).all()
    assert (out[gate == 0] == 0).all() and (out[gate > 0] != 0).all()  # zeroed heads output exactly 0


def test_membership_has_no_temperature_and_is_sigmoid():
    s, logits = _inputs(1, 2, 4, 2, grad=False)
    _, stats = dmsa(s, logits, return_stats=True)
    torch.testing.assert_close(stats["pi"], torch.sigmoid(logits.transpose(1, 2)))


# ----------------------------------------------------------------------------- ablations


def test_ablation_semantics():
    s, logits = _inputs(2, 4, 6, 3, grad=False)
    mask = _right_mask([6, 4], 6)
    base, bs = dmsa(s, logits, mask, return_stats=True)

    out, st = dmsa(s, logits, mask, sparsity="tokens", return_stats=True)  # TPUSA: no gate, token-ST Pi
    assert (st["gate"] == 1).all()
    torch.testing.assert_close(st["pi"].sum(-1), torch.ones(2, 4, dtype=F64))
    assert (st["pi"][mask[:, None, :].expand(-1, 4, -1)] == 0).any() and (st["pi"][1, :, 4:] == 0).all()
    assert not torch.allclose(out, base)

    out, st = dmsa(s, logits, mask, sparsity="both", return_stats=True)  # TPSUSA: gate and token-ST Pi
    torch.testing.assert_close(st["gate"], bs["gate"])
    torch.testing.assert_close(st["pi"].sum(-1), torch.ones(2, 4, dtype=F64))
    assert not torch.allclose(out, base)

    for act, fn in (("relu", torch.relu), ("gelu", torch.nn.functional.gelu)):
        out, st = dmsa(s, logits, mask, activation=act, return_stats=True)
        torch.testing.assert_close(st["pi"], fn(logits.transpose(1, 2)) * mask[:, None, :])
        assert not torch.allclose(out, base)
    out, st = dmsa(s, logits, mask, activation="sparsemax", return_stats=True)
    torch.testing.assert_close(st["pi"].sum(1), mask.to(F64))  # over heads, per real token
    assert (st["pi"] == 0).any() and not torch.allclose(out, base)

    out, st = dmsa(s, logits, mask, gate_activation="sigmoid", return_stats=True)
    masked_mean = (logits * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    torch.testing.assert_close(st["gate"], torch.sigmoid(masked_mean))
    assert not torch.allclose(out, base)

    # Eq. (19)-(21): channel mode drops only the Diag(pi) on the output, same gain and gate
    chan = dmsa(s, logits, mask, mode="channel")
    torch.testing.assert_close(chan * bs["pi"].unsqueeze(-1), base)
    assert not torch.allclose(chan, base)


def test_attn_drop_only_in_training():
    s, logits = _inputs(2, 2, 5, 4, grad=False)
    base = dmsa(s, logits)
    torch.testing.assert_close(dmsa(s, logits, attn_drop=0.5), base)
    assert not torch.allclose(dmsa(s, logits, attn_drop=0.5, training=True), base)


# ----------------------------------------------------------------------------- masks


@pytest.mark.parametrize("opts", [dict(), dict(sparsity="both", activation="sparsemax"),
                                  dict(sparsity="tokens", mode="channel")])
def test_op_padding_equals_each_sequence_alone(opts):
    s, logits = _inputs(3, 2, 6, 3, grad=False)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    s_pad = s.masked_fill(~mask[:, None, :, None], 1e3)  # garbage in padded slots must not matter
    out, st = dmsa(s_pad, logits.masked_fill(~mask[..., None], -50.0), mask, return_stats=True, **opts)
    for b in range(3):
        k = mask[b]
        o, sb = dmsa(s[b : b + 1, :, k], logits[b : b + 1, k], return_stats=True, **opts)
        torch.testing.assert_close(out[b, :, k], o[0])
        torch.testing.assert_close(st["pi"][b, :, k], sb["pi"][0])
        torch.testing.assert_close(st["gate"][b], sb["gate"][0])
    assert (out[~mask[:, None, :].expand(-1, 2, -1)] == 0).all()


# ----------------------------------------------------------------------------- rotary


def test_rotary_matches_complex_reference():
    for dtype in (torch.float32, F64):
        x = torch.randn(2, 9, 12, dtype=dtype)
        torch.testing.assert_close(rotary(x), rotary_reference(x))
    x = torch.randn(1, 5000, 4)  # beyond the official 4096-position table
    torch.testing.assert_close(rotary(x), rotary_reference(x))


def test_rotary_properties():
    x = torch.randn(3, 7, 8, dtype=F64)
    y = rotary(x)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # norm preserving
    torch.testing.assert_close(y[:, 0], x[:, 0])  # position 0 is the identity
    assert not torch.allclose(y[:, 1:], x[:, 1:])
    # <rot(q, m), rot(k, n)> depends only on m - n
    q, k = torch.randn(8, dtype=F64), torch.randn(8, dtype=F64)
    rq, rk = rotary(q.expand(1, 12, 8)), rotary(k.expand(1, 12, 8))
    for delta in (0, 2, 5):
        vals = torch.stack([rq[0, m] @ rk[0, m - delta] for m in range(delta, 12)])
        torch.testing.assert_close(vals, vals[0].expand_as(vals))
    # angle of pair i at position n is n * 10000**(-2i/C)
    e = torch.zeros(1, 4, 8, dtype=F64)
    e[..., 2] = 1.0  # pair i = 1: angle 3 * 10000**(-2/8) at position 3
    a = torch.tensor(3 * 10000 ** (-2 / 8), dtype=F64)
    torch.testing.assert_close(rotary(e)[0, 3, 2:4], torch.stack([torch.cos(a), torch.sin(a)]))


def test_rotary_positions_argument():
    x = torch.randn(2, 5, 6, dtype=F64)
    pos = torch.tensor([[0, 0, 1, 2, 2], [4, 3, 2, 1, 0]])
    y = rotary(x, positions=pos)
    for b in range(2):
        for n in range(5):
            torch.testing.assert_close(y[b, n], rotary(x[b : b + 1, n : n + 1].expand(1, pos[b, n] + 1, 6))[0, -1])


def test_rotary_bad_inputs():
    with pytest.raises(ValueError, match="even"):
        rotary(torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match="3 dimensions"):
        rotary(torch.randn(3, 4))
    with pytest.raises(ValueError, match="no tokens"):
        rotary(torch.randn(2, 0, 4))
    with pytest.raises(ValueError, match="positions"):
        rotary(torch.randn(2, 3, 4), positions=torch.arange(4))
    with pytest.raises(ValueError, match="base"):
        rotary(torch.randn(2, 3, 4), base=0.0)


# ----------------------------------------------------------------------------- layer


def _layer_reference(layer, x, mask=None):
    """Algorithm 1 as a plain function of the layer's parameters, each sequence alone."""
    def one(xb):
        S = rearrange(layer.qkv(xb), "b n (h d) -> b h n d", h=layer.num_heads)
        PI = layer.membership(rotary_reference(xb))
        out, st = dmsa_reference(S, PI, None, layer.sparsity, layer.activation, layer.mode, True,
                                 gate_activation=layer.gate_activation)
        return layer.proj(rearrange(out, "b h n d -> b n (h d)")), st

    if mask is None:
        return one(x)
    B, N, C = x.shape
    y, pi, gate = x.new_zeros(B, N, C), x.new_zeros(B, layer.num_heads, N), x.new_zeros(B, layer.num_heads)
    for b in range(B):
        yb, st = one(x[b : b + 1, mask[b]])
        y[b, mask[b]], pi[b, :, mask[b]], gate[b] = yb[0], st["pi"][0], st["gate"][0]
    return y, {"pi": pi, "gate": gate}


def test_layer_structure_and_registry():
    layer = build("dmsa", 16, num_heads=4)
    assert isinstance(layer, DMSA)
    shapes = {k: tuple(v.shape) for k, v in layer.named_parameters()}
    assert shapes == {"qkv.weight": (16, 16), "membership.weight": (4, 16), "proj.weight": (16, 16),
                      "proj.bias": (16,)}
    assert "qkv.bias" in dict(DMSA(16, 4, qkv_bias=True).named_parameters())


@pytest.mark.parametrize("B,N,C,H", [(1, 1, 8, 2), (2, 5, 12, 3), (3, 9, 16, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("opts", [dict(), dict(sparsity="both", activation="sparsemax", mode="channel")])
def test_layer_matches_reference_forward_and_param_grads(B, N, C, H, dtype, opts):
    layer = DMSA(C, num_heads=H, qkv_bias=True, **opts).to(dtype)
    x = torch.randn(B, N, C, dtype=dtype, requires_grad=True)
    params = [x, *layer.parameters()]
    a = _grads(lambda: layer(x, return_pi=True), params)
    b = _grads(lambda: _layer_reference(layer, x), params)
    tol = {} if dtype == F64 else dict(rtol=1e-4, atol=1e-5)
    _assert_close_all([a[0], a[1]["pi"], a[1]["gate"], *a[2]], [b[0], b[1]["pi"], b[1]["gate"], *b[2]], **tol)
    assert a[0].shape == (B, N, C) and a[0].dtype == dtype


@pytest.mark.parametrize("opts", [dict(), dict(sparsity="tokens", activation="relu")])
def test_layer_padding_equals_each_sequence_alone(opts):
    layer = DMSA(8, num_heads=2, **opts).double()
    x = torch.randn(3, 6, 8, dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 1, 0]], dtype=torch.bool)
    params = [x, *layer.parameters()]
    a = _grads(lambda: layer(x, mask, return_pi=True), params)
    b = _grads(lambda: _layer_reference(layer, x, mask), params)
    _assert_close_all([a[0], a[1]["pi"], a[1]["gate"], *a[2]], [b[0], b[1]["pi"], b[1]["gate"], *b[2]])
    assert (a[0][~mask] == 0).all() and (x.grad[~mask] == 0).all()


def test_layer_fp16_large_inputs_finite_and_bf16_autocast():
    layer = DMSA(16, num_heads=4)
    x = (torch.rand(2, 7, 16) * 2 - 1) * 1e3
    y = layer.half()(x.half(), _right_mask([7, 4], 7))
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
    out = dmsa(*(t.half() for t in _inputs(2, 4, 7, 4, dtype=torch.float32, grad=False)), attn_mask=None)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    s, lg = (t * 1e3 for t in _inputs(2, 4, 7, 4, dtype=torch.float32, grad=False))
    assert torch.isfinite(dmsa(s.half(), lg.half(), sparsity="both")).all()

    layer = DMSA(16, num_heads=4)
    x = torch.randn(2, 7, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, st = layer(x, return_pi=True)
    assert y.dtype == torch.bfloat16 and st["pi"].dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), layer(x), rtol=0.05, atol=0.05)


def test_layer_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    layer = DMSA(16, num_heads=4, sparsity="both").eval()
    x = torch.randn(2, 6, 16)
    mask = _right_mask([6, 3], 6)
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x, mask), layer(x, mask), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- errors


def test_bad_inputs_raise():
    s, logits = _inputs(2, 3, 4, 2, grad=False)
    with pytest.raises(ValueError, match="s must have 4 dimensions"):
        dmsa(s[0], logits)
    with pytest.raises(ValueError, match="logits must have 3 dimensions"):
        dmsa(s, logits[0])
    with pytest.raises(ValueError, match=r"logits must have shape \(B, N, H\)"):
        dmsa(s, logits.transpose(1, 2))
    with pytest.raises(TypeError, match="floating"):
        dmsa(s, logits.long())
    with pytest.raises(ValueError, match="no tokens"):
        dmsa(s[:, :, :0], logits[:, :0])
    with pytest.raises(ValueError, match="attn_mask must have shape"):
        dmsa(s, logits, torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool or 0/1 integer"):
        dmsa(s, logits, torch.ones(2, 4))
    for kw, bad in (("sparsity", "rows"), ("activation", "tanh"), ("mode", "gated"), ("gate_activation", "softmax")):
        with pytest.raises(ValueError, match=rf"{kw} must be one of \[.*\], got '{bad}'"):
            dmsa(s, logits, **{kw: bad})
    with pytest.raises(ValueError, match="gate_activation"):
        dmsa(s, logits, sparsity="tokens", gate_activation="relu")
    with pytest.raises(ValueError, match="attn_drop"):
        dmsa(s, logits, attn_drop=1.0)


def test_layer_bad_inputs_raise():
    with pytest.raises(ValueError, match="divisible"):
        DMSA(10, num_heads=4)
    with pytest.raises(ValueError, match="even"):
        DMSA(9, num_heads=3)
    with pytest.raises(ValueError, match="sparsity must be one of"):
        DMSA(8, num_heads=2, sparsity="token")
    with pytest.raises(ValueError, match="activation must be one of"):
        DMSA(8, num_heads=2, activation="softmax")
    with pytest.raises(ValueError, match="mode must be one of"):
        DMSA(8, num_heads=2, mode="gate")
    layer = DMSA(8, num_heads=2)
    with pytest.raises(ValueError, match="3 dimensions"):
        layer(torch.randn(5, 8))
    with pytest.raises(ValueError, match="last dimension 8"):
        layer(torch.randn(2, 5, 6))
    with pytest.raises(ValueError, match="no tokens"):
        layer(torch.randn(2, 0, 8))
    with pytest.raises(ValueError, match="attn_mask must have shape"):
        layer(torch.randn(2, 5, 8), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool or 0/1 integer"):
        layer(torch.randn(2, 5, 8), torch.ones(2, 5, dtype=torch.float32))
