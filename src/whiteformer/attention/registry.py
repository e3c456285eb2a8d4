"""Name registry for attention layers (``build``/``list_attention``), in the manner of timm's
``_registry.py``: each layer module registers its class with ``@register_attention("name")``."""
from __future__ import annotations

from typing import Callable, List, Tuple, Type

import torch.nn as nn

from .._registry import Registry

ATTENTION = Registry("attention")

#: the options a model passes to its attention layers (timm's ``Attention`` arguments); a layer class
#: that takes only some of them names those in its ``shell_options`` attribute
SHELL_OPTIONS = ("qkv_bias", "attn_drop", "proj_drop")


def register_attention(name: str) -> Callable[[Type[nn.Module]], Type[nn.Module]]:
    """Class decorator: register an attention layer under ``name``."""
    return ATTENTION.register(name)


def list_attention() -> List[str]:
    """Sorted names accepted by :func:`build`."""
    return ATTENTION.list()


def get_attention_class(name: str) -> Type[nn.Module]:
    """The layer class registered under ``name`` (``ValueError`` with the closest name otherwise)."""
    return ATTENTION.get(name)


def shell_options(name: str) -> Tuple[str, ...]:
    """The options of :data:`SHELL_OPTIONS` that the layer ``name`` takes: its class's
    ``shell_options``, all of them when it names none."""
    return getattr(get_attention_class(name), "shell_options", SHELL_OPTIONS)


def build(name: str, dim: int, num_heads: int = 8, **kwargs) -> nn.Module:
    """Build the attention layer ``name`` as ``cls(dim, num_heads=num_heads, **kwargs)``."""
    return get_attention_class(name)(dim, num_heads=num_heads, **kwargs)
