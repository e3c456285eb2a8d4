"""FLOPs of whole models and modules as counted by ``torch.utils.flop_counter``, next to the
closed-form MACs formulas of MHSA and its compressed forms (IrrAtt paper, Sec. 2.2-3.4), which live with
the layers in :mod:`whiteformer.attention.macs` and are re-exported here."""
from __future__ import annotations

import torch

from ..attention.macs import (cp_qk_macs, irratt_qk_macs, linear_macs, lowrank_linear_macs, mhsa_macs,  # noqa: F401
                              mhsa_qk_macs, mhsa_vo_macs, truncatt_qk_macs, vo_truncatt_macs)

__all__ = ["mhsa_macs", "mhsa_qk_macs", "mhsa_vo_macs", "truncatt_qk_macs", "cp_qk_macs", "irratt_qk_macs",
           "vo_truncatt_macs", "linear_macs", "lowrank_linear_macs", "count_flops"]


def count_flops(module: torch.nn.Module, *args, **kwargs) -> int:
    """FLOPs of ``module(*args, **kwargs)`` counted by ``torch.utils.flop_counter.FlopCounterMode``.

    Modules with a ``fused_attn`` attribute (the compressed layers, timm-style attention) are
    switched to their explicit-matmul path for the count (the fused SDPA CPU kernel is invisible to
    the counter).
    """
    from torch.utils.flop_counter import FlopCounterMode

    saved = []
    for m in module.modules():
        if hasattr(m, "fused_attn"):
            saved.append((m, m.fused_attn))
            m.fused_attn = False
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            module(*args, **kwargs)
    finally:
        for m, v in saved:
            m.fused_attn = v
    return int(fc.get_total_flops())
