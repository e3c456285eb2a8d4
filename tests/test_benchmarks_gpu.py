"""benchmarks/gpu.py: the command line works on any machine; without a CUDA GPU it
refuses with one ``error:`` line and exit code 2, writing nothing."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu", *args, "--out", str(tmp_path / "gpu.json")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_help(tmp_path):
    res = _run("--help", tmp_path=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "usage: python -m benchmarks.gpu" in res.stdout and "--stack-n" in res.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_refuses_without_cuda(tmp_path):
    res = _run("--skip-stack", tmp_path=tmp_path)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "CUDA" in lines[0], res.stderr
    assert not (tmp_path / "gpu.json").exists()


def test_bad_sizes_are_a_usage_error(tmp_path):
    res = _run("--stack-n", "4k", tmp_path=tmp_path)
    assert res.returncode == 2 and "--stack-n" in res.stderr and "Traceback" not in res.stderr


def test_tables_render_from_a_result_row():
    from benchmarks import gpu

    row = {"impl": "triton", "status": "ok", "tssa_saved_x_w": 1.05, "causal_saved_x_w": 1.07}
    for op in gpu.OPS:
        row[op] = {"ratio": 1.5, "peak_bytes": 3 * 2**20}
    text = gpu.ops_table([row, {"impl": "compile", "status": "failed: X"}])
    assert "1.50x (3.0 MiB)" in text and "failed: X" in text and "1.05x w / 1.07x w" in text
    stack = gpu.stack_table([{"method": "tssa (triton)", "n": 4096, "fwd_s": 0.01, "fwd_peak_bytes": 2**20,
                              "fwdbwd_s": None, "fwdbwd_status": "out of memory"}])
    assert "| tssa (triton) | 4k | 10 ms | 1.0 MiB | out of memory | - |" in stack


def test_report_gpu_section(tmp_path):
    """Without a GPU result file the page says what could not be measured; with one it renders
    the tables from it."""
    import json

    from benchmarks import gpu, report

    text = "\n".join(report.gpu_section(tmp_path))
    assert "## 5. GPU: Triton kernels" in text and "correctness only" in text and "python -m benchmarks.gpu" in text
    row = {"impl": "triton", "status": "ok", "tssa_saved_x_w": 1.0, "causal_saved_x_w": 1.0}
    for op in gpu.OPS:
        row[op] = {"ratio": 2.5, "peak_bytes": 2**20}
    data = {"gpu": "Some GPU", "torch": "x", "triton": "y", "command": "python -m benchmarks.gpu",
            "config": {"dtype": "bfloat16", "batch": 1, "heads": 8, "head_dim": 64, "n": 16384, "depth": 12},
            "ops": [row], "stack": []}
    (tmp_path / "gpu.json").write_text(json.dumps(data))
    text = "\n".join(report.gpu_section(tmp_path))
    assert "Measured on Some GPU" in text and "2.50x (1.0 MiB)" in text and "correctness only" not in text


def test_model_runs_without_a_gpu(tmp_path):
    """--model: the traffic table per op and head dim, written to --model-out (no GPU needed)."""
    pytest.importorskip("triton")
    import json

    out = tmp_path / "model.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--model", "--n", "2048", "--model-out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {(r["op"], r["head_dim"]): r for r in data["rows"]}
    assert set(rows) == {(op, p) for op in ("tssa", "causal_tssa", "causal_tssa_step") for p in (16, 32, 64, 128, 256)}
    for key in (("tssa", 64), ("causal_tssa", 128)):
        assert rows[key]["bwd"]["goal_met"] and rows[key]["bwd"]["ratio"] <= 3.0
        assert rows[key]["fwd"]["time_s"] == pytest.approx(rows[key]["fwd"]["bytes"] / 3.35e12)
    assert "| tssa | 64 |" in res.stdout and "goal <= 3x: met" in res.stdout


def test_report_renders_the_model(tmp_path):
    import json

    from benchmarks import gpu, report

    text = "\n".join(report.gpu_model_section(tmp_path))
    assert "No GPU was available" in text and "python -m benchmarks.gpu --model" in text
    x = {"bytes": 4e8, "min_bytes": 2e8, "ratio": 2.0, "time_s": 1e-4, "min_time_s": 5e-5, "goal": 2.0,
         "goal_met": True}
    data = {"config": {"batch": 4, "heads": 8, "n": 16384, "dtype": "bfloat16"}, "command": "python -m benchmarks.gpu "
            "--model", "rows": [{"op": "tssa", "head_dim": 64, "block_n": 4, "num_warps": 8, "fwd": x, "bwd": x}]}
    (tmp_path / "gpu_model.json").write_text(json.dumps(data))
    text = "\n".join(report.gpu_model_section(tmp_path))
    assert "| tssa | 64 | 4 / 8 | 2.00x (goal <= 2x: met) | 100 µs (50 µs) |" in text
    assert gpu.model_table(data["rows"]) in text
