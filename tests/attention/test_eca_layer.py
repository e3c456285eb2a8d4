"""ECAttention's constructor and forward refuse what the layer cannot be: each bad argument raises
at the door with a message naming it."""
import pytest
import torch

from whiteformer.attention import ECAttention


def test_constructor_refuses_what_the_layer_cannot_be():
    with pytest.raises(ValueError, match="expand and compress cannot both be False"):
        ECAttention(16, num_heads=2, expand=False, compress=False)
    with pytest.raises(ValueError, match=r"rank \(9\) must be <= the head dimension p \(8\)"):
        ECAttention(16, num_heads=2, rank=9)
    with pytest.raises(ValueError, match=r"expand_rank \(17\) must be <= dim \(16\)"):
        ECAttention(16, num_heads=2, expand_rank=17)
    with pytest.raises(ValueError, match=r"seed must be a non-negative integer \(< 2\*\*63\), got -1"):
        ECAttention(16, num_heads=2, seed=-1)
    with pytest.raises(ValueError, match="alpha_init must be > 0 when positive=True"):
        ECAttention(16, num_heads=2, alpha_init=0.0)
    with pytest.raises(ValueError, match="beta_init must be a finite number"):
        ECAttention(16, num_heads=2, beta_init=float("nan"))
    with pytest.raises(ValueError, match="head_dim must be a positive integer"):
        ECAttention(16, num_heads=2, head_dim=0)
    ECAttention(16, num_heads=2, alpha_init=-0.1, positive=False)  # a signed scale without softplus


def test_return_pi_needs_the_compression_module():
    layer = ECAttention(16, num_heads=2, compress=False)
    x = torch.randn(2, 5, 16)
    assert layer(x).shape == x.shape
    with pytest.raises(ValueError, match="return_pi=True needs the compression module"):
        layer(x, return_pi=True)
