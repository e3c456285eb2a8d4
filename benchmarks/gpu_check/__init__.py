"""The GPU check: everything the GPU path needs measured, in one command that fits a short
lease of a bare GPU machine (about 8 minutes).

Usage::

    python -m benchmarks.gpu_check --out DIR [--wheels WHEEL_DIR] [--budget-s 450] [--dry-run]

Parts, each in its own process with its own time limit (a crash, a hung kernel or a spent budget
loses only that part; every part saves its rows as it goes):

- ``env``: versions (torch, Triton, transformers, flash-linear-attention), the GPU;
- ``correctness`` (a): Triton vs the PyTorch path vs the float64 reference; float32, bfloat16,
  float16; masks, ``cu_seqlens``, odd sizes; forward and gradients; the decoding step;
- ``ops`` (b): each op as a multiple of ``w.clone()`` (:mod:`benchmarks.gpu`);
- ``bandwidth`` (e): the measured copy bandwidth and the kernels' traffic model;
- ``fla`` (c): flash-linear-attention's ``chunk_simple_gla`` / ``chunk_retention`` beside
  ``tssa`` / ``causal_tssa`` at the same shapes;
- ``lm`` (d): a training step of causal ToST vs GPT (SDPA), 12 layers, at 4k and 8k tokens;
- ``stack`` (b): 12 layers of TSSA vs MHSA (SDPA), 4k to 64k tokens, time and peak memory;
- ``lm_linearized`` (g): a ``decoder_base`` linearized with 0 steps: prefill 1k tokens, ``step`` per
  token, its logits against the parallel forward's (:mod:`benchmarks.gpu_check.lm_more`);
- ``lm_packed`` (h): the forward of a 12-layer causal ToST on one packed row of 1,000 documents
  (``cu_seqlens``), timed, two documents checked against each run alone.

Writes ``DIR/gpu_check.json`` (all parts and the summary), ``DIR/gpu_check.md`` (the summary
tables, also printed at the end: (f)), ``DIR/parts/PART.json`` and ``DIR/logs/PART.log``.

``--wheels WHEEL_DIR``: pure-Python wheels for what the machine lacks (entmax, einops, tensorly,
flash-linear-attention, fla-core; ``make gpu-wheels`` downloads them), installed with ``pip
install --no-index --no-deps --target`` into a temporary directory put on the parts' path; a
package the machine already has is left as it is. Nothing is installed into the environment.

``--dry-run``: the same pipeline on the CPU at tiny sizes, the kernels through Triton's
interpreter; what needs CUDA (fla's kernels, ``torch.compile`` timings) is skipped with the
reason recorded. It runs in the test suite, so the check is known to work before a GPU is at hand.

Exit code: 0 when every part finished and every correctness case passed, 1 otherwise (the
files are written either way), 2 for a usage error.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
PARTS = ["env", "correctness", "ops", "bandwidth", "fla", "lm", "stack", "lm_linearized", "lm_packed"]
# seconds per part on a GPU (the first calls compile the kernels); the whole check is cut at --budget-s
BUDGETS = {"env": 40, "correctness": 100, "ops": 100, "bandwidth": 40, "fla": 120, "lm": 60, "stack": 80,
           "lm_linearized": 45, "lm_packed": 45}
DRY_BUDGET_S = 120  # per part in a dry run
# bfloat16 on an H100 (the targets): op time / w.clone() time
TARGETS = {"tssa_fwd": 2.5, "tssa_fwdbwd": 6.0, "causal_fwdbwd": 8.0}
FULL_OPS = dict(n=16384, batch=1, heads=8, head_dim=64, dtype="bfloat16", repeats=20, warmup=3, depth=12,
                stack_n=[4096, 8192, 16384, 32768, 65536], stack_repeats=3)
DRY_OPS = dict(n=32, batch=1, heads=2, head_dim=8, dtype="bfloat16", repeats=2, warmup=1, depth=2, stack_n=[16],
               stack_repeats=1)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for every result file (created)")
    ap.add_argument("--wheels", type=Path, help="folder of pure-Python wheels to install for the parts")
    ap.add_argument("--budget-s", type=float, default=450.0, help="time for all parts together (seconds)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, kernels through Triton's interpreter")
    ap.add_argument("--overwrite", action="store_true", help="replace the result files of an earlier check in --out")
    return ap


def _usage(ap: argparse.ArgumentParser, msg: str) -> None:
    ap.print_usage(sys.stderr)
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _check_args(ap, args) -> List[str]:
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        _usage(ap, f"--parts: unknown part(s) {unknown or args.parts!r}; expected a subset of {','.join(PARTS)}")
    if not args.budget_s > 0:
        _usage(ap, f"--budget-s must be positive, got {args.budget_s}")
    if args.wheels is not None and not args.wheels.is_dir():
        _usage(ap, f"--wheels {args.wheels}: not a directory")
    out = args.out
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        _usage(ap, f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        _usage(ap, f"--out {out}: not empty (give --overwrite to replace an earlier check's files)")
    return parts


def install_wheels(wheels: Path, site: Path) -> List[Dict[str, str]]:
    """Install each wheel whose distribution the interpreter lacks into ``site`` (no index, no
    dependencies); a pure-Python wheel is unpacked directly if pip cannot run."""
    rows, todo = [], []
    for whl in sorted(wheels.glob("*.whl")):
        dist, version = whl.name.split("-")[:2]
        try:
            have = metadata.version(dist)
            rows.append({"wheel": whl.name, "action": f"kept the installed {dist} {have}"})
        except metadata.PackageNotFoundError:
            todo.append(whl)
    if not todo:
        return rows
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--target", str(site),
           *map(str, todo)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    for whl in todo:
        if res.returncode == 0:
            rows.append({"wheel": whl.name, "action": "pip install --no-index --no-deps --target"})
        else:
            with zipfile.ZipFile(whl) as z:
                z.extractall(site)
            rows.append({"wheel": whl.name, "action": f"unpacked (pip failed: {res.stderr.strip()[-200:]})"})
    return rows


def part_config(dry_run: bool, device: str) -> Dict[str, Any]:
    skip = {"compile": "torch.compile timings need a GPU (a dry run checks the pipeline, not speed)"} if dry_run else {}
    return {"dry_run": dry_run, "device": device, "ops_args": dict(DRY_OPS if dry_run else FULL_OPS),
            "skip_impls": skip, "targets": TARGETS}


def groups(parts: List[str], dry_run: bool) -> List[List[str]]:
    """Parts sharing one process. On a GPU each part has its own (crash isolation, its own limit);
    a dry run saves the start-up of most of them (``bandwidth`` apart: the traffic model records
    compiled kernels, not the interpreter's)."""
    if not dry_run:
        return [[p] for p in parts]
    shared = [p for p in parts if p != "bandwidth"]
    return ([shared] if shared else []) + ([["bandwidth"]] if "bandwidth" in parts else [])


def run_group(group: List[str], cfg: Dict[str, Any], out: Path, env: Dict[str, str], timeout: float
              ) -> Dict[str, Dict[str, Any]]:
    """Parts in one child process; each part's result file, with the status the parent saw."""
    outs = {p: str(out / "parts" / f"{p}.json") for p in group}
    spec = out / "parts" / f"{group[0]}.spec.json"
    spec.write_text(json.dumps({"config": cfg, "outs": outs}))
    log = out / "logs" / f"{'+'.join(group)}.log"
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_check._child", ",".join(group), str(spec)],
                                cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: Optional[int] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    spec.unlink()
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
    results = {}
    for part in group:
        data: Dict[str, Any] = {"part": part, "status": "not started", "rows": []}
        path = Path(outs[part])
        if path.exists():
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError:
                pass
        if data["status"] in ("running", "not started"):
            if code is None:
                data["status"] = f"stopped at the time limit ({timeout:g} s); {len(data.get('rows', []))} rows kept"
            else:
                data["status"] = f"failed: exit code {code}" + (f" ({tail[0][:200]})" if tail else "")
        data.setdefault("wall_s", round(time.time() - t0, 1))
        results[part] = data
    return results


def child_env(dry_run: bool, site: Optional[Path]) -> Dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT / "src"), str(ROOT)] + ([str(site)] if site else []) + [env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.pop("WHITEFORMER_BACKEND", None)
    env.pop("TRITON_INTERPRET", None)
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
    return env


def _importable(site: Optional[Path]) -> None:
    """This process imports the library from the checkout (and the wheels' directory), as its
    children do: on a bare GPU machine whiteformer is not installed."""
    for path in (str(ROOT / "src"), str(ROOT)):
        if path not in sys.path:
            sys.path.insert(0, path)
    if site is not None:
        sys.path.append(str(site))


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    parts = _check_args(ap, args)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("error: the GPU check needs a CUDA GPU (torch.cuda.is_available() is False); --dry-run runs it on "
              "the CPU at tiny sizes", file=sys.stderr)
        return 2
    site = Path(tempfile.mkdtemp(prefix="gpu-check-site-")) if args.wheels else None
    try:
        return _check(args, parts, argv, site)
    finally:
        if site is not None:
            shutil.rmtree(site, ignore_errors=True)


def _check(args, parts: List[str], argv: List[str], site: Optional[Path]) -> int:
    t0 = time.time()
    out = args.out
    for sub in ("parts", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    wheels = install_wheels(args.wheels, site) if args.wheels else []
    _importable(site)
    from .. import common
    from . import summary

    cfg = part_config(args.dry_run, "cpu" if args.dry_run else "cuda")
    results: Dict[str, Dict[str, Any]] = {}
    for group in groups(parts, args.dry_run):
        left = args.budget_s - (time.time() - t0)
        limit = min(sum(DRY_BUDGET_S if args.dry_run else BUDGETS[p] for p in group), left)
        if limit < 5:
            for part in group:
                results[part] = {"part": part, "status": f"not run: the budget of {args.budget_s:.0f} s was spent",
                                 "rows": []}
            continue
        print(f"[{time.time() - t0:5.0f} s] {', '.join(group)} (at most {limit:.0f} s)", flush=True)
        env = child_env(args.dry_run, site)
        if group == ["bandwidth"]:  # the traffic model records launches of the compiled kernels
            env.pop("TRITON_INTERPRET", None)
        for part, data in run_group(group, cfg, out, env, limit).items():
            results[part] = data
            print(f"        {part}: {data['status']} ({data['wall_s']} s)", flush=True)
    results = {p: results[p] for p in parts}
    report = summary.build(results, cfg)
    data = {"command": common.command_string("benchmarks.gpu_check", argv), "dry_run": args.dry_run,
            "budget_s": args.budget_s, "wall_s": round(time.time() - t0, 1), "wheels": wheels, "config": cfg,
            "targets": TARGETS, "summary": report["summary"], "parts": results}
    common.write_json(out / "gpu_check.json", data)
    common.write_text(out / "gpu_check.md", report["markdown"] + "\n")
    print()
    print(report["markdown"])
    print(f"\nwrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'} ({data['wall_s']} s)")
    return 0 if report["summary"]["complete"] else 1
