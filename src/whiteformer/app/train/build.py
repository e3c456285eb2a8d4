"""Building the datasets and the model of a run from its configuration, with the checks that
must fail before any work starts (unknown names, missing data, incompatible sizes)."""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch.nn as nn

from ..config import ConfigError
from ..data import build_dataset, check_dataset_args
from .distributed import DistInfo
from .tasks import Task, task_class

__all__ = ["check_names", "build_datasets", "build_model", "build_task", "make_task", "dataset_kwargs", "unwrap"]

def check_names(model: Optional[str], dataset: Optional[str], data_dir: Optional[str] = None) -> None:
    """Unknown model / dataset names and missing data (:func:`whiteformer.app.data.check_dataset_args`)
    -> :class:`ConfigError`, before any work starts."""
    from ...models.registry import MODELS

    if model is not None and model not in MODELS:
        raise ConfigError(f"unknown model {model!r}{MODELS.hint(model, n=3)}; `whiteformer list-models` lists "
                          f"the {len(MODELS)} names")
    if dataset is not None:
        try:
            check_dataset_args(dataset, **({} if data_dir is None else {"data_dir": data_dir}))
        except (TypeError, ValueError, FileNotFoundError) as err:
            raise ConfigError(str(err).replace("data_dir (--data-dir)", "--data-dir")) from None


def dataset_kwargs(dataset: str, data_dir: Optional[str], data_args: Dict[str, Any]) -> Dict[str, Any]:
    """The keyword arguments of ``build_dataset``: ``data_args`` and ``data_dir`` when given."""
    return {**data_args, **({} if data_dir is None else {"data_dir": data_dir})}


def build_datasets(dataset: str, data_dir: Optional[str], data_args: Dict[str, Any], eval_split: str,
                   eval_only: bool = False):
    """(train split, ``eval_split``) of ``dataset``; with ``eval_only`` the evaluation split twice."""
    kw = dataset_kwargs(dataset, data_dir, data_args)
    try:
        ev = build_dataset(dataset, eval_split, **kw)
        return (ev if eval_only else build_dataset(dataset, "train", **kw)), ev
    except (TypeError, ValueError, FileNotFoundError, EOFError, OSError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"cannot build dataset {dataset!r}: {err}") from err


def build_model(name: str, ds, model_args: Dict[str, Any], finetune: Optional[str] = None,
                block_size: Optional[int] = None, unlimited_length: bool = False) -> nn.Module:
    """``create_model`` with what the dataset fixes (classes, image size, channels / vocabulary;
    the task of the data decides, :meth:`~.tasks.base.Task.model_kwargs`).

    ``finetune``: the checkpoint is loaded with its own head, then a classifier gets a new head
    when the number of classes differs. ``unlimited_length``: a model built from scratch also gets
    the arguments its class names as ``length_free_kwargs`` (a ToST language model: no absolute
    positions and no position bias, so no length limit; a decoder: ``max_len=None``), unless
    ``model_args`` sets them. A ``finetune`` checkpoint keeps its context limit (``max_len``); a
    ``block_size`` above it is a :class:`ConfigError`.
    A model whose class states a ``model_kind`` the task does not use is refused before building.
    """
    from ...models import create_model
    from ...models.registry import model_class

    task = task_class(ds)
    cls = model_class(name)
    task.check_model_kind(name, getattr(cls, "model_kind", None), ds)
    defaults, fixed = task.model_kwargs(ds, finetune=finetune, block_size=block_size)
    defaults = {k: v for k, v in defaults.items() if k not in task.optional_model_kwargs or _takes(cls, k)}
    optional = {} if (finetune is not None or not unlimited_length) else \
        {k: v for k, v in getattr(cls, "length_free_kwargs", {}).items() if k not in model_args}
    kw = {**defaults, **optional, **model_args}
    try:
        model = create_model(name, checkpoint_path=finetune, **fixed, **kw)
    except FileNotFoundError as err:
        raise ConfigError(f"finetune checkpoint: {err}") from err
    except (TypeError, ValueError) as err:
        raise ConfigError(f"cannot build model {name!r} for {ds.name} ({task.describe_data(ds)}) with {kw}: {err}"
                          f"{task.model_hint(str(err))}") from err
    limit = getattr(model, "context_limit", None)
    if finetune is not None and block_size is not None and isinstance(limit, int) and block_size > limit:
        raise ConfigError(f"block_size {block_size} exceeds the context limit {limit} of the finetune checkpoint "
                          f"{finetune!r} (its max_len); lower --block-size")
    return task.adapt_model(model, ds, finetune)


def _takes(cls, name: str) -> bool:
    """Whether the constructor of the model class ``cls`` takes the argument ``name``."""
    import inspect

    params = inspect.signature(cls).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def make_task(train_ds, eval_ds, dist: Optional[DistInfo] = None, **options: Any) -> Task:
    """The task of ``train_ds``'s kind with the options it names in ``Task.options`` (``batch_size``,
    ``seed``, ``bf16``, ``label_smoothing``, ``translate``, ``flip``, ``block_size``,
    ``eval_batches``, ``eval_batch_size``, ...; the others are ignored)."""
    options.setdefault("eval_batch_size", max(int(options.get("batch_size", 64)), 256))
    try:
        return task_class(train_ds).from_options(train_ds, eval_ds, dist or DistInfo(), **options)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(str(err)) from err


def build_task(dataset: str, *, data_dir: Optional[str] = None, data_args: Optional[Dict[str, Any]] = None,
               eval_split: str = "test", eval_only: bool = False, dist: Optional[DistInfo] = None,
               **options: Any) -> Task:
    """Build the datasets of ``dataset`` (the train split and ``eval_split``; only ``eval_split``,
    used for both, with ``eval_only``) and their task (:func:`make_task`)."""
    check_names(None, dataset, data_dir)
    train_ds, eval_ds = build_datasets(dataset, data_dir, data_args or {}, eval_split, eval_only=eval_only)
    return make_task(train_ds, eval_ds, dist, **options)


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
