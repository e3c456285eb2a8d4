"""Smoke tests of the compression benchmarks: the interleaved latency of compressed models and the
IrrAtt decomposition (fast path against the reference) run in tiny configurations, write their
files, and their docs sections render what they measured. No timing assertions."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import compressed_latency, irratt_decomposition, report  # noqa: E402


def test_compressed_latency_quick(tmp_path):
    res = compressed_latency.run(quick=True, out_dir=tmp_path, command="pytest")
    rows = res["rows"]
    assert {r["method"] for r in rows} == {"truncatt", "cp", "irratt"}
    for r in rows:
        assert (r["speedup"] is None) == r["overlap"]
        assert len(r["samples_ms"]["original"]) == len(r["samples_ms"]["compressed"]) == res["runs"]
        assert 0 < r["flops_ratio"] < 1 and r["time_ratio_iqr"][0] <= r["time_ratio"] <= r["time_ratio_iqr"][1]
    saved = json.loads((tmp_path / "compressed_latency_quick.json").read_text())
    assert len(saved["rows"]) == len(rows)
    text = "\n".join(compressed_latency.section(saved))
    assert text.count("| deit_t_p16 |") == len(rows) and "interleaved" in text


def test_compressed_latency_rounds_per_batch_in_the_docs():
    rows = [dict(batch=1, runs=7), dict(batch=32, runs=3), dict(batch=1, runs=7)]
    assert compressed_latency._rounds(dict(rows=rows)) == "7 rounds at batch 1, 3 at batch 32"
    assert compressed_latency._rounds(dict(rows=rows[:1])) == "7 rounds"
    a = compressed_latency.build_parser().parse_args(["--runs-large", "2"])
    assert (a.runs, a.runs_large) == (7, 2)


def test_irratt_decomposition_quick(tmp_path):
    res = irratt_decomposition.run(quick=True, out_dir=tmp_path, command="pytest")
    (row,) = res["rows"]
    assert row["reference_cp_iterations"] == 100 and row["fast_cp_iterations"] < 100
    assert row["speedup"] == row["reference_s"] / row["fast_s"]
    assert sum(row["fast_ranks"]) == sum(row["reference_ranks"]) == row["rank"]
    assert (tmp_path / "irratt_decomposition_quick.md").read_text() == irratt_decomposition.tables(res)
    lines = report.irratt_decomposition_section(res)
    assert any(f"{row['fast_rel_error']:.6f}" in ln for ln in lines)
