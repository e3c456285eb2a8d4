"""Reference DMSA (Liu et al., DMST paper, Eq. (18); Appendix B Algorithm 1) and LLaMA-style
rotary encoding, written literally for clarity.

Oracle for :func:`whiteformer.ops.dmsa` and :func:`whiteformer.ops.rotary`. Soft thresholding
(Eq. 13-14) is ``entmax.sparsemax``; rotary uses complex numbers as LLaMA's ``apply_rotary_emb``.
A padding mask is handled by the definition itself: each sequence's real tokens are run alone
and padded outputs are 0. No input validation (see the main versions).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from entmax import sparsemax

from ..._dtypes import stats_dtype
from ..constants import PI_EPS

__all__ = ["dmsa_reference", "rotary_reference"]


def rotary_reference(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """x (B, N, C), C even: token n's channel pair (2i, 2i+1), read as the complex number
    x[2i] + i x[2i+1], is multiplied by exp(i n base**(-2i/C)). Positions 0..N-1."""
    B, N, C = x.shape
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    freqs = 1.0 / (base ** (torch.arange(0, C, 2, device=x.device)[: C // 2].to(cd) / C))
    t = torch.arange(N, device=x.device).to(cd)
    freqs_cis = torch.polar(torch.ones(N, C // 2, dtype=cd, device=x.device), torch.outer(t, freqs))
    xc = torch.view_as_complex(x.to(cd).reshape(B, N, C // 2, 2))
    return torch.view_as_real(xc * freqs_cis).flatten(2).to(x.dtype)


def _activation(name: str, logits: torch.Tensor, dim: int) -> torch.Tensor:
    if name == "sigmoid":
        return torch.sigmoid(logits)
    if name == "relu":
        return F.relu(logits)
    if name == "gelu":
        return F.gelu(logits)
    if name == "sparsemax":
        return sparsemax(logits, dim=dim)
    raise ValueError(f"unknown activation {name!r}")


def _dmsa_literal(S, PI, sparsity, activation, mode, gate_activation, attn_drop, training):
    """Algorithm 1 on one batch of unpadded sequences: S (B, H, N, p), PI (B, N, H) logits."""
    B, H = S.shape[0], S.shape[1]
    if sparsity in ("heads", "both"):
        gate = PI.mean(dim=1)  # (B, H)
        head_mask = _activation(gate_activation, gate, dim=1)  # ST over heads
    else:
        head_mask = S.new_ones(B, H)  # TPUSA keeps the full U_k
    w = S * rearrange(head_mask, "b h -> b h 1 1")  # sparse weighting of the full space S
    Pi = _activation(activation, rearrange(PI, "b n h -> b h n"), dim=1)
    if sparsity in ("tokens", "both"):
        Pi = sparsemax(Pi, dim=-1)  # ST along the token axis, used directly as the membership
    dots = torch.matmul((Pi / (Pi.sum(dim=-1, keepdim=True) + PI_EPS)).unsqueeze(-2), w**2)  # (B, H, 1, p)
    attn = 1.0 / (1 + dots)
    attn = F.dropout(attn, p=attn_drop, training=training)
    if mode == "membership":
        out = -torch.mul(w.mul(Pi.unsqueeze(-1)), attn)
    else:  # gated channel attention, Eq. (19)-(21): no Diag(pi_k) on the output
        out = -torch.mul(w, attn)
    return out, Pi, head_mask


def dmsa_reference(
    s: torch.Tensor,
    logits: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    sparsity: str = "heads",
    activation: str = "sigmoid",
    mode: str = "membership",
    return_stats: bool = False,
    *,
    gate_activation: str = "sparsemax",
    attn_drop: float = 0.0,
    training: bool = False,
):
    """Reference DMSA. s (B, H, N, p), logits (B, N, H), attn_mask (B, N) bool keep-mask or None.

    Returns out (B, H, N, p) (and ``{"pi": (B, H, N), "gate": (B, H)}`` with ``return_stats``).
    Half inputs are computed in float32 and cast back.
    """
    out_dtype = torch.promote_types(s.dtype, logits.dtype)
    sd = stats_dtype(s.to(out_dtype))
    S, PI = s.to(sd), logits.to(sd)
    args = (sparsity, activation, mode, gate_activation, attn_drop, training)
    if attn_mask is None:
        out, Pi, gate = _dmsa_literal(S, PI, *args)
    else:
        B, H, N, _ = S.shape
        out, Pi, gate = torch.zeros_like(S), S.new_zeros(B, H, N), S.new_zeros(B, H)
        for b in range(B):
            keep = attn_mask[b]
            if not bool(keep.any()):
                # no real token: outputs 0; the gate of an all-zero mean
                _, _, gate[b] = _dmsa_literal(S[b : b + 1, :, :1] * 0, PI[b : b + 1, :1] * 0, *args)
                continue
            o, pb, gb = _dmsa_literal(S[b : b + 1, :, keep], PI[b : b + 1, keep], *args)
            out[b, :, keep] = o[0]
            Pi[b, :, keep] = pb[0]
            gate[b] = gb[0]
    out, Pi, gate = out.to(out_dtype), Pi.to(out_dtype), gate.to(out_dtype)
    return (out, {"pi": Pi, "gate": gate}) if return_stats else out
