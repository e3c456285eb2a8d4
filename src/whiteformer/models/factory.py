"""Building models by name or from a saved directory (timm's ``create_model``, transformers'
``from_pretrained``).

A checkpoint may be named in three ways, everywhere: a directory written by ``save_pretrained``
(``config.json`` + ``model.safetensors``), a training run directory (its ``final/`` is used), or
that run's ``final/`` itself; a single weights file (``.safetensors``, ``.pth``, ...) also works
with :func:`create_model` when the model name is given (its sizes from the ``config.json`` beside it
when that describes a model, e.g. a saved folder's ``model.safetensors``; else the caller's).

Sizes read from a ``config.json`` are not trusted: every build first checks the bounds of
:mod:`whiteformer.models.size` (blocks, then parameters counted on the ``meta`` device); a
checkpoint's model is then built on the ``meta`` device (no memory) and refused when its parameters
and buffers would not fit in this machine's memory.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn as nn

from .._checks import check_instance
from .._files import check_path
from ..layers import FeatureGetterNet
from .formats.vit_weights import (
    HF_VIT_MODEL_TYPES,
    convert_hf_vit_state_dict,
    init_kwargs_from_config,
    is_hf_vit_config,
    model_name_for,
)
from .load import load_checkpoint
from .pretrained import merge_pretrained_cfg, pretrained_source
from .read import CONFIG_NAME, PathLike, read_config
from .registry import MODELS, get_model_entry, list_models

__all__ = ["create_model", "from_pretrained", "from_transformers_vit", "resolve_model_dir"]

#: where a training run keeps its final model and, with EMA, the averaged one (the one place they are named)
RUN_MODEL_DIR = "final"
RUN_EMA_MODEL_DIR = "final_ema"
#: prefix of the hidden folder where ``train --overwrite`` keeps the replaced run until the new one has its model
RUN_STASH_PREFIX = ".overwritten-"


def resolve_model_dir(path: PathLike, prefer_ema: bool = False) -> Path:
    """The model directory (or weights file) that ``path`` names: a saved model directory itself, a
    run directory's ``final/`` (its ``final_ema/`` first with ``prefer_ema``), or a file. Raises
    ``FileNotFoundError`` naming what was expected."""
    p = Path(check_path(path, "checkpoint")).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if p.is_file() or (p / CONFIG_NAME).is_file():
        return p
    for name in ((RUN_EMA_MODEL_DIR,) if prefer_ema else ()) + (RUN_MODEL_DIR,):
        if (p / name / CONFIG_NAME).is_file():
            return p / name
    hidden = sorted(str(e.parent.parent.name) for e in p.glob(f"{RUN_STASH_PREFIX}*/{RUN_MODEL_DIR}/{CONFIG_NAME}"))
    if hidden:
        raise FileNotFoundError(
            f"{str(path)!r} holds no model: a run started there with --overwrite was stopped before writing its "
            f"model; the run it replaces is kept in {str(p / hidden[0])!r} (`whiteformer train --out {str(path)}` "
            f"puts it back, `--resume` continues the stopped run)")
    raise FileNotFoundError(
        f"{str(path)!r} holds no model: expected a directory saved by save_pretrained (config.json + "
        f"model.safetensors), a training run directory with {RUN_MODEL_DIR}/, or a weights file")


def model_config(path: Path) -> Optional[dict]:
    """The ``config.json`` describing the model at ``path``: a folder's own, or, for a weights file, the
    one beside it when it describes a model (whiteformer's format with a ``model_name``, or a
    transformers ViT / DeiT), so that a saved folder's ``model.safetensors`` (or a checkpoint's
    ``ema.safetensors``) loads with the folder's sizes. A file beside it that is not a model's config,
    or cannot be read, is not the weights' (None: the sizes are the caller's)."""
    if path.is_dir():
        return read_config(path)
    try:
        config = read_config(path.parent)
    except ValueError:  # not a whiteformer config, not JSON (CheckpointFileError)
        return None
    if config is None or not (isinstance(config.get("model_name"), str) or is_hf_vit_config(config)):
        return None
    return config


def free_memory_bytes() -> Optional[int]:
    """The memory this machine has free for a new model: ``MemAvailable`` of ``/proc/meminfo`` (what can
    be allocated without swapping), else the free physical pages; None where neither is known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        return None


def _check_fits(entry, kwargs: dict, where: str) -> None:
    """Build on ``meta`` and refuse a model whose tensors, with the checkpoint's copy of them that
    loading reads, exceed the memory this machine has free (:func:`free_memory_bytes`), before any
    allocation."""
    try:
        with torch.device("meta"):
            probe = entry(**kwargs)
    except (NotImplementedError, RuntimeError):  # an op without a meta kernel: the real build decides
        return
    size = sum(t.numel() * t.element_size() for t in list(probe.parameters()) + list(probe.buffers()))
    free = free_memory_bytes()
    if free is not None and 2 * size > free:
        raise ValueError(f"{where} asks for a model of {size / 2**30:.1f} GiB of parameters; with the checkpoint's "
                         f"copy that is more than the {free / 2**30:.1f} GiB of memory this machine has free; "
                         "refusing to build it (check the sizes in its config.json)")


def _classifier_prefix(model: nn.Module) -> Optional[str]:
    get = getattr(model, "get_classifier", None)
    head = get() if callable(get) else None
    if head is None:
        return None
    for name, m in model.named_modules():
        if m is head and name:
            return name
    return None


def create_model(name: str, num_classes: Optional[int] = None, img_size: Optional[int] = None,
                 checkpoint_path: Optional[PathLike] = None, features_only: bool = False,
                 out_indices: Optional[Union[int, Sequence[int]]] = None, feature_cfg: Optional[dict] = None,
                 pretrained: bool = False, pretrained_cfg: Optional[dict] = None,
                 pretrained_cfg_overlay: Optional[dict] = None, **overrides: Any) -> nn.Module:
    """Build a registered model (timm-style), optionally loading a checkpoint.

    ``num_classes`` (default 1000) and ``img_size`` (default 224) go to vision models; models that
    do not take them (language models) raise a ``TypeError`` when they are set. ``checkpoint_path``
    (a saved model directory, a run directory, its ``final/``, or a weights file: own safetensors,
    official ToST ``.pth``, timm state_dicts, transformers ViT/DeiT ``save_pretrained`` directories or
    their ``model.safetensors`` into ``deit_*``) is loaded after building; a saved directory's
    constructor arguments are the defaults under ``overrides`` and its model name must equal
    ``name``. With ``num_classes`` different from the checkpoint's head, the head is left freshly
    initialised and everything else is loaded (as timm).

    ``pretrained=True`` (as timm) loads the weights that the model's ``pretrained_cfg``, updated by
    the ``pretrained_cfg`` and ``pretrained_cfg_overlay`` dicts, names: ``file`` (a local file or
    saved folder), ``hf_hub_id`` (a Hugging Face Hub repository, through ``huggingface_hub``'s cache
    and offline mode) or ``url``; see :mod:`whiteformer.models.pretrained`. A model with none
    published raises a ``ValueError`` saying how to load a local file.

    ``features_only=True`` (vision models, as timm): returns a
    :class:`~whiteformer.layers.FeatureGetterNet` whose forward gives the feature maps (B, D, Hp, Wp)
    of the blocks ``out_indices`` (int n: the last n, default 3; list: those), the model pruned
    after the last of them; ``feature_cfg`` may set ``output_fmt`` ("NCHW" / "NLC") and ``norm``.
    """
    check_instance(features_only, "features_only", bool, "a bool")
    if not features_only and (out_indices is not None or feature_cfg is not None):
        raise ValueError("out_indices and feature_cfg go with features_only=True")
    check_instance(pretrained, "pretrained", bool, "a bool")
    entry = get_model_entry(name)
    cfg = None
    if pretrained or pretrained_cfg is not None or pretrained_cfg_overlay is not None:
        cfg = merge_pretrained_cfg(MODELS.metadata(name).get("pretrained_cfg"), pretrained_cfg, pretrained_cfg_overlay)
    if checkpoint_path is not None:
        check_path(checkpoint_path, "checkpoint_path")
    if pretrained:
        if checkpoint_path is not None:
            raise ValueError("give pretrained=True (weights named by pretrained_cfg) or checkpoint_path, not both")
        checkpoint_path = pretrained_source(name, cfg)
    kwargs = dict(overrides)
    if num_classes is not None:
        kwargs["num_classes"] = num_classes
    if img_size is not None:
        kwargs["img_size"] = img_size
    path = None
    if checkpoint_path is not None:
        path = resolve_model_dir(checkpoint_path)
        config = model_config(path)
        if config is not None:
            saved_name = config.get("model_name")
            if saved_name and saved_name != name:
                raise ValueError(
                    f"checkpoint {str(checkpoint_path)!r} was saved from model {saved_name!r}, not {name!r}; "
                    f"use whiteformer.from_pretrained(path) or create_model({saved_name!r}, checkpoint_path=...)")
            # The saved constructor arguments are the defaults; the caller's overrides win.
            kwargs = {**config.get("init_kwargs", {}), **kwargs}
            if is_hf_vit_config(config):  # a transformers ViT / DeiT directory: sizes from its config.json
                if not (name.startswith("deit_") or name == "vit"):
                    raise ValueError(f"checkpoint {str(checkpoint_path)!r} is a transformers {config['model_type']} "
                                     f"model; it loads into the vit / deit_* models (timm layout), not {name!r}")
                kwargs = {**init_kwargs_from_config(config), **kwargs}
            _check_fits(entry, kwargs, f"checkpoint {str(checkpoint_path)!r}")
    model = entry(**kwargs)
    model.model_name = name
    if path is not None:
        head = _classifier_prefix(model) if num_classes is not None else None
        load_checkpoint(model, path, reset_prefix=head)
    if cfg is not None:
        own = getattr(model, "pretrained_cfg", None)
        model.pretrained_cfg = {**(own if isinstance(own, dict) else {}), **cfg}
    if features_only:
        if not callable(getattr(model, "prune_intermediate_layers", None)):
            raise ValueError(f"features_only=True needs a vision model with timm's feature API; {name!r} is a "
                             f"{type(model).__name__}")
        check_instance(feature_cfg, "feature_cfg", dict, "a dict (output_fmt, norm)", optional=True)
        return FeatureGetterNet(model, out_indices, **(feature_cfg or {}))
    return model


def from_pretrained(path: PathLike, **overrides: Any) -> nn.Module:
    """Build and load the model saved in ``path`` (a saved model directory, a run directory or its
    ``final/``); its name and constructor arguments are read from ``config.json`` (as transformers'
    ``from_pretrained``). ``overrides`` (e.g. ``num_classes=K``, which resets the head) win over the
    saved arguments."""
    model_dir = resolve_model_dir(check_path(path, "path"))
    config = model_config(model_dir)
    if config is None or not config.get("model_name"):
        raise ValueError(f"{str(path)!r} has no config.json with a model_name; use "
                         f"create_model(name, checkpoint_path=...) with one of {len(list_models())} names")
    return create_model(config["model_name"], checkpoint_path=model_dir, **overrides)



def from_transformers_vit(model: nn.Module) -> nn.Module:
    """A ``transformers`` ``ViTForImageClassification`` / ``ViTModel`` (or DeiT without distillation
    token) object -> the timm-layout whiteformer ViT with the same weights and logits
    (:mod:`whiteformer.models.formats.vit_weights`), named by its sizes (:func:`~whiteformer.models.formats.vit_weights.model_name_for`),
    on the same device and dtype."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in HF_VIT_MODEL_TYPES:
        raise ValueError(f"expected a transformers ViT / DeiT model (config.model_type in {HF_VIT_MODEL_TYPES}), got "
                         f"{type(model).__name__}")
    state = convert_hf_vit_state_dict(model.state_dict())
    kwargs = init_kwargs_from_config(config.to_dict())
    kwargs["num_classes"] = int(state["head.weight"].shape[0]) if "head.weight" in state else 0
    name = model_name_for(kwargs)
    ref = next(iter(model.parameters()))
    net = create_model(name, **kwargs).to(device=ref.device, dtype=ref.dtype)
    net.load_state_dict(state, strict=True)
    return net.train(model.training)
