"""Model registry in the manner of timm's ``_registry.py``.

A model family module decorates entry-point functions with ``@register_model``; each entry
point takes keyword overrides for any constructor argument and returns an ``nn.Module``::

    @register_model
    def tost_t12_p16(**kwargs):
        return build_with_defaults(ToSTVision, dict(embed_dim=192, depth=12, num_heads=4), kwargs)

``create_model(name, num_classes=..., img_size=..., checkpoint_path=..., **overrides)``
(:mod:`whiteformer.models.factory`) builds the model and, when given a checkpoint, loads it (own
format, or a foreign format the model class knows how to convert: see
:mod:`whiteformer.models.checkpoint`).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional

import torch.nn as nn

from .._registry import Registry
from .size import check_model_size

MODELS = Registry("model", choices="see whiteformer.list_models() for the {count} names")


#: Rewrites of a model's modules that its constructor arguments describe (a saved model's
#: ``init_kwargs``), run by the constructor before the weights load, as transformers' quantizers do;
#: keyed by that argument's name. :mod:`whiteformer.compress` registers "compression".
STRUCTURES = Registry("model structure")


def register_structure(name: str, apply: Callable[[nn.Module, Any], nn.Module]) -> None:
    """Register ``apply(model, spec)``, the rewrite that the constructor argument ``name`` describes."""
    STRUCTURES.register(name, apply)


def apply_structure(model: nn.Module, name: str, spec: Any) -> nn.Module:
    """Rewrite ``model`` as ``spec`` (its constructor argument ``name``) describes."""
    return STRUCTURES.get(name)(model, spec)


def register_model(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """Register an entry point under its function name."""
    return MODELS.register(fn.__name__, fn)


def list_models(pattern: Optional[str] = None) -> List[str]:
    """Sorted registered model names, optionally filtered by an fnmatch ``pattern``."""
    return MODELS.list(pattern)


def is_model(name: str) -> bool:
    return name in MODELS


def _estimate(cls: type, args: Dict[str, Any]) -> Optional[float]:
    """``cls.estimate_num_params(args)`` (arithmetic on the sizes), None when the class has none or
    an argument is not a number (the constructor then reports it), inf when a size overflows."""
    estimate = getattr(cls, "estimate_num_params", None)
    if estimate is None:
        return None
    try:
        return estimate(args)
    except OverflowError:
        return float("inf")
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError):
        return None


def build_with_defaults(cls: type, defaults: Dict[str, Any], overrides: Dict[str, Any]) -> nn.Module:
    """``cls(**{**defaults, **overrides})`` with a clear error for unknown override names, after the
    size bounds of :mod:`whiteformer.models.size` (blocks, estimated parameters) are checked from
    the arguments alone."""
    params = inspect.signature(cls.__init__).parameters
    accepts_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if not accepts_var_kw:
        unknown = sorted(k for k in overrides if k not in params)
        if unknown:
            valid = sorted(k for k in params if k != "self")
            raise TypeError(f"{cls.__name__} got unknown argument(s) {unknown}; valid arguments: {valid}")
    kwargs = {**defaults, **overrides}
    args = {**{k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}, **kwargs}
    check_model_size(cls.__name__, args, _estimate(cls, args), getattr(cls, "depth_args", ("depth",)))
    return cls(**kwargs)


def get_model_entry(name: str) -> Callable[..., nn.Module]:
    """The entry point registered under ``name`` (``ValueError`` with the closest name and how to
    list them otherwise)."""
    return MODELS.get(name)
