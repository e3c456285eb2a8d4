"""What a model needs to run context-parallel (its sequence split over the ranks of a group)."""
from __future__ import annotations

from typing import Iterable

import torch.nn as nn

from ..attention.context_parallel import ContextParallel


def one_process(model: nn.Module, what: str) -> None:
    """``ValueError`` when ``model`` is context-parallel: ``what`` (generation, intermediates) needs
    the whole sequence on one process."""
    if model.context_parallel_group is not None:
        raise ValueError(f"{what} runs on one process; the model is context-parallel (call "
                         "set_context_parallel(None) first)")


def check_blocks_split(model: nn.Module, blocks: Iterable[nn.Module]) -> None:
    """``ValueError`` unless every block's attention is :class:`ContextParallel` (split exactly by
    combining per-rank sums, as TSSA); attention that mixes token contents would need ring attention."""
    for i, blk in enumerate(blocks):
        if not isinstance(blk.attn, ContextParallel):
            raise ValueError(f"{type(model).__name__} cannot run context-parallel: block {i}'s attention "
                             f"({type(blk.attn).__name__}) is not split exactly by per-rank sums (it would need ring "
                             "attention); context parallelism is for TSSA (ToST) models")
