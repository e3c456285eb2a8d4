"""The classifier head's arguments of the vision models (their constructors and timm's
``reset_classifier(num_classes, global_pool=None)``): checked and recorded in one place."""
from __future__ import annotations

from typing import Optional

import torch.nn as nn

from .._checks import check_choice, check_int


def set_head_args(model: nn.Module, num_classes: int, global_pool: Optional[str]) -> None:
    """Check ``num_classes`` (>= 0; 0: no head) and ``global_pool`` ('token', 'avg' or None: unchanged,
    refused while the model has none, in its constructor), then record them on ``model`` and in its
    ``init_kwargs`` (what a saved model rebuilds)."""
    check_int(num_classes, "num_classes", 0)
    if global_pool is not None or not hasattr(model, "global_pool"):
        model.global_pool = check_choice(global_pool, "global_pool", ("token", "avg"))
    model.num_classes = num_classes
    if hasattr(model, "init_kwargs"):
        model.init_kwargs = {**model.init_kwargs, "num_classes": num_classes, "global_pool": model.global_pool}
