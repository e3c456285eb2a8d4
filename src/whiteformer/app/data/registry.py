"""The dataset name registry: :data:`DATASETS`, :func:`register_dataset` (with what a dataset
reads and its one-line help), and :func:`build_dataset`, the one place that checks a dataset's
arguments (:func:`check_dataset_args`). The builders import it; it imports none of them."""
from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any, Callable, List, Optional

from ..._registry import Registry

__all__ = ["build_dataset", "list_datasets", "register_dataset", "dataset_builder", "dataset_info",
           "check_dataset_args", "check_split", "check_data_dir", "DATASETS", "READS"]

DATASETS = Registry("dataset", choices="available: {names}")
#: what ``reads=`` may say: ``None`` (generated or bundled), "directory" (``data_dir`` required),
#: "file" (``data_dir`` optional: a corpus file instead of the shipped one)
READS = (None, "directory", "file")


def register_dataset(name: str, reads: Optional[str] = None, help: Optional[str] = None) -> Callable:
    """Decorator: register ``fn(split="train", **kwargs) -> dataset`` under ``name``.

    ``reads``: what ``data_dir`` is for this dataset (:data:`READS`); ``help``: one line for
    ``whiteformer list-datasets`` (default: the first line of the builder's docstring). The
    builder's keyword arguments are read once, here (:func:`dataset_info`)."""
    if reads not in READS:
        raise ValueError(f"reads must be one of {READS}, got {reads!r}")

    def deco(fn: Callable) -> Callable:
        params = inspect.signature(fn).parameters
        if reads is not None and "data_dir" not in params:
            raise TypeError(f"dataset {name!r} reads a {reads} but its builder takes no data_dir argument")
        line = help or ((fn.__doc__ or "").strip().splitlines() or [""])[0]
        return DATASETS.register(name, fn, reads=reads, help=line,
                                 arguments=tuple(k for k in params if k != "split"))

    return deco


def list_datasets() -> List[str]:
    return DATASETS.list()


def dataset_builder(name: str) -> Callable:
    """The registered builder of ``name`` (``ValueError`` naming the closest name and the choices otherwise)."""
    return DATASETS.get(name)


def dataset_info(name: str) -> dict:
    """``{"reads": None | "directory" | "file", "help": str, "arguments": (keyword names,)}`` of ``name``."""
    return DATASETS.metadata(name)


def check_dataset_args(name: str, **kwargs: Any) -> None:
    """The checks :func:`build_dataset` makes before building (callable alone, e.g. before a run
    starts): a known name, keyword arguments the builder takes, and a ``data_dir`` that fits what
    the dataset reads (a directory that exists, a corpus file that exists, or none at all)."""
    info = dataset_info(name)
    unknown = sorted(k for k in kwargs if k not in info["arguments"])
    if unknown:
        if unknown == ["data_dir"]:
            raise TypeError(f"dataset {name!r} does not read files; remove data_dir (--data-dir)")
        raise TypeError(f"dataset {name!r} got unknown argument(s) {unknown}; "
                        f"valid arguments: {sorted(info['arguments'])}")
    data_dir = kwargs.get("data_dir")
    if info["reads"] == "directory":
        check_data_dir(data_dir, name)
    elif info["reads"] == "file" and data_dir is not None and not Path(os.path.expanduser(str(data_dir))).exists():
        raise FileNotFoundError(f"dataset {name!r}: corpus file {str(data_dir)!r} does not exist "
                                f"(give a .txt/.xz/.gz file)")


def check_data_dir(data_dir, dataset: str) -> Path:
    """``data_dir`` as a ``Path`` to an existing directory, or a clear error naming ``dataset``."""
    if data_dir is None:
        raise ValueError(f"dataset {dataset!r} needs a data directory: pass --data-dir DIR (data_dir=DIR)")
    path = Path(os.path.expanduser(str(data_dir)))
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise FileNotFoundError(f"dataset {dataset!r}: data directory {str(path)!r} {what}")
    return path


def build_dataset(name: str, split: str = "train", **kwargs: Any):
    """Build dataset ``name`` for ``split`` ("train", "test"; "val" is an alias of "test" for the
    image datasets and the validation part of ``text``), after :func:`check_dataset_args`
    (unknown keyword arguments raise a ``TypeError`` listing the valid ones)."""
    check_dataset_args(name, **kwargs)
    return dataset_builder(name)(split=split, **kwargs)


def check_split(name: str, split: str, canonical=("train", "test"), aliases=None) -> str:
    """The canonical split name (``aliases`` default: "val" -> "test"), or a clear ``ValueError``."""
    aliases = {"val": "test"} if aliases is None else aliases
    if split in canonical:
        return split
    if split in aliases:
        return aliases[split]
    raise ValueError(f"dataset {name!r}: unknown split {split!r}; expected one of {sorted(set(canonical) | set(aliases))}")
