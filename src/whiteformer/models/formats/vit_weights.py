"""Hugging Face ``transformers`` ViT / DeiT checkpoints into the timm-layout ``deit_*`` models.

``ViTForImageClassification`` / ``DeiTForImageClassification`` (and the bare ``ViTModel`` /
``DeiTModel``) state dicts, in the layout ``save_pretrained`` writes
(``vit.encoder.layer.{i}.attention.attention.query``, ...) or the one recent ``transformers`` keep
in memory (``vit.layers.{i}.attention.q_proj``, ...), map onto
:class:`~whiteformer.models.deit.VisionTransformer`:

==========================================================  ==========================
transformers                                                 timm / whiteformer
==========================================================  ==========================
``embeddings.cls_token`` / ``position_embeddings``           ``cls_token`` / ``pos_embed``
``embeddings.patch_embeddings.projection``                   ``patch_embed.proj``
``query`` | ``key`` | ``value`` (``q_proj`` | ...)            ``blocks.i.attn.qkv`` (rows q, k, v)
``attention.output.dense`` (``o_proj``)                      ``blocks.i.attn.proj``
``intermediate.dense`` / ``output.dense`` (``mlp.fc1/2``)    ``blocks.i.mlp.fc1`` / ``fc2``
``layernorm_before`` / ``layernorm_after``                   ``blocks.i.norm1`` / ``norm2``
``layernorm`` / ``classifier``                               ``norm`` / ``head``
==========================================================  ==========================

Both models compute ``x + attn(LN(x))``, ``x + mlp(LN(x))`` with exact GELU and classify the
final-normed class token, so with the configuration's ``layer_norm_eps`` (1e-12 in
``transformers``, 1e-6 in timm) the logits agree. DeiT's distillation token takes part in every
attention layer, which ``deit_*`` models do not have: such checkpoints are refused.
"""
from __future__ import annotations

import re
from typing import Any, Dict, Mapping, Optional

import torch

__all__ = ["HF_VIT_MODEL_TYPES", "is_hf_vit_config", "is_hf_vit_state_dict", "init_kwargs_from_config",
           "convert_hf_vit_state_dict", "model_name_for", "describe_sizes"]

HF_VIT_MODEL_TYPES = ("vit", "deit")
#: the deit_* presets (embed_dim, depth, num_heads; patch 16, MLP ratio 4); other sizes are "vit"
_PRESETS = {"deit_t_p16": (192, 12, 3), "deit_s_p16": (384, 12, 6), "deit_b_p16": (768, 12, 12)}


def model_name_for(init_kwargs: Mapping[str, Any]) -> str:
    """The registry name of a timm-layout ViT with these constructor arguments: the ``deit_*`` preset
    of its sizes, else ``"vit"`` (any size; every size is in ``init_kwargs``)."""
    sizes = (init_kwargs.get("embed_dim"), init_kwargs.get("depth"), init_kwargs.get("num_heads"))
    patch = init_kwargs.get("patch_size", 16)
    if patch in (16, (16, 16), [16, 16]) and init_kwargs.get("mlp_ratio", 4.0) == 4.0:
        for name, preset in _PRESETS.items():
            if sizes == preset:
                return name
    return "vit"


def describe_sizes(init_kwargs: Mapping[str, Any]) -> str:
    """``"D 64, 2 blocks, 4 heads, patch 8, 32 px"`` (what a ViT's name alone may not say)."""
    img = init_kwargs.get("img_size")
    img = f"{img[0]}x{img[1]}" if isinstance(img, (tuple, list)) and img[0] != img[1] else \
        (img[0] if isinstance(img, (tuple, list)) else img)
    patch = init_kwargs.get("patch_size")
    patch = patch[0] if isinstance(patch, (tuple, list)) and patch[0] == patch[1] else patch
    return (f"D {init_kwargs.get('embed_dim')}, {init_kwargs.get('depth')} blocks, {init_kwargs.get('num_heads')} "
            f"heads, patch {patch}, {img} px")

_BLOCK = {  # transformers block sub-key (both layouts) -> timm sub-key
    "attention.output.dense": "attn.proj", "attention.o_proj": "attn.proj",
    "intermediate.dense": "mlp.fc1", "output.dense": "mlp.fc2", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2",
    "layernorm_before": "norm1", "layernorm_after": "norm2",
}
_QKV = {"attention.attention.query": 0, "attention.attention.key": 1, "attention.attention.value": 2,
        "attention.q_proj": 0, "attention.k_proj": 1, "attention.v_proj": 2}
_TOP = {"embeddings.cls_token": "cls_token", "embeddings.position_embeddings": "pos_embed",  # outside the blocks
        "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
        "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
        "layernorm.weight": "norm.weight", "layernorm.bias": "norm.bias",
        "classifier.weight": "head.weight", "classifier.bias": "head.bias"}
_BLOCK_KEY = re.compile(r"^(?:encoder\.layer|layers)\.(\d+)\.(.+)\.(weight|bias)$")


def is_hf_vit_config(config: Optional[Mapping[str, Any]]) -> bool:
    return bool(config) and config.get("model_type") in HF_VIT_MODEL_TYPES


def _prefix(state_dict: Mapping[str, Any]) -> Optional[str]:
    for key in state_dict:
        if key.endswith("embeddings.patch_embeddings.projection.weight"):
            return key[: -len("embeddings.patch_embeddings.projection.weight")]
    return None


def is_hf_vit_state_dict(state_dict: Mapping[str, Any]) -> bool:
    """True for a transformers ViT / DeiT state dict (with or without the ``vit.`` / ``deit.`` prefix)."""
    return _prefix(state_dict) is not None


def init_kwargs_from_config(config: Mapping[str, Any]) -> Dict[str, Any]:
    """``VisionTransformer`` constructor arguments from a transformers ``ViTConfig`` / ``DeiTConfig``
    dict (``config.json``)."""
    if config.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"transformers ViT config has hidden_act={config.get('hidden_act')!r}; deit_* models use "
                         "exact GELU ('gelu')")
    hidden = int(config.get("hidden_size", 768))
    kwargs: Dict[str, Any] = dict(
        embed_dim=hidden, depth=int(config.get("num_hidden_layers", 12)),
        num_heads=int(config.get("num_attention_heads", 12)),
        mlp_ratio=int(config.get("intermediate_size", 4 * hidden)) / hidden,
        img_size=config.get("image_size", 224), patch_size=config.get("patch_size", 16),
        in_chans=int(config.get("num_channels", 3)), qkv_bias=bool(config.get("qkv_bias", True)),
        norm_eps=float(config.get("layer_norm_eps", 1e-12)))
    if any(a.endswith("ForImageClassification") for a in config.get("architectures") or []) and config.get("id2label"):
        kwargs["num_classes"] = len(config["id2label"])
    return kwargs


def convert_hf_vit_state_dict(state_dict: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A transformers ViT / DeiT state dict -> timm ``VisionTransformer`` keys (see the module
    docstring). Raises ``ValueError`` for a DeiT distillation checkpoint and for unknown keys."""
    prefix = _prefix(state_dict)
    if prefix is None:
        raise ValueError("not a transformers ViT/DeiT state dict (no embeddings.patch_embeddings.projection.weight)")
    if f"{prefix}embeddings.distillation_token" in state_dict:
        raise ValueError(
            "this transformers DeiT checkpoint has a distillation token (DeiTForImageClassification[WithTeacher]); "
            "it takes part in every attention layer and deit_* models (timm VisionTransformer) have no such token, "
            "so the logits could not match. Convert a checkpoint without distillation (e.g. ViTForImageClassification)")
    out: Dict[str, torch.Tensor] = {}
    qkv: Dict[tuple, Dict[int, torch.Tensor]] = {}
    for key, val in state_dict.items():
        own = key.startswith(prefix) or key.startswith(("classifier.", "cls_classifier.", "distillation_classifier."))
        sub = key[len(prefix):] if key.startswith(prefix) else key if own else ""  # "": an unexpected key
        block = _BLOCK_KEY.match(sub)
        i, name, kind = block.groups() if block else (None, None, None)
        if name in _QKV:
            qkv.setdefault((i, kind), {})[_QKV[name]] = val
        elif not sub.startswith(("pooler.", "embeddings.mask_token")):  # ViTModel's pooler / MIM token: unused
            target = f"blocks.{i}.{_BLOCK[name]}.{kind}" if name in _BLOCK else None if block else _TOP.get(sub)
            if target is None:
                raise ValueError(f"unexpected key {key!r} in a transformers ViT/DeiT state dict")
            out[target] = val
    for (i, kind), parts in qkv.items():
        if sorted(parts) != [0, 1, 2]:
            raise ValueError(f"block {i}: the transformers checkpoint lacks some of query/key/value {kind}")
        out[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat([parts[0], parts[1], parts[2]], dim=0)
    return out
