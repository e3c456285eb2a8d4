"""Power-of-two rescaling of the TSSA statistics, so that squares of large inputs stay finite.

The TSSA operators sum squares of ``w``; in float32 (the statistics dtype of bfloat16/float16
too) ``w^2`` overflows for |w| > ~1.8e19 and the ratio inf / inf of the normalisation is NaN,
although the operator is finite there. The memberships depend on ratios of energies only (scale
invariant); with ``x = c x'`` the sums of squares are ``dots = c^2 dots'``, so::

    out = -x Pi / (1 + dots) = -x' Pi / (1 / c + c dots')

The TSSA operators take ``c`` per feature (:func:`feature_scale`: per batch row, head and
feature j over the tokens; per packed document, head and feature: :func:`document_scale`): the
memberships are invariant to a scale of each feature column (each is normalised over the tokens,
its clamp becoming ``eps / c_j^2``, :func:`scaled_eps`) and ``dots`` is per feature, so the
formula keeps its form with ``c`` broadcast over the features. One scale per head would not do:
beside one feature holding a huge value, the squares of the ordinary features would underflow to
0 in its units and their gains be wrong. :func:`head_scale` gives one scale over several trailing
dims (for operators whose sums mix the features). ``c`` is a power of two (exact division), 1
unless the largest |w| there exceeds :data:`SAFE_MAX`: ordinary inputs run the unscaled formula
unchanged.

The parallel causal op takes ``c_j`` over all the tokens too, although its sums are prefix sums: a
token whose feature's largest |w_j| so far is more than ~2^63 times below ``c_j`` (a huge value
later in that feature) would have its squares underflow in those units in float32, so the batch
rows that the C++ kernel flags run that path in float64 (exact for float32 inputs). Limit: on the
PyTorch path with float32 statistics (the ``torch`` backend, and what the C++ kernel does not take:
bfloat16/float16, dropout, context parallelism, packed rows with much padding), the tokens before a
value > ~2^63x larger in their feature get squares of 0 and so wrong memberships and outputs. The
step (:func:`whiteformer.ops.causal_tssa_step`) scales each token by its own prefix and has no
such limit.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from .constants import SAFE_MAX
from .layout import Segments, segment_max_abs

__all__ = ["SAFE_MAX", "document_scale", "feature_scale", "head_scale", "rows_beyond_kernel_range", "scaled_eps"]


def head_scale(x: torch.Tensor, trailing: int = 2, extra: Optional[torch.Tensor] = None, group=None) -> torch.Tensor:
    """The scale ``c`` of ``x`` over its last ``trailing`` dims (kept as size-1 dims), detached:
    the power of two at or below the largest |x|, or 1 when that is at most :data:`SAFE_MAX` (or
    not finite). ``extra``: a magnitude of the same shape to include (e.g. the square root of
    earlier tokens' sum of squares); ``group``: the largest over the ranks of a split sequence."""
    return _scale_of(_max_abs(x, trailing), extra, group)


def feature_scale(x: torch.Tensor, extra: Optional[torch.Tensor] = None, group=None) -> torch.Tensor:
    """The scale ``c_j`` of each feature of ``x`` (..., N, p) over its tokens (dim -2), as
    (..., 1, p), detached: :func:`head_scale` of each feature column alone. ``extra`` (..., 1, p):
    a magnitude to include (e.g. a state's scale); ``group``: the largest over the ranks of a
    split sequence (one all-reduce of (..., 1, p))."""
    return _scale_of(_max_abs(x, (-2,)), extra, group)


def _scale_of(m: torch.Tensor, extra: Optional[torch.Tensor], group) -> torch.Tensor:
    """The power of two of the largest magnitude ``m``, ``extra`` (same shape) and, with ``group``,
    the other ranks' ``m`` (one all-reduce)."""
    if extra is not None:
        m = torch.maximum(m, extra.detach())
    if group is not None:
        from .context_parallel import all_reduce_max

        m = all_reduce_max(m, group)
    return _power_of_two(m)


def document_scale(x: torch.Tensor, seg: Segments) -> torch.Tensor:
    """The scale ``c_j`` of each packed document and feature of ``x`` (H, total, p), as
    (H, S, p), detached: :func:`feature_scale` of the document's tokens alone (a document beside
    one at a far larger scale keeps its own; 1 for an empty document)."""
    return _power_of_two(segment_max_abs(x.detach(), seg))


def _power_of_two(m: torch.Tensor) -> torch.Tensor:
    """The power of two at or below each ``m`` (max |x|), or 1 where ``m`` is at most
    :data:`SAFE_MAX` or not finite."""
    big = torch.isfinite(m) & (m > SAFE_MAX)
    # 2 ** floor(log2 m), exact; pow rather than exp2, which the TorchScript ONNX exporter lacks
    return torch.where(big, torch.pow(2.0, torch.floor(torch.log2(torch.where(big, m, torch.ones_like(m))))),
                       torch.ones_like(m))


def _max_abs(x: torch.Tensor, trailing: Union[int, Tuple[int, ...]]) -> torch.Tensor:
    """max |x| over the last ``trailing`` dims (or over the negative dims of a tuple), kept as
    size-1 dims (0 where they hold nothing): the larger of ``amax`` and ``-amin`` (no |x|
    temporary: ~3x faster than ``abs().amax()`` on CPU)."""
    dims = tuple(range(-trailing, 0)) if isinstance(trailing, int) else trailing
    if any(x.shape[d] == 0 for d in dims):  # no tokens (a rank's empty chunk): nothing to scale
        return x.new_zeros(*(1 if d - x.dim() in dims else n for d, n in enumerate(x.shape)))
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
