"""Name registry for attention layers (``build``/``list_attention``), in the manner of timm's
``_registry.py``: each layer module registers its class with ``@register_attention("name")``."""
from __future__ import annotations

from typing import Callable, Dict, List, Type

import torch.nn as nn

_ATTENTION: Dict[str, Type[nn.Module]] = {}


def register_attention(name: str) -> Callable[[Type[nn.Module]], Type[nn.Module]]:
    """Class decorator: register an attention layer under ``name``."""

    def deco(cls: Type[nn.Module]) -> Type[nn.Module]:
        if name in _ATTENTION and _ATTENTION[name] is not cls:
            raise ValueError(f"attention name {name!r} is already registered to {_ATTENTION[name].__name__}")
        _ATTENTION[name] = cls
        return cls

    return deco


def list_attention() -> List[str]:
    """Sorted names accepted by :func:`build`."""
    return sorted(_ATTENTION)


def get_attention_class(name: str) -> Type[nn.Module]:
    """The layer class registered under ``name``."""
    if not isinstance(name, str) or name not in _ATTENTION:
        raise ValueError(f"unknown attention {name!r}; expected one of {list_attention()}")
    return _ATTENTION[name]


def build(name: str, dim: int, num_heads: int = 8, **kwargs) -> nn.Module:
    """Build the attention layer ``name`` as ``cls(dim, num_heads=num_heads, **kwargs)``."""
    return get_attention_class(name)(dim, num_heads=num_heads, **kwargs)
