"""TSSA operator (main vs reference vs official formula), masks, dtypes, errors, and the layer."""
import pytest
import torch
import torch.nn.functional as F
from einops import rearrange

from whiteformer.attention import TSSA, build, list_attention
from whiteformer.ops import tssa
from whiteformer.ops.reference import tssa_reference

SHAPES = [(2, 3, 7, 5), (1, 4, 1, 3), (3, 2, 16, 8), (2, 1, 5, 1)]


def official_tssa(w, temp):
    """Independent transcription of the official TSSA (github RobinWu218/ToST, ``tost_vision/tost.py``):
    memberships from the token-normalised projection, statistics from the raw one."""
    w_normed = F.normalize(w, dim=-2)
    Pi = torch.softmax(temp * (w_normed**2).sum(-1), dim=1)
    dots = (Pi / (Pi.sum(-1, keepdim=True) + 1e-8)).unsqueeze(-2) @ w**2
    return -(w * Pi[..., None]) * (1 / (1 + dots)), Pi


def _inputs(shape, dtype=torch.float64, grad=False):
    w = torch.randn(*shape, dtype=dtype) * 2
    temp = torch.rand(shape[1], 1, dtype=dtype) * 2 + 0.5
    return w.requires_grad_(grad), temp.requires_grad_(grad)


def _random_mask(b, n):
    lengths = torch.randint(1, n + 1, (b,))
    lengths[0] = n
    return torch.arange(n)[None, :] < lengths[:, None]


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_official_formula(shape):
    w, temp = _inputs(shape, torch.float32)
    ref_out, ref_pi = official_tssa(w, temp)
    for fn in (tssa, tssa_reference):
        out, pi = fn(w, temp, return_pi=True)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pi, ref_pi, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
def test_main_vs_reference_forward_and_grads(shape, masked):
    w, temp = _inputs(shape, grad=True)
    mask = _random_mask(shape[0], shape[2]) if masked else None
    g_out = torch.randn(shape, dtype=torch.float64)
    g_pi = torch.randn(shape[:3], dtype=torch.float64)
    results = []
    for fn in (tssa, tssa_reference):
        out, pi = fn(w, temp, mask, return_pi=True)
        grads = torch.autograd.grad((out * g_out).sum() + (pi * g_pi).sum(), (w, temp))
        results.append((out, pi, *grads))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_gradcheck():
    w, temp = _inputs((2, 2, 4, 3), grad=True)
    assert torch.autograd.gradcheck(lambda w, t: tssa(w, t, return_pi=True), (w, temp))
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    assert torch.autograd.gradcheck(lambda w, t: tssa(w, t, mask, return_pi=True), (w, temp))


def test_padding_mask_equals_each_sequence_alone():
    b, h, n, p = 3, 2, 9, 4
    w, temp = _inputs((b, h, n, p), torch.float32)
    lengths = [9, 4, 1]
    mask = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    w = w.masked_fill(~mask[:, None, :, None], float("nan"))  # padded content must not leak
    out, pi = tssa(w, temp, mask, return_pi=True)
    for i, L in enumerate(lengths):
        alone, pi_alone = tssa(w[i : i + 1, :, :L], temp, return_pi=True)
        torch.testing.assert_close(out[i : i + 1, :, :L], alone, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pi[i : i + 1, :, :L], pi_alone, rtol=1e-5, atol=1e-6)
        assert (out[i, :, L:] == 0).all() and (pi[i, :, L:] == 0).all()
    # gradients never reach padded tokens
    wg = w.nan_to_num(3.0).requires_grad_(True)
    tssa(wg, temp, mask).sum().backward()
    assert (wg.grad[~mask[:, None, :, None].expand_as(wg)] == 0).all()
    assert torch.isfinite(wg.grad).all()


def test_pi_is_a_distribution_over_heads():
    w, temp = _inputs((2, 4, 6, 3), torch.float32)
    _, pi = tssa(w, temp, return_pi=True)
    assert pi.shape == (2, 4, 6) and (pi >= 0).all()
    torch.testing.assert_close(pi.sum(1), torch.ones(2, 6))


def test_attn_drop_on_gain():
    w, temp = _inputs((2, 3, 5, 4), torch.float64)
    base = tssa(w, temp)
    torch.testing.assert_close(tssa(w, temp, attn_drop=0.5, training=False), base)
    torch.manual_seed(1)
    dropped = tssa(w, temp, attn_drop=0.5, training=True)
    torch.manual_seed(1)
    ref = tssa_reference(w, temp, attn_drop=0.5, training=True)
    torch.testing.assert_close(dropped, ref)
    # gain dropped per (b, h, feature) for all tokens, else scaled by 1 / (1 - p)
    zero = (dropped == 0).all(dim=2)
    assert zero.any() and (~zero).any()
    keep = ~zero[:, :, None, :].expand_as(base)
    torch.testing.assert_close(dropped[keep], 2 * base[keep])


def test_float16_large_entries_finite_and_accurate():
    w, temp = _inputs((2, 2, 8, 4), torch.float32)
    w = (w / w.abs().max() * 1e3).half()
    out, pi = tssa(w, temp, return_pi=True)
    assert out.dtype == torch.float16 and pi.dtype == torch.float16
    assert torch.isfinite(out).all()
    ref = tssa_reference(w.float(), temp)
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=1e-2)


def test_bfloat16_and_float64():
    w, temp = _inputs((2, 2, 6, 4), torch.float64)
    ref = tssa_reference(w, temp)
    out = tssa(w.bfloat16(), temp.float())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    assert tssa(w, temp).dtype == torch.float64


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(w=torch.randn(2, 7, 5)), ValueError, "w must have 4 dimensions"),
        (dict(temp=torch.ones(4, 1)), ValueError, r"temp must have shape \(H, 1\)"),
        (dict(temp=torch.ones(3)), ValueError, "temp must have 2 dimensions"),
        (dict(w=torch.randn(2, 3, 0, 5)), ValueError, "no tokens"),
        (dict(w=torch.randint(0, 3, (2, 3, 7, 5))), TypeError, "floating"),
        (dict(attn_mask=torch.ones(2, 6, dtype=torch.bool)), ValueError, "attn_mask must have shape"),
        (dict(attn_mask=torch.ones(2, 7)), TypeError, "additive"),
        (dict(attn_drop=1.0), ValueError, "attn_drop"),
        (dict(normalize=1), TypeError, "normalize must be a bool, got int"),
    ],
)
def test_bad_inputs_raise(kwargs, err, match):
    args = dict(w=torch.randn(2, 3, 7, 5), temp=torch.ones(3, 1))
    args.update(kwargs)
    with pytest.raises(err, match=match):
        tssa(**args)


# ----------------------------------------------------------------------------- layer


def test_layer_parameters_and_registry():
    layer = TSSA(24, num_heads=4, qkv_bias=True)
    shapes = {k: tuple(v.shape) for k, v in layer.named_parameters()}
    assert shapes == {"qkv.weight": (24, 24), "qkv.bias": (24,), "temp": (4, 1),
                      "proj.weight": (24, 24), "proj.bias": (24,)}
    assert (layer.temp == 1).all()
    assert "tssa" in list_attention() and isinstance(build("tssa", 24, num_heads=4), TSSA)
    assert "qkv.bias" not in dict(TSSA(24, num_heads=4).named_parameters())


def test_layer_forward_composition_pi_and_mask():
    layer = TSSA(12, num_heads=3).double()
    x = torch.randn(3, 6, 12, dtype=torch.float64)
    w = rearrange(layer.qkv(x), "b n (h d) -> b h n d", h=3)
    out, pi = tssa_reference(w, layer.temp, return_pi=True)
    expected = layer.proj(rearrange(out, "b h n d -> b n (h d)"))
    y, aux = layer(x, return_pi=True)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(aux["pi"], pi)
    # padded batch == each sequence alone on real tokens; padded outputs 0
    mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3, [True] + [False] * 5])
    ym = layer(x, attn_mask=mask)
    for i, L in enumerate([6, 3, 1]):
        torch.testing.assert_close(ym[i, :L], layer(x[i : i + 1, :L])[0])
        assert (ym[i, L:] == 0).all()


def test_layer_attn_drop_honoured():
    layer = TSSA(16, num_heads=4, attn_drop=0.5)
    x = torch.randn(2, 5, 16)
    layer.eval()
    assert torch.equal(layer(x), layer(x))
    layer.train()
    assert not torch.allclose(layer(x), layer.eval()(x))


def test_layer_errors_and_autocast():
    with pytest.raises(ValueError, match="divisible"):
        TSSA(10, num_heads=4)
    layer = TSSA(16, num_heads=4)
    with pytest.raises(ValueError, match="last dimension 16"):
        layer(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="no tokens"):
        layer(torch.randn(2, 0, 16))
    x = torch.randn(2, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), layer(x), rtol=5e-2, atol=5e-2)


def test_layer_compile_fullgraph():
    layer = TSSA(8, num_heads=2).eval()
    x = torch.randn(2, 4, 8)
    mask = torch.tensor([[True] * 4, [True, True, False, False]])
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x, mask), layer(x, mask), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- normalize=False (ToST Table 8)
def test_no_l2_normalisation_matches_reference_and_formula():
    torch.manual_seed(1)
    w = torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True)
    temp = (torch.rand(3, 1, dtype=torch.float64) + 0.5).requires_grad_()
    out, pi = tssa(w, temp, return_pi=True, normalize=False)
    ref_out, ref_pi = tssa_reference(w, temp, return_pi=True, normalize=False)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(pi, ref_pi)
    # literal: Pi = softmax over heads of temp * sum_p w^2 (no division by the token norms)
    torch.testing.assert_close(pi, torch.softmax(temp * (w**2).sum(-1), dim=1))
    g = torch.randn_like(out)
    gw, gt = torch.autograd.grad(out, (w, temp), g)
    rw, rt = torch.autograd.grad(ref_out, (w, temp), g)
    torch.testing.assert_close(gw, rw)
    torch.testing.assert_close(gt, rt)
    assert not torch.allclose(pi, tssa(w, temp, return_pi=True)[1])  # the option changes Pi
    assert torch.autograd.gradcheck(lambda a, b: tssa(a, b, normalize=False), (w[:1, :, :3], temp))


def test_no_l2_normalisation_layer_option():
    layer = TSSA(16, num_heads=4, normalize=False)
    x = torch.randn(2, 6, 16)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    y = layer(x, attn_mask=mask)
    y_alone = layer(x[1:, :4])
    torch.testing.assert_close(y[1:, :4], y_alone, rtol=1e-5, atol=1e-6)
    normed = TSSA(16, num_heads=4)
    normed.load_state_dict(layer.state_dict())
    assert not torch.allclose(layer(x), normed(x))
    with pytest.raises(TypeError, match="normalize"):
        TSSA(16, num_heads=4, normalize="no")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_temp_is_refused_at_any_head(dtype, bad):
    """The temperature's values are read once per call (as Python floats for a few values): a
    non-finite one at any head raises, a finite one of any size passes."""
    w = torch.randn(1, 3, 4, 2, dtype=dtype)
    for head in range(3):
        temp = torch.ones(3, 1, dtype=dtype)
        temp[head] = bad
        with pytest.raises(ValueError, match="temp contains NaN or inf"):
            tssa(w, temp)
    big = torch.full((3, 1), torch.finfo(dtype).max, dtype=dtype)
    assert tssa(w, big).shape == w.shape
