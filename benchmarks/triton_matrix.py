"""The Triton version matrix: the kernels' compile check and interpreter tests under every Triton
release that a supported torch pins (``make triton-matrix``).

Each release is either an install folder given with ``--dirs`` (one ``pip install --no-deps
--target DIR triton==X`` per release, its version read from the folder) or, without ``--dirs``, a
version of ``--versions`` whose wheel is downloaded once (``pip download --no-deps``) into
``CACHE/wheels`` and installed with ``pip install --no-deps --no-index --target CACHE/triton-X``
(CACHE: ``--cache``, default ``~/.cache/whiteformer-triton``; never the project's environment).
Then, with that folder first on ``PYTHONPATH`` and this interpreter's torch:

1. the compile check (:mod:`benchmarks.kernels.compile_check`): the kernel launches of
   :data:`benchmarks.kernels.compile_check.MATRIX_WORKLOAD` recorded (not run), each distinct
   specialisation compiled for sm_80 and sm_90, registers and stack frame read from the cubin, per
   kernel;
2. the interpreter tests (:data:`INTERPRETER_TESTS`, ``TRITON_INTERPRET=1``), one pytest run.

Versions run one after the other (the compiles use ``--jobs`` processes). The result, per
version (compiles ok / failed, compiles with a stack frame, max stack, max registers, the same per
kernel, tests passed / failed), is written to
``--out`` (default ``benchmarks/results/triton_matrix.json``) as soon as it is measured, keeping
the other releases' entries (``--versions 3.6.0`` reruns one), and printed as a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ("3.3.1", "3.5.1", "3.6.0", "3.7.1", "3.8.0", "3.9.0")  # pinned by torch 2.7, 2.9, 2.11, 2.13, 2.14, 2.15
# every kernel test (forward, gradients, float64 gradcheck, masks, chunk boundaries, the step), the
# public ops on the kernels (head dims 4 and 64) and the fallback: a few minutes per release
INTERPRETER_TESTS = ("tests/ops/test_triton_kernels.py",
                     "tests/ops/test_triton_dispatch.py::test_forced_backend_public_ops_match_reference[4]",
                     "tests/ops/test_triton_dispatch.py::test_forced_backend_public_ops_match_reference[64]",
                     "tests/ops/test_triton_fallback.py")
DEFAULT_CACHE = Path.home() / ".cache" / "whiteformer-triton"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "triton_matrix.json"


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True)


def install(version: str, cache: Path) -> Path:
    """The directory holding Triton ``version`` (downloaded and installed on first use)."""
    target = cache / f"triton-{version}"
    done = target / ".whiteformer-installed"
    if done.exists():
        return target
    wheels = cache / "wheels"
    if not list(wheels.glob(f"triton-{version}-*.whl")):
        _pip("download", "--no-deps", "--only-binary", ":all:", "--dest", str(wheels), f"triton=={version}")
    _pip("install", "--no-deps", "--no-index", "--find-links", str(wheels), "--target", str(target),
         "--upgrade", f"triton=={version}")
    done.write_text(version + "\n")
    return target


def installed_version(target: Path) -> str:
    """The Triton version installed in the ``--target`` folder ``target`` (from its dist-info)."""
    found = sorted(target.glob("triton-*.dist-info"))
    if not found:
        raise FileNotFoundError(f"{target} holds no triton-*.dist-info (not a pip --target install of triton)")
    return found[-1].name[len("triton-"):-len(".dist-info")]


def _env(target: Path, cache: Path, version: str, interpret: bool) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join([str(target), str(ROOT / "src"), str(ROOT)])
    env["TRITON_CACHE_DIR"] = str(cache / f"compiled-{version}")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return env


def compile_check(target: Path, cache: Path, version: str, jobs: int) -> dict:
    """Run the compile check under ``target``'s Triton (a child process): its summary."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "compile.json"
        # without the interpreter: before Triton 3.6 interpreted kernels bypass the recorded entry (they would run)
        proc = subprocess.run([sys.executable, "-m", "benchmarks.kernels.compile_check", "--matrix", str(out),
                               "--jobs", str(jobs)], cwd=ROOT, env=_env(target, cache, version, False),
                              capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            return {"error": (proc.stderr or proc.stdout)[-2000:]}
        return json.loads(out.read_text())


def interpreter_tests(target: Path, cache: Path, version: str) -> dict:
    """Run :data:`INTERPRETER_TESTS` under ``target``'s Triton's interpreter: counts and failures."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                               *INTERPRETER_TESTS], cwd=ROOT, env=_env(target, cache, version, True),
                              capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if not report.exists():
            return {"error": (proc.stdout + proc.stderr)[-2000:]}
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        failed: List[str] = []
        for suite in ET.parse(report).getroot().iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
            for case in suite.iter("testcase"):
                bad = case.find("failure")
                bad = bad if bad is not None else case.find("error")
                if bad is not None:
                    failed.append(f"{case.get('name')}: {(bad.get('message') or '')[:300]}")
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"files": list(INTERPRETER_TESTS), "passed": passed, "failed": counts["failures"] + counts["errors"],
            "skipped": counts["skipped"], "seconds": round(seconds, 1), "failures": failed[:20]}


def table(results: List[dict]) -> str:
    """The matrix as a Markdown table."""
    lines = ["| Triton | specialisations | compiles ok / failed (sm_80 + sm_90) | with a stack frame | "
             "max stack (bytes) | max registers | kernels with a stack frame | interpreter tests passed / failed |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        c, t = r["compile"], r.get("interpreter", {"error": "not run"})
        if "error" in c:
            lines.append(f"| {r['triton']} | - | error | - | - | - | - | - |")
            continue
        framed = ", ".join(k for k, v in c.get("kernels", {}).items() if v["spilled"]) or "-"
        tests = t["error"][:20] if "error" in t else f"{t['passed']} / {t['failed']}"
        lines.append(f"| {r['triton']} | {c.get('specialisations', '?')} | {c['ok']} / {c['failed']} | {c['spilled']} | "
                     f"{c['max_stack']} | {c['max_registers']} | {framed} | {tests} |")
    return "\n".join(lines)


def record(out: Path, entry: dict, lock: Path) -> List[dict]:
    """Write one release's entry into ``out`` (the other releases' entries kept, in version
    order; runs for different releases may write at once, holding ``lock``): all entries."""
    import fcntl

    import numpy
    import torch

    out.parent.mkdir(parents=True, exist_ok=True)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        old = json.loads(out.read_text())["results"] if out.exists() else []
        results = {r["triton"]: r for r in old}
        results[entry["triton"]] = entry
        ordered = sorted(results.values(), key=lambda r: tuple(int(x) for x in r["triton"].split(".")[:3]))
        doc = {"command": "make triton-matrix  (python -m benchmarks.triton_matrix)",
               "python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
               "interpreter_tests": list(INTERPRETER_TESTS), "results": ordered}
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(out)
    return ordered


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.triton_matrix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", default=",".join(VERSIONS), help="comma-separated Triton versions")
    parser.add_argument("--dirs", default="", help="space- or comma-separated pip --target folders of Triton "
                        "releases (each release's version read from its folder; replaces --versions)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="wheels and installs (outside the repo)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compiles")
    parser.add_argument("--skip-tests", action="store_true", help="only the compile check")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    dirs = [Path(d) for d in args.dirs.replace(",", " ").split()]
    if dirs:
        try:
            releases = [(installed_version(d), d) for d in dirs]
        except FileNotFoundError as e:
            parser.error(f"--dirs: {e}")
    else:
        releases = [(v.strip(), None) for v in args.versions.split(",") if v.strip()]
    for version, target in releases:
        if target is None:
            print(f"Triton {version}: installing", flush=True)
            target = install(version, args.cache)
        print(f"Triton {version}: compile check", flush=True)
        entry = {"triton": version, "compile": compile_check(target, args.cache, version, args.jobs)}
        if not args.skip_tests:
            print(f"Triton {version}: interpreter tests", flush=True)
            entry["interpreter"] = interpreter_tests(target, args.cache, version)
        results = record(args.out, entry, args.cache / "results.lock")
    print(table(results))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
