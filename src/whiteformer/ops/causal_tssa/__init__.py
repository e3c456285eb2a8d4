"""Causal Token Statistics Self-Attention (ToST, Wu et al., ICLR 2025, Appendix B Eq. (28) with
the memberships of Appendix C.1 Eq. (39); Algorithm 2 and the official language model).

* :mod:`.dispatch`: the public :func:`causal_tssa` (a whole sequence) and
  :func:`causal_tssa_step` (one token, for generation): checks, kernel choice;
* :mod:`.parallel`: the one differentiable PyTorch implementation (prefix sums), also the
  fused kernels' double backward;
* :mod:`.recurrent`: the step's PyTorch path (the parallel form on one token from a state);
* :mod:`.state`: :class:`CausalTSSAState` (the constant-size running sums) and the position bias;
* the literal formula (test oracle): :func:`whiteformer.ops.reference.causal_tssa_reference`;
* fused kernels: the custom ops of :mod:`whiteformer.ops._kernels.fused` (C++ on CPU) and the
  backends registered in :mod:`whiteformer.ops._kernels`.
"""
from .dispatch import causal_tssa, causal_tssa_step  # noqa: F401
from .state import CausalTSSAState  # noqa: F401

__all__ = ["causal_tssa", "causal_tssa_step", "CausalTSSAState"]
