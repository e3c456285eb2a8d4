"""Training machinery: configuration, schedule, optimizer groups, EMA, checkpoints, the trainer
(in process, tiny models), fine-tuning, evaluation and generation."""
import json
import math
import os
import re

import pytest
import torch
import torch.nn as nn
import yaml
from safetensors.torch import load_file

from whiteformer.app.config import config_to_dict, parse_overrides
from whiteformer.app.data import build_dataset
from whiteformer.app.evaluate import evaluate, generate
from whiteformer.app.schedule import warmup_cosine
from whiteformer.app.train import (
    CheckpointError,
    ConfigError,
    EvalConfig,
    GenerateConfig,
    TrainConfig,
    build_config,
    latest_checkpoint,
    load_training_checkpoint,
    save_checkpoint,
    train,
    verify_checkpoint,
)
from whiteformer.app.train.build import build_model
from whiteformer.app.train.checkpoint import list_checkpoints, remove_stale_temporaries, rng_state, set_rng_state
from whiteformer.app.train.distributed import CPUSyncBatchNorm, DistInfo, convert_sync_batchnorm
from whiteformer.app.train.ema import ModelEMA
from whiteformer.app.train.optim import param_groups
from whiteformer.app.train.tasks import ClassificationTask, seeded_generator


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models: one thread avoids thread-synchronisation overhead on a shared 2-core machine.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


TINY = {"patch_size": 2, "embed_dim": 16, "depth": 2, "num_heads": 2, "cls_attn_layers": 1}


def tiny_cfg(tmp_path, **kw):
    base = dict(model="tost_t12_p16", model_args=dict(TINY), dataset="digits", epochs=1, batch_size=64,
                lr=2e-3, out=str(tmp_path / "run"), progress=False, tensorboard=False, report=False, log_every=5)
    base.update(kw)
    return TrainConfig(**base)


# ----------------------------------------------------------------------------- configuration
def test_parse_overrides_forms():
    got = parse_overrides(["--lr", "1e-3", "epochs=3", "--ema", "--no-progress", "--model-args.embed_dim=64",
                           "data_args={img_size: 16}", "--out", "runs/x", "--resume"])
    assert got == [("lr", "1e-3"), ("epochs", "3"), ("ema", True), ("progress", False), ("model_args.embed_dim", "64"),
                   ("data_args", "{img_size: 16}"), ("out", "runs/x"), ("resume", True)]
    cfg = build_config(TrainConfig, None, got)
    assert (cfg.lr, cfg.epochs, cfg.ema, cfg.progress, cfg.out, cfg.resume) == (1e-3, 3, True, False, "runs/x", True)
    assert cfg.model_args == {"embed_dim": 64} and cfg.data_args == {"img_size": 16}
    # String options keep the text as typed; optional ones accept null.
    g = build_config(GenerateConfig, None, parse_overrides(["--prompt", "true", "--checkpoint", "3"]))
    assert (g.prompt, g.checkpoint) == ("true", "3")
    t = build_config(TrainConfig, None, parse_overrides(["--finetune", "none", "--data-dir", "1"]))
    assert t.finetune is None and t.data_dir == "1"
    # Strings inside a mapping option are plain strings, which the run's config.yaml can hold.
    t = build_config(TrainConfig, None, parse_overrides(["data_args.eod=\n", "data_args.path=a.txt"]))
    assert t.data_args == {"eod": "\n", "path": "a.txt"} and {type(v) for v in t.data_args.values()} == {str}
    assert yaml.safe_load(yaml.safe_dump(config_to_dict(t)))["data_args"] == t.data_args


def test_build_config_precedence_and_errors(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("lr: 3.0e-3\nepochs: 7\nmodel_args:\n  embed_dim: 32\n  depth: 2\n")
    cfg = build_config(TrainConfig, y, parse_overrides(["--epochs", "9", "model_args.depth=3"]))
    assert (cfg.lr, cfg.epochs, cfg.model_args) == (3e-3, 9, {"embed_dim": 32, "depth": 3})
    with pytest.raises(ConfigError, match="unknown option 'learning_rate'"):
        build_config(TrainConfig, None, [("learning_rate", 1.0)])
    with pytest.raises(ConfigError, match="did you mean 'epochs'"):
        build_config(TrainConfig, None, [("epoch", 1)])
    with pytest.raises(ConfigError, match="epochs must be an integer"):
        build_config(TrainConfig, None, [("epochs", "many")])
    with pytest.raises(ConfigError, match="min_lr must be in"):
        build_config(TrainConfig, None, [("min_lr", 1.0)])
    with pytest.raises(ConfigError, match="does not exist"):
        build_config(TrainConfig, tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not a mapping option"):
        build_config(TrainConfig, None, [("lr.x", 1)])


# ----------------------------------------------------------------------------- schedule / optim / EMA
def test_warmup_cosine():
    assert warmup_cosine(0, 100, 10, 0.01) == pytest.approx(0.1)
    assert warmup_cosine(9, 100, 10, 0.01) == pytest.approx(1.0)
    assert warmup_cosine(10, 100, 10, 0.01) == pytest.approx(1.0)
    assert warmup_cosine(55, 100, 10, 0.01) == pytest.approx(0.01 + 0.99 * 0.5)
    assert warmup_cosine(100, 100, 10, 0.01) == pytest.approx(0.01)
    vals = [warmup_cosine(s, 100, 10, 0.0) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))


def test_no_weight_decay_groups():
    import whiteformer

    m = whiteformer.create_model("tost_t12_p16", img_size=8, in_chans=1, num_classes=10, **TINY)
    decay, no_decay = param_groups(m, 0.05)
    names = {id(p): n for n, p in m.named_parameters()}
    nd = {names[id(p)] for p in no_decay["params"]}
    d = {names[id(p)] for p in decay["params"]}
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert "cls_token" in nd and "blocks.0.attn.temp" in nd and "blocks.0.norm1.weight" in nd
    assert "blocks.0.attn.qkv.bias" in nd and "blocks.0.gamma1" in nd
    assert "blocks.0.attn.qkv.weight" in d and "head.weight" in d
    assert not d & nd and len(d) + len(nd) == len(list(m.parameters()))


def test_ema_update():
    m = nn.Linear(3, 2)
    ema = ModelEMA(m, decay=0.9)
    before = ema.module.weight.clone()
    with torch.no_grad():
        m.weight.add_(1.0)
    ema.update(m)
    assert torch.allclose(ema.module.weight, 0.9 * before + 0.1 * m.weight)
    assert not ema.module.weight.requires_grad


def test_seeded_generator_is_a_function_of_keys():
    a = torch.rand(3, generator=seeded_generator(0, 1, 5))
    assert torch.equal(a, torch.rand(3, generator=seeded_generator(0, 1, 5)))
    assert not torch.equal(a, torch.rand(3, generator=seeded_generator(0, 1, 6)))


def test_data_order_depends_on_seed_and_epoch_only():
    ds = build_dataset("digits", "train")
    t = ClassificationTask(ds, ds, 64, 3, DistInfo())
    first = [t.global_indices(s) for s in range(t.steps_per_epoch)]
    seen = torch.cat(first)
    assert len(set(seen.tolist())) == len(seen) == t.steps_per_epoch * 64  # no repeats within an epoch
    t2 = ClassificationTask(ds, ds, 64, 3, DistInfo())
    assert torch.equal(t2.global_indices(30), t.global_indices(30))  # random access: same batch
    assert not torch.equal(t.global_indices(0), t.global_indices(t.steps_per_epoch))  # reshuffled per epoch


# ----------------------------------------------------------------------------- checkpoints
def _save_tiny(root, step, keep=3):
    import whiteformer

    m = whiteformer.create_model("tost_t12_p16", img_size=8, in_chans=1, num_classes=10, **TINY)
    opt = torch.optim.AdamW(m.parameters())
    state = {"optimizer": opt.state_dict(), "rng": [rng_state()], "total_steps": 10}
    return m, save_checkpoint(root, step, m, state, ema_state=m.state_dict(), keep_last=keep,
                              extra_files={"note.txt": "hi"})


def test_checkpoint_roundtrip_and_keep_last(tmp_path):
    for step in (1, 2, 3, 4):
        m, path = _save_tiny(tmp_path, step, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    ck = load_training_checkpoint(path)
    assert ck["trainer"]["step"] == 4 and ck["trainer"]["total_steps"] == 10
    for k, v in m.state_dict().items():
        assert torch.equal(ck["model"][k], v) and torch.equal(ck["ema"][k], v)
    assert (path / "note.txt").read_text() == "hi"
    manifest = verify_checkpoint(path)
    assert set(manifest["files"]) >= {"model.safetensors", "config.json", "trainer_state.pt", "ema.safetensors"}


def test_corrupt_checkpoint_falls_back(tmp_path):
    _save_tiny(tmp_path, 5)
    _, newest = _save_tiny(tmp_path, 6)
    w = newest / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-100])  # truncated
    with pytest.raises(CheckpointError, match="truncated or corrupt: model.safetensors"):
        load_training_checkpoint(newest)
    msgs = []
    path, ck = latest_checkpoint(tmp_path, log=msgs.append)
    assert path.name == "step_00000005" and ck["trainer"]["step"] == 5
    assert msgs and "falling back" in msgs[0]
    # Same size but flipped bytes: caught by the checksum.
    _, p7 = _save_tiny(tmp_path, 7)
    w = p7 / "trainer_state.pt"
    b = bytearray(w.read_bytes())
    b[len(b) // 2] ^= 0xFF
    w.write_bytes(bytes(b))
    with pytest.raises(CheckpointError, match="sha256"):
        verify_checkpoint(p7)
    (newest / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        verify_checkpoint(newest)


def test_interrupted_write_is_invisible_and_cleaned(tmp_path):
    _save_tiny(tmp_path, 1)
    tmp = tmp_path / ".tmp-step_00000002-123"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"partial")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]
    remove_stale_temporaries(tmp_path)
    assert not tmp.exists()


def test_rng_state_roundtrip():
    import random

    import numpy as np

    st = rng_state()
    a = (torch.rand(3), np.random.rand(2), random.random())
    set_rng_state(st)
    b = (torch.rand(3), np.random.rand(2), random.random())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


# ----------------------------------------------------------------------------- trainer
def test_tiny_training_run_writes_everything(tmp_path):
    cfg = tiny_cfg(tmp_path, epochs=2, report=True, ema=True, ema_decay=0.9, label_smoothing=0.1)
    res = train(cfg, command="pytest")
    run = tmp_path / "run"
    for name in ("config.yaml", "metrics.jsonl", "metrics.csv", "report.md", "report.json", "curves.png",
                 "coding_rate.png", "membership.png", "final/model.safetensors", "final_ema/model.safetensors"):
        assert (run / name).is_file(), name
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "eval_acc" in r] == [22, 44]
    assert all(math.isfinite(r["train_loss"]) for r in recs if "train_loss" in r)
    assert len(res["coding_rate_per_block"]) == 2 and all(r > 0 for r in res["coding_rate_per_block"])
    report = (run / "report.md").read_text()
    assert "test accuracy" in report and "coding rate" in report and "membership.png" in report
    assert 0.0 <= res["final_eval"]["acc"] <= 1.0 and res["final_eval"]["n"] == 359
    # eval of the run directory (EMA weights) reproduces the final evaluation
    ev = evaluate(EvalConfig(checkpoint=str(run)))
    assert ev["acc"] == pytest.approx(res["final_eval"]["acc"]) and ev["checkpoint"].endswith("final_ema")
    raw = evaluate(EvalConfig(checkpoint=str(run), ema=False))
    assert raw["acc"] == pytest.approx(res["raw_eval"]["acc"])
    # each model folder's card carries the run's configuration and its own final metrics
    for name, key in (("final_ema", "final_eval"), ("final", "raw_eval")):
        card = (run / name / "README.md").read_text()
        assert "library_name: whiteformer" in card and "## Training" in card and '"ema_decay": 0.9' in card
        assert f"| acc | {res[key]['acc']:.6g} |" in card


def test_in_process_resume_is_bit_exact(tmp_path):
    kw = dict(epochs=1, ckpt_every=5, translate=1, model_args={**TINY, "drop_path_rate": 0.1})
    full = train(tiny_cfg(tmp_path, out=str(tmp_path / "a"), steps=12, **kw))
    # Stop after step 5 (a run of 12 steps whose checkpoint at 5 we keep), then resume.
    train(tiny_cfg(tmp_path, out=str(tmp_path / "b"), steps=12, **kw))
    b = tmp_path / "b" / "checkpoints"
    for p in list_checkpoints(b):
        if p.name != "step_00000005":
            import shutil

            shutil.rmtree(p)
    res = train(tiny_cfg(tmp_path, out=str(tmp_path / "b"), steps=12, resume=True, **kw))
    wa = load_file(str(tmp_path / "a" / "final" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "final" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert res["final_eval"] == full["final_eval"]
    steps = [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps)  # the log was truncated at the checkpoint, not duplicated


def test_existing_run_needs_resume_or_overwrite(tmp_path):
    train(tiny_cfg(tmp_path, steps=2))
    with pytest.raises(ConfigError, match="already has checkpoints.*--resume"):
        train(tiny_cfg(tmp_path, steps=2))
    train(tiny_cfg(tmp_path, steps=2, overwrite=True))


@pytest.mark.parametrize("kw,match", [
    (dict(model="tost_nope"), "unknown model 'tost_nope'"),
    (dict(dataset="cifar"), "unknown dataset 'cifar'"),
    (dict(dataset="mnist", data_dir="/nonexistent/mnist"), "data directory '/nonexistent/mnist' does not exist"),
    (dict(dataset="mnist"), "pass --data-dir"),
    (dict(model_args={**TINY, "patch_size": 16}), "divisible by patch_size 16.*patch_size=.*img_size"),
    (dict(batch_size=4096), "larger than the training set"),
    (dict(dataset="text"), "needs --steps"),
    (dict(dataset="text", steps=2), "use a causal language model"),
    (dict(model="tost_lm_base", model_args={}), "use an image classifier"),
    (dict(model_args={**TINY, "embed_dim": 15}), "cannot build model"),
    (dict(finetune="/nonexistent/ckpt"), "finetune checkpoint .* does not exist"),
    (dict(device="cuda:7") if not torch.cuda.is_available() else dict(device="nope"), "device"),
])
def test_bad_configuration_fails_before_work(tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        train(tiny_cfg(tmp_path, **kw))
    assert not (tmp_path / "run").exists()


def test_finetune_resets_the_head_and_keeps_the_backbone(tmp_path):
    src = tmp_path / "src"
    train(tiny_cfg(tmp_path, out=str(src), dataset="subspaces", data_args={"num_train": 64, "num_test": 16},
                   steps=2))
    ds = build_dataset("digits", "train")
    m = build_model("tost_t12_p16", ds, {}, finetune=str(src / "final"))
    saved = load_file(str(src / "final" / "model.safetensors"))
    assert m.head.out_features == 10 and saved["head.weight"].shape[0] == 4
    for k, v in m.state_dict().items():
        if not k.startswith("head."):
            assert torch.equal(v, saved[k]), k
    res = train(tiny_cfg(tmp_path, out=str(tmp_path / "ft"), finetune=str(src / "final"), steps=2, model_args={}))
    assert res["final_eval"]["n"] == 359


def test_language_model_training_eval_and_generate(tmp_path):
    lm_args = {"dim": 32, "depth": 2, "num_heads": 2}
    cfg = tiny_cfg(tmp_path, model="tost_lm_base", model_args=lm_args, dataset="text", steps=6, batch_size=8,
                   block_size=32, eval_batches=2, report=True)
    res = train(cfg)
    run = tmp_path / "run"
    assert math.isfinite(res["final_eval"]["loss"]) and res["final_eval"]["ppl"] < 200
    assert (run / "final" / "vocab.json").is_file() and (run / "report.md").is_file()
    assert "Sample" in (run / "report.md").read_text()
    ev = evaluate(EvalConfig(checkpoint=str(run), eval_batches=2, batch_size=8))
    assert ev["loss"] == pytest.approx(res["final_eval"]["loss"], rel=1e-5)
    out = generate(GenerateConfig(checkpoint=str(run), prompt="KING", max_new_tokens=20, num_samples=2))
    assert len(out) == 2 and all(s.startswith("KING") and len(s) == 24 for s in out)
    again = generate(GenerateConfig(checkpoint=str(run), prompt="KING", max_new_tokens=20, num_samples=2))
    assert out == again  # seeded
    with pytest.raises(ConfigError, match="prompt"):
        generate(GenerateConfig(checkpoint=str(run), prompt="\u00e9"))
    import shutil

    shutil.copytree(run / "final", tmp_path / "novocab")
    (tmp_path / "novocab" / "vocab.json").unlink()
    (tmp_path / "novocab" / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="vocab.json"):
        generate(GenerateConfig(checkpoint=str(tmp_path / "novocab")))
    # past the context limit the context is cropped (as GPT), so long generations work
    (long,) = generate(GenerateConfig(checkpoint=str(run), prompt="KING", max_new_tokens=200))
    assert long.startswith("KING") and len(long) == 204


def test_progress_line_shows_the_loss_of_its_own_window(tmp_path, capsys):
    # Evaluating every 2 steps while logging every 10: each line's train loss is the mean of the
    # steps since the previous line, not the last 10-step log record repeated.
    lm = dict(model="tost_lm_base", model_args={"dim": 16, "depth": 1, "num_heads": 2}, dataset="text", steps=14,
              batch_size=4, block_size=16, eval_batches=1, eval_every=2)
    train(tiny_cfg(tmp_path, out=str(tmp_path / "per_step"), log_every=1, **lm))
    from whiteformer.app.train.metrics import read_metrics

    per_step = {r["step"]: r["train_loss"] for r in read_metrics(tmp_path / "per_step" / "metrics.jsonl")
                if "train_loss" in r}
    capsys.readouterr()
    train(tiny_cfg(tmp_path, out=str(tmp_path / "windowed"), log_every=10, **lm))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    shown = {int(m.group(1)): float(m.group(2)) if m.group(2) else None
             for m in (re.match(r"step (\d+)/\d+(?: \| train loss ([\d.]+))?", ln) for ln in lines)}
    assert sorted(shown) == list(range(2, 15, 2))
    want = {step: round((per_step[step - 1] + per_step[step]) / 2, 4) for step in shown}
    assert shown == pytest.approx(want, abs=2e-4)


# ----------------------------------------------------------------------------- BatchNorm conversion
def test_cpu_sync_batchnorm_without_process_group_is_batchnorm():
    bn = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4))
    with torch.no_grad():
        bn[1].weight.uniform_()
        bn[1].bias.uniform_()
    sync = convert_sync_batchnorm(__import__("copy").deepcopy(bn), torch.device("cpu"))
    assert isinstance(sync[1], CPUSyncBatchNorm)
    assert sync.state_dict().keys() == bn.state_dict().keys()
    x = torch.randn(5, 2, 6, 6)
    assert torch.allclose(sync(x), bn(x), atol=1e-6)
    assert torch.allclose(sync[1].running_var, bn[1].running_var)
    sync.eval(), bn.eval()
    assert torch.allclose(sync(x), bn(x), atol=1e-6)


def test_metrics_log_survives_a_torn_line(tmp_path):
    from whiteformer.app.train.metrics import read_metrics, truncate_metrics

    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a"')
    assert [r["step"] for r in read_metrics(p)] == [1, 2]
    truncate_metrics(p, 1)
    assert [r["step"] for r in read_metrics(p)] == [1]
    assert os.path.getsize(p) > 0


def test_bf16_autocast_run(tmp_path):
    res = train(tiny_cfg(tmp_path, steps=3, bf16=True))
    assert math.isfinite(res["final_eval"]["loss"])
    w = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    assert all(v.dtype == torch.float32 for k, v in w.items() if v.is_floating_point())  # master weights stay fp32


def test_report_without_memberships_notes_it(tmp_path):
    # A softmax ViT (DeiT) has no memberships: the report keeps the coding rate and says why there is no map.
    cfg = tiny_cfg(tmp_path, model="deit_t_p16", model_args={"patch_size": 2, "embed_dim": 16, "depth": 2,
                                                              "num_heads": 2}, steps=3, report=True)
    res = train(cfg)
    assert len(res["coding_rate_per_block"]) == 2
    assert "membership" not in res["figures"] and any("memberships" in n for n in res["notes"])
    assert "no membership maps" in (tmp_path / "run" / "report.md").read_text()


def test_listops_with_a_causal_language_model(tmp_path):
    data_args = {"num_train": 64, "num_test": 16, "min_length": 8, "max_length": 24, "max_depth": 3}
    res = train(tiny_cfg(tmp_path, model="tost_lm_base", model_args={"dim": 16, "depth": 1, "num_heads": 2},
                         dataset="listops", data_args=data_args, steps=3, batch_size=16))
    assert res["final_eval"]["n"] == 16
    ev = evaluate(EvalConfig(checkpoint=str(tmp_path / "run")))
    assert ev["acc"] == pytest.approx(res["final_eval"]["acc"])


def test_sequence_task_reads_the_answer_after_the_last_real_token():
    from whiteformer.app.train.tasks import SequenceTask

    ds = build_dataset("listops", "train", num_train=8, min_length=4, max_length=12, max_depth=2)
    task = SequenceTask(ds, ds, 4, 0, DistInfo())

    class Probe(nn.Module):  # logits[b, t, v] = 100 * t + v: identifies the position read
        def forward(self, idx, targets=None):
            b, t = idx.shape
            pos = torch.arange(t, dtype=torch.float32)[None, :, None] * 100
            logits = pos + torch.arange(ds.vocab_size, dtype=torch.float32)[None, None, :]
            return logits.expand(b, t, ds.vocab_size), None

    x, _ = ds.get_batch(torch.arange(4))
    out = task.logits(Probe(), x)
    last = ds.lengths[:4] - 1
    assert out.shape == (4, 10)
    assert torch.equal(out[:, 0], last.float() * 100 + ds.vocab.index("0"))
    assert torch.equal(out[:, 9], last.float() * 100 + ds.vocab.index("9"))


def test_finetune_from_a_foreign_pth_checkpoint(tmp_path):
    # A torch file with a {"model": state_dict} entry and a 1000-class head, as the official scripts write.
    import whiteformer

    src = whiteformer.create_model("tost_t12_p16", img_size=8, in_chans=1, **TINY)
    assert src.head.out_features == 1000
    torch.save({"model": src.state_dict(), "epoch": 3}, tmp_path / "ckpt.pth")
    ds = build_dataset("digits", "train")
    m = build_model("tost_t12_p16", ds, dict(TINY), finetune=str(tmp_path / "ckpt.pth"))
    assert m.head.out_features == 10
    assert torch.equal(m.blocks[0].attn.qkv.weight, src.blocks[0].attn.qkv.weight)
    res = train(tiny_cfg(tmp_path, finetune=str(tmp_path / "ckpt.pth"), steps=2))
    assert res["final_eval"]["n"] == 359


@pytest.mark.parametrize("schedule", ["linear", "inverse_sqrt"])
def test_schedule_option_sets_the_learning_rate_and_resume_keeps_it(tmp_path, schedule):
    """``schedule=`` (ToST Table 7's LRA schedules) drives the logged learning rate step by step;
    resuming the run under another schedule is refused, not silently mixed."""
    from whiteformer.app.schedule import lr_multiplier

    cfg = tiny_cfg(tmp_path, steps=8, warmup_steps=2, lr=1e-3, min_lr=1e-5, schedule=schedule, log_every=1,
                   ckpt_every=4)
    train(cfg)
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["lr"] for r in recs if "lr" in r}
    assert sorted(logged) == list(range(1, 9))
    for step, lr in logged.items():
        assert lr == pytest.approx(1e-3 * lr_multiplier(schedule, step - 1, 8, 2, 1e-2))
    other = "cosine"
    with pytest.raises(ConfigError, match=f"schedule={schedule}.*schedule={other}"):
        train(tiny_cfg(tmp_path, steps=8, warmup_steps=2, lr=1e-3, min_lr=1e-5, schedule=other, resume=True))


def test_unknown_schedule_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="schedule must be one of cosine, linear, inverse_sqrt"):
        tiny_cfg(tmp_path, steps=2, schedule="step").validate()
