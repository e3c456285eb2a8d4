"""Reading one image file with Pillow (optional dependency, imported on first use), and timm's
evaluation crop (resize to ``size / crop_pct``, then the centre ``size``) in torch."""
from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["read_image", "resize_center_crop"]


def _pil():
    try:
        from PIL import Image
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the 'image-folder' dataset needs Pillow: pip install whiteformer[data]") from err
    return Image


def resize_center_crop(img: torch.Tensor, size: Tuple[int, int], crop_pct: float) -> torch.Tensor:
    """timm's evaluation transform (``Resize(int(s / crop_pct))`` then ``CenterCrop(s)``) of an
    image (C, H, W) -> (C, *size), same dtype (uint8 rounded).

    Square ``size`` (s, s): the shorter side is resized to ``floor(s / crop_pct)``, keeping the aspect
    ratio; otherwise both sides to ``floor(size / crop_pct)``. Bilinear, antialiased when shrinking.
    """
    h, w = img.shape[-2:]
    if size[0] == size[1]:
        short = math.floor(size[0] / crop_pct)
        scaled = (short, int(short * w / h)) if h <= w else (int(short * h / w), short)
    else:
        scaled = (math.floor(size[0] / crop_pct), math.floor(size[1] / crop_pct))
    x = img.float().unsqueeze(0)
    if scaled != (h, w):
        shrink = scaled[0] < h or scaled[1] < w
        x = F.interpolate(x, size=scaled, mode="bilinear", align_corners=False, antialias=shrink)
    top, left = int(round((scaled[0] - size[0]) / 2.0)), int(round((scaled[1] - size[1]) / 2.0))
    x = x[0, :, top:top + size[0], left:left + size[1]]
    if img.dtype == torch.uint8:
        x = x.round().clamp(0, 255)
    return x.to(img.dtype)


def read_image(path: str, mode: str, size: Tuple[int, int], crop_pct: Optional[float] = None,
               box: Optional[Callable[[int, int], Tuple[int, int, int, int]]] = None) -> torch.Tensor:
    """Image file -> uint8 tensor (C, H, W) in ``mode`` ("L" / "RGB") resized to ``size`` (h, w), or
    with ``crop_pct``, resized and centre-cropped to it (:func:`resize_center_crop`), or with ``box``
    (``box(height, width)`` -> (top, left, h, w) of the file's pixels), that box resized to ``size``."""
    Image = _pil()
    with Image.open(path) as im:
        im = im.convert(mode)
        if box is not None:
            top, left, h, w = box(im.size[1], im.size[0])
            im = im.resize((size[1], size[0]), Image.BILINEAR, box=(left, top, left + w, top + h))
        elif crop_pct is None and im.size != (size[1], size[0]):
            im = im.resize((size[1], size[0]), Image.BILINEAR)
        arr = np.asarray(im, dtype=np.uint8)
    t = torch.from_numpy(arr.copy())
    t = t.unsqueeze(0) if t.dim() == 2 else t.permute(2, 0, 1).contiguous()
    return t if crop_pct is None else resize_center_crop(t, size, crop_pct)
