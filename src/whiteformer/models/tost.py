"""Registered vision models on the ToST/XCiT shell (:class:`~whiteformer.models.vision.ToSTVision`).

Every entry point takes keyword overrides for any constructor argument, e.g. a small variant for
MNIST: ``create_model("tost_t12_p16", img_size=28, patch_size=4, depth=4, in_chans=1, num_classes=10)``.
Parameter counts below are for 1000 classes at 224 px (measured; the tests check them).

ToST (paper 001, Tables 2/5; official ``tost_cab_*``, qkv bias, eta 1.0 for 12 and 1e-5 for 24
blocks): T12 5.769M, S12 22.590M, T24 10.223M, S24 40.345M, M24 71.481M (the paper's Table 5 says
68.1M for ToST-M; the official code builds 71.48M, which is what we match). p8 variants have the
same counts minus the first conv stage (a little fewer parameters).

DMST (paper 002): ToST-T/S with DMSA (one ``Linear(D, H)`` membership per block instead of TSSA's
``temp``): 5.778M / 22.627M (the paper's Table I: 5.58M / 22.25M, with its own TSSA baselines at
5.57M / 22.20M; the difference to ours is the baseline count, the increment ~D*H*L is the same).

ECA (paper 003, Table 3): ECAttention blocks without MLP, ``x + alpha E(norm1(x)) - beta C(norm1(x))``
(Eq. 4 on pre-normalised features; alpha, beta are the layer's learned scales, no layer scale), the
same conv patch embedding, Fourier encoding and two class-attention blocks (with MLPs) as ToST.
Head dimension p (the columns of each subspace basis U_k, ``ECAttention(head_dim=...)``) as the
parameter counts of Table 3 require. Measured vs paper: T 1.910M vs 1.91M, S 7.204M vs 7.2M,
M 14.72M vs 14.7M, B 21.04M vs 21.0M, B+ 57.71M vs 57.7M, L 70.31M vs 70M. Table 3 is not
self-consistent for T/S and B: it lists p 48 for T/S (= d / K), but their counts come out only with
p = 64 (p = 48 gives 1.763M / 6.614M, exactly 4 d^2 fewer: L d (64 K - d) = 4 d^2), so T/S are
built with p = 64; it lists p 64 for B, but with p = 64 ECA-B would have 33.6M (the bases alone
L d K p = 25.2M), and 21.0M comes out only with p = d / K = 32, so B is built with p = 32 (as
the paper's Algorithm 3 defaults it). Without public code we follow the counts.

Baselines on the same shell: ``xcit_s12_p16`` (XCA, no LPI; = official ``xcit_cab_small_12_p16``,
26.14M: its qkv is (3D, D)) and ``vit_cab_s12_p16`` (softmax MHSA, 6 heads, 26.14M).
"""
from __future__ import annotations

from typing import Any, Dict

from .registry import build_with_defaults, register_model
from .vision import ToSTVision

__all__: list = []


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
