"""The vision recipe's built-in transforms (RandAugment, Mixup / CutMix, random erasing, repeated
augmentation, the crop_pct evaluation crop) and timm's, when timm imports."""
import math

import numpy as np
import pytest
import torch

from whiteformer.app.data import build_dataset
from whiteformer.app.data import randaugment as ra
from whiteformer.app.data.erasing import RandomErasing
from whiteformer.app.data.images import resize_center_crop
from whiteformer.app.data.mixing import MixupCutmix, smooth_one_hot, soft_target_cross_entropy
from whiteformer.app.data.randaugment import RandAugment, parse_rand_augment
from whiteformer.app.data.recipe import VisionRecipe, timm_available
from whiteformer.app.data.resized_crop import RandomResizedCrop
from whiteformer.app.data.sampler import RepeatAugSampler, repeated_indices


def _images(b=6, c=3, h=12, w=16, seed=0):
    return torch.rand(b, c, h, w, generator=torch.Generator().manual_seed(seed))


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- RandAugment
def test_parse_rand_augment_reads_timm_strings_and_names_bad_parts():
    cfg = parse_rand_augment("rand-m9-mstd0.5-inc1")
    assert cfg == {"m": 9.0, "n": 2, "mstd": 0.5, "mmax": 10.0, "inc": 1, "p": 0.5}
    assert parse_rand_augment("rand-n3-m7-p1")["n"] == 3
    assert math.isinf(parse_rand_augment("rand-m9-mstdinf")["mstd"])
    for bad, what in (("augmix-m5", "RandAugment string"), ("rand-m9-q2", "'q2'"), ("rand-n0", "n must be"),
                      ("rand-inc2", "inc must be"), ("rand-p1.5", "p must be")):
        with pytest.raises(ValueError, match=what):
            parse_rand_augment(bad)


def _pil_apply(x, fn):
    from PIL import Image

    arr = (x * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    out = [torch.from_numpy(np.asarray(fn(Image.fromarray(a))).copy()).permute(2, 0, 1) for a in arr]
    return torch.stack(out).float() / 255


def test_randaugment_operations_match_pil():
    """Each tensor operation against PIL's (which timm's RandAugment calls), on 8-bit images."""
    from PIL import Image, ImageEnhance, ImageOps

    x = (_images(2) * 255).round() / 255
    fill = torch.full((3,), 0.5)
    one = torch.ones(2)
    point = [  # exact on 8-bit levels, or within float-vs-uint8 rounding of the blends
        (ra.equalize(x, None, fill), ImageOps.equalize, 0.5),
        (ra.posterize(x, 3 * one, fill), lambda i: ImageOps.posterize(i, 3), 0.5),
        (ra.solarize(x, 100 * one, fill), lambda i: ImageOps.solarize(i, 100), 0.5),
        (ra.invert(x, None, fill), ImageOps.invert, 0.5),
        (ra.auto_contrast(x, None, fill), ImageOps.autocontrast, 1.5),
        (ra.color(x, 0.3 * one, fill), lambda i: ImageEnhance.Color(i).enhance(0.3), 1.5),
        (ra.contrast(x, 1.7 * one, fill), lambda i: ImageEnhance.Contrast(i).enhance(1.7), 1.5),
        (ra.brightness(x, 1.5 * one, fill), lambda i: ImageEnhance.Brightness(i).enhance(1.5), 1.5),
        (ra.sharpness(x, 1.8 * one, fill), lambda i: ImageEnhance.Sharpness(i).enhance(1.8), 1.5),
        (ra.translate_y_rel(x, 0.25 * one, fill),
         lambda i: i.transform(i.size, Image.AFFINE, (1, 0, 0, 0, 1, 3), resample=Image.BILINEAR,
                               fillcolor=(128,) * 3), 1.5),
    ]
    for mine, fn, tol in point:
        assert (mine - _pil_apply(x, fn)).abs().max() * 255 <= tol
    # Rotation / shear: bilinear interpolation agrees inside; PIL and grid_sample treat the border differently.
    rot = ra.rotate(x, 20 * one, fill)
    ref = _pil_apply(x, lambda i: i.rotate(20, resample=Image.BILINEAR, fillcolor=(128,) * 3))
    assert (rot - ref).abs().mean() * 255 < 3
    assert (rot - ref)[..., 4:8, 5:11].abs().max() * 255 < 2


def test_randaugment_is_reproducible_sliceable_and_in_range():
    aug = RandAugment("rand-m9-mstd0.5-inc1", fill=(0.4, 0.5, 0.6))
    assert aug.ops == ra.INCREASING_OPS and len(aug.ops) == 15
    x = _images(8)
    p1, p2 = aug.sample(8, _g(3)), aug.sample(8, _g(3))
    assert all(torch.equal(p1[k], p2[k]) for k in p1)
    full = aug.apply(x, p1)
    assert full.shape == x.shape and full.min() >= 0 and full.max() <= 1
    assert not torch.allclose(full, x)
    # One rank's slice of a global batch is augmented as in the whole batch.
    torch.testing.assert_close(aug.apply(x[4:], p1, slice(4, 8)), full[4:])
    # Probability 0: nothing changes; magnitudes stay within [0, mmax].
    assert torch.equal(RandAugment("rand-m9-p0").apply(x, RandAugment("rand-m9-p0").sample(8, _g())), x)
    assert p1["magnitude"].min() >= 0 and p1["magnitude"].max() <= 10


def test_randaugment_grey_images():
    aug = RandAugment("rand-m9-n3-p1", fill=(0.5,))
    x = _images(4, c=1)
    out = aug.apply(x, aug.sample(4, _g(1)))
    assert out.shape == x.shape and torch.isfinite(out).all()


# ----------------------------------------------------------------------------- Mixup / CutMix
@pytest.mark.parametrize("mode", ["batch", "elem"])
@pytest.mark.parametrize("alphas", [(0.8, 0.0), (0.0, 1.0), (0.8, 1.0)])
def test_mixup_targets_sum_to_one_with_smoothing(mode, alphas):
    k = 5
    mix = MixupCutmix(*alphas, mode=mode, label_smoothing=0.1, num_classes=k)
    x, y = _images(6), torch.tensor([0, 1, 2, 3, 4, 1])  # every image and its partner differ
    xm, t = mix.apply(x, y, mix.sample(6, _g(2)))
    assert xm.shape == x.shape and t.shape == (6, k)
    torch.testing.assert_close(t.sum(-1), torch.ones(6))
    assert t.min() >= 0.1 / k - 1e-6  # every class keeps the smoothing floor
    # The targets are lam-mixtures of the image's and its partner's (B - 1 - i) smoothed labels.
    s = smooth_one_hot(y, k, 0.1)
    d = s - s.flip(0)
    lam = ((t - s.flip(0)) * d).sum(-1) / (d * d).sum(-1)
    assert ((lam >= -1e-6) & (lam <= 1 + 1e-6)).all()
    torch.testing.assert_close(t, lam[:, None] * s + (1 - lam[:, None]) * s.flip(0))


def test_mixup_blends_and_cutmix_pastes_a_box():
    x, y = _images(4), torch.arange(4)
    mix = MixupCutmix(1.0, 0.0, label_smoothing=0.0, num_classes=4)
    p = mix.sample(4, _g(0))
    lam = float(p["lam"])
    xm, t = mix.apply(x, y, p)
    torch.testing.assert_close(xm, lam * x + (1 - lam) * x.flip(0))
    torch.testing.assert_close(t[0, 0], torch.tensor(lam))
    cut = MixupCutmix(0.0, 1.0, label_smoothing=0.0, num_classes=4)
    p = cut.sample(4, _g(1))
    xc, t = cut.apply(x, y, p)
    from_partner = (xc == x.flip(0)).all(1) & (xc != x).any(1)  # (B, H, W) pixels taken from the partner
    area = from_partner[0].float().mean()
    # lam is corrected to the pasted box's area.
    torch.testing.assert_close(t[0, 0], 1 - area)
    assert ((xc == x) | (xc == x.flip(0))).all()


def test_mixup_elem_slices_like_the_global_batch():
    mix = MixupCutmix(0.8, 1.0, mode="elem", num_classes=3)
    p = mix.sample(8, _g(5))
    assert p["lam"].shape == (8,)
    x, y = _images(4), torch.tensor([0, 1, 2, 0])
    a, ta = mix.apply(x, y, p, slice(4, 8))
    b, tb = mix.apply(x, y, {k: v[4:8] for k, v in p.items()})
    assert torch.equal(a, b) and torch.equal(ta, tb)


def test_soft_target_cross_entropy_equals_smoothed_cross_entropy():
    logits, y = torch.randn(5, 4, generator=_g()), torch.tensor([0, 1, 2, 3, 1])
    torch.testing.assert_close(soft_target_cross_entropy(logits, smooth_one_hot(y, 4, 0.1)),
                               torch.nn.functional.cross_entropy(logits, y, label_smoothing=0.1))


def test_mixup_checks_its_arguments():
    with pytest.raises(ValueError, match="one > 0"):
        MixupCutmix(0.0, 0.0)
    with pytest.raises(ValueError, match="mode must be"):
        MixupCutmix(mode="pair")


# ----------------------------------------------------------------------------- random erasing
@pytest.mark.parametrize("mode", ["const", "rand", "pixel"])
def test_random_erasing_changes_one_rectangle(mode):
    er = RandomErasing(prob=1.0, mode=mode)
    x = _images(3, h=16, w=16) + 5.0  # far from any fill value
    out = er.apply(x, er.sample(3, _g(4)))
    for i in range(3):
        changed = (out[i] != x[i]).any(0)
        assert changed.any()
        rows, cols = torch.nonzero(changed.any(1)).flatten(), torch.nonzero(changed.any(0)).flatten()
        box = changed[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
        assert box.all()  # one filled rectangle, nothing outside it
        assert changed.sum() == box.numel() and box.numel() < 16 * 16
        if mode == "const":
            assert (out[i][:, changed] == 0).all()


def test_random_erasing_probability_reproducibility_and_slices():
    x = _images(8)
    assert torch.equal(RandomErasing(prob=0.0).apply(x, RandomErasing(prob=0.0).sample(8, _g())), x)
    er = RandomErasing(prob=0.5, count=3)
    p = er.sample(8, _g(7))
    full = er.apply(x, p)
    assert torch.equal(full, er.apply(x, er.sample(8, _g(7))))
    assert torch.equal(er.apply(x[2:5], p, slice(2, 5)), full[2:5])
    with pytest.raises(ValueError, match="mode must be"):
        RandomErasing(mode="noise")


# ----------------------------------------------------------------------------- repeated augmentation
def test_repeated_indices_spread_copies_over_ranks():
    n, k, world = 10, 3, 4
    per_rank = repeated_indices(n, k, world, _g(0))
    assert per_rank.shape == (world, math.ceil(n * k / world))
    flat = per_rank.t().reshape(-1)[:n * k]  # the repeated permutation, read back
    perm = flat[::k]
    assert sorted(perm.tolist()) == list(range(n))
    assert torch.equal(flat, perm.repeat_interleave(k))
    # The k copies of the first image go to ranks 0, 1, 2.
    assert [per_rank[r, 0].item() for r in range(3)] == [perm[0].item()] * 3


def test_repeat_aug_sampler_per_rank_and_epochs():
    data = list(range(12))
    samplers = [RepeatAugSampler(data, num_replicas=2, rank=r, repeats=3, seed=1) for r in range(2)]
    got = [list(s) for s in samplers]
    assert all(len(g) == len(s) == 6 for g, s in zip(got, samplers))
    # Consecutive copies alternate between the ranks: rank 0 and rank 1 see the same first image.
    assert got[0][0] == got[1][0]
    samplers[0].set_epoch(1)
    assert list(samplers[0]) != got[0]
    with pytest.raises(ValueError, match="rank must be"):
        RepeatAugSampler(data, num_replicas=2, rank=2)


# ----------------------------------------------------------------------------- random resized crops
def test_resized_crop_boxes_follow_scale_and_ratio():
    rrc = RandomResizedCrop((0.2, 0.6), (0.5, 2.0))
    p = rrc.sample(200, _g(0))
    for i in range(200):
        top, left, h, w = rrc.box(p, i, 30, 40)
        assert 0 <= top <= 30 - h and 0 <= left <= 40 - w
        assert 0.2 * 1200 * 0.85 <= h * w <= 0.6 * 1200 * 1.15  # rounding of the sides
        assert 0.5 * 0.8 <= w / h <= 2.0 * 1.25
    # The whole image for scale 1 at its own ratio; the centred fallback when no draw fits.
    assert RandomResizedCrop((1, 1), (1, 1)).box(RandomResizedCrop((1, 1), (1, 1)).sample(1, _g()), 0, 8, 8) == (0, 0, 8, 8)
    wide = RandomResizedCrop((1, 1), (2, 2))
    assert wide.box(wide.sample(1, _g()), 0, 8, 8) == (2, 0, 4, 8)
    with pytest.raises(ValueError, match="crop_scale must be"):
        RandomResizedCrop((0.0, 1.0))


def test_resized_crop_on_tensors():
    x = _images(4, h=8, w=8)
    same = RandomResizedCrop((1, 1), (1, 1))
    torch.testing.assert_close(same.apply(x, same.sample(4, _g())), x)
    rrc = RandomResizedCrop((0.1, 0.5))
    p = rrc.sample(4, _g(1))
    out = rrc.apply(x, p)
    assert out.shape == x.shape and not torch.allclose(out, x)
    torch.testing.assert_close(rrc.apply(x[1:3], p, slice(1, 3)), out[1:3])


def test_image_folder_crops_the_files_own_pixels(tmp_path):
    """A box inside the black half of a 40x40 half-black, half-white file is black, although the
    image read whole at 8x8 mixes both halves."""
    pytest.importorskip("PIL")
    from PIL import Image

    arr = np.zeros((40, 40, 3), dtype=np.uint8)
    arr[:, 20:] = 255
    for c in ("a", "b"):
        (tmp_path / c).mkdir()
        Image.fromarray(arr).save(tmp_path / c / "0.png")
    ds = build_dataset("image-folder", "train", data_dir=str(tmp_path), img_size=8, test_fraction=0.5,
                       mean=(0.0,), std=(1.0,))
    rrc = RandomResizedCrop((0.1, 0.1), (1, 1))
    p = {"area": torch.full((1, 10), 0.1, dtype=torch.float64), "log_ratio": torch.zeros(1, 10, dtype=torch.float64),
         "top": torch.full((1, 10), 0.5, dtype=torch.float64), "left": torch.zeros(1, 10, dtype=torch.float64)}
    assert rrc.box(p, 0, 40, 40) == (14, 0, 13, 13)
    x, _ = ds.get_batch(torch.tensor([0]), crop=(rrc, p))
    assert x.shape == (1, 3, 8, 8) and (x == 0).all()
    whole, _ = ds.get_batch(torch.tensor([0]))
    assert (whole == 1).any() and (whole == 0).any()


# ----------------------------------------------------------------------------- crop_pct
@pytest.mark.parametrize("hw,size,crop,scaled", [((40, 60), (16, 16), 0.875, (18, 27)),
                                                 ((30, 20), (8, 8), 0.5, (24, 16)),
                                                 ((30, 20), (8, 12), 0.9, (8, 13))])
def test_resize_center_crop_sizes(hw, size, crop, scaled):
    img = torch.arange(hw[0] * hw[1], dtype=torch.float32).view(1, *hw).repeat(3, 1, 1)
    out = resize_center_crop(img, size, crop)
    assert out.shape == (3, *size)
    # The crop is the centre of the image resized to ``scaled``.
    ref = torch.nn.functional.interpolate(img[None], size=scaled, mode="bilinear", align_corners=False,
                                          antialias=scaled[0] < hw[0])[0]
    top, left = round((scaled[0] - size[0]) / 2), round((scaled[1] - size[1]) / 2)
    torch.testing.assert_close(out, ref[:, top:top + size[0], left:left + size[1]])


def _folder(root, n=4, size=(20, 14)):
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(root / c / f"{i}.png")


def test_image_folder_crop_pct_on_eval_splits_only(tmp_path):
    pytest.importorskip("PIL")
    _folder(tmp_path)
    kw = dict(data_dir=str(tmp_path), img_size=8, test_fraction=0.5)
    plain, tr = build_dataset("image-folder", "test", **kw), build_dataset("image-folder", "train", crop_pct=0.5, **kw)
    te = build_dataset("image-folder", "test", crop_pct=0.5, **kw)
    assert tr.crop_pct is None and te.crop_pct == 0.5
    x, _ = te.get_batch(torch.arange(len(te)))
    assert x.shape == (len(te), 3, 8, 8)
    assert not torch.allclose(x, plain.get_batch(torch.arange(len(te)))[0])
    for bad in (0, 1.5, "x"):
        with pytest.raises(ValueError, match="crop_pct must be"):
            build_dataset("image-folder", "test", crop_pct=bad, **kw)


# ----------------------------------------------------------------------------- options, timm
def test_recipe_options_are_checked():
    assert not VisionRecipe().active and VisionRecipe(aug_repeats=3).active
    for kw, what in (({"mixup": -0.1}, "mixup must be"), ({"reprob": 2}, "reprob must be"),
                     ({"remode": "x"}, "remode must be"), ({"aug_repeats": 1.5}, "aug_repeats must be"),
                     ({"aug_impl": "tf"}, "aug_impl must be"), ({"auto_augment": "rand-zz"}, "cannot read")):
        with pytest.raises(ValueError, match=what):
            VisionRecipe(**kw).check()


def test_recipe_builds_the_builtin_transforms():
    parts = VisionRecipe(auto_augment="rand-m9-mstd0.5-inc1", mixup=0.8, cutmix=1.0, reprob=0.25,
                         aug_impl="torch").build(10, [0.5, 0.5, 0.5], (8, 8))
    assert isinstance(parts["rand_augment"], RandAugment) and isinstance(parts["mixup"], MixupCutmix)
    assert isinstance(parts["erasing"], RandomErasing)


@pytest.mark.skipif(timm_available(), reason="timm imports here: the error for a missing timm cannot happen")
def test_aug_impl_timm_without_timm_is_a_clear_error():
    with pytest.raises(ValueError, match="aug_impl=timm needs timm and torchvision"):
        VisionRecipe(aug_impl="timm").check()
    assert VisionRecipe().impl == "torch"


@pytest.mark.skipif(not timm_available(), reason="timm's data pipeline needs timm and torchvision, not importable here")
def test_timm_transforms_are_reproducible_and_sliceable():
    parts = VisionRecipe(auto_augment="rand-m9-mstd0.5-inc1", mixup=0.8, cutmix=1.0, reprob=1.0,
                         aug_impl="timm").build(4, [0.485, 0.456, 0.406], (16, 16))
    x, y = _images(4, h=16, w=16), torch.tensor([0, 1, 2, 3])
    aug, er, mix = parts["rand_augment"], parts["erasing"], parts["mixup"]
    p = aug.sample(4, _g(0))
    a = aug.apply(x, p)
    assert a.shape == x.shape and torch.equal(a, aug.apply(x, aug.sample(4, _g(0))))
    assert torch.equal(aug.apply(x[2:], p, slice(2, 4)), a[2:])
    e = er.apply(a, er.sample(4, _g(1)))
    assert (e != a).any()
    xm, t = mix.apply(e, y, mix.sample(4, _g(2)))
    assert xm.shape == x.shape and t.shape == (4, 4)
    torch.testing.assert_close(t.sum(-1), torch.ones(4))
