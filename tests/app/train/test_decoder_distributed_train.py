"""``whiteformer train --finetune`` of a linearized decoder (what ``whiteformer linearize`` writes)
under torchrun with 2 CPU processes (gloo): the all-TSSA student with ``--context-parallel 2`` and the
hybrid (a softmax layer kept) with ``--fsdp`` give the same losses and model as one process; the
hybrid under ``--context-parallel`` is one ``error:`` line per rank and writes nothing."""
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from test_context_parallel_train import COMMON as CP_COMMON
from test_context_parallel_train import SRC
from test_ddp import cli_args
from test_fsdp import _losses
from whiteformer.app.train import TrainConfig, train

pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available"),
              pytest.mark.usefixtures("fused_kernel_built")]

COMMON = dict(CP_COMMON, model="tost_decoder_base", log_every=1)
TEACHER = dict(dim=16, depth=2, num_heads=2, num_kv_heads=1, intermediate_size=24, max_len=None)


@pytest.fixture(scope="module")
def students(tmp_path_factory):
    """Folders of the plain swap (``linearize`` without training steps) of a softmax decoder over the
    text data's vocabulary: ``"tssa"`` (every layer TSSA) and ``"hybrid"`` (layer 1 kept softmax)."""
    from whiteformer.app.train.build import build_datasets
    from whiteformer.convert import linearize
    from whiteformer.models import create_model

    vocab = build_datasets("text", None, {}, "val", eval_only=True)[0].vocab_size
    torch.manual_seed(0)
    teacher = create_model("decoder_base", vocab_size=vocab, **TEACHER)
    batches = [torch.randint(0, vocab, (2, 9))]
    root = tmp_path_factory.mktemp("students")
    for name, keep in (("tssa", []), ("hybrid", [1])):
        student, _ = linearize(teacher, batches, keep_softmax=keep, transfer_steps=0, finetune_steps=0,
                               progress=False)
        student.save_pretrained(root / name)
    return root


def _torchrun(student, out, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "whiteformer",
           "train", *cli_args(COMMON), "--finetune", str(student), "--out", str(out), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _one_process(student, out):
    n = torch.get_num_threads()
    try:
        train(TrainConfig(finetune=str(student), out=str(out), unlimited_length=True, **COMMON))
    finally:
        torch.set_num_threads(n)


def _same_run(a, b):
    """The same losses at every step and the same final weights."""
    assert len(_losses(a)) == COMMON["steps"]
    assert _losses(a) == pytest.approx(_losses(b), rel=1e-5)
    wa, wb = (load_file(str(d / "final" / "model.safetensors")) for d in (a, b))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize("student,option", [("tssa", ["--context-parallel", "2"]), ("hybrid", ["--fsdp"])],
                         ids=["tssa-context-parallel", "hybrid-fsdp"])
def test_a_linearized_decoder_trains_split_as_in_one_process(students, student, option, tmp_path):
    res = _torchrun(students / student, tmp_path / "split", *option)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    _one_process(students / student, tmp_path / "one")
    _same_run(tmp_path / "split", tmp_path / "one")


def test_context_parallel_refuses_a_hybrid_in_one_line(students, tmp_path):
    res = _torchrun(students / "hybrid", tmp_path / "out", "--context-parallel", "2")
    assert res.returncode != 0
    # one per rank; the ranks share stderr, so two lines can land on one without a newline between
    errors = res.stderr.split("whiteformer train: error:")[1:]
    assert len(errors) == 2, res.stderr[-3000:]
    assert all(e.startswith(" DecoderLM cannot run context-parallel: block 1 is softmax attention, which would need "
                            "ring attention") for e in errors)
    assert not (tmp_path / "out").exists()
