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


def _closed_bars(text: str, desc: str):
    """(done, total) of each bar named ``desc`` as it was left when closed (one line each)."""
    out = []
    for line in text.split("\n"):
        found = _bars(line.split("\r")[-1], desc)
        out += found[-1:]
    return out


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


@pytest.mark.parametrize("kind", ["whiteformer", "transformers"])
def test_analyze_layerwise_draws_a_bar_over_the_layers(kind, tmp_path, monkeypatch):
    from whiteformer import create_model

    if kind == "transformers":
        transformers = pytest.importorskip("transformers")
        model = transformers.GPT2Model(transformers.GPT2Config(n_embd=16, n_layer=3, n_head=2, vocab_size=50,
                                                               n_positions=16))
        rows = 3 + 1  # the layers and the final norm
    else:
        model = create_model("tost_t12_p16", img_size=8, patch_size=2, in_chans=1, depth=2, embed_dim=16,
                             num_heads=2, num_classes=3)
        rows = 2
    model.save_pretrained(tmp_path / "m")
    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    args = ["analyze", "layerwise", "--checkpoint", str(tmp_path / "m"), "--no-plots", "options.samples=2",
            "options.seq_len=8"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    bars = _bars(tty.getvalue(), "layerwise")
    assert bars and bars[-1] == (rows, rows) and {t for _, t in bars} == {rows}, tty.getvalue()
    quiet = Tty()
    monkeypatch.setattr(sys, "stderr", quiet)
    assert main([*args, "--no-progress", "--out", str(tmp_path / "b")]) == 0
    assert _bars(quiet.getvalue(), "layerwise") == []


def test_compress_draws_its_block_bar_and_the_accuracy_bars_on_a_terminal(tmp_path, monkeypatch):
    pytest.importorskip("sklearn")
    run = tmp_path / "deit"
    assert main(["train", "--model", "deit_t_p16", "model_args={patch_size: 4, embed_dim: 16, depth: 2, num_heads: 2}",
                 "--dataset", "digits", "--steps", "1", "--no-progress", "--no-report", "--no-tensorboard",
                 "--out", str(run)]) == 0
    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    args = ["compress", "--checkpoint", str(run), "--qk", "truncatt", "--qk-rank", "4", "--vo-rank", "4"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    text = tty.getvalue()
    assert _bars(text, "compress")[-1] == (2, 2), text
    evals = _closed_bars(text, "eval")  # the original's and the compressed model's accuracy
    assert len(evals) == 2 and all(done == total > 0 for done, total in evals), text
    quiet = Tty()
    monkeypatch.setattr(sys, "stderr", quiet)
    assert main([*args, "--quiet", "--out", str(tmp_path / "b")]) == 0
    assert _bars(quiet.getvalue(), "compress") == [] and _bars(quiet.getvalue(), "eval") == []
