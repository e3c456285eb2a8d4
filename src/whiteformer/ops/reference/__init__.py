"""Plain reference implementations: the papers' formulas written for clarity, used as the
oracle for the main operators in :mod:`whiteformer.ops`."""

# --- tssa / causal_tssa ---
from .tssa import tssa_reference  # noqa: F401
from .causal_tssa import causal_tssa_reference  # noqa: F401
# --- dmsa ---
from .dmsa import dmsa_reference, rotary_reference  # noqa: F401
# --- eca ---
from .eca import eca_compress_reference, eca_expand_reference, orthonormal_basis_reference  # noqa: F401
# --- baselines ---
from .baselines import class_attention_reference, mhsa_reference, mssa_reference, xca_reference  # noqa: F401
# --- chunked LM-head cross-entropy ---
from .linear_cross_entropy import linear_cross_entropy_reference  # noqa: F401

__all__ = ["tssa_reference", "causal_tssa_reference", "dmsa_reference", "rotary_reference", "eca_compress_reference",
           "eca_expand_reference", "orthonormal_basis_reference", "class_attention_reference", "mhsa_reference",
           "mssa_reference", "xca_reference", "linear_cross_entropy_reference"]
