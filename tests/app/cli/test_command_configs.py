"""compress, prepare-text and the analyses read their options as every command: one dataclass each,
its defaults, ``-c FILE`` and ``--key value`` / ``key=value`` (the last winning), ``--help`` from the
fields."""
import pytest

from whiteformer.app.analyze import EcaToyConfig, LayerwiseConfig, ReportConfig
from whiteformer.app.cli import main
from whiteformer.app.compress_cli import CompressConfig
from whiteformer.app.config import AnalyzeConfig, ConfigError, build_config, parse_overrides
from whiteformer.app.prepare_text import PrepareTextConfig
from whiteformer.compress import CompressSpec


def test_bare_words_fill_the_positional_option_in_order():
    words = ["a.txt", "--tokenizer", "t.json", "b.txt", "--out=d", "c.txt", "--no-progress"]
    parsed = parse_overrides(words, positional="inputs")
    assert dict(parsed)["inputs"] == ["a.txt", "b.txt", "c.txt"]
    cfg = build_config(PrepareTextConfig, overrides=parsed)
    assert (cfg.inputs, cfg.tokenizer, cfg.out, cfg.progress) == (["a.txt", "b.txt", "c.txt"], "t.json", "d", False)
    with pytest.raises(ConfigError, match="unexpected argument 'a.txt'"):
        parse_overrides(["a.txt"])  # a command without a positional option refuses a bare word


def test_compress_options_from_yaml_and_command_line_make_the_spec(tmp_path):
    yaml = tmp_path / "c.yaml"
    yaml.write_text("checkpoint: runs/deit\nout: runs/small\nqk: truncatt\nqk_rank: [4, 4, 8]\nvo_rank: 8\n"
                    "model_args: {drop_rate: 0.0}\n")
    words = ["--vo-rank", "16", "blocks=0,2", "--mlp-rank", "8,4", "model_args.img_size=32", "--quiet"]
    cfg = build_config(CompressConfig, yaml, parse_overrides(words))
    assert cfg.model_args == {"drop_rate": 0.0, "img_size": 32}
    assert cfg.spec() == CompressSpec(qk="truncatt", qk_rank=(4, 4, 8), vo_rank=16, mlp_rank=(8, 4), blocks=(0, 2),
                                      progress=False)
    with pytest.raises(ConfigError, match=r"qk_rank\[1\] must be an integer, got 'x'"):
        build_config(CompressConfig, overrides=parse_overrides(["--qk-rank", "4,x", "--checkpoint", "c", "--out", "o"]))
    with pytest.raises(ConfigError, match="qk must be one of"):  # the spec's own check, before any work
        build_config(CompressConfig, overrides={"checkpoint": "c", "out": "o", "qk": "svd", "qk_rank": [4]})
    with pytest.raises(ConfigError, match="compress needs --out"):
        build_config(CompressConfig, overrides={"checkpoint": "c"})


def test_each_analysis_has_typed_options_of_its_own():
    common = {f for f in AnalyzeConfig.__dataclass_fields__}
    assert issubclass(EcaToyConfig, AnalyzeConfig) and issubclass(LayerwiseConfig, AnalyzeConfig)
    assert {"small", "d", "layers", "eps_sweep"} <= set(EcaToyConfig.__dataclass_fields__) - common
    assert {"checkpoint", "inputs", "samples", "seq_len"} <= set(LayerwiseConfig.__dataclass_fields__) - common
    assert set(ReportConfig.__dataclass_fields__) - common == {"checkpoint"}
    cfg = build_config(EcaToyConfig, overrides=parse_overrides(["--layers", "2", "eps_sweep=0,0.1"]))
    assert (cfg.layers, cfg.eps_sweep, cfg.d) == (2, [0.0, 0.1], None)  # None: the preset's value
    with pytest.raises(ConfigError, match="unknown option 'samples' for EcaToyConfig"):
        build_config(EcaToyConfig, overrides={"samples": 2})


def test_help_lists_the_fields(capsys):
    assert main(["analyze", "--help"]) == 0
    out = capsys.readouterr().out
    assert "options of layerwise:" in out and "--seq-len" in out and "--eps-sweep" in out
    assert main(["prepare-text", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--train-tokenizer" in out and "-c NAME|FILE" in out


def test_a_bad_option_is_one_error_line(tmp_path, capsys):
    assert main(["compress", "--checkpoint", str(tmp_path), "--qk-rank", "4", "--out", str(tmp_path / "o"),
                 "--fusion", "diag"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("whiteformer compress: error: fusion must be one of"), err
    assert not (tmp_path / "o").exists()
