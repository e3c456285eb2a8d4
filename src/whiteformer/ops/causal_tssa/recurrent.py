"""The recurrent form of causal TSSA: one token from the running sums (constant memory per
token, for generation). It is the prefix-sum form of :mod:`.parallel` on a sequence of one token
continuing from the sums, so the two cannot drift apart."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .parallel import causal_tssa_parallel

__all__ = ["causal_tssa_recurrent"]


def causal_tssa_recurrent(
    w_t: torch.Tensor,
    sum_sq: torch.Tensor,
    sum_pi: torch.Tensor,
    sum_sq_pi: torch.Tensor,
    temp: torch.Tensor,
    logit_bias: Optional[torch.Tensor] = None,
    scale: Optional[torch.Tensor] = None,
    drop_p: float = 0.0,
) -> Tuple[torch.Tensor, ...]:
    """One step on validated inputs: w_t (B, H, p), the sums of the earlier tokens (sum_sq
    (B, H, p), sum_pi (B, H), sum_sq_pi (B, H, p)) in units of ``scale`` (B, H, p) (a power of
    two per feature, or None for 1), temp (H, 1), logit_bias (H, 1) or (B, H, 1) or None. Returns
    out_t (B, H, p), pi_t (B, H) in ``w_t``'s dtype, the updated sums and their scale (B, H, p) (the larger of
    ``scale`` and ``w_t``'s own, :mod:`whiteformer.ops.scaling`): the kernel signature of
    ``causal_tssa_step`` backends, see :mod:`whiteformer.ops._kernels`."""
    out, pi, *sums = causal_tssa_parallel(w_t.unsqueeze(-2), temp, logit_bias, None, drop_p,
                                          initial=(sum_sq, sum_pi, sum_sq_pi, scale))
    return (out.squeeze(-2), pi.squeeze(-1), *sums)
