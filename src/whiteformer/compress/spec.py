"""``CompressSpec``: the options of :func:`whiteformer.compress.compress`, checked once.

A frozen dataclass built from ``compress()``'s keyword arguments (or passed as ``spec=``). Its
``__post_init__`` is the one check of the options that do not depend on the model (a rank's range
against a block's heads is checked per block, block indices against the model's depth); the
per-block step trusts it. ``to_dict()`` is plain JSON, recorded in the compressed model's
``init_kwargs["compression"]["options"]`` (one entry per ``compress()`` call), and
``CompressSpec(**d)`` rebuilds the same spec from it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional, Tuple, Union

from .._checks import check_choice, check_int, is_int
from .budget import check_flops_ratio

__all__ = ["CompressSpec", "check_attention_options"]

Ranks = Union[int, Tuple[int, ...], None]

_QK_METHODS = (None, "none", "truncatt", "cp", "irratt")
_VO = (None, "none", "truncatt")


def _ranks_arg(rank, name: str):
    if rank is None or is_int(rank):
        return rank
    if isinstance(rank, (list, tuple)):
        return tuple(rank)
    raise TypeError(f"{name} must be an int, a sequence of ints or None, got {type(rank).__name__}")


def check_attention_options(qk, qk_rank, qk_flops_ratio, fusion: str, rank_allocation: str, protocol: str):
    """The options of :func:`~.compress_block.compress_attention` that do not depend on the block
    (also those of :func:`whiteformer.compress.compress`, checked once for all blocks); returns
    ``(qk, qk_rank)`` with ``qk`` None for "none" and a rank sequence as a tuple."""
    check_choice(qk, "qk", _QK_METHODS)
    check_choice(fusion, "fusion", ("general", "identity"))
    check_choice(rank_allocation, "rank_allocation", ("btd", "spectral"))
    check_choice(protocol, "protocol", ("flops", "rank"))
    qk, qk_rank = None if qk == "none" else qk, _ranks_arg(qk_rank, "qk_rank")
    if qk is None and (qk_rank is not None or qk_flops_ratio is not None):
        raise ValueError("qk_rank / qk_flops_ratio given but qk=None (QK kept exact)")
    if qk is not None and (qk_rank is None) == (qk_flops_ratio is None):
        raise ValueError(f"qk={qk!r} needs exactly one of qk_rank and qk_flops_ratio")
    if qk_flops_ratio is not None:  # before any block is calibrated or counted
        check_flops_ratio(qk_flops_ratio)
    return qk, qk_rank


def _kwargs(value, name: str, what: str) -> Optional[dict]:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict of {what} options or None, got {type(value).__name__}")
    return dict(value)


@dataclass(frozen=True)
class CompressSpec:
    """What :func:`~whiteformer.compress.compress` does (see its docstring for each option).

    Normalised on construction: ``qk="none"`` becomes None, a rank list a tuple, ``blocks`` a tuple
    of indices (an int: one block), ``cp_kwargs`` / ``btd_kwargs`` plain dicts.
    """

    qk: Optional[str] = "irratt"
    qk_rank: Ranks = None
    qk_flops_ratio: Optional[float] = None
    vo: Optional[str] = "truncatt"
    vo_rank: Ranks = None
    mlp_rank: Ranks = None
    fusion: str = "general"
    rank_allocation: str = "btd"
    protocol: str = "flops"
    blocks: Optional[Tuple[int, ...]] = None
    num_tokens: Optional[int] = None
    seed: int = 0
    cp_kwargs: Optional[dict] = None
    btd_kwargs: Optional[dict] = None
    latency_batch: Optional[int] = None
    latency_runs: int = 10
    latency_warmup: int = 2
    latency_threads: Optional[int] = None
    allow_growth: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        def put(name, value):
            object.__setattr__(self, name, value)

        qk, qk_rank = check_attention_options(self.qk, self.qk_rank, self.qk_flops_ratio, self.fusion,
                                              self.rank_allocation, self.protocol)
        put("qk", qk)
        put("qk_rank", qk_rank)
        if self.qk_flops_ratio is not None:
            put("qk_flops_ratio", float(self.qk_flops_ratio))
        check_choice(self.vo, "vo", _VO)
        if self.vo in (None, "none") and self.vo_rank is not None:
            raise ValueError("vo_rank given but vo=None (VO kept exact); pass vo='truncatt'")
        put("vo_rank", _ranks_arg(self.vo_rank, "vo_rank"))
        if isinstance(self.mlp_rank, list):  # compress_mlp checks its form against each MLP
            put("mlp_rank", tuple(self.mlp_rank))
        if is_int(self.blocks):
            put("blocks", (int(self.blocks),))
        elif isinstance(self.blocks, (list, tuple)):  # their range is checked against the model's depth
            if not self.blocks:
                raise ValueError("blocks must not be empty")
            put("blocks", tuple(self.blocks))
        elif self.blocks is not None:
            raise ValueError(f"blocks must be a block index or a sequence of block indices, got {self.blocks!r}")
        if self.num_tokens is not None:
            put("num_tokens", check_int(self.num_tokens, "num_tokens", 1))
        put("seed", check_int(self.seed, "seed", 0))
        put("cp_kwargs", _kwargs(self.cp_kwargs, "cp_kwargs", "cp()"))
        put("btd_kwargs", _kwargs(self.btd_kwargs, "btd_kwargs", "btd_ll1()"))
        if self.latency_batch is not None:  # named as the caller wrote them, not as compare_latency's
            check_int(self.latency_batch, "latency_batch", 1)
            check_int(self.latency_runs, "latency_runs", 1)
            check_int(self.latency_warmup, "latency_warmup", 0)
            if self.latency_threads is not None:
                check_int(self.latency_threads, "latency_threads", 1)
        put("allow_growth", bool(self.allow_growth))
        put("progress", bool(self.progress))

    @property
    def compresses_attention(self) -> bool:
        """Whether the attention is replaced (QK compressed or VO truncated)."""
        return self.qk is not None or self.vo_rank is not None

    def to_dict(self) -> dict:
        """The options as plain JSON values (tuples as lists); ``CompressSpec(**d)`` rebuilds the spec."""
        def plain(v):
            if isinstance(v, tuple):
                return [plain(x) for x in v]
            if isinstance(v, dict):
                return {k: plain(x) for k, x in v.items()}
            return v

        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def option_names(cls) -> Tuple[str, ...]:
        """The option names (``compress()``'s keyword arguments besides ``model`` and ``calib``)."""
        return tuple(f.name for f in dataclasses.fields(cls))
