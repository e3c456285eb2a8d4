"""``transformers.Trainer`` (through ``accelerate``) with 2 CPU processes (torchrun, gloo) on the
whiteformer wrapper: the same losses and weights as one process with the same global batch."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers", reason="needs the hf extra: pip install whiteformer[hf]")
pytest.importorskip("accelerate", reason="Trainer needs accelerate")
pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available"),
              pytest.mark.usefixtures("fused_kernel_built")]

SRC = Path(__file__).resolve().parents[2] / "src"

# Every example is the same sequence, so any sampler order gives the same global batches: the two
# processes' run must equal the one-process run step for step.
SCRIPT = textwrap.dedent('''
    import gc, json, os, sys
    import torch
    import torch.distributed
    import whiteformer.hf
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    out, per_device = sys.argv[1], int(sys.argv[2])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    config = AutoConfig.for_model("whiteformer-tost-lm", model_name="tost_lm_base",
                                  init_kwargs=dict(vocab_size=61, dim=32, depth=2, num_heads=4, max_len=16))
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.arange(12) * 5 % 61
    data = [{"input_ids": ids, "labels": ids}] * 64
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=per_device, max_steps=3, learning_rate=1e-2,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True,
                             ddp_backend="gloo" if world > 1 else None)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        json.dump({"losses": losses, "world": trainer.args.world_size}, open(os.path.join(out, "losses.json"), "w"))
        trainer.save_model(os.path.join(out, "final"))
    # A process that exits with its gloo group alive can abort in interpreter shutdown (gloo work still
    # holding tensors): free the DDP-wrapped model, then destroy the group, as a training script should.
    del trainer, model
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
''')


def test_trainer_two_processes_match_one(tmp_path):
    script = tmp_path / "train_hf.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    runs = {"two": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
                    str(tmp_path / "two"), "2"],
            "one": [str(script), str(tmp_path / "one"), "4"]}
    for name, cmd in runs.items():
        res = subprocess.run([sys.executable, *cmd], env=env, capture_output=True, text=True, timeout=400)
        assert res.returncode == 0, name + res.stdout[-3000:] + res.stderr[-3000:]
    two, one = (json.loads((tmp_path / n / "losses.json").read_text()) for n in ("two", "one"))
    assert two["world"] == 2 and one["world"] == 1
    assert len(two["losses"]) == 3 and two["losses"] == pytest.approx(one["losses"], rel=1e-4)
    from safetensors.torch import load_file

    a, b = (load_file(str(tmp_path / n / "final" / "model.safetensors")) for n in ("two", "one"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
