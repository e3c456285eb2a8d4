"""Run the test suite's fast subset under other torch / transformers versions, each in a scratch
virtual environment outside the repository, and record the results.

Usage::

    python tools/version_matrix.py [--envs torch2.11,torch2.15] [--venv-dir DIR] [--no-install]
                                   [--groups ops,layers,models,hf] [--out benchmarks/results/version_matrix.json]

Environments (:data:`ENVS`): ``torch2.11`` is what the GPU machines run (torch 2.11, its Triton
3.6, transformers 5.17), ``torch2.15`` the newest torch (Triton 3.9) with the newest
transformers, ``torch2.7`` the oldest torch of the supported range with the oldest transformers.
Each lives in ``DIR/venv-NAME`` (default ``$XDG_CACHE_HOME/whiteformer/version-matrix``). Unless
``--no-install``, the environment is created and the pinned versions installed first. The
registry's torch wheels are CUDA builds: several GB each, downloaded once; they run on a CPU.
The install ignores the machine's pip configuration (``PIP_CONFIG_FILE=/dev/null``: a torch cap
there would refuse the pin) and constrains torch to the pin, so nothing resolves another torch.
The project itself is not installed: the tests import it from ``src/``.

The subset (:data:`GROUPS`): the operators (PyTorch paths, the C++ CPU kernel built against that
torch, the Triton kernels through the interpreter of that torch's Triton), the attention layers,
one model of each family (language, vision, long-range arena), and the Hugging Face tests (the
transformers check). Each group is one pytest process, run one after the other.

Results are merged by environment name into ``--out``: per environment the versions, and per group
the counts and the failing tests.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
# name -> (torch, transformers); torch's own Triton pin comes with it
ENVS: Dict[str, tuple] = {
    "torch2.11": ("2.11.0", "5.17.0"),
    "torch2.15": ("2.15.0", "5.24.0"),
    "torch2.7": ("2.7.1", "5.17.0"),
}
DEFAULT_ENVS = ["torch2.11", "torch2.15"]
OTHER = ["accelerate", "peft", "einops", "entmax", "numpy", "safetensors", "pyyaml", "tqdm", "ninja", "pytest",
         "hypothesis", "tensorly", "matplotlib"]
GROUPS: Dict[str, List[str]] = {
    "ops": ["tests/ops/test_tssa.py", "tests/ops/test_causal_tssa.py", "tests/ops/test_dmsa.py",
            "tests/ops/test_eca.py", "tests/ops/test_baselines.py", "tests/ops/test_packing.py",
            "tests/ops/test_linear_cross_entropy.py", "tests/ops/test_kernel_backends.py",
            "tests/ops/test_triton_kernels.py", "tests/ops/test_triton_dispatch.py"],
    "layers": ["tests/attention", "tests/layers"],
    "models": ["tests/models/test_lm.py", "tests/models/test_vision.py", "tests/models/test_lra.py",
               "-k", "build_and_forward or builds_and_forward or prefill_and_step or train_step or lra"],
    "hf": ["tests/hf/test_hf.py", "tests/hf/test_auto.py", "tests/hf/test_peft.py", "tests/hf/test_labels.py",
           "tests/hf/test_generate_options.py", "tests/hf/test_lens.py", "tests/hf/test_training.py"],
}
# failures that come from running a CUDA build of torch on a machine without a GPU driver, not from whiteformer
KNOWN = {
    "test_caches_of_other_kinds_are_refused": "transformers' offloading DynamicCache creates a CUDA stream at "
    "construction in some versions: a CUDA torch without a GPU driver fails there, before whiteformer runs",
}
GROUP_TIMEOUT_S = 1800


def default_venv_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "whiteformer" / "version-matrix"


def _pip_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def install(venv: Path, torch_version: str, transformers_version: str) -> None:
    """Create ``venv`` if needed and install the pins (torch first, then the rest under a torch constraint)."""
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text(f"torch=={torch_version}\n")
    env = _pip_env()
    pip = [str(py), "-m", "pip", "install", "-q", "-c", str(constraints)]
    subprocess.run([*pip, f"torch=={torch_version}"], check=True, env=env)
    subprocess.run([*pip, f"transformers=={transformers_version}", *OTHER], check=True, env=env)


def versions(py: Path) -> Dict[str, Optional[str]]:
    code = ("import json, platform, importlib.metadata as m\n"
            "def v(n):\n try:\n  return m.version(n)\n except m.PackageNotFoundError:\n  return None\n"
            "names = ('torch', 'triton', 'transformers', 'peft', 'accelerate', 'numpy')\n"
            "print(json.dumps({n: v(n) for n in names} | {'python': platform.python_version()}))")
    res = subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True)
    return json.loads(res.stdout)


def run_group(py: Path, name: str, args: List[str]) -> Dict[str, Any]:
    """One pytest process over the group's tests: counts and failing test ids from its JUnit XML."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "WHITEFORMER_BACKEND", "PYTHONPATH")}
    env["PYTHONPATH"] = str(ROOT / "src")
    with tempfile.TemporaryDirectory(prefix="version-matrix-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--junitxml={xml}", *args]
        t0 = time.time()
        try:
            res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=GROUP_TIMEOUT_S)
            code, tail = res.returncode, (res.stdout + res.stderr).strip().splitlines()[-3:]
        except subprocess.TimeoutExpired:
            code, tail = None, [f"stopped after {GROUP_TIMEOUT_S} s"]
        out: Dict[str, Any] = {"tests": args, "seconds": round(time.time() - t0, 1), "exit_code": code,
                               "summary": tail[-1] if tail else ""}
        if xml.exists():
            out.update(parse_junit(xml))
    return out


def parse_junit(path: Path) -> Dict[str, Any]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failing = []
    for case in root.iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            msg = (bad.get("message") or "").splitlines()[0][:200] if bad.get("message") else ""
            name = case.get("name") or ""
            note = next((f" [{v}]" for k, v in KNOWN.items() if name.startswith(k)), "")
            failing.append(f"{case.get('classname')}::{name}: {msg}{note}")
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"passed": passed, "failed": counts["failures"], "errors": counts["errors"], "skipped": counts["skipped"],
            "failing": failing}


def merge(path: Path, runs: Dict[str, Dict[str, Any]], command: str) -> Dict[str, Any]:
    data: Dict[str, Any] = {}
    if path.exists():
        data = json.loads(path.read_text())
    data.update({"description": "the test suite's fast subset under other torch / transformers versions "
                                "(tools/version_matrix.py), on a CPU: the CUDA torch wheels run their CPU paths "
                                "and the Triton kernels run in that Triton's interpreter",
                 "groups": GROUPS})
    old = data.setdefault("runs", {})
    for name, run in runs.items():
        if name in old and old[name]["versions"] == run["versions"]:  # the same environment: update its groups
            run["groups"] = {**old[name]["groups"], **run["groups"]}
        old[name] = run
        for group in run["groups"].values():
            group.setdefault("command", command)
    data["runs"] = dict(sorted(old.items()))
    _files().write_text(path, json.dumps(data, indent=1) + "\n")
    return data


def _files():
    """whiteformer._files (standard library only) without importing the package: this script runs
    on any Python, torch or not."""
    spec = importlib.util.spec_from_file_location("whiteformer_files", ROOT / "src" / "whiteformer" / "_files.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def table(data: Dict[str, Any]) -> str:
    lines = ["| env | torch | triton | transformers | " + " | ".join(GROUPS) + " |",
             "|" + "---|" * (4 + len(GROUPS))]
    for name, run in data["runs"].items():
        v = run["versions"]
        cells = []
        for g in GROUPS:
            r = run["groups"].get(g)
            bad = None if r is None else r.get("failed", 0) + r.get("errors", 0)
            cells.append("-" if r is None else f"{r.get('passed', '?')} passed, {bad} failed ({r['seconds']:.0f} s)")
        lines.append(f"| {name} | {v['torch']} | {v['triton']} | {v['transformers']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _names(text: str, known: Sequence[str], what: str) -> List[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown {what} {bad or text!r}; expected some of {','.join(known)}")
    return names


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/version_matrix.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--envs", type=lambda s: _names(s, list(ENVS), "environment"), default=DEFAULT_ENVS)
    ap.add_argument("--groups", type=lambda s: _names(s, list(GROUPS), "group"), default=list(GROUPS))
    ap.add_argument("--venv-dir", type=Path, default=default_venv_dir())
    ap.add_argument("--no-install", action="store_true", help="use the environments as they are")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "version_matrix.json")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    venv_dir = args.venv_dir.resolve()
    if venv_dir == ROOT or ROOT in venv_dir.parents:
        ap.error(f"--venv-dir {args.venv_dir}: must be outside the repository")
    data: Dict[str, Any] = {}
    for name in args.envs:
        torch_version, tf_version = ENVS[name]
        venv = venv_dir / f"venv-{name}"
        if not args.no_install:
            print(f"{name}: installing torch {torch_version}, transformers {tf_version} into {venv}", flush=True)
            install(venv, torch_version, tf_version)
        py = venv / "bin" / "python"
        if not py.exists():
            ap.error(f"{venv}: no environment there (run without --no-install to create it)")
        run: Dict[str, Any] = {"versions": versions(py), "machine": platform.machine(), "groups": {},
                               "date": time.strftime("%Y-%m-%d")}
        for group in args.groups:
            print(f"{name}: {group} ...", flush=True)
            r = run_group(py, group, GROUPS[group])
            r["command"] = "python tools/version_matrix.py " + " ".join(argv)
            print(f"{name}: {group}: {r['summary']}", flush=True)
            run["groups"] = {group: r}  # saved at once, merged with the environment's other groups
            data = merge(args.out, {name: run}, "python tools/version_matrix.py " + " ".join(argv))
    print(table(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
