"""A padded token (attn_mask False) takes no part, in every registered attention layer: NaN or inf
held at padded positions never reaches the real tokens' outputs, nor their gradients, nor the
layer's parameter gradients. The same for the functional baseline operators."""
import pytest
import torch

import whiteformer.attention  # noqa: F401  (imports and registers every layer)
from whiteformer.attention import build, list_attention
from whiteformer.ops import baselines as ops

NAMES = [n for n in list_attention() if not n.startswith("_")]
DIM, HEADS = 32, 4
LAYER_KWARGS = {"eca": {"rank": 1, "expand_rank": 1}}
# right padding, left padding and a hole in the middle (the class token, index 0, stays real)
KEEP = torch.tensor([[1, 1, 1, 1, 0, 0, 0],
                     [1, 0, 0, 1, 1, 1, 1],
                     [1, 1, 0, 1, 0, 1, 1]], dtype=torch.bool)


def _poisoned(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``x`` with NaN, +inf and -inf written into the padded positions."""
    bad = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=x.dtype)
    fill = bad[torch.arange(x[0].numel()) % 3].reshape(x.shape[1:]).expand_as(x)
    return torch.where(keep[..., None], x, fill)


@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_padding_never_reaches_real_tokens(name):
    layer = build(name, DIM, num_heads=HEADS, **LAYER_KWARGS.get(name, {})).double().eval()
    x = torch.randn(*KEEP.shape, DIM, dtype=torch.float64)
    clean = torch.where(KEEP[..., None], x, torch.zeros_like(x))
    try:
        ref = layer(clean, attn_mask=KEEP)
    except (ValueError, TypeError, NotImplementedError) as err:  # a layer may refuse masks (none does today)
        assert "attn_mask" in str(err)
        pytest.skip(f"{name} refuses attn_mask")
    xp = _poisoned(x, KEEP).requires_grad_(True)
    y = layer(xp, attn_mask=KEEP)
    real = KEEP[..., None].expand_as(y)
    assert torch.isfinite(y[real]).all(), f"{name}: NaN/inf of padded tokens reached real tokens"
    torch.testing.assert_close(y[real], ref[real], atol=1e-12, rtol=1e-10)
    (y[real] ** 2).sum().backward()
    assert torch.isfinite(xp.grad[real]).all(), f"{name}: non-finite gradient at real tokens"
    for pname, p in layer.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), f"{name}: padded tokens made the gradient of {pname} non-finite"


@pytest.mark.parametrize("op", ["mhsa", "mhsa_explicit", "mssa", "xca", "mhsa_causal"])
def test_baseline_ops_ignore_nonfinite_padding(op):
    B, N = KEEP.shape
    q, k, v = (torch.randn(B, 2, N, 8, dtype=torch.float64) for _ in range(3))
    pad = ~KEEP[:, None, :, None]

    def run(q, k, v):
        if op == "mssa":
            return ops.mssa(q, KEEP)
        if op == "xca":
            return ops.xca(q, k, v, 1.0, KEEP)
        if op == "mhsa_causal":
            return ops.mhsa(q, k, v, KEEP, causal=True)
        return getattr(ops, op)(q, k, v, KEEP)

    ref = run(*(t.masked_fill(pad, 0.0) for t in (q, k, v)))
    poisoned = [t.masked_fill(pad, float("nan")).requires_grad_(True) for t in (q, k, v)]
    out = run(*poisoned)
    real = KEEP[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[real], ref[real], atol=1e-12, rtol=1e-10)
    out[real].sum().backward()
    for t in poisoned:
        if t.grad is not None:
            assert torch.isfinite(t.grad).all()


def test_class_attention_op_ignores_nonfinite_padding():
    B, N = KEEP.shape
    q = torch.randn(B, 2, 1, 8, dtype=torch.float64)
    k, v = (torch.randn(B, 2, N, 8, dtype=torch.float64) for _ in range(2))
    pad = ~KEEP[:, None, :, None]
    ref = ops.class_attention(q, k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0), KEEP)
    kp, vp = (t.masked_fill(pad, float("inf")).requires_grad_(True) for t in (k, v))
    out = ops.class_attention(q, kp, vp, KEEP)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    out.sum().backward()
    assert torch.isfinite(kp.grad).all() and torch.isfinite(vp.grad).all()
