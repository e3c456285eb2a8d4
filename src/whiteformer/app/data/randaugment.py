"""RandAugment on batches of [0, 1]-scaled images (B, C, H, W) in plain torch (no torchvision).

RandAugment (Cubuk, Zoph, Shlens, Le: "RandAugment: Practical automated data augmentation with a
reduced search space", arXiv:1909.13719): each image gets ``n`` operations drawn uniformly (with
replacement) from a fixed list, each applied with probability ``p`` at magnitude ``m`` (out of 10).
The configuration is timm's string, e.g. ``rand-m9-mstd0.5-inc1`` (DeiT, XCiT, ToST):

- ``m`` magnitude (default 10), ``n`` operations per image (default 2), ``p`` probability of each
  (default 0.5), ``mstd`` standard deviation of a Gaussian noise on the magnitude per operation
  (``inf``: uniform in [0, m]), ``mmax`` the magnitude's upper bound (default 10), ``inc1`` the
  "increasing" variants whose strength grows with the magnitude.

All 15 operations of timm's RandAugment are implemented on tensors: AutoContrast, Equalize, Invert,
Rotate (up to 30 degrees), Posterize, Solarize, SolarizeAdd, Color, Contrast, Brightness, Sharpness
(enhance factors in [0.1, 1.9]), ShearX / ShearY (up to 0.3), TranslateXRel / TranslateYRel (up to
45 % of the side). Differences from timm's PIL version: geometric operations always interpolate
bilinearly (timm draws bilinear or bicubic) and fill with the dataset's mean colour; the enhance
operations blend in float (PIL rounds to 8 bits after each).

As :class:`~.augment.Augment`, the random parameters of the whole global batch are drawn first
(:meth:`RandAugment.sample`) and applied to a slice of it (:meth:`RandAugment.apply`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

__all__ = ["RandAugment", "parse_rand_augment", "OPS", "INCREASING_OPS"]

#: the operations of ``inc0`` (strength not monotone in the magnitude for Posterize / Solarize / enhance)
OPS = ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "SolarizeAdd", "Color", "Contrast",
       "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")
#: the operations of ``inc1``
INCREASING_OPS = ("AutoContrast", "Equalize", "Invert", "Rotate", "PosterizeIncreasing", "SolarizeIncreasing",
                  "SolarizeAdd", "ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing",
                  "SharpnessIncreasing", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")

_DENOM = 10.0  # magnitudes are out of 10


def parse_rand_augment(spec: str) -> Dict[str, float]:
    """timm's RandAugment string (``rand-m9-n2-mstd0.5-mmax10-inc1-p0.5``) -> {"m", "n", "mstd",
    "mmax", "inc", "p"} (defaults m=10, n=2, mstd=0, mmax=10, inc=0, p=0.5); a ``ValueError`` names
    the part it cannot read."""
    if not isinstance(spec, str) or not spec.split("-")[0] == "rand":
        raise ValueError(f"auto_augment must be a RandAugment string such as 'rand-m9-mstd0.5-inc1', got {spec!r}")
    out: Dict[str, float] = {"m": 10.0, "n": 2, "mstd": 0.0, "mmax": 10.0, "inc": 0, "p": 0.5}
    for part in spec.split("-")[1:]:
        key = next((k for k in ("mstd", "mmax", "inc", "m", "n", "p") if part.startswith(k)), None)
        try:
            if key is None:
                raise ValueError
            value = float(part[len(key):])
        except ValueError:
            raise ValueError(f"auto_augment {spec!r}: cannot read {part!r} (known parts: m<magnitude>, n<ops>, "
                             f"mstd<std>, mmax<max>, inc<0|1>, p<probability>)") from None
        out[key] = value
    if not (math.isfinite(out["m"]) and 0 <= out["m"]):
        raise ValueError(f"auto_augment {spec!r}: the magnitude m must be >= 0")
    if not (out["n"] >= 1 and float(out["n"]).is_integer()):
        raise ValueError(f"auto_augment {spec!r}: the number of operations n must be an integer >= 1")
    if not out["mstd"] >= 0:
        raise ValueError(f"auto_augment {spec!r}: mstd must be >= 0 (inf: uniform magnitudes)")
    if not (math.isfinite(out["mmax"]) and out["mmax"] > 0):
        raise ValueError(f"auto_augment {spec!r}: mmax must be > 0")
    if out["inc"] not in (0, 1):
        raise ValueError(f"auto_augment {spec!r}: inc must be 0 or 1")
    if not 0 <= out["p"] <= 1:
        raise ValueError(f"auto_augment {spec!r}: p must be a probability in [0, 1]")
    out["n"], out["inc"] = int(out["n"]), int(out["inc"])
    return out


# ----------------------------------------------------------------------------- helpers
def _gray(x: torch.Tensor) -> torch.Tensor:
    """ITU-R 601-2 luma (PIL's "L" conversion) of (B, C, H, W) -> (B, 1, H, W)."""
    if x.shape[1] == 1:
        return x
    w = x.new_tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)
    return (x * w).sum(1, keepdim=True)


def _blend(degenerate: torch.Tensor, x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """PIL's ImageEnhance: ``degenerate + factor (x - degenerate)`` clamped to [0, 1]."""
    return (degenerate + factor.view(-1, 1, 1, 1) * (x - degenerate)).clamp(0, 1)


def _levels(x: torch.Tensor) -> torch.Tensor:
    return (x * 255).round().long().clamp(0, 255)


def _affine(x: torch.Tensor, coeffs: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """PIL's ``Image.transform(AFFINE, (a, b, c, d, e, f))`` on a batch: output pixel (X, Y) reads the
    input at (a X + b Y + c, d X + e Y + f) (pixel coordinates, centres at i + 0.5); outside: ``fill``.
    ``coeffs`` (B, 6)."""
    b, _, h, w = x.shape
    a, bb, c, d, e, f = coeffs.unbind(-1)
    # Normalised coordinates u = 2 X / W - 1 (align_corners=False) on both sides.
    row0 = torch.stack([a, bb * h / w, a + bb * h / w + 2 * c / w - 1], -1)
    row1 = torch.stack([d * w / h, e, d * w / h + e + 2 * f / h - 1], -1)
    theta = torch.stack([row0, row1], 1).to(x.dtype)
    grid = F.affine_grid(theta, [b, x.shape[1], h, w], align_corners=False)
    fill = fill.view(1, -1, 1, 1).to(x)
    return F.grid_sample(x - fill, grid, mode="bilinear", padding_mode="zeros", align_corners=False) + fill


def _const(v: torch.Tensor, value: float) -> torch.Tensor:
    return torch.full_like(v, value)


# ----------------------------------------------------------------------------- operations
def auto_contrast(x, v, fill):
    """Per image and channel, stretch [min, max] to [0, 1] (identity where min == max)."""
    lo = x.amin((2, 3), keepdim=True)
    hi = x.amax((2, 3), keepdim=True)
    scale = torch.where(hi > lo, 1.0 / (hi - lo).clamp_min(1e-12), torch.ones_like(hi))
    offset = torch.where(hi > lo, lo, torch.zeros_like(lo))
    return ((x - offset) * scale).clamp(0, 1)


def equalize(x, v, fill):
    """PIL's ImageOps.equalize per image and channel on the 256 levels: ``lut[i] = (step // 2 +
    #pixels below level i) // step``, ``step = (#pixels - #pixels at the highest level) // 255``."""
    b, c, h, w = x.shape
    q = _levels(x).view(b, c, -1)
    hist = torch.zeros(b, c, 256, dtype=torch.long, device=x.device).scatter_add_(-1, q, torch.ones_like(q))
    top = torch.where(hist > 0, torch.arange(256, device=x.device), 0).amax(-1, keepdim=True)
    step = (h * w - hist.gather(-1, top)) // 255  # (B, C, 1)
    below = hist.cumsum(-1) - hist
    lut = ((step // 2 + below) // step.clamp_min(1)).clamp(max=255)
    out = lut.gather(-1, q).view(b, c, h, w).to(x.dtype) / 255
    return torch.where((step > 0).view(b, c, 1, 1), out, x)


def invert(x, v, fill):
    return 1 - x


def posterize(x, bits, fill):
    """Keep the ``bits`` most significant bits of each 8-bit level (8 or more: unchanged)."""
    shift = (8 - bits.long()).clamp(0, 8).view(-1, 1, 1, 1)
    return ((_levels(x) >> shift) << shift).to(x.dtype) / 255


def solarize(x, thresh, fill):
    """Invert the 8-bit levels >= ``thresh``."""
    q = _levels(x)
    return torch.where(q >= thresh.view(-1, 1, 1, 1), 255 - q, q).to(x.dtype) / 255


def solarize_add(x, add, fill):
    """Add ``add`` to the 8-bit levels below 128 (capped at 255)."""
    q = _levels(x)
    return torch.where(q < 128, (q + add.long().view(-1, 1, 1, 1)).clamp(max=255), q).to(x.dtype) / 255


def color(x, f, fill):
    return _blend(_gray(x).expand_as(x), x, f)


def contrast(x, f, fill):
    return _blend(_gray(x).mean((1, 2, 3), keepdim=True).expand_as(x), x, f)


def brightness(x, f, fill):
    return _blend(torch.zeros_like(x), x, f)


def sharpness(x, f, fill):
    """Blend with PIL's SMOOTH filter ([[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13; border pixels kept)."""
    c = x.shape[1]
    k = x.new_tensor([[1.0, 1, 1], [1, 5, 1], [1, 1, 1]]) / 13
    smooth = F.conv2d(x, k.expand(c, 1, 3, 3), groups=c)
    degenerate = x.clone()
    degenerate[:, :, 1:-1, 1:-1] = smooth
    return _blend(degenerate, x, f)


def rotate(x, deg, fill):
    """Counter-clockwise rotation by ``deg`` degrees about the centre (PIL's ``Image.rotate``)."""
    h, w = x.shape[-2:]
    a = -torch.deg2rad(deg)
    cos, sin = torch.cos(a), torch.sin(a)
    cx, cy = w / 2.0, h / 2.0
    coeffs = torch.stack([cos, sin, cx - (cos * cx + sin * cy), -sin, cos, cy - (-sin * cx + cos * cy)], -1)
    return _affine(x, coeffs, fill)


def shear_x(x, s, fill):
    z, o = torch.zeros_like(s), torch.ones_like(s)
    return _affine(x, torch.stack([o, s, z, z, o, z], -1), fill)


def shear_y(x, s, fill):
    z, o = torch.zeros_like(s), torch.ones_like(s)
    return _affine(x, torch.stack([o, z, z, s, o, z], -1), fill)


def translate_x_rel(x, pct, fill):
    z, o = torch.zeros_like(pct), torch.ones_like(pct)
    return _affine(x, torch.stack([o, z, pct * x.shape[-1], z, o, z], -1), fill)


def translate_y_rel(x, pct, fill):
    z, o = torch.zeros_like(pct), torch.ones_like(pct)
    return _affine(x, torch.stack([o, z, z, z, o, pct * x.shape[-2]], -1), fill)


# magnitude m (B,) in [0, mmax], sign (B,) of +-1 -> the operation's argument (timm's level-to-arg maps)
def _enhance(m, s):
    return m / _DENOM * 1.8 + 0.1


def _enhance_inc(m, s):
    return (1.0 + s * m / _DENOM * 0.9).clamp_min(0.1)


def _posterize_bits(m, s):
    return (m / _DENOM * 4).floor()


def _solarize_thresh(m, s):
    return (m / _DENOM * 256).floor()


_OP_TABLE: Dict[str, Tuple[Callable, Optional[Callable]]] = {
    "AutoContrast": (auto_contrast, None),
    "Equalize": (equalize, None),
    "Invert": (invert, None),
    "Rotate": (rotate, lambda m, s: s * m / _DENOM * 30.0),
    "Posterize": (posterize, _posterize_bits),
    "PosterizeIncreasing": (posterize, lambda m, s: 4 - _posterize_bits(m, s)),
    "Solarize": (solarize, _solarize_thresh),
    "SolarizeIncreasing": (solarize, lambda m, s: 256 - _solarize_thresh(m, s)),
    "SolarizeAdd": (solarize_add, lambda m, s: (m / _DENOM * 110).floor()),
    "Color": (color, _enhance),
    "ColorIncreasing": (color, _enhance_inc),
    "Contrast": (contrast, _enhance),
    "ContrastIncreasing": (contrast, _enhance_inc),
    "Brightness": (brightness, _enhance),
    "BrightnessIncreasing": (brightness, _enhance_inc),
    "Sharpness": (sharpness, _enhance),
    "SharpnessIncreasing": (sharpness, _enhance_inc),
    "ShearX": (shear_x, lambda m, s: s * m / _DENOM * 0.3),
    "ShearY": (shear_y, lambda m, s: s * m / _DENOM * 0.3),
    "TranslateXRel": (translate_x_rel, lambda m, s: s * m / _DENOM * 0.45),
    "TranslateYRel": (translate_y_rel, lambda m, s: s * m / _DENOM * 0.45),
}


@dataclass
class RandAugment:
    """RandAugment of timm's string ``spec`` on [0, 1]-scaled images; ``fill`` (one value per
    channel, or one for all) is the colour that geometric operations move into the frame."""

    spec: str = "rand-m9-mstd0.5-inc1"
    fill: Sequence[float] = (0.5,)

    def __post_init__(self):
        cfg = parse_rand_augment(self.spec)
        self.magnitude, self.num_ops, self.mstd, self.mmax = cfg["m"], cfg["n"], cfg["mstd"], cfg["mmax"]
        self.prob = cfg["p"]
        self.ops = INCREASING_OPS if cfg["inc"] else OPS
        self._fill = torch.as_tensor(self.fill, dtype=torch.float32).reshape(-1)

    def sample(self, n: int, generator: torch.Generator) -> Dict[str, torch.Tensor]:
        """Parameters for n images, each (n, num_ops): ``op`` index into :attr:`ops`, ``apply``
        (bool), ``magnitude`` (clipped to [0, mmax]) and ``sign`` (+-1)."""
        shape = (n, self.num_ops)
        op = torch.randint(len(self.ops), shape, generator=generator)
        apply = torch.rand(shape, generator=generator) < self.prob
        if math.isinf(self.mstd):
            mag = torch.rand(shape, generator=generator, dtype=torch.float64) * self.magnitude
        else:
            mag = self.magnitude + self.mstd * torch.randn(shape, generator=generator, dtype=torch.float64)
        mag = mag.clamp(0.0, self.mmax).float()
        sign = torch.where(torch.rand(shape, generator=generator) < 0.5, 1.0, -1.0)
        return {"op": op, "apply": apply, "magnitude": mag, "sign": sign}

    def apply(self, x: torch.Tensor, params: Dict[str, torch.Tensor], sl: Optional[slice] = None) -> torch.Tensor:
        """Augment x (B, C, H, W) in [0, 1] with ``params`` (or their rows ``sl``: one rank's part)."""
        if sl is not None:
            params = {k: v[sl] for k, v in params.items()}
        if params["op"].shape[0] != x.shape[0]:
            raise ValueError(f"RandAugment parameters for {params['op'].shape[0]} images, got {x.shape[0]}")
        fill = self._fill.to(x.device)
        out = x.clone()
        for j in range(self.num_ops):
            for k, name in enumerate(self.ops):
                rows = torch.nonzero((params["op"][:, j] == k) & params["apply"][:, j]).flatten()
                if rows.numel() == 0:
                    continue
                fn, level = _OP_TABLE[name]
                m, s = params["magnitude"][rows, j], params["sign"][rows, j]
                arg = (level(m, s) if level is not None else m).to(x.device)
                rows = rows.to(x.device)
                out[rows] = fn(out[rows], arg, fill).to(out.dtype)
        return out
