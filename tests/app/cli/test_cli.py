"""The ``whiteformer`` command: subcommands, configuration from YAML + overrides, errors, demo."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from whiteformer.app.cli import ANALYSES, COMMANDS, build_parser, main, register_command, register_lazy_command

TINY = ["model_args={patch_size: 2, embed_dim: 16, depth: 2, num_heads: 2, cls_attn_layers: 1}",
        "--no-progress", "--no-tensorboard", "--num-threads", "1"]


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_help_and_unknown_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("train", "eval", "generate", "analyze", "list-models"):
        assert name in out
    assert main(["trian"]) == 2
    assert "did you mean 'train'" in capsys.readouterr().err
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--label-smoothing" in out and "--resume" in out and "--finetune" in out


def test_list_models_and_datasets(capsys):
    assert main(["list-models", "tost_t*"]) == 0
    names = capsys.readouterr().out.split()
    assert "tost_t12_p16" in names and all(n.startswith("tost_t") for n in names)
    assert main(["list-datasets"]) == 0
    out = capsys.readouterr().out
    assert "digits" in out and "listops" in out


def test_subcommand_registry_is_extensible(capsys):
    @register_command("hello-test", "test command")
    def _hello(argv):
        print("hello", *argv)
        return 0

    try:
        assert main(["hello-test", "x"]) == 0
        assert capsys.readouterr().out.strip() == "hello x"
        with pytest.raises(ValueError, match="already registered"):
            register_command("hello-test", "again")(_hello)
    finally:
        COMMANDS.pop("hello-test")
    assert {"eca-toy", "report"} <= set(ANALYSES)
    # Lazily imported commands: resolved at first use, a missing module is a clean error.
    register_lazy_command("lazy-test", "whiteformer.app.cli:_usage_probe_missing", "missing")
    register_lazy_command("lazy-ok", "json:dumps", "returns a string, exit code 0")
    try:
        assert main(["lazy-test"]) == 2
        assert "not available" in capsys.readouterr().err
        assert main(["lazy-ok"]) == 0
    finally:
        COMMANDS.pop("lazy-test")
        COMMANDS.pop("lazy-ok")


def test_one_parser_holds_every_command(capsys):
    """Every registered command is a subparser of the one ``whiteformer`` parser, compress included,
    and no other module of the package builds an ArgumentParser."""
    assert main(["--version"]) == 0 and capsys.readouterr().out.startswith("whiteformer ")
    assert main(["compress", "--help"]) == 0 and "--qk-flops-ratio" in capsys.readouterr().out
    assert main(["--bogus"]) == 2
    assert capsys.readouterr().err.startswith("whiteformer: error: give a command (unrecognized arguments: --bogus)")
    parser = build_parser()
    assert set(parser.subcommands) == set(COMMANDS)
    assert "--qk-flops-ratio" in parser.subcommands["compress"].format_help()
    assert "-c NAME|FILE" in parser.subcommands["eval"].format_help()
    src = Path(__import__("whiteformer").__file__).parent
    builders = sorted(str(f.relative_to(src)) for f in src.rglob("*.py") if "ArgumentParser(" in f.read_text())
    assert builders == ["app/cli.py"], builders


def test_overrides_keep_their_order_around_the_config_option():
    """The words the parser does not know are the overrides, in the order given, wherever -c is."""
    args, extra = build_parser(["train"]).parse_known_args(
        ["train", "--lr", "1e-3", "-c", "x.yaml", "epochs=3", "--prompt", "-x", "--no-ema", "--lr=-2", "--report-images",
         "-1"])
    assert args.command == "train" and args.config == "x.yaml"
    assert extra == ["--lr", "1e-3", "epochs=3", "--prompt", "-x", "--no-ema", "--lr=-2", "--report-images", "-1"]
    # --co is an override (no abbreviation of --config)
    args, extra = build_parser(["train"]).parse_known_args(["train", "--co", "3"])
    assert args.config is None and extra == ["--co", "3"]


def test_a_command_with_arguments_gets_its_namespace(capsys):
    def add(p):
        p.add_argument("--times", type=int, default=1)

    @register_command("echo-test", "test command with options", add)
    def _echo(args):
        print("echo " * args.times)
        return 0

    try:
        assert main(["echo-test", "--times", "2"]) == 0
        assert capsys.readouterr().out.strip() == "echo echo"
        assert main(["echo-test", "--times", "x"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("whiteformer echo-test: error: argument --times: invalid int value") and err.count("\n") == 1
        assert main(["echo-test", "stray"]) == 2
        assert "unrecognized arguments: stray" in capsys.readouterr().err
        assert main(["echo-test", "--help"]) == 0
        assert "--times" in capsys.readouterr().out
    finally:
        COMMANDS.pop("echo-test")


@pytest.mark.parametrize("argv,msg", [
    (["train", "--model", "tost_nope"], "unknown model 'tost_nope'"),
    (["train", "--lr", "fast"], "lr must be a number"),
    (["train", "--dataset", "mnist", "--data-dir", "/nonexistent"], "does not exist"),
    (["train", "--bogus", "1"], "unknown option 'bogus'"),
    (["train", "-c", "/nonexistent.yaml"], "config file"),
    (["train", "stray"], "unexpected argument 'stray'"),
    (["eval"], "give --checkpoint"),
    (["eval", "--checkpoint", "/nonexistent/run"], "does not exist"),
    (["analyze"], "needs an analysis name"),
    (["analyze", "nope"], "unknown analysis 'nope'"),
])
def test_errors_are_reported_cleanly(capsys, argv, msg):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_train_eval_with_yaml_and_overrides(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"dataset": "digits", "epochs": 5, "batch_size": 64, "lr": 2.0e-3,
                                   "report": True}))
    out = tmp_path / "run"
    assert main(["train", "-c", str(cfg), *TINY, "--epochs", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "final test accuracy" in text and f"report: {out}/report.md" in text and "membership.png" in text
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["epochs"] == 1 and saved["lr"] == 2e-3 and saved["model_args"]["embed_dim"] == 16
    report = (out / "report.md").read_text()
    assert "whiteformer train -c" in report or "whiteformer" in report

    assert main(["eval", "--checkpoint", str(out), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["dataset"] == "digits" and res["n"] == 359 and 0 <= res["acc"] <= 1
    # Evaluating on the training split uses the run's dataset settings too.
    assert main(["eval", "--checkpoint", str(out / "final"), "--split", "train"]) == 0
    assert "digits/train: accuracy" in capsys.readouterr().out
    # A second train into the same directory needs --resume (which here has nothing left to do).
    assert main(["train", "-c", str(cfg), *TINY, "--epochs", "1", "--out", str(out)]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["train", "-c", str(cfg), *TINY, "--epochs", "1", "--out", str(out), "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().out
    # The report can be re-created from the run directory.
    assert main(["analyze", "report", "--checkpoint", str(out), "--out", str(tmp_path / "again")]) == 0
    assert "report:" in capsys.readouterr().out
    assert "test accuracy" in (tmp_path / "again" / "report.md").read_text()


def test_generate_from_a_language_model(tmp_path, capsys):
    out = tmp_path / "lm"
    argv = ["train", "--model", "tost_lm_base", "model_args={dim: 32, depth: 1, num_heads: 2}", "--dataset", "text",
            "--steps", "3", "--batch-size", "4", "--block-size", "16", "--eval-batches", "1", "--no-report",
            "--no-progress", "--no-tensorboard", "--num-threads", "1", "--out", str(out)]
    assert main(argv) == 0
    assert "perplexity" in capsys.readouterr().out
    assert main(["generate", "--checkpoint", str(out), "--prompt", "ROMEO", "--max-new-tokens", "8",
                 "--num-samples", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "--- sample 1" and lines[1].startswith("ROMEO")


def test_analyze_eca_toy_small(tmp_path, capsys, monkeypatch):
    calls = {}

    def fake_run(out_dir, seed=0, small=False, plots=True, **over):
        calls.update(out=out_dir, seed=seed, small=small, plots=plots, **over)
        return {"figures": []}

    import whiteformer.app.eca_toy as eca_toy

    monkeypatch.setattr(eca_toy, "run", fake_run)
    monkeypatch.setattr(eca_toy, "_format_summary", lambda res: "summary", raising=False)
    assert main(["analyze", "eca-toy", "--out", str(tmp_path), "--small", "--seed", "2", "options.layers=3"]) == 0
    assert Path(calls.pop("out")).parent == tmp_path.parent  # written beside, then swapped in as --out
    assert calls == {"seed": 2, "small": True, "plots": True, "progress": True, "layers": 3}
    assert "summary" in capsys.readouterr().out


def test_python_m_whiteformer_entry_point():
    res = subprocess.run([sys.executable, "-m", "whiteformer", "list-models", "eca_*"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and "eca_t" in res.stdout.split()
    res = subprocess.run([sys.executable, "-m", "whiteformer", "train", "--modle", "x"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "did you mean 'model'" in res.stderr


def test_demo_config_and_short_demo(tmp_path, capsys):
    from whiteformer.app import demo
    from whiteformer.app.train import TrainConfig, build_config

    cfg = build_config(TrainConfig, demo.config_path())
    assert cfg.dataset == "digits" and cfg.model_args["patch_size"] == 2 and cfg.out == "runs/demo"
    rc = demo.main(["--epochs", "1", "--out", str(tmp_path / "demo"), "--no-progress"])
    out = capsys.readouterr().out
    assert rc in (0, 1)  # one epoch does not reach the 95 % target; the full demo does
    assert "test accuracy" in out and f"report:   {tmp_path / 'demo'}/report.md" in out
    assert "pictures:" in out and "coding_rate.png" in out
    assert (tmp_path / "demo" / "report.md").is_file()
