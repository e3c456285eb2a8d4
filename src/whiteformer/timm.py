"""The vision models of the zoo in timm's model registry.

``whiteformer.timm.register()`` (timm must import) adds every vision model of the zoo to timm's
registry, under ``whiteformer_<name>`` and, where timm has no model of that name, under ``<name>``
itself -- so ``timm.create_model("whiteformer_tost_s12_p16", num_classes=10)`` and
``timm.create_model("whiteformer/tost_s12_p16")`` (timm keeps the part after the last ``/``) build
them, ``features_only=True, out_indices=...`` included. The models implement timm's model API
(``forward_features`` / ``forward_head`` / ``forward_intermediates`` / ``prune_intermediate_layers``
/ ``set_grad_checkpointing`` / ``group_matcher`` / ``pretrained_cfg`` / ``reset_classifier``);
``pretrained=True`` with ``pretrained_cfg_overlay=dict(file=...)`` or ``dict(hf_hub_id=...)`` loads
weights as :func:`whiteformer.create_model` does (none are published: without an overlay it raises).
"""
from __future__ import annotations

import sys
from typing import Callable, List

from .models import create_model, list_models

__all__ = ["register", "vision_model_names"]


def vision_model_names() -> List[str]:
    """Registered whiteformer models that are image classifiers with timm's feature API (each built
    once on the ``meta`` device to ask)."""
    import torch

    out = []
    for name in list_models():
        with torch.device("meta"):
            model = create_model(name)
        if callable(getattr(model, "prune_intermediate_layers", None)):
            out.append(name)
    return out


def _entry(name: str, timm_name: str) -> Callable:
    def entry(pretrained: bool = False, pretrained_cfg=None, pretrained_cfg_overlay=None, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        if isinstance(pretrained_cfg, dict):
            kwargs["pretrained_cfg"] = pretrained_cfg
        return create_model(name, pretrained=bool(pretrained), pretrained_cfg_overlay=pretrained_cfg_overlay, **kwargs)

    entry.__name__ = entry.__qualname__ = timm_name
    entry.__module__ = __name__
    entry.__doc__ = f"whiteformer's {name} (see whiteformer.list_models())."
    return entry


_REGISTERED: List[str] = []


def register() -> List[str]:
    """Put the zoo's vision models in timm's registry (once); returns the timm names registered."""
    try:
        from timm.models import is_model, register_model
    except ImportError as err:
        raise ImportError(f"whiteformer.timm.register() needs timm (and the torchvision it imports): {err}") from err
    if _REGISTERED:
        return list(_REGISTERED)
    module = sys.modules[__name__]
    for name in vision_model_names():
        # timm's own model of the same name (if any) stays
        for timm_name in [f"whiteformer_{name}"] + ([] if is_model(name) else [name]):
            fn = _entry(name, timm_name)
            setattr(module, timm_name, fn)  # timm looks the entry point up in its module
            register_model(fn)
            _REGISTERED.append(timm_name)
    return list(_REGISTERED)
