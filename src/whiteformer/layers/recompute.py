"""Activation (gradient) checkpointing of a model's blocks, under timm's name.

``model.set_grad_checkpointing(True)`` makes the model run each block through
``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` while gradients are recorded: a block's
inner activations are not kept for backward but recomputed from its input (same loss and
gradients; dropout replays the same random numbers), so the memory of a training step holds one
(B, N, D) tensor per block instead of every block's intermediates.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .._checks import check_instance

__all__ = ["GradCheckpointMixin"]


class GradCheckpointMixin:
    """``set_grad_checkpointing`` (timm) and :meth:`run_block` for a model's blocks."""

    grad_checkpointing: bool = False
    _checkpoint_fn: Optional[Callable] = None  # e.g. transformers' own (offload ...); default use_reentrant=False

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True, checkpoint_fn: Optional[Callable] = None) -> None:
        """Checkpoint every block in training (``enable=False`` turns it off). ``checkpoint_fn``
        replaces ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` (same signature)."""
        check_instance(enable, "enable", bool, "a bool")
        self.grad_checkpointing = enable
        self._checkpoint_fn = checkpoint_fn

    def run_block(self, block: nn.Module, *args, **kwargs):
        """``block(*args, **kwargs)``, checkpointed when enabled and gradients are recorded."""
        if not (self.grad_checkpointing and torch.is_grad_enabled()):
            return block(*args, **kwargs)
        fn = self._checkpoint_fn or functools.partial(checkpoint, use_reentrant=False)
        return fn(block, *args, **kwargs)
