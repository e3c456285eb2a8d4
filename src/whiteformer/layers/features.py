"""timm's intermediate-feature protocol: block selection (``feature_take_indices``) and the shared
``forward_intermediates`` of class-token ViTs."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from .._checks import is_int

__all__ = ["feature_take_indices", "vit_forward_intermediates"]


def feature_take_indices(depth: int, indices: Optional[Union[int, Sequence[int]]] = None) -> Tuple[List[int], int]:
    """timm's block selection: None -> all, int n -> the last n, sequence -> those (negative ok).

    Returns ``(sorted indices, max index)``.
    """
    if indices is None:
        take = list(range(depth))
    elif is_int(indices):
        if not 0 < indices <= depth:
            raise ValueError(f"indices (last n blocks) must be in [1, {depth}], got {indices}")
        take = list(range(depth - indices, depth))
    else:
        take = []
        for i in indices:
            j = i + depth if i < 0 else i
            if not 0 <= j < depth:
                raise ValueError(f"block index {i} is out of range for {depth} blocks")
            take.append(j)
        take = sorted(set(take))
    return take, (max(take) if take else -1)


def vit_forward_intermediates(model: nn.Module, x: torch.Tensor, indices, return_prefix_tokens: bool,
                              norm: bool, stop_early: bool, output_fmt: str, intermediates_only: bool,
                              final_norm: nn.Module, inter_norm: nn.Module):
    """Shared timm-style ``forward_intermediates`` for class-token ViTs (``model._embed``,
    ``model.blocks``, ``model.patch_embed.grid_size``, ``model.num_prefix_tokens``)."""
    if output_fmt not in ("NCHW", "NLC"):
        raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
    take, max_index = feature_take_indices(len(model.blocks), indices)
    x = model._embed(x)
    blocks = model.blocks[: max_index + 1] if (stop_early or intermediates_only) else model.blocks
    inter = []
    for i, blk in enumerate(blocks):
        x = blk(x)
        if i in take:
            inter.append(inter_norm(x) if norm else x)
    npt = model.num_prefix_tokens
    prefix = [y[:, :npt] for y in inter]
    inter = [y[:, npt:] for y in inter]
    if output_fmt == "NCHW":
        h, w = model.patch_embed.grid_size
        inter = [y.reshape(y.shape[0], h, w, -1).permute(0, 3, 1, 2).contiguous() for y in inter]
    if return_prefix_tokens:
        inter = list(zip(inter, prefix))
    if intermediates_only:
        return inter
    return final_norm(x), inter
