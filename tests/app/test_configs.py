"""Shipped configs are named: ``whiteformer train -c demo_digits`` reads the packaged file from any
directory, ``whiteformer list-configs`` lists them, and the wheel carries every one of them."""
import sys
from pathlib import Path

import pytest

from whiteformer.app.cli import main
from whiteformer.app.config import build_config
from whiteformer.app.configs import describe_config, list_configs, shipped_config
from whiteformer.app.train import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "src" / "whiteformer" / "app" / "configs"


def test_list_configs_names_every_yaml_file_of_the_package():
    assert list_configs() == sorted(p.stem for p in CONFIGS.glob("*.yaml"))
    assert "demo_digits" in list_configs()


def test_list_configs_command_prints_each_name_with_its_description(capsys):
    assert main(["list-configs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == list_configs()
    demo = next(ln for ln in lines if ln.startswith("demo_digits "))
    assert "8x8 digits" in demo and demo.endswith(".")
    assert describe_config("demo_digits") in demo


def test_list_configs_refuses_arguments(capsys):
    assert main(["list-configs", "extra"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error: list-configs takes no arguments" in err[0]


@pytest.mark.parametrize("name", ["demo_digits", "demo_digits.yaml"])
def test_a_shipped_config_is_found_by_name_from_any_directory(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    cfg = build_config(TrainConfig, name, {"epochs": 1})
    assert (cfg.model, cfg.dataset, cfg.epochs, cfg.model_args["embed_dim"]) == ("tost_t12_p16", "digits", 1, 96)
    assert shipped_config(name) == CONFIGS / "demo_digits.yaml"


def test_a_file_that_exists_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo_digits").write_text("dataset: subspaces\nepochs: 3\n")
    cfg = build_config(TrainConfig, "demo_digits")
    assert (cfg.dataset, cfg.epochs) == ("subspaces", 3)


def test_neither_a_file_nor_a_shipped_name_is_one_error_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "-c", "demo_digit"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error: config file 'demo_digit' does not exist" in err[0]
    assert "shipped: demo_digits" in err[0] and "whiteformer list-configs" in err[0]


def test_the_wheel_carries_every_shipped_config():
    """pyproject's package-data globs cover each YAML file (what an installed wheel holds)."""
    import fnmatch

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        tomllib = pytest.importorskip("tomli")
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["whiteformer"]
    pkg = ROOT / "src" / "whiteformer"
    for path in CONFIGS.glob("*.yaml"):
        rel = path.relative_to(pkg).as_posix()
        assert any(fnmatch.fnmatch(rel, g) for g in globs), f"{rel} is not package data"
