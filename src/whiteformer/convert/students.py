"""The teachers :func:`~whiteformer.convert.linearize` takes, and how each becomes its TSSA student.

A :class:`Family` says, for one kind of softmax teacher, where its attention layers are, which
model its student is (the same shell with TSSA outside ``keep_softmax``, every other weight the
teacher's), how a TSSA layer starts from the teacher's projections, what a batch is and what the
task loss of stage 2 is:

- :class:`DecoderFamily`: the Llama-style :class:`~whiteformer.models.decoder.DecoderLM`
  (``decoder_base``; ``from_transformers`` of Llama / Qwen2 / Mistral) -> ``tost_decoder_base``;
- :class:`GPTFamily`: the GPT shell :class:`~whiteformer.models.lm.GPTLM` (``gpt_*``;
  ``from_transformers`` of GPT-2) -> ``tost_gpt_base`` (:class:`~whiteformer.models.hybrid_lm.HybridGPTLM`);
- :class:`VisionFamily`: the timm-layout ViT / DeiT (``vit``, ``deit_*``; ``from_transformers``
  of ``ViTForImageClassification``) and the ToST vision shell with softmax attention
  (``vit_cab_*``, or any ``tost_*`` built with ``attn="mhsa"``) -> the same shell with ``attn="tssa"``.

Language-model batches: a (B, T) integer tensor of token ids (targets: the ids shifted), or a dict
with ``idx`` (B, T), optional ``targets`` (B, T) (``-1`` ignored) and optional ``cu_seqlens`` (S + 1,)
for packed documents in idx (1, T). Vision batches: images (B, C, H, W) (float; no labels: stage 2
is the KL alone), an ``(images, labels)`` pair, or a dict with ``images`` and optional ``labels`` (B,)
class indices.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models import create_model
from ..models.decoder import DecoderLM
from ..models.deit import VisionTransformer
from ..models.lm import GPTLM
from ..models.vision import SOFTMAX_ATTN, ToSTVision

__all__ = ["Family", "DecoderFamily", "GPTFamily", "VisionFamily", "family_of", "TEACHERS"]

#: what :func:`family_of` accepts, as its error message says it
TEACHERS = ("a softmax DecoderLM (decoder_base; from_transformers of Llama / Qwen2 / Mistral), a GPTLM (gpt_*; "
            "from_transformers of GPT-2), a softmax ViT / DeiT (vit, deit_*; from_transformers of "
            "ViTForImageClassification) or a ToST vision model with attn='mhsa' (vit_cab_*)")


def _copy_rows(dst: nn.Linear, src: nn.Linear, part: int) -> None:
    """``dst`` (D -> D) <- rows ``part`` (0 queries, 2 values) of the fused ``src`` (D -> 3D, layout (3, H, p))."""
    d = dst.weight.shape[0]
    dst.weight.copy_(src.weight[part * d:(part + 1) * d])
    if dst.bias is not None and src.bias is not None:
        dst.bias.copy_(src.bias[part * d:(part + 1) * d])


class Family:
    """How :func:`~whiteformer.convert.linearize` handles one kind of teacher (see the module docstring)."""

    kind = ""  # "language model" or "image classifier"

    def __init__(self, teacher: nn.Module):
        self.teacher = teacher

    # ---- structure ----------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        return len(self.blocks(self.teacher))

    def blocks(self, model: nn.Module) -> nn.ModuleList:  # pragma: no cover - abstract
        raise NotImplementedError

    def prefix(self, i: int) -> str:  # pragma: no cover - abstract
        """The state-dict prefix of block ``i``'s attention (``"transformer.h.3.attn."``)."""
        raise NotImplementedError

    def attn(self, model: nn.Module, i: int) -> nn.Module:
        return self.blocks(model)[i].attn

    def check_init(self, init: str) -> None:
        """A ValueError when ``init`` cannot copy this teacher's projections."""

    # ---- the student --------------------------------------------------------------------------
    def build(self, keep: List[int]) -> nn.Module:  # pragma: no cover - abstract
        """The student's shell (random weights)."""
        raise NotImplementedError

    def init_layer(self, src: nn.Module, dst: nn.Module, init: str) -> None:
        """Block ``dst`` (TSSA) from the teacher's softmax layer ``src``: "vo" the values and the
        output, "qk" the queries (the fused (3, H, p) ``qkv`` of the GPT and vision shells)."""
        if init == "vo":
            _copy_rows(dst.qkv, src.qkv, 2)
            dst.proj.load_state_dict(src.proj.state_dict())
        elif init == "qk":
            _copy_rows(dst.qkv, src.qkv, 0)

    def student(self, keep: List[int], init: str, seed: int) -> nn.Module:
        """The teacher's shell with TSSA outside ``keep``: every other weight copied, each TSSA layer
        initialised by ``init`` from the teacher's projections."""
        teacher = self.teacher
        torch.manual_seed(seed)
        ref = next(teacher.parameters())
        student = self.build(keep).to(ref.device, ref.dtype)
        theirs, mine = teacher.state_dict(), student.state_dict()
        tssa = [i for i in range(self.depth) if i not in keep]
        own = {k: v for k, v in theirs.items() if k in mine and mine[k].shape == v.shape
               and not any(k.startswith(self.prefix(i)) for i in tssa)}
        student.load_state_dict(own, strict=False)
        with torch.no_grad():
            for i in tssa:
                self.init_layer(self.attn(teacher, i), self.attn(student, i), init)
        return student

    # ---- data ---------------------------------------------------------------------------------
    def split(self, batch: Any, device: torch.device) -> Dict[str, Any]:  # pragma: no cover - abstract
        """A batch (see the module docstring), checked -> a dict of tensors on ``device``."""
        raise NotImplementedError

    def logits(self, model: nn.Module, b: Dict[str, Any]) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def loss(self, model: nn.Module, b: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover
        """``(logits, task loss)`` of stage 2 (next-token or classification cross-entropy)."""
        raise NotImplementedError


# ---- language models -----------------------------------------------------------------------------
class _LMFamily(Family):
    kind = "language model"

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        return model.transformer.h

    def prefix(self, i: int) -> str:
        return f"transformer.h.{i}.attn."

    def split(self, batch: Any, device: torch.device) -> Dict[str, Any]:
        vocab_size = self.teacher.vocab_size
        if isinstance(batch, torch.Tensor):
            idx, targets, cu = batch, None, None
        elif isinstance(batch, Mapping) and "idx" in batch:
            idx, targets, cu = batch["idx"], batch.get("targets"), batch.get("cu_seqlens")
        else:
            raise TypeError(f"batches of a language-model teacher must hold (B, T) token-id tensors or dicts with "
                            f"'idx', got {type(batch).__name__}")
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype.is_floating_point or idx.shape[1] < 2:
            raise ValueError(f"batches must hold integer token ids of shape (B, T) with T >= 2, got "
                             f"{getattr(idx, 'shape', idx)!r}")
        if targets is None:
            targets = torch.cat([idx[:, 1:], idx.new_full((idx.shape[0], 1), -1)], dim=1)
        if idx.numel() and not 0 <= int(idx.min()) <= int(idx.max()) < vocab_size:
            raise ValueError(f"batches hold token ids in [{int(idx.min())}, {int(idx.max())}], outside the teacher's "
                             f"vocabulary [0, {vocab_size})")
        return {"idx": idx.to(device), "targets": targets.to(device),
                "cu_seqlens": None if cu is None else cu.to(device)}

    def logits(self, model: nn.Module, b: Dict[str, Any]) -> torch.Tensor:
        return model(b["idx"], cu_seqlens=b["cu_seqlens"])[0]

    def loss(self, model: nn.Module, b: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
        return model(b["idx"], b["targets"], cu_seqlens=b["cu_seqlens"])


class DecoderFamily(_LMFamily):
    """:class:`~whiteformer.models.decoder.DecoderLM` -> ``tost_decoder_base``: ``init="vo"`` copies
    the value projection (each key/value head repeated for the query heads it serves) and the output
    projection, ``"qk"`` the query projection."""

    def check_init(self, init: str) -> None:
        t = self.teacher
        if init != "random" and t.num_heads * t.head_dim != t.dim:
            raise ValueError(f"init={init!r} copies the teacher's projections into TSSA's (dim x dim) ones, which "
                             f"needs num_heads * head_dim == dim ({t.num_heads} * {t.head_dim} != {t.dim}); "
                             "use init='random'")

    def build(self, keep: List[int]) -> nn.Module:
        return create_model("tost_decoder_base",
                            **{**self.teacher.init_kwargs, "attention": "tssa", "keep_softmax": keep})

    def init_layer(self, src: nn.Module, dst: nn.Module, init: str) -> None:
        t = self.teacher
        groups = t.num_heads // t.num_kv_heads
        if init == "vo":
            w = src.v_proj.weight.view(t.num_kv_heads, t.head_dim, -1)
            dst.qkv.weight.copy_(w.repeat_interleave(groups, dim=0).reshape_as(dst.qkv.weight))
            if src.v_proj.bias is not None:
                b = src.v_proj.bias.view(t.num_kv_heads, t.head_dim)
                dst.qkv.bias.copy_(b.repeat_interleave(groups, dim=0).reshape(-1))
            dst.proj.load_state_dict(src.proj.state_dict())
        elif init == "qk":
            dst.qkv.load_state_dict(src.q_proj.state_dict())


class GPTFamily(_LMFamily):
    """:class:`~whiteformer.models.lm.GPTLM` (GPT-2 imported, or ``gpt_*``) -> ``tost_gpt_base`` with
    the teacher's sizes, ``mlp_act``, biases and layer scales."""

    def build(self, keep: List[int]) -> nn.Module:
        return create_model("tost_gpt_base", **{**self.teacher.init_kwargs, "keep_softmax": keep})


# ---- vision --------------------------------------------------------------------------------------
class VisionFamily(Family):
    """A softmax ViT / DeiT (timm layout) or ToST vision shell -> the same shell with ``attn="tssa"``
    outside ``keep_softmax``; the ToST shell's class-attention head is kept as it is."""

    kind = "image classifier"

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        return model.blocks

    def prefix(self, i: int) -> str:
        return f"blocks.{i}.attn."

    def build(self, keep: List[int]) -> nn.Module:
        kwargs = {**self.teacher.init_kwargs, "attn": "tssa", "keep_softmax": keep}
        if isinstance(self.teacher, ToSTVision):
            return create_model("tost_t12_p16", **{**kwargs, "attn_kwargs": None})
        return create_model(self.teacher.model_name or "vit", **kwargs)

    def split(self, batch: Any, device: torch.device) -> Dict[str, Any]:
        labels: Optional[torch.Tensor] = None
        if isinstance(batch, torch.Tensor):
            images = batch
        elif isinstance(batch, (tuple, list)) and len(batch) == 2:
            images, labels = batch
        elif isinstance(batch, Mapping) and "images" in batch:
            images, labels = batch["images"], batch.get("labels")
        else:
            raise TypeError(f"batches of an image-classifier teacher must hold images (B, C, H, W), (images, labels) "
                            f"pairs or dicts with 'images', got {type(batch).__name__}")
        if not isinstance(images, torch.Tensor) or images.dim() != 4 or not images.dtype.is_floating_point:
            raise ValueError(f"batches must hold float images of shape (B, C, H, W), got "
                             f"{getattr(images, 'shape', type(images).__name__)!r}")
        if labels is not None:
            classes = self.teacher.num_classes
            if not isinstance(labels, torch.Tensor) or labels.shape != images.shape[:1] \
                    or labels.dtype.is_floating_point or labels.dtype == torch.bool:
                raise ValueError(f"labels must be an integer tensor of shape ({images.shape[0]},), got "
                                 f"{getattr(labels, 'shape', type(labels).__name__)!r}")
            if labels.numel() and not 0 <= int(labels.min()) <= int(labels.max()) < classes:
                raise ValueError(f"labels hold classes in [{int(labels.min())}, {int(labels.max())}], outside the "
                                 f"teacher's [0, {classes})")
            labels = labels.to(device)
        return {"images": images.to(device, next(self.teacher.parameters()).dtype), "labels": labels}

    def logits(self, model: nn.Module, b: Dict[str, Any]) -> torch.Tensor:
        return model(b["images"])

    def loss(self, model: nn.Module, b: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
        logits = model(b["images"])
        if b["labels"] is None:
            return logits, logits.new_zeros(())
        return logits, F.cross_entropy(logits.float(), b["labels"])


def family_of(teacher: Any) -> Family:
    """The :class:`Family` of a softmax ``teacher`` (ValueError naming what is accepted otherwise)."""
    if isinstance(teacher, DecoderLM) and teacher.attention == "softmax":
        return DecoderFamily(teacher)
    if isinstance(teacher, GPTLM):
        return GPTFamily(teacher)
    if isinstance(teacher, VisionTransformer) and teacher.attn_name == SOFTMAX_ATTN \
            and teacher.init_kwargs.get("compression") is None:
        return VisionFamily(teacher)
    if isinstance(teacher, ToSTVision) and teacher.attn_name == SOFTMAX_ATTN:
        return VisionFamily(teacher)
    what = type(teacher).__name__
    for attr in ("attention", "attn_name"):
        if getattr(teacher, attr, None) is not None:
            what += f" with {attr.replace('_name', '')}={getattr(teacher, attr)!r}"
    raise ValueError(f"teacher must be {TEACHERS}, got {what}")
