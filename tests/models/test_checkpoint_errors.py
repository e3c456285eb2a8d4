"""Unreadable checkpoints and configs: the error names the file and says what is wrong, in one
line; weights of the wrong kind are refused, not cast."""
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from whiteformer.app.cli import main
from whiteformer.models import create_model, from_pretrained
from whiteformer.models.load import load_checkpoint
from whiteformer.models.read import CheckpointFileError

ARGS = dict(img_size=8, patch_size=4, in_chans=1, num_classes=10, depth=1, embed_dim=16, num_heads=2)
EVAL = ["--model", "deit_t_p16", "--dataset", "digits",
        "model_args={img_size: 8, patch_size: 4, in_chans: 1, num_classes: 10, depth: 1, embed_dim: 16, num_heads: 2}"]


def _model():
    return create_model("deit_t_p16", **ARGS)


@pytest.fixture
def saved(tmp_path):
    d = tmp_path / "m"
    _model().save_pretrained(d)
    return d


def _eval_error(capsys, path) -> str:
    assert main(["eval", "--checkpoint", str(path), *EVAL]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: " in err and "Traceback" not in err, err
    return err


def test_corrupt_safetensors_names_the_file(saved, capsys):
    weights = saved / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointFileError, match="truncated or corrupt") as info:
        from_pretrained(saved)
    assert isinstance(info.value, ValueError) and info.value.path == str(weights) and str(weights) in str(info.value)
    assert str(weights) in _eval_error(capsys, saved)


def test_unparsable_config_json_names_file_and_line(saved, capsys):
    cfg = saved / "config.json"
    cfg.write_text('{"model_name": "deit_t_p16",\n  oops\n}')
    with pytest.raises(CheckpointFileError, match="line 2, column 3") as info:
        from_pretrained(saved)
    assert str(cfg) in str(info.value)
    assert "line 2" in _eval_error(capsys, saved)


def test_random_bytes_pt_is_not_called_a_dangerous_pickle(tmp_path, capsys):
    path = tmp_path / "w.pt"
    for n in (1, 100, 1000, 4096):
        path.write_bytes(os.urandom(n))
        with pytest.raises(CheckpointFileError, match="is not a valid torch checkpoint"):
            load_checkpoint(_model(), path)
    err = _eval_error(capsys, path)
    assert "not a valid torch checkpoint" in err and "could run code" not in err and str(path) in err


def test_malicious_pickle_is_still_refused_as_such(tmp_path, capsys):
    class Evil:
        def __reduce__(self):
            return (os.getcwd, ())

    torch.save({"w": Evil()}, tmp_path / "evil.pt")
    import pickle

    with pytest.raises(pickle.UnpicklingError, match=r"refused to load .*evil.pt.* could run code .*GLOBAL"):
        load_checkpoint(_model(), tmp_path / "evil.pt")
    err = _eval_error(capsys, tmp_path / "evil.pt")
    assert "refused to load" in err and "evil.pt" in err and "Weights only load failed" not in err


def test_state_dict_mismatch_is_one_line(saved, capsys):
    sd = load_file(saved / "model.safetensors")
    sd["extra.weight"] = sd.pop("head.weight")
    save_file(sd, saved / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing keys \(1\): head.weight; unexpected keys \(1\): extra.weight") \
            as info:
        load_checkpoint(_model(), saved)
    assert "\n" not in str(info.value)
    _eval_error(capsys, saved)


def test_integer_weights_are_refused_naming_the_key(saved, capsys):
    sd = load_file(saved / "model.safetensors")
    sd["head.weight"] = (sd["head.weight"] * 100).long()
    save_file(sd, saved / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'head.weight' holds integer values \(torch.int64\)"):
        from_pretrained(saved)
    assert "'head.weight'" in _eval_error(capsys, saved)


@pytest.mark.parametrize("text,needle", [("{oops", "line 1, column 2"), ("[1, 2]", "must hold a JSON object")])
def test_unparsable_train_config_json_names_the_file(saved, capsys, text, needle):
    (saved / "train_config.json").write_text(text)
    err = _eval_error(capsys, saved)
    assert str(saved / "train_config.json") in err and needle in err
