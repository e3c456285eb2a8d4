"""Bounds on a model's size, checked from its constructor arguments before anything is built.

Sizes may come from an untrusted ``config.json`` (``from_pretrained``, ``eval --checkpoint``,
``AutoModel*.from_config``): ``depth: 200000`` or ``dim: 2**20`` must be refused at once, not after
minutes of building or at the allocator. :func:`whiteformer.models.registry.build_with_defaults`
refuses a model of more than :func:`max_depth` blocks, then counts its parameters on one model built
on the ``meta`` device (nothing is allocated) and refuses one above :func:`max_params` parameters,
with a ``ValueError`` naming the sizes.

Limits: :data:`MAX_PARAMS` (10 billion) and :data:`MAX_DEPTH` (1024 blocks), raised or lowered by the
environment variables ``WHITEFORMER_MAX_PARAMS`` / ``WHITEFORMER_MAX_DEPTH`` (positive integers).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Sequence

from .._checks import is_int, is_real

__all__ = ["MAX_PARAMS", "MAX_DEPTH", "max_params", "max_depth", "check_model_size"]

MAX_PARAMS = 10_000_000_000
MAX_DEPTH = 1024
ENV_MAX_PARAMS = "WHITEFORMER_MAX_PARAMS"
ENV_MAX_DEPTH = "WHITEFORMER_MAX_DEPTH"


def _env_limit(var: str, default: int) -> int:
    raw = os.environ.get(var)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip().replace("_", ""))
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"environment variable {var} must be a positive integer, got {raw!r}")
    return value


def max_params() -> int:
    """Largest parameter count a model may be built with: ``WHITEFORMER_MAX_PARAMS`` or :data:`MAX_PARAMS`."""
    return _env_limit(ENV_MAX_PARAMS, MAX_PARAMS)


def max_depth() -> int:
    """Largest number of blocks a model may be built with: ``WHITEFORMER_MAX_DEPTH`` or :data:`MAX_DEPTH`."""
    return _env_limit(ENV_MAX_DEPTH, MAX_DEPTH)


def check_model_size(model: str, args: Dict[str, Any], estimate: Optional[int],
                     depth_keys: Sequence[str] = ("depth",)) -> None:
    """Refuse (``ValueError``) a model whose blocks (the sum of ``args[k]`` over ``depth_keys``)
    exceed :func:`max_depth` or whose ``estimate`` (its parameter count, None: not known) exceeds :func:`max_params`.
    Sizes that are not numbers are left to the constructor's own checks."""
    blocks = [args.get(k) for k in depth_keys]
    depth = sum(b for b in blocks if is_int(b) and b > 0)
    limit = max_depth()
    if depth > limit:
        shown = ", ".join(f"{k}={args.get(k)!r}" for k in depth_keys if is_int(args.get(k)))
        raise ValueError(f"{model} with {shown} has more than {limit} blocks; refusing to build it (check the "
                         f"sizes, e.g. in its config.json; set {ENV_MAX_DEPTH} to raise the limit)")
    if estimate is None or not is_real(estimate):
        return
    limit = max_params()
    if estimate > limit:
        sizes = ", ".join(f"{k}={v!r}" for k, v in args.items() if is_int(v) or k == "img_size")
        raise ValueError(f"{model} ({sizes}) would have about {estimate:.3g} parameters, more than the limit of "
                         f"{limit:.3g}; refusing to build it (check the sizes, e.g. in its config.json; set "
                         f"{ENV_MAX_PARAMS} to raise the limit)")
