"""The vision recipe in the image-classification task and the train command: batches per process,
repeated augmentation's order, soft-target loss, option errors, and a short run on an ImageFolder."""
import numpy as np
import pytest
import torch

from whiteformer.app.cli import main
from whiteformer.app.data.recipe import timm_available
from whiteformer.app.train import ConfigError, TrainConfig, train
from whiteformer.app.train.build import build_task
from whiteformer.app.train.distributed import DistInfo

RECIPE = dict(crop_scale=[0.3, 1.0], auto_augment="rand-m9-mstd0.5-inc1", reprob=0.5, remode="pixel",
              aug_impl="torch")
TINY = {"patch_size": 2, "embed_dim": 16, "depth": 1, "num_heads": 2, "cls_attn_layers": 1}


@pytest.fixture
def folder(tmp_path):
    pytest.importorskip("PIL")
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 6), ("val", 2)):
        for c in ("a", "b", "c"):
            (tmp_path / split / c).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)).save(tmp_path / split / c / f"{i}.png")
    return str(tmp_path)


def _task(folder, world=1, rank=0, **kw):
    dist = DistInfo(rank=rank, world_size=world)
    return build_task("image-folder", data_dir=folder, data_args={"img_size": 8, "crop_pct": 0.875},
                      eval_split="val", dist=dist, batch_size=kw.pop("batch_size", 8), seed=3, translate=0, **kw)


def test_processes_augment_their_slice_as_one_process(folder):
    one = _task(folder, **RECIPE)
    x, y = one.train_batch(1)
    parts = [_task(folder, world=2, rank=r, **RECIPE).train_batch(1) for r in range(2)]
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(torch.cat([p[1] for p in parts]), y)
    # Reproducible from the seed, different at another step.
    assert torch.equal(one.train_batch(1)[0], x)
    plain_x, _ = _task(folder).train_batch(1)
    assert not torch.allclose(plain_x, x)


@pytest.mark.skipif(not timm_available(), reason="timm's data pipeline needs timm and torchvision, not importable here")
def test_timm_path_trains_and_processes_augment_their_slice(tmp_path, folder):
    timm_recipe = {**RECIPE, "aug_impl": "timm"}
    x, y = _task(folder, **timm_recipe).train_batch(1)
    parts = [_task(folder, world=2, rank=r, **timm_recipe).train_batch(1) for r in range(2)]
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), x)
    assert not torch.allclose(x, _task(folder, **RECIPE).train_batch(1)[0])  # not the built-in transforms
    cfg = TrainConfig(model="tost_t12_p16", model_args=dict(TINY), dataset="image-folder", data_dir=folder,
                      data_args={"img_size": 8}, eval_split="val", steps=2, batch_size=6, mixup=0.8, cutmix=1.0,
                      label_smoothing=0.1, out=str(tmp_path / "run"), progress=False, tensorboard=False,
                      report=False, **timm_recipe)
    assert np.isfinite(train(cfg)["final_eval"]["loss"])


def test_mixup_gives_soft_targets_and_the_soft_loss(folder):
    task = _task(folder, mixup=0.8, cutmix=1.0, label_smoothing=0.1, aug_impl="torch")
    x, y = task.train_batch(0)
    assert y.shape == (8, 3) and y.dtype == torch.float32
    torch.testing.assert_close(y.sum(-1), torch.ones(8))
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 3))
    loss, stats = task.loss(model, x, y)
    logp = torch.log_softmax(model(x), -1)
    torch.testing.assert_close(loss, -(y * logp).sum(-1).mean())
    assert stats["count"] == 8


def test_repeated_augmentation_puts_copies_on_different_processes(folder):
    tasks = [_task(folder, world=2, rank=r, aug_repeats=3, batch_size=4) for r in range(2)]
    idx = [torch.cat([t.global_indices(s)[t.lo:t.hi] for s in range(2)]) for t in tasks]  # 2 steps of 2
    # DeiT's order: the repeated permutation [a, a, a, b, b, b, ...] dealt out to processes 0, 1, 0, 1, ...
    a, b = idx[0][0].item(), idx[1][1].item()
    assert a != b and idx[0][:3].tolist() == [a, a, b] and idx[1][:3].tolist() == [a, b, b]
    assert tasks[0].steps_per_epoch == 18 // 4
    # Off: a plain permutation of the training set per epoch.
    assert sorted(_task(folder).order(0).tolist()) == list(range(18))


def test_recipe_options_are_refused_where_they_do_not_apply(folder):
    with pytest.raises(ConfigError, match="augment images"):
        build_task("subspaces", data_args={"layout": "vector"}, batch_size=8, mixup=0.8)
    with pytest.raises(ConfigError, match="reprob must be"):
        _task(folder, reprob=1.5)


def test_train_command_refuses_bad_recipe_options(capsys, folder):
    for opts, needle in ((["--mixup", "-1"], "mixup must be"), (["--auto-augment", "rand-q1"], "cannot read 'q1'"),
                         (["--mixup-mode", "pair"], "mixup_mode must be"),
                         (["data_args.crop_pct=2"], "crop_pct must be")):
        code = main(["train", "--dataset", "image-folder", "--data-dir", folder, "data_args.img_size=8", "--no-progress",
                     "--no-tensorboard", "--out", f"{folder}/run", *opts])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "error: " in err[0] and needle in err[0], err


def test_two_steps_with_the_whole_recipe(tmp_path, folder, capsys):
    cfg = TrainConfig(model="tost_t12_p16", model_args=dict(TINY), dataset="image-folder", data_dir=folder,
                      data_args={"img_size": 8, "crop_pct": 0.875}, eval_split="val", steps=2, batch_size=6,
                      mixup=0.8, cutmix=1.0, label_smoothing=0.1, aug_repeats=3, flip=0.5,
                      out=str(tmp_path / "run"), progress=False, tensorboard=False, report=False, log_every=1,
                      **RECIPE)
    res = train(cfg)
    assert res["final_eval"]["n"] == 6 and np.isfinite(res["final_eval"]["loss"])
    said = capsys.readouterr()
    assert ("augmentation: random resized crops (area 0.3-1, ratio 0.75-1.33), RandAugment rand-m9-mstd0.5-inc1, "
            "Mixup 0.8 / CutMix 1 per batch (targets smoothed 0.1), random erasing 0.5 (pixel, up to 1), "
            "repeated augmentation x3 (built-in)") in said.out + said.err


def test_resume_with_the_recipe_is_bit_exact(tmp_path):
    """Every augmentation is a function of (seed, step): a run resumed from its checkpoint at step 3
    ends with the weights of the run that did not stop."""
    import shutil

    from safetensors.torch import load_file

    from whiteformer.app.train.checkpoint import list_checkpoints

    def cfg(out, **kw):
        return TrainConfig(model="tost_t12_p16", model_args=dict(TINY), dataset="digits", steps=6, batch_size=16,
                           ckpt_every=3, mixup=0.8, cutmix=1.0, mixup_mode="elem", label_smoothing=0.1,
                           aug_repeats=2, out=str(tmp_path / out), progress=False, tensorboard=False, report=False,
                           **RECIPE, **kw)

    train(cfg("a"))
    train(cfg("b"))
    for p in list_checkpoints(tmp_path / "b" / "checkpoints"):
        if p.name != "step_00000003":
            shutil.rmtree(p)
    train(cfg("b", resume=True))
    wa, wb = (load_file(str(tmp_path / r / "final" / "model.safetensors")) for r in "ab")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
