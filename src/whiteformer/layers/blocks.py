"""Building blocks shared by the model zoo (timm-like signatures and parameter names).

- :class:`Mlp` (``fc1``/``fc2``), :class:`DropPath`, :class:`LayerScale` (``gamma``): as timm.
- :class:`ISTA`: CRATE's sparse-coding block (one (dim, dim) dictionary ``weight``).
- :class:`ConvPatchEmbed`, :class:`FourierPositionalEncoding`, :class:`ClassAttentionBlock`: the
  XCiT pieces of the ToST vision shell (El-Nouby et al., XCiT, 2021; Wu et al., ToST, 2025), with
  the parameter names of the official ToST state dict so that its checkpoints load directly.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._checks import check_finite_real, check_positive_real, check_probability, check_tensor, check_tokens_input
from .helpers import to_2tuple

__all__ = [
    "DropPath",
    "Mlp",
    "LayerScale",
    "ISTA",
    "ConvPatchEmbed",
    "FourierPositionalEncoding",
    "ClassAttentionBlock",
]


def drop_path(x: torch.Tensor, drop_prob: float = 0.0, training: bool = False, scale_by_keep: bool = True):
    """Stochastic depth per sample: zero whole samples with probability ``drop_prob``.

    The kept samples are divided by the keep probability when ``scale_by_keep`` (timm semantics).
    """
    if drop_prob == 0.0 or not training:
        return x
    keep = 1.0 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.dim() - 1)
    mask = x.new_empty(shape).bernoulli_(keep)
    if keep > 0.0 and scale_by_keep:
        mask.div_(keep)
    return x * mask


class DropPath(nn.Module):
    """Stochastic depth (Huang et al., 2016) applied to a residual branch, timm's ``DropPath``."""

    def __init__(self, drop_prob: float = 0.0, scale_by_keep: bool = True):
        super().__init__()
        self.drop_prob = check_probability(drop_prob, "drop_prob")
        self.scale_by_keep = scale_by_keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.drop_prob, self.training, self.scale_by_keep)

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob:.3f}"


class Mlp(nn.Module):
    """Two-layer MLP ``fc2(drop(act(fc1(x))))`` (+ dropout), timm's ``Mlp``.

    Shapes: (..., in_features) -> (..., out_features); hidden defaults to ``in_features``.
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: Optional[int] = None,
        out_features: Optional[int] = None,
        act_layer: type = nn.GELU,
        drop: float = 0.0,
        bias: bool = True,
    ):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class LayerScale(nn.Module):
    """Per-channel scale ``x * gamma`` with ``gamma`` (dim,) initialised to ``init_values`` (CaiT)."""

    def __init__(self, dim: int, init_values: float = 1e-5):
        super().__init__()
        self.gamma = nn.Parameter(check_finite_real(init_values, "init_values") * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class ISTA(nn.Module):
    """CRATE's sparse-coding block: one proximal-gradient (ISTA) step on a LASSO with dictionary D.

    ``ISTA(x) = relu(x + eta * (D^T x - D^T D x) - eta * lambda)`` (Yu et al., CRATE, 2023,
    Eq. (17) with the non-negativity constraint), ``D = weight`` of shape (dim, dim), initialised
    with ``kaiming_uniform_`` as the official CRATE code. Shapes: (..., dim) -> (..., dim).
    """

    def __init__(self, dim: int, eta: float = 0.1, lambd: float = 0.1):
        super().__init__()
        self.dim = dim
        self.eta = check_finite_real(eta, "eta")
        self.lambd = check_finite_real(lambd, "lambd")
        self.weight = nn.Parameter(torch.empty(dim, dim))
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor(x, "x")
        if x.shape[-1] != self.dim:
            raise ValueError(f"x must have last dimension {self.dim}, got shape {tuple(x.shape)}")
        dx = F.linear(x, self.weight)  # D x
        dtdx = F.linear(dx, self.weight.t())  # D^T D x
        dtx = F.linear(x, self.weight.t())  # D^T x
        return F.relu(x + self.eta * (dtx - dtdx) - self.eta * self.lambd)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, eta={self.eta}, lambd={self.lambd}"


def _conv3x3_bn(in_ch: int, out_ch: int) -> nn.Sequential:
    """conv3x3 (stride 2, padding 1, no bias) + BatchNorm: keys ``0.weight``, ``1.*``."""
    return nn.Sequential(nn.Conv2d(in_ch, out_ch, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(out_ch))


class ConvPatchEmbed(nn.Module):
    """XCiT's convolutional patch embedding: ``log2(patch_size)`` stride-2 conv3x3+BN stages.

    p16 = 4 stages with channels ``in_chans -> D/8 -> D/4 -> D/2 -> D``, GELU between stages
    (none after the last); p8 = 3 stages ``-> D/4 -> D/2 -> D``; p4 = 2; p2 = 1. The module
    names (``proj.{0,2,4,6}.{0,1}``) are those of the official ToST/XCiT code.

    Shapes: images (B, in_chans, H, W) -> tokens (B, Hp*Wp, D) and ``(Hp, Wp)``, with
    ``Hp = ceil(H / patch)`` (= H / patch for the divisible sizes checked at construction).
    """

    SUPPORTED_PATCH_SIZES = (2, 4, 8, 16)

    def __init__(self, img_size=224, patch_size: int = 16, in_chans: int = 3, embed_dim: int = 768):
        super().__init__()
        if isinstance(patch_size, (tuple, list)):
            ps = to_2tuple(patch_size, "patch_size")
            if ps[0] != ps[1]:
                raise ValueError(f"patch_size must be square for the conv patch embedding, got {patch_size!r}")
            patch_size = ps[0]
        if patch_size not in self.SUPPORTED_PATCH_SIZES:
            raise ValueError(
                f"patch_size must be one of {self.SUPPORTED_PATCH_SIZES} (a power of two: one stride-2 conv "
                f"per factor 2), got {patch_size!r}"
            )
        if not isinstance(in_chans, int) or in_chans <= 0:
            raise ValueError(f"in_chans must be a positive int, got {in_chans!r}")
        stages = int(math.log2(patch_size))
        if not isinstance(embed_dim, int) or embed_dim <= 0 or embed_dim % (2 ** (stages - 1)) != 0:
            raise ValueError(
                f"embed_dim must be a positive multiple of {2 ** (stages - 1)} for patch_size {patch_size}, "
                f"got {embed_dim!r}"
            )
        img = to_2tuple(img_size, "img_size")
        if img[0] % patch_size or img[1] % patch_size:
            raise ValueError(f"img_size {img} must be divisible by patch_size {patch_size}")
        self.img_size = img
        self.patch_size = (patch_size, patch_size)
        self.grid_size = (img[0] // patch_size, img[1] // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.in_chans = in_chans

        chans = [in_chans] + [embed_dim // 2 ** (stages - 1 - i) for i in range(stages)]
        layers = []
        for i in range(stages):
            if i > 0:
                layers.append(nn.GELU())
            layers.append(_conv3x3_bn(chans[i], chans[i + 1]))
        self.proj = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, int]]:
        check_tensor(x, "x", 4)
        if x.shape[1] != self.in_chans:
            raise ValueError(
                f"x must have {self.in_chans} channels (B, {self.in_chans}, H, W), got shape {tuple(x.shape)}"
            )
        if x.shape[0] == 0 or x.shape[2] == 0 or x.shape[3] == 0:
            raise ValueError(f"x must be a non-empty image batch, got shape {tuple(x.shape)}")
        x = self.proj(x)
        hp, wp = x.shape[2], x.shape[3]
        return x.flatten(2).transpose(1, 2), (hp, wp)


class FourierPositionalEncoding(nn.Module):
    """Sinusoidal 2-d position encoding of XCiT (from DETR), projected by a 1x1 conv.

    For a grid of ``H x W`` patches, the normalised coordinates ``y = i / (H + 1e-6) * scale``,
    ``x = j / (W + 1e-6) * scale`` (i, j = 1..H, 1..W; scale = 2 pi) are divided by
    ``temperature ** (2 floor(k/2) / hidden_dim)``, k < hidden_dim, and encoded as
    ``[sin, cos, sin, cos, ...]`` (even k sin, odd k cos) per axis; the ``2 * hidden_dim`` features
    ``[enc(y), enc(x)]`` are mapped to ``dim`` by ``token_projection`` (Conv2d 1x1 with bias).
    The encoding is computed for any grid, so the model works at any resolution. The features are
    computed in float32 (float64 for a float64 model), as the official code.

    ``forward(batch, height, width)`` -> (batch, height*width, dim), row-major over the grid.
    """

    def __init__(self, hidden_dim: int = 32, dim: int = 768, temperature: float = 10000.0):
        super().__init__()
        self.token_projection = nn.Conv2d(hidden_dim * 2, dim, kernel_size=1)
        self.scale = 2 * math.pi
        self.temperature = temperature
        self.hidden_dim = hidden_dim
        self.dim = dim

    def features(self, height: int, width: int, device=None, dtype=torch.float32) -> torch.Tensor:
        """Raw sinusoidal features (1, 2*hidden_dim, height, width) before the projection."""
        eps = 1e-6
        y = torch.arange(1, height + 1, device=device, dtype=dtype)[:, None].expand(height, width)
        x = torch.arange(1, width + 1, device=device, dtype=dtype)[None, :].expand(height, width)
        y = y / (height + eps) * self.scale
        x = x / (width + eps) * self.scale
        k = torch.arange(self.hidden_dim, device=device, dtype=dtype)
        freq = self.temperature ** (2 * (k // 2) / self.hidden_dim)

        def enc(c: torch.Tensor) -> torch.Tensor:
            c = c[:, :, None] / freq  # (H, W, hidden)
            return torch.stack((c[:, :, 0::2].sin(), c[:, :, 1::2].cos()), dim=3).flatten(2)

        return torch.cat((enc(y), enc(x)), dim=2).unsqueeze(0).permute(0, 3, 1, 2)

    def forward(self, batch: int, height: int, width: int) -> torch.Tensor:
        w = self.token_projection.weight
        dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
        feats = self.features(height, width, device=w.device, dtype=dtype).to(w.dtype)
        pos = self.token_projection(feats)  # (1, dim, H, W)
        return pos.flatten(2).transpose(1, 2).expand(batch, -1, -1)

    def extra_repr(self) -> str:
        return f"hidden_dim={self.hidden_dim}, dim={self.dim}, temperature={self.temperature}"


def _class_attention_cls() -> type:
    """The CaiT class-attention layer of :mod:`whiteformer.attention` (params ``qkv``, ``proj``)."""
    from .. import attention

    cls = getattr(attention, "ClassAttention", None)
    if cls is None:
        cls = attention.get_attention_class("class_attention")
    return cls


class ClassAttentionBlock(nn.Module):
    """CaiT/XCiT class-attention block: only the CLS token (index 0) queries all tokens.

    As the official XCiT/ToST code (``tokens_norm=True`` there)::

        y = norm1(x);   a = ClassAttention(y)          # only a[:, 0] is used
        x = x + drop_path(gamma1 * [a_0, y_1..N])       # patch tokens: x_i + gamma1 * y_i
        x = norm2(x)    if tokens_norm else  [norm2(x_0), x_1..N]
        x = x + drop_path([gamma2 * mlp(x_0), x_1..N])  # patch tokens are doubled (XCiT quirk)

    The patch-token updates (adding ``gamma1 * norm1(x)`` and the doubling) reproduce the official
    implementation exactly; they matter because the next class-attention block attends to them.
    ``eta=None`` disables the layer scale (gammas = 1). Shapes: (B, 1+N, C) -> (B, 1+N, C).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        act_layer: type = nn.GELU,
        norm_eps: float = 1e-6,
        eta: Optional[float] = None,
        tokens_norm: bool = False,
    ):
        super().__init__()
        eta = check_finite_real(eta, "eta", allow_none=True)
        mlp_ratio = check_positive_real(mlp_ratio, "mlp_ratio")
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = _class_attention_cls()(
            dim, num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=drop
        )
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, drop=drop)
        if eta is not None:
            self.gamma1 = nn.Parameter(eta * torch.ones(dim))
            self.gamma2 = nn.Parameter(eta * torch.ones(dim))
        else:
            self.gamma1 = self.gamma2 = None
        self.tokens_norm = tokens_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_tokens_input(x, "x", self.norm1.normalized_shape[0])
        y = self.norm1(x)
        a = self.attn(y)
        upd = torch.cat([a[:, :1], y[:, 1:]], dim=1)
        if self.gamma1 is not None:
            upd = self.gamma1 * upd
        x = x + self.drop_path(upd)
        if self.tokens_norm:
            x = self.norm2(x)
        else:
            x = torch.cat([self.norm2(x[:, :1]), x[:, 1:]], dim=1)
        cls = self.mlp(x[:, :1])
        if self.gamma2 is not None:
            cls = self.gamma2 * cls
        return x + self.drop_path(torch.cat([cls, x[:, 1:]], dim=1))
