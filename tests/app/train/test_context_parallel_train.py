"""``whiteformer train --context-parallel 2`` under torchrun (CPU processes, gloo): every training
sequence split over two processes (alone, or two such groups data-parallel over 4 processes; or
packed documents, a row of them split over two processes) gives the same model and losses as one
process."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from test_ddp import cli_args
from whiteformer.app.config import ConfigError
from whiteformer.app.train import TrainConfig, train

pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available"),
              pytest.mark.usefixtures("fused_kernel_built")]

SRC = Path(__file__).resolve().parents[3] / "src"
# global position embedding and position bias: the chunks' positions must be global
MODEL_ARGS = {"dim": 16, "depth": 2, "num_heads": 2, "pos_emb": True, "pos_bias": True}
COMMON = dict(model="tost_lm_base", dataset="text", steps=4, batch_size=4, block_size=15, lr=3e-3, warmup_steps=1,
              eval_batches=1, ckpt_every=4, log_every=2, num_threads=1, seed=3, progress=False, report=False,
              tensorboard=False)


# packed documents: each line of the corpus (ended by a newline, id 0 of the sorted characters) is one
PACKED = {"pack": True, "eod_id": 0}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The run of one process for data_args ``{}`` or :data:`PACKED` (each trained once)."""
    runs = {}

    def run(data_args):
        key = bool(data_args)
        if key not in runs:
            out = tmp_path_factory.mktemp("one")
            n = torch.get_num_threads()
            try:
                train(TrainConfig(model_args=dict(MODEL_ARGS), data_args=dict(data_args), out=str(out), **COMMON))
            finally:
                torch.set_num_threads(n)
            runs[key] = out
        return runs[key]
    return run


@pytest.mark.parametrize("nproc,data_args", [(2, {}), (4, {}), (2, PACKED)], ids=["2", "4", "2-packed"])
def test_split_sequences_match_one_process(nproc, data_args, one_process, tmp_path):
    """2 processes: one context-parallel group; 4: two groups of 2, data-parallel."""
    cp_out = tmp_path / "cp"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    mappings = dict(model_args=MODEL_ARGS, **({"data_args": data_args} if data_args else {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "whiteformer", "train", *cli_args(COMMON, **mappings), "--context-parallel", "2", "--out", str(cp_out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"context-parallel 2 x data-parallel {nproc // 2}" in res.stdout
    ref = one_process(data_args)

    a = load_file(str(cp_out / "final" / "model.safetensors"))
    b = load_file(str(ref / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
    logs = [[json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (cp_out, ref)]
    pairs = list(zip(*[[r for r in log if "train_loss" in r or "eval_loss" in r] for log in logs]))
    assert len(pairs) >= 3
    for r, s in pairs:
        for key in ("train_loss", "eval_loss"):
            if key in s:
                assert r[key] == pytest.approx(s[key], rel=1e-5), (key, r, s)


def test_context_parallel_refusals(tmp_path):
    from whiteformer.ops.context_parallel import token_chunk

    assert [token_chunk(7, i, 3) for i in range(3)] == [slice(0, 3), slice(3, 5), slice(5, 7)]
    with pytest.raises(ConfigError, match="block_size 1 must be >= context_parallel 2"):
        TrainConfig(context_parallel=2, block_size=1).validate()
    with pytest.raises(ConfigError, match="context_parallel and compile cannot be combined"):
        TrainConfig(context_parallel=2, compile=True).validate()
    with pytest.raises(ConfigError, match="divisible by it, got WORLD_SIZE=1"):
        train(TrainConfig(model_args=dict(MODEL_ARGS), out=str(tmp_path / "x"), context_parallel=2, **COMMON))
