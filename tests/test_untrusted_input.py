"""Bounded work on untrusted files: a checkpoint's manifest names only files of its own directory,
each once; nested JSON / YAML is refused past a depth in one line (config.json, safetensors metadata,
manifest.json, RUN/config.yaml, -c FILE, data_args=[[...]]); a vocab.json that is not the model's is
one error line; a model config is refused before allocating when it cannot fit in the memory free;
generate refuses a temperature that overflows and an output that cannot fit, naming the argument."""
import json
import shutil

import pytest
import torch

from test_faults_runs import SUBSPACES, one_error_line, tiny_cfg
from test_no_data_loss import finished  # noqa: F401  (fixture: a finished 2-step run)
from test_train import _one_thread  # noqa: F401  (autouse: one thread for the tiny models)
from whiteformer.app.cli import main
from whiteformer.app.train import train
from whiteformer.app.train.checkpoint import CheckpointError, list_checkpoints, verify_checkpoint
from whiteformer.models import create_model, from_pretrained

DEEP = 100_000  # far past the interpreter's recursion limit


def error_line(capsys, rc, *words):
    line = one_error_line(capsys, rc)
    assert all(w in line for w in words), line


@pytest.fixture(scope="module")
def run(finished):
    return finished


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("untrusted_lm") / "run"
    train(tiny_cfg(out, model="tost_lm_base", model_args={"dim": 16, "depth": 1, "num_heads": 2}, dataset="text",
                   data_args={}, steps=1, batch_size=4, block_size=16, eval_batches=1))
    return out


def _checkpoint(run, tmp_path):
    ck = shutil.copytree(list_checkpoints(run / "checkpoints")[-1], tmp_path / "step_00000002")
    return ck, json.loads((ck / "manifest.json").read_text())


# ----------------------------------------------------------------------------- manifests
@pytest.mark.parametrize("case", ["alias", "absolute", "parent", "too_many", "list", "no_size"])
def test_a_manifest_names_only_its_own_files_each_once(run, tmp_path, case):
    """300k aliases of one file ('./x', './/x', ...) took 50 s to hash in eval and train --resume, and
    an absolute path made verify_checkpoint hash a system file; a 'files' list was a traceback."""
    ck, manifest = _checkpoint(run, tmp_path)
    files = manifest["files"]
    name, meta = "model.safetensors", files["model.safetensors"]
    if case == "alias":
        files.update({"./" + "/" * i + name: meta for i in range(50)})
    elif case == "absolute":
        files[str(ck / name)] = meta
    elif case == "parent":
        files[f"../{ck.name}/{name}"] = meta
    elif case == "too_many":
        files.update({f"x{i}": meta for i in range(20)})
    elif case == "list":
        manifest["files"] = list(files)
    else:
        files[name] = {"sha256": meta["sha256"]}
    (ck / "manifest.json").write_text(json.dumps(manifest))
    hashed = []
    import whiteformer.app.train.checkpoint as c

    real = c._sha256
    c._sha256 = lambda p: (hashed.append(p), real(p))[1]
    try:
        with pytest.raises(CheckpointError, match="manifest|more than"):
            verify_checkpoint(ck)
    finally:
        c._sha256 = real
    assert not hashed  # refused before hashing anything


# ----------------------------------------------------------------------------- nesting
def _deep(n=DEEP):
    return "[" * n + "]" * n


@pytest.mark.parametrize("where", ["config.json", "metadata", "manifest.json"])
def test_deeply_nested_json_in_a_checkpoint_is_one_error_line(run, tmp_path, capsys, where):
    """A RecursionError traceback."""
    ck, manifest = _checkpoint(run, tmp_path)
    if where == "config.json":
        (ck / "config.json").write_text('{"init_kwargs": {}, "x": ' + _deep() + "}")
        (ck / "manifest.json").unlink()  # (a plain model folder, read without a manifest)
    elif where == "manifest.json":
        (ck / "manifest.json").write_text('{"files": ' + _deep() + "}")
    else:
        from safetensors.torch import load_file, save_file

        save_file(load_file(ck / "model.safetensors"), ck / "model.safetensors",
                  metadata={"format": "pt", "whiteformer_aliases": _deep()})
        (ck / "manifest.json").unlink()  # (a plain model folder, read without a manifest)
    error_line(capsys, main(["eval", "--checkpoint", str(ck)]), "levels deep")


def test_deeply_nested_yaml_is_one_error_line(run, tmp_path, capsys):
    """-c FILE, RUN/config.yaml and data_args=[[...]]: RecursionError tracebacks."""
    deep = tmp_path / "deep.yaml"
    deep.write_text("data_args: {x: " + _deep() + "}\n")
    error_line(capsys, main(["train", *SUBSPACES, "--steps", "1", "-c", str(deep), "--out", str(tmp_path / "a")]),
               "levels deep")
    error_line(capsys, main(["train", *SUBSPACES, "--steps", "1", "data_args=" + _deep(),
                             "--out", str(tmp_path / "b")]), "levels deep")
    mine = shutil.copytree(run, tmp_path / "run")
    (mine / "config.yaml").write_text("model_args: " + _deep() + "\n")
    error_line(capsys, main(["train", "--out", str(mine), "--resume", "--steps", "3"]), "levels deep")
    error_line(capsys, main(["compress", "--checkpoint", str(run), "--qk", "truncatt", "--qk-rank", "2",
                             "model_args.x=" + "[" * 200 + "]" * 200, "--out", str(tmp_path / "c")]), "levels deep")


# ----------------------------------------------------------------------------- vocab.json
@pytest.mark.parametrize("vocab", [[], 3, None, {"type": "char"}, {"type": "char", "chars": 5},
                                   {"type": "bpe", "chars": "ab"}, {"chars": "ab"}, {"type": "char", "chars": ["a"]},
                                   {"type": "char", "chars": "aab"}, {"type": "char", "chars": "\nab"}])
def test_a_malformed_vocab_json_is_one_error_line(lm_run, tmp_path, capsys, vocab):
    """Nine malformed shapes and duplicate characters were tracebacks; a vocabulary with fewer
    characters than the model's gave IndexError while decoding."""
    final = shutil.copytree(lm_run / "final", tmp_path / "final")
    (final / "vocab.json").write_text(json.dumps(vocab))
    error_line(capsys, main(["generate", "--checkpoint", str(final), "--max-new-tokens", "50", "--temperature", "5"]),
               "vocab")


# ----------------------------------------------------------------------------- generate
def test_generate_refuses_a_temperature_that_overflows(lm_run, capsys):
    """--temperature 1e-45 passed the check, then failed inside multinomial (CLI and Python API)."""
    error_line(capsys, main(["generate", "--checkpoint", str(lm_run), "--temperature", "1e-45"]), "temperature")
    model = create_model("tost_lm_base", vocab_size=16, dim=16, depth=1, num_heads=2, max_len=8)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), 2, temperature=1e-45)


def test_generate_refuses_an_output_that_cannot_fit_naming_max_new_tokens(lm_run, capsys):
    """model.generate(max_new_tokens=10**13) gave the allocator's raw error."""
    model = create_model("tost_lm_base", vocab_size=16, dim=16, depth=1, num_heads=2, max_len=8)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), 10**13)
    error_line(capsys, main(["generate", "--checkpoint", str(lm_run), "--max-new-tokens", str(10**13)]),
               "max_new_tokens")


# ----------------------------------------------------------------------------- memory
def test_a_config_json_asking_for_more_memory_than_is_free_is_refused_before_building(tmp_path, monkeypatch):
    """mlp_ratio=1e6 allocated for 19 s before failing: the bound was the machine's physical memory."""
    import whiteformer.models.factory as factory

    model = create_model("tost_t12_p16", img_size=16, patch_size=8, depth=1, embed_dim=32, num_heads=4,
                         num_classes=3)
    model.save_pretrained(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["init_kwargs"]["mlp_ratio"] = 1e5  # about 0.8 GB of parameters, within the size bounds
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(factory, "free_memory_bytes", lambda: 2**30, raising=False)
    with pytest.raises(ValueError, match="free"):
        from_pretrained(tmp_path / "m")
