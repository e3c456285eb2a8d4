"""Packed variable-length sequences (FlashAttention's ``cu_seqlens`` convention).

S documents concatenated along the token axis of one row, ``w`` (1, H, total, p), with
``cu_seqlens`` (S + 1,) int32: document s is tokens ``cu_seqlens[s]:cu_seqlens[s + 1]``. Each
document is its own sequence (own statistics, memberships and positions).

Two ways to run a packed row, chosen by the operators (``group`` None):

- native (PyTorch path: ``WHITEFORMER_BACKEND=torch``, no kernel for the device/dtype,
  dropout, ``normalize=False``): :mod:`whiteformer.ops.tssa.varlen` and
  :mod:`whiteformer.ops.causal_tssa.varlen` work on the ``total`` tokens directly, with
  per-document sums (:func:`segment_sum`) and a segmented scan (:func:`segment_cumsum`): each
  document is summed on its own row of a padded layout of documents of similar length (within
  2x), so its statistics restart at its start exactly, and memory and time follow ``total``
  (under 2x), whatever the lengths.
- padded (C++ CPU kernel, Triton, when the layout wastes little: S * L <= PADDED_WASTE_MAX *
  ``total``, :func:`pads_little`): the documents are laid out as a padded batch (S, H, L, p),
  L the longest document, with a keep-mask; the masked path of the fused kernels already gives
  each real token the result of its sequence alone. The fused kernels have no varlen entry
  point, and the layout costs S * L slots for ``total`` tokens: for one 4096-token document and
  100 of 8 tokens (84x padding) the C++ kernel on it took 3.7 s and 2.5 GiB for forward +
  backward against 0.25 s and 0.3 GiB natively (``python -m benchmarks.packed_varlen --kernel``,
  CPU), so a packed row with more padding than that threshold takes the native path on every
  backend (not measured on GPU).

Context parallelism (``group``): the packed row is split over the ranks (each holds a contiguous
chunk, ``cu_seqlens`` are the boundaries of the whole row, the same on every rank) and a document
may span rank boundaries. Each rank lays out its pieces of all S documents as (S, H, L_r, p), L_r
its longest piece (a document without tokens there is an all-padding row), so row s is document
s on every rank and the operators' context-parallel path combines each document's sums over the
ranks, positions included (:mod:`whiteformer.ops.context_parallel`).
"""
from __future__ import annotations

import itertools
from typing import Dict, List, NamedTuple, Tuple

import torch

from .._checks import check_cu_seqlens, check_same_device
from .context_parallel import chunk_layout, local_checks

__all__ = ["Packing", "packing", "check_packed", "packed_layout", "to_padded", "from_padded", "segment_ids", "segment_positions",
           "split_cu_seqlens", "Segments", "segments", "segment_sum", "segment_amax", "segment_cumsum",
           "segment_gather", "PADDED_WASTE_MAX", "pads_little"]

#: the fused kernels run a packed row on the padded layout only while S * L <= this * total
PADDED_WASTE_MAX = 2.0


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


def packing(cu_seqlens: torch.Tensor, total: int, device: torch.device, lengths: List[int] | None = None) -> Packing:
    """The padded layout of the documents of ``cu_seqlens``: validated here (see
    :func:`whiteformer._checks.check_cu_seqlens`) unless the caller gives their checked ``lengths``."""
    if lengths is None:
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


def check_packed(w: torch.Tensor, attn_mask, cu_seqlens) -> None:
    """The checks of an operator called with ``cu_seqlens``: ``w`` (1, H, total, p), no
    ``attn_mask``, ``cu_seqlens`` on ``w``'s device (its values: :func:`packing`, :func:`segments`)."""
    if w.shape[0] != 1:
        raise ValueError(f"with cu_seqlens, w must hold the packed documents in one row, shape (1, H, total, p); "
                         f"got {tuple(w.shape)}")
    if attn_mask is not None:
        raise ValueError("attn_mask and cu_seqlens cannot be combined: a packed row has no padding (leave "
                         "attn_mask None)")
    check_same_device(w, "w", cu_seqlens=cu_seqlens)


def pads_little(lengths: List[int]) -> bool:
    """Whether the padded layout of documents of these (checked) ``lengths`` has at most
    ``PADDED_WASTE_MAX * total`` slots."""
    return len(lengths) * max(lengths) <= PADDED_WASTE_MAX * max(sum(lengths), 1)


def packed_layout(w: torch.Tensor, attn_mask, cu_seqlens, group=None, lengths: List[int] | None = None) -> Packing:
    """The padded layout of checked arguments (:func:`check_packed`; without a ``group``, the
    documents' ``lengths`` when the caller checked them; with a ``group``: of this rank's chunk, see
    the module docstring)."""
    if group is None:
        return packing(cu_seqlens, w.shape[2], w.device, lengths)
    return _chunk_packing(w, cu_seqlens, group)


def split_cu_seqlens(cu_seqlens) -> List[int]:
    """The checks of the ``cu_seqlens`` of a row split over a group that a rank can make alone
    (:func:`~whiteformer._checks.check_cu_seqlens` but the total, which needs every rank's chunk),
    returning a fingerprint of the boundaries (3 integers) that :func:`chunk_layout` checks equal
    on every rank."""
    ok = isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1 and cu_seqlens.numel() > 0
    check_cu_seqlens(cu_seqlens, int(cu_seqlens[-1]) if ok else 0)
    bounds = [int(v) for v in cu_seqlens.tolist()]
    modulus = (1 << 61) - 1
    return [len(bounds), sum(bounds) % modulus, sum((i + 1) * b for i, b in enumerate(bounds)) % modulus]


def _chunk_packing(w: torch.Tensor, cu_seqlens, group) -> Packing:
    """The layout of this rank's pieces of the S documents of a packed row split over ``group``."""
    with local_checks(group, w):
        fingerprint = split_cu_seqlens(cu_seqlens)
    start, total, _ = chunk_layout(w, group, same=fingerprint, same_name="cu_seqlens")
    bounds = [0, *itertools.accumulate(check_cu_seqlens(cu_seqlens, total))]
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
    return segments(cu_seqlens, check_cu_seqlens(cu_seqlens, total), device).ids


def segment_positions(cu_seqlens: torch.Tensor, lengths: List[int], device: torch.device) -> torch.Tensor:
    """(sum(lengths),) long: each packed token's position within its document (0 at every start),
    for documents of checked ``lengths`` (:func:`whiteformer._checks.check_cu_seqlens`)."""
    return segments(cu_seqlens, lengths, device).positions


class Segments(NamedTuple):
    """The packed documents of a row of ``total`` tokens, for the native (unpadded) path.

    lengths: the S document lengths; ids (total,) long: each token's document; starts (S,) long:
    each document's first token; positions (total,) long: each token's index in its document;
    buckets: the non-empty documents grouped by length, lengths in (2^(k-1), 2^k] for bucket k,
    each as (docs (S_k,) long, its padded :class:`Packing`), so a bucket's layout has fewer than
    twice its tokens in slots; order (total,) long: where each packed token lies in the
    concatenation of the buckets' tokens (bucket by bucket, document by document).
    """

    lengths: List[int]
    ids: torch.Tensor
    starts: torch.Tensor
    positions: torch.Tensor
    buckets: List[Tuple[torch.Tensor, Packing]]
    order: torch.Tensor


def segments(cu_seqlens: torch.Tensor, lengths: List[int], device: torch.device) -> Segments:
    """Index the S documents of ``cu_seqlens``, of checked ``lengths``
    (:func:`whiteformer._checks.check_cu_seqlens`, one host sync)."""
    total = sum(lengths)
    starts = cu_seqlens[:-1].to(device=device, dtype=torch.long)
    ids = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                  torch.tensor(lengths, device=device), output_size=total)
    by_size: Dict[int, List[int]] = {}
    for s, n in enumerate(lengths):
        if n:
            by_size.setdefault((n - 1).bit_length(), []).append(s)
    buckets = []
    for k in sorted(by_size):
        docs = torch.tensor(by_size[k], device=device, dtype=torch.long)
        buckets.append((docs, _layout(starts[docs], [lengths[s] for s in by_size[k]], total, device)))
    tokens = torch.cat([pk.index.reshape(-1)[pk.flat] for _, pk in buckets]) if buckets else ids
    order = torch.empty_like(tokens).scatter_(0, tokens, torch.arange(total, device=device))
    return Segments(lengths, ids, starts, torch.arange(total, device=device) - starts[ids], buckets, order)


def _bucket_rows(x: torch.Tensor, seg: Segments) -> List[torch.Tensor]:
    """(H, total, ...) -> each bucket's documents as padded rows (S_k, H, L_k, ...), zeros at padding."""
    return [to_padded(x.unsqueeze(0), pk) for _, pk in seg.buckets]


def segment_sum(x: torch.Tensor, seg: Segments) -> torch.Tensor:
    """(H, total, ...) -> (H, S, ...): the sum over each document's tokens (0 for an empty one),
    each document reduced on its own row."""
    return _segment_reduce(x, seg, torch.sum)


def segment_amax(x: torch.Tensor, seg: Segments) -> torch.Tensor:
    """(H, total, ...) of values >= 0 -> (H, S, ...): the largest over each document's tokens (0
    for an empty one), each document reduced on its own row."""
    return _segment_reduce(x, seg, torch.amax)


def _segment_reduce(x: torch.Tensor, seg: Segments, reduce) -> torch.Tensor:
    """(H, total, ...) -> (H, S, ...): ``reduce(rows, dim=2)`` over each document's row of its
    bucket's padded layout (0 at padding and for an empty document)."""
    parts = [reduce(rows, dim=2) for rows in _bucket_rows(x, seg)]  # (S_k, H, ...)
    out = x.new_zeros(len(seg.lengths), x.shape[0], *x.shape[2:])
    if parts:
        out = out.index_copy(0, torch.cat([docs for docs, _ in seg.buckets]), torch.cat(parts))
    return out.transpose(0, 1)


def segment_cumsum(x: torch.Tensor, seg: Segments, exclusive: bool = False) -> torch.Tensor:
    """(H, total, ...) -> (H, total, ...): prefix sums over dim 1 restarting at each document
    start, inclusive (or ``exclusive``: the sum over the document's earlier tokens, 0 at its start).

    A segmented scan: each document's prefix sums run on its own row of its bucket's padded
    layout (:class:`Segments`), so they, and their gradients (reverse prefix sums on the same
    rows), never see another document's values: the result is the one of the document alone,
    whatever the number, lengths and order of the documents before it. Memory is under twice
    ``x``'s size per bucket.
    """
    parts = []
    for rows, (_, pk) in zip(_bucket_rows(x, seg), seg.buckets):
        if exclusive:
            rows = torch.cat([torch.zeros_like(rows[:, :, :1]), rows[:, :, :-1]], dim=2)
        parts.append(from_padded(rows.cumsum(dim=2), pk)[0])
    return torch.cat(parts, dim=1).index_select(1, seg.order)


def segment_gather(table: torch.Tensor, seg: Segments) -> torch.Tensor:
    """(H, T, ...) with T >= the longest document -> (H, total, ...): each token's row of ``table``
    at its position in its document (0 at every start).

    Taken through the buckets' layout, so the gradient of ``table`` sums the tokens at one
    position as a batch reduction, as separate runs of the documents do, rather than
    accumulating thousands of documents one by one.
    """
    parts = []
    for docs, pk in seg.buckets:
        rows = table[:, :pk.mask.shape[1]]
        parts.append(from_padded(rows.unsqueeze(0).expand(len(docs), *rows.shape), pk)[0])
    return torch.cat(parts, dim=1).index_select(1, seg.order)
