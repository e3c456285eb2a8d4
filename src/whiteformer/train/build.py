"""Building the datasets and the model of a run from its configuration, with the checks that
must fail before any work starts (unknown names, missing data, incompatible sizes)."""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch.nn as nn

from ..data import build_dataset, dataset_builder
from .configuration import ConfigError

__all__ = ["check_names", "build_datasets", "build_model", "dataset_kwargs", "unwrap"]

_DATA_DIR_DATASETS = ("mnist", "image-folder")


def check_names(model: Optional[str], dataset: Optional[str], data_dir: Optional[str] = None) -> None:
    """Unknown model / dataset names and missing data directories -> :class:`ConfigError`."""
    import difflib

    from ..models import list_models

    if model is not None:
        names = list_models()
        if model not in names:
            close = difflib.get_close_matches(model, names, n=3)
            hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
            raise ConfigError(f"unknown model {model!r}{hint}; `whiteformer list-models` lists the {len(names)} names")
    if dataset is not None:
        try:
            dataset_builder(dataset)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if dataset in _DATA_DIR_DATASETS:
            if data_dir is None:
                raise ConfigError(f"dataset {dataset!r} reads files: pass --data-dir DIR")
            if not Path(data_dir).expanduser().is_dir():
                raise ConfigError(f"dataset {dataset!r}: data directory {data_dir!r} does not exist")
        if dataset == "text" and data_dir is not None and not Path(data_dir).expanduser().is_file():
            raise ConfigError(f"dataset 'text': corpus file {data_dir!r} does not exist (give a .txt/.xz/.gz file)")


def dataset_kwargs(dataset: str, data_dir: Optional[str], data_args: Dict[str, Any]) -> Dict[str, Any]:
    kw = dict(data_args)
    if data_dir is not None:
        params = inspect.signature(dataset_builder(dataset)).parameters
        if "data_dir" not in params:
            raise ConfigError(f"dataset {dataset!r} does not read files; remove --data-dir")
        kw["data_dir"] = data_dir
    return kw


def build_datasets(dataset: str, data_dir: Optional[str], data_args: Dict[str, Any], eval_split: str):
    kw = dataset_kwargs(dataset, data_dir, data_args)
    try:
        return build_dataset(dataset, "train", **kw), build_dataset(dataset, eval_split, **kw)
    except (TypeError, ValueError, FileNotFoundError) as err:
        raise ConfigError(f"cannot build dataset {dataset!r}: {err}") from err


def build_model(name: str, ds, model_args: Dict[str, Any], finetune: Optional[str] = None,
                block_size: Optional[int] = None) -> nn.Module:
    """``create_model`` with the dataset's metadata (classes, image size, channels / vocabulary).

    ``finetune``: the checkpoint is loaded with its own head, then ``reset_classifier`` gives a
    new head when the number of classes differs.
    """
    from ..models import create_model

    kw = dict(model_args)
    kind = ds.kind
    if kind == "lm":
        kw.setdefault("vocab_size", ds.vocab_size)
        if block_size is not None:
            kw.setdefault("max_len", block_size)
        extra: Dict[str, Any] = {}
    elif kind == "sequence":
        # ListOps & co.: a causal language model over the sequence vocabulary answers with the
        # next token (see tasks.SequenceTask).
        kw.setdefault("vocab_size", ds.vocab_size)
        kw.setdefault("max_len", ds.max_len)
        extra = {}
    elif kind == "image":
        kw.setdefault("in_chans", ds.in_chans)
        h, w = ds.img_size
        extra = {"img_size": h if h == w else (h, w)}
        if finetune is None:
            extra["num_classes"] = ds.num_classes
    else:
        raise ConfigError(f"dataset {ds.name!r} yields {kind} data, which the registered models do not take "
                          f"(they read images, characters or token sequences); for 'subspaces' use "
                          f"data_args.layout=image")
    what = (f"{ds.num_classes} classes, images {ds.img_size} with {ds.in_chans} channel(s)" if kind == "image"
            else f"vocabulary {ds.vocab_size}")
    try:
        model = create_model(name, checkpoint_path=finetune, **extra, **kw)
    except FileNotFoundError as err:
        raise ConfigError(f"finetune checkpoint: {err}") from err
    except (TypeError, ValueError) as err:
        hint = ""
        msg = str(err)
        if kind in ("lm", "sequence") and "vocab_size" in msg and "unknown argument" in msg:
            hint = ("; the dataset holds characters / tokens: use a causal language model (tost_lm_*, gpt_*), "
                    "which for ListOps answers with the token after the expression")
        elif kind == "image" and "in_chans" in msg and "unknown argument" in msg:
            hint = "; the dataset holds images: use an image classifier (tost_*, dmst_*, eca_*, deit_*, crate_*)"
        elif "divisible by patch_size" in msg:
            hint = ("; choose a patch size that divides the image size (model_args.patch_size=...) or resize the "
                    "images (data_args.img_size=...)")
        raise ConfigError(f"cannot build model {name!r} for {ds.name} ({what}) with {kw}: {err}{hint}") from err
    if finetune is not None and kind == "image":
        if getattr(model, "num_classes", None) != ds.num_classes:
            if not hasattr(model, "reset_classifier"):
                raise ConfigError(f"model {name!r} has no reset_classifier(); cannot change its head to "
                                  f"{ds.num_classes} classes")
            model.reset_classifier(ds.num_classes)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP / torch.compile wrappers."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module) and \
                type(model).__name__ == "DistributedDataParallel":
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def describe(model: nn.Module) -> Tuple[int, str]:
    n = sum(p.numel() for p in model.parameters())
    return n, f"{n / 1e6:.3f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"
