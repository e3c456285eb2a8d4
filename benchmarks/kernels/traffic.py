"""Memory-traffic model of the Triton kernels: bytes each launch reads and writes, per op call,
against the op's minimum.

A launch's bytes come from its recorded grid, tile constexprs and arguments
(:mod:`.launches`), per pointer argument, by the access pattern declared for each kernel in
:data:`.access_patterns.PATTERNS` ``[module][kernel][argument] = (mode, pattern, passes, flag)``
(mode ``"r"`` or ``"w"``):

- ``"tile"``: a (B, H, N, p) tensor; a program of the grid (B, chunks) touches its chunk of
  ``min(CHUNK, N - c * CHUNK)`` tokens of every head: the sum over the grid;
- ``"token"``: a (B, H, N) tensor, likewise without p; ``"mask"``: the (B, N) uint8 keep-mask;
- ``"all"``: every element once (per-chunk statistics, per-sequence statistics, the step's
  tensors). Per-sequence rows read by all programs of a sequence count once: after the first
  program they are served by the L2 cache (50 MB on an H100), not by DRAM.

``passes`` is how many times the kernel streams it, ``flag`` the launch argument that must be true
for the access to happen (``has_mask``: the mask pointer is a dummy otherwise). Host-side ``torch``
operations between launches (sums over chunks, prefix sums, dtype conversions) count their tensor inputs and outputs,
seen through a ``TorchDispatchMode`` (views and allocations are free).

Minimum per op: forward reads ``w`` once and writes ``out`` once; backward
reads ``w``, ``dL/dout`` and the statistics saved by the forward once and writes ``dL/dw`` once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .access_patterns import PATTERNS
from .launches import Launch, op_calls, record_launches

__all__ = ["H100_BYTES_PER_S", "OpTraffic", "launch_bytes", "op_traffic"]

H100_BYTES_PER_S = 3.35e12  # H100 SXM HBM3
_FREE = {"view", "_unsafe_view", "slice", "select", "expand", "t", "transpose", "permute", "as_strided", "detach",
         "alias", "unsqueeze", "squeeze", "reshape", "empty", "empty_like", "new_empty", "empty_strided",
         "new_empty_strided", "lift_fresh", "_to_copy_meta", "unbind", "split", "view_as", "flip_meta"}


def _spec(launch: Launch) -> Dict[str, Tuple[str, str, int, Optional[str]]]:
    table = PATTERNS.get(launch.module.rsplit(".", 1)[-1], {})
    if launch.name not in table:
        raise KeyError(f"{launch.kernel} has no entry in benchmarks.kernels.access_patterns")
    return table[launch.name]


def launch_bytes(launch: Launch) -> Dict[str, int]:
    """{argument: bytes} read or written by one launch."""
    spec = _spec(launch)
    pointers = {k for k, v in launch.args.items() if isinstance(v, torch.Tensor)}
    missing = pointers - set(spec)
    if missing:
        raise KeyError(f"{launch.kernel}: access_patterns declares no access for {sorted(missing)}")
    args, const = launch.args, launch.constexprs
    flags = {**args, **const}
    chunk = const.get("CHUNK")
    tokens = 0
    if chunk is not None:  # grid (B, chunks): tokens covered by the grid, per sequence
        n = args["N"]
        tokens = launch.grid[0] * sum(min(chunk, n - c * chunk) for c in range(launch.grid[1]))
    out = {}
    for key, (_, pattern, passes, flag) in spec.items():
        tensor = args[key]
        if flag is not None and not flags[flag]:
            continue
        size = tensor.element_size()
        if pattern == "tile":
            elems = tokens * args["H"] * args["P"]
        elif pattern == "token":
            elems = tokens * args["H"]
        elif pattern == "mask":
            elems = tokens
        elif pattern == "all":
            elems = tensor.numel()
        else:
            raise ValueError(f"{launch.kernel}: unknown access pattern {pattern!r}")
        out[key] = elems * size * passes
    return out


class _HostBytes(TorchDispatchMode):
    """Bytes of the tensor inputs and outputs of each ``torch`` operation (the custom ops'
    own implementations are entered, their boundary is not counted)."""

    def __init__(self):
        super().__init__()
        self.ops: List[Tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "whiteformer":  # a custom op: count what runs inside its implementation
            from torch._library.custom_ops import _maybe_get_opdef

            with self:
                return _maybe_get_opdef(func._schema.name)._init_fn(*args, **kwargs)
        result = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in _FREE or name.endswith("_meta"):
            return result
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outs = [r for r in torch.utils._pytree.tree_leaves(result) if isinstance(r, torch.Tensor)]
        if name in ("zeros_like", "zeros", "new_zeros", "fill", "zero"):
            tensors = []  # writes only
        self.ops.append((name, sum(t.numel() * t.element_size() for t in tensors + outs)))
        return result


@dataclass
class OpTraffic:
    """One op call (``fwd`` or ``bwd``): per-launch bytes, host bytes, total and minimum."""

    op: str
    direction: str
    launches: List[Tuple[str, int]] = field(default_factory=list)
    host: List[Tuple[str, int]] = field(default_factory=list)
    minimum: int = 0

    @property
    def total(self) -> int:
        return sum(b for _, b in self.launches) + sum(b for _, b in self.host)

    @property
    def ratio(self) -> float:
        return self.total / self.minimum

    def seconds(self, bytes_per_s: float = H100_BYTES_PER_S) -> float:
        return self.total / bytes_per_s


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def op_traffic(op: str, *, batch: int, heads: int, tokens: int, head_dim: int, dtype: torch.dtype,
               masked: bool = False, bias: bool = False) -> Tuple[OpTraffic, OpTraffic]:
    """The model of one forward and one backward call of ``op`` at this shape (CPU tensors;
    nothing runs: launches are recorded, host operations are counted)."""
    forward, backward = op_calls(op, batch=batch, heads=heads, tokens=tokens, head_dim=head_dim, dtype=dtype,
                                 masked=masked, bias=bias)
    saved: List[torch.Tensor] = []
    results = []
    for direction, call in (("fwd", forward), ("bwd", backward)):
        mode = _HostBytes()
        with record_launches() as launches, mode:
            if direction == "fwd":
                with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                    outs = call()
            else:
                call()
        traffic = OpTraffic(op, direction, [(f"{la.name}", sum(launch_bytes(la).values())) for la in launches],
                            mode.ops)
        results.append(traffic)
    saved = _distinct(saved)
    if op == "causal_tssa_step":  # one token: read the inputs (all saved) and write the outputs once
        results[0].minimum = _nbytes(saved) + _nbytes(outs)
        results[1].minimum = 2 * _nbytes(saved) + _nbytes(outs)  # + their gradients
    else:
        w_bytes = _nbytes(outs[:1])  # out has w's shape and dtype
        stats = [t for t in saved if t.numel() * t.element_size() < w_bytes]  # all but w
        results[0].minimum = 2 * w_bytes
        results[1].minimum = 3 * w_bytes + _nbytes(stats)
    return results[0], results[1]


def _distinct(tensors):
    seen, out = set(), []
    for t in tensors:
        key = (t.data_ptr(), t.shape)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out
