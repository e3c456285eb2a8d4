"""Compile recorded kernel launches for NVIDIA GPUs without a GPU, and read their resources.

1. :func:`specialisations`: the distinct specialisations among recorded launches
   (:func:`.launches.record_launches`): kernel, Triton signature, constexpr values, the
   16-divisibility of pointers and integers (as Triton's launcher specialises them) and the launch
   options (``num_warps``, ``num_stages``, ``maxnreg``).
2. :func:`compile_specialisations`: compiles each for each compute capability with
   ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` in a child process where
   ``TRITON_INTERPRET`` is unset (the real ``JITFunction`` s), in parallel, and reads the cubin's
   ``cuobjdump -res-usage``: registers per thread (``REG``, 255 is the ceiling) and the spilled
   stack frame per thread (``STACK``, bytes). Triton's cache (``TRITON_CACHE_DIR``) serves repeated
   runs.

``python -m benchmarks.kernels.compile_check --child SPECS.json OUT.json JOBS`` is the child.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from whiteformer._checks import is_int

from .launches import OPS, Launch, op_calls, record_launches

__all__ = ["CCS", "MATRIX_WORKLOAD", "TEST_WORKLOAD", "Result", "Spec", "Workload", "compile_specialisations",
           "specialisations", "summary"]

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
    """Distinct specialisations (first-seen order) of the recorded launches. As Triton's launcher,
    an integer argument equal to 1 (one chunk, one head) is compiled as the constant 1."""
    seen: Dict[Spec, None] = {}
    for launch in launches:
        sig = launch.signature()
        ones = {k: 1 for k, v in launch.args.items() if is_int(v) and v == 1}
        sig.update({k: "constexpr" for k in ones})
        spec = Spec(
            launch.kernel,
            tuple(sig.items()),
            tuple((k, _constexpr_text(v)) for k, v in {**launch.constexprs, **ones}.items()),
            tuple(k for k, v in launch.args.items() if _divisible(k, v) and k not in ones),
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
    root = Path(__file__).resolve().parents[2]  # the repository: src/ and benchmarks/
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([env.get("PYTHONPATH", ""), str(root / "src"), str(root)])
    with tempfile.TemporaryDirectory() as tmp:
        spec_file, out_file = Path(tmp) / "specs.json", Path(tmp) / "out.json"
        spec_file.write_text(json.dumps({"specs": [asdict(s) for s in specs], "ccs": list(ccs)}))
        proc = subprocess.run([sys.executable, "-m", "benchmarks.kernels.compile_check", "--child", str(spec_file),
                               str(out_file), str(jobs)],
                              cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"the compile process failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
        raw = json.loads(out_file.read_text())
    jobs_order = [(s, cc) for s in specs for cc in ccs]
    return [Result(s, cc, **r) for (s, cc), r in zip(jobs_order, raw)]


# ------------------------------------------------------------------ the workloads


@dataclass(frozen=True)
class Workload:
    """What the compile check records: every op (forward and backward) at each (heads, head dim,
    dtype, tokens) of ``shapes``, with and without a keep-mask (tssa, causal_tssa) and the
    position bias (causal ops), on ``batch`` sequences. The flags are runtime arguments of the
    kernels: one specialisation serves every combination; the token count decides the chunks
    (one chunk is the constant 1 to Triton) and whether N is a multiple of 16."""

    shapes: Tuple[Tuple[int, int, torch.dtype, int], ...]
    batch: int = 2

    def cases(self) -> Iterator[Tuple[str, Callable, Callable]]:
        """(name, forward, backward) per case (:func:`.launches.op_calls`)."""
        for op, (h, p, dtype, n), masked, bias in itertools.product(OPS, self.shapes, (False, True), (False, True)):
            if (op == "tssa" and bias) or (op == "causal_tssa_step" and masked):
                continue  # tssa has no position bias; the step takes no mask
            name = f"{op} h={h} p={p} n={n} {str(dtype)[6:]}{' mask' if masked else ''}{' bias' if bias else ''}"
            yield name, *op_calls(op, batch=self.batch, heads=h, tokens=n, head_dim=p, dtype=dtype, masked=masked,
                                  bias=bias)

    def record(self) -> List[Tuple[str, Launch]]:
        """Every case's launches, not run: (case name, launch) pairs."""
        out = []
        for name, forward, backward in self.cases():
            with record_launches() as launches:
                forward()
                backward()
            out += [(name, launch) for launch in launches]
        return out


def shapes(heads_dims, dtypes, tokens=1024) -> Tuple[Tuple[int, int, torch.dtype, int], ...]:
    """Every (heads, head dim) of ``heads_dims`` with every dtype, at ``tokens`` tokens (1024:
    four chunks, sizes divisible by 16)."""
    return tuple((h, p, dtype, tokens) for (h, p), dtype in itertools.product(heads_dims, dtypes))


_F32, _BF16, _F16 = torch.float32, torch.bfloat16, torch.float16
# head dims 16 to 256 at 8 heads, and the head counts users pick at head dim 64 (small models 4:
# BLOCK_H 4, BLOCK_N 8; ViT-B and GPT-2 12: BLOCK_H 16), in float32 and bfloat16; float16 (the
# same tiles and loads as bfloat16, another conversion) at head dims 64 and 128; ViT-S and ViT-B
# at 197 tokens (one chunk, N odd)
TEST_WORKLOAD = Workload(
    shapes(((8, 16), (8, 32), (4, 64), (8, 64), (12, 64), (8, 128), (8, 256)), (_F32, _BF16))
    + shapes(((8, 64), (8, 128)), (_F16,)) + shapes(((6, 64), (12, 64)), (_BF16,), tokens=197))
# the version matrix, compiled by every Triton release (a few minutes each on two cores)
MATRIX_WORKLOAD = Workload(shapes(((4, 64), (8, 128)), (_F32, _BF16)) + shapes(((12, 64),), (_BF16,), tokens=197))


def summary(results: Sequence[Result]) -> dict:
    """Counts and extremes of compile results (JSON-able)."""
    ok = [r for r in results if not r.error]
    return {"compiles": len(results), "ok": len(ok), "failed": len(results) - len(ok),
            "spilled": sum(1 for r in ok if r.stack), "max_stack": max((r.stack for r in ok), default=None),
            "max_registers": max((r.reg for r in ok), default=None),
            "failures": [r.describe() for r in results if r.error or r.stack][:20]}


def _matrix(out: str, jobs: int) -> None:
    """Compile :data:`MATRIX_WORKLOAD` with the importable Triton; write :func:`summary` to ``out``."""
    import triton

    specs = specialisations(launch for _, launch in MATRIX_WORKLOAD.record())
    start = time.perf_counter()
    result = summary(compile_specialisations(specs, CCS, jobs=jobs))
    result.update(triton=triton.__version__, specialisations=len(specs), ccs=list(CCS),
                  seconds=round(time.perf_counter() - start, 1))
    Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif sys.argv[1:2] == ["--matrix"]:
        _matrix(sys.argv[2], int(sys.argv[4]) if sys.argv[3:4] == ["--jobs"] else 2)
    else:
        sys.exit("usage: python -m benchmarks.kernels.compile_check --matrix OUT.json [--jobs N]")
