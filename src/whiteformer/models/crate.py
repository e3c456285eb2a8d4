"""CRATE: white-box transformer by sparse rate reduction (Yu et al., NeurIPS 2023).

Each layer is one step of compression then sparsification of the token representation
(CRATE Eqs. (9) and (17))::

    z = x + MSSA(LN(x))          # compression against the subspaces (multi-head subspace SA)
    x = ISTA(LN(z))              # one ISTA step on a sparse-coding LASSO; no residual around it

with ``ISTA(z) = relu(z + eta (D^T z - D^T D z) - eta lambda)`` (eta = lambda = 0.1).
Shell as the official ``model/crate.py``: patches flattened as ``(p1 p2 c)``, LayerNorm(patch) ->
Linear -> LayerNorm, class token, learned position embedding (1, 1 + N, D), head = LayerNorm +
Linear on the pooled token (class token, or mean over all tokens for ``global_pool='avg'``).
:meth:`CRATE.convert_state_dict` reads the official key names.
"""
from __future__ import annotations

import re
from typing import Dict, Optional, Set

import torch
import torch.nn as nn
from einops import rearrange

from .._checks import check_finite_real, check_int, check_probability
from ..attention.baselines import MSSA
from ..layers import GradCheckpointMixin, PatchGrid, TimmFeatureMixin, resample_abs_pos_embed
from ..layers.mlp import ISTA
from ._head import set_head_args
from .registry import build_with_defaults, register_model
from .save import PretrainedMixin

__all__ = ["CRATE", "CRATEBlock", "CRATEPatchEmbed"]


class CRATEPatchEmbed(PatchGrid):
    """Non-overlapping patches flattened in the official ``(p1 p2 c)`` order, then
    ``patch_norm`` (LayerNorm over p*p*C) -> ``proj`` (Linear to D) -> ``norm`` (LayerNorm).

    (B, C, H, W) with (H, W) == ``img_size`` -> (B, N, D).
    """

    def __init__(self, img_size=224, patch_size=16, in_chans: int = 3, embed_dim: int = 384,
                 dynamic_img_size: bool = False, dynamic_img_pad: bool = False):
        super().__init__(img_size, patch_size, in_chans, dynamic_img_size, dynamic_img_pad)
        patch_dim = in_chans * self.patch_size[0] * self.patch_size[1]
        self.patch_norm = nn.LayerNorm(patch_dim)
        self.proj = nn.Linear(patch_dim, embed_dim)
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.check_images(x)
        p1, p2 = self.patch_size
        x = rearrange(x, "b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=p1, p2=p2)
        return self.norm(self.proj(self.patch_norm(x)))


class CRATEBlock(nn.Module):
    """CRATE layer: ``z = x + attn(norm1(x))``; ``x = ista(norm2(z))`` (CRATE Eqs. (9), (17))."""

    def __init__(self, dim: int, num_heads: int, dim_head: Optional[int] = None, eta: float = 0.1,
                 lambd: float = 0.1, attn_drop: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = MSSA(dim, num_heads=num_heads, dim_head=dim_head, attn_drop=attn_drop, proj_drop=attn_drop)
        self.norm2 = nn.LayerNorm(dim)
        self.ista = ISTA(dim, eta=eta, lambd=lambd)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        z = x + self.attn(self.norm1(x), attn_mask=attn_mask)
        return self.ista(self.norm2(z))


# official key -> ours (``transformer.layers.{i}.{0|1}`` = PreNorm(attention | ISTA))
_OFFICIAL_RULES = [
    (re.compile(r"^to_patch_embedding\.1\."), "patch_embed.patch_norm."),
    (re.compile(r"^to_patch_embedding\.2\."), "patch_embed.proj."),
    (re.compile(r"^to_patch_embedding\.3\."), "patch_embed.norm."),
    (re.compile(r"^pos_embedding$"), "pos_embed"),
    (re.compile(r"^transformer\.layers\.(\d+)\.0\.norm\."), r"blocks.\1.norm1."),
    (re.compile(r"^transformer\.layers\.(\d+)\.0\.fn\."), r"blocks.\1.attn."),
    (re.compile(r"^transformer\.layers\.(\d+)\.1\.norm\."), r"blocks.\1.norm2."),
    (re.compile(r"^transformer\.layers\.(\d+)\.1\.fn\."), r"blocks.\1.ista."),
    (re.compile(r"^mlp_head\.0\."), "fc_norm."),
    (re.compile(r"^mlp_head\.1\."), "head."),
]


class CRATE(GradCheckpointMixin, TimmFeatureMixin, PretrainedMixin, nn.Module):
    """CRATE image classifier (official ``CRATE`` of ``model/crate.py``).

    Args: img_size, patch_size, in_chans, num_classes (0: no head), embed_dim (official ``dim``),
    depth, num_heads (``heads``), dim_head (default embed_dim // num_heads, as the official
    configs), eta (ISTA step size, official ``ista``), lambd (ISTA sparsity, 0.1), global_pool
    ('token' = official ``pool='cls'``, or 'avg' = ``'mean'``, the mean over all tokens including
    the class token), attn_drop_rate (official ``dropout``: attention weights and output),
    pos_drop_rate (official ``emb_dropout``), dynamic_img_size / dynamic_img_pad (timm's: other
    input sizes, the position embedding resized to each input's grid; padding up to a multiple of
    the patch size).
    Shapes: images (B, in_chans, H, W) with (H, W) = img_size (any multiple of the patch size with
    dynamic_img_size) -> logits (B, num_classes).

    Init as the official code: PyTorch defaults for Linear/LayerNorm, ``pos_embed`` and
    ``cls_token`` standard normal, ISTA dictionaries Kaiming-uniform.
    """

    hf_model_type = "whiteformer-vision"
    model_kind = "image classifier"

    def __init__(self, img_size=224, patch_size=16, in_chans: int = 3, num_classes: int = 1000,
                 embed_dim: int = 384, depth: int = 12, num_heads: int = 6, dim_head: Optional[int] = None,
                 eta: float = 0.1, lambd: float = 0.1, global_pool: str = "token", attn_drop_rate: float = 0.0,
                 pos_drop_rate: float = 0.0, dynamic_img_size: bool = False, dynamic_img_pad: bool = False):
        super().__init__()
        set_head_args(self, num_classes, global_pool)
        check_int(depth, "depth", 0)
        for name, val in (("attn_drop_rate", attn_drop_rate), ("pos_drop_rate", pos_drop_rate)):
            check_probability(val, name)
        check_finite_real(eta, "eta")
        check_finite_real(lambd, "lambd")
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1

        self.patch_embed = CRATEPatchEmbed(img_size, patch_size, in_chans, embed_dim, dynamic_img_size, dynamic_img_pad)
        self.fixed_input_size = not dynamic_img_size
        self.cls_token = nn.Parameter(torch.randn(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.randn(1, self.patch_embed.num_patches + 1, embed_dim))
        self.pos_drop = nn.Dropout(pos_drop_rate)
        self.blocks = nn.Sequential(*[CRATEBlock(embed_dim, num_heads, dim_head, eta, lambd, attn_drop_rate)
                                      for _ in range(depth)])
        self.fc_norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return {"pos_embed", "cls_token"}

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """New head (PyTorch default init) for ``num_classes`` (0: identity); optional new pooling."""
        set_head_args(self, num_classes, global_pool)
        w = self.pos_embed
        self.head = (nn.Linear(self.embed_dim, num_classes, device=w.device, dtype=w.dtype)
                     if num_classes > 0 else nn.Identity())

    def _embed_grid(self, x: torch.Tensor):
        """Images -> ([CLS; patches] + pos_embed (B, 1 + N, D), grid (Hp, Wp))."""
        grid = self.patch_embed.input_grid(x)
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.pos_drop(x + self.patch_embed.pos_embed_for(self.pos_embed, grid)), grid

    def _finish(self, x: torch.Tensor) -> torch.Tensor:
        return x  # CRATE normalises the pooled token in the head

    def _inter_norm(self) -> nn.Module:
        return self.fc_norm  # ``norm=True`` applies the head LayerNorm token-wise

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> tokens after the last layer (B, 1 + N, D) (no final norm:
        CRATE normalises the pooled token in the head)."""
        x = self._embed_grid(x)[0]
        for blk in self.blocks:
            x = self.run_block(blk, x)
        return x

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens (B, 1 + N, D) -> logits (B, num_classes) (normalised pooled token if ``pre_logits``)."""
        x = x.mean(dim=1) if self.global_pool == "avg" else x[:, 0]
        x = self.fc_norm(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def convert_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Official CRATE keys (``to_patch_embedding.{1,2,3}``, ``pos_embedding``,
        ``transformer.layers.{i}.{0,1}.{norm,fn}``, ``mlp_head.{0,1}``) -> ours; own keys pass.
        A position embedding on another grid is resampled (bicubic, as timm)."""
        out: Dict[str, torch.Tensor] = {}
        for key, val in state_dict.items():
            for pat, rep in _OFFICIAL_RULES:
                if pat.search(key):
                    key = pat.sub(rep, key, count=1)
                    break
            out[key] = val
        pe = out.get("pos_embed")
        if isinstance(pe, torch.Tensor) and pe.dim() == 3 and pe.shape[1] != self.pos_embed.shape[1]:
            out["pos_embed"] = resample_abs_pos_embed(pe, self.patch_embed.grid_size, num_prefix_tokens=1)
        return out


_CONFIGS = dict(
    t=dict(embed_dim=384, depth=12, num_heads=6),
    s=dict(embed_dim=576, depth=12, num_heads=12),
    b=dict(embed_dim=768, depth=12, num_heads=12),
    l=dict(embed_dim=1024, depth=24, num_heads=16),
)


@register_model
def crate_t(**kwargs) -> CRATE:
    """CRATE-T/16 (official ``CRATE_tiny``): D 384, 12 layers, 6 heads, 6.09M params."""
    return build_with_defaults(CRATE, dict(patch_size=16, **_CONFIGS["t"]), kwargs)


@register_model
def crate_s(**kwargs) -> CRATE:
    """CRATE-S/16 (official ``CRATE_small``): D 576, 12 layers, 12 heads, 13.12M params."""
    return build_with_defaults(CRATE, dict(patch_size=16, **_CONFIGS["s"]), kwargs)


@register_model
def crate_b(**kwargs) -> CRATE:
    """CRATE-B/16 (official ``CRATE_base``): D 768, 12 layers, 12 heads, 22.80M params."""
    return build_with_defaults(CRATE, dict(patch_size=16, **_CONFIGS["b"]), kwargs)


@register_model
def crate_l(**kwargs) -> CRATE:
    """CRATE-L/16 (official ``CRATE_large``): D 1024, 24 layers, 16 heads, 77.64M params."""
    return build_with_defaults(CRATE, dict(patch_size=16, **_CONFIGS["l"]), kwargs)
