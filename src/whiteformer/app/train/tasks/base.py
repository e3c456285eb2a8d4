"""The contract of a task: what one training step reads and optimises, how a model is built for
the data, how it is evaluated and what the run report shows.

The data seen at optimizer step ``s`` is a pure function of ``(seed, s)``, which makes runs
resumable bit-exactly at any step and lets data-parallel processes each take their slice of the
same global batch (``lo:hi`` of the global batch belongs to this process).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn

from ...._progress import progress_bar
from ...config import ConfigError
from ..distributed import DistInfo

__all__ = ["seeded_generator", "Task", "ReportContext", "CausalLMData"]


def seeded_generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded by a hash of the integer ``keys`` (numpy's SeedSequence)."""
    state = np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in keys]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 31 ^ int(state[1]))


class ReportContext:
    """What a task's report section may use: the run directory, ``plt`` (matplotlib when figures can
    be drawn, else None; figures go through :mod:`whiteformer.analysis`, which never touches pyplot's
    backend), the analysis inputs ``x`` / ``labels`` (or None), and the ``results`` / ``figures`` /
    ``notes`` it may add to."""

    def __init__(self, run_dir, plt, x, labels, results: Dict[str, Any], figures: Dict[str, str], notes: List[str],
                 num_images: int = 4):
        self.run_dir, self.plt, self.x, self.labels = run_dir, plt, x, labels
        self.results, self.figures, self.notes, self.num_images = results, figures, notes, num_images


class Task:
    """Base class of the tasks; a subclass is registered for one or more dataset kinds
    (``register_task``) and implements the methods that raise ``NotImplementedError``.

    Class-level (need only a dataset): :meth:`model_kwargs`, :meth:`adapt_model`,
    :meth:`describe_data`, :meth:`check_model_kind`, :meth:`model_hint`, :meth:`check_model`.
    Per run: :meth:`train_batch`, :meth:`loss`, :meth:`evaluate`, :attr:`steps_per_epoch`,
    the metrics it reports (:meth:`summary`, :meth:`report_rows`, :meth:`report_sections`).
    """

    #: the trainer evaluates and checkpoints at the end of every epoch (else 10 times per run)
    epoch_based = True
    #: the run needs an explicit number of steps (``--steps``): an epoch is nominal
    requires_steps = False
    #: the metric shown as the quality of a model (a key of :meth:`evaluate`'s result)
    metric = "acc"
    #: the run options the constructor takes (:meth:`from_options`)
    options: Tuple[str, ...] = ("batch_size", "seed", "bf16")
    #: the kinds of model that read this task's data (a model class's ``model_kind``; () : any)
    model_kinds: Tuple[str, ...] = ()
    #: what to use instead, appended to the error for a model of another kind
    kind_hint = ""
    #: the defaults of :meth:`model_kwargs` given only to a model class whose constructor takes them
    optional_model_kwargs: Tuple[str, ...] = ()
    #: a progress bar over the batches of :meth:`evaluate` on a terminal (``whiteformer eval``; off during
    #: training, whose own bar runs)
    eval_progress = False

    def __init__(self, train_ds, eval_ds, batch_size: int = 64, seed: int = 0, dist: Optional[DistInfo] = None,
                 bf16: bool = False):
        dist = dist or DistInfo()
        if batch_size % dist.dp_size:
            groups = f"; with context parallelism {dist.cp_size}, the data-parallel groups" if dist.cp_size > 1 else ""
            raise ValueError(f"batch_size {batch_size} must be divisible by the number of processes "
                             f"{dist.dp_size} (it is the global batch){groups}")
        self.train_ds, self.eval_ds = train_ds, eval_ds
        self.batch_size, self.seed, self.dist = batch_size, seed, dist
        self.local_batch = batch_size // dist.dp_size
        self.lo = dist.dp_rank * self.local_batch
        self.hi = self.lo + self.local_batch
        self.device = dist.device
        self.bf16 = bf16
        self.amp_dtype = torch.bfloat16 if bf16 else None  # autocast dtype (None: float32)

    def set_precision(self, precision: str) -> None:
        """``fp32``, ``bf16`` or ``fp16``: the autocast dtype of :meth:`autocast`."""
        self.amp_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        self.bf16 = precision == "bf16"

    @classmethod
    def from_options(cls, train_ds, eval_ds, dist: Optional[DistInfo] = None, **options: Any) -> "Task":
        """The task with the options named in :attr:`options` (the others are ignored: one options
        mapping, e.g. a whole ``TrainConfig``, serves every task)."""
        return cls(train_ds, eval_ds, dist=dist, **{k: options[k] for k in cls.options if k in options})

    # ------------------------------------------------------------------ model for the data
    @classmethod
    def model_kwargs(cls, ds, *, finetune: Optional[str] = None, block_size: Optional[int] = None
                     ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """(defaults the user's model arguments may override, arguments fixed by the data)."""
        raise NotImplementedError

    @classmethod
    def adapt_model(cls, model: nn.Module, ds, finetune: Optional[str]) -> nn.Module:
        """Called after ``create_model`` (e.g. a fine-tuned classifier gets a new head)."""
        return model

    @classmethod
    def describe_data(cls, ds) -> str:
        return ds.name

    @classmethod
    def check_model_kind(cls, name: str, kind: Optional[str], ds) -> None:
        """:class:`ConfigError` before building when the model ``name`` is of a ``kind`` (its class's
        ``model_kind``; None: not stated) that does not read this task's data."""
        if kind is not None and cls.model_kinds and kind not in cls.model_kinds:
            raise ConfigError(f"cannot build model {name!r} for {ds.name} ({cls.describe_data(ds)}): a model of kind {kind!r}"
                              f"{cls.kind_hint}")

    @classmethod
    def model_hint(cls, message: str) -> str:
        """A hint appended to a model-construction error (e.g. sizes that do not fit the data)."""
        return ""

    @classmethod
    def check_model(cls, model: nn.Module, ds) -> None:
        """:class:`ConfigError` when ``model`` cannot read ``ds`` (e.g. eval on another kind of data)."""

    # ------------------------------------------------------------------ training
    @property
    def steps_per_epoch(self) -> int:
        raise NotImplementedError

    def train_batch(self, step: int):
        raise NotImplementedError

    def loss(self, model: nn.Module, x, y):
        """(scalar loss, {"count": n, ...}) of one batch; extra keys (``correct``) are summed."""
        raise NotImplementedError

    def train_metrics(self, totals: Dict[str, float]) -> Dict[str, float]:
        """Logged training metrics besides the loss from the summed statistics of :meth:`loss`."""
        return {}

    def evaluate(self, model: nn.Module, ds=None) -> Dict[str, float]:
        raise NotImplementedError

    def eval_steps(self, starts: range):
        """The first index of each evaluation batch, under a progress bar (batches, ETA) when
        :attr:`eval_progress` is on and stderr is a terminal."""
        bar = progress_bar(len(starts), "eval", "batch", enabled=self.eval_progress and self.dist.is_main)
        with bar:
            for i in starts:
                yield i
                bar.update(1)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.amp_dtype or torch.bfloat16,
                              enabled=self.amp_dtype is not None)

    def _to(self, *ts):
        return tuple(t.to(self.device, non_blocking=True) for t in ts)

    # ------------------------------------------------------------------ reporting
    def summary(self, res: Dict[str, float]) -> str:
        """The metrics for the terminal, e.g. ``accuracy 96.94 % (loss 0.1794, 359 samples)``."""
        raise NotImplementedError

    def report_rows(self, results: Dict[str, Any], split: str = "test") -> List[str]:
        """Markdown table rows (``| name | value |``) of the final metrics."""
        raise NotImplementedError

    def report_inputs(self, n: int = 64):
        """(x, labels) of the first evaluation samples: the inputs of the white-box analyses."""
        raise NotImplementedError

    def report_sections(self, model: nn.Module, ctx: ReportContext) -> List[str]:
        """Markdown lines of the task's own report sections (membership maps, text samples, ...)."""
        return []

    #: (key in the metrics log, axis label) of the evaluation curve
    curve = ("eval_acc", "accuracy")


class CausalLMData:
    """Mixin (listed before the :class:`Task` base) of the tasks whose data a causal language model
    reads (:class:`~.lm.LMTask`, :class:`~.sequence.SequenceTask`): the one-line summary, the hint on
    a model of another family, and the check that the model is a language model covering the
    vocabulary. ``holds``: what the dataset holds (for the messages); ``kind_hint``: the hint."""

    holds = "token sequences"
    model_kinds = ("causal language model",)
    kind_hint = "; use a causal language model (tost_lm_*, gpt_*)"

    @classmethod
    def describe_data(cls, ds) -> str:
        return f"vocabulary {ds.vocab_size}"

    @classmethod
    def check_model(cls, model: nn.Module, ds) -> None:
        vocab = getattr(model, "vocab_size", None)
        if vocab is None:
            raise ConfigError(f"dataset {ds.name!r} holds {cls.holds}, but the model ({type(model).__name__}) is not "
                              f"a language model; evaluate it on the kind of data it was trained on")
        if vocab < ds.vocab_size:
            raise ConfigError(f"dataset {ds.name!r} has a vocabulary of {ds.vocab_size} tokens, the model {vocab}")
