"""The XCiT-derived vision shell of ToST (Wu et al., "Token Statistics Transformer", ICLR 2025,
Sec. 4 / Appendix C; official code ``tost_vision/tost.py``, itself XCiT without the LPI block).

    images (B, C_in, H, W)
      -> ConvPatchEmbed (log2(p) x [conv3x3 s2 + BN], GELU between)  -> tokens (B, N, D)
      -> + FourierPositionalEncoding(Hp, Wp)                           (any resolution)
      -> depth x Block:  x += drop_path(gamma1 * attn(norm1(x)))
                         x += drop_path(gamma2 * mlp(norm2(x)))       (pre-norm, layer scale)
      -> [CLS; x] -> cls_attn_layers x ClassAttentionBlock -> norm -> head(CLS)

The attention is any layer of the :mod:`whiteformer.attention` registry (``attn="tssa"``, "dmsa",
"eca", "xca", "mhsa", ...) built as ``build(attn, D, num_heads=H, qkv_bias=..., attn_drop=...,
proj_drop=..., **attn_kwargs)`` (the drop/bias arguments a layer takes: its class's ``shell_options``).

Module and parameter names are those of the official ToST state dict (``patch_embed.proj.i.j``,
``blocks.i.{norm1,attn,norm2,mlp,gamma1,gamma2}``, ``cls_attn_blocks``, ``norm``, ``head``) except
``pos_embed`` (official ``pos_embeder``) and the TSSA output ``attn.proj`` (official
``attn.to_out.0``); :meth:`ToSTVision.convert_state_dict` maps an official checkpoint.

Registered entry points are below the class, this file being the family's one file.
Every entry point takes keyword overrides for any constructor argument, e.g. a small variant for
MNIST: ``create_model("tost_t12_p16", img_size=28, patch_size=4, depth=4, in_chans=1, num_classes=10)``.
Families: ToST (Wu et al., ICLR 2025; official ``tost_cab_*``: qkv bias, eta 1.0 for 12 and 1e-5 for
24 blocks), DMST (Liu et al., arXiv:2601.17042: DMSA's ``Linear(D, H)`` membership per block instead
of TSSA's ``temp``), ECA (ECAttention blocks without MLP, ``x + alpha E(norm1(x)) - beta C(norm1(x))``,
Eq. 4, with ToST's stem, Fourier encoding and two class-attention blocks), and the baselines
``xcit_s12_p16`` (XCA, no LPI) and ``vit_cab_s12_p16`` (softmax MHSA) on the same shell. Their
parameter counts against the papers' tables, and the head dimensions ECA's counts require, are in
docs/models.md ("Parameter counts").
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Set, Tuple, Union

import torch
import torch.nn as nn

from .. import attention as _attention
from .._checks import (
    check_choice,
    check_divisible,
    check_finite_real,
    check_instance,
    check_int,
    check_keep_softmax,
    check_positive_real,
    check_probability,
    check_tokens_input,
)
from .._utils import apply_layer_scale, layer_scale_param
from ..attention.context_parallel import ContextParallel
from ..attention.registry import shell_options
from ..layers import (
    ISTA,
    ClassAttentionBlock,
    ConvPatchEmbed,
    DropPath,
    FourierPositionalEncoding,
    GradCheckpointMixin,
    Mlp,
    TimmFeatureMixin,
    feature_take_indices,
    forward_intermediates,
    to_2tuple,
)
from ..ops.context_parallel import group_chunk, local_checks
from ._context_parallel import check_blocks_split, one_process
from ._head import set_head_args
from .registry import build_with_defaults, register_model
from .save import PretrainedMixin

__all__ = ["Block", "ToSTVision", "SOFTMAX_ATTN"]

#: the registered softmax attention the shells keep in a hybrid's ``keep_softmax`` blocks
SOFTMAX_ATTN = "mhsa"

_MLP_KINDS = ("mlp", "ista", "none")
_NO_DECAY_SUFFIXES = ("temp", "temperature", "pos_bias", "cls_token", "pos_embed")


def check_attn_args(attn: Any, attn_kwargs: Any) -> None:
    """``attn`` names a registered attention (else a ValueError listing them); ``attn_kwargs`` is a dict or None."""
    check_instance(attn, "attn", str, "a registered attention name (str)")
    _attention.get_attention_class(attn)  # unknown name -> ValueError listing the choices
    check_instance(attn_kwargs, "attn_kwargs", dict, "a dict or None", optional=True)


def _attention_kwargs(
    attn: str, qkv_bias: bool, attn_drop: float, proj_drop: float, attn_kwargs: Optional[Dict[str, Any]]
) -> Dict[str, Any]:
    """Constructor kwargs for the registered layer ``attn``: the shell's options it takes
    (:func:`whiteformer.attention.registry.shell_options`; a non-zero dropout it cannot honour
    raises), then ``attn_kwargs`` (passed through unchanged)."""
    takes = shell_options(attn)
    kwargs: Dict[str, Any] = {}
    for name, value, must in (("qkv_bias", qkv_bias, False), ("attn_drop", attn_drop, True),
                              ("proj_drop", proj_drop, True)):
        if name in takes:
            kwargs[name] = value
        elif must and value > 0:
            cls = _attention.get_attention_class(attn)
            raise ValueError(f"attention {attn!r} ({cls.__name__}) has no {name!r}; set the shell's rate to 0")
    kwargs.update(attn_kwargs or {})
    return kwargs


class Block(nn.Module):
    """Pre-norm transformer block of the ToST/XCiT shell (without XCiT's LPI).

    ``x = x + drop_path(gamma1 * attn(norm1(x)))``; ``x = x + drop_path(gamma2 * mlp(norm2(x)))``;
    LayerNorm eps 1e-6; ``gamma`` initialised to ``eta`` (``eta=None``: no layer scale).
    ``mlp``: "mlp" (2-layer GELU MLP, ratio ``mlp_ratio``), "ista" (CRATE's ISTA step, ToST
    Table 8 ablation, in the same residual slot) or "none" (attention-only block, as ECA).
    A layer with its own learned scales (class attribute ``learned_scale = True``, e.g. ECAttention:
    ``x + alpha E(norm1(x)) - beta C(norm1(x))``, the ECAttention paper's Eq. (4) on the normalised features)
    gets no layer scale gamma1. ``prenorm=False`` drops norm1/norm2 (for ECA:
    ``x + alpha E(x) - beta C(x)``, Eq. (4) literally).
    A building block: its arguments are checked by the model that builds it. Shapes: (B, N, C) -> (B, N, C).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        attn: str = "tssa",
        attn_kwargs: Optional[Dict[str, Any]] = None,
        mlp: str = "mlp",
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        eta: Optional[float] = 1.0,
        norm_eps: float = 1e-6,
        prenorm: bool = True,
    ):
        super().__init__()
        self.dim = dim
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps) if prenorm else nn.Identity()
        self.attn = _attention.build(
            attn, dim, num_heads=num_heads, **_attention_kwargs(attn, qkv_bias, attn_drop, drop, attn_kwargs)
        )
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        use_gamma1 = eta is not None and not getattr(self.attn, "learned_scale", False)
        self.gamma1 = layer_scale_param(dim, eta) if use_gamma1 else None
        if mlp == "none":
            self.norm2 = self.mlp = self.gamma2 = None
        else:
            self.norm2 = nn.LayerNorm(dim, eps=norm_eps) if prenorm else nn.Identity()
            self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop) if mlp == "mlp" else ISTA(dim)
            self.gamma2 = layer_scale_param(dim, eta)

    def forward(self, x: torch.Tensor, return_pi: bool = False):
        y = self.norm1(x)
        if return_pi:
            a, stats = self.attn(y, return_pi=True)
        else:
            a, stats = self.attn(y), None
        x = x + self.drop_path(apply_layer_scale(self.gamma1, a))
        if self.mlp is not None:
            x = x + self.drop_path(apply_layer_scale(self.gamma2, self.mlp(self.norm2(x))))
        return (x, stats) if return_pi else x


class ToSTVision(ContextParallel, GradCheckpointMixin, TimmFeatureMixin, PretrainedMixin, nn.Module):
    """ToST's XCiT-derived image classifier with a pluggable token mixer (see module docstring).

    Args:
        img_size: nominal input size (int or (h, w)); must be divisible by ``patch_size``. Other
            resolutions are accepted at run time (Fourier position encoding).
        patch_size: 16, 8, 4 or 2 (4, 3, 2, 1 stride-2 conv stages).
        in_chans: image channels (1 for MNIST).
        num_classes: classes of the linear head (0: no head, ``forward`` returns features).
        embed_dim, depth, num_heads: D, number of blocks, heads (D divisible by heads).
        mlp_ratio, mlp: MLP hidden ratio; "mlp" | "ista" | "none" (see :class:`Block`).
        qkv_bias: bias of the attention input projection (the official ToST uses True).
        attn: name in the :mod:`whiteformer.attention` registry; ``attn_kwargs`` go to its
            constructor unchanged (e.g. ``{"rank": 10}`` for ECA).
        drop_rate, attn_drop_rate, drop_path_rate: dropout after the position encoding / in the
            MLPs and attention outputs; attention dropout; stochastic depth (constant over blocks,
            as the official code).
        eta: layer-scale initial value (official: 1.0 for 12 blocks, 1e-5 for 24); ``None``: off.
        cls_attn_layers: number of class-attention blocks (official 2, must be >= 1).
        tokens_norm: class-attention blocks normalise all tokens (official True).
        use_pos: add the Fourier position encoding.
        prenorm: LayerNorm before the attention/MLP of each block (official: True). ECA models
            keep it by default (the ECA paper does not say; ``prenorm=False`` gives
            ``x_{l+1} = x_l + ECAttention(x_l)``, the ECAttention paper's Eq. (4) literally).
        global_pool: what the head reads: "token" (the class token after class attention, official)
            or "avg" (the mean of the normalised patch tokens, as timm's XCiT).
        keep_softmax: the blocks (indices) that keep softmax attention (``"mhsa"``) whatever ``attn``:
            a hybrid, e.g. of a model linearized by :func:`whiteformer.convert.linearize`.
        dynamic_img_size, dynamic_img_pad: timm's flags. Images of any size already run (the
            Fourier position encoding is computed for each input's grid), so ``dynamic_img_size``
            changes nothing and is accepted for timm's callers; ``dynamic_img_pad`` pads the images
            with zeros at the right and bottom up to multiples of ``patch_size`` before the stem
            (:class:`~whiteformer.layers.ConvPatchEmbed`).

    Shapes: ``forward`` (B, in_chans, H, W) -> logits (B, num_classes) (in training mode too; the
    official returns ``(x, x)`` there). ``forward_features`` -> (B, 1 + N, D) normalised tokens
    (CLS first); ``forward_head(x, pre_logits=False)`` -> logits or pooled features (B, D);
    timm's feature API (:class:`~whiteformer.layers.TimmFeatureMixin`): ``forward_intermediates``
    (block outputs before the class token joins: patch tokens only), ``prune_intermediate_layers``
    (the head includes the class-attention blocks), ``group_matcher``, ``pretrained_cfg``.

    Context parallelism (TSSA blocks): after ``model.set_context_parallel(group)`` every rank of
    the group passes the whole images; the conv patch embedding (BatchNorm over the whole image
    batch, as unsplit) and the position encoding run on every rank, then each rank keeps its
    contiguous share of the patch tokens (rank order; sizes differ by at most one, a rank may hold none) for the
    blocks and the class attention, which combines the class token's softmax over the ranks.
    Logits are the unsplit ones on every rank; the mean of the parameter gradients over the
    group (DDP) is the unsplit gradient. Memory: the blocks' activations are split, the stem's
    are not. ``forward_features`` returns this rank's tokens; ``forward_intermediates`` runs on
    one process; the "avg" pooling is refused (it would need the whole token set).
    """

    hf_model_type = "whiteformer-vision"
    model_kind = "image classifier"
    num_prefix_tokens = 0  # the class token joins after the blocks
    first_conv = "patch_embed.proj.0.0"
    head_modules = ("cls_attn_blocks",)
    extra_groups = ("cls_attn_blocks",)
    fixed_input_size = False  # Fourier positions: any multiple of the patch size

    depth_args = ("depth", "cls_attn_layers")

    def __init__(
        self,
        img_size: Union[int, Sequence[int]] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 192,
        depth: int = 12,
        num_heads: int = 4,
        mlp_ratio: float = 4.0,
        mlp: str = "mlp",
        qkv_bias: bool = True,
        attn: str = "tssa",
        attn_kwargs: Optional[Dict[str, Any]] = None,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        eta: Optional[float] = 1.0,
        cls_attn_layers: int = 2,
        tokens_norm: bool = True,
        use_pos: bool = True,
        prenorm: bool = True,
        global_pool: str = "token",
        dynamic_img_size: bool = False,
        dynamic_img_pad: bool = False,
        keep_softmax: Optional[Sequence[int]] = None,
    ):
        super().__init__()
        check_divisible(embed_dim, num_heads, "embed_dim")
        for name, v in (("depth", depth), ("cls_attn_layers", cls_attn_layers)):
            check_int(v, name, 0 if name == "depth" else 1)
        set_head_args(self, num_classes, global_pool)
        check_attn_args(attn, attn_kwargs)
        self.keep_softmax = check_keep_softmax(keep_softmax, depth, attn, "attn", SOFTMAX_ATTN)
        check_choice(mlp, "mlp", _MLP_KINDS)
        drop_rate = check_probability(drop_rate, "drop_rate")
        attn_drop_rate = check_probability(attn_drop_rate, "attn_drop_rate")
        drop_path_rate = check_probability(drop_path_rate, "drop_path_rate")
        eta = check_finite_real(eta, "eta", allow_none=True)
        mlp_ratio = check_positive_real(mlp_ratio, "mlp_ratio")

        self.num_features = self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.attn_name = attn
        self.use_pos = use_pos
        self.img_size = to_2tuple(img_size, "img_size")

        self.patch_embed = ConvPatchEmbed(self.img_size, patch_size, in_chans, embed_dim, dynamic_img_size,
                                          dynamic_img_pad)
        self.num_patches = self.patch_embed.num_patches
        self.pos_embed = FourierPositionalEncoding(dim=embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_drop = nn.Dropout(drop_rate)
        kept = set(self.keep_softmax)
        self.blocks = nn.ModuleList(
            Block(embed_dim, num_heads, attn=SOFTMAX_ATTN if i in kept else attn,
                  attn_kwargs=None if i in kept else attn_kwargs, mlp=mlp, mlp_ratio=mlp_ratio,
                  qkv_bias=qkv_bias, drop=drop_rate, attn_drop=attn_drop_rate, drop_path=drop_path_rate, eta=eta,
                  prenorm=prenorm)
            for i in range(depth)
        )
        self.cls_attn_blocks = nn.ModuleList(
            ClassAttentionBlock(embed_dim, num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, drop=drop_rate,
                                attn_drop=attn_drop_rate, eta=eta, tokens_norm=tokens_norm)
            for _ in range(cls_attn_layers)
        )
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()

        nn.init.trunc_normal_(self.cls_token, std=0.02)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    # ------------------------------------------------------------------ timm protocol
    def no_weight_decay(self) -> Set[str]:
        """Names of parameters to exclude from weight decay: temperatures, position biases, the
        class token, position embeddings, plus what each submodule's ``no_weight_decay`` lists."""
        names = {n for n, _ in self.named_parameters() if n.rsplit(".", 1)[-1] in _NO_DECAY_SUFFIXES}
        own = dict(self.named_parameters())
        for prefix, module in self.named_modules():
            fn = getattr(module, "no_weight_decay", None)
            if module is self or not callable(fn):
                continue
            for n in fn():
                full = f"{prefix}.{n}" if prefix else n
                if full in own:
                    names.add(full)
        return names

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """Replace the head by a freshly initialised ``Linear(D, num_classes)`` (0: identity);
        ``global_pool`` "token" or "avg" switches the pooling (see the class docstring)."""
        set_head_args(self, num_classes, global_pool)
        ref = self.cls_token  # (the norm may be pruned: prune_intermediate_layers)
        if num_classes > 0:
            self.head = nn.Linear(self.embed_dim, num_classes, device=ref.device, dtype=ref.dtype)
            self._init_weights(self.head)
        else:
            self.head = nn.Identity()

    def check_context_parallel(self) -> None:
        check_blocks_split(self, self.blocks)
        if self.global_pool == "avg":
            raise ValueError("global_pool='avg' averages the patch tokens of every rank; context parallelism "
                             "supports the class-token readout (global_pool='token')")

    def _embed_grid(self, x: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, int]]:
        """Images -> (patch tokens + Fourier positions (B, N, D), grid (Hp, Wp)); the patch embedding
        checks them."""
        tokens, (hp, wp) = self.patch_embed(x)
        if self.use_pos:
            tokens = tokens + self.pos_embed(tokens.shape[0], hp, wp).to(tokens.dtype)
        return self.pos_drop(tokens), (hp, wp)

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        group = self.context_parallel_group
        with local_checks(group, x):  # the stem runs on each rank alone: a rank failing it stops every rank
            tokens = self._embed_grid(x)[0]
        if group is not None:  # this rank's share of the tokens, global positions (class docstring)
            tokens = tokens[:, group_chunk(tokens.shape[1], group)]
        return tokens

    def _head_tokens(self, x: torch.Tensor) -> torch.Tensor:
        cls = self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype)
        x = torch.cat((cls, x), dim=1)
        for blk in self.cls_attn_blocks:
            x = self.run_block(blk, x)
        return self.norm(x)

    _finish = _head_tokens

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C_in, H, W) -> normalised tokens (B, 1 + N, D), CLS token first."""
        x = self._embed(x)
        for blk in self.blocks:
            x = self.run_block(blk, x)
        return self._head_tokens(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens (B, 1 + N, D) from :meth:`forward_features` -> logits (B, num_classes), or the
        pooled features (B, D) when ``pre_logits`` (CLS token, or the patch-token mean for "avg")."""
        check_tokens_input(x, "x", self.embed_dim)
        x = x[:, 1:].mean(dim=1) if self.global_pool == "avg" else x[:, 0]
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(self, x: torch.Tensor, indices=None, return_prefix_tokens: bool = False,
                              norm: bool = False, stop_early: bool = False, output_fmt: str = "NCHW",
                              intermediates_only: bool = False, return_pi: bool = False):
        """timm's ``forward_intermediates`` (:func:`whiteformer.layers.features.forward_intermediates`:
        ``(forward_features output, [block outputs])``, or the list alone with ``intermediates_only``),
        plus ``return_pi``: the attention statistics of the selected blocks (e.g. ``{"pi": (B, H, N)}``
        memberships; TSSA, DMSA, ECA) appended as one more element, ``(list, stats)`` or
        ``(final, list, stats)``."""
        one_process(self, "forward_intermediates")
        if not return_pi:
            return super().forward_intermediates(x, indices, return_prefix_tokens, norm, stop_early, output_fmt,
                                                 intermediates_only)
        if not all(getattr(blk.attn, "returns_pi", False) for blk in self.blocks):
            kept = f" (the keep_softmax blocks {self.keep_softmax} are softmax)" if self.keep_softmax else ""
            raise ValueError(f"attention {self.attn_name!r} does not support return_pi{kept}")
        take = set(feature_take_indices(len(self.blocks), indices)[0])
        stats: Dict[int, Dict[str, torch.Tensor]] = {}

        def run(i: int, blk: nn.Module, z: torch.Tensor) -> torch.Tensor:
            if i not in take:
                return self.run_block(blk, z)
            z, stats[i] = blk(z, return_pi=True)
            return z

        out = forward_intermediates(self, x, indices, norm, stop_early, output_fmt, intermediates_only,
                                    return_prefix_tokens, self.norm, block_fn=run)
        st = [stats[i] for i in sorted(take)]
        return (out, st) if intermediates_only else (*out, st)

    # ------------------------------------------------------------------ checkpoints
    def convert_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Map an official ToST/XCiT-shell state dict (``tost_vision/tost.py``) to this layout:
        ``pos_embeder.`` -> ``pos_embed.``, ``attn.to_out.0.`` -> ``attn.proj.`` (TSSA output).
        The identity on this model's own keys."""
        out = {}
        for key, value in state_dict.items():
            if key.startswith("pos_embeder."):
                key = "pos_embed." + key[len("pos_embeder."):]
            key = key.replace(".attn.to_out.0.", ".attn.proj.")
            out[key] = value
        return out


# ============================================================================ registered entry points
def _build(defaults: Dict[str, Any], overrides: Dict[str, Any]) -> ToSTVision:
    return build_with_defaults(ToSTVision, defaults, overrides)


def _tost(embed_dim: int, depth: int, num_heads: int, patch_size: int, **extra: Any) -> Dict[str, Any]:
    return dict(patch_size=patch_size, embed_dim=embed_dim, depth=depth, num_heads=num_heads, mlp_ratio=4.0,
                qkv_bias=True, eta=1.0 if depth <= 12 else 1e-5, attn="tssa", **extra)


# ---------------------------------------------------------------------------- ToST (TSSA)
@register_model
def tost_t12_p16(**kwargs) -> ToSTVision:
    """ToST-T/16: D 192, 12 blocks, 4 heads (official ``tost_cab_tiny_12_p16``, 5.77M)."""
    return _build(_tost(192, 12, 4, 16), kwargs)


@register_model
def tost_s12_p16(**kwargs) -> ToSTVision:
    """ToST-S/16: D 384, 12 blocks, 8 heads (official ``tost_cab_small_12_p16``, 22.59M)."""
    return _build(_tost(384, 12, 8, 16), kwargs)


@register_model
def tost_t24_p16(**kwargs) -> ToSTVision:
    """ToST-T24/16: D 192, 24 blocks, 4 heads, eta 1e-5 (10.22M)."""
    return _build(_tost(192, 24, 4, 16), kwargs)


@register_model
def tost_s24_p16(**kwargs) -> ToSTVision:
    """ToST-S24/16: D 384, 24 blocks, 8 heads, eta 1e-5 (40.35M)."""
    return _build(_tost(384, 24, 8, 16), kwargs)


@register_model
def tost_m24_p16(**kwargs) -> ToSTVision:
    """ToST-M/16: D 512, 24 blocks, 8 heads, eta 1e-5 (official ``tost_cab_medium_24_p16``, 71.48M)."""
    return _build(_tost(512, 24, 8, 16), kwargs)


@register_model
def tost_t12_p8(**kwargs) -> ToSTVision:
    """ToST-T/8 (3 conv stages): D 192, 12 blocks, 4 heads."""
    return _build(_tost(192, 12, 4, 8), kwargs)


@register_model
def tost_s12_p8(**kwargs) -> ToSTVision:
    """ToST-S/8: D 384, 12 blocks, 8 heads."""
    return _build(_tost(384, 12, 8, 8), kwargs)


@register_model
def tost_t24_p8(**kwargs) -> ToSTVision:
    """ToST-T24/8: D 192, 24 blocks, 4 heads, eta 1e-5."""
    return _build(_tost(192, 24, 4, 8), kwargs)


@register_model
def tost_s24_p8(**kwargs) -> ToSTVision:
    """ToST-S24/8: D 384, 24 blocks, 8 heads, eta 1e-5."""
    return _build(_tost(384, 24, 8, 8), kwargs)


@register_model
def tost_m24_p8(**kwargs) -> ToSTVision:
    """ToST-M/8: D 512, 24 blocks, 8 heads, eta 1e-5."""
    return _build(_tost(512, 24, 8, 8), kwargs)


# ---------------------------------------------------------------------------- DMST (DMSA)
@register_model
def dmst_t12_p16(**kwargs) -> ToSTVision:
    """DMST-T/16: ToST-T with decoupled-membership attention (DMSA)."""
    return _build(_tost(192, 12, 4, 16) | {"attn": "dmsa"}, kwargs)


@register_model
def dmst_s12_p16(**kwargs) -> ToSTVision:
    """DMST-S/16: ToST-S with DMSA."""
    return _build(_tost(384, 12, 8, 16) | {"attn": "dmsa"}, kwargs)


# ---------------------------------------------------------------------------- ECA (ECAttention, no MLP)
def _eca(embed_dim: int, depth: int, num_heads: int, head_dim: int) -> Dict[str, Any]:
    # eta only scales the class-attention blocks (ECA blocks are scaled by their alpha, beta).
    return dict(patch_size=16, embed_dim=embed_dim, depth=depth, num_heads=num_heads, mlp="none", mlp_ratio=4.0,
                qkv_bias=True, eta=1.0 if depth <= 12 else 1e-5, attn="eca", attn_kwargs={"head_dim": head_dim})


def _build_eca(defaults: Dict[str, Any], overrides: Dict[str, Any]) -> ToSTVision:
    # attn_kwargs overrides are merged into the defaults (head_dim stays unless overridden)
    if isinstance(overrides.get("attn_kwargs"), dict):
        overrides = {**overrides, "attn_kwargs": {**defaults["attn_kwargs"], **overrides["attn_kwargs"]}}
    return _build(defaults, overrides)


@register_model
def eca_t(**kwargs) -> ToSTVision:
    """ECA-T: K 4 heads, L 12, d 192, p 64 (Table 3 says 48; see module docstring); 1.91M as the paper."""
    return _build_eca(_eca(192, 12, 4, 64), kwargs)


@register_model
def eca_s(**kwargs) -> ToSTVision:
    """ECA-S: K 8, L 12, d 384, p 64 (Table 3 says 48; see module docstring); 7.2M as the paper."""
    return _build_eca(_eca(384, 12, 8, 64), kwargs)


@register_model
def eca_m(**kwargs) -> ToSTVision:
    """ECA-M: K 8, L 24, d 512 (p 64); paper 14.7M."""
    return _build_eca(_eca(512, 24, 8, 64), kwargs)


@register_model
def eca_b(**kwargs) -> ToSTVision:
    """ECA-B: K 16, L 48, d 512, p 32 = d / K (Table 3 says 64, which would give 33.6M; see module
    docstring); paper 21.0M."""
    return _build_eca(_eca(512, 48, 16, 32), kwargs)


@register_model
def eca_bplus(**kwargs) -> ToSTVision:
    """ECA-B+: K 16, L 24, d 1024 (p 64); paper 57.7M."""
    return _build_eca(_eca(1024, 24, 16, 64), kwargs)


@register_model
def eca_l(**kwargs) -> ToSTVision:
    """ECA-L: K 16, L 36, d 1024 (p 64); paper 70M."""
    return _build_eca(_eca(1024, 36, 16, 64), kwargs)


# ---------------------------------------------------------------------------- baselines on the same shell
@register_model
def xcit_s12_p16(**kwargs) -> ToSTVision:
    """XCiT-S12/16 without LPI (official ToST repo ``xcit_cab_small_12_p16``): XCA, D 384, 12, 8 heads."""
    return _build(_tost(384, 12, 8, 16) | {"attn": "xca"}, kwargs)


@register_model
def vit_cab_s12_p16(**kwargs) -> ToSTVision:
    """Softmax-attention ViT-S12/16 on the same shell (MHSA, D 384, 12 blocks, 6 heads)."""
    return _build(_tost(384, 12, 6, 16) | {"attn": "mhsa"}, kwargs)
