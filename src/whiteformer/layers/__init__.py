"""Building blocks shared by the models (and by compression): timm keeps these in ``layers/``.

- :func:`to_2tuple`; :class:`PatchGrid` (non-overlapping patch geometry and image check);
- :func:`resample_abs_pos_embed` (position embedding to another grid, as timm);
- timm's feature API on any vision model of the zoo (:mod:`.features`): :func:`forward_intermediates`,
  :func:`prune_intermediate_layers`, :class:`FeatureGetterNet`, :func:`pretrained_cfg`, and
  :func:`token_states` (transformers' hidden states);
- :class:`GradCheckpointMixin` (timm's ``set_grad_checkpointing``: activation checkpointing of the blocks);
- :class:`LowRankLinear` (a linear through a rank-r bottleneck, the compressed MLP linears).

Sits above :mod:`whiteformer.attention` and below :mod:`whiteformer.models`.
"""
from .checkpointing import GradCheckpointMixin
from .features import (FeatureGetterNet, FeatureInfo, TimmFeatureMixin, feature_take_indices, forward_intermediates,
                       pretrained_cfg, prune_intermediate_layers, token_states)
from .helpers import to_2tuple
from .lowrank import LowRankLinear
from .patch import PatchGrid
from .pos_embed import resample_abs_pos_embed

__all__ = ["GradCheckpointMixin", "FeatureGetterNet", "FeatureInfo", "TimmFeatureMixin", "feature_take_indices",
           "forward_intermediates", "pretrained_cfg", "prune_intermediate_layers", "token_states", "to_2tuple", "LowRankLinear", "PatchGrid",
           "resample_abs_pos_embed"]
