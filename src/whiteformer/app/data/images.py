"""Reading one image file with Pillow (optional dependency, imported on first use)."""
from __future__ import annotations

from typing import Tuple

import numpy as np
import torch

__all__ = ["read_image"]


def _pil():
    try:
        from PIL import Image
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the 'image-folder' dataset needs Pillow: pip install whiteformer[data]") from err
    return Image


def read_image(path: str, mode: str, size: Tuple[int, int]) -> torch.Tensor:
    """Image file -> uint8 tensor (C, H, W) in ``mode`` ("L" / "RGB") resized to ``size`` (h, w)."""
    Image = _pil()
    with Image.open(path) as im:
        im = im.convert(mode)
        if im.size != (size[1], size[0]):
            im = im.resize((size[1], size[0]), Image.BILINEAR)
        arr = np.asarray(im, dtype=np.uint8)
    t = torch.from_numpy(arr.copy())
    return t.unsqueeze(0) if t.dim() == 2 else t.permute(2, 0, 1).contiguous()
