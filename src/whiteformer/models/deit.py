"""timm-compatible ViT / DeiT (Dosovitskiy et al., 2021; Touvron et al., 2021).

The state_dict keys and shapes are those of timm's ``VisionTransformer`` (``cls_token``,
``pos_embed``, ``patch_embed.proj``, ``blocks.{i}.norm1|attn.qkv|attn.proj|norm2|mlp.fc1|mlp.fc2``,
``norm``, ``head``), so timm / official DeiT checkpoints load unchanged. Every block's attention is
an :class:`~whiteformer.attention.baselines.MHSA` at ``blocks[i].attn`` (with ``num_heads``), the
target of the compression toolkit. Block::

    x = x + drop_path(ls1(attn(norm1(x))))
    x = x + drop_path(ls2(mlp(norm2(x))))

LayerNorm eps 1e-6 (``norm_eps``), ``qkv_bias=True``, class token + learned position embedding (1, 1 + N, D).
A checkpoint whose position-embedding grid differs from the model's is resampled (bicubic, with
antialiasing, :func:`whiteformer.layers.resample_abs_pos_embed`, as timm's) by
:meth:`VisionTransformer.convert_state_dict`.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Set

import torch
import torch.nn as nn

from .. import attention as _attention
from .._checks import (
    check_divisible,
    check_finite_real,
    check_int,
    check_keep_softmax,
    check_positive_real,
    check_probability,
)
from ..attention.baselines import MHSA
from ..layers import DropPath, GradCheckpointMixin, LayerScale, Mlp, PatchGrid, TimmFeatureMixin, resample_abs_pos_embed
from ._head import set_head_args
from .formats.vit_weights import convert_hf_vit_state_dict, is_hf_vit_state_dict
from .registry import apply_structure, build_with_defaults, register_model
from .save import PretrainedMixin
from .vision import SOFTMAX_ATTN, _attention_kwargs, check_attn_args

__all__ = ["VisionTransformer", "PatchEmbed", "Block"]


class PatchEmbed(PatchGrid):
    """Image to patch tokens with a strided conv ``proj`` (timm ``PatchEmbed``).

    (B, C, H, W) with (H, W) == ``img_size`` -> (B, N, D), N = ``num_patches``.
    """

    def __init__(self, img_size=224, patch_size=16, in_chans: int = 3, embed_dim: int = 768,
                 dynamic_img_size: bool = False, dynamic_img_pad: bool = False):
        super().__init__(img_size, patch_size, in_chans, dynamic_img_size, dynamic_img_pad)
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=self.patch_size, stride=self.patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.check_images(x)
        return self.proj(x).flatten(2).transpose(1, 2)


class Block(nn.Module):
    """timm's ``Block`` (DeiT's keys ``norm1``, ``attn``, ``ls1.gamma``, ``norm2``, ``mlp``, ``ls2.gamma``): pre-LN
    MHSA (or the registered attention ``attn``) and MLP residual branches with optional layer scale. The generic block with any attention is
    :class:`whiteformer.layers.ViTBlock`."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 init_values: Optional[float] = None, proj_drop: float = 0.0, attn_drop: float = 0.0,
                 drop_path: float = 0.0, norm_eps: float = 1e-6, attn: str = SOFTMAX_ATTN):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        if attn == SOFTMAX_ATTN:
            self.attn = MHSA(dim, num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop)
        else:  # another registered attention in the same slot (a linearized ViT: "tssa")
            self.attn = _attention.build(attn, dim, num_heads=num_heads,
                                         **_attention_kwargs(attn, qkv_bias, attn_drop, proj_drop, None))
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU, drop=proj_drop)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask)))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class VisionTransformer(GradCheckpointMixin, TimmFeatureMixin, PretrainedMixin, nn.Module):
    """ViT / DeiT classifier with timm's ``VisionTransformer`` state_dict and protocol
    (``forward_features``, ``forward_head``, ``reset_classifier``, ``no_weight_decay``, and the
    feature API of :class:`~whiteformer.layers.TimmFeatureMixin`: ``forward_intermediates``,
    ``prune_intermediate_layers``, ``group_matcher``, ``pretrained_cfg``).

    Args (timm names): img_size, patch_size, in_chans, num_classes (0: no head), global_pool
    ('token' or 'avg'; 'avg' uses ``fc_norm`` after pooling instead of ``norm``, as timm),
    embed_dim, depth, num_heads, mlp_ratio, qkv_bias, init_values (layer scale; None: off),
    drop_rate (head dropout), pos_drop_rate, proj_drop_rate, attn_drop_rate, drop_path_rate
    (linearly increasing over blocks), compression (per-block specs of a model compressed by
    :func:`whiteformer.compress.compress`, recorded in its checkpoint; None: plain ViT), norm_eps
    (LayerNorm epsilon: 1e-6 as timm; 1e-12 for checkpoints from transformers' ViT),
    dynamic_img_size / dynamic_img_pad (timm's: other input sizes, the position embedding resized
    to each input's grid; padding up to a multiple of the patch size), attn (the blocks' attention,
    a registered name: ``"mhsa"``, timm's softmax attention, or e.g. ``"tssa"`` for a ViT
    linearized by :func:`whiteformer.convert.linearize`), keep_softmax (with another ``attn``: the
    blocks that keep softmax attention, a hybrid).
    Shapes: images (B, in_chans, H, W) with (H, W) = img_size (any multiple of the patch size with
    dynamic_img_size) -> logits (B, num_classes).
    """

    hf_model_type = "whiteformer-vision"
    model_kind = "image classifier"
    head_modules = ("fc_norm",)

    def __init__(self, img_size=224, patch_size=16, in_chans: int = 3, num_classes: int = 1000,
                 global_pool: str = "token", embed_dim: int = 768, depth: int = 12, num_heads: int = 12,
                 mlp_ratio: float = 4.0, qkv_bias: bool = True, init_values: Optional[float] = None,
                 drop_rate: float = 0.0, pos_drop_rate: float = 0.0, proj_drop_rate: float = 0.0,
                 attn_drop_rate: float = 0.0, drop_path_rate: float = 0.0, compression: Optional[dict] = None,
                 norm_eps: float = 1e-6, dynamic_img_size: bool = False, dynamic_img_pad: bool = False,
                 attn: str = SOFTMAX_ATTN, keep_softmax: Optional[Sequence[int]] = None):
        super().__init__()
        set_head_args(self, num_classes, global_pool)
        check_int(depth, "depth", 0)
        check_attn_args(attn, None)
        self.attn_name = attn
        self.keep_softmax = check_keep_softmax(keep_softmax, depth, attn, "attn", SOFTMAX_ATTN)
        check_divisible(embed_dim, num_heads, "embed_dim")
        for name, val in (("drop_rate", drop_rate), ("pos_drop_rate", pos_drop_rate),
                          ("proj_drop_rate", proj_drop_rate), ("attn_drop_rate", attn_drop_rate),
                          ("drop_path_rate", drop_path_rate)):
            check_probability(val, name)
        init_values = check_finite_real(init_values, "init_values", allow_none=True)
        mlp_ratio = check_positive_real(mlp_ratio, "mlp_ratio")
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, dynamic_img_size, dynamic_img_pad)
        self.fixed_input_size = not dynamic_img_size
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + 1, embed_dim))
        self.pos_drop = nn.Dropout(pos_drop_rate)
        # linearly increasing stochastic depth (torch.linspace(0, rate, depth) as timm)
        dpr = [drop_path_rate * i / (depth - 1) if depth > 1 else 0.0 for i in range(depth)]
        self.blocks = nn.Sequential(*[
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias, init_values, proj_drop_rate, attn_drop_rate, dpr[i],
                  norm_eps, SOFTMAX_ATTN if i in self.keep_softmax else attn)
            for i in range(depth)])
        use_fc_norm = global_pool == "avg"
        self.norm = nn.Identity() if use_fc_norm else nn.LayerNorm(embed_dim, eps=norm_eps)
        self.fc_norm = nn.LayerNorm(embed_dim, eps=norm_eps) if use_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        if compression is not None:  # compressed blocks (whiteformer.compress), rebuilt before loading weights
            apply_structure(self, "compression", compression)
        self._init_weights()

    def _init_weights(self) -> None:
        """timm's default ('') init: pos_embed trunc-normal 0.02, cls_token normal 1e-6, Linear
        trunc-normal 0.02 with zero bias; conv and LayerNorm keep PyTorch's defaults."""
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return {"pos_embed", "cls_token"}

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """New (re-initialised) head for ``num_classes`` (0: identity); ``global_pool`` 'token'
        or 'avg' switches the pooling (the norms are left as built, as timm)."""
        set_head_args(self, num_classes, global_pool)
        w = self.pos_embed
        if num_classes > 0:
            self.head = nn.Linear(self.embed_dim, num_classes, device=w.device, dtype=w.dtype)
            nn.init.trunc_normal_(self.head.weight, std=0.02)
            nn.init.zeros_(self.head.bias)
        else:
            self.head = nn.Identity()

    def _embed_grid(self, x: torch.Tensor):
        """Images -> ([CLS; patches] + pos_embed (B, 1 + N, D), grid (Hp, Wp))."""
        grid = self.patch_embed.input_grid(x)
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.pos_drop(x + self.patch_embed.pos_embed_for(self.pos_embed, grid)), grid

    def _finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> normalised tokens (B, 1 + N, D) (class token first)."""
        x, _ = self._embed_grid(x)
        for blk in self.blocks:
            x = self.run_block(blk, x)
        return self._finish(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens (B, 1 + N, D) -> logits (B, num_classes) (or pooled features if ``pre_logits``)."""
        x = x[:, self.num_prefix_tokens:].mean(dim=1) if self.global_pool == "avg" else x[:, 0]
        x = self.head_drop(self.fc_norm(x))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def convert_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """timm / official DeiT state_dicts have this model's keys; transformers ViT / DeiT ones are
        converted (:mod:`whiteformer.models.formats.vit_weights`); a position embedding on another grid is
        resampled to ``patch_embed.grid_size`` (bicubic + antialias, as timm)."""
        out = dict(state_dict)
        if is_hf_vit_state_dict(out):
            out = convert_hf_vit_state_dict(out)
        pe = out.get("pos_embed")
        if isinstance(pe, torch.Tensor) and pe.dim() == 3 and pe.shape[1] != self.pos_embed.shape[1]:
            out["pos_embed"] = resample_abs_pos_embed(pe, self.patch_embed.grid_size,
                                                      num_prefix_tokens=self.num_prefix_tokens)
        return out


def _deit(defaults: dict, kwargs: dict) -> VisionTransformer:
    return build_with_defaults(VisionTransformer, dict(patch_size=16, **defaults), kwargs)


@register_model
def vit(**kwargs) -> VisionTransformer:
    """ViT of any size in timm's layout (defaults: ViT-B/16, D 768, 12 blocks, 12 heads); transformers
    ViT / DeiT checkpoints whose sizes match no ``deit_*`` preset load under this name."""
    return build_with_defaults(VisionTransformer, {}, kwargs)


@register_model
def deit_t_p16(**kwargs) -> VisionTransformer:
    """DeiT-Tiny/16 (timm ``deit_tiny_patch16_224``): D 192, 12 blocks, 3 heads, 5.7M params."""
    return _deit(dict(embed_dim=192, depth=12, num_heads=3), kwargs)


@register_model
def deit_s_p16(**kwargs) -> VisionTransformer:
    """DeiT-Small/16 (timm ``deit_small_patch16_224``): D 384, 12 blocks, 6 heads, 22.1M params."""
    return _deit(dict(embed_dim=384, depth=12, num_heads=6), kwargs)


@register_model
def deit_b_p16(**kwargs) -> VisionTransformer:
    """DeiT-Base/16 (timm ``deit_base_patch16_224``): D 768, 12 blocks, 12 heads, 86.6M params."""
    return _deit(dict(embed_dim=768, depth=12, num_heads=12), kwargs)
