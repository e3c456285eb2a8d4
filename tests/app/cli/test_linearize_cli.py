"""``whiteformer linearize``: a transformers Llama folder + token files -> a causal TSSA model folder."""
import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import whiteformer
from test_cli_errors import _one_error_line
from whiteformer.app import linearize_cli
from whiteformer.app.cli import main
from whiteformer.convert import linearize

transformers = pytest.importorskip("transformers")

VOCAB = 24
STEPS = ["--transfer-steps", "4", "--finetune-steps", "3", "--batch-size", "4", "--block-size", "16", "--no-progress"]


def _tokens_dir(d, vocab=VOCAB):
    """train.bin / val.bin of repeated motifs, meta.json with ``vocab``."""
    d.mkdir()
    rng = np.random.default_rng(0)
    for name, n in (("train.bin", 60), ("val.bin", 15)):
        rows = [np.tile(rng.integers(0, VOCAB, rng.integers(3, 6)), 8)[:20] for _ in range(n)]
        np.concatenate(rows).astype(np.uint16).tofile(d / name)
    (d / "meta.json").write_text(json.dumps({"vocab_size": vocab, "dtype": "uint16"}))
    return d


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lin")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, eos_token_id=1, bos_token_id=0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "teacher")
    (root / "teacher" / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    return root / "teacher", _tokens_dir(root / "data")


def _argv(teacher, data, out, *extra):
    return ["linearize", "--teacher", str(teacher), "--dataset", "tokens", "--data-dir", str(data), "--out", str(out),
            *STEPS, *extra]


@pytest.fixture(scope="module")
def written(folders, tmp_path_factory):
    teacher_dir, data = folders
    out = tmp_path_factory.mktemp("out") / "student"
    assert main(_argv(teacher_dir, data, out, "--keep-softmax", "1")) == 0
    return out


def test_writes_a_model_that_generates_as_the_in_process_student(folders, written):
    teacher_dir, data = folders
    out = written
    model = whiteformer.from_pretrained(out).eval()
    assert model.attention == "tssa" and model.keep_softmax == [1]
    for name in ("generation_config.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (teacher_dir / name).read_bytes()
    report = json.loads((out / "linearize.json").read_text())
    assert report["tssa_layers"] == [0] and len(report["transfer_after"]) == 1

    # the same run in process
    args = argparse.Namespace(data_dir=str(data), dataset="tokens", tokenizer=None, teacher=str(teacher_dir),
                              pack=False)
    teacher = linearize_cli._load_teacher(teacher_dir)
    train, val = linearize_cli._dataset(args, "train"), linearize_cli._dataset(args, "val")
    held = next(linearize_cli._windows(val, 4, 16, 1))
    student, _ = linearize(teacher, linearize_cli._windows(train, 4, 16, 0), keep_softmax=[1], transfer_steps=4,
                           finetune_steps=3, eval_batch=held, progress=False)
    prompt = torch.tensor([[3, 4, 5, 3, 4]])
    want = student.generate(prompt, max_new_tokens=8, temperature=0)
    assert torch.equal(model.generate(prompt, max_new_tokens=8, temperature=0), want)


def greedy_in_transformers(folder, prompt, new_tokens: int, tmp_path) -> str:
    """The greedy tokens (as printed) of ``folder`` loaded by ``AutoModelForCausalLM(trust_remote_code=True)``
    in a fresh process whose script imports only transformers."""
    code = ("import torch\nfrom transformers import AutoModelForCausalLM\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()\n"
            f"out = m.generate(torch.tensor({prompt}), max_new_tokens={new_tokens}, min_new_tokens={new_tokens}, "
            "do_sample=False, pad_token_id=0)\nprint(out.tolist())")
    src = str(Path(whiteformer.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": src, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"),
           "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip().splitlines()[-1]


def test_the_folder_loads_in_a_process_that_imports_only_transformers(written, tmp_path):
    model = whiteformer.from_pretrained(written).eval()
    prompt = [[3, 4, 5, 3, 4, 5, 3]]
    ref = model.generate(torch.tensor(prompt), max_new_tokens=5, temperature=0)
    assert greedy_in_transformers(written, prompt, 5, tmp_path) == str(ref.tolist())


def test_an_interrupted_run_resumes_to_the_same_model(folders, written, tmp_path, monkeypatch, capsys):
    teacher_dir, data = folders
    out = tmp_path / "student"
    argv = _argv(teacher_dir, data, out, "--keep-softmax", "1", "--checkpoint-every", "1")
    windows = linearize_cli._windows

    def interrupted(ds, *a, **kw):  # Ctrl-C while the 6th training batch is read
        for k, b in enumerate(windows(ds, *a, **kw)):
            if k == 5 and ds.name.endswith("train"):
                raise KeyboardInterrupt
            yield b

    monkeypatch.setattr(linearize_cli, "_windows", interrupted)
    assert main(argv) == 130
    state = linearize_cli.state_path(out)
    assert state.is_file() and not out.exists()
    monkeypatch.setattr(linearize_cli, "_windows", windows)
    capsys.readouterr()
    assert main(argv) == 2  # the state is not silently thrown away
    _one_error_line(capsys, "--resume")
    assert main([*argv, "--resume"]) == 0
    assert not state.exists()
    got, want = whiteformer.from_pretrained(out).state_dict(), whiteformer.from_pretrained(written).state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6, msg=k)
    capsys.readouterr()
    assert main([*argv, "--resume", "--overwrite"]) == 2
    _one_error_line(capsys, "--resume", "no interrupted run")


def test_out_is_refused_unless_overwrite(folders, tmp_path, capsys):
    teacher_dir, data = folders
    out = tmp_path / "student"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    assert main(_argv(teacher_dir, data, out)) == 2
    _one_error_line(capsys, "--overwrite")
    assert (out / "mine.txt").read_text() == "keep me"
    assert main(_argv(teacher_dir, data, out, "--overwrite", "--transfer-steps", "0", "--finetune-steps", "0")) == 0
    assert whiteformer.from_pretrained(out).attention == "tssa" and not (out / "mine.txt").exists()


def _unsupported(teacher):
    cfg = json.loads((teacher / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3"}))


@pytest.mark.parametrize("spoil, needle", [
    (_unsupported, "qwen3"),
    (lambda t: (t / "model.safetensors").unlink(), "teacher"),
    (lambda t: (t / "config.json").unlink(), "config.json"),
    ("vocab", "vocabulary"),
])
def test_bad_input_is_one_error_line_and_writes_nothing(folders, tmp_path, capsys, spoil, needle):
    teacher_dir, data = folders
    teacher = shutil.copytree(teacher_dir, tmp_path / "teacher")
    if spoil == "vocab":
        data = _tokens_dir(tmp_path / "data", vocab=VOCAB + 10)
    else:
        spoil(teacher)
    out = tmp_path / "student"
    assert main(_argv(teacher, data, out)) == 2
    _one_error_line(capsys, needle)
    assert not out.exists()


def test_bad_options_are_one_error_line(folders, tmp_path, capsys):
    teacher_dir, data = folders
    for extra, needle in ((["--transfer-steps", "-1"], "--transfer-steps"), (["--keep-softmax", "a"], "--keep-softmax"),
                          (["--keep-softmax", "5"], "keep_softmax"), (["--lora-rank", "0"], "--lora-rank")):
        assert main(_argv(teacher_dir, data, tmp_path / "student", *extra)) == 2
        _one_error_line(capsys, needle)
        assert not (tmp_path / "student").exists()


def test_text_data_with_the_teachers_tokenizer_packed(tmp_path):
    from whiteformer.app.data.tokenizer import train_bpe

    docs = ["the cat sat on the mat. " * 3, "a dog ran in the park. " * 3, "we go to the sea. " * 3] * 6
    text = "<|endoftext|>".join(docs)
    tok = train_bpe(text, 270)
    teacher = tmp_path / "teacher"
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(teacher)
    for name, body in tok.files().items():
        (teacher / name).write_text(body)
    (tmp_path / "corpus.txt").write_text(text)
    out = tmp_path / "student"
    argv = ["linearize", "--teacher", str(teacher), "--dataset", "text", "--data-dir", str(tmp_path / "corpus.txt"),
            "--out", str(out), "--pack", *STEPS]
    assert main(argv) == 0
    assert json.loads((out / "linearize.json").read_text())["pack"] is True
    assert (out / "tokenizer.json").read_bytes() == (teacher / "tokenizer.json").read_bytes()
    assert whiteformer.from_pretrained(out).attention == "tssa"
    args = argparse.Namespace(data_dir=str(tmp_path / "corpus.txt"), dataset="text", tokenizer=None,
                              teacher=str(teacher), pack=True)
    batch = next(linearize_cli._windows(linearize_cli._dataset(args, "train"), 4, 16, 0, pack=True))
    assert batch["idx"].shape == (1, 64) and len(batch["cu_seqlens"]) > 5  # documents split inside the windows


@pytest.mark.parametrize("option", ["--teacher", "--data-dir", "--out", "--tokenizer"])
def test_an_empty_path_is_one_error_line(folders, tmp_path, capsys, monkeypatch, option):
    teacher_dir, data = folders
    monkeypatch.chdir(tmp_path)
    argv = _argv(teacher_dir, data, tmp_path / "student", "--tokenizer", str(teacher_dir))
    argv[argv.index(option) + 1] = ""
    assert main(argv) == 2
    _one_error_line(capsys, "empty path")
    assert list(tmp_path.iterdir()) == []


def test_a_whiteformer_teacher_folder(folders, tmp_path, capsys):
    _, data = folders
    kw = dict(vocab_size=VOCAB, dim=32, depth=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    whiteformer.create_model("decoder_base", **kw).save_pretrained(tmp_path / "decoder")
    assert main(_argv(tmp_path / "decoder", data, tmp_path / "student", "--finetune-steps", "0")) == 0
    assert whiteformer.from_pretrained(tmp_path / "student").attention == "tssa"
    whiteformer.create_model("tost_decoder_base", **kw).save_pretrained(tmp_path / "tssa")
    assert main(_argv(tmp_path / "tssa", data, tmp_path / "student2")) == 2
    _one_error_line(capsys, "softmax")
    assert not (tmp_path / "student2").exists()
