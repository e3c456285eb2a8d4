"""Small helpers on modules and values shared across the package (bottom layer, beside ``_checks``):
``eval_mode`` (a context), ``count_params``, ``to_jsonable`` and ``zero_padded``."""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.nn as nn

__all__ = ["eval_mode", "count_params", "to_jsonable", "zero_padded", "layer_scale_param", "apply_layer_scale"]


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put every submodule in eval mode inside the block and restore each one's own ``training``
    flag on exit (``model.train()`` after would also switch on what was frozen in eval mode)."""
    saved = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        yield model
    finally:
        for m, flag in saved:
            m.training = flag


def zero_padded(x: torch.Tensor, keep: Optional[torch.Tensor], token_dim: int = 1) -> torch.Tensor:
    """``x`` with its padded tokens set to 0: ``keep`` is a (B, N) bool keep-mask (True = real
    token; None returns ``x``), the tokens of ``x`` lie along ``token_dim`` (1 for (B, N, C), 2 for
    head-split (B, H, N, p)). Zeroing (not only masking scores) keeps NaN/inf held by a padded
    token out of every product with it, forward and backward."""
    if keep is None:
        return x
    shape = [keep.shape[0]] + [1] * (x.dim() - 1)
    shape[token_dim] = keep.shape[1]
    return x.masked_fill(~keep.reshape(shape), 0.0)


def layer_scale_param(dim: int, init_values: Optional[float]) -> Optional[nn.Parameter]:
    """Layer scale (CaiT): a per-channel gain ``gamma`` (dim,) filled with ``init_values``, or None
    (no layer scale) when ``init_values`` is None. The one definition behind
    :class:`whiteformer.layers.LayerScale` (timm's keys ``ls1.gamma``) and the blocks that keep the
    official ToST/CRATE keys ``gamma1``/``gamma2`` as plain parameters."""
    if init_values is None:
        return None
    return nn.Parameter(torch.full((dim,), float(init_values)))


def apply_layer_scale(gamma: Optional[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    """``gamma * y`` (gamma (C,) broadcast over (..., C)); ``y`` itself when ``gamma`` is None."""
    return y if gamma is None else gamma * y


def count_params(module: nn.Module) -> int:
    """Number of parameters of ``module``, each counted once (a tied weight once)."""
    return sum(p.numel() for p in module.parameters())


def to_jsonable(value: Any, where: str = "value", *, tensors: bool = False) -> Any:
    """``value`` as plain JSON types: lists for tuples, dicts with string keys for mappings.

    ``tensors=True`` (reports of measurements): tensors become (nested) lists, non-finite floats
    the strings "nan" / "inf" / "-inf", and other objects pass unchanged. ``tensors=False``
    (configs that must load back exactly): anything that is not None, bool, int, float, str, a
    list/tuple or a string-keyed mapping of those raises a ``TypeError`` naming ``where``.
    """
    if isinstance(value, float) and tensors and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v, f"{where}[{i}]", tensors=tensors) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                if not tensors:
                    raise TypeError(f"cannot save config: key {k!r} of {where} is not a string")
                k = str(k)
            out[k] = to_jsonable(v, f"{where}[{k!r}]", tensors=tensors)
        return out
    if tensors:
        return to_jsonable(value.tolist(), where, tensors=True) if isinstance(value, torch.Tensor) else value
    raise TypeError(
        f"cannot save config: constructor argument {where} = {value!r} ({type(value).__name__}) is not "
        "JSON-serialisable; pass plain values (numbers, strings, lists, dicts) to the constructor"
    )
