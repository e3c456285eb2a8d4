"""The long commands show progress on a terminal: a tqdm bar on stderr with its total (and ETA) for
``eval`` (batches), ``analyze eca-toy`` (steps of the whole run) and ``analyze report``; none with
``--no-progress`` and none when stderr is not a terminal (a log file gets no redrawn bar)."""
import io
import re
import sys

import pytest

from test_train import _one_thread  # noqa: F401  (autouse: one thread for the tiny models)
from whiteformer.app import eca_toy
from whiteformer.app.cli import main

LM = ["--model", "tost_lm_base", "model_args={dim: 32, depth: 1, num_heads: 2}", "--dataset", "text", "--steps", "2",
      "--batch-size", "4", "--block-size", "16", "--eval-batches", "1", "--no-report", "--no-progress",
      "--no-tensorboard", "--num-threads", "1"]


class Tty(io.StringIO):
    def isatty(self):
        return True


def _bars(text: str, desc: str):
    """(done, total) of each redraw of the bar named ``desc``."""
    return [(int(a), int(b)) for a, b in re.findall(re.escape(desc) + r"[^\r\n]*?\|\s*(\d+)/(\d+)", text)]


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("progress") / "lm"
    assert main(["train", *LM, "--out", str(out)]) == 0
    return out


def test_eval_draws_a_bar_over_its_batches_on_a_terminal(lm_run, monkeypatch, capsys):
    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main(["eval", "--checkpoint", str(lm_run), "--eval-batches", "3", "--batch-size", "2"]) == 0
    bars = _bars(tty.getvalue(), "eval")
    assert bars and {total for _, total in bars} == {3} and bars[-1] == (3, 3), tty.getvalue()
    assert "<" in tty.getvalue()  # elapsed<remaining: tqdm's ETA
    quiet = Tty()
    monkeypatch.setattr(sys, "stderr", quiet)
    assert main(["eval", "--checkpoint", str(lm_run), "--eval-batches", "3", "--batch-size", "2",
                 "--no-progress"]) == 0
    assert _bars(quiet.getvalue(), "eval") == []
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(lm_run), "--eval-batches", "3", "--batch-size", "2"]) == 0
    assert _bars(capsys.readouterr().err, "eval") == []  # not a terminal: no bar in the log


def test_eca_toy_draws_one_bar_over_the_whole_run(tmp_path, monkeypatch):
    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main(["analyze", "eca-toy", "--small", "--no-plots", "--out", str(tmp_path / "a")]) == 0
    bars = _bars(tty.getvalue(), "eca-toy")
    total = eca_toy._num_steps(eca_toy.SMALL)
    assert bars and {t for _, t in bars} == {total} and bars[-1] == (total, total), tty.getvalue()[-400:]
    assert "Cholesky sweep" in tty.getvalue()  # each stage named
    quiet = Tty()
    monkeypatch.setattr(sys, "stderr", quiet)
    assert main(["analyze", "eca-toy", "--small", "--no-plots", "--no-progress", "--out", str(tmp_path / "b")]) == 0
    assert _bars(quiet.getvalue(), "eca-toy") == []


def test_eca_toy_bar_total_counts_every_step(tmp_path, monkeypatch):
    """The bar's total is the number of updates the run makes, for other sizes too."""
    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    eca_toy.run(tmp_path, small=True, plots=False, progress=True, layers=2, epochs=1, sweep_repeats=2)
    bars = _bars(tty.getvalue(), "eca-toy")
    total = eca_toy._num_steps(eca_toy.ToyConfig(**{**eca_toy.SMALL.__dict__, "layers": 2, "epochs": 1,
                                                   "sweep_repeats": 2}))
    assert bars[-1] == (total, total)
