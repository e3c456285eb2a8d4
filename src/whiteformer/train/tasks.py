"""What one training step reads and optimises, per kind of dataset.

The data seen at optimizer step ``s`` is a pure function of ``(seed, s)`` (through the epoch
``s // steps_per_epoch`` for classification), which makes runs resumable bit-exactly at any step
and lets data-parallel processes each take their slice of the same global batch:

- classification (images, vectors): epoch ``e`` visits the training set in the order
  ``randperm(N, seed=(seed, e))``, in full global batches (the incomplete last one is dropped);
  augmentation parameters of step ``s`` come from a generator seeded with ``(seed, s)``;
- sequence classification (ListOps) reads token sequences in the same order and asks a causal
  language model for the answer token after the expression;
- language modelling: step ``s`` reads ``batch_size`` random windows of ``block_size + 1``
  characters whose starts come from a generator seeded with ``(seed, s)``.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..data.augment import Augment
from .distributed import DistInfo, all_reduce_sum

__all__ = ["seeded_generator", "ClassificationTask", "SequenceTask", "LMTask", "make_task"]


def seeded_generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded by a hash of the integer ``keys`` (numpy's SeedSequence)."""
    state = np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in keys]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 31 ^ int(state[1]))


class _Task:
    kind = ""

    def __init__(self, train_ds, eval_ds, batch_size: int, seed: int, dist: DistInfo, bf16: bool = False):
        if batch_size % dist.world_size:
            raise ValueError(f"batch_size {batch_size} must be divisible by the number of processes "
                             f"{dist.world_size} (it is the global batch)")
        self.train_ds, self.eval_ds = train_ds, eval_ds
        self.batch_size, self.seed, self.dist = batch_size, seed, dist
        self.local_batch = batch_size // dist.world_size
        self.lo = dist.rank * self.local_batch
        self.hi = self.lo + self.local_batch
        self.device = dist.device
        self.bf16 = bf16

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def _to(self, *ts):
        return tuple(t.to(self.device, non_blocking=True) for t in ts)


class ClassificationTask(_Task):
    """Image / vector / token-sequence classification with cross-entropy (label smoothing)."""

    kind = "classification"

    def __init__(self, train_ds, eval_ds, batch_size: int, seed: int, dist: DistInfo, bf16: bool = False,
                 label_smoothing: float = 0.0, augment: Optional[Augment] = None, eval_batch_size: int = 256):
        super().__init__(train_ds, eval_ds, batch_size, seed, dist, bf16)
        n = len(train_ds)
        if n < batch_size:
            raise ValueError(f"batch_size {batch_size} is larger than the training set ({n} samples)")
        self.label_smoothing = label_smoothing
        self.augment = augment if (augment is not None and augment.active and train_ds.kind == "image") else None
        self.eval_batch_size = eval_batch_size
        self._perm_epoch = -1
        self._perm: Optional[torch.Tensor] = None

    @property
    def steps_per_epoch(self) -> int:
        return len(self.train_ds) // self.batch_size

    def order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            self._perm = torch.randperm(len(self.train_ds), generator=seeded_generator(self.seed, 1, epoch))
            self._perm_epoch = epoch
        return self._perm  # type: ignore[return-value]

    def global_indices(self, step: int) -> torch.Tensor:
        epoch, j = divmod(step, self.steps_per_epoch)
        return self.order(epoch)[j * self.batch_size:(j + 1) * self.batch_size]

    def train_batch(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        idx = self.global_indices(step)[self.lo:self.hi]
        transform = None
        if self.augment is not None:
            params = self.augment.sample(self.batch_size, seeded_generator(self.seed, 2, step))
            sl = slice(self.lo, self.hi)
            transform = lambda x: self.augment.apply(x, params, sl)  # noqa: E731
        return self._to(*self.train_ds.get_batch(idx, transform))

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
        with self.autocast():
            logits = self.logits(model, x)
        loss = F.cross_entropy(logits.float(), y, label_smoothing=self.label_smoothing)
        with torch.no_grad():
            correct = (logits.argmax(-1) == y).sum()
        return loss, {"correct": correct.float(), "count": torch.tensor(float(y.numel()), device=y.device)}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, ds=None) -> Dict[str, float]:
        """Mean cross-entropy (no smoothing) and accuracy on ``ds`` (default the eval split),
        sharded over the processes."""
        ds = ds if ds is not None else self.eval_ds
        was_training = model.training
        model.eval()
        idx_all = torch.arange(len(ds))[self.dist.rank::self.dist.world_size]
        tot = torch.zeros(3, dtype=torch.float64, device=self.device)
        for i in range(0, len(idx_all), self.eval_batch_size):
            x, y = self._to(*ds.get_batch(idx_all[i:i + self.eval_batch_size]))
            with self.autocast():
                logits = self.logits(model, x)
            tot[0] += F.cross_entropy(logits.float(), y, reduction="sum").double()
            tot[1] += (logits.argmax(-1) == y).sum().double()
            tot[2] += y.numel()
        all_reduce_sum(tot)
        model.train(was_training)
        n = max(tot[2].item(), 1.0)
        return {"loss": tot[0].item() / n, "acc": tot[1].item() / n, "n": int(tot[2].item())}


class SequenceTask(ClassificationTask):
    """Token sequences with one label (ListOps) read by a causal language model: the answer is
    the next token after the expression, i.e. the model's logits at the last real token restricted
    to the label tokens ``label_token_ids`` (ListOps: the digit tokens). Right padding is invisible
    to the causal model at that position."""

    def __init__(self, *args, label_token_ids: Optional[torch.Tensor] = None, **kw):
        super().__init__(*args, **kw)
        ds = self.train_ds
        if label_token_ids is None:
            label_token_ids = torch.tensor([ds.vocab.index(str(c)) for c in range(ds.num_classes)])
        self.label_token_ids = label_token_ids.to(self.device)

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = model(x)
        logits = out[0] if isinstance(out, tuple) else out  # (B, L, V)
        last = (x != self.train_ds.pad_id).sum(1).clamp_min(1) - 1
        at_end = logits[torch.arange(x.shape[0], device=x.device), last]  # (B, V)
        return at_end[:, self.label_token_ids]


class LMTask(_Task):
    """Next-character prediction on random windows (see module docstring)."""

    kind = "lm"

    def __init__(self, train_ds, eval_ds, batch_size: int, seed: int, dist: DistInfo, bf16: bool = False,
                 block_size: int = 128, eval_batches: int = 10):
        super().__init__(train_ds, eval_ds, batch_size, seed, dist, bf16)
        self.block_size = block_size
        self.eval_batches = eval_batches
        for ds in (train_ds, eval_ds):
            if len(ds) < block_size + 1:
                raise ValueError(f"{ds.name} has {len(ds)} characters, fewer than block_size + 1 = {block_size + 1}; "
                                 f"lower block_size")

    @property
    def steps_per_epoch(self) -> int:
        # Nominal epoch: as many windows as there are characters.
        return max(1, len(self.train_ds) // (self.batch_size * self.block_size))

    def train_batch(self, step: int):
        high = len(self.train_ds) - self.block_size
        starts = torch.randint(0, high, (self.batch_size,), generator=seeded_generator(self.seed, 3, step))
        return self._to(*self.train_ds.get_windows(starts[self.lo:self.hi], self.block_size))

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
        with self.autocast():
            _, loss = model(x, targets=y)
        return loss.float(), {"count": torch.tensor(float(y.numel()), device=y.device)}

    def eval_starts(self, ds) -> torch.Tensor:
        n = self.eval_batches * self.batch_size
        max_start = len(ds) - self.block_size - 1
        return (torch.arange(n, dtype=torch.long) * max_start) // max(n - 1, 1)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, ds=None) -> Dict[str, float]:
        """Mean next-character cross-entropy over evenly spread windows, and perplexity."""
        ds = ds if ds is not None else self.eval_ds
        was_training = model.training
        model.eval()
        starts = self.eval_starts(ds)[self.dist.rank::self.dist.world_size]
        tot = torch.zeros(2, dtype=torch.float64, device=self.device)
        for i in range(0, len(starts), self.local_batch):
            x, y = self._to(*ds.get_windows(starts[i:i + self.local_batch], self.block_size))
            with self.autocast():
                _, loss = model(x, targets=y)
            tot[0] += loss.double() * y.numel()
            tot[1] += y.numel()
        all_reduce_sum(tot)
        model.train(was_training)
        loss = tot[0].item() / max(tot[1].item(), 1.0)
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "n": int(tot[1].item())}


def make_task(cfg, train_ds, eval_ds, dist: DistInfo):
    if train_ds.kind == "lm":
        return LMTask(train_ds, eval_ds, cfg.batch_size, cfg.seed, dist, cfg.bf16, cfg.block_size, cfg.eval_batches)
    aug = Augment(translate=cfg.translate, flip=cfg.flip)
    if train_ds.kind == "sequence":
        return SequenceTask(train_ds, eval_ds, cfg.batch_size, cfg.seed, dist, cfg.bf16, cfg.label_smoothing, None,
                            eval_batch_size=max(cfg.batch_size, 256))
    return ClassificationTask(train_ds, eval_ds, cfg.batch_size, cfg.seed, dist, cfg.bf16, cfg.label_smoothing, aug,
                              eval_batch_size=max(cfg.batch_size, 256))
