"""The memory-traffic model of the Triton kernels: every launch's pointers are declared,
the grid covers the tensors it streams, and the model's totals against the ops' minimum."""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'whiteformer[triton]')")

from benchmarks.kernels.launches import OPS, op_calls, record_launches  # noqa: E402
from benchmarks.kernels.traffic import _spec, launch_bytes, op_traffic  # noqa: E402


@pytest.mark.parametrize("op", OPS)
def test_launches_are_declared_and_cover_their_tensors(op):
    """Per launch: every pointer argument has an access pattern; a "tile" argument (B, H, N, p) is
    covered exactly by the grid (chunks of the ragged last one included), times its passes."""
    forward, backward = op_calls(op, batch=2, heads=3, tokens=1000, head_dim=64, dtype=torch.bfloat16,
                                 masked=op != "causal_tssa_step", bias=op != "tssa")
    with record_launches() as launches:
        forward()
        backward()
    assert launches
    for launch in launches:
        got = launch_bytes(launch)
        for name, (mode, pattern, passes, flag) in _spec(launch).items():
            tensor = launch.args[name]
            if pattern == "tile":
                assert got[name] == tensor.numel() * tensor.element_size() * passes, (launch.kernel, name)
            if flag is not None and not {**launch.args, **launch.constexprs}[flag]:
                assert name not in got


@pytest.mark.parametrize("p", [64, 128])
@pytest.mark.parametrize("op", ["tssa", "causal_tssa"])
def test_model_against_the_minimum(op, p):
    """Backward <= 3x the minimum; forward: three reads of w and one write of out (2x) plus the
    statistics, below 2.2x (the floor of three dependent reductions over tokens: docs/benchmarks.md)."""
    fwd, bwd = op_traffic(op, batch=2, heads=8, tokens=4096, head_dim=p, dtype=torch.bfloat16)
    w_bytes = fwd.minimum // 2
    assert bwd.ratio <= 3.0, bwd
    assert 2.0 < fwd.ratio < 2.2, fwd
    assert [k for k, _ in fwd.launches] == ["chunk_energy", "_pi", "_out"]
    assert sum(b for _, b in fwd.launches) >= 4 * w_bytes
