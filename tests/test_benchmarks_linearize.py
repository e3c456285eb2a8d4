"""Smoke test of the linearization study (benchmarks/linearize.py): the whole pipeline at the
``smoke`` preset on the shipped small corpus (BPE, teacher trained with ``whiteformer train``,
linearize, ToST from scratch, generation cost), its result file's structure, and the docs
section rendered from that file. No timing assertions."""
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import linearize, report  # noqa: E402


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    from whiteformer.app.data.text import default_corpus_path

    tmp = tmp_path_factory.mktemp("linearize")
    out = tmp / "results" / "linearize_quick.json"
    linearize.main(["--preset", "smoke", "--text", str(default_corpus_path()), "--out", str(out),
                    "--work", str(tmp / "work"), "--no-vision"])
    return out


def test_result_file_has_every_row(study):
    data = json.loads(study.read_text())
    assert data["preset"] == "smoke" and data["issue_size_run"] is False and data["threads"] == 1
    rows = data["rows"]
    stages = [r["stage"] for r in rows]
    assert stages == (["teacher"] + ["swap", "transfer"] * len(linearize.INITS)
                      + ["finetune", "hybrid 1 of 4", "hybrid 1 of 2", "scratch", "scratch"])
    assert {r["init"] for r in rows if r["stage"] == "transfer"} == set(linearize.INITS)
    assert data["best_init"] in linearize.INITS
    s = data["settings"]
    window = s["train"]["batch_size"] * s["train"]["block_size"]
    teacher = rows[0]
    assert teacher["tokens"] == s["train"]["steps"] * window and teacher["params"] == data["teacher_params"]
    for r in rows:
        assert math.isfinite(r["val_loss"]) and r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]))
        assert r["loss_rel_to_teacher"] == pytest.approx(r["val_loss"] / teacher["val_loss"] - 1)
        assert r["wall_s"] > 0 and r["arch"] in data["generation"]
    lin_tokens = (s["lin"]["transfer_steps"] + s["lin"]["finetune_steps"]) * window
    by = {r["name"]: r for r in rows}
    assert by["after transfer + fine-tuning"]["tokens"] == lin_tokens
    assert by["ToST from scratch, same tokens as the linearization"]["tokens"] == lin_tokens
    assert by["ToST from scratch, the teacher's tokens"]["tokens"] == teacher["tokens"]
    # the hybrids keep the layers matched worst after transfer, and transfer only the others
    order = data["layers_by_relative_transfer_loss"]
    assert sorted(order) == list(range(s["model"]["depth"]))
    for r, k in ((r for r in rows if r["stage"] == "hybrid 1 of 4"), 1), ((r for r in rows if r["stage"] ==
                                                                          "hybrid 1 of 2"), 2):
        r = next(r)
        assert r["keep_softmax"] == sorted(order[:k])
        assert r["tssa_layers"] == [i for i in range(s["model"]["depth"]) if i not in r["keep_softmax"]]
    assert set(data["goal_results"]) == {"tssa", "hybrid_1of4"}


def test_generation_state_grows_only_with_softmax_layers(study):
    data = json.loads(study.read_text())
    gen = data["generation"]
    contexts = data["settings"]["contexts"]
    for arch, points in gen.items():
        assert [p["context"] for p in points] == contexts
        sizes = [p["state_bytes"] for p in points]
        kinds = points[0]["state_kinds"]
        softmax_layers = kinds.count("KVCache")
        if softmax_layers == 0:
            assert len(set(sizes)) == 1, arch  # constant-size state
        else:  # the key/value cache grows by the same amount per token
            per = [(b - a) / (q - p) for a, b, p, q in zip(sizes, sizes[1:], contexts, contexts[1:])]
            assert per[0] > 0 and all(x == pytest.approx(per[0]) for x in per), arch
        assert all(p["per_token_s"] > 0 for p in points)
    assert gen["softmax"][0]["state_kinds"] == ["KVCache"] * data["settings"]["model"]["depth"]


def test_docs_section_renders_from_the_file(study):
    data = json.loads(study.read_text())
    text = "\n".join(linearize.section(data))
    assert text.startswith(f"## {linearize.HEADING}")
    for r in data["rows"]:
        assert f"| {r['name']} | {r['val_loss']:.4f} |" in text
    assert f"**{data['teacher_params']:,} parameters**" in text and "**not run here**" in text
    assert "Pure TSSA within 3 %" in text and "1-in-4 hybrid within 1 %" in text
    assert text.count("**met**") + text.count("**missed**") == 2
    # the benchmarks page and the results page include it
    page = report.linearize_section(study.parent, "_quick")
    assert page[0] == f"## {linearize.HEADING}" and "\n".join(page) == text
    assert "**Not run yet.**" in "\n".join(linearize.section(None))
