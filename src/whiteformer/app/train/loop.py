"""One optimizer step, shared by the trainer and by fine-tuning after compression, and a plain
fine-tuning loop over a task.

A step: the task's loss of the batch, backward, optional gradient-norm clipping, the optimizer
and scheduler steps, then the ``post_step`` hooks (e.g. projecting constrained parameters back
onto their set after each step, as IrrAtt's head-fusion matrices, IrrAtt paper Sec. 3.3).
"""
from __future__ import annotations

import math
import time
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.nn as nn

from ..._checks import check_int

__all__ = ["check_finite_weights", "nonfinite_weight", "train_step", "finetune"]

PostStep = Callable[[nn.Module], object]


def train_step(model: nn.Module, task, optimizer: torch.optim.Optimizer, step: int, *, clip_grad: float = 0.0,
               scheduler=None, post_step: Sequence[PostStep] = (), hook_model: Optional[nn.Module] = None,
               scaler: Optional[torch.amp.GradScaler] = None, check_loss: bool = True):
    """Run optimizer step ``step`` on the task's batch of that step; returns ``(loss, stats, lr)``
    (the loss tensor, the task's summed statistics, the learning rate the step used).
    ``post_step`` hooks get ``hook_model`` (default ``model``; the plain module under DDP).
    ``scaler`` (float16 training): the loss is scaled for backward, the gradients unscaled before
    clipping, and a step with inf/NaN gradients is skipped (the scale then shrinks). Otherwise, with
    ``check_loss``, a non-finite loss is a :class:`FloatingPointError` naming the step, raised before
    the step changes the weights (distributed callers check the loss of all ranks together instead)."""
    x, y = task.train_batch(step)
    try:
        loss, stats = task.loss(model, x, y)
    except ValueError:  # an op's input check: NaN / inf in the weights (a previous step diverged)
        check_finite_weights(hook_model if hook_model is not None else model, f"at step {step + 1}")
        raise
    if check_loss and scaler is None and not bool(torch.isfinite(loss.detach())):
        raise FloatingPointError(f"the training loss is {float(loss.detach())} at step {step + 1} (diverged: lower the "
                                 f"learning rate or the weight decay, or clip gradients); no step was taken with it")
    optimizer.zero_grad(set_to_none=True)
    (loss if scaler is None else scaler.scale(loss)).backward()
    if scaler is not None:
        scaler.unscale_(optimizer)
    if clip_grad > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
    lr = optimizer.param_groups[0]["lr"]
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    if scheduler is not None:
        scheduler.step()
    for hook in post_step:
        hook(hook_model if hook_model is not None else model)
    return loss, stats, lr


def nonfinite_weight(model: nn.Module) -> Optional[str]:
    """The name of the first floating-point parameter or buffer of ``model`` holding NaN or inf, or None."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def check_finite_weights(model: nn.Module, when: str) -> None:
    """A :class:`FloatingPointError` when a weight of the trained ``model`` holds NaN or inf (``when``
    says where it was found)."""
    bad = nonfinite_weight(model)
    if bad is not None:
        raise FloatingPointError(f"the model's weights are not finite {when} ({bad} holds NaN or inf): training "
                                 f"diverged; lower the learning rate or the weight decay, or clip gradients")


def finetune(model: nn.Module, task, *, epochs: int = 1, lr: float = 1e-4, weight_decay: float = 0.05,
             max_steps: Optional[int] = None, post_step: Sequence[PostStep] = (),
             no_decay: Optional[Callable[[str], bool]] = None, log: Optional[Callable[[str], None]] = None
             ) -> Dict[str, float]:
    """Fine-tune ``model`` in place on ``task`` (its seeded data order): AdamW with
    :func:`~.optim.param_groups` (``no_decay`` names more parameters without weight decay), a constant
    learning rate, ``epochs`` passes (``max_steps`` stops early), ``post_step`` hooks after every
    step. Returns ``{"steps", "train_loss" (mean of the last epoch), "time_s"}``."""
    from .optim import build_optimizer

    check_int(epochs, "epochs", 1)
    if max_steps is not None:
        check_int(max_steps, "max_steps", 1)
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite positive number, got {lr!r}")
    say = log or (lambda _m: None)
    opt = build_optimizer(model, lr, weight_decay, no_decay=no_decay)
    t0, steps, mean = time.perf_counter(), 0, float("nan")
    was_training = model.training
    model.train()
    try:
        for epoch in range(epochs):
            if max_steps is not None and steps >= max_steps:
                break
            tot, done = 0.0, 0
            for j in range(task.steps_per_epoch):
                if max_steps is not None and steps >= max_steps:
                    break
                loss, _, _ = train_step(model, task, opt, epoch * task.steps_per_epoch + j, post_step=post_step)
                tot += float(loss.detach())
                done += 1
                steps += 1
            if done:
                mean = tot / done
                say(f"fine-tune epoch {epoch + 1}/{epochs}: train loss {mean:.4f} ({done} steps)")
    finally:
        model.train(was_training)
    return {"steps": steps, "train_loss": mean, "time_s": time.perf_counter() - t0}
