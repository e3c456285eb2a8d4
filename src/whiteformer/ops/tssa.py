"""Token Statistics Self-Attention (TSSA), the attention operator of ToST
(Wu et al., "Token Statistics Transformer", ICLR 2025).

Implements Eq. (11) with the memberships of Eq. (10) as the paper's implementation computes
them (Appendix C.1, Eqs. (31)-(34); Algorithm 1): for each head k, with w = U_k^T Z of shape
(N, p),

    Pi     = softmax_heads( temp * sum_p (w / ||w||_tokens)^2 )           (Eqs. 32-34)
    dots   = sum_n  Pi_n / (sum_n Pi_n + 1e-8) * w_n^2                    (second moments)
    out_n  = -(w_n * Pi_n) / (1 + dots)                                    (Eq. 31, grad f = 1/(1+x))

The norm over tokens has ``F.normalize`` semantics (eps 1e-12). This module is the efficient
pure-PyTorch version; :func:`whiteformer.ops.reference.tssa_reference` is the literal formula.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from .._checks import autocast_off, check_mask, check_nonempty, check_tensor, stats_dtype
from .tssa_fused import fused_supported, tssa_fused

__all__ = ["tssa"]

NORM_EPS = 1e-12  # F.normalize default eps (on the l2 norm over tokens)
PI_EPS = 1e-8  # added to the membership mass sum_n Pi_n




def _check_temp(temp, heads: int) -> None:
    check_tensor(temp, "temp", 2)
    if temp.shape != (heads, 1):
        raise ValueError(f"temp must have shape (H, 1) = ({heads}, 1) to match w, got {tuple(temp.shape)}")


def _check_drop(attn_drop) -> None:
    if not isinstance(attn_drop, (int, float)) or not 0.0 <= attn_drop < 1.0:
        raise ValueError(f"attn_drop must be a float in [0, 1), got {attn_drop!r}")


def _check_heads_input(w, name: str = "w") -> None:
    """w: (B, H, N, p) floating, with N > 0, H > 0, p > 0."""
    check_tensor(w, name, 4)
    check_nonempty(w, name, 1, "heads")
    check_nonempty(w, name, 2, "tokens")
    check_nonempty(w, name, 3, "features (head dim p)")


def tssa(
    w: torch.Tensor,
    temp: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    return_pi: bool = False,
    *,
    attn_drop: float = 0.0,
    training: bool = False,
    normalize: bool = True,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Token Statistics Self-Attention (ToST Eq. (11), memberships Eq. (10)/(34)).

    Args:
        w: (B, H, N, p) projected tokens ``U_k^T Z`` per head.
        temp: (H, 1) temperature (``1 / (2 eta)`` in Eq. (10)).
        attn_mask: optional (B, N) bool keep-mask (True = real token). Padded tokens take no
            part in any statistic (norms, membership sums, second moments) and their outputs
            are 0, so each real token gets the result of its sequence alone.
        return_pi: also return the memberships Pi.
        attn_drop: dropout probability on the gain ``1 / (1 + dots)`` (as the official layer).
        training: dropout is applied only when True.
        normalize: l2-normalise each feature over the tokens before computing Pi (Eq. (32)-(34),
            the official default). ``False`` gives ``Pi = softmax_heads(temp * sum_p w^2)``: the
            "no l2 normalisation" row of the ToST Table 8 ablation (always the PyTorch path).

    Returns:
        out (B, H, N, p) in ``w``'s dtype; with ``return_pi``, ``(out, pi)`` with pi (B, H, N)
        (softmax over heads; 0 at padded tokens).

    Under float16/bfloat16 (or autocast) all statistics are computed in float32.
    """
    _check_heads_input(w)
    _check_temp(temp, w.shape[1])
    attn_mask = check_mask(attn_mask, w.shape[0], w.shape[2])
    _check_drop(attn_drop)
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
    drop_p = float(attn_drop) if training else 0.0
    if normalize:
        out, pi = _tssa_forward(w, temp, attn_mask, drop_p)
    else:
        out, pi = _tssa_torch(w, temp, attn_mask, drop_p, normalize=False)
    return (out, pi) if return_pi else out


def _tssa_forward(
    w: torch.Tensor, temp: torch.Tensor, attn_mask: Optional[torch.Tensor], drop_p: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Single dispatch point (inputs already validated): the fused kernel
    (:mod:`.tssa_fused`; chosen by device type and dtype, see :mod:`._kernels`) when it
    supports ``w`` and there is no dropout, else the pure-PyTorch path.
    ``WHITEFORMER_DISABLE_KERNELS=1`` forces the pure-PyTorch path."""
    if drop_p == 0.0 and fused_supported(w):
        return tssa_fused(w, temp, attn_mask)
    return _tssa_torch(w, temp, attn_mask, drop_p)


def _tssa_torch(
    w: torch.Tensor, temp: torch.Tensor, attn_mask: Optional[torch.Tensor], drop_p: float,
    normalize: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch TSSA: returns (out (B,H,N,p), pi (B,H,N)) in ``w``'s dtype.

    Never materialises ``w_normed``: sum_p (w_np / ||w_:p||)^2 = sum_p w_np^2 / sum_n w_np^2 is one
    matrix-vector product of w^2 with the inverse per-feature energies, and the Pi-weighted
    second moments are one more.
    """
    sd = stats_dtype(w)
    with autocast_off(w):
        x = w.to(sd)
        if attn_mask is not None:
            # padded tokens: zero entries contribute nothing to any token sum below
            x = x.masked_fill(~attn_mask[:, None, :, None], 0.0)
        x2 = x * x  # (B, H, N, p)
        # F.normalize divides by max(||w||, eps): squared, max(sum_n w^2, eps^2)
        if normalize:
            inv_energy = x2.sum(dim=-2).clamp_min(NORM_EPS * NORM_EPS).reciprocal()  # (B, H, p)
            logits = torch.einsum("bhnp,bhp->bhn", x2, inv_energy) * temp.to(sd)
        else:
            logits = x2.sum(dim=-1) * temp.to(sd)
        pi = torch.softmax(logits, dim=1)  # over heads
        if attn_mask is not None:
            pi = pi.masked_fill(~attn_mask[:, None, :], 0.0)
        pi_w = pi / (pi.sum(dim=-1, keepdim=True) + PI_EPS)
        dots = torch.einsum("bhn,bhnp->bhp", pi_w, x2)  # (B, H, p)
        gain = (1.0 + dots).reciprocal()
        if drop_p > 0.0:
            gain = F.dropout(gain, p=drop_p, training=True)
        out = -(x * pi.unsqueeze(-1)) * gain.unsqueeze(-2)
    return out.to(w.dtype), pi.to(w.dtype)
