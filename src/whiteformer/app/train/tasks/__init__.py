"""Tasks: everything that depends on the kind of data, behind one factory.

A dataset says what it holds through ``ds.kind`` ("image", "vector", "sequence", "lm", ...); the
task registered for that kind owns the rest: the model arguments the data fixes
(:meth:`~.base.Task.model_kwargs`), the batches of each step, the loss, the evaluation, the
one-line summary and the report's sections. ``train``, ``eval``, ``analyze report`` and
``compress`` all get their task from the one factory in :mod:`whiteformer.app.train.build`
(:func:`~whiteformer.app.train.build.build_task`: datasets by name; :func:`~whiteformer.app.train.build.make_task`:
datasets already built), so none of them branches on the kind of data. This package only holds the
tasks and their registry (:func:`register_task`, :func:`task_class`); it imports nothing that builds.

Adding a task (e.g. a new kind of data):

1. a dataset builder decorated with ``@whiteformer.app.data.register_dataset("name")`` returning a
   dataset whose ``kind`` is a new string (say ``"pixels"``), with ``get_batch(indices)`` and the
   metadata the models need;
2. a subclass of :class:`Task` (or :class:`ClassificationTask` for labelled data, which already
   does the seeded data order, cross-entropy and accuracy) implementing ``model_kwargs`` and
   whatever differs (``logits``, ``loss``, ``evaluate``, ``summary``, ``report_rows``,
   ``report_sections``), registered with ``@register_task("pixels")``. The run options its
   constructor takes are named in ``options`` (:meth:`Task.from_options`), and the kinds of model
   that read its data in ``model_kinds`` (a model class's ``model_kind``).

Every command then accepts ``--dataset name``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Type

from ...._registry import Registry
from ...config import ConfigError
from .base import ReportContext, Task, seeded_generator
from .classification import ClassificationTask, ImageClassificationTask, VectorClassificationTask
from .lm import LMTask
from .sequence import SequenceTask
from .tokens import TokenClassificationTask

__all__ = ["Task", "ReportContext", "ClassificationTask", "ImageClassificationTask", "VectorClassificationTask",
           "SequenceTask", "TokenClassificationTask", "LMTask",
           "seeded_generator", "register_task", "task_class", "task_options", "TASKS"]

TASKS = Registry("task")  # data kind -> task class


def register_task(*kinds: str) -> Callable[[Type[Task]], Type[Task]]:
    """Class decorator: ``cls`` is the task of datasets whose ``kind`` is one of ``kinds``."""

    def deco(cls: Type[Task]) -> Type[Task]:
        for kind in kinds:
            TASKS.register(kind, cls)
        return cls

    return deco


register_task("image")(ImageClassificationTask)
register_task("vector")(VectorClassificationTask)
register_task("sequence")(SequenceTask)
register_task("lm")(LMTask)
register_task("tokens")(TokenClassificationTask)


def task_class(ds) -> Type[Task]:
    """The task registered for ``ds.kind`` (``ds`` may also be the kind itself)."""
    kind = ds if isinstance(ds, str) else getattr(ds, "kind", None)
    if kind not in TASKS:
        raise ConfigError(f"no task handles data of kind {kind!r}{TASKS.hint(kind)} (known kinds: "
                          f"{', '.join(TASKS.list())}); register one with whiteformer.app.train.tasks.register_task")
    return TASKS[kind]


def task_options(cfg: Any) -> Dict[str, Any]:
    """The task options held by a configuration object (``TrainConfig``, ``EvalConfig``, ...)."""
    import dataclasses

    opts = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg)
    return {k: v for k, v in opts.items() if v is not None}
