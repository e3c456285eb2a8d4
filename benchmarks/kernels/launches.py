"""Record the Triton kernel launches an op makes, without running them.

:func:`record_launches` patches the launch entry of Triton's kernels (``JITFunction.run`` for
compiled kernels, ``InterpretedFunction.run`` under ``TRITON_INTERPRET=1``): inside the block a
launch ``kernel[grid](*args, **kwargs)`` appends a :class:`Launch` and returns without running, so
an op called on any device (CPU tensors included, any size) goes through its launchers and host
code at no kernel cost; its outputs are then uninitialised memory. The records serve the compile
check (:mod:`.compile_check`: each distinct specialisation compiled for sm_80/sm_90) and the
traffic model (:mod:`.traffic`: bytes per launch from the grid and the tensors' sizes).
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Tuple

import torch

__all__ = ["Launch", "record_launches"]

# torch dtype -> Triton pointer element type
_POINTER = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
            torch.uint8: "u8", torch.int8: "i8", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
OPTIONS = ("num_warps", "num_stages", "maxnreg")


@dataclass
class Launch:
    """One kernel launch: the kernel's module and name, the grid, each argument by parameter
    name (tensors as themselves), the constexpr values and the launch options."""

    module: str
    name: str
    grid: Tuple[int, ...]
    args: Dict[str, Any]
    constexprs: Dict[str, Any]
    options: Dict[str, int] = field(default_factory=dict)

    @property
    def kernel(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def programs(self) -> int:
        n = 1
        for g in self.grid:
            n *= g
        return n

    def signature(self) -> Dict[str, str]:
        """Triton's signature: parameter name -> ``*fp32`` / ``i32`` / ``fp32`` / ``constexpr``."""
        sig = {}
        for name, value in self.args.items():
            sig[name] = _type_of(name, value)
        for name in self.constexprs:
            sig[name] = "constexpr"
        return sig


def _type_of(name: str, value: Any) -> str:
    if isinstance(value, torch.Tensor):
        if value.dtype not in _POINTER:
            raise TypeError(f"argument {name}: no Triton pointer type for {value.dtype}")
        return "*" + _POINTER[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"argument {name}: cannot type {type(value).__name__} for a Triton signature")


def _constexpr_names(fn) -> List[str]:
    import triton.language as tl

    def is_constexpr(annotation) -> bool:  # a string under ``from __future__ import annotations``
        return annotation is tl.constexpr or (isinstance(annotation, str) and annotation.split(".")[-1] == "constexpr")

    return [p.name for p in inspect.signature(fn).parameters.values() if is_constexpr(p.annotation)]


def _record(into: List[Launch], kernel, args, grid, kwargs) -> None:
    fn = kernel.fn
    names = list(inspect.signature(fn).parameters)
    bound = dict(zip(names, args))
    options = {k: kwargs.pop(k) for k in OPTIONS if k in kwargs}
    bound.update(kwargs)
    missing = [n for n in names if n not in bound]
    if missing:
        raise TypeError(f"launch of {fn.__name__} misses arguments {missing}")
    if callable(grid):
        grid = grid(bound)
    const = set(_constexpr_names(fn))
    into.append(Launch(fn.__module__, fn.__name__, tuple(int(g) for g in grid),
                       {n: v for n, v in bound.items() if n not in const},
                       {n: v for n, v in bound.items() if n in const}, options))


@contextlib.contextmanager
def record_launches() -> Iterator[List[Launch]]:
    """Within the block, Triton kernel launches are recorded (in order) into the yielded list
    instead of running."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches: List[Launch] = []
    # before Triton 3.6 interpreted kernels launch through another entry: only compiled ones are seen there
    saved = {cls: cls.run for cls in (JITFunction, InterpretedFunction) if hasattr(cls, "run")}

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            _record(launches, self, args, grid, dict(kwargs))

    try:
        for cls in saved:
            cls.run = run
        yield launches
    finally:
        for cls, original in saved.items():
            cls.run = original


OPS = ("tssa", "causal_tssa", "causal_tssa_step")


def op_calls(op: str, *, batch: int, heads: int, tokens: int, head_dim: int, dtype: torch.dtype,
             masked: bool = False, bias: bool = False, device: str = "cpu"):
    """``(forward, backward)`` closures calling one op's Triton path on fresh inputs: ``forward()``
    runs the op (differentiably), ``backward()`` its backward (after ``forward()``, an
    uninitialised gradient on every output; the inputs' gradients are returned). ``tokens`` is
    ignored by the step (one token); ``masked``: a (B, N) keep-mask (tssa, causal_tssa); ``bias``:
    the position logit bias (causal ops)."""
    from whiteformer.ops._kernels.triton.causal_tssa import causal_tssa_triton
    from whiteformer.ops._kernels.triton.causal_tssa_step import causal_tssa_step_triton
    from whiteformer.ops._kernels.triton.tssa import tssa_triton

    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    b, h, n, p = batch, heads, tokens, head_dim
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    temp = torch.ones(h, 1, device=device, requires_grad=True)
    mask = torch.ones(b, n, dtype=torch.bool, device=device) if masked else None
    state: Dict[str, Any] = {}
    if op == "causal_tssa_step":
        w = torch.zeros(b, h, p, device=device, dtype=dtype, requires_grad=True)
        sums = [torch.zeros(b, h, p, device=device, dtype=acc), torch.zeros(b, h, device=device, dtype=acc),
                torch.zeros(b, h, p, device=device, dtype=acc)]
        lb = torch.zeros(b, h, 1, device=device, dtype=acc, requires_grad=True) if bias else None
        call = lambda: causal_tssa_step_triton(w, *sums, temp, lb)  # noqa: E731
        params = [w, temp] + ([lb] if bias else [])
    else:
        w = torch.zeros(b, h, n, p, device=device, dtype=dtype, requires_grad=True)
        params = [w, temp]
        if op == "tssa":
            call = lambda: tssa_triton(w, temp, mask)  # noqa: E731
        else:
            lb = torch.zeros(1, h, n, device=device, dtype=acc, requires_grad=True) if bias else None
            params += [lb] if bias else []
            call = lambda: causal_tssa_triton(w, temp, lb, mask)  # noqa: E731

    def forward():
        state["outs"] = [o for o in call() if o.requires_grad]
        return state["outs"]

    def backward():
        outs = state["outs"]  # gradients of the inputs, returned (not accumulated into .grad)
        return torch.autograd.grad(outs, params, [torch.empty_like(o) for o in outs])  # values unused

    return forward, backward
