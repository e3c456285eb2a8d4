"""Pathfinder (Linsley et al., 2018; LRA, Tay et al., 2021), generated here: are the two dots connected?

Each image (``img_size`` x ``img_size`` grey pixels, LRA: 32x32 read as 1024 tokens) holds two
**main** dashed curvy paths and ``num_distractors`` shorter dashed paths, none touching another or
itself (rejection sampling with a one-pixel margin), and two dots (3x3 squares):

- positive (label 1): the dots sit at both ends of the same main path;
- negative (label 0): one dot at an end of each main path.

Both classes thus show the same number of paths, dashes and dots; only the connection differs.
A path is a smooth random walk of unit steps: the heading changes by a turn that is an AR(1)
process (``turn = 0.5 * turn + N(0, curvature)``), a step that would leave the image reflects the
heading off the border. Dashes are ``dash`` pixels on, ``gap`` pixels off along the walk (``gap=0``
draws solid paths). Pixel values are 0 (background) and 255 (paths, dots); the tokens are the
pixel values in row-major order (vocabulary 256, nothing padded), as LRA's.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import numpy as np
import torch

from ..._checks import is_int
from .base import SequenceDataset
from .registry import check_split, register_dataset

__all__ = ["random_path", "generate_pathfinder", "pathfinder"]

_NEIGHBOURS = np.array([(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)])


def random_path(rng: np.random.Generator, size: int, length: int, curvature: float = 0.15,
                margin: int = 2, forbidden: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
    """Integer pixel coordinates (length + 1, 2) of one smooth random walk of unit steps (rows, cols),
    inside ``[margin, size - 1 - margin]``, consecutive points distinct. With a boolean image
    ``forbidden``, the walk is abandoned (None) when it enters a forbidden pixel or touches its own
    earlier points (more than 2 steps back, 8-neighbourhood)."""
    lo, hi = float(margin), float(size - 1 - margin)
    y, x = rng.uniform(lo, hi, 2).tolist()
    heading = float(rng.uniform(0.0, 2.0 * math.pi))
    noise = iter(rng.normal(0.0, curvature, 8 * length + 8).tolist())
    turn = 0.0
    pts = [(round(y), round(x))]
    if forbidden is not None and forbidden[pts[0]]:
        return None
    while len(pts) <= length:
        turn = 0.5 * turn + next(noise, 0.0)
        heading += turn
        dy, dx = math.sin(heading), math.cos(heading)
        # heading h walks (sin h, cos h): flipping the row step is h -> -h, the column step h -> pi - h
        if not lo <= y + dy <= hi:  # reflect off the top/bottom border
            heading, dy = -heading, -dy
        if not lo <= x + dx <= hi:  # reflect off the left/right border
            heading, dx = math.pi - heading, -dx
        y, x = min(max(y + dy, lo), hi), min(max(x + dx, lo), hi)
        r = (round(y), round(x))
        if r != pts[-1]:
            if forbidden is not None and (forbidden[r] or any(
                    abs(r[0] - a) <= 1 and abs(r[1] - b) <= 1 for a, b in pts[:-2])):
                return None
            pts.append(r)
    return np.array(pts, dtype=np.int64)


def _dilate(mask: np.ndarray) -> np.ndarray:
    """8-neighbourhood dilation of a boolean image."""
    out = mask.copy()
    h, w = mask.shape
    padded = np.pad(mask, 1)
    for dy, dx in _NEIGHBOURS:
        out |= padded[1 + dy:1 + dy + h, 1 + dx:1 + dx + w]
    return out


def _place(rng, size, length, curvature, occupied, tries) -> Optional[np.ndarray]:
    """A self-avoiding path whose pixels and end squares keep one pixel away from ``occupied``."""
    forbidden = _dilate(occupied)
    for _ in range(tries):
        pts = random_path(rng, size, length, curvature, forbidden=forbidden)
        # the 3x3 squares a dot may take at its ends must keep away from the other paths too
        if pts is not None and not (_footprint(pts, size) & forbidden).any():
            return pts
    return None


def _footprint(pts: np.ndarray, size: int) -> np.ndarray:
    """Pixels of a path with 3x3 squares at both ends (the space a dot may take)."""
    m = np.zeros((size, size), dtype=bool)
    m[pts[:, 0], pts[:, 1]] = True
    for end in (pts[0], pts[-1]):
        m[max(end[0] - 1, 0):end[0] + 2, max(end[1] - 1, 0):end[1] + 2] = True
    return m


def generate_pathfinder(rng: np.random.Generator, label: int, size: int = 32, length: int = 20,
                        distractor_length: int = 10, num_distractors: int = 2, dash: int = 2, gap: int = 1,
                        curvature: float = 0.15, max_tries: int = 200) -> Tuple[np.ndarray, List[np.ndarray]]:
    """One image (size, size) uint8 with the given ``label`` (1: dots connected) and its paths
    (main path A, main path B, then the distractors; each (n, 2) pixel coordinates; the dots are
    on A's ends (label 1) or on A's start and B's end (label 0))."""
    if label not in (0, 1):
        raise ValueError(f"label must be 0 or 1, got {label!r}")
    for _ in range(max_tries):
        occupied = np.zeros((size, size), dtype=bool)
        paths: List[np.ndarray] = []
        for i in range(2 + num_distractors):
            pts = _place(rng, size, length if i < 2 else distractor_length, curvature, occupied, 50)
            if pts is None:
                break
            paths.append(pts)
            occupied |= _footprint(pts, size)
        if len(paths) == 2 + num_distractors:
            break
    else:
        raise ValueError(f"could not place {2 + num_distractors} non-touching paths of length {length} in a "
                         f"{size}x{size} image; use fewer distractors or shorter paths")
    img = np.zeros((size, size), dtype=np.uint8)
    period = dash + gap
    for pts in paths:
        on = (np.arange(len(pts)) % period) < dash if gap > 0 else np.ones(len(pts), dtype=bool)
        img[pts[on, 0], pts[on, 1]] = 255
    dots = (paths[0][0], paths[0][-1]) if label == 1 else (paths[0][0], paths[1][-1])
    for y, x in dots:
        img[max(y - 1, 0):y + 2, max(x - 1, 0):x + 2] = 255
    return img, paths


@register_dataset("pathfinder", help="generated two-dot / dashed-path images read as pixel tokens (LRA Pathfinder)")
def pathfinder(split: str = "train", num_train: int = 4000, num_test: int = 1000, img_size: int = 32,
               length: int = 20, distractor_length: int = 10, num_distractors: int = 2, dash: int = 2,
               gap: int = 1, curvature: float = 0.15, seed: int = 0) -> SequenceDataset:
    """Generated Pathfinder ``split`` ("train" / "test"; "val" = "test"): pixel tokens (N, img_size**2),
    labels balanced (alternating 1, 0 before shuffling by index)."""
    split = check_split("pathfinder", split)
    n = num_train if split == "train" else num_test
    for name, v, low in (("num_" + split, n, 1), ("img_size", img_size, 8), ("length", length, 2),
                         ("distractor_length", distractor_length, 1), ("num_distractors", num_distractors, 0),
                         ("dash", dash, 1), ("gap", gap, 0)):
        if not is_int(v) or v < low:
            raise ValueError(f"pathfinder: {name} must be an int >= {low}, got {v!r}")
    rng = np.random.default_rng([seed, 0 if split == "train" else 1, 7])
    labels = rng.permutation(np.arange(n) % 2)
    images = np.stack([generate_pathfinder(rng, int(lab), img_size, length, distractor_length, num_distractors,
                                           dash, gap, curvature)[0] for lab in labels])
    tokens = torch.from_numpy(images.reshape(n, -1).astype(np.int64))
    lengths = torch.full((n,), tokens.shape[1], dtype=torch.long)
    return SequenceDataset(tokens, lengths, torch.from_numpy(labels.astype(np.int64)), 2,
                           [str(v) for v in range(256)], pad_id=None, name=f"pathfinder/{split}", kind="tokens",
                           classes=["disconnected", "connected"])
