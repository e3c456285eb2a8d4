"""DistributedDataParallel on CPU (gloo): 2 processes launched by torchrun give the same model as
one process with the same global batch (BatchNorm synchronised: CPUSyncBatchNorm)."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from whiteformer.app.train import TrainConfig, train

pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available"),
              pytest.mark.usefixtures("fused_kernel_built")]

MODEL_ARGS = {"patch_size": 2, "embed_dim": 16, "depth": 2, "num_heads": 2, "cls_attn_layers": 1}
DATA_ARGS = {"num_train": 128, "num_test": 40}
COMMON = dict(dataset="subspaces", steps=8, batch_size=32, lr=2e-3, warmup_steps=2, translate=1, flip=0.5,
              label_smoothing=0.1, ckpt_every=4, log_every=2, num_threads=1, seed=5, progress=False, report=False,
              tensorboard=False)


def cli_args(common, **mappings):
    """``whiteformer train`` arguments for the options ``common`` and the dict options ``mappings``
    (e.g. ``model_args={...}``)."""
    out = []
    for k, v in common.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    for name, mapping in mappings.items():
        out.append(name + "={" + ", ".join(f"{k}: {v}" for k, v in mapping.items()) + "}")
    return out


def test_two_cpu_processes_match_one_process(tmp_path):
    ddp_out = tmp_path / "ddp"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "whiteformer",
           "train", *cli_args(COMMON, model_args=MODEL_ARGS, data_args=DATA_ARGS), "--out", str(ddp_out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "2 processes" in res.stdout

    n = torch.get_num_threads()
    try:
        single = train(TrainConfig(model="tost_t12_p16", model_args=dict(MODEL_ARGS), data_args=dict(DATA_ARGS),
                                   out=str(tmp_path / "single"), **COMMON))
    finally:
        torch.set_num_threads(n)

    a = load_file(str(ddp_out / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "single" / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    # BatchNorm running statistics are synchronised too (same keys, close values).
    assert any("running_var" in k for k in a)
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-4, atol=1e-5), k
    # Different initial weights would differ by far more: the comparison has teeth.
    assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) < 1e-4

    # Rank 0 alone logs and checkpoints: each step once in the log, one set of checkpoints.
    rec = [json.loads(x) for x in (ddp_out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rec if "train_loss" in r]
    assert steps == [2, 4, 6, 8]
    single_rec = [json.loads(x) for x in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    for r, s in zip([r for r in rec if "train_loss" in r], [s for s in single_rec if "train_loss" in s]):
        assert r["train_loss"] == pytest.approx(s["train_loss"], rel=1e-4)
    ev = [r for r in rec if "eval_acc" in r][-1]
    assert ev["eval_n"] == 40 and ev["eval_acc"] == pytest.approx(single["final_eval"]["acc"])
    assert sorted(p.name for p in (ddp_out / "checkpoints").iterdir()) == ["step_00000004", "step_00000008"]


def test_batch_must_split_evenly(tmp_path, monkeypatch):
    from whiteformer.app.data import build_dataset
    from whiteformer.app.train.distributed import DistInfo
    from whiteformer.app.train.tasks import ClassificationTask

    ds = build_dataset("subspaces", "train", num_train=64)
    with pytest.raises(ValueError, match="divisible by the number of processes 3"):
        ClassificationTask(ds, ds, 32, 0, DistInfo(rank=0, world_size=3))
    # Each rank reads its own slice of the same global batch.
    t0 = ClassificationTask(ds, ds, 32, 0, DistInfo(rank=0, world_size=2))
    t1 = ClassificationTask(ds, ds, 32, 0, DistInfo(rank=1, world_size=2))
    t = ClassificationTask(ds, ds, 32, 0, DistInfo())
    x0, _ = t0.train_batch(3)
    x1, _ = t1.train_batch(3)
    x, _ = t.train_batch(3)
    assert torch.equal(torch.cat([x0, x1]), x)
