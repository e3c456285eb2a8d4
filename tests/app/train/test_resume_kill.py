"""A real training process killed with SIGKILL and resumed ends with the same weights (bit for
bit) as an uninterrupted run; a corrupt newest checkpoint makes the resume fall back."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import slow_steps

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")

ARGS = [
    "--dataset", "subspaces", "data_args={num_train: 256, num_test: 64}",
    "--model", "tost_t12_p16",
    "model_args={patch_size: 2, embed_dim: 16, depth: 2, num_heads: 2, cls_attn_layers: 1, drop_path_rate: 0.1}",
    "--steps", "40", "--batch-size", "32", "--lr", "2e-3", "--warmup-steps", "5", "--label-smoothing", "0.1",
    "--translate", "1", "--flip", "0.5", "--ema", "--ema-decay", "0.9",
    "--ckpt-every", "4", "--keep-last", "3", "--log-every", "2",
    "--num-threads", "1", "--seed", "3", "--no-progress", "--no-report", "--no-tensorboard",
]


def _cmd(out, *extra):
    return [sys.executable, "-m", "whiteformer", "train", *ARGS, "--out", str(out), *extra]


def _env():
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _weights(run: Path, name: str):
    return load_file(str(run / name / "model.safetensors"))


def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
    ref = tmp_path / "ref"
    subprocess.run(_cmd(ref), check=True, env=_env(), capture_output=True, timeout=240)

    run = tmp_path / "killed"
    ckpts = run / "checkpoints"
    proc = subprocess.Popen(slow_steps.command(0.06, "train", *ARGS, "--out", str(run)), env=slow_steps.env(),
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    deadline = time.time() + 180
    try:
        # Wait until two checkpoints exist, then kill at once (possibly while a third is written).
        while time.time() < deadline:
            if ckpts.is_dir() and len([p for p in ckpts.iterdir() if p.name.startswith("step_")]) >= 2:
                break
            if proc.poll() is not None:
                pytest.fail("training ended before it could be killed:\n" + proc.stdout.read().decode())
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (run / "final").exists()
    steps = sorted(int(p.name[5:]) for p in ckpts.iterdir() if p.name.startswith("step_"))
    assert steps and steps[-1] < 40

    # Corrupt the newest checkpoint: the resume must say so and fall back to the previous one.
    newest = ckpts / f"step_{steps[-1]:08d}" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    res = subprocess.run(_cmd(run, "--resume"), env=_env(), capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "truncated or corrupt" in res.stdout and "falling back" in res.stdout
    resumed_from = int(res.stdout.split("(step ")[1].split("/")[0])
    assert resumed_from == steps[-2] and resumed_from < 40

    for name in ("final", "final_ema"):
        a, b = _weights(ref, name), _weights(run, name)
        assert a.keys() == b.keys()
        diff = [k for k in a if not torch.equal(a[k], b[k])]
        assert not diff, f"{name}: tensors differ after resume: {diff[:5]}"
    # The metrics log holds each step once (records after the resumed checkpoint were dropped).
    rec = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in rec if "train_loss" in r]
    assert train_steps == sorted(set(train_steps)) and train_steps[-1] == 40
    ref_rec = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    assert [r["train_loss"] for r in rec if "train_loss" in r] == [r["train_loss"] for r in ref_rec if "train_loss" in r]
