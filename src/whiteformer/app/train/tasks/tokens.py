"""Labelled token sequences read by a sequence classifier (the LRA stand-ins: ``pathfinder``,
``mnist-pixels``, ``shakespeare-plays``, ``shakespeare-pairs``; models ``tost_lra_*`` and
``transformer_lra_*``). The data fix the vocabulary, the length and the classes; ``model(x)`` gives
the (B, classes) logits, pairs (B, 2, L) included."""
from __future__ import annotations

import torch.nn as nn

from ...config import ConfigError
from .classification import ClassificationTask

__all__ = ["TokenClassificationTask"]


class TokenClassificationTask(ClassificationTask):
    """Cross-entropy classification of pixel / byte token sequences by a sequence classifier."""

    model_kinds = ("sequence classifier",)
    kind_hint = "; the dataset holds labelled token sequences: use a sequence classifier (tost_lra_*, transformer_lra_*)"

    @classmethod
    def model_kwargs(cls, ds, *, finetune=None, block_size=None):
        return {"vocab_size": ds.vocab_size, "max_len": ds.max_len}, {"num_classes": ds.num_classes}

    @classmethod
    def describe_data(cls, ds) -> str:
        return f"{ds.num_classes} classes, token sequences of {ds.max_len} (vocabulary {ds.vocab_size})"

    @classmethod
    def check_model(cls, model: nn.Module, ds) -> None:
        super().check_model(model, ds)
        vocab = getattr(model, "vocab_size", None)
        if vocab is None or vocab < ds.vocab_size:
            raise ConfigError(f"dataset {ds.name!r} holds token sequences of a vocabulary of {ds.vocab_size}; the model "
                              f"({type(model).__name__}) reads {vocab}")
