"""The layer contract, checked for every registered attention layer (``list_attention()``, names
starting with "_" excluded): timm-style ``(B, N, C)`` in and out, float64, padding masks honoured
or refused clearly, input validation, fp16 robustness, ``torch.compile(fullgraph=True)`` and the
optional ``return_pi`` output."""
import inspect

import pytest
import torch

import whiteformer.attention  # noqa: F401  (imports and registers every layer)
from whiteformer.attention import build, list_attention

NAMES = [n for n in list_attention() if not n.startswith("_")]
DIM, HEADS = 32, 4

# Constructor kwargs some layers need at these tiny sizes: ECA needs its sketch ranks <= N (N = 1 here).
LAYER_KWARGS = {"eca": {"rank": 1, "expand_rank": 1}}
# Layers that are not token mixers: only token 0 is updated, tokens 1: pass through.
NON_MIXERS = {"class_attention"}
# Layers that cannot run in float16 on CPU (tested under bfloat16 autocast instead); none so far.
NO_CPU_FP16 = set()


def _build(name, dim=DIM, **extra):
    return build(name, dim, num_heads=HEADS, **LAYER_KWARGS.get(name, {}), **extra).eval()


def _has_return_pi(layer) -> bool:
    return "return_pi" in inspect.signature(layer.forward).parameters


def test_registry_is_populated():
    assert {"mhsa", "xca", "mssa", "class_attention"} <= set(NAMES)


def test_every_layer_class_is_exported():
    from whiteformer.attention import get_attention_class

    exported = set(whiteformer.attention.__all__)
    classes = [get_attention_class(n) for n in NAMES]
    own = [c for c in classes if c.__module__.startswith("whiteformer.attention.")]  # not whiteformer.compress's
    assert {"TSSA", "CausalTSSA", "DMSA", "ECAttention", "MHSA", "XCA", "MSSA", "ClassAttention"} <= {
        c.__name__ for c in own}
    for cls in own:
        assert cls.__name__ in exported and getattr(whiteformer.attention, cls.__name__) is cls
        assert cls.forward.__doc__, f"{cls.__name__}.forward has no docstring"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("N", [1, 7])
def test_shapes_and_gradients(name, N):
    layer = _build(name)
    x = torch.randn(2, N, DIM, requires_grad=True)
    y = layer(x)
    assert isinstance(y, torch.Tensor), f"{name} without return_pi must return a tensor"
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.isfinite(y).all()
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    grads = [p.grad for p in layer.parameters() if p.requires_grad]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("name", NAMES)
def test_float64(name):
    layer = _build(name).double()
    x = torch.randn(2, 7, DIM, dtype=torch.float64)
    y = layer(x)
    assert y.dtype == torch.float64 and y.shape == x.shape and torch.isfinite(y).all()


@pytest.mark.parametrize("name", NAMES)
def test_token_mixing(name):
    """Token 0 influences the last token (causal layers included); a class-attention layer only
    updates token 0 and passes the other tokens through."""
    layer = _build(name).double()
    x = torch.randn(1, 7, DIM, dtype=torch.float64)
    x2 = x.clone()
    if name in NON_MIXERS:
        x2[:, -1] += 1.0
        y, y2 = layer(x), layer(x2)
        assert not torch.allclose(y[:, 0], y2[:, 0])
        assert torch.equal(y[:, 1:], x[:, 1:]) and torch.equal(y2[:, 1:], x2[:, 1:])
    else:
        x2[:, 0] += 1.0
        assert not torch.allclose(layer(x)[:, -1], layer(x2)[:, -1])


@pytest.mark.parametrize("name", NAMES)
def test_attn_mask_honoured_or_refused(name):
    """Right-padded batch: real tokens get the result of their sequence alone, or the layer
    refuses the mask with an error naming ``attn_mask``."""
    layer = _build(name).double()
    x = torch.randn(3, 7, DIM, dtype=torch.float64)
    lengths = [7, 4, 1]
    keep = torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]
    try:
        y = layer(x, attn_mask=keep)
    except (ValueError, TypeError, NotImplementedError) as err:
        assert "attn_mask" in str(err), f"{name} refused the mask without naming it: {err}"
        return
    assert y.shape == x.shape and torch.isfinite(y).all()
    for b, n in enumerate(lengths):
        alone = layer(x[b:b + 1, :n])
        torch.testing.assert_close(y[b, :n], alone[0], atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(layer(x, attn_mask=torch.ones(3, 7, dtype=torch.bool)), layer(x))
    # transformers' long / int 0-1 masks mean the same as the bool one
    torch.testing.assert_close(layer(x, attn_mask=keep.long()), y)
    torch.testing.assert_close(layer(x, attn_mask=keep.int()), y)
    with pytest.raises(ValueError, match="attn_mask must hold 0/1"):
        layer(x, attn_mask=keep.long() * 2)
    with pytest.raises((ValueError, TypeError), match="attn_mask"):
        layer(x, attn_mask=keep[:, :5])
    with pytest.raises(TypeError, match="additive"):
        layer(x, attn_mask=keep.float())


@pytest.mark.parametrize("name", NAMES)
def test_padded_tokens_output_zero(name):
    """A padded token's output is 0 (NaN in its input included), class attention's passed-through
    tokens too; left, right and middle padding."""
    layer = _build(name).double()
    keep = torch.tensor([[1, 1, 1, 1, 0, 0, 0], [1, 0, 0, 1, 1, 1, 1], [1, 1, 0, 1, 0, 1, 1]], dtype=torch.bool)
    x = torch.randn(3, 7, DIM, dtype=torch.float64).masked_fill(~keep[..., None], float("nan"))
    y = layer(x, attn_mask=keep)
    assert torch.isfinite(y).all() and not y[~keep].any()


@pytest.mark.parametrize("name", NAMES)
def test_mask_on_another_device_is_named(name):
    layer = _build(name)
    x = torch.randn(2, 5, DIM)
    with pytest.raises(ValueError, match="attn_mask must be on the input's device"):
        layer(x, attn_mask=torch.ones(2, 5, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize("name", NAMES)
def test_input_on_another_device_than_the_layer_is_named_before_its_mask(name):
    """x on meta beside the layer's CPU weights, with a CPU mask: the error is x's (the mask is on the
    layer's device; x is what to move), not "attn_mask must be on the input's device"."""
    layer = _build(name)
    x = torch.randn(2, 5, DIM, device="meta")
    for mask in (None, torch.ones(2, 5, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"^x is on device meta"):
            layer(x, attn_mask=mask)


@pytest.mark.parametrize("name", NAMES)
def test_empty_batch(name):
    """B = 0, with and without a mask: an empty output."""
    layer = _build(name)
    x = torch.randn(0, 5, DIM)
    assert layer(x).shape == (0, 5, DIM)
    assert layer(x, attn_mask=torch.ones(0, 5, dtype=torch.bool)).shape == (0, 5, DIM)


@pytest.mark.parametrize("name", NAMES)
def test_dim_not_divisible_by_heads(name):
    with pytest.raises(ValueError, match="num_heads"):
        build(name, 30, num_heads=HEADS, **LAYER_KWARGS.get(name, {}))


@pytest.mark.parametrize("name", NAMES)
def test_bad_inputs(name):
    layer = _build(name)
    for bad in (torch.randn(7, DIM), torch.randn(1, 2, 7, DIM)):
        with pytest.raises(ValueError, match="dimensions"):
            layer(bad)
    with pytest.raises(ValueError, match=str(DIM)):
        layer(torch.randn(2, 7, DIM // 2))
    with pytest.raises(ValueError, match="no tokens"):
        layer(torch.randn(2, 0, DIM))
    with pytest.raises(TypeError, match="floating"):
        layer(torch.randint(0, 5, (2, 7, DIM)))


@pytest.mark.parametrize("name", NAMES)
def test_half_precision_large_inputs_finite(name):
    x = (torch.rand(2, 7, DIM) * 2 - 1) * 1e3
    layer = _build(name)
    if name in NO_CPU_FP16:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
    else:
        layer = layer.half()
        y = layer(x.half())
        assert y.dtype == torch.float16
    assert y.shape == x.shape and torch.isfinite(y).all()


@pytest.mark.parametrize("name", [n for n in NAMES if _has_return_pi(_build(n))])
def test_return_pi(name):
    layer = _build(name)
    x = torch.randn(2, 7, DIM)
    out = layer(x, return_pi=True)
    assert isinstance(out, tuple) and len(out) == 2
    y, aux = out
    assert isinstance(aux, dict) and "pi" in aux
    assert aux["pi"].shape == (2, HEADS, 7) and torch.isfinite(aux["pi"]).all()
    torch.testing.assert_close(y, layer(x))
    assert isinstance(layer(x, return_pi=False), torch.Tensor)


@pytest.mark.compile
@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()  # an inference graph only: keeps the compile time small
def test_compile_fullgraph_matches_eager(name):
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    layer = _build(name)
    x = torch.randn(2, 7, DIM)
    torch.manual_seed(1)
    want = layer(x)
    compiled = torch.compile(layer, fullgraph=True)
    with inductor_config.patch(fallback_random=True):  # same RNG stream as eager, should a layer sample
        torch.manual_seed(1)
        got = compiled(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
