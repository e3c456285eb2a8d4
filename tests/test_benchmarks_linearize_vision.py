"""Smoke test of benchmarks/linearize_vision.py: the MNIST linearization study at a tiny size writes
its JSON, and its docs section is rendered from it. No timing or accuracy assertions."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import linearize_vision  # noqa: E402


def test_quick_run_writes_the_rows_and_the_goal(data_dir, tmp_path):
    mnist = data_dir / "mnist"
    if not mnist.is_dir():
        pytest.skip(f"MNIST not found in {mnist}")
    out = tmp_path / "linearize_vision.json"
    linearize_vision.main(["--quick", "--data-dir", str(mnist), "--out", str(out)])
    res = json.loads(out.read_text())
    cfg = res["config"]
    names = [r["name"] for r in res["rows"]]
    assert names == ["teacher (softmax)", "plain swap", "after transfer", "after transfer + fine-tuning"]
    assert [r["images"] for r in res["rows"]] == [cfg["teacher_steps"] * cfg["batch_size"], 0,
                                                 cfg["transfer_steps"] * cfg["batch_size"],
                                                 (cfg["transfer_steps"] + cfg["finetune_steps"]) * cfg["batch_size"]]
    assert all(0 <= r["accuracy"] <= 100 for r in res["rows"])
    goal = res["goal"]
    assert goal["gap_points"] == pytest.approx(res["rows"][0]["accuracy"] - res["rows"][-1]["accuracy"])
    assert goal["met"] == (goal["gap_points"] <= linearize_vision.GOAL_POINTS)
    text = linearize_vision.section(res)
    assert text.count("\n|") >= 5 and "Goal" in text and f"{res['rows'][-1]['accuracy']:.2f} %" in text


def test_a_missing_data_dir_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        linearize_vision.main(["--quick", "--data-dir", str(tmp_path / "none")])
    assert err.value.code == 2 and "--data-dir" in capsys.readouterr().err
