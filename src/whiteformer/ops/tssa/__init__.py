"""Token Statistics Self-Attention (ToST, Wu et al., ICLR 2025, Eq. (11)).

* :mod:`.dispatch`: the public :func:`tssa` (checks, kernel choice);
* :mod:`.parallel`: the one differentiable PyTorch implementation (fallback and double backward);
* the literal formula (test oracle): :func:`whiteformer.ops.reference.tssa_reference`;
* fused kernels: the custom ops of :mod:`whiteformer.ops._kernels.fused` (C++ on CPU) and the
  backends registered in :mod:`whiteformer.ops._kernels`.
"""
from .dispatch import tssa  # noqa: F401

__all__ = ["tssa"]
