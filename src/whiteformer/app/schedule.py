"""Learning-rate schedules (per optimizer step): linear warm-up, then a decay.

- ``cosine``: cosine decay to ``min_lr`` (the default of ``whiteformer train``);
- ``linear``: linear decay to ``min_lr`` at the last step (ToST Table 7: LRA Text, Retrieval,
  Image, Pathfinder);
- ``inverse_sqrt``: ``lr * sqrt(warmup / (step + 1))`` after the warm-up, never below ``min_lr``
  (ToST Table 7: LRA ListOps; the Transformer schedule of Vaswani et al., 2017, peak-normalised).
"""
from __future__ import annotations

import math

import torch

__all__ = ["warmup_cosine", "warmup_linear", "warmup_inverse_sqrt", "SCHEDULES", "lr_multiplier",
           "build_scheduler", "extend_schedule"]


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """LR multiplier at (0-based) ``step``: ``(step + 1) / warmup`` during the warm-up, then
    ``min_ratio + (1 - min_ratio) * (1 + cos(pi * t)) / 2`` with t going from 0 to 1 over the
    remaining steps (``min_ratio = min_lr / lr``)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    rest = max(1, total_steps - warmup_steps)
    t = min(1.0, (step - warmup_steps) / rest)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


def warmup_linear(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """Warm-up as :func:`warmup_cosine`, then ``1 - (1 - min_ratio) * t``, t from 0 to 1."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    rest = max(1, total_steps - warmup_steps)
    t = min(1.0, (step - warmup_steps) / rest)
    return 1.0 - (1.0 - min_ratio) * t


def warmup_inverse_sqrt(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """Warm-up as :func:`warmup_cosine`, then ``sqrt(max(warmup, 1) / (step + 1))`` (1 at the end of
    the warm-up), floored at ``min_ratio``; ``total_steps`` is not used."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    return max(min_ratio, math.sqrt(max(warmup_steps, 1) / (step + 1)))


SCHEDULES = {"cosine": warmup_cosine, "linear": warmup_linear, "inverse_sqrt": warmup_inverse_sqrt}


class _Multiplier:
    """Picklable multiplier for ``LambdaLR`` (the scheduler state_dict then round-trips)."""

    def __init__(self, total_steps: int, warmup_steps: int, min_ratio: float, schedule: str = "cosine"):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        self.total_steps, self.warmup_steps, self.min_ratio = total_steps, warmup_steps, min_ratio
        self.schedule = schedule

    def __call__(self, step: int) -> float:
        return SCHEDULES[self.schedule](step, self.total_steps, self.warmup_steps, self.min_ratio)


def lr_multiplier(schedule: str, step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """The multiplier of ``schedule`` ("cosine", "linear", "inverse_sqrt") at ``step``."""
    return _Multiplier(total_steps, warmup_steps, min_ratio, schedule)(step)


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int, lr: float,
                    min_lr: float, schedule: str = "cosine") -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _Multiplier(total_steps, warmup_steps, min_lr / lr, schedule))


def extend_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, total_steps: int) -> None:
    """Give a (restored) schedule a new length: the cosine then runs over ``total_steps`` from the
    scheduler's current step, the rate a run configured with that length would have used there."""
    for fn in scheduler.lr_lambdas:
        fn.total_steps = total_steps
    step = scheduler.last_epoch
    for group, base, fn in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * fn(step)
    scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]
