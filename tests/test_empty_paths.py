"""Every door that takes a path refuses an empty one (an unset shell variable, a missing setting):
``Path("")`` is the working directory, which a save would replace and a reader take in whole."""
import os

import pytest
import torch

from whiteformer.app.cli import main

#: every command line option or argument that names a file or folder, given empty
COMMANDS = [
    ["train", "--out", "", "--dataset", "subspaces", "--steps", "1"],
    ["train", "--data-dir", "", "--dataset", "text", "--steps", "1"],
    ["train", "--finetune", "", "--steps", "1"],
    ["train", "-c", "", "--steps", "1"],
    ["eval", "--checkpoint", ""],
    ["eval", "--checkpoint", "run", "--data-dir", ""],
    ["generate", "--checkpoint", ""],
    ["analyze", "layerwise", "--checkpoint", ""],
    ["analyze", "eca-toy", "--small", "--out", ""],
    ["prepare-text", "", "--out", "out", "--train-tokenizer", "300"],
    ["prepare-text", "a.txt", "--out", "", "--train-tokenizer", "300"],
    ["prepare-text", "a.txt", "--out", "out", "--tokenizer", ""],
    ["compress", "--checkpoint", "", "--out", "out"],
    ["compress", "--checkpoint", "run", "--out", ""],
    ["compress", "--checkpoint", "run", "--out", "out", "--data-dir", ""],
]


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A working directory holding a text file and a folder of the user's (what an empty path would reach)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("the user's text\n" * 50)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "b.txt").write_text("more text\n" * 50)
    return tmp_path


def _listing(root):
    return sorted((str(p.relative_to(root)), p.stat().st_mtime_ns) for p in root.rglob("*"))


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(repr(w) if not w else w for w in a))
def test_an_empty_path_on_the_command_line_is_one_error_line(here, capsys, argv):
    before = _listing(here)
    rc = main(list(argv))
    err = capsys.readouterr().err
    assert rc == 2 and "empty path" in err and len(err.strip().splitlines()) == 1, err
    assert _listing(here) == before


def _tiny_lm():
    from whiteformer import create_model

    return create_model("tost_lm_base", vocab_size=16, dim=16, depth=1, num_heads=2, max_len=8)


def test_an_empty_path_in_the_python_api_is_a_value_error_naming_it(here):
    import whiteformer
    from whiteformer.analysis import cls_attention_maps, layerwise_report, membership_maps
    from whiteformer.analysis.hidden_states import load_for_analysis
    from whiteformer.app.prepare_text import prepare_text
    from whiteformer.app.train.checkpoint import save_checkpoint, verify_checkpoint
    from whiteformer.models.load import load_checkpoint

    model = _tiny_lm()
    model.save_pretrained(here / "saved")
    before = _listing(here)
    calls = [("save_dir", lambda: model.save_pretrained("")),
             ("path", lambda: whiteformer.from_pretrained("")),
             ("checkpoint_path", lambda: whiteformer.create_model("tost_lm_base", checkpoint_path="")),
             ("path", lambda: load_checkpoint(model, "")),
             ("root", lambda: save_checkpoint("", 1, model, {})),
             ("path", lambda: verify_checkpoint("")),
             ("inputs", lambda: prepare_text([""], "out", train_tokenizer=300)),
             ("--out", lambda: prepare_text(["a.txt"], "", train_tokenizer=300)),
             ("out_dir", lambda: layerwise_report(model, torch.randint(0, 16, (1, 4)), out_dir="", plot=False)),
             ("out_path", lambda: membership_maps(model, torch.zeros(1, 3, 8, 8), "")),
             ("out_path", lambda: cls_attention_maps(model, torch.zeros(1, 3, 8, 8), "")),
             ("path", lambda: load_for_analysis(""))]
    for name, call in calls:
        with pytest.raises(ValueError, match=f"^{name}: an empty path"):
            call()
    assert _listing(here) == before
    with pytest.raises(TypeError, match="save_dir must be a path"):
        model.save_pretrained(None)


def test_transformers_save_pretrained_refuses_an_empty_path(here):
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    import whiteformer.hf  # noqa: F401

    config = AutoConfig.for_model("whiteformer-tost-lm", model_name="tost_lm_base",
                                  init_kwargs=dict(vocab_size=16, dim=16, depth=1, num_heads=2, max_len=8))
    model = AutoModelForCausalLM.from_config(config)
    before = _listing(here)
    with pytest.raises(ValueError, match="^save_directory: an empty path"):
        model.save_pretrained("")
    with pytest.raises(ValueError, match="^pretrained_model_name_or_path: an empty path"):
        type(model).from_pretrained("")
    assert _listing(here) == before and os.getcwd() == str(here)
