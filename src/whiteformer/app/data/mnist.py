"""MNIST read from the standard IDX files (LeCun et al.), raw or gzip-compressed.

``data_dir`` must hold ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
``t10k-images-idx3-ubyte`` and ``t10k-labels-idx1-ubyte`` (each optionally ``.gz``; the
``train-images.idx3-ubyte`` spelling is accepted too). Nothing is downloaded. IDX format: a
big-endian magic number ``0x0000 08 <ndim>`` (unsigned bytes), ``ndim`` big-endian int32 sizes,
then the data. Images are kept as uint8 (N, 1, 28, 28) and normalised at fetch time with the
usual MNIST statistics (mean 0.1307, std 0.3081); ``img_size`` resizes (e.g. 32 for patch 16 / 8).
"""
from __future__ import annotations

import gzip
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .base import ArrayDataset
from .registry import check_data_dir, check_split, register_dataset

__all__ = ["read_idx", "find_idx_file", "mnist"]

MEAN, STD = 0.1307, 0.3081
_PREFIX = {"train": "train", "test": "t10k"}


def read_idx(path) -> np.ndarray:
    """Read an IDX file (raw or .gz) of unsigned bytes into an array of its shape."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{str(path)!r} is not an IDX file (bad magic number)")
    if raw[2] != 0x08:
        raise ValueError(f"{str(path)!r}: only unsigned-byte IDX files are supported (type 0x{raw[2]:02x})")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{str(path)!r} is truncated (header)")
    shape = tuple(int(v) for v in np.frombuffer(raw[4:header], dtype=">i4"))
    n = int(np.prod(shape))
    if len(raw) - header != n:
        raise ValueError(f"{str(path)!r} is truncated or corrupt: {len(raw) - header} data bytes, expected {n} "
                         f"for shape {shape}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def find_idx_file(data_dir: Path, prefix: str, what: str) -> Path:
    """``<prefix>-<what>-idx?-ubyte[.gz]`` (or ``<prefix>-<what>.idx?-ubyte[.gz]``) in data_dir."""
    ndim = 3 if what == "images" else 1
    names = [f"{prefix}-{what}-idx{ndim}-ubyte", f"{prefix}-{what}.idx{ndim}-ubyte"]
    for name in names:
        for candidate in (name, name + ".gz"):
            if (data_dir / candidate).is_file():
                return data_dir / candidate
    raise FileNotFoundError(f"MNIST file {names[0]}[.gz] not found in {str(data_dir)!r}; the directory must "
                            f"hold the four standard IDX files (train-/t10k- images and labels)")


@register_dataset("mnist", reads="directory", help="MNIST from the standard IDX files (raw or .gz) in data_dir")
def mnist(split: str = "train", data_dir: Optional[str] = None, img_size: Optional[int] = None,
          limit: Optional[int] = None) -> ArrayDataset:
    """MNIST ``split`` ("train": 60k, "test": 10k; "val" = "test"); ``limit`` keeps the first n."""
    split = check_split("mnist", split)
    root = check_data_dir(data_dir, "mnist")
    images = read_idx(find_idx_file(root, _PREFIX[split], "images"))
    labels = read_idx(find_idx_file(root, _PREFIX[split], "labels"))
    if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
        raise ValueError(f"MNIST {split}: images {images.shape} and labels {labels.shape} do not match")
    if limit is not None:
        if limit <= 0:
            raise ValueError(f"limit must be a positive integer, got {limit!r}")
        images, labels = images[:limit], labels[:limit]
    x = torch.from_numpy(images.copy()).unsqueeze(1)
    y = torch.from_numpy(labels.astype(np.int64))
    return ArrayDataset(x, y, 10, kind="image", mean=(MEAN,), std=(STD,), scale=255.0, img_size=img_size,
                        name=f"mnist/{split}")


@register_dataset("mnist-pixels", reads="directory",
                  help="sequential MNIST: 784 pixel tokens per image (LRA Image stand-in), IDX files in data_dir")
def mnist_pixels(split: str = "train", data_dir: Optional[str] = None, limit: Optional[int] = None,
                 img_size: Optional[int] = None):
    """Sequential MNIST: each image as its 784 pixel values (0..255) in row-major order, one token
    per pixel (vocabulary 256, nothing padded). The stand-in for LRA Image (sequential CIFAR-10
    grey pixels, 1024 tokens) on the data available offline; same files as ``mnist``. ``img_size``
    resizes first (antialiased; e.g. 14 -> 196 tokens for a small compute budget)."""
    from .base import SequenceDataset, resize_images

    ds = mnist(split, data_dir=data_dir, limit=limit)
    images = ds.data
    if img_size is not None:
        images = resize_images(images.float(), (int(img_size), int(img_size))).round().clamp(0, 255).to(torch.uint8)
    tokens = images.reshape(len(ds), -1).long()
    lengths = torch.full((len(ds),), tokens.shape[1], dtype=torch.long)
    return SequenceDataset(tokens, lengths, ds.labels, 10, [str(v) for v in range(256)], pad_id=None,
                           name=f"mnist-pixels/{split}", kind="tokens")
