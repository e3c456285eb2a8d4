"""scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes, values 0..16).

Fixed stratified split (per class, a seeded permutation; ``test_fraction`` of each class goes to
the test split; default 20 %: 1438 train / 359 test). Nothing is downloaded: the data ship with
scikit-learn (``pip install whiteformer[data]``). Images are scaled to [0, 1] and normalised with
the mean and standard deviation of the training split (one channel); ``img_size`` resizes them
(bilinear) e.g. for larger patch sizes.
"""
from __future__ import annotations

from typing import Optional

import torch

from .base import ArrayDataset, stratified_split
from .registry import check_split, register_dataset

__all__ = ["load_digits_arrays", "digits"]

_CACHE: dict = {}


def load_digits_arrays():
    """(images (1797, 1, 8, 8) float32 in [0, 1], labels (1797,) int64) from scikit-learn."""
    if "data" not in _CACHE:
        try:
            from sklearn.datasets import load_digits
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError("the 'digits' dataset needs scikit-learn: pip install whiteformer[data]") from err
        d = load_digits()
        x = torch.as_tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
        y = torch.as_tensor(d.target, dtype=torch.long)
        _CACHE["data"] = (x, y)
    return _CACHE["data"]


@register_dataset("digits", help="scikit-learn's bundled 8x8 handwritten digits (1797), fixed stratified split")
def digits(split: str = "train", img_size: Optional[int] = None, test_fraction: float = 0.2,
           split_seed: int = 0) -> ArrayDataset:
    """Digits ``split`` ("train" / "test"; "val" = "test")."""
    split = check_split("digits", split)
    x, y = load_digits_arrays()
    train_idx, test_idx = stratified_split(y, test_fraction, split_seed)
    mean = float(x[train_idx].mean())
    std = float(x[train_idx].std())
    idx = train_idx if split == "train" else test_idx
    return ArrayDataset(x[idx], y[idx], 10, kind="image", mean=(mean,), std=(std,), img_size=img_size,
                        name=f"digits/{split}")
