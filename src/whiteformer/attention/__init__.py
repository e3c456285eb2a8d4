"""Attention layers with timm's contract: ``(B, N, C)`` in and out, ``Attn(dim, num_heads=...)``,
``forward(x, attn_mask=None)`` with a (B, N) bool keep-mask (True = real token)."""
from .registry import build, get_attention_class, list_attention, register_attention

# --- tssa / causal_tssa (one line each section; keep sections separate) ---
from .tssa import TSSA, CausalTSSA  # noqa: F401
# --- causal_mhsa (GPT baseline) and the prefill/step protocol of causal layers ---
from .causal import CausalAttention, CausalSelfAttention, KVCache  # noqa: F401
# --- dmsa ---
from .dmsa import DMSA  # noqa: F401
# --- eca ---
from .eca import ECAttention  # noqa: F401
# --- baselines: mhsa, xca, mssa, class_attention ---
from .baselines import MHSA, MSSA, XCA, ClassAttention  # noqa: F401

__all__ = [
    "build", "get_attention_class", "list_attention", "register_attention",
    "TSSA", "CausalTSSA", "CausalAttention", "CausalSelfAttention", "KVCache",
    "DMSA", "ECAttention", "MHSA", "MSSA", "XCA", "ClassAttention",
]
