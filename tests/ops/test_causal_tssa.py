"""Causal TSSA operator (main vs reference vs official formula), causality, recurrent step,
masks, bias table, dtypes, errors, and the layer."""
import pytest
import torch
from einops import rearrange

from whiteformer.attention import CausalTSSA, build, list_attention
from whiteformer.ops import CausalTSSAState, causal_tssa, causal_tssa_step
from whiteformer.ops.reference import causal_tssa_reference

SHAPES = [(2, 3, 7, 5), (1, 4, 1, 3), (3, 2, 12, 8), (2, 1, 5, 1)]


def official_causal_tssa(w, temp, bias):
    """Independent transcription of the official causal TSSA (github RobinWu218/ToST,
    ``tost_lang/model_TSSA.py``): cumulative statistics, ``denom_bias``, ``1 / (1 + dots)``."""
    T = w.shape[2]
    w_sq = w**2
    ratio = w_sq / torch.cumsum(w_sq, dim=2).clamp_min(1e-12)
    Pi = torch.softmax(temp * (ratio + bias[:, :T, :]).sum(-1), dim=1)
    dots = torch.cumsum(w_sq * Pi[..., None], dim=2) / (torch.cumsum(Pi, dim=2) + 1e-8)[..., None]
    return -(w * Pi[..., None]) / (1 + dots), Pi


def _inputs(shape, dtype=torch.float64, grad=False, t_max=16):
    w = torch.randn(*shape, dtype=dtype) * 2
    temp = torch.rand(shape[1], 1, dtype=dtype) * 2 + 0.5
    bias = torch.randn(shape[1], t_max, 1, dtype=dtype) * 0.5
    return w.requires_grad_(grad), temp.requires_grad_(grad), bias.requires_grad_(grad)


def _step_through(w, temp, bias, state=None):
    outs, pis = [], []
    for t in range(w.shape[2]):
        o, pi, state = causal_tssa_step(w[:, :, t], state, temp, bias, return_pi=True)
        outs.append(o)
        pis.append(pi)
    return torch.stack(outs, 2), torch.stack(pis, 2), state


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_official_formula(shape):
    w, temp, bias = _inputs(shape, torch.float32)
    ref_out, ref_pi = official_causal_tssa(w, temp, bias)
    for fn in (causal_tssa, causal_tssa_reference):
        out, pi = fn(w, temp, bias, return_pi=True)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pi, ref_pi, rtol=1e-5, atol=1e-6)
    zero = torch.zeros_like(bias)
    torch.testing.assert_close(causal_tssa(w, temp), official_causal_tssa(w, temp, zero)[0])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("use_bias", [False, True])
def test_main_vs_reference_forward_and_grads(shape, masked, use_bias):
    w, temp, bias = _inputs(shape, grad=True)
    bias = bias if use_bias else None
    mask = None
    if masked:  # mixed left / right / inner padding
        mask = torch.rand(shape[0], shape[2]) > 0.3
        mask[:, -1] = True
    g_out = torch.randn(shape, dtype=torch.float64)
    g_pi = torch.randn(shape[:3], dtype=torch.float64)
    params = (w, temp) + ((bias,) if use_bias else ())
    results = []
    for fn in (causal_tssa, causal_tssa_reference):
        out, pi = fn(w, temp, bias, mask, return_pi=True)
        grads = torch.autograd.grad((out * g_out).sum() + (pi * g_pi).sum(), params)
        results.append((out, pi, *grads))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_gradcheck():
    w, temp, bias = _inputs((2, 2, 4, 3), grad=True, t_max=5)
    assert torch.autograd.gradcheck(lambda w, t, b: causal_tssa(w, t, b, return_pi=True), (w, temp, bias))
    mask = torch.tensor([[True, True, True, True], [False, True, True, False]])
    assert torch.autograd.gradcheck(lambda w, t, b: causal_tssa(w, t, b, mask), (w, temp, bias))


def test_causality():
    w, temp, bias = _inputs((2, 3, 10, 4), torch.float32)
    out = causal_tssa(w, temp, bias)
    for t in (0, 4, 8):
        w2 = w.clone()
        w2[:, :, t + 1 :] = torch.randn_like(w2[:, :, t + 1 :]) * 10
        out2 = causal_tssa(w2, temp, bias)
        assert torch.equal(out2[:, :, : t + 1], out[:, :, : t + 1])
        assert not torch.allclose(out2[:, :, t + 1 :], out[:, :, t + 1 :])


@pytest.mark.parametrize("use_bias", [False, True])
def test_step_matches_parallel(use_bias):
    w, temp, bias = _inputs((2, 3, 16, 8), torch.float32)
    bias = bias if use_bias else None
    out, pi = causal_tssa(w, temp, bias, return_pi=True)
    s_out, s_pi, state = _step_through(w, temp, bias)
    torch.testing.assert_close(s_out, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_pi, pi, rtol=1e-5, atol=1e-5)
    # constant memory: the state never grows with t
    assert state.t == 16 and state.sum_sq.shape == (2, 3, 8) and state.sum_pi.shape == (2, 3)


def test_prefill_state_then_step():
    w, temp, bias = _inputs((2, 2, 9, 4), torch.float32)
    full = causal_tssa(w, temp, bias)
    head, state = causal_tssa(w[:, :, :5], temp, bias, return_state=True)
    assert isinstance(state, CausalTSSAState) and state.t == 5
    tail, _, _ = _step_through(w[:, :, 5:], temp, bias, state)
    torch.testing.assert_close(torch.cat([head, tail], 2), full, rtol=1e-5, atol=1e-5)


def test_left_padded_prefill_then_step_equals_each_sequence_alone():
    w, temp, bias = _inputs((2, 2, 10, 4), torch.float32)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, :3] = False  # left padding: sequence 1 has 3 real prompt tokens
    _, state = causal_tssa(w[:, :, :6], temp, bias, mask, return_state=True)
    assert state.t.tolist() == [6, 3]
    tail, _, _ = _step_through(w[:, :, 6:], temp, bias, state)
    alone0 = causal_tssa(w[0:1], temp, bias)[:, :, 6:]
    alone1 = causal_tssa(w[1:2, :, 3:], temp, bias)[:, :, 3:]
    torch.testing.assert_close(tail[0:1], alone0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tail[1:2], alone1, rtol=1e-5, atol=1e-5)


def test_padding_mask_equals_each_sequence_alone():
    w, temp, bias = _inputs((3, 2, 8, 4), torch.float32)
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[0] = True
    mask[1, 3:] = True  # left padding
    mask[2, :2] = True  # right padding
    w = w.masked_fill(~mask[:, None, :, None], float("nan"))
    out, pi = causal_tssa(w, temp, bias, mask, return_pi=True)
    for i in range(3):
        keep = mask[i]
        alone, pi_alone = causal_tssa(w[i : i + 1, :, keep], temp, bias, return_pi=True)
        torch.testing.assert_close(out[i : i + 1, :, keep], alone, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pi[i : i + 1, :, keep], pi_alone, rtol=1e-5, atol=1e-6)
        assert (out[i, :, ~keep] == 0).all() and (pi[i, :, ~keep] == 0).all()


def test_bias_table_limits():
    w, temp, bias = _inputs((1, 2, 6, 3), torch.float32, t_max=5)
    with pytest.raises(ValueError, match="exceeds the positional bias table length T_max = 5"):
        causal_tssa(w, temp, bias)
    # a packed row: each document restarts at position 0, so only the longest one must fit
    causal_tssa(w, temp, bias, cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="exceeds the positional bias table length T_max = 5"):
        causal_tssa(w, temp, bias, cu_seqlens=torch.tensor([0, 0, 6], dtype=torch.int32))
    # one long document among short ones: padding would waste most slots, the packed tokens run as they are
    many = torch.randn(1, 2, 12, 3)
    with pytest.raises(ValueError, match=r"the longest packed document \(6 tokens\) exceeds the positional bias "
                                         r"table length T_max = 5"):
        causal_tssa(many, temp, bias, cu_seqlens=torch.tensor([0, 6, 7, 8, 9, 10, 11, 12], dtype=torch.int32))
    _, _, state = _step_through(w[:, :, :5], temp, bias)
    with pytest.raises(ValueError, match="reached the positional bias table length T_max = 5"):
        causal_tssa_step(w[:, :, 5], state, temp, bias)
    long_w = torch.randn(1, 2, 1100, 2)
    assert torch.isfinite(causal_tssa(long_w, temp)).all()  # no table, no limit


def test_attn_drop_on_gain():
    w, temp, bias = _inputs((2, 3, 5, 4))
    torch.testing.assert_close(causal_tssa(w, temp, bias, attn_drop=0.5), causal_tssa(w, temp, bias))
    torch.manual_seed(1)
    dropped = causal_tssa(w, temp, bias, attn_drop=0.5, training=True)
    torch.manual_seed(1)
    ref = causal_tssa_reference(w, temp, bias, attn_drop=0.5, training=True)
    torch.testing.assert_close(dropped, ref)
    assert (dropped == 0).any() and not torch.allclose(dropped, causal_tssa(w, temp, bias))


def test_float16_large_entries_finite_and_bfloat16():
    w, temp, bias = _inputs((2, 2, 8, 4), torch.float32)
    w16 = (w / w.abs().max() * 1e3).half()
    out = causal_tssa(w16, temp, bias)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), causal_tssa_reference(w16.float(), temp, bias), rtol=2e-3, atol=1e-2)
    o_t, st = causal_tssa_step(w16[:, :, 0], None, temp, bias)
    assert o_t.dtype == torch.float16 and st.sum_sq.dtype == torch.float32
    ob = causal_tssa(w.bfloat16(), temp, bias)
    assert ob.dtype == torch.bfloat16
    torch.testing.assert_close(ob.float(), causal_tssa(w, temp, bias), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(w=torch.randn(2, 7, 5)), ValueError, "w must have 4 dimensions"),
        (dict(temp=torch.ones(2, 1)), ValueError, r"temp must have shape \(H, 1\)"),
        (dict(pos_bias=torch.zeros(3, 16)), ValueError, "pos_bias must have 3 dimensions"),
        (dict(pos_bias=torch.zeros(2, 16, 1)), ValueError, r"pos_bias must have shape \(H, T_max, 1\)"),
        (dict(pos_bias=torch.zeros(3, 16, 5)), ValueError, r"pos_bias must have shape \(H, T_max, 1\)"),
        (dict(w=torch.randn(2, 3, 0, 5)), ValueError, "no tokens"),
        (dict(w=torch.randint(0, 3, (2, 3, 7, 5))), TypeError, "floating"),
        (dict(attn_mask=torch.ones(7, 2, dtype=torch.bool)), ValueError, "attn_mask must have shape"),
        (dict(attn_mask=torch.ones(2, 7)), TypeError, "additive"),
        (dict(attn_mask=torch.full((2, 7), 2)), ValueError, "0/1"),
    ],
)
def test_bad_inputs_raise(kwargs, err, match):
    args = dict(w=torch.randn(2, 3, 7, 5), temp=torch.ones(3, 1), pos_bias=torch.zeros(3, 16, 1))
    args.update(kwargs)
    with pytest.raises(err, match=match):
        causal_tssa(**args)


def test_step_bad_inputs_raise():
    temp = torch.ones(3, 1)
    with pytest.raises(ValueError, match="w_t must have 3 dimensions"):
        causal_tssa_step(torch.randn(2, 3, 1, 4), None, temp)
    _, state = causal_tssa_step(torch.randn(2, 3, 4), None, temp)
    with pytest.raises(ValueError, match=r"state.sum_sq must have shape \(2, 3, 5\)"):
        causal_tssa_step(torch.randn(2, 3, 5), state, temp)
    with pytest.raises(TypeError, match="CausalTSSAState"):
        causal_tssa_step(torch.randn(2, 3, 4), (1, 2, 3, 4), temp)


# ----------------------------------------------------------------------------- layer


def test_layer_parameters_and_registry():
    layer = CausalTSSA(24, num_heads=4, max_len=32)
    shapes = {k: tuple(v.shape) for k, v in layer.named_parameters()}
    assert shapes == {"qkv.weight": (24, 24), "temp": (4, 1), "pos_bias": (4, 32, 1), "proj.weight": (24, 24)}
    assert (layer.temp == 1).all() and (layer.pos_bias == 0).all()
    no_bias = CausalTSSA(24, num_heads=4, pos_bias=False, qkv_bias=True, proj_bias=True)
    assert no_bias.pos_bias is None
    assert set(dict(no_bias.named_parameters())) == {"qkv.weight", "qkv.bias", "temp", "proj.weight", "proj.bias"}
    assert "causal_tssa" in list_attention()
    assert isinstance(build("causal_tssa", 24, num_heads=4, max_len=8), CausalTSSA)
    with pytest.raises(ValueError, match="divisible"):
        CausalTSSA(10, num_heads=4)


def test_layer_forward_step_prefill_and_mask():
    layer = CausalTSSA(12, num_heads=3, max_len=10)
    with torch.no_grad():
        layer.pos_bias.normal_()
    x = torch.randn(2, 8, 12)
    w = rearrange(layer.qkv(x), "b n (h d) -> b h n d", h=3)
    out, pi = causal_tssa_reference(w, layer.temp, layer.pos_bias, return_pi=True)
    y, aux = layer(x, return_pi=True)
    torch.testing.assert_close(y, layer.proj(rearrange(out, "b h n d -> b n (h d)")))
    torch.testing.assert_close(aux["pi"], pi)
    state, ys = None, []
    for t in range(8):
        y_t, state = layer.step(x[:, t], state)
        ys.append(y_t)
    torch.testing.assert_close(torch.stack(ys, 1), y, rtol=1e-5, atol=1e-5)
    y_head, st = layer.prefill(x[:, :5])
    y_next, _ = layer.step(x[:, 5], st)
    torch.testing.assert_close(y_next, y[:, 5], rtol=1e-5, atol=1e-5)
    mask = torch.tensor([[True] * 8, [False] * 3 + [True] * 5])
    ym = layer(x, attn_mask=mask)
    torch.testing.assert_close(ym[1, 3:], layer(x[1:2, 3:])[0])
    assert (ym[1, :3] == 0).all()
    with pytest.raises(ValueError, match="exceeds the positional bias table"):
        layer(torch.randn(1, 11, 12))
    with pytest.raises(ValueError, match=r"x_t must have shape \(B, 12\)"):
        layer.step(torch.randn(2, 6))


def test_layer_autocast_bfloat16():
    layer = CausalTSSA(16, num_heads=4, max_len=8)
    x = torch.randn(2, 6, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), layer(x), rtol=5e-2, atol=5e-2)


def test_layer_compile_fullgraph():
    layer = CausalTSSA(8, num_heads=2, max_len=6).eval()
    x = torch.randn(2, 4, 8)
    mask = torch.tensor([[True] * 4, [False, True, True, True]])
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x, mask), layer(x, mask), rtol=1e-5, atol=1e-6)


def test_bias_table_limit_counts_real_tokens_only():
    """Padding has no position: a masked batch wider than T_max whose sequences each hold at most T_max real
    tokens runs, each sequence as alone (the padded width was checked against T_max)."""
    w, temp, bias = _inputs((2, 2, 8, 3), torch.float32, t_max=5)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, 3:], mask[1, 6:] = True, True
    out = causal_tssa(w, temp, bias, attn_mask=mask)
    torch.testing.assert_close(out, causal_tssa_reference(w, temp, bias, attn_mask=mask), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[:1, :, 3:], causal_tssa(w[:1, :, 3:], temp, bias), rtol=1e-5, atol=1e-6)
    mask[0, 2] = True  # 6 real tokens
    with pytest.raises(ValueError, match="N = 6 exceeds the positional bias table length T_max = 5"):
        causal_tssa(w, temp, bias, attn_mask=mask)
