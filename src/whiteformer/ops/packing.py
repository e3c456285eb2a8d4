"""Packed variable-length sequences (FlashAttention's ``cu_seqlens`` convention).

S documents concatenated along the token axis of one row, ``w`` (1, H, total, p), with
``cu_seqlens`` (S + 1,) int32: document s is tokens ``cu_seqlens[s]:cu_seqlens[s + 1]``. Each
document is its own sequence (own statistics, memberships and positions).

The TSSA operators run a packed batch by laying the documents out as a padded batch
(S, H, L, p), L the longest document, with a keep-mask: the masked path of every backend
(PyTorch, C++ CPU kernel, Triton) already gives each real token the result of its sequence
alone, so packing is exactly "each document alone". The cost is the padding of that layout
(S * L slots for ``total`` tokens) inside the operator only.

Context parallelism (``group``): the packed row is split over the ranks (each holds a contiguous
chunk, ``cu_seqlens`` are the boundaries of the whole row, the same on every rank) and a document
may span rank boundaries. Each rank lays out its pieces of all S documents as (S, H, L_r, p), L_r
its longest piece (a document without tokens there is an all-padding row), so row s is document
s on every rank and the operators' context-parallel path combines each document's sums over the
ranks, positions included (:mod:`whiteformer.ops.context_parallel`).
"""
from __future__ import annotations

from typing import List, NamedTuple

import torch

from .._checks import check_cu_seqlens
from .context_parallel import check_group, chunk_layout

__all__ = ["Packing", "packing", "packed_layout", "to_padded", "from_padded", "segment_ids", "segment_positions"]


class Packing(NamedTuple):
    """Where the ``total`` packed tokens go in the padded (S, L) layout.

    lengths: the S document lengths; mask (S, L) bool, True at a real token; index (S, L) long:
    the packed token at each slot (a padded slot repeats its document's last token, or token 0);
    flat (total,) long: each packed token's slot in the flattened (S * L) layout.
    """

    lengths: List[int]
    mask: torch.Tensor
    index: torch.Tensor
    flat: torch.Tensor


def packing(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> Packing:
    """Validate ``cu_seqlens`` (see :func:`whiteformer._checks.check_cu_seqlens`) and build the layout."""
    lengths = check_cu_seqlens(cu_seqlens, total)
    return _layout(cu_seqlens[:-1].to(device=device, dtype=torch.long), lengths, total, device)


def _layout(starts: torch.Tensor, lengths: List[int], total: int, device: torch.device) -> Packing:
    """The padded layout of S pieces of a row of ``total`` tokens: piece s is ``lengths[s]``
    tokens from ``starts[s]``."""
    longest = max(lengths)
    lens = torch.tensor(lengths, device=device, dtype=torch.long)
    slot = torch.arange(longest, device=device)
    mask = slot[None, :] < lens[:, None]  # (S, L)
    index = (starts[:, None] + slot[None, :]).clamp_max(max(total - 1, 0))
    flat = torch.arange(len(lengths) * longest, device=device).reshape(len(lengths), longest)[mask]
    return Packing(lengths, mask, index, flat)


def packed_layout(w: torch.Tensor, attn_mask, cu_seqlens, group=None) -> Packing:
    """The checks of an operator called with ``cu_seqlens``: ``w`` (1, H, total, p), no
    ``attn_mask``, ``cu_seqlens`` on ``w``'s device; returns the layout (with a ``group``: of this
    rank's chunk, see the module docstring)."""
    if w.shape[0] != 1:
        raise ValueError(f"with cu_seqlens, w must hold the packed documents in one row, shape (1, H, total, p); "
                         f"got {tuple(w.shape)}")
    if attn_mask is not None:
        raise ValueError("attn_mask and cu_seqlens cannot be combined: a packed row has no padding (leave "
                         "attn_mask None)")
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device != w.device:
        raise ValueError(f"cu_seqlens must be on w's device ({w.device}), got {cu_seqlens.device}")
    if group is None:
        return packing(cu_seqlens, w.shape[2], w.device)
    return _chunk_packing(w, cu_seqlens, group)


def _chunk_packing(w: torch.Tensor, cu_seqlens, group) -> Packing:
    """The layout of this rank's pieces of the S documents of a packed row split over ``group``."""
    check_group(group)
    ok = isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1 and cu_seqlens.numel() > 0
    check_cu_seqlens(cu_seqlens, int(cu_seqlens[-1]) if ok else 0)  # all but the total, before any collective
    bounds = [int(v) for v in cu_seqlens.tolist()]
    modulus = (1 << 61) - 1  # a fingerprint of the boundaries: the same on every rank
    fingerprint = [len(bounds), sum(bounds) % modulus, sum((i + 1) * b for i, b in enumerate(bounds)) % modulus]
    start, total, _ = chunk_layout(w, group, same=fingerprint, same_name="cu_seqlens")
    check_cu_seqlens(cu_seqlens, total)
    end = start + w.shape[2]
    lo = [min(max(b, start), end) for b in bounds[:-1]]
    hi = [max(min(b, end), start) for b in bounds[1:]]
    pieces = [max(h - l, 0) for l, h in zip(lo, hi)]
    starts = torch.tensor([l - start for l in lo], device=w.device, dtype=torch.long)
    return _layout(starts, pieces, w.shape[2], w.device)


def to_padded(x: torch.Tensor, pk: Packing) -> torch.Tensor:
    """(1, H, total, ...) -> (S, H, L, ...) with zeros at padded slots."""
    y = x[0][:, pk.index].transpose(0, 1)  # (S, H, L, ...)
    keep = pk.mask.reshape(pk.mask.shape[0], 1, pk.mask.shape[1], *([1] * (x.dim() - 3)))
    return y.masked_fill(~keep, 0)


def from_padded(y: torch.Tensor, pk: Packing) -> torch.Tensor:
    """(S, H, L, ...) -> (1, H, total, ...): the real slots, in packed order."""
    s, h, length = y.shape[:3]
    flat = y.transpose(0, 1).reshape(h, s * length, *y.shape[3:])
    return flat[:, pk.flat].unsqueeze(0)


def segment_ids(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    """(total,) long: the document index of each packed token (validates ``cu_seqlens``)."""
    lengths = check_cu_seqlens(cu_seqlens, total)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                   torch.tensor(lengths, device=device), output_size=total)


def segment_positions(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    """(total,) long: each packed token's position within its document (0 at every start)."""
    starts = cu_seqlens.to(device=device, dtype=torch.long)[segment_ids(cu_seqlens, total, device)]
    return torch.arange(total, device=device) - starts
