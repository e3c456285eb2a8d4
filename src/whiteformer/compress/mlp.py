"""MLP compression by truncated SVD: each linear becomes two linears (IrrAtt paper, Sec. 4.7).

``W (out x in) ~= U_r S_r V_r^T``: ``first.weight = S_r^{1/2} V_r^T``, ``second.weight = U_r S_r^{1/2}``.
With calibration inputs X the activation-aware variant minimises ``||X (W - What)^T||_F``: with
``X^T X / n = L L^T``, take the rank-r SVD of ``W L`` and map back with ``L^{-1}``.
"""
from __future__ import annotations

import copy
from typing import Optional, Sequence, Union

import torch
import torch.nn as nn

from .._checks import check_instance, is_int
from .lowrank import LowRankLinear
from .whitening import second_moment, whitening_factor

__all__ = ["compress_linear", "compress_mlp"]


@torch.no_grad()
def compress_linear(linear: nn.Linear, rank: int, *, calib: Optional[torch.Tensor] = None) -> LowRankLinear:
    """Rank-``rank`` truncated SVD of ``linear`` as a :class:`LowRankLinear` (same device/dtype).

    Args:
        linear: nn.Linear(in, out); rank: 1 <= r <= min(in, out).
        calib: optional inputs (..., in) of the layer for the activation-aware variant.
    """
    check_instance(linear, "linear", nn.Linear, "an nn.Linear")
    n_in, n_out = linear.in_features, linear.out_features
    out = LowRankLinear(n_in, n_out, rank, bias=linear.bias is not None)  # checks rank: an int in [1, min(in, out)]
    W = linear.weight.detach().to(torch.float64)
    L = None
    if calib is not None:
        if not isinstance(calib, torch.Tensor) or calib.shape[-1] != n_in:
            raise ValueError(f"calib must be a tensor of inputs (..., {n_in}), got "
                             f"{getattr(calib, 'shape', type(calib).__name__)}")
        L = whitening_factor(second_moment(calib))
        W = W @ L
    u, s, vh = torch.linalg.svd(W, full_matrices=False)
    root = s[:rank].sqrt()
    first = root[:, None] * vh[:rank]  # (r, in)
    if L is not None:  # first <- first L^{-1}
        first = torch.linalg.solve_triangular(L, first, upper=False, left=False)
    second = u[:, :rank] * root
    out.first.weight.copy_(first)
    out.second.weight.copy_(second)
    if linear.bias is not None:
        out.second.bias.copy_(linear.bias.detach())
    return out.to(device=linear.weight.device, dtype=linear.weight.dtype)


@torch.no_grad()
def compress_mlp(mlp: nn.Module, rank: Union[int, Sequence[int]], *, calib: Optional[torch.Tensor] = None,
                 allow_growth: bool = False) -> nn.Module:
    """Copy of a timm-style ``Mlp`` (``fc1``, ``act``, ``fc2``) with both linears replaced by
    :class:`LowRankLinear` of rank ``rank`` (or ``(rank_fc1, rank_fc2)``).

    ``calib``: optional MLP inputs (..., F); fc2 is then calibrated on ``act(fc1(calib))``.
    A rank r with ``r (in + out) > in out`` costs more MACs than the dense linear: ``ValueError``
    unless ``allow_growth``.
    """
    fc1, fc2 = getattr(mlp, "fc1", None), getattr(mlp, "fc2", None)
    if not isinstance(fc1, nn.Linear) or not isinstance(fc2, nn.Linear):
        raise TypeError(f"{type(mlp).__name__} is not a timm-style Mlp with `fc1` and `fc2` nn.Linear layers")
    if isinstance(rank, (list, tuple)):
        if len(rank) != 2:
            raise ValueError(f"rank must be an int or (rank_fc1, rank_fc2), got {rank!r}")
        r1, r2 = rank
    else:
        r1 = r2 = rank
    for name, fc, r in (("fc1", fc1, r1), ("fc2", fc2, r2)):
        grows = is_int(r) and 1 <= r <= min(fc.in_features, fc.out_features) \
            and r * (fc.in_features + fc.out_features) > fc.in_features * fc.out_features
        if grows and not allow_growth:  # (a rank out of range is reported by compress_linear)
            raise ValueError(f"MLP rank {r} for {name} ({fc.in_features} -> {fc.out_features}) costs more MACs than "
                             f"the dense layer (r (in + out) > in out): a compression that grows the model is "
                             "refused; lower the rank, or pass allow_growth=True (whiteformer compress --allow-growth)")
    new = copy.deepcopy(mlp)
    new.fc1 = compress_linear(fc1, r1, calib=calib)  # checks r1 and calib (..., fc1.in_features)
    hidden = None
    if calib is not None:
        act = getattr(mlp, "act", nn.Identity())
        hidden = act(fc1(calib.to(fc1.weight)))
        norm = getattr(mlp, "norm", None)
        if norm is not None:
            hidden = norm(hidden)
    new.fc2 = compress_linear(fc2, r2, calib=hidden)
    return new
