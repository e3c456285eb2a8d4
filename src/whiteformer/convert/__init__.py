"""Converting pretrained transformers into whiteformer models.

:func:`from_transformers`: a transformers GPT-2, Llama, Qwen2 or Mistral causal language model (an
object or its ``save_pretrained`` folder) -> the equivalent whiteformer model with softmax
attention, the same logits (see docs/convert.md).

:func:`linearize`: a softmax teacher -> its TSSA (or hybrid) student, by attention transfer and
fine-tuning with KL to the teacher: a decoder or GPT-2 language model (causal TSSA) or a ViT / DeiT
image classifier (:mod:`whiteformer.convert.students` says how each becomes its student).
"""
from .linearize import LinearizeResult, linearize
from .transformers import SUPPORTED_MODEL_TYPES, from_transformers

__all__ = ["from_transformers", "SUPPORTED_MODEL_TYPES", "linearize", "LinearizeResult"]
