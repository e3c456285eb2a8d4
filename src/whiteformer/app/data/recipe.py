"""The image-classification training recipe of DeiT / XCiT / ToST behind options, all off by default:
random resized crops (``crop_scale``, ``crop_ratio``), RandAugment (``auto_augment``), Mixup /
CutMix with label smoothing (``mixup``, ``cutmix``, ``mixup_prob``, ``mixup_switch_prob``,
``mixup_mode``, ``label_smoothing``), random erasing (``reprob``, ``remode``, ``recount``) and
repeated augmentation (``aug_repeats``); the evaluation crop (``crop_pct``) is an option of the
``image-folder`` dataset.

Two implementations of the same sample-then-apply interface (``sample(n, generator)`` for a global
batch, ``apply(..., params, sl)`` on one process's slice), chosen by ``aug_impl``:

- ``"timm"``: timm's own transforms: the RandAugment that ``timm.data.create_transform`` builds for
  ``auto_augment`` (``rand_augment_transform`` with create_transform's hyper-parameters, on PIL
  images), ``timm.data.Mixup`` and ``timm.data.random_erasing.RandomErasing``; their global random
  state (``random``, NumPy, torch) is seeded per step and image and restored afterwards.
  Needs timm and torchvision.
- ``"torch"``: the built-in versions in plain torch (:mod:`.randaugment`, :mod:`.mixing`,
  :mod:`.erasing`), which run without torchvision.
- ``"auto"`` (default): timm when it imports, else the built-in versions.

Random resized crops (:mod:`.resized_crop`, torchvision's algorithm, read from the files' own
pixels) and repeated augmentation (:mod:`.sampler`) are the built-in ones in both.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional, Sequence

from ..._checks import is_int, is_real
from .erasing import ERASE_MODES, RandomErasing
from .mixing import MIXUP_MODES, MixupCutmix
from .randaugment import RandAugment, parse_rand_augment
from .resized_crop import RandomResizedCrop, check_crop_range

__all__ = ["VisionRecipe", "AUG_IMPLS", "timm_available"]

AUG_IMPLS = ("auto", "timm", "torch")


@functools.lru_cache(maxsize=None)
def timm_available() -> bool:
    """Whether timm's data pipeline imports (it needs torchvision); tried once per process."""
    try:
        import timm.data  # noqa: F401
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure to import means: not usable here
        return False
    return True


def _prob(value, name: str) -> None:
    if not (is_real(value) and 0 <= value <= 1):
        raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")


@dataclass
class VisionRecipe:
    """The recipe's options (names as timm's ``train.py``); :meth:`check` validates them,
    :meth:`build` makes the transforms."""

    crop_scale: Optional[Sequence[float]] = None
    crop_ratio: Sequence[float] = (3 / 4, 4 / 3)
    auto_augment: Optional[str] = None
    mixup: float = 0.0
    cutmix: float = 0.0
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5
    mixup_mode: str = "batch"
    label_smoothing: float = 0.0
    reprob: float = 0.0
    remode: str = "pixel"
    recount: int = 1
    aug_repeats: int = 0
    aug_impl: str = "auto"

    @classmethod
    def from_options(cls, options: Dict[str, Any]) -> "VisionRecipe":
        """The recipe of the options of that name in ``options`` (others ignored; None: the default)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in options.items() if k in names and v is not None})

    def check(self) -> "VisionRecipe":
        """A ``ValueError`` naming the first option out of range (timm: only when ``aug_impl="timm"``
        and it does not import)."""
        if self.crop_scale is not None:
            check_crop_range(self.crop_scale, "crop_scale", 0.0, 1.0)
        check_crop_range(self.crop_ratio, "crop_ratio", 0.0, math.inf)
        if self.auto_augment is not None:
            parse_rand_augment(self.auto_augment)
        for name in ("mixup", "cutmix"):
            v = getattr(self, name)
            if not (is_real(v) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a Beta alpha >= 0 (0: off), got {v!r}")
        _prob(self.mixup_prob, "mixup_prob")
        _prob(self.mixup_switch_prob, "mixup_switch_prob")
        _prob(self.reprob, "reprob")
        if not (is_real(self.label_smoothing) and 0 <= self.label_smoothing < 1):
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing!r}")
        if self.mixup_mode not in MIXUP_MODES:
            raise ValueError(f"mixup_mode must be one of {', '.join(MIXUP_MODES)}, got {self.mixup_mode!r}")
        if self.remode not in ERASE_MODES:
            raise ValueError(f"remode must be one of {', '.join(ERASE_MODES)}, got {self.remode!r}")
        if not (is_int(self.recount) and self.recount >= 1):
            raise ValueError(f"recount must be an integer >= 1 (rectangles per erased image), got {self.recount!r}")
        if not (is_int(self.aug_repeats) and self.aug_repeats >= 0):
            raise ValueError(f"aug_repeats must be an integer >= 0 (0 or 1: off; DeiT uses 3), got {self.aug_repeats!r}")
        if self.aug_impl not in AUG_IMPLS:
            raise ValueError(f"aug_impl must be one of {', '.join(AUG_IMPLS)}, got {self.aug_impl!r}")
        if self.aug_impl == "timm" and not timm_available():
            raise ValueError("aug_impl=timm needs timm and torchvision (pip install timm torchvision); "
                             "aug_impl=torch uses the built-in transforms")
        return self

    @property
    def mixes(self) -> bool:
        return self.mixup > 0 or self.cutmix > 0

    @property
    def active(self) -> bool:
        """Whether any option is on (label smoothing alone is the loss's, not an augmentation)."""
        return (self.crop_scale is not None or self.auto_augment is not None or self.mixes or self.reprob > 0
                or self.aug_repeats > 1)

    @property
    def impl(self) -> str:
        """"timm" or "torch": the implementation ``aug_impl`` resolves to here."""
        if self.aug_impl == "auto":
            return "timm" if timm_available() else "torch"
        return self.aug_impl

    def describe(self) -> str:
        """One line naming the parts that are on and the implementation, e.g. ``RandAugment
        rand-m9-mstd0.5-inc1, Mixup 0.8 / CutMix 1.0 per batch (targets smoothed 0.1), ... (built-in)``."""
        parts = []
        if self.crop_scale is not None:
            parts.append(f"random resized crops (area {self.crop_scale[0]:g}-{self.crop_scale[1]:g}, ratio "
                         f"{self.crop_ratio[0]:.3g}-{self.crop_ratio[1]:.3g})")
        if self.auto_augment is not None:
            parts.append(f"RandAugment {self.auto_augment}")
        if self.mixes:
            parts.append(f"Mixup {self.mixup:g} / CutMix {self.cutmix:g} per {self.mixup_mode} "
                         f"(targets smoothed {self.label_smoothing:g})")
        if self.reprob > 0:
            parts.append(f"random erasing {self.reprob:g} ({self.remode}, up to {self.recount})")
        if self.aug_repeats > 1:
            parts.append(f"repeated augmentation x{self.aug_repeats}")
        return ", ".join(parts) + (" (timm)" if self.impl == "timm" else " (built-in)")

    def build(self, num_classes: int, mean: Sequence[float], img_size) -> Dict[str, Any]:
        """{"resized_crop", "rand_augment", "mixup", "erasing"}: each None when off, else an object with
        ``sample`` and ``apply`` (see the module docstring). ``mean``: the colour geometric operations
        fill with."""
        self.check()
        timm = self.impl == "timm"
        if timm:
            from . import timm_recipe as T
        out: Dict[str, Any] = {"resized_crop": None, "rand_augment": None, "mixup": None, "erasing": None}
        if self.crop_scale is not None:
            out["resized_crop"] = RandomResizedCrop(self.crop_scale, self.crop_ratio)
        if self.auto_augment is not None:
            out["rand_augment"] = (T.TimmRandAugment(self.auto_augment, mean, img_size) if timm
                                   else RandAugment(self.auto_augment, tuple(mean)))
        if self.mixes:
            kw = dict(mixup_alpha=self.mixup, cutmix_alpha=self.cutmix, prob=self.mixup_prob,
                      switch_prob=self.mixup_switch_prob, mode=self.mixup_mode,
                      label_smoothing=self.label_smoothing, num_classes=num_classes)
            out["mixup"] = T.TimmMixup(**kw) if timm else MixupCutmix(**kw)
        if self.reprob > 0:
            kw = dict(prob=self.reprob, mode=self.remode, count=self.recount)
            out["erasing"] = T.TimmRandomErasing(**kw) if timm else RandomErasing(**kw)
        return out
