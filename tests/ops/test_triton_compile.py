"""The Triton kernels compile for real GPUs (sm_80 A100, sm_90 H100) without register spills,
checked on this CPU-only machine with the installed Triton (every release from 3.3 to 3.9:
``make triton-matrix``).

The launches are recorded without running (the ops' launchers and host code run;
:mod:`benchmarks.kernels.launches`) over the configurations users hit
(:data:`benchmarks.kernels.compile_check.TEST_WORKLOAD`, a representative subset of the version
matrix's launch list: each BLOCK_P with exact and padded head dims, every branch of the tile rule,
float32/bfloat16/float16, one-chunk odd lengths and multi-chunk ones, with and without a keep-mask
and the position bias, packed rows (``cu_seqlens``), forward and backward of tssa, causal_tssa and
the causal step);
each distinct specialisation is compiled with ``triton.compile`` for both targets in a child process without
``TRITON_INTERPRET`` and its cubin read with ``cuobjdump -res-usage``
(:mod:`benchmarks.kernels.compile_check`). The test is driven by the recorded launches only: a new
kernel or launch (another op argument) is covered once the workload makes it. Triton's cache
(``TRITON_CACHE_DIR``) serves repeated runs.
"""
import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install 'whiteformer[triton]')")

from benchmarks.kernels.compile_check import CCS, TEST_WORKLOAD, compile_specialisations, specialisations  # noqa: E402

from whiteformer.ops._kernels.triton import _tiles  # noqa: E402


@pytest.fixture(scope="module")
def recorded():
    """(case, launch) pairs of every case of the workload."""
    return TEST_WORKLOAD.record()


@pytest.fixture(scope="module")
def compiled(recorded):
    specs = specialisations(launch for _, launch in recorded)
    return specs, compile_specialisations(specs, CCS, jobs=2)


def test_launches_follow_the_tile_rule(recorded):
    """Every sequence kernel runs the grid (sequences, chunks) with the tiles of _tiles.tiles;
    every kernel of the three modules is launched by the workload, the configuration of small
    models (4 heads of 64: BLOCK_H 4, BLOCK_N 8, CHUNK 256) with a mask included, and the tile
    rule's branches (BLOCK_N at its cap, one token per sub-block, one head at a full tile; 2 and 8
    warps) are reached."""
    kernels = {launch.name for _, launch in recorded}
    assert {"chunk_energy", "_pi", "_out", "_bwd_q", "_bwd_lambda", "_bwd_dw", "_bwd_chunk", "_step_fwd",
            "_step_bwd"} <= kernels
    for case, launch in recorded:
        if "BLOCK_N" not in launch.constexprs:
            continue
        t = _tiles.tiles(case.heads, case.head_dim, case.dtype)
        seqs, tokens = (len(case.packed), max(case.packed)) if case.packed else (TEST_WORKLOAD.batch, case.tokens)
        groups, meta = t.group_meta(case.heads) if len(launch.grid) == 3 else (None, t.meta())  # head groups
        assert launch.grid == (seqs, -(-tokens // t.chunk)) + ((groups,) if groups else ()), (case.name, launch.kernel)
        assert (launch.constexprs["BLOCK_H"], launch.constexprs["BLOCK_N"], launch.constexprs["BLOCK_P"],
                launch.options["num_warps"]) == (meta["BLOCK_H"], meta["BLOCK_N"], t.block_p, meta["num_warps"]), \
            (case.name, launch.kernel)
    small = {(la.kernel.rsplit(".", 2)[-2], la.name) for _, la in recorded if la.args.get("has_mask")
             and (la.constexprs.get("BLOCK_H"), la.constexprs.get("BLOCK_P"), la.constexprs.get("BLOCK_N"),
                  la.constexprs.get("CHUNK")) == (4, 64, 8, 256)}
    assert {("tssa", "_pi"), ("tssa", "_bwd_lambda"), ("causal_tssa", "_pi"), ("causal_tssa", "_bwd_lambda")} <= small
    assert any(case.packed and la.args.get("has_mask") for case, la in recorded)  # packed rows: the padded layout
    blocks = {la.constexprs["BLOCK_N"] for _, la in recorded if "BLOCK_N" in la.constexprs}
    warps = {la.options["num_warps"] for _, la in recorded if "BLOCK_N" in la.constexprs}
    assert {1, _tiles.BLOCK_N_MAX} <= blocks and {_tiles.MIN_WARPS, _tiles.MAX_WARPS} <= warps
    split = [(case, la) for case, la in recorded if len(la.grid) == 3 and la.grid[2] > 1]
    assert split and all(la.constexprs["BLOCK_H"] * la.constexprs["BLOCK_N"] * la.constexprs["BLOCK_P"]
                         <= _tiles.TILE_ELEMS // 2 for _, la in split)  # the dw kernel in head groups
    one_head = [la for case, la in recorded if la.kernel.endswith("causal_tssa._bwd_dw") and case.heads == 1
                and _tiles.tiles(1, case.head_dim, case.dtype).block_n * case.head_dim >= _tiles.TILE_ELEMS]
    assert one_head and all(la.constexprs["BLOCK_N"] * la.constexprs["BLOCK_P"] <= _tiles.TILE_ELEMS // 2
                            for la in one_head)  # one head at a full tile: the dw kernel on half sub-blocks


def test_every_specialisation_compiles_for_sm80_and_sm90_without_spills(compiled):
    """No kernel fails to compile and none has a spilled stack frame (STACK > 0), on either
    target; the failure message names the kernel, its specialisation and resources."""
    specs, results = compiled
    assert len(results) == len(specs) * len(CCS) and len(specs) > 0
    bad = [r for r in results if r.error or r.stack]
    assert not bad, f"{len(bad)} of {len(results)} compiles fail or spill:\n" + "\n".join(r.describe() for r in bad)
    assert all(0 < r.reg <= 255 for r in results)
