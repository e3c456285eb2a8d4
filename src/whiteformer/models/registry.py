"""Model registry in the manner of timm's ``_registry.py``.

A model family module decorates entry-point functions with ``@register_model``; each entry
point takes keyword overrides for any constructor argument and returns an ``nn.Module``::

    @register_model
    def tost_t12_p16(**kwargs):
        return build_with_defaults(ToSTVision, dict(embed_dim=192, depth=12, num_heads=4), kwargs)

``create_model(name, num_classes=..., img_size=..., checkpoint_path=..., **overrides)`` builds the
model and, when given a checkpoint, loads it (own format, or a foreign format the model class
knows how to convert: see :mod:`whiteformer.models.checkpoint`).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional

import torch.nn as nn

_MODELS: Dict[str, Callable[..., nn.Module]] = {}


def register_model(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """Register an entry point under its function name."""
    name = fn.__name__
    if name in _MODELS and _MODELS[name] is not fn:
        raise ValueError(f"model name {name!r} is already registered")
    _MODELS[name] = fn
    return fn


def list_models(pattern: Optional[str] = None) -> List[str]:
    """Sorted registered model names, optionally filtered by an fnmatch ``pattern``."""
    import fnmatch

    names = sorted(_MODELS)
    return [n for n in names if fnmatch.fnmatch(n, pattern)] if pattern else names


def is_model(name: str) -> bool:
    return name in _MODELS


def build_with_defaults(cls: type, defaults: Dict[str, Any], overrides: Dict[str, Any]) -> nn.Module:
    """``cls(**{**defaults, **overrides})`` with a clear error for unknown override names."""
    params = inspect.signature(cls.__init__).parameters
    accepts_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if not accepts_var_kw:
        unknown = sorted(k for k in overrides if k not in params)
        if unknown:
            valid = sorted(k for k in params if k != "self")
            raise TypeError(f"{cls.__name__} got unknown argument(s) {unknown}; valid arguments: {valid}")
    return cls(**{**defaults, **overrides})


def create_model(
    name: str,
    num_classes: Optional[int] = None,
    img_size: Optional[int] = None,
    checkpoint_path: Optional[str] = None,
    **overrides: Any,
) -> nn.Module:
    """Build a registered model (timm-style).

    ``num_classes`` (default 1000) and ``img_size`` (default 224) are passed to vision models;
    models that do not take them (language models) ignore them when left at their defaults and
    raise a ``TypeError`` when they are set explicitly. ``checkpoint_path`` loads weights after
    building (own safetensors+JSON format, official ToST ``.pth`` files, timm state_dicts, transformers
    ViT/DeiT ``save_pretrained`` directories or their ``model.safetensors`` into ``deit_*``); for a
    directory written by ``save_pretrained``, its saved constructor arguments are used as defaults
    under ``overrides`` (so a small variant loads back), and its model name must equal ``name``.
    """
    # Importing the package registers every family's entry points.
    from . import _load_families  # noqa: F401

    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; see whiteformer.list_models() for the {len(_MODELS)} names")
    fn = _MODELS[name]
    kwargs = dict(overrides)
    if num_classes is not None:
        kwargs["num_classes"] = num_classes
    if img_size is not None:
        kwargs["img_size"] = img_size
    if checkpoint_path is not None:
        from .checkpoint import read_config

        config = read_config(checkpoint_path)
        if config is not None:
            saved_name = config.get("model_name")
            if saved_name and saved_name != name:
                raise ValueError(
                    f"checkpoint {str(checkpoint_path)!r} was saved from model {saved_name!r}, not {name!r}; "
                    f"use create_model({saved_name!r}, checkpoint_path=...) or "
                    "whiteformer.models.checkpoint.load_pretrained"
                )
            # The saved constructor arguments are the defaults; the caller's overrides win.
            kwargs = {**config.get("init_kwargs", {}), **kwargs}
            from .hf_vit import init_kwargs_from_config, is_hf_vit_config

            if is_hf_vit_config(config):  # a transformers ViT / DeiT directory: sizes from its config.json
                if not name.startswith("deit_"):
                    raise ValueError(f"checkpoint {str(checkpoint_path)!r} is a transformers {config['model_type']} "
                                     f"model; it loads into the deit_* models (timm layout), not {name!r}")
                kwargs = {**init_kwargs_from_config(config), **kwargs}
    model = fn(**kwargs)
    model.model_name = name
    if checkpoint_path is not None:
        from .checkpoint import load_checkpoint

        load_checkpoint(model, checkpoint_path)
    return model
