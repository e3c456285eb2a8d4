"""First contact with the CLI: a default language model generates without
a length limit, Ctrl-C / SIGTERM save a checkpoint, ``--out RUN --resume`` alone resumes and may
extend a run, every command names checkpoints and options the same way, progress without a bar."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import slow_steps
from test_train import _one_thread  # noqa: F401  (autouse: one thread for the tiny models)
from whiteformer import create_model
from whiteformer.app.cli import main
from whiteformer.app.schedule import warmup_cosine
from whiteformer.app.train import TrainConfig, train
from whiteformer.app.train.checkpoint import list_checkpoints

SUBSPACES = ["--dataset", "subspaces", "data_args={num_train: 128, num_test: 32}", "--model", "tost_t12_p16",
             "model_args={patch_size: 2, embed_dim: 16, depth: 2, num_heads: 2, cls_attn_layers: 1}",
             "--batch-size", "32", "--num-threads", "1", "--no-report", "--no-tensorboard"]
LM = ["--model", "tost_lm_base", "model_args={dim: 32, depth: 1, num_heads: 2}", "--dataset", "text", "--steps", "2",
      "--batch-size", "4", "--block-size", "16", "--eval-batches", "1", "--no-report", "--no-progress",
      "--no-tensorboard", "--num-threads", "1"]


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- item 4
def test_default_language_model_generates_past_its_training_context(tmp_path, capsys):
    out = tmp_path / "lm"
    assert main(["train", *LM, "--out", str(out)]) == 0
    saved = json.loads((out / "final" / "config.json").read_text())["init_kwargs"]
    assert saved["pos_emb"] is False and saved["pos_bias"] is False
    capsys.readouterr()
    # The default 300 characters, far past block_size 16 (the trained context).
    assert main(["generate", "--checkpoint", str(out), "--prompt", "ROMEO"]) == 0
    assert len(capsys.readouterr().out.rstrip("\n")) >= 305
    # The official-compatible configuration (absolute positions + position bias) is still one option away.
    off = tmp_path / "official"
    assert main(["train", *LM, "model_args.pos_emb=true", "model_args.pos_bias=true", "--out", str(off)]) == 0
    m = create_model("tost_lm_base", checkpoint_path=str(off / "final"))
    assert m.context_limit == 16


# ----------------------------------------------------------------------------- items 5 + 6
def test_sigint_saves_a_checkpoint_and_resume_alone_reads_the_run_config(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(slow_steps.command(0.1, "train", *SUBSPACES, "--no-progress", "--steps", "2000",
                                               "--ckpt-every", "1000", "--log-every", "1", "--out", str(run)),
                            env=slow_steps.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while time.time() < deadline:
        if (run / "metrics.jsonl").is_file() and len(_metrics(run)) >= 3:
            break
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "checkpoint saved" in err and "--resume" in err and "Traceback" not in err
    saved = list_checkpoints(run / "checkpoints")
    assert len(saved) == 1
    step = int(saved[0].name.split("_")[1])
    assert 3 <= step < 1000  # saved on the signal, not by the step schedule
    # `--out RUN --resume` alone: the model/data come from RUN/config.yaml; a larger or smaller
    # --steps changes the schedule's length.
    res = subprocess.run([sys.executable, "-m", "whiteformer", "train", "--out", str(run), "--resume", "--steps",
                          str(step + 2)], env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    assert f"resumed from {saved[0]}" in res.stdout
    assert _metrics(run)[-1]["step"] == step + 2


def test_time_based_checkpoints(tmp_path):
    cfg = TrainConfig(model="tost_t12_p16", model_args={"patch_size": 2, "embed_dim": 16, "depth": 2, "num_heads": 2,
                                                       "cls_attn_layers": 1},
                      dataset="subspaces", data_args={"num_train": 128, "num_test": 32}, steps=5, batch_size=32,
                      ckpt_every=100, ckpt_minutes=1e-9, keep_last=10, progress=False, tensorboard=False,
                      report=False, out=str(tmp_path / "run"))
    train(cfg)  # a checkpoint after every step: the timer is always due
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == \
        [f"step_{s:08d}" for s in range(1, 6)]


def test_extending_a_finished_run_continues_the_schedule(tmp_path):
    kw = dict(model="tost_t12_p16", model_args={"patch_size": 2, "embed_dim": 16, "depth": 2, "num_heads": 2,
                                                "cls_attn_layers": 1},
              dataset="subspaces", data_args={"num_train": 128, "num_test": 32}, batch_size=32, lr=2e-3,
              min_lr=1e-5, warmup_steps=2, log_every=1, progress=False, tensorboard=False, report=False,
              out=str(tmp_path / "run"))
    train(TrainConfig(steps=4, **kw))
    train(TrainConfig(steps=8, resume=True, **kw))
    rec = [r for r in _metrics(tmp_path / "run") if "lr" in r]
    assert [r["step"] for r in rec] == list(range(1, 9))
    # Steps 5..8 use the schedule of an 8-step run (not the finished 4-step one at min_lr).
    for r in rec[4:]:
        assert r["lr"] == pytest.approx(2e-3 * warmup_cosine(r["step"] - 1, 8, 2, 1e-5 / 2e-3))
    assert rec[4]["lr"] > 1e-4


# ----------------------------------------------------------------------------- item 8
def test_progress_false_prints_a_line_per_epoch_and_no_bar_without_a_terminal(tmp_path, capsys):
    args = ["train", *SUBSPACES, "--epochs", "2", "--out"]
    assert main([*args, str(tmp_path / "a"), "--progress", "false"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("epoch ")]
    assert [ln.split(" |")[0] for ln in lines] == ["epoch 1", "epoch 2"]
    assert all("eval accuracy" in ln and "%" in ln for ln in lines)
    assert main([*args, str(tmp_path / "b")]) == 0  # --progress true, but stderr is not a terminal
    captured = capsys.readouterr()
    assert "it/s" not in captured.err and len([ln for ln in captured.out.splitlines() if ln.startswith("epoch ")]) == 2


def test_compress_takes_a_run_directory_the_train_option_style_and_reports_accuracy(tmp_path, capsys):
    pytest.importorskip("sklearn")
    run = tmp_path / "deit"
    assert main(["train", "--model", "deit_t_p16", "model_args={patch_size: 4, embed_dim: 16, depth: 1, num_heads: 2}",
                 "--dataset", "digits", "--steps", "2", "--no-progress", "--no-report", "--no-tensorboard",
                 "--out", str(run)]) == 0
    capsys.readouterr()
    out = tmp_path / "small"
    rc = main(["compress", "--checkpoint", str(run), "--qk", "truncatt", "--qk-rank", "4", "--vo-rank", "4",
               "model_args.drop_rate=0.0", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "digits test accuracy: original" in captured.out and " %, compressed " in captured.out
    rep = json.loads((out / "compression_report.json").read_text())
    assert 0 <= rep["extra"]["accuracy"]["compressed"] <= 1
    assert main(["eval", "--checkpoint", str(out)]) == 2  # no run config and no --dataset: one clear line
    assert "--dataset" in capsys.readouterr().err
    # --protocol rank (the paper's Table 1): IrrAtt gets TruncAtt's total QK rank at the same ratio;
    # --protocol flops (ours) charges the general head fusion to the budget, so it gets less.
    totals = {}
    for qk, protocol in (("truncatt", "flops"), ("irratt", "rank"), ("irratt", "flops")):
        dst = tmp_path / f"{qk}_{protocol}"
        assert main(["compress", "--checkpoint", str(run), "--qk", qk, "--qk-flops-ratio", "0.5",
                     "--protocol", protocol, "--vo", "none", "--out", str(dst)]) == 0
        assert f"(protocol {protocol})" in capsys.readouterr().out
        totals[qk, protocol] = json.loads((dst / "compression_report.json").read_text())["blocks"][0]["qk_total_rank"]
    assert totals["irratt", "rank"] == totals["truncatt", "flops"] > totals["irratt", "flops"]
    assert main(["compress", "--checkpoint", str(run), "--qk", "irratt", "--qk-flops-ratio", "0.5", "--protocol",
                 "equal", "--out", str(tmp_path / "bad")]) == 2
