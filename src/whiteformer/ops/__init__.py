"""Functional attention operators. Shapes: B batch, H heads, N tokens, p head dim.

Each operator has a plain, readable reference version in :mod:`whiteformer.ops.reference`
that the main version here is tested against (forward and gradients)."""

# --- tssa / causal_tssa ---
# --- dmsa ---
# --- eca ---
# --- baselines: mhsa, xca, mssa, class_attention ---
