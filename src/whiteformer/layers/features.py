"""timm's intermediate-feature API, shared by every vision family of the zoo.

A vision model implements it by providing (the *token-model protocol*):

- ``blocks``: its sequence of blocks, each (B, P + N, D) -> (B, P + N, D);
- ``_embed_grid(x)``: images (B, C, H, W) -> ``(tokens (B, P + N, D), (Hp, Wp))`` entering block 0;
- ``num_prefix_tokens``: P, the class tokens in front of the N = Hp * Wp patch tokens (0 for the
  ToST shell, whose class token joins after the blocks);
- ``_finish(x)``: the last block's output -> what ``forward_features`` returns.

On that protocol this module gives timm's semantics (``timm.models.vision_transformer``):
:func:`forward_intermediates` -> ``(final features, [selected block outputs])``,
:func:`prune_intermediate_layers`, :func:`token_states` (embeddings + every block's output, the
``hidden_states`` of ``transformers``) and :class:`FeatureGetterNet` (``create_model(...,
features_only=True)``).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from .._checks import check_choice, is_int

__all__ = ["feature_take_indices", "forward_intermediates", "prune_intermediate_layers", "token_states",
           "FeatureInfo", "FeatureGetterNet", "OUTPUT_FORMATS", "pretrained_cfg",
           "TimmFeatureMixin"]

OUTPUT_FORMATS = ("NCHW", "NLC")
Indices = Optional[Union[int, Sequence[int]]]


def feature_take_indices(depth: int, indices: Indices = None) -> Tuple[List[int], int]:
    """timm's block selection: None -> all, int n -> the last n, sequence -> those (negative ok).

    Returns ``(sorted indices, max index)``.
    """
    if indices is None:
        take = list(range(depth))
    elif is_int(indices):
        if not 0 < indices <= depth:
            raise ValueError(f"indices (last n blocks) must be in [1, {depth}], got {indices}")
        take = list(range(depth - indices, depth))
    else:
        take = []
        for i in indices:
            if not is_int(i):
                raise TypeError(f"indices must be ints (block indices), got {i!r}")
            j = i + depth if i < 0 else i
            if not 0 <= j < depth:
                raise ValueError(f"block index {i} is out of range for {depth} blocks")
            take.append(j)
        take = sorted(set(take))
    return take, (max(take) if take else -1)


def _run(model: nn.Module, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    run = getattr(model, "run_block", None)  # GradCheckpointMixin: checkpointed in training when enabled
    return run(block, x) if run is not None else block(x)


def forward_intermediates(model: nn.Module, x: torch.Tensor, indices: Indices = None, norm: bool = False,
                          stop_early: bool = False, output_fmt: str = "NCHW", intermediates_only: bool = False,
                          return_prefix_tokens: bool = False, inter_norm: Optional[nn.Module] = None,
                          block_fn: Optional[Callable[[int, nn.Module, torch.Tensor], torch.Tensor]] = None):
    """timm's ``forward_intermediates`` on the token-model protocol (module docstring).

    The outputs of the blocks ``indices`` (None: all, int n: the last n, list: those), their patch
    tokens as maps (B, D, Hp, Wp) (``output_fmt='NCHW'``) or tokens (B, N, D) ('NLC'), each through
    ``inter_norm`` when ``norm``; with ``return_prefix_tokens`` each is a pair (patch part, class
    tokens (B, P, D)). Returns the list when ``intermediates_only`` (the blocks after the last
    selected one are not run), else ``(final, list)`` with ``final`` = ``model._finish`` of the
    last block run (all blocks, or up to the last selected one with ``stop_early``), which without
    ``stop_early`` equals ``forward_features(x)``. Each block runs through ``model.run_block`` (activation
    checkpointing when enabled) unless ``block_fn(i, block, x)`` is given.
    """
    check_choice(output_fmt, "output_fmt", OUTPUT_FORMATS)
    take, max_index = feature_take_indices(len(model.blocks), indices)
    if norm and inter_norm is None:
        raise ValueError(f"{type(model).__name__} has no norm to apply to its intermediates; use norm=False")
    x, (hp, wp) = model._embed_grid(x)
    last = max_index if (stop_early or intermediates_only) else len(model.blocks) - 1
    npt = model.num_prefix_tokens
    inter: list = []
    for i in range(last + 1):
        blk = model.blocks[i]
        x = block_fn(i, blk, x) if block_fn is not None else _run(model, blk, x)
        if i in take:
            y = inter_norm(x) if norm else x
            prefix, y = y[:, :npt], y[:, npt:]
            if output_fmt == "NCHW":
                y = y.reshape(y.shape[0], hp, wp, -1).permute(0, 3, 1, 2).contiguous()
            inter.append((y, prefix) if return_prefix_tokens else y)
    if intermediates_only:
        return inter
    return model._finish(x), inter


def prune_intermediate_layers(model: nn.Module, indices: Indices = 1, prune_norm: bool = False,
                              prune_head: bool = True, head_modules: Sequence[str] = ()) -> List[int]:
    """timm's ``prune_intermediate_layers``: drop the blocks after the last of ``indices``; with
    ``prune_norm`` the final ``norm`` becomes an identity; with ``prune_head`` the classifier is
    removed (``reset_classifier(0)``) and the modules named in ``head_modules`` (e.g. class-attention
    blocks, ``fc_norm``) become identities / empty. Returns the kept indices (sorted).
    ``init_kwargs["depth"]`` follows, so a saved pruned model says how many blocks it has."""
    take, max_index = feature_take_indices(len(model.blocks), indices)
    model.blocks = model.blocks[: max_index + 1]
    if prune_norm and hasattr(model, "norm"):
        model.norm = nn.Identity()
    if prune_head:
        for name in head_modules:
            old = getattr(model, name)
            setattr(model, name, nn.ModuleList() if isinstance(old, nn.ModuleList) else nn.Identity())
        model.reset_classifier(0)
    if isinstance(getattr(model, "init_kwargs", None), dict) and "depth" in model.init_kwargs:
        model.init_kwargs = {**model.init_kwargs, "depth": max_index + 1}
    return take


def token_states(model: nn.Module, x: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Images -> ``(forward_features(x), [embeddings, block 1 output, ..., block L output])``,
    every state the full token sequence (B, P + N, D) (``transformers``' ``hidden_states``)."""
    x, _ = model._embed_grid(x)
    states = [x]
    for blk in model.blocks:
        x = _run(model, blk, x)
        states.append(x)
    return model._finish(x), states


class FeatureInfo(list):
    """timm's ``feature_info``: one dict per returned feature map (``num_chs``, ``reduction``,
    ``module``), with ``channels()`` and ``reduction()``."""

    def channels(self) -> List[int]:
        return [f["num_chs"] for f in self]

    def reduction(self) -> List[int]:
        return [f["reduction"] for f in self]

    def module_name(self) -> List[str]:
        return [f["module"] for f in self]


class FeatureGetterNet(nn.Module):
    """timm's ``FeatureGetterNet``: a model pruned after its last wanted block whose forward
    returns the feature maps of the blocks ``out_indices`` (``forward_intermediates(...,
    intermediates_only=True)``): a list of (B, D, Hp, Wp) ('NCHW') or (B, N, D) ('NLC').
    ``norm=True`` applies the model's final norm to each map."""

    def __init__(self, model: nn.Module, out_indices: Indices = None, output_fmt: str = "NCHW",
                 norm: bool = False):
        super().__init__()
        check_choice(output_fmt, "output_fmt", OUTPUT_FORMATS)
        if out_indices is None:  # timm's default for ViTs: the last 3 blocks
            out_indices = min(3, len(model.blocks))
        self.out_indices = model.prune_intermediate_layers(out_indices, prune_norm=not norm, prune_head=True)
        self.model = model
        self.output_fmt, self.norm = output_fmt, norm
        reduction = int(model.patch_embed.patch_size[0])
        self.feature_info = FeatureInfo(
            dict(num_chs=model.embed_dim, reduction=reduction, module=f"blocks.{i}") for i in self.out_indices)

    def forward(self, x: torch.Tensor) -> List[torch.Tensor]:
        return self.model.forward_intermediates(x, indices=self.out_indices, norm=self.norm,
                                                output_fmt=self.output_fmt, intermediates_only=True)


def pretrained_cfg(model: nn.Module, first_conv: str, classifier: str = "head", fixed_input_size: bool = True,
                   mean: Optional[Sequence[float]] = None, std: Optional[Sequence[float]] = None) -> Dict:
    """timm's ``pretrained_cfg`` of a model built here (no published weights: ``url`` / ``hf_hub_id``
    empty; ``create_model(pretrained=True, pretrained_cfg_overlay=...)`` names some): input size,
    interpolation, crop, mean/std (ImageNet's for 3 channels, 0.5 otherwise), number of classes,
    classifier and first-conv module names; ``fixed_input_size`` False for a model that takes other
    resolutions."""
    c = model.patch_embed.in_chans
    h, w = model.patch_embed.img_size
    if mean is None:
        mean = (0.485, 0.456, 0.406) if c == 3 else (0.5,) * c
    if std is None:
        std = (0.229, 0.224, 0.225) if c == 3 else (0.5,) * c
    return dict(architecture=getattr(model, "model_name", None) or type(model).__name__, url="", hf_hub_id="",
                input_size=(c, h, w), fixed_input_size=fixed_input_size, interpolation="bicubic", crop_pct=0.9,
                crop_mode="center", mean=tuple(mean), std=tuple(std), num_classes=model.num_classes,
                pool_size=None, first_conv=first_conv, classifier=classifier, license="apache-2.0")


class TimmFeatureMixin:
    """timm's model API for a vision model on the token-model protocol (module docstring):
    ``forward_intermediates``, ``prune_intermediate_layers``, ``forward_hidden_states``,
    ``group_matcher``, ``pretrained_cfg`` / ``default_cfg``, ``feature_info``.

    Class attributes a family sets: ``first_conv`` (its first conv / linear), ``head_modules``
    (modules removed with the head by ``prune_intermediate_layers``), ``fixed_input_size``,
    ``extra_groups`` (``group_matcher`` groups between the blocks and the final norm, e.g. ToST's
    class-attention blocks); ``_inter_norm()`` is the norm ``norm=True`` applies to intermediates.
    """

    first_conv: str = "patch_embed.proj"
    head_modules: Tuple[str, ...] = ()
    fixed_input_size: bool = True
    extra_groups: Tuple[str, ...] = ()

    def _inter_norm(self) -> Optional[nn.Module]:
        return self.norm

    def forward_intermediates(self, x: torch.Tensor, indices: Indices = None, return_prefix_tokens: bool = False,
                              norm: bool = False, stop_early: bool = False, output_fmt: str = "NCHW",
                              intermediates_only: bool = False):
        """timm's ``forward_intermediates``: see :func:`whiteformer.layers.features.forward_intermediates`.
        images (B, C, H, W) -> ``(forward_features output, [maps (B, D, Hp, Wp) or tokens (B, N, D)])``."""
        return forward_intermediates(self, x, indices, norm, stop_early, output_fmt, intermediates_only,
                                     return_prefix_tokens, self._inter_norm())

    def prune_intermediate_layers(self, indices: Indices = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> List[int]:
        """timm's: keep the blocks up to the last of ``indices`` (see
        :func:`whiteformer.layers.features.prune_intermediate_layers`); returns the kept indices."""
        return prune_intermediate_layers(self, indices, prune_norm, prune_head, self.head_modules)

    def forward_hidden_states(self, x: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """images -> ``(forward_features output, [embeddings, block outputs...])`` (B, P + N, D) each."""
        return token_states(self, x)

    def group_matcher(self, coarse: bool = False) -> Dict:
        """timm's parameter groups (layer-wise learning-rate decay): the stem, one group per block
        (``coarse``: the blocks' regex without the per-block split is the same here), then the final
        norm; the classifier falls in the last group."""
        groups: Dict = dict(stem=r"^cls_token|^pos_embed|^patch_embed", blocks=r"^blocks\.(\d+)")
        tail = (r"^norm|^fc_norm", (99999,))
        if not self.extra_groups:
            groups["blocks"] = [(r"^blocks\.(\d+)", None), tail]
        for name in self.extra_groups:
            groups[name] = [(rf"^{name}\.(\d+)", None), tail]
        return groups

    @property
    def feature_info(self) -> FeatureInfo:
        """timm's ``feature_info``: one entry per block (``blocks.i``, D channels, patch-size reduction)."""
        r = int(self.patch_embed.patch_size[0])
        return FeatureInfo(dict(num_chs=self.embed_dim, reduction=r, module=f"blocks.{i}")
                           for i in range(len(self.blocks)))

    @property
    def pretrained_cfg(self) -> Dict:
        """timm's ``pretrained_cfg`` (``default_cfg``): see :func:`whiteformer.layers.features.pretrained_cfg`."""
        own = self.__dict__.get("_pretrained_cfg")
        if own is not None:
            return own
        return pretrained_cfg(self, self.first_conv, "head", self.fixed_input_size)

    @pretrained_cfg.setter
    def pretrained_cfg(self, value: Dict) -> None:
        self.__dict__["_pretrained_cfg"] = dict(value)

    default_cfg = pretrained_cfg
