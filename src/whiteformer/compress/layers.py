"""Compressed multi-head self-attention layers (IrrAtt paper): TruncAtt, CP SlimAtt, IrrAtt.

Registered like every other layer (``build("truncatt", dim, num_heads=H, qk_ranks=...)``); the
decompositions that fill them from a pretrained MHSA live in :mod:`whiteformer.compress`.

All attention layers share the timm contract ``forward(x, attn_mask=None)``, (B, N, F) -> (B, N, F),
with a (B, N) bool keep-mask (padded keys are excluded; outputs at padded positions are 0), and the
same value-output part (VO TruncAtt, per-head ranks r_h^V; full rank = the original MHSA):

    v = x W_v (B, N, sum r^V),  out_h = A_h v_h,  y = proj(concat_h out_h)

with ``W_v`` = ``v.weight.T`` holding the per-head factors of ``Y_VO[:, :, h] = W_h^V (W_h^O)^T`` and
``proj`` (sum r^V -> F) the other factor plus the folded output bias. The attention maps differ:

* :class:`TruncAtt`: per-head ranks r_h, ``A_h = softmax(q_h k_h^T)`` with ``q = x S^Q + b``,
  ``k = x S^K`` (Sec. 2.3; the softmax scale is folded into ``S^Q``, ``b`` is the exact
  key-dependent query-bias term).
* :class:`CPSlimAtt`: shared ``S^Q, S^K`` (F x R) and head fusion ``S^H`` (H x R):
  ``A_h = softmax(X S^Q diag(S^H(h, :)) S^K^T X^T)`` (Sec. 2.4, Eq. 4).
* :class:`IrrAtt`: blocks with irregular ranks L_b, ``A_h = softmax(sum_b C[h, b] q_b k_b^T)``
  (Sec. 3.1, Eq. 6; BTD-(L, L, 1)); with ``fusion="identity"`` it is TruncAtt with irregular ranks.

``fused_attn = True`` (default) runs ``F.scaled_dot_product_attention`` (irregular ranks are
zero-padded to the largest rank); ``fused_attn = False`` runs explicit matmuls whose MACs are exactly
the formulas of :mod:`whiteformer.compress.flops`, visible to ``torch.utils.flop_counter``
(IrrAtt with general fusion always runs the explicit path). Under float16/bfloat16 (or autocast)
logits and softmax are computed in float32; outputs are in the input dtype.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from .._checks import (
    check_choice,
    check_divisible,
    check_mask,
    check_probability,
    check_tokens_input,
    is_int,
)
from .._dtypes import autocast_off, stats_dtype
from .._utils import zero_padded
from ..attention.registry import register_attention
from . import flops as _flops
from .ranks import normalize_ranks

__all__ = ["CompressedAttention", "TruncAtt", "CPSlimAtt", "IrrAtt"]

Ranks = Union[int, Sequence[int], None]


class _RankLayout(nn.Module):
    """Bookkeeping for per-head (or per-block) ranks laid out contiguously along the last dim."""

    def __init__(self, ranks: Tuple[int, ...]):
        super().__init__()
        self.ranks = tuple(int(r) for r in ranks)
        self.total = sum(self.ranks)
        self.rmax = max(self.ranks)
        self.equal = len(set(self.ranks)) == 1
        offsets = [0]
        for r in self.ranks:
            offsets.append(offsets[-1] + r)
        self.offsets = tuple(offsets)
        # gather index into cat([t, 0]) giving (n_groups, rmax) zero-padded groups
        pad = torch.full((len(self.ranks), self.rmax), self.total, dtype=torch.long)
        unpad = []
        for g, r in enumerate(self.ranks):
            pad[g, :r] = torch.arange(offsets[g], offsets[g] + r)
            unpad.extend(range(g * self.rmax, g * self.rmax + r))
        self.register_buffer("pad_index", pad.flatten(), persistent=False)
        self.register_buffer("unpad_index", torch.tensor(unpad, dtype=torch.long), persistent=False)

    def split(self, t: torch.Tensor) -> List[torch.Tensor]:
        """(..., total) -> list of (..., r_g)."""
        return [t[..., self.offsets[g]:self.offsets[g + 1]] for g in range(len(self.ranks))]

    def heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, N, total) -> (B, G, N, rmax), zero-padded when ranks differ."""
        if self.equal:
            return rearrange(t, "b n (g r) -> b g n r", g=len(self.ranks))
        t = torch.cat([t, t.new_zeros(*t.shape[:-1], 1)], dim=-1)[..., self.pad_index]
        return rearrange(t, "b n (g r) -> b g n r", g=len(self.ranks))

    def merge(self, t: torch.Tensor) -> torch.Tensor:
        """(B, G, N, rmax) -> (B, N, total), dropping the padding."""
        t = rearrange(t, "b g n r -> b n (g r)")
        return t if self.equal else t[..., self.unpad_index]


class CompressedAttention(nn.Module):
    """Base class: the VO TruncAtt part, masking, precision and the two execution paths.

    Subclasses implement ``_project(x)`` (the query/key projections), ``_logits(proj)`` (explicit
    logits (B, H, N, N)) and, when SDPA applies, ``_sdpa_qk(proj)`` -> q, k (B, H, N, E).
    """

    shell_options = ("attn_drop", "proj_drop")  # the query/key maps are the subclass's

    def __init__(self, dim: int, num_heads: int, vo_ranks: Ranks = None, proj_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        self.head_dim = check_divisible(dim, num_heads)
        self.dim, self.num_heads = dim, num_heads
        vo = normalize_ranks(self.head_dim if vo_ranks is None else vo_ranks, num_heads, dim, "vo_ranks")
        self.vo_layout = _RankLayout(vo)
        self.v = nn.Linear(dim, self.vo_layout.total, bias=False)
        self.proj = nn.Linear(self.vo_layout.total, dim, bias=proj_bias)
        self.attn_drop = nn.Dropout(check_probability(attn_drop, "attn_drop"))
        self.proj_drop = nn.Dropout(check_probability(proj_drop, "proj_drop"))
        self.fused_attn = True

    @property
    def vo_ranks(self) -> Tuple[int, ...]:
        return self.vo_layout.ranks

    # -- hooks -------------------------------------------------------------------------------
    def _project(self, x):
        raise NotImplementedError

    def _logits(self, proj, sd: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def _sdpa_qk(self, proj, sd: torch.dtype):
        return None

    def qk_tensor(self) -> torch.Tensor:
        """Dense (F+1, F, H) query-key tensor of the layer, softmax scale included; row F is the
        query bias (zeros without bias): logits_h = [x, 1] Y[:, :, h] x^T."""
        raise NotImplementedError

    def qk_macs(self, num_tokens: int) -> int:
        raise NotImplementedError

    # -- shared ------------------------------------------------------------------------------
    def vo_tensor(self) -> torch.Tensor:
        """Dense (F, F, H) value-output tensor ``W_v,h W_o,h^T`` of the layer."""
        wv = self.vo_layout.split(self.v.weight.T)  # (F, r_h)
        wo = self.vo_layout.split(self.proj.weight)  # (F, r_h)
        return torch.stack([a @ b.T for a, b in zip(wv, wo)], dim=-1)

    def vo_macs(self, num_tokens: int) -> int:
        return _flops.vo_truncatt_macs(num_tokens, self.dim, list(self.vo_ranks))

    def macs(self, num_tokens: int) -> int:
        """MACs of the explicit path for N tokens (QK + VO)."""
        return self.qk_macs(num_tokens) + self.vo_macs(num_tokens)

    def _apply_values(self, attn: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """attn (B, H, N, N), v (B, N, sum r^V) -> (B, N, sum r^V) by per-head matmuls."""
        lay = self.vo_layout
        if lay.equal:
            return lay.merge(attn @ lay.heads(v))
        outs = [attn[:, h] @ vh for h, vh in enumerate(lay.split(v))]
        return torch.cat(outs, dim=-1)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (B, N, F), attn_mask (B, N) bool keep-mask (True = real token; padded keys are
        excluded) -> y (B, N, F), 0 at padded tokens; the subclass's attention maps A_h
        (see the module docstring) applied to the low-rank values."""
        check_tokens_input(x, "x", self.dim, like=self.v.weight)
        B, N, _ = x.shape
        keep = check_mask(attn_mask, B, N, device=x.device)
        x = zero_padded(x, keep)  # padded tokens take no part (NaN/inf there reach nothing)
        sd = stats_dtype(x)
        proj = self._project(x)
        v = self.v(x)
        allowed = None
        if keep is not None:  # padded keys excluded; rows of padded queries opened (zeroed below)
            allowed = keep[:, None, None, :] | ~keep[:, None, :, None]
        with autocast_off(x):
            qk = None if not self.fused_attn else self._sdpa_qk(proj, sd)
            if qk is None:
                logits = self._logits(proj, sd)
                if allowed is not None:
                    logits = logits.masked_fill(~allowed, float("-inf"))
                attn = self.attn_drop(logits.softmax(dim=-1))
                o = self._apply_values(attn, v.to(sd))
            else:
                q, k = qk
                drop = self.attn_drop.p if self.training else 0.0
                o = F.scaled_dot_product_attention(q, k, self.vo_layout.heads(v.to(sd)), attn_mask=allowed,
                                                   dropout_p=drop, scale=1.0)
                o = self.vo_layout.merge(o)
        y = self.proj_drop(self.proj(o.to(x.dtype)))
        return zero_padded(y, keep).to(x.dtype)


class _LowRankQK(CompressedAttention):
    """Query/key maps made of groups (heads or BTD blocks) of low-rank factors:
    ``q = x S^Q + b`` and ``k = x S^K`` (F -> sum of the group ranks), group g using its own slice."""

    def __init__(self, dim: int, num_heads: int, group_ranks, n_groups: int, vo_ranks: Ranks, qk_bias: bool,
                 proj_bias: bool, attn_drop: float, proj_drop: float, name: str, allow_zero: bool = True):
        super().__init__(dim, num_heads, vo_ranks, proj_bias, attn_drop, proj_drop)
        qk = normalize_ranks(self.head_dim if group_ranks is None else group_ranks, n_groups, dim, name,
                             allow_zero=allow_zero)
        self.qk_layout = _RankLayout(qk)
        self.q = nn.Linear(dim, self.qk_layout.total, bias=qk_bias)
        self.k = nn.Linear(dim, self.qk_layout.total, bias=False)
        with torch.no_grad():  # fold a softmax-like scale into a fresh layer
            self.q.weight.mul_(self.qk_layout.rmax ** -0.5)

    def _project(self, x):
        return self.q(x), self.k(x)

    def _group_logits(self, proj, sd) -> torch.Tensor:
        """(B, G, N, N): ``q_g k_g^T`` per group (sum_g N^2 r_g MACs)."""
        q, k = proj[0].to(sd), proj[1].to(sd)
        lay = self.qk_layout
        if lay.equal:
            return lay.heads(q) @ lay.heads(k).transpose(-2, -1)
        return torch.stack([a @ b.transpose(-2, -1) for a, b in zip(lay.split(q), lay.split(k))], dim=1)

    def _group_tensor(self) -> torch.Tensor:
        """(F+1, F, G): the dense ``[S^Q; b] S^K^T`` of each group."""
        wq = self.q.weight.T
        bias = self.q.bias[None] if self.q.bias is not None else wq.new_zeros(1, wq.shape[1])
        wq = torch.cat([wq, bias], dim=0)
        qs, ks = self.qk_layout.split(wq), self.qk_layout.split(self.k.weight.T)
        return torch.stack([a @ b.T for a, b in zip(qs, ks)], dim=-1)


@register_attention("truncatt")
class TruncAtt(_LowRankQK):
    """TruncAtt (IrrAtt paper, Sec. 2.3): per-head low-rank query-key maps.

    ``logits_h = (x S^Q_h + b_h)(x S^K_h)^T`` with S^Q_h, S^K_h of shape (F, r_h); the softmax scale is
    folded into ``q`` and ``b`` carries the exact key-dependent query-bias term.

    Args:
        dim: F; num_heads: H.
        qk_ranks: r_h, an int or H ints (0 allowed for a head: uniform attention); default F / H.
        vo_ranks: VO ranks r_h^V (default F / H = uncompressed VO).
        qk_bias: query bias; proj_bias: output bias; attn_drop, proj_drop: dropouts.
    Parameters: ``q`` Linear(F, sum r), ``k`` Linear(F, sum r, bias=False), ``v`` Linear(F, sum r^V,
    bias=False), ``proj`` Linear(sum r^V, F). QK MACs ``sum_h N r_h (2F + N)``.
    Shapes: x (B, N, F) -> (B, N, F).
    """

    def __init__(self, dim: int, num_heads: int = 8, qk_ranks: Ranks = None, vo_ranks: Ranks = None,
                 qk_bias: bool = True, proj_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__(dim, num_heads, qk_ranks, num_heads, vo_ranks, qk_bias, proj_bias, attn_drop, proj_drop,
                         "qk_ranks")

    @property
    def qk_ranks(self) -> Tuple[int, ...]:
        return self.qk_layout.ranks

    def _logits(self, proj, sd):
        return self._group_logits(proj, sd)

    def _sdpa_qk(self, proj, sd):
        return self.qk_layout.heads(proj[0].to(sd)), self.qk_layout.heads(proj[1].to(sd))

    def qk_tensor(self) -> torch.Tensor:
        return self._group_tensor()

    def qk_macs(self, num_tokens: int) -> int:
        return _flops.truncatt_qk_macs(num_tokens, self.dim, list(self.qk_ranks))


@register_attention("irratt")
class IrrAtt(_LowRankQK):
    """IrrAtt (IrrAtt paper, Sec. 3.1-3.2): BTD-(L, L, 1) query-key maps with irregular block ranks.

    ``logits_h = sum_b C[h, b] (x S^Q_b + b_b)(x S^K_b)^T`` (Eq. 6), S^Q_b, S^K_b of shape (F, L_b).
    ``fusion="general"``: learnable head fusion ``fusion`` C (H x n_blocks, initialised to I), QK MACs
    ``2NF sum L + N^2 sum L + N^2 H B`` (block ranks must be >= 1); ``fusion="identity"``: C = I with
    one block per head (a rank may be 0), i.e. TruncAtt with irregular ranks, QK MACs
    ``2NF sum L + N^2 sum L``.

    Args:
        dim: F; num_heads: H.
        ranks: block ranks L_b: an int (H equal blocks) or a sequence (exactly H with identity fusion);
            default F / H per head.
        fusion: "general" or "identity"; vo_ranks, qk_bias, proj_bias, attn_drop, proj_drop: as TruncAtt.
    Shapes: x (B, N, F) -> (B, N, F).
    """

    def __init__(self, dim: int, num_heads: int = 8, ranks: Ranks = None, fusion: str = "general",
                 vo_ranks: Ranks = None, qk_bias: bool = True, proj_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0):
        check_choice(fusion, "fusion", ("general", "identity"))
        n_blocks = num_heads
        if fusion == "general" and isinstance(ranks, (list, tuple)):
            n_blocks = len(ranks)  # none: "ranks must not all be zero" (normalize_ranks)
        super().__init__(dim, num_heads, ranks, n_blocks, vo_ranks, qk_bias, proj_bias, attn_drop, proj_drop,
                         "ranks", allow_zero=(fusion == "identity"))
        if fusion == "general":
            self.fusion = nn.Parameter(torch.eye(num_heads, n_blocks))
        else:
            self.register_parameter("fusion", None)

    @property
    def block_ranks(self) -> Tuple[int, ...]:
        return self.qk_layout.ranks

    def _logits(self, proj, sd):
        g = self._group_logits(proj, sd)
        if self.fusion is None:
            return g
        B, nb, N, _ = g.shape
        fused = self.fusion.to(sd) @ g.reshape(B, nb, N * N)  # (H, nb) @ (B, nb, N^2): N^2 H B MACs
        return fused.reshape(B, self.num_heads, N, N)

    def _sdpa_qk(self, proj, sd):
        if self.fusion is not None:
            return None
        return self.qk_layout.heads(proj[0].to(sd)), self.qk_layout.heads(proj[1].to(sd))

    def qk_tensor(self) -> torch.Tensor:
        blocks = self._group_tensor()  # (F+1, F, nb)
        return blocks if self.fusion is None else blocks @ self.fusion.T

    def qk_macs(self, num_tokens: int) -> int:
        fusion = "identity" if self.fusion is None else "general"
        return _flops.irratt_qk_macs(num_tokens, self.dim, list(self.block_ranks), self.num_heads, fusion)


@register_attention("cp_slimatt")
class CPSlimAtt(CompressedAttention):
    """CP SlimAtt (IrrAtt paper, Sec. 2.4, Eqs. 3-4): shared projections and a head-fusion matrix.

    ``logits_h = (x S^Q + b) diag(S^H(h, :)) (x S^K)^T`` with S^Q, S^K (F x R) shared by all heads and
    ``fusion`` S^H (H x R). QK MACs ``2NFR + N(N+1)HR``.

    Args:
        dim: F; num_heads: H; rank: R in [1, F] (default F; R = F = H p already represents the QK map
        of any MHSA, as IrrAtt's total rank H p); vo_ranks, qk_bias, proj_bias, attn_drop, proj_drop:
        as :class:`TruncAtt`.
    Shapes: x (B, N, F) -> (B, N, F).
    """

    def __init__(self, dim: int, num_heads: int = 8, rank: Optional[int] = None, vo_ranks: Ranks = None,
                 qk_bias: bool = True, proj_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__(dim, num_heads, vo_ranks, proj_bias, attn_drop, proj_drop)
        rank = dim if rank is None else rank
        if not is_int(rank) or not 1 <= rank <= dim:
            raise ValueError(f"rank out of range: must be an int in [1, dim = H p = {dim}], got {rank!r}")
        self.rank = rank
        self.q = nn.Linear(dim, rank, bias=qk_bias)
        self.k = nn.Linear(dim, rank, bias=False)
        self.fusion = nn.Parameter(torch.ones(num_heads, rank))
        with torch.no_grad():
            self.q.weight.mul_(rank ** -0.5)

    def _project(self, x):
        return self.q(x), self.k(x)

    def _logits(self, proj, sd):
        q, k = proj[0].to(sd), proj[1].to(sd)
        # head expansion q_r * S^H[h, r] written as a (.., 1) @ (1, H) matmul: N H R MACs, counted
        qs = q[..., None, None] @ self.fusion.to(sd).T[:, None, :]  # (B, N, R, 1, 1) @ (R, 1, H)
        qs = qs.squeeze(-2).permute(0, 3, 1, 2)  # (B, H, N, R)
        return qs @ k.unsqueeze(1).transpose(-2, -1)

    def _sdpa_qk(self, proj, sd):
        q, k = proj[0].to(sd), proj[1].to(sd)
        qs = q.unsqueeze(1) * self.fusion.to(sd)[None, :, None, :]
        return qs, k.unsqueeze(1).expand(-1, self.num_heads, -1, -1)

    def qk_tensor(self) -> torch.Tensor:
        wq = self.q.weight.T
        bias = self.q.bias[None] if self.q.bias is not None else wq.new_zeros(1, wq.shape[1])
        wq = torch.cat([wq, bias], dim=0)
        return torch.einsum("ir,jr,hr->ijh", wq, self.k.weight.T, self.fusion)

    def qk_macs(self, num_tokens: int) -> int:
        return _flops.cp_qk_macs(num_tokens, self.dim, self.num_heads, self.rank)
