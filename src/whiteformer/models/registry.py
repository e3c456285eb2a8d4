"""Model registry in the manner of timm's ``_registry.py``.

A model family module decorates entry-point functions with ``@register_model``; each entry
point takes keyword overrides for any constructor argument and returns an ``nn.Module``::

    @register_model
    def tost_t12_p16(**kwargs):
        return build_with_defaults(ToSTVision, dict(embed_dim=192, depth=12, num_heads=4), kwargs)

``create_model(name, num_classes=..., img_size=..., checkpoint_path=..., **overrides)``
(:mod:`whiteformer.models.factory`) builds the model and, when given a checkpoint, loads it (own
format, or a foreign format the model class knows how to convert: see
:mod:`whiteformer.models.load`).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn

from .._checks import is_int
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
    """Register an entry point under its function name; its return annotation names the class it
    builds (``def tost_t12_p16(**kwargs) -> ToSTVision``), which :func:`model_class` reports."""
    return MODELS.register(fn.__name__, fn)


def model_class(name: str) -> Optional[type]:
    """The class the entry point ``name`` builds, as its return annotation states; None when it
    states none. A model class says what it is for in its own attributes, e.g. ``model_kind``
    ("image classifier", "sequence classifier", "causal language model") and
    ``length_free_kwargs`` (the arguments that remove a language model's length limit)."""
    import typing

    try:
        cls = typing.get_type_hints(MODELS.get(name)).get("return")
    except NameError:  # an annotation naming nothing importable
        return None
    return cls if isinstance(cls, type) else None


def list_models(pattern: Optional[str] = None) -> List[str]:
    """Sorted registered model names, optionally filtered by an fnmatch ``pattern``."""
    return MODELS.list(pattern)


def is_model(name: str) -> bool:
    return name in MODELS


#: an integer argument this large cannot size any tensor (torch's sizes are int64)
_UNBUILDABLE = 2**62


def _count_on_meta(cls: type, args: Dict[str, Any]) -> Optional[float]:
    """Parameters of ``cls(**args)``, counted on one model built on the ``meta`` device (nothing is
    allocated; the depth is already bounded). None when the constructor refuses the arguments (it
    says why when the model is built), inf for a size no tensor can have."""
    if any(is_int(v) and abs(v) >= _UNBUILDABLE for v in args.values()):
        return float("inf")
    try:
        with torch.device("meta"):
            model = cls(**args)
    except (TypeError, ValueError):
        return None
    return sum(p.numel() for p in model.parameters())


def build_with_defaults(cls: type, defaults: Dict[str, Any], overrides: Dict[str, Any]) -> nn.Module:
    """``cls(**{**defaults, **overrides})`` with a clear error for unknown override names, after the
    size bounds of :mod:`whiteformer.models.size` (blocks, then parameters counted on the ``meta``
    device) are checked."""
    params = inspect.signature(cls.__init__).parameters
    accepts_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if not accepts_var_kw:
        unknown = sorted(k for k in overrides if k not in params)
        if unknown:
            valid = sorted(k for k in params if k != "self")
            raise TypeError(f"{cls.__name__} got unknown argument(s) {unknown}; valid arguments: {valid}")
    kwargs = {**defaults, **overrides}
    args = {**{k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}, **kwargs}
    depth_keys = getattr(cls, "depth_args", ("depth",))
    check_model_size(cls.__name__, args, None, depth_keys)  # the depth first: the count below builds blocks
    check_model_size(cls.__name__, args, _count_on_meta(cls, args), ())
    return cls(**kwargs)


def get_model_entry(name: str) -> Callable[..., nn.Module]:
    """The entry point registered under ``name`` (``ValueError`` with the closest name and how to
    list them otherwise)."""
    return MODELS.get(name)
