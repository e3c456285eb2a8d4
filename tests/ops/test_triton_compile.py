"""The Triton kernels compile for real GPUs (sm_80 A100, sm_90 H100) without register spills
, checked on this CPU-only machine.

The launches are recorded through Triton's interpreter hook without running (the ops' launchers
and host code run; :mod:`whiteformer.ops._kernels.triton._launches`) over head dims 16-256,
float32/bfloat16/float16, with and without a keep-mask and the position bias, forward and
backward of tssa, causal_tssa and the causal step; each distinct specialisation is compiled with
``triton.compile`` for both targets in a child process without ``TRITON_INTERPRET`` and its cubin
read with ``cuobjdump -res-usage`` (:mod:`whiteformer.ops._kernels.triton._compile_check`). The
test is driven by the recorded launches only: a new kernel or launch (another op argument) is
covered once the workload below makes it. Triton's cache (``TRITON_CACHE_DIR``) serves repeated
runs.
"""
import itertools

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'whiteformer[triton]')")

from whiteformer.ops._kernels.triton import _tiles  # noqa: E402
from whiteformer.ops._kernels.triton._compile_check import CCS, compile_specialisations, specialisations  # noqa: E402
from whiteformer.ops._kernels.triton._launches import OPS, op_calls, record_launches  # noqa: E402

HEAD_DIMS = (16, 32, 64, 128, 256)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEADS, BATCH, TOKENS = 8, 2, 4096  # 4096 tokens: several chunks, sizes divisible by 16 as on a GPU


def workload():
    """Every (op, head dim, dtype, mask, bias) the suite compiles: (name, forward, backward)."""
    for op, p, dtype, masked, bias in itertools.product(OPS, HEAD_DIMS, DTYPES, (False, True), (False, True)):
        if (op == "tssa" and bias) or (op == "causal_tssa_step" and masked):
            continue  # tssa has no position bias; the step takes no mask
        name = f"{op} p={p} {str(dtype)[6:]}{' mask' if masked else ''}{' bias' if bias else ''}"
        yield name, *op_calls(op, batch=BATCH, heads=HEADS, tokens=TOKENS, head_dim=p, dtype=dtype, masked=masked,
                              bias=bias)


@pytest.fixture(scope="module")
def recorded():
    """{kernel launches recorded}: (case name, launch) pairs."""
    out = []
    for name, forward, backward in workload():
        with record_launches() as launches:
            forward()
            backward()
        out += [(name, launch) for launch in launches]
    return out


@pytest.fixture(scope="module")
def compiled(recorded):
    specs = specialisations(launch for _, launch in recorded)
    return specs, compile_specialisations(specs, CCS, jobs=2)


def test_launches_follow_the_tile_rule(recorded):
    """Every sequence kernel runs the grid (B, chunks) with the tiles of _tiles.tiles; every
    kernel of the three modules is launched by the workload."""
    kernels = {launch.name for _, launch in recorded}
    assert {"chunk_energy", "_pi", "_out", "_bwd_q", "_bwd_lambda", "_bwd_dw", "_bwd_chunk", "_step_fwd",
            "_step_bwd"} <= kernels
    for name, launch in recorded:
        if "BLOCK_N" not in launch.constexprs:
            continue
        p = int(name.split("p=")[1].split()[0])
        dtype = getattr(torch, name.split()[2])
        t = _tiles.tiles(HEADS, p, dtype)
        assert launch.grid == (BATCH, -(-TOKENS // t.chunk)), (name, launch.kernel)
        assert (launch.constexprs["BLOCK_N"], launch.constexprs["BLOCK_P"], launch.options["num_warps"]) == \
            (t.block_n, t.block_p, t.num_warps), (name, launch.kernel)


def test_every_specialisation_compiles_for_sm80_and_sm90_without_spills(compiled):
    """No kernel fails to compile and none has a spilled stack frame (STACK > 0), head dims 16 to
    256, on either target; the failure message names the kernel, its specialisation and resources."""
    specs, results = compiled
    assert len(results) == len(specs) * len(CCS) and len(specs) > 0
    bad = [r for r in results if r.error or r.stack]
    assert not bad, f"{len(bad)} of {len(results)} compiles fail or spill:\n" + "\n".join(r.describe() for r in bad)
    assert all(0 < r.reg <= 255 for r in results)
