"""Plain reference implementations: the papers' formulas written for clarity, used as the
oracle for the main operators in :mod:`whiteformer.ops`."""

# --- tssa / causal_tssa ---
# --- dmsa ---
# --- eca ---
# --- baselines ---
