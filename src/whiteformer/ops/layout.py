"""Token layouts: where the tokens of a batch are, validated and derived once per forward.

A batch reaches the ops in one of three layouts, each with its own facts (positions, which tokens
are real, which belong together): padding (``attn_mask`` (B, N), a keep-mask), packed documents
(``cu_seqlens``, below), and a sequence split over a context-parallel ``group`` (each rank holds
a contiguous chunk, :mod:`whiteformer.ops.context_parallel`). :class:`TokenLayout` holds them:
``TokenLayout.of(x, attn_mask, cu_seqlens, group)`` is the one validation of these arguments, and
there the one host read (``cu_seqlens`` to Python integers) and the one exchange between the ranks
(:func:`~whiteformer.ops.context_parallel.chunk_layout`, an all-gather) happen. Its views
(positions, the padded layout, the segments of the native path) are built when first asked and
kept, so a model builds the layout once per forward and hands it to every block: an L-block
model reads ``cu_seqlens`` once, not L + 1 times. An op or layer called alone builds its own.

Packed variable-length sequences (FlashAttention's ``cu_seqlens`` convention).

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
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from .._checks import check_cu_seqlens, check_cu_seqlens_total, check_mask, check_same_device
from .._compile import can_read_values
from .context_parallel import chunk_layout, local_checks

__all__ = ["TokenLayout", "Packing", "packing", "to_padded", "from_padded", "segment_ids", "segment_positions",
           "Segments", "segments", "segment_sum", "segment_amax", "segment_max_abs", "segment_cumsum", "segment_gather",
           "PADDED_WASTE_MAX", "pads_little"]

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


def pads_little(lengths: List[int]) -> bool:
    """Whether the padded layout of documents of these (checked) ``lengths`` has at most
    ``PADDED_WASTE_MAX * total`` slots."""
    return len(lengths) * max(lengths) <= PADDED_WASTE_MAX * max(sum(lengths), 1)


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


def segment_max_abs(x: torch.Tensor, seg: Segments) -> torch.Tensor:
    """(H, total, ...) -> (H, S, ...): the largest |x| over each document's tokens (0 for an empty
    one). Each bucket's padded rows repeat the document's first token in the padded slots instead
    of zeros, so ``max(amax, -amin)`` needs no |x| temporary (~5x faster than
    ``segment_amax(x.abs())`` on CPU)."""
    out = x.new_zeros(x.shape[0], len(seg.lengths), *x.shape[2:])
    for docs, pk in seg.buckets:
        rows = x[:, torch.where(pk.mask, pk.index, pk.index[:, :1])]  # (H, S_k, L_k, ...)
        out = out.index_copy(1, docs, torch.maximum(rows.amax(dim=2), -rows.amin(dim=2)))
    return out


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


# ------------------------------------------------------------------------------ the layout of a batch
class TokenLayout:
    """Where the tokens of a batch are: padding, packed documents, a split over processes (see the
    module docstring). Build it with :meth:`of`; a model builds it once per forward and passes it
    to every block (``layout=``), the ops and layers trust it.

    Attributes:
        batch, tokens: B and N of this process's chunk (tokens along the layout's token axis);
        device: the tokens' device;
        mask: (B, N) bool keep-mask or None (no padding);
        cu_seqlens: (S + 1,) boundaries of the S packed documents of the one row, or None;
        lengths: the S documents' lengths as Python ints (whole row), or None;
        group: the ``torch.distributed`` group the sequence is split over, or None;
        start: the position of this chunk's first token in its sequence (an int; with padding on a
            split sequence, a (B,) tensor: each sequence's real tokens on the earlier ranks);
        total: the whole sequence's (row's) token count, padding included.

    Views, computed when first used and kept: :attr:`real`, :attr:`longest`, :attr:`positions`,
    :attr:`packing` (the padded (S, L) layout), :attr:`segments` (the native path's index) and
    :meth:`padded` (the layout of the padded batch of documents).
    """

    def __init__(self, batch: int, tokens: int, device: torch.device, *, mask: Optional[torch.Tensor] = None,
                 cu_seqlens: Optional[torch.Tensor] = None, lengths: Optional[List[int]] = None, group=None,
                 start: Union[int, torch.Tensor] = 0, total: Optional[int] = None,
                 real: Union[int, torch.Tensor, None] = None, longest: Optional[int] = None):
        self.batch, self.tokens, self.device = batch, tokens, device
        self.mask, self.cu_seqlens, self.lengths, self.group = mask, cu_seqlens, lengths, group
        self.start = start
        self.total = tokens if total is None else total
        self._views: Dict[str, Any] = {}
        if real is not None:
            self._views["real"] = real
        if longest is not None:
            self._views["longest"] = longest

    def __repr__(self) -> str:
        kind = "packed" if self.packed else "padded" if self.mask is not None else "dense"
        split = "" if self.group is None else ", split"
        return f"TokenLayout({kind}, batch={self.batch}, tokens={self.tokens}{split})"

    @classmethod
    def of(cls, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
           group=None, *, token_dim: int = 1, name: str = "x", row: str = "(1, N, C)", same: Sequence[int] = (),
           same_name: str = "") -> "TokenLayout":
        """The layout of ``x`` (B, N, ...) (tokens along ``token_dim``: 1 for a layer's (B, N, C) or a
        model's (B, T) ids, 2 for an op's (B, H, N, p)), validating the arguments that describe it:

        - ``attn_mask`` (B, N) keep-mask (bool, or 0/1 integers), on ``x``'s device -> bool;
        - ``cu_seqlens`` (S + 1,) int32 boundaries of S packed documents in the one row ``row`` of
          ``x`` (no ``attn_mask`` then), on its device, read to the host here (the one host read);
        - ``group``: the process group of a split sequence; this rank's local checks come first
          (:class:`~whiteformer.ops.context_parallel.local_checks`), then the one exchange of the
          chunk shapes (:func:`~whiteformer.ops.context_parallel.chunk_layout`; with a mask, the real
          tokens per sequence too). ``same`` / ``same_name``: integers the caller needs equal on every
          rank (an op's own arguments), exchanged with the shapes (packed: in a second exchange, after
          the boundaries' fingerprint).

        ``name`` names ``x`` in the errors."""
        batch, tokens = x.shape[0], x.shape[token_dim]
        lengths, fingerprint = None, ()
        with local_checks(group, x):  # split: a rank failing these stops every rank
            attn_mask = check_mask(attn_mask, batch, tokens, device=x.device)
            if cu_seqlens is not None:
                if batch != 1:
                    raise ValueError(f"with cu_seqlens, {name} must hold the packed documents in one row {row}; got "
                                     f"{name} of shape {tuple(x.shape)}")
                if attn_mask is not None:
                    raise ValueError("attn_mask and cu_seqlens cannot be combined: a packed row has no padding "
                                     "(attn_mask must be None)")
                check_same_device(x, name, cu_seqlens=cu_seqlens)
                lengths = check_cu_seqlens(cu_seqlens, tokens if group is None else None)
                if group is not None:
                    fingerprint = _fingerprint(lengths)
        if group is None:
            return cls(batch, tokens, x.device, mask=attn_mask, cu_seqlens=cu_seqlens, lengths=lengths)
        if cu_seqlens is None:
            start, total, real = chunk_layout(x, group, attn_mask, name=name, token_dim=token_dim, same=same,
                                              same_name=same_name or "cu_seqlens")
            return cls(batch, tokens, x.device, mask=attn_mask, group=group, start=start, total=total, real=real)
        start, total, _ = chunk_layout(x, group, name=name, token_dim=token_dim, same=fingerprint,
                                       same_name="cu_seqlens")
        check_cu_seqlens_total(sum(lengths), total)  # the same boundaries on every rank: all raise together
        if same:
            chunk_layout(x, group, name=name, token_dim=token_dim, same=same, same_name=same_name)
        return cls(batch, tokens, x.device, cu_seqlens=cu_seqlens, lengths=lengths, group=group, start=start,
                   total=total)

    def check_matches(self, batch: int, tokens: int, name: str = "x") -> None:
        """A ``layout=`` handed to an op or layer describes its input's batch and token count."""
        if (batch, tokens) != (self.batch, self.tokens):
            raise ValueError(f"layout describes {self.batch} sequences of {self.tokens} tokens, {name} has {batch} of "
                             f"{tokens}: pass the layout of this input (TokenLayout.of)")

    # ---- views -----------------------------------------------------------------------------
    @property
    def packed(self) -> bool:
        """Whether the row holds packed documents (``cu_seqlens``)."""
        return self.cu_seqlens is not None

    @property
    def real(self) -> Union[int, torch.Tensor]:
        """The real tokens of each sequence, over every rank: an int without padding, else (B,)."""
        if "real" not in self._views:
            self._views["real"] = self.total if self.mask is None else self.mask.long().sum(dim=-1)
        return self._views["real"]

    @property
    def longest(self) -> int:
        """The most positions a sequence uses: the longest document (packed), the most real tokens of
        a sequence (padding; read once, and only outside torch.compile's tracing, else the padded
        length), else the whole length."""
        if "longest" not in self._views:
            real = self.real
            if self.packed:
                longest = max(self.lengths)
            elif isinstance(real, torch.Tensor):
                longest = (int(real.max()) if real.numel() else 0) if can_read_values() else self.total
            else:
                longest = real
            self._views["longest"] = longest
        return self._views["longest"]

    @property
    def positions(self) -> torch.Tensor:
        """(B, N) long: each token's position in its sequence, counting its real tokens only (padding
        gets its sequence's last position or 0), from 0 at each packed document's start, global over
        the ranks of a split sequence."""
        if "positions" not in self._views:
            if self.packed:
                lens = torch.tensor(self.lengths, device=self.device)
                ids = torch.repeat_interleave(torch.arange(len(self.lengths), device=self.device), lens,
                                              output_size=self.total)
                starts = torch.cumsum(lens, 0) - lens
                whole = torch.arange(self.total, device=self.device) - starts[ids]
                pos = whole[None, self.start:self.start + self.tokens]
            else:
                if self.mask is None:
                    pos = torch.arange(self.tokens, dtype=torch.long, device=self.device).expand(self.batch, -1)
                else:
                    pos = (self.mask.long().cumsum(dim=1) - 1).clamp_min(0)
                if isinstance(self.start, torch.Tensor):
                    pos = pos + self.start.to(pos.device, torch.long)[:, None]
                elif self.start:
                    pos = pos + self.start
            self._views["positions"] = pos
        return self._views["positions"]

    @property
    def pads_little(self) -> bool:
        """Whether the padded layout of the documents wastes little (:func:`pads_little`)."""
        return pads_little(self.lengths)

    @property
    def packing(self) -> Packing:
        """The padded (S, L) layout of the packed documents (this rank's pieces of them, L its longest
        piece, when the row is split: a document without tokens here is an all-padding row)."""
        if "packing" not in self._views:
            if self.group is None:
                pk = _layout(self.cu_seqlens[:-1].to(device=self.device, dtype=torch.long), self.lengths,
                             self.tokens, self.device)
            else:
                lo, pieces = self._pieces()
                starts = torch.tensor([lo_s - self.start for lo_s in lo], device=self.device, dtype=torch.long)
                pk = _layout(starts, pieces, self.tokens, self.device)
            self._views["packing"] = pk
        return self._views["packing"]

    @property
    def segments(self) -> Segments:
        """The index of the documents for the native (unpadded) path (:class:`Segments`; one process)."""
        if "segments" not in self._views:
            self._views["segments"] = segments(self.cu_seqlens, self.lengths, self.device)
        return self._views["segments"]

    def padded(self) -> "TokenLayout":
        """The layout of the packed documents laid out as a padded batch (S, L) (:attr:`packing`): its
        keep-mask, each document from position 0 (split: from its tokens on the earlier ranks)."""
        if "padded" not in self._views:
            pk = self.packing
            real = torch.tensor(self.lengths, device=self.device, dtype=torch.long)
            start: Union[int, torch.Tensor] = 0
            if self.group is not None:
                bounds = [0, *itertools.accumulate(self.lengths)]
                start = torch.tensor([max(min(b1, self.start) - b0, 0) for b0, b1 in zip(bounds, bounds[1:])],
                                     device=self.device, dtype=torch.long)
            self._views["padded"] = TokenLayout(len(self.lengths), pk.mask.shape[1], self.device, mask=pk.mask,
                                                group=self.group, start=start, total=pk.mask.shape[1], real=real,
                                                longest=max(self.lengths))
        return self._views["padded"]

    def _pieces(self) -> Tuple[List[int], List[int]]:
        """This rank's piece of each document of a split row: its first token's index in the row and
        its length (0 for a document without tokens here)."""
        bounds = [0, *itertools.accumulate(self.lengths)]
        end = self.start + self.tokens
        lo = [min(max(b, self.start), end) for b in bounds[:-1]]
        hi = [max(min(b, end), self.start) for b in bounds[1:]]
        return lo, [max(h - l, 0) for l, h in zip(lo, hi)]


def _fingerprint(lengths: List[int]) -> List[int]:
    """Three integers that tell the boundaries of documents of these ``lengths`` apart, compared
    between the ranks of a split row by :func:`~whiteformer.ops.context_parallel.chunk_layout`."""
    bounds = [0, *itertools.accumulate(lengths)]
    modulus = (1 << 61) - 1
    return [len(bounds), sum(bounds) % modulus, sum((i + 1) * b for i, b in enumerate(bounds)) % modulus]
