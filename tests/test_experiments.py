"""Smoke tests of the reproduction experiments (experiments/*.py --smoke): each script runs on a tiny
budget with built-in data and writes its result files; a second run is skipped (resumable)."""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))

pytest.importorskip("yaml")
pytest.importorskip("sklearn")  # the smoke runs use scikit-learn's bundled digits


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("experiments")
    return base


def _run(mod_name: str, roots: Path, extra=()):
    import importlib

    mod = importlib.import_module(mod_name)
    out, runs = roots / "results" / mod_name, roots / "runs" / mod_name
    assert mod.main(["--smoke", "--out", str(out), "--runs", str(runs), *extra]) == 0
    return out, runs


def _csv(path: Path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_exp1_vision_then_whitebox_and_ablations(roots):
    out, runs = _run("exp1_vision", roots)
    summary = json.loads((out / "summary.json").read_text())
    names = [s["name"] for s in summary["summary"]]
    assert names == ["tost", "vit_cab", "xcit", "dmst", "eca", "crate"]
    for s in summary["summary"]:
        assert s["n_seeds"] == 1 and 0.0 <= s["acc_mean"] <= 1.0 and s["params"] > 0
    assert len(_csv(out / "runs.csv")) == 6
    # resumable: a second invocation trains nothing (result.json of every run is reused)
    mtimes = {p: p.stat().st_mtime for p in runs.glob("*/result.json")}
    assert len(mtimes) == 6
    _run("exp1_vision", roots)
    assert {p: p.stat().st_mtime for p in runs.glob("*/result.json")} == mtimes

    out3, _ = _run("exp3_whitebox", roots)
    s3 = json.loads((out3 / "summary.json").read_text())
    assert set(s3["models"]) == {"tost", "crate", "tost_init"} and not s3["missing"]
    assert len(s3["models"]["tost"]["R_c_var"]) == 1
    assert (out3 / "tost" / "memberships_last.png").stat().st_size > 0

    out2, _ = _run("exp2_ablations", roots)
    rows = {r["name"]: r for r in _csv(out2 / "ablations.csv")}
    assert rows["tost_no_l2norm"]["status"] == "done"
    assert rows["tost_mlp"]["status"] == "done" and rows["tost_ista"]["status"] == "done"
    assert int(rows["tost_ista"]["params"]) < int(rows["tost_mlp"]["params"])  # ISTA has fewer weights than the MLP
    eca = [r for r in json.loads((out2 / "results.json").read_text())["rows"] if r["name"] == "eca_raw"][0]
    assert len(eca["alpha"]) == 1 and len(eca["beta"]) == 1


def test_exp4_compression(roots):
    out, _ = _run("exp4_compression", roots)
    res = json.loads((out / "results.json").read_text())
    rows = {r["name"]: r for r in res["rows"]}
    assert set(rows) == {"truncatt_0.5", "cp_0.5", "irratt_0.5", "irratt_rank_0.5", "vo_truncatt_8"}
    for name in ("truncatt_0.5", "cp_0.5", "irratt_0.5"):
        assert rows[name]["qk_flops_ratio"] <= 0.5 + 1e-9 and rows[name]["protocol"] in ("flops", "both")
        assert rows[name]["mhsa_flops_ratio"] < 1.0 and rows[name]["params_ratio"] < 1.0
    # the paper's protocol: IrrAtt gets TruncAtt's total rank, its fusion MACs on top of the budget
    assert rows["irratt_rank_0.5"]["protocol"] == "rank"
    assert rows["irratt_rank_0.5"]["qk_total_rank_block0"] == rows["truncatt_0.5"]["qk_total_rank_block0"]
    assert rows["irratt_0.5"]["qk_total_rank_block0"] < rows["truncatt_0.5"]["qk_total_rank_block0"]
    assert rows["vo_truncatt_8"]["qk_flops_ratio"] == pytest.approx(1.0)


def test_exp5_language(roots):
    out, _ = _run("exp5_language", roots)
    res = json.loads((out / "results.json").read_text())
    params = {r["name"]: r["params"] for r in res["train"]}
    assert abs(params["tost"] - params["gpt"]) / params["gpt"] < 0.05  # equal-parameter comparison
    gen = {(r["name"], r["position"]): r for r in res["generation"]}
    # ToST's recurrent state does not grow with the position; GPT's key/value cache does
    assert gen[("tost", 16)]["state_bytes"] == gen[("tost", 64)]["state_bytes"]
    assert gen[("gpt", 64)]["state_bytes"] > gen[("gpt", 16)]["state_bytes"]


def test_exp6_listops_and_exp7_index(roots):
    out, _ = _run("exp6_listops", roots)
    res = json.loads((out / "results.json").read_text())
    assert {r["name"] for r in res["runs"]} == {"tost", "gpt"}
    assert 0.0 < res["majority_class_acc"] <= 1.0
    out7, _ = _run("exp7_efficiency", roots)
    idx = json.loads((out7 / "index.json").read_text())
    assert "attention" in idx["targets"]


def test_exp8_plain_vit(roots):
    out, runs = _run("exp8_plain_vit", roots)
    res = json.loads((out / "results.json").read_text())
    got = {(r["attn"], r["readout"], r["lpi"]) for r in res["runs"]}
    assert got == {("tssa", "cls", False), ("tssa", "mean", False), ("tssa", "pool", False), ("tssa", "pool", True),
                   ("eca", "pool", False)}
    for r in res["runs"]:
        assert 0.0 <= r["test_acc"] <= 1.0 and r["params"] > 0
    by = {(r["readout"], r["lpi"]): r["params"] for r in res["runs"] if r["attn"] == "tssa"}
    assert by[("pool", False)] > by[("cls", False)] and by[("pool", True)] > by[("pool", False)]
    mtimes = {p: p.stat().st_mtime for p in runs.glob("*/result.json")}
    assert len(mtimes) == 5
    _run("exp8_plain_vit", roots)  # resumable: nothing is trained again
    assert {p: p.stat().st_mtime for p in runs.glob("*/result.json")} == mtimes


def test_exp9_lra(roots, tmp_path):
    """Every LRA stand-in task trains ToST and the Transformer (tiny MNIST written as IDX files)."""
    import gzip

    import numpy as np

    rng = np.random.default_rng(0)
    for prefix, n in (("train", 16), ("t10k", 8)):
        for what, arr in (("images-idx3", rng.integers(0, 256, (n, 28, 28))), ("labels-idx1", rng.integers(0, 10, (n,)))):
            header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
            with gzip.open(tmp_path / f"{prefix}-{what}-ubyte.gz", "wb") as f:
                f.write(header + arr.astype(np.uint8).tobytes())
    out, runs = _run("exp9_lra", roots, ["--mnist-dir", str(tmp_path)])
    res = json.loads((out / "results.json").read_text())
    got = {(r["task"], r["family"]) for r in res["runs"]}
    tasks = ("listops", "text", "retrieval", "image", "pathfinder")
    assert got == {(t, f) for t in tasks for f in ("tost", "transformer")}
    for r in res["runs"]:
        assert 0.0 <= r["test_acc"] <= 1.0 and r["steps_done"] == 2 and r["params"] > 0
    assert {r["schedule"] for r in res["runs"] if r["task"] == "listops"} == {"inverse_sqrt"}  # Table 7
    assert {r["schedule"] for r in res["runs"] if r["task"] == "text"} == {"linear"}
    assert res["data"]["retrieval"]["pair"] and res["data"]["image"]["seq_len"] == 64
    mtimes = {p: p.stat().st_mtime for p in runs.glob("*/result.json")}
    assert len(mtimes) == 10
    _run("exp9_lra", roots, ["--mnist-dir", str(tmp_path)])  # resumable: nothing is trained again
    assert {p: p.stat().st_mtime for p in runs.glob("*/result.json")} == mtimes


def test_make_results_md_reads_only_result_files(roots, tmp_path):
    import make_results_md

    doc = tmp_path / "results.md"
    # an empty results root: every section says "not run yet" with its command
    assert make_results_md.main(["--results", str(tmp_path / "none"), "--bench-results", str(tmp_path / "none"),
                                 "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.count("**Not run yet.**") == 10 and "python -m benchmarks.linearize" in text
    assert "experiments/exp4_compression.py" in text
    # the smoke results of the tests above (run earlier in this module)
    assert make_results_md.main(["--results", str(roots / "results"), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "| tost | `tost_t12_p16` |" in text and "tost_no_l2norm" in text
    assert "| irratt_rank_0.5 | rank |" in text and "protocol rank (the paper's)" in text
    assert "## Summary" in text
    assert "## 9. Long-Range-Arena encoders" in text and "| pathfinder | Pathfinder 32x32, 1024 |" in text


def test_result_files_are_written_whole_and_never_through_a_link(tmp_path):
    """write_csv opened the path for writing (through a link into its target, half a table when
    killed); write_json wrote a fixed NAME.tmp (through a link of that name, and two runs collided)."""
    import common

    target = tmp_path / "elsewhere"
    target.write_text("theirs")
    for name in ("runs.csv", "results.json", "results.json.tmp"):
        (tmp_path / name).symlink_to(target)
    common.write_csv(tmp_path / "runs.csv", [{"a": 1.5, "b": "x"}])
    common.write_json(tmp_path / "results.json", {"a": 1})
    assert target.read_text() == "theirs"
    assert list(csv.DictReader(open(tmp_path / "runs.csv"))) == [{"a": "1.5", "b": "x"}]
    assert json.loads((tmp_path / "results.json").read_text()) == {"a": 1}
    assert (tmp_path / "results.json.tmp").is_symlink()  # not a name the writer owns: left alone
