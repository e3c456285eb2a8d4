"""The Llama-style decoder language model (RMSNorm, SwiGLU, rotary grouped-query attention), with
softmax attention, causal TSSA, or a hybrid of the two per layer (:class:`DecoderLM`)."""
from .attention import RotaryCausalAttention
from .layers import RMSNorm, SwiGLU
from .model import DecoderBlock, DecoderLM

__all__ = ["DecoderLM", "DecoderBlock", "RotaryCausalAttention", "RMSNorm", "SwiGLU"]
