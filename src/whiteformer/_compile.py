"""``torch.compile`` awareness of eager-only code: what may run while it traces, and what it must skip."""
from __future__ import annotations

import torch

__all__ = ["can_read_values", "compile_disabled"]


def can_read_values() -> bool:
    """False while ``torch.compile`` traces: a check that reads a tensor's values (``int(x.min())``,
    ``bool(mask.any())``) would break the graph there, so such checks run in eager mode only."""
    return not torch.compiler.is_compiling()


def compile_disabled(reason: str):
    """``torch.compiler.disable`` as a decorator, with the ``reason`` that torch (from 2.8) shows in a
    ``fullgraph=True`` error; torch 2.7 takes no reason."""
    try:
        return torch.compiler.disable(reason=reason)
    except TypeError:
        return torch.compiler.disable
