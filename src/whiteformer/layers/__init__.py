"""Building blocks shared by the models (and by compression): timm keeps these in ``layers/``.

- :func:`to_2tuple`; :class:`PatchGrid` (non-overlapping patch geometry and image check);
- :func:`resample_abs_pos_embed` (position embedding to another grid, as timm);
- :func:`feature_take_indices`, :func:`vit_forward_intermediates` (timm's ``forward_intermediates``);
- :class:`GradCheckpointMixin` (timm's ``set_grad_checkpointing``: activation checkpointing of the blocks);
- :class:`LowRankLinear` (a linear through a rank-r bottleneck, the compressed MLP linears).

Sits above :mod:`whiteformer.attention` and below :mod:`whiteformer.models`.
"""
from .checkpointing import GradCheckpointMixin
from .features import feature_take_indices, vit_forward_intermediates
from .helpers import to_2tuple
from .lowrank import LowRankLinear
from .patch import PatchGrid
from .pos_embed import resample_abs_pos_embed

__all__ = ["GradCheckpointMixin", "feature_take_indices", "vit_forward_intermediates", "to_2tuple", "LowRankLinear", "PatchGrid",
           "resample_abs_pos_embed"]
