"""Functional attention operators. Shapes: B batch, H heads, N tokens, p head dim.

Each operator has a plain, readable reference version in :mod:`whiteformer.ops.reference`
that the main version here is tested against (forward and gradients)."""

# --- tssa / causal_tssa ---
from .tssa import tssa  # noqa: F401
from .causal_tssa import CausalTSSAState, causal_tssa, causal_tssa_step  # noqa: F401
# --- dmsa ---
from .dmsa import dmsa, sparsemax  # noqa: F401
from .rotary import rotary  # noqa: F401
# --- eca ---
from .eca import eca_compress, eca_expand, eca_omega, orthonormal_basis  # noqa: F401
from .eca import cholesky_fallback_count, cholesky_stats, reset_cholesky_fallback_count  # noqa: F401
# --- baselines: mhsa, xca, mssa, class_attention ---
from .baselines import class_attention, mhsa, mhsa_explicit, mssa, xca  # noqa: F401
