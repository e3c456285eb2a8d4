"""Non-finite numbers are errors, never results: ``eval`` of a model with NaN / inf weights or
overflowing outputs, and ``train`` diverging (huge learning rate or weight decay), stop with one
``error:`` line (exit 2) naming the model or the step; a diverged run keeps its last good checkpoint
and saves no final model."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_faults_runs import SUBSPACES, one_error_line
from test_no_data_loss import finished  # noqa: F401  (fixture: a finished 2-step run)
from test_train import _one_thread  # noqa: F401  (autouse: one thread for the tiny models)
from whiteformer.app.cli import main
from whiteformer.app.train.checkpoint import list_checkpoints


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e38])
def test_eval_of_a_model_with_non_finite_weights_or_outputs_is_one_error_line(finished, tmp_path, capsys, value):
    """eval printed 'accuracy 25.00 % (loss nan)' and exit 0 for a 1e38 weight, a traceback
    ('temp contains NaN or inf') for NaN."""
    model = shutil.copytree(finished / "final", tmp_path / "model")
    weights = load_file(model / "model.safetensors")
    key = "head.weight" if value == 1e38 else next(k for k in weights if k.endswith("temp"))
    weights[key] = torch.randn(weights[key].shape) * value if value == 1e38 else torch.full_like(weights[key], value)
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    err = one_error_line(capsys, main(["eval", "--checkpoint", str(model)]))
    assert str(model) in err and ("NaN or inf" in err or "non-finite" in err), err


@pytest.mark.parametrize("option", [["--lr", "1e20"], ["--weight-decay", "1e20"]])
def test_train_stops_at_a_non_finite_loss_naming_the_step_and_saves_no_final_model(tmp_path, capsys, option):
    """train --weight-decay 1e20 finished with exit 0, 'loss nan', and saved the model; --lr 1e20
    diverged into a traceback."""
    run = tmp_path / "run"
    rc = main(["train", *SUBSPACES, "--steps", "6", "--ckpt-every", "1", "--out", str(run), *option])
    err = one_error_line(capsys, rc)
    assert "step" in err and ("NaN" in err or "nan" in err or "inf" in err), err
    assert not (run / "final").exists()
    for ck in list_checkpoints(run / "checkpoints"):  # the checkpoints kept hold finite weights only
        assert all(torch.isfinite(t).all() for t in load_file(ck / "model.safetensors").values())
