"""Power-of-two rescaling of the TSSA statistics, so that squares of large inputs stay finite.

The TSSA operators sum squares of ``w``; in float32 (the statistics dtype of bfloat16/float16
too) ``w^2`` overflows for |w| > ~1.8e19 and the ratio inf / inf of the normalisation is NaN,
although the operator is finite there. The memberships depend on ratios of energies only (scale
invariant); with ``x = c x'`` the sums of squares are ``dots = c^2 dots'``, so::

    out = -x Pi / (1 + dots) = -x' Pi / (1 / c + c dots')

``c`` is a power of two (exact division) per batch row and head (per packed document and head:
:func:`document_scale`), 1 unless the largest |w| there exceeds :data:`SAFE_MAX`: ordinary inputs
run the unscaled formula unchanged.
"""
from __future__ import annotations

from typing import Optional

import torch

from .constants import SAFE_MAX
from .layout import Segments, segment_amax

__all__ = ["SAFE_MAX", "document_scale", "head_scale", "rows_beyond_kernel_range", "scaled_eps"]


def head_scale(x: torch.Tensor, trailing: int = 2, extra: Optional[torch.Tensor] = None, group=None) -> torch.Tensor:
    """The scale ``c`` of ``x`` over its last ``trailing`` dims (kept as size-1 dims), detached:
    the power of two at or below the largest |x|, or 1 when that is at most :data:`SAFE_MAX` (or
    not finite). ``extra``: a magnitude of the same shape to include (e.g. the square root of
    earlier tokens' sum of squares); ``group``: the largest over the ranks of a split sequence."""
    m = _max_abs(x, trailing)
    if extra is not None:
        m = torch.maximum(m, extra.detach())
    if group is not None:
        from .context_parallel import all_reduce_max

        m = all_reduce_max(m, group)
    return _power_of_two(m)


def document_scale(x: torch.Tensor, seg: Segments) -> torch.Tensor:
    """The scale ``c`` of each packed document of ``x`` (H, total, p), as (H, S, 1), detached:
    :func:`head_scale` of the document's tokens alone (a document beside one at a far larger
    scale keeps its own; 1 for an empty document)."""
    return _power_of_two(segment_amax(_max_abs(x, 1)[..., 0], seg)).unsqueeze(-1)


def _power_of_two(m: torch.Tensor) -> torch.Tensor:
    """The power of two at or below each ``m`` (max |x|), or 1 where ``m`` is at most
    :data:`SAFE_MAX` or not finite."""
    big = torch.isfinite(m) & (m > SAFE_MAX)
    # 2 ** floor(log2 m), exact; pow rather than exp2, which the TorchScript ONNX exporter lacks
    return torch.where(big, torch.pow(2.0, torch.floor(torch.log2(torch.where(big, m, torch.ones_like(m))))),
                       torch.ones_like(m))


def _max_abs(x: torch.Tensor, trailing: int) -> torch.Tensor:
    """max |x| over the last ``trailing`` dims, kept as size-1 dims (0 where they hold nothing):
    the larger of ``amax`` and ``-amin`` (no |x| temporary: ~3x faster than ``abs().amax()`` on CPU)."""
    dims = tuple(range(-trailing, 0))
    if any(x.shape[d] == 0 for d in dims):  # no tokens (a rank's empty chunk): nothing to scale
        return x.new_zeros(*x.shape[:-trailing], *([1] * trailing))
    x = x.detach()
    return torch.maximum(x.amax(dim=dims, keepdim=True), -x.amin(dim=dims, keepdim=True))


def scaled_eps(eps: float, c: torch.Tensor) -> torch.Tensor:
    """A clamp ``eps`` on sums of squares in the scaled units (``eps / c^2``), at least the dtype's
    smallest normal number (so that its reciprocal stays finite)."""
    return (eps / (c * c)).clamp_min(torch.finfo(c.dtype).tiny)


def rows_beyond_kernel_range(w: torch.Tensor) -> Optional[torch.Tensor]:
    """(B,) bool: the batch rows of a CPU tensor ``w`` (B, ...) holding some |w| > :data:`SAFE_MAX`,
    for a registered backend's kernel that squares ``w`` unscaled (the Triton kernels on CPU
    tensors, through the interpreter): those rows take the (rescaled) PyTorch path. A pass over
    ``w``; the C++ kernels flag such rows from their own sums instead
    (:mod:`whiteformer.ops._kernels.fused`). None where not read: off the CPU (it would synchronise
    the device) and while compiling."""
    if w.device.type != "cpu" or w.numel() == 0 or torch.compiler.is_compiling():
        return None
    return _max_abs(w, w.dim() - 1).flatten() > SAFE_MAX
