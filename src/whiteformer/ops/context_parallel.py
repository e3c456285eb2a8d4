"""Context parallelism: the collectives that let TSSA run on a sequence split over processes.

Each process of a ``torch.distributed`` group holds one contiguous chunk of the tokens (group
rank order = sequence order; chunks may differ in length, and the ops :func:`~whiteformer.ops.tssa` /
:func:`~whiteformer.ops.causal_tssa` take an empty one, as :func:`group_chunk` gives when the
sequence is shorter than the group). TSSA mixes tokens only through
per-head sums over tokens (ToST Eq. (11): ``sum_n w^2``, ``sum_n Pi w^2``, ``sum_n Pi``; Eq. (28):
the same as prefix sums), so a split sequence needs only these O(B H p) numbers combined:

* non-causal: :func:`all_reduce_sum` of the per-rank sums (the whole-sequence sums on every rank);
* causal: :func:`exclusive_prefix_sum` of the per-rank totals (the sums of the tokens on the
  earlier ranks, the offset of this rank's prefix sums), by an all-gather of the totals.

Both are autograd Functions whose backward is the matching collective (the adjoint): the
gradient of an all-reduce input is the all-reduce of the output gradients (every rank's output
depends on every rank's input); the gradient of an exclusive prefix is the exclusive *suffix*
sum of the output gradients. Each backward is itself written with these Functions, so double
backward works too.

:func:`chunk_layout` exchanges the chunk shapes (checked equal except the token count) and the
token offsets (global positions); :func:`count_communication` records the bytes each collective
of this module hands to torch.distributed (the benchmark ``benchmarks/context_parallel.py``).

A rank whose arguments fail a local check must not leave the others waiting in a collective (until
the backend's timeout, 30 minutes for gloo): every entry point taking a group runs its local checks
inside :class:`local_checks`, which on an error still sends this rank's :func:`chunk_layout` header,
marked failed, and the error's message; the other ranks, in their :func:`chunk_layout`, raise a
``ValueError`` naming the failed rank. The happy path costs nothing more (the mark is a value of
the header's first slot).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, List, NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .._checks import check_instance

__all__ = ["ChunkLayout", "CommRecord", "CommLog", "all_reduce_max", "all_reduce_sum", "broadcast_from_first",
           "check_group", "chunk_layout", "count_communication", "exclusive_prefix_sum", "group_chunk", "local_checks",
           "token_chunk"]


# ------------------------------------------------------------------------------ byte counting
@dataclass
class CommRecord:
    """One collective call: ``op`` ("all_reduce" / "all_gather" / "broadcast"), ``nbytes`` the payload this rank
    handed to it (its input tensor), ``world`` the group size."""

    op: str
    nbytes: int
    world: int


@dataclass
class CommLog:
    """The collectives recorded by :func:`count_communication`."""

    records: List[CommRecord] = field(default_factory=list)

    @property
    def payload_bytes(self) -> int:
        """Bytes this rank handed to the collectives."""
        return sum(r.nbytes for r in self.records)

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank sends under the bandwidth-optimal ring algorithms: an all-reduce of n
        bytes sends ``2 (R - 1) / R * n``, an all-gather of n bytes per rank sends ``(R - 1) n``."""
        total = 0.0
        for r in self.records:
            if r.op == "all_reduce":
                total += 2.0 * (r.world - 1) / r.world * r.nbytes
            elif r.op == "broadcast":  # a ring/pipelined broadcast: each rank forwards it once
                total += r.nbytes
            else:
                total += (r.world - 1) * r.nbytes
        return int(round(total))


_LOGS: List[CommLog] = []


@contextlib.contextmanager
def count_communication() -> Iterator[CommLog]:
    """Record every collective of this module (forward and backward) while the block runs."""
    log = CommLog()
    _LOGS.append(log)
    try:
        yield log
    finally:
        _LOGS.remove(log)


def _record(op: str, t: torch.Tensor, world: int) -> None:
    for log in _LOGS:
        log.records.append(CommRecord(op, t.numel() * t.element_size(), world))


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    t = t.contiguous().clone()
    _record("all_reduce", t, dist.get_world_size(group))
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def _all_gather(t: torch.Tensor, group) -> List[torch.Tensor]:
    t = t.contiguous()
    world = dist.get_world_size(group)
    _record("all_gather", t, world)
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t, group=group)
    return out


# ------------------------------------------------------------------------------ checks
def check_group(group, name: str = "group") -> None:
    """``group`` is a torch.distributed process group of an initialised default group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{name} needs torch.distributed initialised (dist.init_process_group), it is not")
    check_instance(group, name, dist.ProcessGroup, "a torch.distributed ProcessGroup or None")
    if dist.get_rank(group) < 0:
        raise ValueError(f"{name} does not contain this process (global rank {dist.get_rank()})")


class local_checks:
    """``with local_checks(group, like): <this rank's input checks>``: an exception raised in the block
    (the checks must come before the call's first collective) is announced to the other ranks of
    ``group`` before it propagates, so that they raise too instead of waiting in a collective: this
    rank sends the header that :func:`chunk_layout` exchanges, marked failed, then the exception's
    message; the others get a ``ValueError`` from their :func:`chunk_layout` naming this rank and
    its message. ``like``: a tensor argument whose device the header takes (if it is a tensor; the
    current CUDA device under NCCL). ``group`` None: does nothing."""

    __slots__ = ("group", "like")

    def __init__(self, group, like=None):
        self.group, self.like = group, like

    def __enter__(self) -> None:
        if self.group is not None:
            check_group(self.group)  # a group this rank cannot use: nothing can be announced

    def __exit__(self, kind, exc, tb) -> bool:
        if self.group is not None and isinstance(exc, Exception) and not getattr(exc, _KNOWN, False):
            try:
                _announce_failure(exc, self.group, self.like)
            except Exception as failed:  # e.g. a rank gone: this rank's own error is still the one raised
                if exc.args and isinstance(exc.args[0], str):
                    exc.args = (f"{exc.args[0]} (telling the other ranks of the group failed too: {failed})",
                                *exc.args[1:])
        return False


#: set on an exception every rank of the group knows about (raised on every rank, or announced)
_KNOWN = "_whiteformer_group_knows"
#: the first header slot of a rank that failed its local checks (else its tensor's dimension count)
_FAILED = -1
#: the bytes of an announced error message that travel (longer ones are cut)
MESSAGE_BYTES = 512


def _known(exc: Exception) -> Exception:
    setattr(exc, _KNOWN, True)
    return exc


def _header_device(group, like) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return like.device if isinstance(like, torch.Tensor) else torch.device("cpu")


def _announce_failure(exc: Exception, group, like) -> None:
    """This rank's side of :func:`chunk_layout` (a header marked failed, then the messages)."""
    device = _header_device(group, like)
    header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
    header[0] = _FAILED
    _all_gather(header, group)
    _exchange_messages(f"{type(exc).__name__}: {exc}", group, device)
    _known(exc)


def _exchange_messages(text: str, group, device: torch.device) -> List[str]:
    """Every rank's ``text`` (its first :data:`MESSAGE_BYTES` bytes), in group rank order."""
    data = text.encode("utf-8")[:MESSAGE_BYTES]
    buf = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8, device=device)
    buf[:len(data)] = torch.tensor(list(data), dtype=torch.uint8, device=device)
    return [bytes(t.tolist()).rstrip(b"\0").decode("utf-8", errors="ignore") for t in _all_gather(buf, group)]


def _raise_if_failed(gathered: List[List[int]], group, device: torch.device) -> None:
    """After the header exchange: the ranks that announced a failure (:class:`local_checks`)."""
    failed = [r for r, other in enumerate(gathered) if other[0] == _FAILED]
    if not failed:
        return
    messages = _exchange_messages("", group, device)
    which = ("rank " if len(failed) == 1 else "ranks ") + ", ".join(str(r) for r in failed)
    details = "; ".join(f"rank {r}: {messages[r]}" for r in failed)
    raise _known(ValueError(f"{which} of the group failed its input checks ({details}); rank "
                            f"{dist.get_rank(group)} stops too"))


# ------------------------------------------------------------------------------ autograd collectives
class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _AllReduceSum.apply(g, ctx.group), None


class _ExclusiveScan(torch.autograd.Function):
    """``reverse=False``: sum of the inputs of the ranks before this one; ``True``: after it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, reverse: bool) -> torch.Tensor:
        ctx.group, ctx.reverse = group, reverse
        parts = _all_gather(x, group)
        rank = dist.get_rank(group)
        chosen = parts[rank + 1:] if reverse else parts[:rank]
        out = torch.zeros_like(x)
        for part in chosen:
            out = out + part
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _ExclusiveScan.apply(g, ctx.group, not ctx.reverse), None, None


def broadcast_from_first(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` of the group's first rank on every rank (not differentiable; e.g. a dropout mask
    shared by the tokens of all ranks)."""
    t = t.contiguous().clone()
    _record("broadcast", t, dist.get_world_size(group))
    dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
    return t


def all_reduce_max(t: torch.Tensor, group) -> torch.Tensor:
    """Elementwise maximum over the ranks of ``group`` (not differentiable: e.g. the shift of a
    split softmax, which the result does not depend on)."""
    t = t.detach().contiguous().clone()
    _record("all_reduce", t, dist.get_world_size(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``x`` over the ranks of ``group`` (same shape on every rank; None: the default
    group), differentiable."""
    return _AllReduceSum.apply(x, group)


def exclusive_prefix_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``x`` over the ranks of ``group`` before this one (zeros on rank 0), differentiable."""
    return _ExclusiveScan.apply(x, group, False)


# ------------------------------------------------------------------------------ chunk layout
def token_chunk(n: int, index: int, parts: int) -> slice:
    """The ``index``-th of ``parts`` contiguous chunks of ``n`` tokens (the first ``n % parts``
    chunks one token longer): a rank's share of a sequence split evenly."""
    base, extra = divmod(n, parts)
    lo = index * base + min(index, extra)
    return slice(lo, lo + base + (index < extra))


def group_chunk(n: int, group) -> slice:
    """This rank's even share (:func:`token_chunk`) of ``n`` tokens split over ``group``."""
    return token_chunk(n, dist.get_rank(group), dist.get_world_size(group))


class ChunkLayout(NamedTuple):
    """Where a rank's chunk lies in the split sequence (see :func:`chunk_layout`)."""

    start: Union[int, torch.Tensor]
    length: int
    real: Union[int, torch.Tensor]


def chunk_layout(
    x: torch.Tensor, group, attn_mask: Optional[torch.Tensor] = None, name: str = "w", token_dim: int = 2,
    same: Sequence[int] = (), same_name: str = "",
) -> ChunkLayout:
    """Exchange the chunk shapes of ``x`` (tokens along ``token_dim``, e.g. w (B, H, N_r, p)) over
    ``group``: checks that every rank has the same sizes except the token count, and (floating
    ``x``) the same dtype, since the combined sums travel in it.

    Returns ``(start, length, real)``: ``start`` the position of this rank's first token in its
    sequence (an int: the tokens of the earlier ranks; with ``attn_mask`` (B, N_r), a (B,) tensor:
    the *real* tokens of each sequence on the earlier ranks), ``length`` the whole sequence's
    token count (padding included), ``real`` the real tokens per sequence over all ranks ((B,)
    with a mask, else ``length``). A rank may pass ``attn_mask=None`` while others pass a mask
    (its chunk has no padding): it then counts all its tokens as real and gets the (B,) tensors
    too. ``same``: at most :data:`SAME_MAX` integers that must also agree on every rank (e.g. a
    fingerprint of ``same_name``), exchanged with the shapes in a header of one length whatever
    ``same`` and ``x``'s dims (at most :data:`HEADER_DIMS`), so ranks that pass different arguments
    raise instead of crashing in a collective. A rank that failed its local checks sends that header
    marked failed (:class:`local_checks`): every other rank then raises ``ValueError`` here.
    """
    rank = dist.get_rank(group)
    sizes = list(x.shape)
    dtype = _DTYPE_CODES.get(x.dtype, len(_DTYPE_CODES)) if x.is_floating_point() else -1
    fixed = [len(sizes), len(same), *same, *[0] * (SAME_MAX - len(same))]
    header = torch.tensor([*fixed, dtype, attn_mask is not None, *sizes, *[0] * (HEADER_DIMS - len(sizes))],
                          dtype=torch.int64, device=x.device)
    gathered = torch.stack(_all_gather(header, group)).tolist()
    _raise_if_failed(gathered, group, x.device)
    k = len(fixed)
    for r, other in enumerate(gathered):
        if other[:k] != header[:k].tolist():
            raise _known(ValueError(f"{same_name or 'the arguments'} must be the same on every rank of the group "
                                    f"(rank {rank} and rank {r} differ)"))
        if other[k] != dtype:
            theirs = next((str(d) for d, c in _DTYPE_CODES.items() if c == other[k]), "another dtype")
            raise _known(ValueError(f"{name} must have the same dtype on every rank of the group: rank {rank} has "
                                    f"{x.dtype}, rank {r} has {theirs}"))
    masked = any(other[k + 1] for other in gathered)
    shapes = [other[k + 2:k + 2 + len(sizes)] for other in gathered]
    mine = sizes[:token_dim] + sizes[token_dim + 1:]
    for r, other in enumerate(shapes):
        theirs = other[:token_dim] + other[token_dim + 1:]
        if theirs != mine:
            raise _known(ValueError(f"{name} must have the same shape on every rank of the group except the token "
                                    f"count (dim {token_dim}): rank {rank} has {tuple(sizes)}, rank {r} has "
                                    f"{tuple(other)}"))
    length = sum(s[token_dim] for s in shapes)
    if not masked:
        return ChunkLayout(sum(s[token_dim] for s in shapes[:rank]), length, length)
    if attn_mask is None:  # every token of this chunk is real
        real_here = torch.full((sizes[0],), sizes[token_dim], dtype=torch.int64, device=x.device)
    else:
        real_here = attn_mask.sum(dim=-1).to(torch.int64)
    counts = torch.stack(_all_gather(real_here, group))  # (R, B)
    return ChunkLayout(counts[:rank].sum(dim=0), length, counts.sum(dim=0))


#: how many integers :func:`chunk_layout` compares between the ranks (``same``)
SAME_MAX = 4
#: the most dims of the tensor whose shape :func:`chunk_layout` exchanges (w (B, H, N, p))
HEADER_DIMS = 4
#: the header's length, the same for every call (a rank that failed its checks sends one too)
HEADER_LEN = 2 + SAME_MAX + 2 + HEADER_DIMS

#: the floating dtypes :func:`chunk_layout` names in its error (codes exchanged between the ranks)
_DTYPE_CODES = {d: i for i, d in enumerate((torch.float64, torch.float32, torch.float16, torch.bfloat16))}
