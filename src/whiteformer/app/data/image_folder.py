"""Users' own images in the standard class-per-subfolder layout, read with Pillow.

``data_dir/<split>/<class>/<image>`` (``split`` "train", "test" or "val", falling back to
``val`` for "test" and vice versa), or ``data_dir/<class>/<image>`` with a fixed stratified split
(``test_fraction``) when there are no split folders. Classes are the sorted subfolder names.
Images are converted to RGB (``in_chans=3``) or grey (``in_chans=1``), resized to ``img_size``
(bilinear) and normalised with ``mean`` / ``std`` (default ImageNet's for RGB, 0.5 for grey).
``crop_pct`` (e.g. 0.875, DeiT's and timm's): the evaluation splits ("test" / "val") are resized to
``img_size / crop_pct`` and centre-cropped to ``img_size`` instead (timm's evaluation transform).
Pillow is needed: ``pip install whiteformer[data]``.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

import torch

from ..._checks import is_real
from .base import FileImageDataset, stratified_split
from .images import read_image
from .registry import check_data_dir, register_dataset

__all__ = ["image_folder", "read_image", "IMAGE_EXTENSIONS"]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _class_dirs(root: Path) -> List[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def _scan(root: Path, classes: Optional[List[str]] = None) -> Tuple[List[str], List[str], List[int]]:
    classes = _class_dirs(root) if classes is None else classes
    files, labels = [], []
    for c, name in enumerate(classes):
        if not (root / name).is_dir():
            continue
        for f in sorted((root / name).rglob("*")):
            if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS:
                files.append(str(f))
                labels.append(c)
    return classes, files, labels


@register_dataset("image-folder", reads="directory",
                  help="class-per-subfolder images read with Pillow (data_dir[/split]/class/*.png)")
def image_folder(split: str = "train", data_dir: Optional[str] = None,
                 img_size: Optional[Union[int, Tuple[int, int]]] = 32,
                 in_chans: int = 3, mean: Optional[Sequence[float]] = None, std: Optional[Sequence[float]] = None,
                 test_fraction: float = 0.2, split_seed: int = 0, preload: bool = False,
                 crop_pct: Optional[float] = None) -> FileImageDataset:
    """Images under ``data_dir`` (see module docstring) for ``split`` ("train" / "test" / "val")."""
    if split not in ("train", "test", "val"):
        raise ValueError(f"dataset 'image-folder': unknown split {split!r}; expected 'train', 'test' or 'val'")
    if in_chans not in (1, 3):
        raise ValueError(f"in_chans must be 1 (grey) or 3 (RGB), got {in_chans!r}")
    if crop_pct is not None and not (is_real(crop_pct) and 0 < crop_pct <= 1):
        raise ValueError(f"crop_pct must be a number in (0, 1] (the evaluation crop's share of the resized "
                         f"image, e.g. 0.875), got {crop_pct!r}")
    root = check_data_dir(data_dir, "image-folder")
    split_dirs = {s: root / s for s in ("train", "test", "val") if (root / s).is_dir()}
    if split_dirs:
        alt = {"test": "val", "val": "test", "train": "train"}[split]
        d = split_dirs.get(split) or split_dirs.get(alt)
        if d is None:
            raise FileNotFoundError(f"image-folder: {str(root)!r} has split folders {sorted(split_dirs)} but no "
                                    f"{split!r} (or {alt!r}) folder")
        # Classes: the union over the split folders, so that labels agree between splits.
        classes = sorted(set().union(*(_class_dirs(p) for p in split_dirs.values())))
        classes, files, labels = _scan(d, classes)
        lab = torch.tensor(labels, dtype=torch.long)
    else:
        classes, files, labels = _scan(root)
        lab = torch.tensor(labels, dtype=torch.long)
        if files:
            tr, te = stratified_split(lab, test_fraction, split_seed)
            keep = tr if split == "train" else te
            files = [files[i] for i in keep.tolist()]
            lab = lab[keep]
    if not classes:
        raise ValueError(f"image-folder: no class subfolders in {str(root)!r} (expected DIR/<class>/<image> "
                         f"or DIR/<split>/<class>/<image>)")
    if not files:
        raise ValueError(f"image-folder: no image files ({', '.join(IMAGE_EXTENSIONS)}) for split {split!r} "
                         f"under {str(root)!r}")
    if mean is None:
        mean = IMAGENET_MEAN if in_chans == 3 else (0.5,)
    if std is None:
        std = IMAGENET_STD if in_chans == 3 else (0.5,)
    return FileImageDataset(files, lab, len(classes), img_size, in_chans, classes, mean, std, preload=preload,
                            name=f"image-folder/{split}", crop_pct=None if split == "train" else crop_pct)
