"""benchmarks/gpu_check: the one-call GPU check. Its dry run (CPU, Triton's interpreter, tiny
sizes) goes through every part and writes DIR/gpu_check.json, so the check is known to work
before a GPU is at hand; the summary, the wheel installation and the time limits are checked on
their own."""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, timeout=900):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "WHITEFORMER_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_dry_run_runs_every_part(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "check"
    res = _run("--dry-run", "--out", out)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((out / "gpu_check.json").read_text())
    parts = data["parts"]
    assert data["dry_run"] and list(parts) == ["env", "correctness", "ops", "bandwidth", "fla", "lm", "stack",
                                               "lm_linearized", "lm_packed"]
    assert all(p["status"] == "ok" for p in parts.values()), {k: p["status"] for k, p in parts.items()}
    # (a) Triton and the PyTorch path against the reference, every dtype, masks and packed documents
    rows = parts["correctness"]["rows"]
    assert {r["dtype"] for r in rows} == {"float32", "float16", "bfloat16"}
    assert {r["layout"] for r in rows} >= {"mask", "cu_seqlens", "steps"} and all(r["passed"] for r in rows)
    assert all(r["triton"]["rel_err"]["grad_w"] < r["tol"] for r in rows if r["op"] != "causal_tssa_step")
    # (b) the ops through both paths (torch.compile skipped with its reason), the stacks
    ops = {r["impl"]: r for r in parts["ops"]["rows"]}
    assert ops["triton"]["status"] == ops["torch"]["status"] == "ok" and ops["triton"]["tssa_fwd"]["ratio"] > 0
    assert ops["compile"]["status"].startswith("skipped: ")
    assert {r["method"] for r in parts["stack"]["rows"]} == {"tssa (triton)", "tssa (torch)", "mhsa (sdpa)"}
    # (c) TSSA timed, fla skipped on a CPU with the reason; (d) both language models stepped
    fla = {r["impl"]: r for r in parts["fla"]["rows"]}
    assert fla["causal_tssa"]["fwdbwd"]["time_s"] > 0 and "CUDA" in fla["chunk_simple_gla"]["status"]
    assert {r["model"] for r in parts["lm"]["rows"] if r.get("time_s", 0) > 0} == {"tost", "gpt_sdpa"}
    # (e) copy bandwidth and the traffic model, combined with the op times in the summary
    assert parts["bandwidth"]["copy"]["bytes_per_s"] > 0
    bw = data["summary"]["bandwidth"]["ops"]
    assert set(bw) == {"tssa_fwd", "tssa_fwdbwd", "causal_fwd", "causal_fwdbwd"}
    assert bw["tssa_fwdbwd"]["model_bytes"] > bw["tssa_fwd"]["model_bytes"] > 0 and bw["tssa_fwd"]["pct_of_copy"] > 0
    # (g) the linearized model's steps equal its parallel forward, its state keeps its size; (h) packed
    # documents give each document's logits as alone
    (lin,), (packed,) = parts["lm_linearized"]["rows"], parts["lm_packed"]["rows"]
    assert lin["passed"] and lin["step_s_median"] > 0
    assert lin["state_bytes_after_prompt"] == lin["state_bytes_after_steps"] > 0
    assert packed["passed"] and packed["time_s"] > 0 and packed["documents"] > 1
    assert not data["summary"]["lm_more"]["failed"]
    # (f) the summary, printed and written
    md = (out / "gpu_check.md").read_text()
    assert "## Targets (bfloat16, H100)" in md and md.strip() in res.stdout
    assert (out / "logs").is_dir() and not list((out / "parts").glob("*.spec.json"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_refuses_without_cuda(tmp_path):
    res = _run("--out", tmp_path / "check", timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and "--dry-run" in lines[0]
    assert not (tmp_path / "check").exists()


def test_usage_errors(tmp_path):
    (tmp_path / "old.json").write_text("{}")
    res = _run("--dry-run", "--out", tmp_path, timeout=120)
    assert res.returncode == 2 and "not empty" in res.stderr and "--overwrite" in res.stderr
    assert (tmp_path / "old.json").read_text() == "{}"
    res = _run("--dry-run", "--out", tmp_path / "new", "--parts", "ops,nope", timeout=120)
    assert res.returncode == 2 and "nope" in res.stderr and "Traceback" not in res.stderr


def _wheel(folder: Path, dist: str, module: str) -> Path:
    """A minimal pure-Python wheel holding ``module`` (one constant)."""
    path = folder / f"{dist}-1.0-py3-none-any.whl"
    info = f"{dist}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}.py", "VALUE = 42\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", f"{module}.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    return path


def test_wheels_missing_are_installed_present_are_kept(tmp_path):
    from benchmarks.gpu_check import install_wheels

    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels, "gpu_check_probe", "gpu_check_probe")
    _wheel(wheels, "pytest", "not_pytest")  # a distribution this interpreter has
    rows = {r["wheel"].split("-")[0]: r["action"] for r in install_wheels(wheels, site)}
    assert rows["pytest"].startswith("kept the installed pytest")
    assert "--no-index" in rows["gpu_check_probe"] or rows["gpu_check_probe"].startswith("unpacked")
    assert (site / "gpu_check_probe.py").read_text() == "VALUE = 42\n" and not (site / "not_pytest.py").exists()


def test_a_part_past_its_time_limit_is_stopped(tmp_path):
    from benchmarks.gpu_check import child_env, part_config, run_group

    for sub in ("parts", "logs"):
        (tmp_path / sub).mkdir()
    res = run_group(["env", "ops"], part_config(True, "cpu"), tmp_path, child_env(True, None), timeout=0.5)
    assert set(res) == {"env", "ops"}
    assert all(r["status"].startswith("stopped at the time limit (0.5 s)") for r in res.values()), res


_SUMMARY = {}


def test_summary_targets_and_bandwidth():
    """The summary's arithmetic on hand-made part results: achieved bandwidth = modelled bytes /
    time, as a share of the copy bandwidth; the fla target needs every shape faster."""
    from benchmarks import gpu
    from benchmarks.gpu_check import TARGETS, summary

    w_bytes = 1000
    triton = {"impl": "triton", "status": "ok", "tssa_saved_x_w": 1.0, "causal_saved_x_w": 1.0}
    for op in gpu.OPS:
        triton[op] = {"ratio": 3.0, "time_s": 1e-3, "peak_bytes": 0}
    model = {"fwd_bytes": 2500, "bwd_bytes": 4000, "w_bytes": w_bytes}
    fla_rows = []
    for d, (mine, gla) in {64: (1.0, 2.0), 128: (3.0, 2.0)}.items():
        shape = {"B": 4, "T": 16384, "H": 8, "D": d}
        fla_rows += [{"impl": "causal_tssa", "shape": shape, "fwd": {"time_s": 0.1}, "fwdbwd": {"time_s": mine}},
                     {"impl": "chunk_simple_gla", "shape": shape, "fwd": {"time_s": 0.1}, "fwdbwd": {"time_s": gla}}]
    results = {"ops": {"status": "ok", "rows": [triton]},
               "bandwidth": {"status": "ok", "copy": {"bytes_per_s": 5e6},
                             "rows": [{"op": "tssa", **model}, {"op": "causal_tssa", **model}]},
               "fla": {"status": "ok", "rows": fla_rows}}
    s = summary.build(results, {"dry_run": False, "targets": TARGETS})["summary"]
    _SUMMARY.update(summary=s, parts=results)
    bw = s["bandwidth"]["ops"]
    assert bw["tssa_fwd"]["model_x_clone"] == pytest.approx(1.25)
    assert bw["tssa_fwdbwd"]["achieved_bytes_per_s"] == pytest.approx(6500 / 1e-3)
    assert bw["tssa_fwdbwd"]["pct_of_copy"] == pytest.approx(100 * 6.5e6 / 5e6)
    targets = {t["target"]: t for t in s["targets"]}
    assert targets["tssa_fwd <= 2.5x clone"]["met"] is False and targets["tssa_fwdbwd <= 6x clone"]["met"] is True
    gla = targets["causal_tssa fwd+bwd faster than chunk_simple_gla at every shape"]
    assert gla["met"] is False and gla["value"] == pytest.approx(1.5)
    assert s["complete"]


def test_report_renders_the_check(tmp_path):
    """docs/benchmarks.md's GPU section: without a GPU run it says so (a dry run does not count);
    with one, the check's summary tables under its own headings."""
    from benchmarks import report

    text = "\n".join(report.gpu_check_section(tmp_path))
    assert "Not run on a GPU yet" in text and "python -m benchmarks.gpu_check" in text
    if not _SUMMARY:
        test_summary_targets_and_bandwidth()
    (tmp_path / "gpu_check").mkdir()
    data = {"dry_run": False, "command": "python -m benchmarks.gpu_check --out x", "wall_s": 400, **_SUMMARY}
    (tmp_path / "gpu_check" / "gpu_check.json").write_text(json.dumps(data))
    text = "\n".join(report.gpu_check_section(tmp_path))
    assert "Not run on a GPU yet" not in text and "`python -m benchmarks.gpu_check --out x` (400 s)" in text
    assert "#### Targets (bfloat16, H100)" in text and "| tssa_fwd <= 2.5x clone | 3.00x | NOT met |" in text
    assert "| B4 T16384 H8 D64 |" in text
