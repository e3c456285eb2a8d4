"""Converting pretrained transformers into whiteformer models.

:func:`from_transformers`: a transformers GPT-2, Llama, Qwen2 or Mistral causal language model (an
object or its ``save_pretrained`` folder) -> the equivalent whiteformer model with softmax
attention, the same logits (see docs/convert.md).

:func:`linearize`: a softmax decoder -> its causal TSSA (or hybrid) student, by attention transfer
and fine-tuning with KL to the teacher.
"""
from .linearize import LinearizeResult, linearize
from .transformers import SUPPORTED_MODEL_TYPES, from_transformers

__all__ = ["from_transformers", "SUPPORTED_MODEL_TYPES", "linearize", "LinearizeResult"]
