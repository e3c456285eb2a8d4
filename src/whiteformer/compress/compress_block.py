"""``compress_attention``: replace one timm-layout MHSA block by a compressed layer (IrrAtt paper).

QK part: TruncAtt (per-head truncated SVD), CP SlimAtt (CPD-EPC) or IrrAtt (BTD-(L, L, 1) with
Algorithm 1 rank selection, or identity fusion); VO part: TruncAtt or kept exact. Ranks are given
directly or chosen from a QK FLOPs budget (Sec. 3.4). With calibration tokens the decompositions are
activation-aware (they minimise the error of the logits ``X~ Y X^T`` / of ``X Y_VO`` on the batch).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from .._checks import check_instance, check_int, is_int
from .._utils import count_params
from . import flops
from .btd import btd_ll1
from .budget import qk_rank_for_budget, rank_for_method
from .cp import cp
from .layers import CompressedAttention, CPSlimAtt, IrrAtt, TruncAtt
from .qk_vo import MHSASpec, mhsa_spec, qk_factors, vo_factors
from .ranks import normalize_ranks
from .spec import CompressSpec
from .truncatt import allocate_ranks_spectral, head_spectra, truncatt
from .whitening import Whitening

__all__ = ["BlockReport", "compress_attention", "check_growth"]

@dataclass
class BlockReport:
    """What :func:`compress_attention` did to one block.

    ``qk_ranks``: per-head ranks (truncatt, irratt with identity fusion), ``(R,)`` for cp, the block
    ranks for irratt with general fusion; ``head_ranks``: per-head ranks before empty blocks were
    dropped (irratt). MACs are for ``num_tokens`` tokens (formulas of :mod:`.flops`). Relative
    errors are ``||Y - Yhat|| / ||Y||`` of the (bias-augmented) QK / VO tensors, or of the logits /
    values on the calibration batch when ``activation_aware``.
    """

    method: str
    fusion: Optional[str]
    qk_ranks: Tuple[int, ...]
    vo_ranks: Tuple[int, ...]
    num_tokens: int
    qk_macs: int
    qk_macs_orig: int
    vo_macs: int
    vo_macs_orig: int
    params: int
    params_orig: int
    qk_rel_error: float
    vo_rel_error: float
    activation_aware: bool
    head_ranks: Optional[Tuple[int, ...]] = None
    details: dict = field(default_factory=dict)

    @property
    def qk_total_rank(self) -> int:
        """Total QK rank: sum of the per-head (truncatt) or block (irratt) ranks, R for cp."""
        return int(self.qk_ranks[0]) if self.method == "cp" else int(sum(self.qk_ranks))

    @property
    def qk_flops_ratio(self) -> float:
        return self.qk_macs / self.qk_macs_orig

    @property
    def flops_ratio(self) -> float:
        """MHSA-block FLOPs CR (Table 1's "MHSA FLOPs CR")."""
        return (self.qk_macs + self.vo_macs) / (self.qk_macs_orig + self.vo_macs_orig)

    def to_dict(self) -> dict:
        """The fields and the derived ratios / total rank, as plain values (JSON-ready)."""
        d = asdict(self)
        d["qk_flops_ratio"], d["flops_ratio"] = self.qk_flops_ratio, self.flops_ratio
        d["qk_total_rank"] = self.qk_total_rank
        return d


def _set_qk(layer, A, B, scale: float, has_bias: bool) -> None:
    """q <- [A_g[:F]] * scale (+ bias A_g[F] * scale), k <- [B_g] for the groups of a low-rank layer."""
    F = layer.dim
    a = torch.cat(list(A), dim=1)
    b = torch.cat(list(B), dim=1)
    with torch.no_grad():
        layer.q.weight.copy_((a[:F] * scale).T)
        if has_bias:
            layer.q.bias.copy_(a[F] * scale)
        layer.k.weight.copy_(b.T)


def _set_vo(layer: CompressedAttention, A, B, out_bias) -> None:
    with torch.no_grad():
        layer.v.weight.copy_(torch.cat(list(A), dim=1).T)
        layer.proj.weight.copy_(torch.cat(list(B), dim=1))
        if layer.proj.bias is not None:
            layer.proj.bias.copy_(out_bias)


def check_growth(macs: int, num_tokens: int, dim: int, num_heads: int, head_dim: int, allow_growth: bool,
                 what: str) -> None:
    """Refuse (``ValueError``) a compressed attention whose MACs (QK + VO) exceed the original
    MHSA's at ``num_tokens`` tokens, unless ``allow_growth``."""
    orig = flops.mhsa_macs(num_tokens, dim, num_heads, head_dim)
    if macs > orig and not allow_growth:
        raise ValueError(f"{what} would cost {macs / orig:.2f}x the attention MACs of the original MHSA ({macs} > "
                         f"{orig} at N = {num_tokens} tokens): a compression that grows the model is refused; "
                         "lower the rank, or pass allow_growth=True (whiteformer compress --allow-growth)")


def compress_attention(attn: nn.Module, *, qk: Optional[str] = "truncatt",
                       qk_rank: Union[int, Sequence[int], None] = None, qk_flops_ratio: Optional[float] = None,
                       vo_rank: Union[int, Sequence[int], None] = None, num_tokens: int = 197,
                       calib: Optional[torch.Tensor] = None, fusion: str = "general",
                       rank_allocation: str = "btd", protocol: str = "flops", seed: int = 0,
                       cp_kwargs: Optional[dict] = None, btd_kwargs: Optional[dict] = None,
                       allow_growth: bool = False) -> Tuple[CompressedAttention, BlockReport]:
    """Compress one timm-layout MHSA module (``qkv`` Linear(F, 3F), ``proj`` Linear(F, F), ``num_heads``).

    Args:
        attn: the MHSA module (not modified).
        qk: "truncatt", "cp", "irratt", or None/"none" (QK kept exact).
        qk_rank: with ``protocol="flops"``: truncatt: per-head rank (int or H ints, <= F/H); cp: R
            (<= H p = F: R = H p already represents the QK map exactly); irratt: the total rank (int,
            split over heads by ``rank_allocation``) or explicit per-head ranks (H ints, each <= F/H).
            With ``protocol="rank"``: the total QK rank (int) for every method (truncatt: total / H
            per head; cp: R = total; irratt: sum of L_h).
        qk_flops_ratio: instead of ``qk_rank``. ``protocol="flops"`` (ours): each method gets its
            largest rank with QK MACs <= ratio x original (Sec. 3.4) for ``num_tokens`` tokens.
            ``protocol="rank"`` (the paper's Table 1): TruncAtt's rank r at that ratio fixes the
            total rank H r, and CP / IrrAtt get that same total (IrrAtt with general fusion then
            pays the N^2 H B fusion MACs on top, CP its N H R head expansion).
        vo_rank: VO TruncAtt rank (int or H ints, <= F/H); None keeps VO exact.
        num_tokens: N for the budget and the report.
        calib: optional calibration tokens (..., F), the *inputs of this block* (after norm1), for
            the activation-aware decompositions.
        fusion: irratt head fusion, "general" (C from BTD refinement, Algorithm 3) or "identity".
        rank_allocation: irratt per-head ranks from "btd" (CPD-EPC + Algorithm 1, the paper) or
            "spectral" (keep the globally largest singular values of the heads). Either way a
            head's rank is capped at the head dim p (its QK slice has rank <= p); terms that
            Algorithm 1 gives a head beyond p are re-spent on the heads with the next-largest gains
            (next singular values), so the total rank is kept.
        protocol: "flops" (default) or "rank": how ``qk_flops_ratio`` / an int ``qk_rank`` compare
            the methods (see ``qk_rank``).
        seed, cp_kwargs, btd_kwargs: controls of :func:`cp` / :func:`btd_ll1`.
        allow_growth: accept a result whose attention MACs (QK + VO at ``num_tokens``) exceed the
            original's (CP's head expansion and IrrAtt's general fusion cost extra MACs); by default
            such a compression raises ``ValueError`` (for CP before its decomposition runs).
    Returns:
        (new_module, :class:`BlockReport`). The new module is on the device/dtype of ``attn``; at full
        rank (qk_rank = vo_rank = F/H with truncatt) it reproduces ``attn``'s outputs.
    Raises:
        TypeError for a non-MHSA module, ValueError for bad ranks/options.
    """
    mhsa = mhsa_spec(attn)
    if getattr(attn, "causal", False):
        raise ValueError("causal attention blocks are not supported by compress_attention")
    opts = CompressSpec(qk=qk, qk_rank=qk_rank, qk_flops_ratio=qk_flops_ratio, vo_rank=vo_rank, fusion=fusion,
                        rank_allocation=rank_allocation, protocol=protocol, num_tokens=num_tokens, seed=seed,
                        cp_kwargs=cp_kwargs, btd_kwargs=btd_kwargs, allow_growth=allow_growth, progress=False)
    check_instance(calib, "calib", torch.Tensor, "a tensor of tokens (..., F)", optional=True, error=ValueError)
    return _compress_attention(attn, mhsa, opts, opts.num_tokens, calib)


def _compress_attention(attn: nn.Module, spec: MHSASpec, opts: CompressSpec, num_tokens: int,
                        calib: Optional[torch.Tensor]) -> Tuple[CompressedAttention, BlockReport]:
    """:func:`compress_attention` on checked options (``opts``; ``spec`` the MHSA's, ``num_tokens``
    N, ``calib`` a tensor or None): the per-block step of :func:`whiteformer.compress.compress`.
    The ranks are checked here, against this block's heads, and the calibration tokens' feature size
    by :meth:`Whitening.from_calibration`."""
    qk, qk_rank, qk_flops_ratio, vo_rank = opts.qk, opts.qk_rank, opts.qk_flops_ratio, opts.vo_rank
    fusion, protocol, seed, allow_growth = opts.fusion, opts.protocol, opts.seed, opts.allow_growth
    rank_allocation, cp_kwargs, btd_kwargs = opts.rank_allocation, opts.cp_kwargs, opts.btd_kwargs
    F, H, p = spec.dim, spec.num_heads, spec.head_dim
    if qk_flops_ratio is not None:
        qk_rank = qk_rank_for_budget(qk, qk_flops_ratio, num_tokens=num_tokens, dim=F, num_heads=H,
                                     fusion=fusion, protocol=protocol)
    elif protocol == "rank" and qk is not None:
        qk_rank = rank_for_method(qk, qk_rank, H)

    ref = attn.qkv.weight
    Yqk = qk_factors(attn)
    Yqk = type(Yqk)(Yqk.P.double(), Yqk.K.double())
    has_bias = spec.qkv_bias
    wq = None
    if calib is not None:
        wq = Whitening.from_calibration(calib.detach().to(torch.float64), Yqk.shape)
    kw = dict(attn_drop=spec.attn_drop, proj_drop=spec.proj_drop, qk_bias=has_bias,
              proj_bias=spec.proj_bias or spec.qkv_bias)
    vo_ranks = normalize_ranks(p if vo_rank is None else vo_rank, H, p, "vo_rank")
    details: dict = {}
    head_ranks = None

    # ---- QK
    if qk is None or qk == "truncatt":
        ranks = normalize_ranks(p if qk is None else qk_rank, H, p, "qk_rank", allow_zero=False)
        layer = TruncAtt(F, H, qk_ranks=ranks, vo_ranks=vo_ranks, **kw)
        if qk is None:
            A, B, qk_err = list(Yqk.P.unbind(0)), list(Yqk.K.unbind(0)), 0.0
        else:
            res = truncatt(Yqk, ranks, calib=wq)
            A, B, qk_err = res.A, res.B, res.rel_error
        _set_qk(layer, A, B, spec.scale, has_bias)
        qk_ranks = ranks
        method = "none" if qk is None else "truncatt"
    elif qk == "cp":
        if not is_int(qk_rank) or not 1 <= qk_rank <= H * p:
            raise ValueError(f"qk_rank out of range: qk='cp' needs an int rank R in [1, H * p = {H * p}] (R = H p "
                             f"already represents the QK map exactly), got {qk_rank!r}")
        vo_macs = (flops.mhsa_vo_macs(num_tokens, F, H, p) if vo_rank is None
                   else flops.vo_truncatt_macs(num_tokens, F, list(vo_ranks)))
        check_growth(flops.cp_qk_macs(num_tokens, F, H, qk_rank) + vo_macs, num_tokens, F, H, p, allow_growth,
                     f"CP rank R = {qk_rank}")
        res = cp(Yqk, qk_rank, seed=seed, calib=wq, **(cp_kwargs or {}))
        layer = CPSlimAtt(F, H, rank=qk_rank, vo_ranks=vo_ranks, **kw)
        _set_qk(layer, [res.A], [res.B], spec.scale, has_bias)
        with torch.no_grad():
            layer.fusion.copy_(res.C)
        qk_err, qk_ranks, method = res.rel_error, (qk_rank,), "cp"
        details.update(cp_als_rel_error=res.als_rel_error, cp_sensitivity=res.sensitivity,
                       cp_als_sensitivity=res.als_sensitivity, cp_n_iter=res.n_iter)
    else:  # irratt
        method = "irratt"
        if isinstance(qk_rank, tuple):
            head_ranks = normalize_ranks(qk_rank, H, p, "qk_rank")
            total = sum(head_ranks)
        else:
            total = check_int(qk_rank, "qk_rank", 1)  # a total rank (H per-head ranks: the branch above)
            if total > H * p:
                raise ValueError(f"qk_rank out of range: total rank {total} exceeds H * p = {H * p}")
        cp_res = None
        if head_ranks is None and rank_allocation == "spectral":
            head_ranks = allocate_ranks_spectral(head_spectra(Yqk, calib=wq), total, max_rank=p)
        if fusion == "identity":
            if head_ranks is None:  # paper Algorithm 1: ranks from the CP fusion matrix
                cp_res = cp(Yqk, total, seed=seed, calib=wq, **(cp_kwargs or {}))
                head_ranks = tuple(int(c) for c in torch.bincount(cp_res.C.abs().argmax(0), minlength=H))
                # a head's slice has rank <= p: cap, and re-spend the rest on the next-largest gains
                capped = tuple(min(r, p) for r in head_ranks)
                if capped != head_ranks:
                    head_ranks = allocate_ranks_spectral(head_spectra(Yqk, calib=wq), total, max_rank=p,
                                                         start=capped)
            res = truncatt(Yqk, head_ranks, calib=wq)
            layer = IrrAtt(F, H, ranks=head_ranks, fusion="identity", vo_ranks=vo_ranks, **kw)
            _set_qk(layer, res.A, res.B, spec.scale, has_bias)
            qk_err, qk_ranks = res.rel_error, head_ranks
        else:
            bkw = dict(btd_kwargs or {})
            if head_ranks is None:
                res = btd_ll1(Yqk, total, seed=seed, calib=wq, cp_kwargs=cp_kwargs, max_rank=p, **bkw)
                cp_res = res.cp_result
            else:
                res = btd_ll1(Yqk, ranks=head_ranks, calib=wq, **bkw)
            head_ranks = res.ranks
            keep = [b for b, r in enumerate(res.ranks) if r > 0]
            qk_ranks = tuple(res.ranks[b] for b in keep)
            layer = IrrAtt(F, H, ranks=list(qk_ranks), fusion="general", vo_ranks=vo_ranks, **kw)
            _set_qk(layer, [res.A[b] for b in keep], [res.B[b] for b in keep], spec.scale, has_bias)
            with torch.no_grad():
                layer.fusion.copy_(res.C[:, keep])
            qk_err = res.rel_error
            details.update(btd_init_rel_error=res.init_rel_error, btd_history=list(res.history))
        if cp_res is not None:
            details.update(cp_rel_error=cp_res.rel_error, cp_als_rel_error=cp_res.als_rel_error,
                           cp_head_ranks=[int(c) for c in torch.bincount(cp_res.C.abs().argmax(0), minlength=H)])

    # ---- VO
    Yvo, out_bias = vo_factors(attn)
    Yvo = type(Yvo)(Yvo.P.double(), Yvo.K.double())
    if vo_rank is None:
        _set_vo(layer, Yvo.P.unbind(0), Yvo.K.unbind(0), out_bias)
        vo_err = 0.0
    else:
        wv = None
        if calib is not None:
            wv = Whitening.from_calibration(calib.detach().to(torch.float64), Yvo.shape, key=False)
        res_vo = truncatt(Yvo, vo_ranks, calib=wv)
        _set_vo(layer, res_vo.A, res_vo.B, out_bias)
        vo_err = res_vo.rel_error

    N = num_tokens
    check_growth(layer.qk_macs(N) + layer.vo_macs(N), N, F, H, p, allow_growth,
                 f"qk={method} with QK ranks {tuple(qk_ranks)}")
    layer = layer.to(device=ref.device, dtype=ref.dtype)
    layer.train(attn.training)
    report = BlockReport(
        method=method, fusion=(fusion if method == "irratt" else None), qk_ranks=tuple(qk_ranks),
        vo_ranks=tuple(vo_ranks), num_tokens=N,
        qk_macs=layer.qk_macs(N), qk_macs_orig=flops.mhsa_qk_macs(N, F, H, p),
        vo_macs=layer.vo_macs(N), vo_macs_orig=flops.mhsa_vo_macs(N, F, H, p),
        params=count_params(layer), params_orig=count_params(attn), qk_rel_error=float(qk_err),
        vo_rel_error=float(vo_err), activation_aware=calib is not None,
        head_ranks=None if head_ranks is None else tuple(head_ranks), details=details)
    return layer, report
