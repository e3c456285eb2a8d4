"""Checks of the ``labels`` the :mod:`whiteformer.hf` wrappers hand to ``transformers``' losses.

A label that the loss cannot take (a wrong shape, a float where class indices are needed, an id
outside the vocabulary or the classes) is a ``ValueError`` / ``TypeError`` naming ``labels`` and what
was expected, before the model runs -- not an ``IndexError`` from inside ``torch``'s cross-entropy.
Value checks read the tensor, so they are skipped while ``torch.compile`` traces.
"""
from __future__ import annotations

import torch

from .._checks import check_integer_tensor, check_tensor
from .._compile import can_read_values

__all__ = ["check_lm_labels", "check_classification_labels"]


def _outside(labels: torch.Tensor, n: int, ignore_index: int) -> list:
    """The distinct values of ``labels`` outside [0, n) other than ``ignore_index`` (up to 5)."""
    if not can_read_values():
        return []
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= n))
    return sorted(set(labels[bad].tolist()))[:5] if bool(bad.any()) else []


def check_lm_labels(labels, input_ids: torch.Tensor, vocab_size: int, ignore_index: int = -100) -> None:
    """``labels`` of a causal language model: token ids (B, T), the shape of ``input_ids``, each in
    [0, vocab_size) or ``ignore_index`` (-100: not counted); ``transformers`` shifts them inside."""
    check_tensor(labels, "labels", floating=False)
    check_integer_tensor(labels, "labels", f"an integer tensor of token ids ({ignore_index} = ignored)")
    if tuple(labels.shape) != tuple(input_ids.shape):
        raise ValueError(f"labels must have the shape of input_ids {tuple(input_ids.shape)} (the next-token targets "
                         f"are shifted inside), got {tuple(labels.shape)}")
    bad = _outside(labels, vocab_size, ignore_index)
    if bad:
        raise ValueError(f"labels hold token ids outside [0, {vocab_size - 1}] (vocab_size {vocab_size}; "
                         f"{ignore_index} = ignored): {bad}")


def check_classification_labels(labels, logits: torch.Tensor, config) -> torch.Tensor:
    """``labels`` fit the loss ``transformers`` picks (``config.problem_type``, else from the labels'
    dtype): class indices (B,) or (B, 1) in [0, num_labels) (or -100) for single-label
    classification, (B, num_labels) floats for multi-label, (B,) or (B, 1) floats for regression
    (num_labels = 1). Returns the labels to use (class indices as int64, what cross-entropy takes)."""
    check_tensor(labels, "labels", floating=False)
    b, n = logits.shape[0], logits.shape[-1]
    kind = config.problem_type or ("regression" if n == 1 else "single_label_classification"
                                   if labels.dtype in (torch.long, torch.int) else "multi_label_classification")
    want = {"regression": ((b,), (b, 1)), "single_label_classification": ((b,), (b, 1)),
            "multi_label_classification": ((b, n),)}.get(kind)
    what = {"regression": "target values (float)", "single_label_classification": "class indices (integer)",
            "multi_label_classification": "0/1 targets per label (float)"}.get(kind)
    if want is not None and tuple(labels.shape) not in want:
        raise ValueError(f"labels must have shape {' or '.join(map(str, want))} ({what} for {kind}, batch {b}, "
                         f"{n} labels), got {tuple(labels.shape)} ({labels.dtype})")
    if kind == "single_label_classification":
        check_integer_tensor(labels, "labels", f"{what} for {kind}")
        bad = _outside(labels, n, -100)
        if bad:
            raise ValueError(f"labels must be class indices in [0, {n - 1}] ({n} labels; -100 = ignored), got {bad}")
        return labels.long()
    if kind in ("regression", "multi_label_classification") and not labels.is_floating_point():
        raise TypeError(f"labels must be {what} for {kind}, got {labels.dtype}")
    return labels
