"""``whiteformer train --fsdp`` (FSDP2 ``fully_shard`` per block and the root) under torchrun with 2
CPU processes (gloo): the same losses and model as one process, and checkpoints that resume across
(FSDP -> one process, one process -> FSDP); ``--precision`` bf16 / fp16 (gradient scaling)."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from test_context_parallel_train import COMMON as CP_COMMON
from test_context_parallel_train import MODEL_ARGS, SRC
from test_ddp import cli_args
from whiteformer.app.config import ConfigError
from whiteformer.app.train import TrainConfig, train

pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available"),
              pytest.mark.usefixtures("fused_kernel_built")]

COMMON = dict(CP_COMMON, ckpt_every=2, log_every=1)  # a checkpoint to resume from half-way, every step's loss


def _torchrun(out, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "whiteformer",
           "train", *cli_args(COMMON, model_args=MODEL_ARGS), "--fsdp", "--out", str(out), *extra]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def _single(out, **over):
    n = torch.get_num_threads()
    try:
        # unlimited_length: the command's default (the explicit position options make it change nothing here)
        return train(TrainConfig(model_args=dict(MODEL_ARGS), out=str(out), unlimited_length=True, **{**COMMON, **over}))
    finally:
        torch.set_num_threads(n)


def _losses(run):
    return [r["train_loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "train_loss" in r]


def _same_final(a, b):
    a, b = (load_file(str(d / "final" / "model.safetensors")) for d in (a, b))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


def _rewind(src, dst):
    """A copy of run ``src`` as it was after its step-2 checkpoint (later checkpoint and finals gone)."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / "step_00000004")
    for name in ("final", "final_ema"):
        if (dst / name).exists():
            shutil.rmtree(dst / name)


def test_fsdp_matches_one_process_and_checkpoints_resume_both_ways(tmp_path):
    one, sharded = tmp_path / "one", tmp_path / "fsdp"
    _single(one)
    _torchrun(sharded)
    assert len(_losses(sharded)) == 4
    assert _losses(sharded) == pytest.approx(_losses(one), rel=1e-4)
    _same_final(sharded, one)
    # an FSDP checkpoint (optimizer state by parameter names) resumes in one process ...
    _rewind(sharded, tmp_path / "fsdp_then_one")
    _single(tmp_path / "fsdp_then_one", resume=True)
    _same_final(tmp_path / "fsdp_then_one", one)
    # ... and a one-process checkpoint (by parameter ids) under FSDP
    _rewind(one, tmp_path / "one_then_fsdp")
    _torchrun(tmp_path / "one_then_fsdp", "--resume")
    _same_final(tmp_path / "one_then_fsdp", one)
    assert _losses(tmp_path / "one_then_fsdp")[-2:] == pytest.approx(_losses(one)[-2:], rel=1e-4)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_precision(tmp_path, precision):
    res = _single(tmp_path / precision, precision=precision, steps=2, ckpt_every=2)
    losses = _losses(tmp_path / precision)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    state = torch.load(tmp_path / precision / "checkpoints" / "step_00000002" / "trainer_state.pt", weights_only=False)
    assert (state["scaler"] is not None) == (precision == "fp16")  # gradient scaling only for float16
    assert state["config"]["precision"] == precision and res["final_eval"]


def test_fsdp_and_precision_refusals():
    for bad, match in [(dict(precision="fp8"), "precision must be one of"),
                       (dict(bf16=True, precision="fp16"), "exclude each other"),
                       (dict(fsdp=True, ema=True), "fsdp and ema"),
                       (dict(fsdp=True, precision="fp16"), "fsdp with precision fp16")]:
        with pytest.raises(ConfigError, match=match):
            TrainConfig(**bad).validate()


_RELEASE_SCRIPT = """
import gc, os, sys
from torch.distributed.fsdp import FSDPModule
from whiteformer.app.train import TrainConfig, train
gc.disable()  # only train() itself may collect
train(TrainConfig(model_args={model_args!r}, out=sys.argv[1], fsdp=True, **{common!r}))
alive = sum(isinstance(o, FSDPModule) for o in gc.get_objects())
print("rank", os.environ["RANK"], "fsdp modules alive:", alive, flush=True)
sys.exit(3 if alive else 0)
"""


def test_train_frees_the_sharded_model_before_the_process_group_goes(tmp_path):
    # FSDP hooks make reference cycles: left to interpreter shutdown, the shards (and the communication
    # state they hold) outlived the process group, and a rank aborted there
    script = tmp_path / "release.py"
    script.write_text(_RELEASE_SCRIPT.format(model_args=dict(MODEL_ARGS), common=dict(COMMON, steps=2)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script), str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("fsdp modules alive: 0") == 2, res.stdout[-3000:]


def test_fsdp_refuses_a_model_with_scalar_parameters_by_name():
    """FSDP2 cannot shard 0-dim parameters (ECAttention's alpha_raw / beta_raw): a ConfigError that names
    them and the way out, before any sharding (it was a ValueError from inside fully_shard)."""
    from whiteformer.app.train.distributed import shard_model
    from whiteformer.models import create_model

    model = create_model("eca_t", img_size=16, patch_size=4, depth=1, num_classes=3, embed_dim=32)
    with pytest.raises(ConfigError, match=r"--fsdp cannot shard .*blocks\.0\.attn\.alpha_raw.*without --fsdp"):
        shard_model(model, "bf16")
