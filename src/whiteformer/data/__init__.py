"""Offline datasets (nothing is downloaded at run time) behind a name registry.

=============== ============================================================================
name            what
=============== ============================================================================
``digits``      scikit-learn's bundled 8x8 handwritten digits (1797), fixed stratified split
``mnist``       MNIST from the standard IDX files (raw or .gz) in ``data_dir``
``image-folder`` class-per-subfolder images read with Pillow (``data_dir[/split]/class/*.png``)
``subspaces``   synthetic union of K orthogonal subspaces (ECA toy data), class = subspace
``text``        character-level language modelling on a text file (default: shipped corpus)
``listops``     Long-Range-Arena ListOps expressions from the task's grammar (generated)
=============== ============================================================================

``build_dataset(name, split, **kwargs)`` returns a dataset with ``get_batch(indices)`` and the
metadata models need (see :mod:`whiteformer.data.base`); ``list_datasets()`` lists the names.
Optional dependencies are imported lazily: ``digits`` needs scikit-learn and ``image-folder``
Pillow (``pip install whiteformer[data]``).
"""
from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable, Dict, List

from .base import ArrayDataset, FileImageDataset, SequenceDataset  # noqa: F401

__all__ = ["build_dataset", "list_datasets", "register_dataset", "dataset_builder", "ArrayDataset",
           "FileImageDataset", "SequenceDataset"]

_DATASETS: Dict[str, Callable[..., Any]] = {}


def register_dataset(name: str) -> Callable:
    """Decorator: register ``fn(split="train", **kwargs) -> dataset`` under ``name``."""

    def deco(fn: Callable) -> Callable:
        if name in _DATASETS and _DATASETS[name] is not fn:
            raise ValueError(f"dataset name {name!r} is already registered")
        _DATASETS[name] = fn
        return fn

    return deco


def list_datasets() -> List[str]:
    return sorted(_DATASETS)


def dataset_builder(name: str) -> Callable:
    """The registered builder of ``name`` (``ValueError`` naming the choices otherwise)."""
    if not isinstance(name, str) or name not in _DATASETS:
        close = difflib.get_close_matches(str(name), _DATASETS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown dataset {name!r}{hint}; available: {', '.join(list_datasets())}")
    return _DATASETS[name]


def build_dataset(name: str, split: str = "train", **kwargs: Any):
    """Build dataset ``name`` for ``split`` ("train", "test"; "val" is an alias of "test" for the
    image datasets and the validation part of ``text``). Unknown keyword arguments raise a
    ``TypeError`` listing the valid ones."""
    fn = dataset_builder(name)
    params = inspect.signature(fn).parameters
    unknown = sorted(k for k in kwargs if k not in params)
    if unknown:
        valid = sorted(k for k in params if k != "split")
        raise TypeError(f"dataset {name!r} got unknown argument(s) {unknown}; valid arguments: {valid}")
    return fn(split=split, **kwargs)


def check_split(name: str, split: str, canonical=("train", "test"), aliases=None) -> str:
    """The canonical split name (``aliases`` default: "val" -> "test"), or a clear ``ValueError``."""
    aliases = {"val": "test"} if aliases is None else aliases
    if split in canonical:
        return split
    if split in aliases:
        return aliases[split]
    raise ValueError(f"dataset {name!r}: unknown split {split!r}; expected one of {sorted(set(canonical) | set(aliases))}")


# Registration (each module decorates its builder).
from . import digits, image_folder, listops, mnist, pathfinder, plays, subspaces, text  # noqa: E402,F401
