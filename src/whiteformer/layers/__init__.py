"""Building blocks shared by the models: timm keeps these in ``layers/``.

- :func:`to_2tuple`; :class:`PatchGrid` (non-overlapping patch geometry and image check);
- :func:`resample_abs_pos_embed` (position embedding to another grid, as timm);
- timm's feature API on any vision model of the zoo (:mod:`.features`): :func:`forward_intermediates`,
  :func:`prune_intermediate_layers`, :class:`FeatureGetterNet`, :func:`pretrained_cfg`, and
  :func:`token_states` (transformers' hidden states);
- :class:`GradCheckpointMixin` (timm's ``set_grad_checkpointing``: activation checkpointing of the blocks);
- the blocks the model families share, one module each as timm: :mod:`.mlp` (:class:`Mlp`, CRATE's
  :class:`ISTA`), :mod:`.drop` (:class:`DropPath`), :mod:`.layer_scale` (:class:`LayerScale`),
  :mod:`.patch_embed` (XCiT's :class:`ConvPatchEmbed`), :mod:`.pos_embed`
  (:class:`FourierPositionalEncoding`), :mod:`.class_attn` (:class:`ClassAttentionBlock`). The generic
  pre-norm block with any registered attention is :class:`ViTBlock` (:mod:`.vit_block`, with XCiT's
  :class:`LocalPatchInteraction`), the attention-pooling readout :class:`ClassAttentionPool` (:mod:`.readout`); blocks whose
  parameter names follow an official checkpoint stay in their family file (``models/deit.py``
  ``Block``: ``ls1.gamma``, ``models/crate.py`` ``CRATEBlock``, ``models/vision.py`` ``Block``: ``gamma1``).

Sits above :mod:`whiteformer.attention` and below :mod:`whiteformer.models`.
"""
from .recompute import GradCheckpointMixin
from .class_attn import ClassAttentionBlock
from .drop import DropPath, drop_path
from .features import (FeatureGetterNet, FeatureInfo, TimmFeatureMixin, feature_take_indices, forward_intermediates,
                       pretrained_cfg, prune_intermediate_layers, token_states)
from .helpers import to_2tuple
from .layer_scale import LayerScale
from .mlp import ISTA, Mlp
from .patch import PatchGrid
from .patch_embed import ConvPatchEmbed
from .pos_embed import FourierPositionalEncoding, resample_abs_pos_embed
from .readout import ClassAttentionPool
from .vit_block import LocalPatchInteraction, ViTBlock

__all__ = ["GradCheckpointMixin", "FeatureGetterNet", "FeatureInfo", "TimmFeatureMixin", "feature_take_indices",
           "forward_intermediates", "pretrained_cfg", "prune_intermediate_layers", "token_states", "to_2tuple", "PatchGrid",
           "resample_abs_pos_embed", "Mlp", "ISTA", "DropPath", "drop_path", "LayerScale", "ConvPatchEmbed",
           "FourierPositionalEncoding", "ClassAttentionBlock", "ClassAttentionPool", "LocalPatchInteraction",
           "ViTBlock"]
