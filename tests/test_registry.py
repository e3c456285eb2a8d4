import pytest
import torch.nn as nn

from whiteformer.attention import build, list_attention, register_attention
from whiteformer.attention.registry import get_attention_class


def test_unknown_name_raises_with_choices():
    with pytest.raises(ValueError, match="unknown attention"):
        build("no-such-attention", 16, num_heads=2)


def test_register_conflict_raises():
    from whiteformer.attention.registry import _ATTENTION

    @register_attention("_test_dummy")
    class Dummy(nn.Module):
        def __init__(self, dim, num_heads=1):
            super().__init__()

    assert "_test_dummy" in list_attention()
    assert get_attention_class("_test_dummy") is Dummy

    try:
        with pytest.raises(ValueError, match="already registered"):

            @register_attention("_test_dummy")
            class Other(nn.Module):
                pass
    finally:
        _ATTENTION.pop("_test_dummy", None)
    assert "_test_dummy" not in list_attention()
