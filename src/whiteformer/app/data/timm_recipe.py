"""timm's RandAugment, Mixup / CutMix and random erasing behind the sample-then-apply interface of
the built-in versions (:mod:`.randaugment`, :mod:`.mixing`, :mod:`.erasing`).

timm draws from the global ``random`` / NumPy / torch generators; each call here runs under those
generators seeded from the step's parameters (:func:`seeded_global_rng`) and puts their states back
afterwards, so a run is reproducible from its seed and the model's own random streams (dropout) are
untouched. Imported only when timm and torchvision import (``aug_impl`` "timm" or "auto").
"""
from __future__ import annotations

import contextlib
import inspect
import random
from typing import Dict, Optional, Sequence

import numpy as np
import torch

__all__ = ["seeded_global_rng", "TimmRandAugment", "TimmMixup", "TimmRandomErasing"]


@contextlib.contextmanager
def seeded_global_rng(seed: int):
    """Run a block with Python's ``random``, NumPy's and torch's CPU generators seeded by ``seed``,
    then restore their states."""
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        seed = int(seed) & 0xFFFFFFFF
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def _seeds(n: int, generator: torch.Generator) -> Dict[str, torch.Tensor]:
    return {"seed": torch.randint(0, 2 ** 31, (n,), generator=generator)}


def _rows(params: Dict[str, torch.Tensor], sl: Optional[slice]) -> torch.Tensor:
    return params["seed"] if sl is None else params["seed"][sl]


class TimmRandAugment:
    """``timm.data.auto_augment.rand_augment_transform(spec, hparams)`` with the hyper-parameters
    ``timm.data.create_transform`` gives it (translation 45 % of the smaller side, fill = the mean
    colour), applied per image on [0, 1]-scaled (B, C, H, W) tensors through PIL."""

    def __init__(self, spec: str, mean: Sequence[float], img_size):
        from timm.data.auto_augment import rand_augment_transform

        size = min(img_size) if isinstance(img_size, (tuple, list)) else int(img_size)
        fill = tuple(min(255, round(255 * m)) for m in mean)
        self.grey = len(fill) == 1
        hparams = {"translate_const": int(size * 0.45), "img_mean": fill[0] if self.grey else fill}
        self.transform = rand_augment_transform(spec, hparams)

    def sample(self, n: int, generator: torch.Generator) -> Dict[str, torch.Tensor]:
        return _seeds(n, generator)

    def apply(self, x: torch.Tensor, params: Dict[str, torch.Tensor], sl: Optional[slice] = None) -> torch.Tensor:
        from PIL import Image

        seeds = _rows(params, sl)
        out = []
        for img, seed in zip(x, seeds.tolist()):
            arr = (img.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
            pil = Image.fromarray(arr[..., 0] if self.grey else arr, "L" if self.grey else "RGB")
            with seeded_global_rng(seed):
                pil = self.transform(pil)
            t = torch.from_numpy(np.asarray(pil, dtype=np.uint8).copy())
            out.append((t.unsqueeze(0) if t.dim() == 2 else t.permute(2, 0, 1)).to(x.dtype) / 255)
        return torch.stack(out).to(x.device)


class TimmMixup:
    """``timm.data.Mixup`` (keyword arguments as :class:`~.mixing.MixupCutmix`); one seed per step,
    offset by the slice's start so that each process mixes its own batch differently."""

    def __init__(self, mixup_alpha, cutmix_alpha, prob, switch_prob, mode, label_smoothing, num_classes):
        from timm.data import Mixup

        self.mixup = Mixup(mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha, prob=prob, switch_prob=switch_prob,
                           mode=mode, label_smoothing=label_smoothing, num_classes=num_classes)

    def sample(self, n: int, generator: torch.Generator) -> Dict[str, torch.Tensor]:
        return _seeds(1, generator)

    def apply(self, x: torch.Tensor, y: torch.Tensor, params: Dict[str, torch.Tensor], sl: Optional[slice] = None):
        if x.shape[0] % 2:
            raise ValueError(f"timm's Mixup needs an even batch per process, got {x.shape[0]}")
        with seeded_global_rng(int(params["seed"][0]) + ((sl.start or 0) if sl is not None else 0)):
            return self.mixup(x.clone(), y)


class TimmRandomErasing:
    """``timm.data.random_erasing.RandomErasing`` of normalised images, one seed per image."""

    def __init__(self, prob: float, mode: str, count: int):
        from timm.data.random_erasing import RandomErasing

        params = inspect.signature(RandomErasing).parameters
        kw = {"max_count": count} if "max_count" in params else {"count": count}
        if "device" in params:
            kw["device"] = "cpu"
        self.erasing = RandomErasing(probability=prob, mode=mode, **kw)

    def sample(self, n: int, generator: torch.Generator) -> Dict[str, torch.Tensor]:
        return _seeds(n, generator)

    def apply(self, x: torch.Tensor, params: Dict[str, torch.Tensor], sl: Optional[slice] = None) -> torch.Tensor:
        out = x.clone()
        for i, seed in enumerate(_rows(params, sl).tolist()):
            with seeded_global_rng(seed):
                out[i] = self.erasing(out[i])
        return out
