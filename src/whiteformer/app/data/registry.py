"""The dataset name registry: :data:`DATASETS`, :func:`register_dataset` (with what a dataset
reads and its one-line help), and :func:`build_dataset`, the one place that checks a dataset's
arguments (:func:`check_dataset_args`). The builders import it; it imports none of them."""
from __future__ import annotations

import inspect
import math
import os
import typing
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from ..._checks import is_real
from ..._registry import Registry

__all__ = ["build_dataset", "list_datasets", "register_dataset", "dataset_builder", "dataset_info",
           "check_dataset_args", "check_dataset_values", "check_split", "check_data_dir", "DATASETS", "READS"]

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


#: the largest count a dataset argument ``num_*`` / ``limit`` may ask for (examples generated or read)
MAX_COUNT = 10 ** 9
#: seeds: what ``torch.manual_seed`` takes, negative ones refused
MAX_SEED = 2 ** 63 - 1


def _scalar_type(hint) -> Tuple[Optional[type], bool]:
    """(int / float / bool / str or None for any other annotation, whether None is allowed)."""
    optional = False
    if typing.get_origin(hint) is Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0] if len(args) == 1 else None
    return (hint if hint in (int, float, bool, str) else None), optional


def check_dataset_values(name: str, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``kwargs`` checked against the builder's annotations, converted (an integral float such as
    ``1e3`` for an int): an int / float / bool / str argument must be one (a str not empty), a
    number finite; counts (``num_*``, ``limit``) in [0, :data:`MAX_COUNT`], seeds in [0, 2**63 - 1].
    A ``ValueError`` / ``TypeError`` names the argument."""
    hints = typing.get_type_hints(dataset_builder(name))
    out = dict(kwargs)
    for key, value in kwargs.items():
        kind, optional = _scalar_type(hints.get(key))
        if kind is None or (value is None and optional):
            continue
        if kind is bool:
            if not isinstance(value, bool):
                raise TypeError(f"{key} must be true or false, got {value!r}")
        elif kind is str:  # (a path may be a PathLike)
            if not isinstance(value, (str, os.PathLike)) or not str(value):
                raise ValueError(f"{key} must be a non-empty string, got {value!r}")
        elif not is_real(value) or not math.isfinite(value):
            what = "an integer" if kind is int else "a number"
            raise ValueError(f"{key} must be {what if not is_real(value) else 'finite'}, got {value!r}")
        elif kind is float:
            out[key] = float(value)
        elif not float(value).is_integer():
            raise ValueError(f"{key} must be an integer, got {value!r}")
        else:
            out[key] = v = int(value)
            top = MAX_SEED if key.endswith("seed") else MAX_COUNT if key.startswith("num_") or key == "limit" else None
            if top is not None and not 0 <= v <= top:
                raise ValueError(f"{key} must be an integer in [0, {top}], got {value!r}")
    return out


def build_dataset(name: str, split: str = "train", **kwargs: Any):
    """Build dataset ``name`` for ``split`` ("train", "test"; "val" is an alias of "test" for the
    image datasets and the validation part of ``text``), after :func:`check_dataset_args`
    (unknown keyword arguments raise a ``TypeError`` listing the valid ones) and
    :func:`check_dataset_values` (each argument of the type its builder annotates)."""
    check_dataset_args(name, **kwargs)
    return dataset_builder(name)(split=split, **check_dataset_values(name, kwargs))


def check_split(name: str, split: str, canonical=("train", "test"), aliases=None) -> str:
    """The canonical split name (``aliases`` default: "val" -> "test"), or a clear ``ValueError``."""
    aliases = {"val": "test"} if aliases is None else aliases
    if split in canonical:
        return split
    if split in aliases:
        return aliases[split]
    raise ValueError(f"dataset {name!r}: unknown split {split!r}; expected one of {sorted(set(canonical) | set(aliases))}")
