"""`whiteformer train` with the LRA sequence classifiers on the offline LRA stand-ins."""
from __future__ import annotations

import json

from whiteformer.app.cli import main


def _train(tmp_path, name, model, dataset, data_args, model_args):
    out = tmp_path / name
    rc = main(["train", "--model", model, "--dataset", dataset, "--data-args", data_args, "--model-args", model_args,
               "--steps", "3", "--batch-size", "8", "--out", str(out), "--progress", "false", "--num-threads", "1"])
    return rc, out


def test_train_lra_models_from_the_cli(tmp_path, capsys):
    small = "{depth: 1, embed_dim: 16, num_heads: 2, mlp_dim: 16}"
    runs = [("pf", "tost_lra_pathfinder", "pathfinder",
             "{num_train: 16, num_test: 8, img_size: 16, length: 6, distractor_length: 3, num_distractors: 1}"),
            ("lo", "tost_lra_listops", "listops", "{num_train: 16, num_test: 8, max_length: 32, min_length: 8, max_depth: 3}"),
            ("rt", "transformer_lra_retrieval", "shakespeare-pairs", "{num_train: 16, num_test: 8, max_length: 32, min_length: 8}")]
    for name, model, dataset, data_args in runs:
        rc, out = _train(tmp_path, name, model, dataset, data_args, small)
        assert rc == 0, capsys.readouterr().err
        cfg = json.loads((out / "final" / "config.json").read_text())
        assert cfg["model_name"] == model
    assert "final test accuracy" in capsys.readouterr().out
    # a language model cannot read pixel tokens with class labels: one clear error line, exit 2
    rc, _ = _train(tmp_path, "bad", "tost_lm_base", "pathfinder", "{num_train: 4, num_test: 4}", "{}")
    err = capsys.readouterr().err
    assert rc == 2 and "sequence classifier (tost_lra_*" in err and "Traceback" not in err
