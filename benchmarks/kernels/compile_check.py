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

import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple
from unittest import mock

import torch

from whiteformer._checks import is_int

from .launches import Launch, op_calls, record_launches

__all__ = ["CCS", "MATRIX_WORKLOAD", "TEST_WORKLOAD", "Case", "Result", "Spec", "Workload", "cases", "compile_specialisations",
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
    """Compile every (spec, cc) in worker processes. A compile that kills its worker (Triton's
    compiler aborting the process) breaks the pool: the unfinished jobs are run again one at a
    time, and the first that breaks that pool is reported as a compiler crash."""
    specs = json.loads(Path(specs_path).read_text())
    work = [(s, cc) for s in specs["specs"] for cc in specs["ccs"]]
    results: List[Optional[dict]] = [None] * len(work)
    workers = max(1, jobs)
    while True:
        pending = [i for i, r in enumerate(results) if r is None]
        if not pending:
            break
        with ProcessPoolExecutor(workers) as pool:
            futures = [(i, pool.submit(_compile_one, work[i])) for i in pending]
            broken = None
            for i, future in futures:
                try:
                    results[i] = future.result()
                except BrokenProcessPool:
                    broken = i if broken is None else broken
        if broken is not None and workers == 1:  # run in order: the first unfinished one crashed
            results[broken] = {"error": "the compiler crashed (its process died)"}
        workers = 1 if broken is not None else workers
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
class Case:
    """One recorded call: ``op`` (:data:`.launches.OPS`) at (heads, head_dim, tokens, dtype), with
    a keep-mask (tssa, causal_tssa), the position bias (causal ops), or ``packed``: the lengths of
    documents packed in one row and given to the public op with ``cu_seqlens`` (on the padded
    layout of :mod:`whiteformer.ops.packing`, one sequence per document; ``tokens`` ignored)."""

    op: str
    heads: int
    head_dim: int
    tokens: int
    dtype: torch.dtype
    masked: bool = False
    bias: bool = False
    packed: Tuple[int, ...] = ()

    @property
    def name(self) -> str:
        flags = " mask" * self.masked + " bias" * self.bias + (f" packed={list(self.packed)}" if self.packed else "")
        return f"{self.op} h={self.heads} p={self.head_dim} n={self.tokens} {str(self.dtype)[6:]}{flags}"

    def calls(self, batch: int) -> Tuple[Callable, Callable]:
        """(forward, backward) closures (:func:`.launches.op_calls`, or the public op for ``packed``)."""
        if self.packed:
            return _packed_calls(self)
        return op_calls(self.op, batch=batch, heads=self.heads, tokens=self.tokens, head_dim=self.head_dim,
                        dtype=self.dtype, masked=self.masked, bias=self.bias)


def _packed_calls(case: Case) -> Tuple[Callable, Callable]:
    """The public ``tssa`` / ``causal_tssa`` on a packed row (``cu_seqlens``) forced onto the
    Triton kernels (``WHITEFORMER_BACKEND=triton`` during the calls; for recording only)."""
    from whiteformer import ops
    from whiteformer.ops._kernels import ENV_BACKEND

    total, h = sum(case.packed), case.heads
    w = torch.zeros(1, h, total, case.head_dim, dtype=case.dtype, requires_grad=True)
    temp = torch.ones(h, 1, requires_grad=True)
    cu = torch.tensor([0, *itertools.accumulate(case.packed)], dtype=torch.int32)
    fn = {"tssa": ops.tssa, "causal_tssa": ops.causal_tssa}[case.op]
    state = {}

    @contextlib.contextmanager
    def forced():  # the launches are recorded, not run: on CPU tensors without the interpreter too
        saved = os.environ.get(ENV_BACKEND)
        os.environ[ENV_BACKEND] = "triton"
        try:
            with mock.patch("whiteformer.ops._kernels.triton.check_runnable", lambda device: None):
                yield
        finally:
            if saved is None:
                os.environ.pop(ENV_BACKEND)
            else:
                os.environ[ENV_BACKEND] = saved

    def forward():
        with forced():
            state["out"] = fn(w, temp, cu_seqlens=cu)
        return state["out"]

    def backward():
        with forced():
            out = state["out"]
            return torch.autograd.grad(out, (w, temp), torch.empty_like(out))

    return forward, backward


@dataclass(frozen=True)
class Workload:
    """What the compile check records: each :class:`Case`, forward and backward, on ``batch``
    sequences. Mask and bias flags are runtime arguments of the kernels (one specialisation serves
    both), but they are recorded to check that; the tiles come from (heads, head dim, dtype)
    (:func:`whiteformer.ops._kernels.triton._tiles.tiles`); the token count decides the chunks
    (one chunk is the constant 1 to Triton) and whether N is a multiple of 16."""

    cases: Tuple[Case, ...]
    batch: int = 2

    def record(self) -> List[Tuple[Case, Launch]]:
        """Every case's launches, not run: (case, launch) pairs."""
        out = []
        for case in self.cases:
            forward, backward = case.calls(self.batch)
            with record_launches() as launches:
                forward()
                backward()
            out += [(case, launch) for launch in launches]
        return out


def cases(heads_dims, dtypes, tokens=(1024,), packed=()) -> Tuple[Case, ...]:
    """Every op at every (heads, head dim) of ``heads_dims``, dtype and token count: tssa plain and
    masked, causal_tssa plain, masked and with the bias, the step plain and with the bias; with
    ``packed`` (document lengths), tssa and causal_tssa on that packed row too."""
    out = []
    for (h, p), dtype in itertools.product(heads_dims, dtypes):
        for n in tokens:
            out += [Case("tssa", h, p, n, dtype), Case("tssa", h, p, n, dtype, masked=True),
                    Case("causal_tssa", h, p, n, dtype), Case("causal_tssa", h, p, n, dtype, masked=True),
                    Case("causal_tssa", h, p, n, dtype, bias=True)]
        out += [Case("causal_tssa_step", h, p, 1, dtype), Case("causal_tssa_step", h, p, 1, dtype, bias=True)]
        if packed:
            out += [Case(op, h, p, sum(packed), dtype, packed=tuple(packed)) for op in ("tssa", "causal_tssa")]
    return tuple(out)


_F32, _BF16, _F16, _F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
HEAD_DIMS = (16, 24, 32, 48, 64, 96, 128)  # the head dims users pick (24, 48, 96: a padded BLOCK_P)
# every branch of the tile rule: BLOCK_N at its cap (1 head of 16: BLOCK_N 64, 4 warps; 1 head of
# 8: 2 warps; 2 heads of 16: 8 warps, the dw kernel in groups of one head), one head at a full
# tile (1 head of 128: BLOCK_N 16, the dw kernel on sub-blocks of 8 tokens), BLOCK_N 8 (4 heads
# of 64: small models), one token per sub-block (32 heads of 128: a tile of twice the budget at
# 8 warps, the dw kernel in groups of 8 heads)
EXTREMES = ((1, 8), (1, 16), (2, 16), (1, 128), (32, 128))
# token counts: 70 (one chunk, N not a multiple of 16: Triton specialises only on == 1 and on
# divisibility by 16, so 197 and every other short odd length compile the same), 1024 (four chunks,
# N a multiple of 16), 600 (three chunks, the last partial)
PACKED = (70, 64, 33)  # documents of one packed row (little padding: the padded kernel layout)
# the whole launch list (``make triton-matrix``, every Triton release; a few hundred compiles each):
# every head dim at 4 heads with a 70-token sequence (197 tokens compiles the same), masked or not,
# float32, bfloat16 and float16 spread over the head dims (float32 and bfloat16 both at 64 and 128,
# where the kernels hold the most registers), a packed row, 12 heads (BLOCK_H 16) at 1024 tokens
# (four chunks), the tile rule's extremes and float64 (two words a value: 4 heads of 64)
MATRIX_WORKLOAD = Workload(
    cases(((4, 64), (4, 128)), (_F32, _BF16), (70, 197), PACKED)
    + cases(((4, 16), (4, 48)), (_F32,), (70,)) + cases(((4, 24), (4, 96)), (_BF16,), (70,))
    + cases(((4, 32),), (_F16,), (70,)) + cases(((12, 64),), (_BF16,), (1024,))
    + cases(EXTREMES, (_F32,), (70,)) + cases(((4, 64),), (_F64,), (70,)))
# the representative subset of ``make test``: the small models' masked configuration (4 heads of
# 64, both dtypes, and on a packed row), a padded head dim, float16, 12 heads at 1024 tokens and the
# tile rule's extremes (2 warps, one head at a full tile, one token per sub-block)
TEST_WORKLOAD = Workload(
    cases(((4, 64),), (_F32, _BF16), (70,), PACKED) + cases(((4, 24),), (_BF16,), (70,))
    + cases(((4, 32),), (_F16,), (70,)) + cases(((12, 64),), (_BF16,), (1024,))
    + cases(((1, 8), (1, 128), (32, 128)), (_F32,), (70,)))


def summary(results: Sequence[Result]) -> dict:
    """Counts and extremes of compile results (JSON-able), overall and per kernel (module.name:
    compiles, failed, spilled, max stack, max registers)."""
    def counts(rs) -> dict:
        ok = [r for r in rs if not r.error]
        return {"compiles": len(rs), "ok": len(ok), "failed": len(rs) - len(ok),
                "spilled": sum(1 for r in ok if r.stack), "max_stack": max((r.stack for r in ok), default=None),
                "max_registers": max((r.reg for r in ok), default=None)}

    kernels: Dict[str, List[Result]] = {}
    for r in results:
        kernels.setdefault(".".join(r.spec.kernel.rsplit(".", 2)[-2:]), []).append(r)
    return {**counts(results), "failures": [r.describe() for r in results if r.error or r.stack][:20],
            "kernels": {k: counts(rs) for k, rs in kernels.items()}}


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
