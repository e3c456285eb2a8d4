"""Learning-rate schedule: linear warm-up then cosine decay to ``min_lr`` (per optimizer step)."""
from __future__ import annotations

import math

import torch

__all__ = ["warmup_cosine", "build_scheduler", "extend_schedule"]


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """LR multiplier at (0-based) ``step``: ``(step + 1) / warmup`` during the warm-up, then
    ``min_ratio + (1 - min_ratio) * (1 + cos(pi * t)) / 2`` with t going from 0 to 1 over the
    remaining steps (``min_ratio = min_lr / lr``)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    rest = max(1, total_steps - warmup_steps)
    t = min(1.0, (step - warmup_steps) / rest)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


class _WarmupCosine:
    """Picklable multiplier for ``LambdaLR`` (the scheduler state_dict then round-trips)."""

    def __init__(self, total_steps: int, warmup_steps: int, min_ratio: float):
        self.total_steps, self.warmup_steps, self.min_ratio = total_steps, warmup_steps, min_ratio

    def __call__(self, step: int) -> float:
        return warmup_cosine(step, self.total_steps, self.warmup_steps, self.min_ratio)


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int, lr: float,
                    min_lr: float) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _WarmupCosine(total_steps, warmup_steps, min_lr / lr))


def extend_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, total_steps: int) -> None:
    """Give a (restored) schedule a new length: the cosine then runs over ``total_steps`` from the
    scheduler's current step, the rate a run configured with that length would have used there."""
    for fn in scheduler.lr_lambdas:
        fn.total_steps = total_steps
    step = scheduler.last_epoch
    for group, base, fn in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * fn(step)
    scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]
