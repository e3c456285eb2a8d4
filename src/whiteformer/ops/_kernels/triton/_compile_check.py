"""Compile recorded kernel launches for NVIDIA GPUs without a GPU, and read their resources.

1. :func:`specialisations`: the distinct specialisations among recorded launches
   (:func:`._launches.record_launches`): kernel, Triton signature, constexpr values, the
   16-divisibility of pointers and integers (as Triton's launcher specialises them) and the launch
   options (``num_warps``, ``num_stages``, ``maxnreg``).
2. :func:`compile_specialisations`: compiles each for each compute capability with
   ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` in a child process where
   ``TRITON_INTERPRET`` is unset (the real ``JITFunction`` s), in parallel, and reads the cubin's
   ``cuobjdump -res-usage``: registers per thread (``REG``, 255 is the ceiling) and the spilled
   stack frame per thread (``STACK``, bytes). Triton's cache (``TRITON_CACHE_DIR``) serves repeated
   runs.

``python -m whiteformer.ops._kernels.triton._compile_check SPECS.json OUT.json [JOBS]`` is the child.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

import torch

from ...._checks import is_int
from ._launches import Launch

__all__ = ["CCS", "Result", "Spec", "compile_specialisations", "specialisations"]

CCS = (80, 90)  # A100, H100
_RES = re.compile(r"Function ([^\s:]+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


@dataclass(frozen=True)
class Spec:
    """One specialisation: ``kernel`` = module.name; signature and constexprs as JSON-able text
    (dtype constexprs by their Triton name, e.g. ``"fp32"``); ``divisible``: the parameters that
    are multiples of 16 (pointers: 16-byte aligned); options: num_warps, num_stages, maxnreg."""

    kernel: str
    signature: tuple
    constexprs: tuple
    divisible: tuple
    options: tuple

    def describe(self) -> str:
        const = ", ".join(f"{k}={v}" for k, v in self.constexprs)
        ptrs = ", ".join(f"{k}:{t}" for k, t in self.signature if t.startswith("*"))
        opts = ", ".join(f"{k}={v}" for k, v in self.options)
        return f"{self.kernel.rsplit('.', 1)[-1]}[{const}; {opts}] ({ptrs})"


@dataclass
class Result:
    spec: Spec
    cc: int
    reg: Optional[int] = None
    stack: Optional[int] = None
    shared: Optional[int] = None
    error: Optional[str] = None

    def describe(self) -> str:
        where = f"{self.spec.describe()} on sm_{self.cc}"
        if self.error:
            return f"{where}: does not compile: {self.error}"
        return f"{where}: REG {self.reg} STACK {self.stack} SHARED {self.shared}"


def _constexpr_text(value) -> object:
    if isinstance(value, (bool, int, float)) or value is None:
        return value
    return f"dtype:{value}"  # tl.float32 -> "dtype:fp32"


def _divisible(name: str, value) -> bool:
    if isinstance(value, torch.Tensor):
        return True  # torch allocations are 16-byte aligned
    return is_int(value) and value % 16 == 0


def specialisations(launches: Iterable[Launch]) -> List[Spec]:
    """Distinct specialisations (first-seen order) of the recorded launches."""
    seen: Dict[Spec, None] = {}
    for launch in launches:
        sig = launch.signature()
        spec = Spec(
            launch.kernel,
            tuple(sig.items()),
            tuple((k, _constexpr_text(v)) for k, v in launch.constexprs.items()),
            tuple(k for k, v in launch.args.items() if _divisible(k, v)),
            tuple(sorted(launch.options.items())),
        )
        seen.setdefault(spec, None)
    return list(seen)


# ------------------------------------------------------------------ the child process side


def _cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def _compile_one(job) -> dict:
    """(spec as dict, cc) -> {"reg", "stack", "shared"} or {"error"}: in a worker of the child."""
    import importlib

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec, cc = job
    module, name = spec["kernel"].rsplit(".", 1)
    try:
        fn = getattr(importlib.import_module(module), name)
        if not isinstance(fn, triton.runtime.JITFunction):
            raise RuntimeError(f"{spec['kernel']} is not a JITFunction (TRITON_INTERPRET set in the compiler?)")
        constexprs = {k: tl.dtype(v[6:]) if isinstance(v, str) and v.startswith("dtype:") else v
                      for k, v in spec["constexprs"]}
        names = fn.arg_names
        attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in spec["divisible"]}
        src = ASTSource(fn=fn, signature=dict(spec["signature"]), constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=dict(spec["options"]))
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "k.cubin"
            path.write_bytes(compiled.asm["cubin"])
            text = subprocess.run([_cuobjdump(), "-res-usage", str(path)], capture_output=True, text=True,
                                  check=True, timeout=120).stdout
        found = _RES.search(text)
        if found is None:
            raise RuntimeError(f"cannot read cuobjdump -res-usage output: {text[-300:]!r}")
        return {"reg": int(found.group(2)), "stack": int(found.group(3)), "shared": int(found.group(4))}
    except Exception as e:  # noqa: BLE001 - reported per specialisation
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        return {"error": f"{type(e).__name__}: {' | '.join(lines[-3:])[:600]}"}


def _child(specs_path: str, out_path: str, jobs: int) -> None:
    specs = json.loads(Path(specs_path).read_text())
    work = [(s, cc) for s in specs["specs"] for cc in specs["ccs"]]
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            results = list(pool.map(_compile_one, work))
    else:
        results = [_compile_one(w) for w in work]
    Path(out_path).write_text(json.dumps(results))


def compile_specialisations(specs: Sequence[Spec], ccs: Sequence[int] = CCS, jobs: int = 2,
                            timeout: float = 1800) -> List[Result]:
    """Compile each specialisation for each compute capability (in a child process without
    ``TRITON_INTERPRET``) and return the resources, one :class:`Result` per (spec, cc)."""
    src = Path(__file__).resolve().parents[4]  # .../src
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as tmp:
        spec_file, out_file = Path(tmp) / "specs.json", Path(tmp) / "out.json"
        spec_file.write_text(json.dumps({"specs": [asdict(s) for s in specs], "ccs": list(ccs)}))
        proc = subprocess.run([sys.executable, "-m", __name__, str(spec_file), str(out_file), str(jobs)],
                              env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"the compile process failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
        raw = json.loads(out_file.read_text())
    jobs_order = [(s, cc) for s in specs for cc in ccs]
    return [Result(s, cc, **r) for (s, cc), r in zip(jobs_order, raw)]


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1)
