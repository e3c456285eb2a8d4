"""bfloat16 over its whole range: ECAttention (expansion and compression), causal TSSA and DMSA,
operators and layers, match a float64 run on the same (bfloat16) values within bfloat16's own
rounding, for inputs from 1 to 1e30 (float32 statistics; powers of two rescale where squares
would overflow, :mod:`whiteformer.ops.scaling`)."""
import copy

import pytest
import torch

from whiteformer.attention import build
from whiteformer.ops import causal_tssa, dmsa, eca_compress, eca_expand, eca_omega

SCALES = [1.0, 1e10, 1e20, 1e30]
SEEDS = [0, 1, 2]
TOL = 2e-2  # a few units of bfloat16's rounding (2^-8), relative to the largest |entry| of a sequence


def _close(out, ref):
    assert out.dtype == torch.bfloat16
    out = out.double()
    assert torch.isfinite(out).all(), f"{(~torch.isfinite(out)).sum().item()} of {out.numel()} not finite"
    dims = tuple(range(1, ref.dim()))
    err = ((out - ref).abs().amax(dim=dims) / ref.abs().amax(dim=dims)).max().item()
    assert err <= TOL, f"max error {err:.3e} relative to the largest |entry| of a sequence"


def _values(shape, scale, seed):
    """bfloat16 values of N(0, scale^2) and the same values in float64."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(torch.bfloat16)
    return x, x.double()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scale", SCALES)
def test_operators_match_float64(scale, seed):
    x, x64 = _values((2, 9, 16), scale, seed)
    omega = eca_omega(9, 4, seed=seed)
    _close(eca_expand(x, omega), eca_expand(x64, omega.double()))
    u = torch.linalg.qr(torch.randn(16, 16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))[0]
    u = u.to(torch.bfloat16)
    out, pi = eca_compress(x, u, omega[:, :2], 0.5, 4, return_pi=True)
    ref, ref_pi = eca_compress(x64, u.double(), omega[:, :2].double(), 0.5, 4, return_pi=True)
    _close(out, ref)
    _close(pi, ref_pi)
    w, w64 = _values((2, 4, 9, 4), scale, seed + 10)
    temp = torch.rand(4, 1, generator=torch.Generator().manual_seed(seed)) + 0.5
    _close(causal_tssa(w, temp), causal_tssa(w64, temp.double()))
    logits, logits64 = _values((2, 9, 4), 3.0, seed + 20)
    for mode in ("membership", "channel"):
        _close(dmsa(w, logits, mode=mode), dmsa(w64, logits64, mode=mode))
    _close(dmsa(w, logits, sparsity="tokens"), dmsa(w64, logits64, sparsity="tokens"))


@pytest.mark.parametrize("name", ["eca", "causal_tssa", "dmsa"])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scale", SCALES)
def test_layers_match_float64(name, scale, seed):
    """The bfloat16 layer against its float64 copy (the same bfloat16 weights), on the same input.
    The output projection's bias is zeroed: it would hide the attention's error at large scales."""
    torch.manual_seed(seed)
    layer = build(name, dim=32, num_heads=4).eval().to(torch.bfloat16)
    proj = getattr(layer, "proj", None)
    if proj is not None and proj.bias is not None:
        torch.nn.init.zeros_(proj.bias)
    x, x64 = _values((2, 9, 32), scale, seed)
    with torch.no_grad():
        _close(layer(x), copy.deepcopy(layer).double()(x64))


@pytest.mark.parametrize("name", ["tssa", "causal_tssa"])
@pytest.mark.parametrize("seed", SEEDS)
def test_layer_with_one_huge_feature_matches_float64(name, seed):
    """One projected feature of one head at ~1e30 (its row of the qkv weight scaled), the others
    ordinary: each feature gets its own power of two, so the ordinary features of that head keep
    their squares (one scale per head sent them below float32's range)."""
    torch.manual_seed(seed)
    layer = build(name, dim=32, num_heads=4).eval()
    with torch.no_grad():
        layer.qkv.weight[9].mul_(1e30)  # head 1, feature 1 (head dim 8)
        if layer.proj.bias is not None:
            torch.nn.init.zeros_(layer.proj.bias)
    layer = layer.to(torch.bfloat16)
    x, x64 = _values((2, 9, 32), 1.0, seed)
    with torch.no_grad():
        _close(layer(x), copy.deepcopy(layer).double()(x64))
