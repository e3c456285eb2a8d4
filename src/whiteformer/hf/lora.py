"""Default LoRA targets of whiteformer models for ``peft``.

``peft`` looks up the modules to adapt by ``config.model_type`` when a ``LoraConfig`` has no
``target_modules`` (its ``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``); whiteformer adds its
families to that table when ``peft`` is imported, so ``get_peft_model(model, LoraConfig(r=8))``
works on the :mod:`whiteformer.hf` wrappers. A target is a module-name suffix:

- language models (``whiteformer-tost-lm``, ``whiteformer-gpt``): every block's attention input
  ``attn.qkv`` and output ``attn.proj`` projections and its MLP ``mlp.c_fc``, ``mlp.c_proj``;
- the decoder (``whiteformer-decoder``): the softmax layers' ``attn.q_proj``, ``k_proj``, ``v_proj``,
  the TSSA layers' ``attn.qkv``, every layer's ``attn.proj`` and the SwiGLU's ``mlp.gate_proj``,
  ``up_proj``, ``down_proj``;
- vision (``whiteformer-vision``): ``attn.qkv``, ``attn.proj`` (``attn.to_out.0`` in CRATE),
  ``mlp.fc1``, ``mlp.fc2`` of the blocks and of ToST's class-attention blocks. ECAttention has no
  linear layer (its subspace bases are parameters), so on ECA models only the class-attention
  blocks are adapted; the classifier ``head`` is not a target (``modules_to_save=["head"]`` trains
  a new one).
"""
from __future__ import annotations

from typing import Dict, List

__all__ = ["LORA_TARGET_MODULES", "register_with_peft"]

LORA_TARGET_MODULES: Dict[str, List[str]] = {
    "whiteformer-tost-lm": ["attn.qkv", "attn.proj", "mlp.c_fc", "mlp.c_proj"],
    "whiteformer-gpt": ["attn.qkv", "attn.proj", "mlp.c_fc", "mlp.c_proj"],
    "whiteformer-decoder": ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.qkv", "attn.proj", "mlp.gate_proj",
                            "mlp.up_proj", "mlp.down_proj"],
    "whiteformer-vision": ["attn.qkv", "attn.proj", "attn.to_out.0", "mlp.fc1", "mlp.fc2"],
}


def register_with_peft() -> None:
    """Add :data:`LORA_TARGET_MODULES` to ``peft``'s LoRA table (an entry already there is kept)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as table

    for model_type, targets in LORA_TARGET_MODULES.items():
        table.setdefault(model_type, list(targets))
