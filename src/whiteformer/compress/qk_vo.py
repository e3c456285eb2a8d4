"""Per-head query-key and value-output forms of a timm-layout MHSA block (IrrAtt paper, Sec. 2.2-2.3).

timm's ``Attention``: ``qkv = Linear(F, 3F)`` whose output rows are laid out as (3, H, p) (q rows
0:F, k rows F:2F, v rows 2F:3F; head h = rows h*p:(h+1)*p within each), ``proj = Linear(F, F)``,
logits scaled by ``scale = p^-0.5``. With PyTorch's ``y = x W^T + b`` the paper's matrices are
``W_h^Q = Wq[h*p:(h+1)*p].T`` (F x p), likewise K and V, and ``W_h^O = Wproj[:, h*p:(h+1)*p]`` (F x p):

* query-key: ``Y_QK[:, :, h] = W_h^Q (W_h^K)^T`` (F x F x H). With a qkv bias the logits are
  ``(x_i W^Q + b^Q)(x_j W^K + b^K)^T = x_i Y x_j^T + x_j . (W^K b^Q) + (terms constant in j)``;
  the terms constant along the keys cancel in the softmax and are dropped, the key-dependent one is
  kept exactly by giving Y an extra query row: ``Y~_h = [W_h^Q; b_h^Q^T] (W_h^K)^T`` ((F+1) x F),
  so that ``logits = [x_i, 1] Y~_h x_j^T``. Any decomposition of Y~ gives compressed query maps
  with a bias (its last row) and key maps without one.
* value-output: ``Y_VO[:, :, h] = W_h^V (W_h^O)^T`` (F x F x H). The value bias adds
  ``A_h 1 b_h^V W_h^O^T = 1 (b_h^V W_h^O^T)`` (attention rows sum to one), a constant folded into
  the output bias ``b^O + Wproj b^V``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch
import torch.nn as nn

from .._checks import check_divisible, check_instance
from ._tensor import HeadFactors

__all__ = ["MHSASpec", "mhsa_spec", "qk_factors", "vo_factors"]


@dataclass(frozen=True)
class MHSASpec:
    """Sizes and options of a timm-layout MHSA block."""

    dim: int
    num_heads: int
    head_dim: int
    scale: float
    qkv_bias: bool
    proj_bias: bool
    attn_drop: float
    proj_drop: float


def _is_identity(m) -> bool:
    return m is None or isinstance(m, nn.Identity)


def _dropout_p(m) -> float:
    if m is None:
        return 0.0
    if isinstance(m, nn.Dropout):
        return float(m.p)
    if isinstance(m, (int, float)):
        return float(m)
    raise TypeError(f"unsupported dropout module {type(m).__name__}")


def mhsa_spec(attn: nn.Module) -> MHSASpec:
    """Validate a timm-layout MHSA module and return its :class:`MHSASpec`.

    Raises TypeError for a module that is not such an MHSA block (no ``qkv``/``proj`` Linear or no
    ``num_heads``) and ValueError for mismatched sizes or options that a bilinear QK form cannot
    express (q/k normalisation, a norm before ``proj``).
    """
    check_instance(attn, "attn", nn.Module, "an nn.Module (timm-layout MHSA)")
    qkv, proj = getattr(attn, "qkv", None), getattr(attn, "proj", None)
    heads = getattr(attn, "num_heads", None)
    if not isinstance(qkv, nn.Linear) or not isinstance(proj, nn.Linear) or heads is None:
        raise TypeError(f"{type(attn).__name__} is not a timm-layout MHSA block: expected attributes "
                        "`qkv` (nn.Linear(F, 3F)), `proj` (nn.Linear(F, F)) and `num_heads`")
    F = qkv.in_features
    p = check_divisible(F, heads)
    if qkv.out_features != 3 * F or proj.in_features != F or proj.out_features != F:
        raise ValueError(f"qkv must map F -> 3F and proj must be Linear({F}, {F}); got qkv Linear({qkv.in_features}, "
                         f"{qkv.out_features}) and proj Linear({proj.in_features}, {proj.out_features})")
    for name in ("q_norm", "k_norm", "norm"):
        if not _is_identity(getattr(attn, name, None)):
            raise ValueError(f"attn.{name} is {type(getattr(attn, name)).__name__}: the QK/VO forms are only "
                             "defined for blocks without q/k normalisation or a norm before proj")
    scale = getattr(attn, "scale", None)
    scale = float(p ** -0.5) if scale is None else float(scale)
    return MHSASpec(F, heads, p, scale, qkv.bias is not None, proj.bias is not None,
                    _dropout_p(getattr(attn, "attn_drop", None)), _dropout_p(getattr(attn, "proj_drop", None)))


@torch.no_grad()
def qk_factors(attn: nn.Module, *, include_bias: bool = True) -> HeadFactors:
    """The query-key tensor as thin factors: ``Y[:, :, h] = P[h] @ K[h].T``.

    ``P[h]`` is ``W_h^Q`` (F x p), or ``[W_h^Q; b_h^Q^T]`` ((F+1) x p) when qkv has a bias and
    ``include_bias`` (see module docstring); ``K[h] = W_h^K`` (F x p). The softmax scale is *not*
    included. Returns float tensors detached from the module, in its dtype.
    """
    spec = mhsa_spec(attn)
    F, H, p = spec.dim, spec.num_heads, spec.head_dim
    W = attn.qkv.weight.detach()
    wq = W[:F].reshape(H, p, F).transpose(1, 2)  # (H, F, p)
    wk = W[F:2 * F].reshape(H, p, F).transpose(1, 2)
    if include_bias and spec.qkv_bias:
        bq = attn.qkv.bias.detach()[:F].reshape(H, 1, p)
        wq = torch.cat([wq, bq], dim=1)  # (H, F+1, p)
    return HeadFactors(wq.clone(), wk.clone())


@torch.no_grad()
def vo_factors(attn: nn.Module) -> Tuple[HeadFactors, torch.Tensor]:
    """The value-output tensor as thin factors and the folded output bias.

    Returns ``(HeadFactors(P = W^V (H, F, p), K = W^O (H, F, p)), out_bias (F,))`` with
    ``Y_VO[:, :, h] = W_h^V (W_h^O)^T`` and ``out_bias = b^O + Wproj b^V`` (zeros if neither exists).
    """
    spec = mhsa_spec(attn)
    F, H, p = spec.dim, spec.num_heads, spec.head_dim
    W = attn.qkv.weight.detach()
    wv = W[2 * F:].reshape(H, p, F).transpose(1, 2)
    wo = attn.proj.weight.detach().reshape(F, H, p).permute(1, 0, 2)  # (H, F, p)
    bias = attn.proj.bias.detach().clone() if spec.proj_bias else W.new_zeros(F)
    if spec.qkv_bias:
        bias = bias + attn.proj.weight.detach() @ attn.qkv.bias.detach()[2 * F:]
    return HeadFactors(wv.clone(), wo.clone()), bias
