"""A language model trained on text carries its tokenizer in final/ (transformers' files): a
byte-level BPE trained by the run (``data_args.train_tokenizer``, documents packed or not) or the
character vocabulary.
``whiteformer generate`` and ``evaluate`` use it, and a fresh process that imports only transformers
loads the folder with AutoTokenizer, AutoModelForCausalLM and pipeline("text-generation")."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from whiteformer.app.cli import main
from whiteformer.app.data import text as text_data
from whiteformer.app.data.tokenizer import load_tokenizer
from whiteformer.app.evaluate import evaluate, generate
from whiteformer.app.train import ConfigError, EvalConfig, GenerateConfig, TrainConfig, train
from whiteformer.models import from_pretrained

pytest.importorskip("tokenizers", reason="needs the data extra: pip install whiteformer[data]")

SRC = str(Path(__file__).resolve().parents[3] / "src")
LM_ARGS = {"dim": 16, "depth": 1, "num_heads": 2}
#: the data options of each run (a run's name -> data_args); "packed": documents packed with cu_seqlens,
#: trained by ``whiteformer train ... data_args.train_tokenizer=300 data_args.pack=true``
RUNS = {"bpe": {"train_tokenizer": 300}, "char": {}, "packed": {"train_tokenizer": 300, "pack": True}}
PROMPT = "KING LEAR"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("lm_tokenizer")
    # the shipped corpus's scenes as documents, each ended by the end-of-document token
    corpus = root / "scenes.txt"
    text = text_data.read_text(text_data.default_corpus_path())[:60_000]
    corpus.write_text("".join(scene + "<|endoftext|>" for scene in text.split("\n\n\n")))
    try:
        for name, data_args in RUNS.items():
            if name == "packed":  # through the command line, as a user types it
                options = [f"data_args.{k}={str(v).lower()}" for k, v in data_args.items()]
                options += [f"model_args.{k}={v}" for k, v in LM_ARGS.items()]
                assert main(["train", "--model", "tost_lm_base", "--dataset", "text", "--data-dir", str(corpus),
                             *options, "--steps", "2", "--batch-size", "4", "--block-size", "16",
                             "--eval-batches", "1", "--out", str(root / name), "--no-progress",
                             "--no-tensorboard", "--no-report"]) == 0
                continue
            train(TrainConfig(model="tost_lm_base", model_args=dict(LM_ARGS), dataset="text", data_dir=str(corpus),
                              data_args=data_args, steps=2, batch_size=4, block_size=16, eval_batches=1,
                              out=str(root / name), progress=False, tensorboard=False, report=False))
    finally:
        torch.set_num_threads(n)
    return {name: root / name for name in RUNS}


def test_final_holds_the_tokenizer_files(runs):
    bpe, char = runs["bpe"] / "final", runs["char"] / "final"
    for final in (bpe, char):
        assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in final.iterdir()}
    assert json.loads((bpe / "config.json").read_text())["init_kwargs"]["vocab_size"] == 300
    assert json.loads((bpe / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    assert json.loads((bpe / "generation_config.json").read_text())["eos_token_id"] == 0
    assert not (bpe / "vocab.json").exists() and (char / "vocab.json").is_file()
    assert not (char / "generation_config.json").exists()  # no end-of-document token in a character vocabulary
    packed = json.loads((runs["packed"] / "final" / "train_config.json").read_text())
    assert packed["data_args"] == RUNS["packed"] and packed["unlimited_length"] is True  # the command's options
    ckpt = sorted((runs["bpe"] / "checkpoints").iterdir())[-1]
    assert (ckpt / "tokenizer.json").read_text() == (bpe / "tokenizer.json").read_text()


def test_generate_and_evaluate_use_the_saved_tokenizer(runs, monkeypatch):
    run = runs["bpe"]
    out = generate(GenerateConfig(checkpoint=str(run), prompt=PROMPT + " caf\u00e9", max_new_tokens=12,
                                  num_samples=2))
    assert len(out) == 2 and all(s.startswith(PROMPT + " caf\u00e9") for s in out)  # byte-level: any text
    assert out == generate(GenerateConfig(checkpoint=str(run), prompt=PROMPT + " caf\u00e9", max_new_tokens=12,
                                          num_samples=2))
    if importlib.util.find_spec("transformers") is not None:  # final/ serves as data_args.tokenizer of a new run
        tok = load_tokenizer(run / "final")  # (its config.json's remote code is not run)
        assert tok.eod_token == "<|endoftext|>" and tok.vocab_size == 300
    saved = json.loads((run / "final" / "train_config.json").read_text())
    monkeypatch.setattr(text_data, "train_bpe", None)  # evaluate trains nothing: it reads final/tokenizer.json
    monkeypatch.setattr(text_data, "_TRAINED", {})
    ev = evaluate(EvalConfig(checkpoint=str(run), eval_batches=1, batch_size=4))
    assert saved["data_args"] == RUNS["bpe"] and ev["n"] == 4 * 16 and ev["loss"] > 0


def _eos_from(model, eos, step):
    """From generation call ``step`` on (0: the prompt's logits), every sequence's mass is on ``eos``
    (a hook on lm_head): a model that ends its documents."""
    calls = [0]

    def hook(module, args, logits):
        if calls[0] >= step:
            logits = logits.clone()
            logits[..., eos] = 1e4
        calls[0] += 1
        return logits

    model.lm_head.register_forward_hook(hook)
    return model


def test_a_run_records_its_end_of_document_id_in_the_model(runs):
    for name in RUNS:
        init = json.loads((runs[name] / "final" / "config.json").read_text())["init_kwargs"]
        eod = load_tokenizer(runs[name] / "final").eod_id if name != "char" else None
        assert init["eos_token_id"] == eod and (eod is None) == (name == "char"), name
        assert from_pretrained(runs[name] / "final").eos_token_id == eod


def test_generate_stops_at_the_end_of_document_token(runs, tmp_path, capsys, monkeypatch):
    """`whiteformer generate` of a packed-trained LM ran past <|endoftext|> (long runs of it mixed
    with fragments): a sample now ends at the model's end-of-document token, --ignore-eos goes on."""
    import whiteformer.app.evaluate as ev

    eod = from_pretrained(runs["packed"] / "final").eos_token_id
    real = ev.load_model
    monkeypatch.setattr(ev, "load_model", lambda *a, **k: _eos_from(real(*a, **k), eod, 3))
    argv = ["generate", "--checkpoint", str(runs["packed"]), "--prompt", PROMPT, "--max-new-tokens", "40",
            "--num-samples", "2"]
    assert main(argv) == 0
    stopped = capsys.readouterr().out
    assert main([*argv, "--ignore-eos"]) == 0
    full = capsys.readouterr().out
    assert "<|endoftext|>" not in stopped and stopped.count(PROMPT) == 2, stopped
    assert full.count("<|endoftext|>") >= 2 * 37, full
    # a model saved before it recorded its end-of-document id: the run's tokenizer says where a sample ends
    final = shutil.copytree(runs["packed"] / "final", tmp_path / "final")
    config = json.loads((final / "config.json").read_text())
    del config["init_kwargs"]["eos_token_id"]
    (final / "config.json").write_text(json.dumps(config))
    assert main([*argv[:2], str(final), *argv[3:]]) == 0
    assert capsys.readouterr().out == stopped
    assert main(["generate", "--help"]) == 0
    assert "tokens to generate at most" in capsys.readouterr().out


def test_the_run_reports_sample_stops_at_the_end_of_document_token(runs, tmp_path):
    from whiteformer.app.train.build import build_task
    from whiteformer.app.train.tasks.base import ReportContext

    saved = json.loads((runs["packed"] / "final" / "train_config.json").read_text())
    task = build_task("text", data_dir=saved["data_dir"], data_args=saved["data_args"], block_size=16, batch_size=4)
    samples = []
    for eos in ("the model's", None):
        model = from_pretrained(runs["packed"] / "final").eval()
        eod = model.eos_token_id
        if eos is None:
            model.eos_token_id = None  # a model that does not know its end-of-document token
        results = {}
        task.report_sections(_eos_from(model, eod, 3), ReportContext(tmp_path, None, None, None, results, {}, [], 2))
        samples.append(results["sample"])
    assert "<|endoftext|>" not in samples[0] and samples[1].count("<|endoftext|>") > 100, samples


@pytest.mark.parametrize("bad", ["{}", "not json", "char"])
def test_generate_refuses_a_tokenizer_json_that_is_not_the_models(runs, tmp_path, capsys, bad):
    final = shutil.copytree(runs["bpe"] / "final", tmp_path / "final")
    text = (runs["char"] / "final" / "tokenizer.json").read_text() if bad == "char" else bad
    (final / "tokenizer.json").write_text(text)
    assert main(["generate", "--checkpoint", str(final), "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tokenizer.json" in err, err
    if bad == "char":
        assert "fewer than the model's vocabulary of 300" in err


def test_resume_refuses_a_text_file_whose_tokenizer_changed(tmp_path):
    text = text_data.read_text(text_data.default_corpus_path())
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text[:20_000])
    cfg = dict(model="tost_lm_base", model_args=dict(LM_ARGS), dataset="text", data_dir=str(corpus),
               data_args={"train_tokenizer": 300}, steps=1, batch_size=4, block_size=16, eval_batches=1,
               out=str(tmp_path / "run"), progress=False, tensorboard=False, report=False)
    train(TrainConfig(**cfg))
    assert train(TrainConfig(**{**cfg, "steps": 2, "resume": True}))["final_eval"]["n"] == 64  # the same text
    corpus.write_text(text[20_000:40_000])  # another text: another BPE, other ids for the same tokens
    with pytest.raises(ConfigError, match="the data's tokenizer is not the one checkpoint .* saved"):
        train(TrainConfig(**{**cfg, "steps": 3, "resume": True}))


# The script run in a fresh process: imports transformers only (the folder's remote code imports whiteformer).
PIPELINE_SCRIPT = r"""
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
out = {}
for final in sys.argv[1:]:
    tok = AutoTokenizer.from_pretrained(final, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(final, trust_remote_code=True).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    greedy = model.generate(ids, max_new_tokens=8, do_sample=False)
    pipe = pipeline("text-generation", model=final, trust_remote_code=True)
    text = pipe(PROMPT, max_new_tokens=8, do_sample=False)[0]["generated_text"]
    out[final] = dict(prompt_ids=ids[0].tolist(), greedy=greedy[0].tolist(), text=text, eos=tok.eos_token_id,
                      decoded=tok.decode(greedy[0], skip_special_tokens=True))
print("RESULT " + json.dumps(out))
"""


def test_transformers_pipeline_generates_from_final_without_importing_whiteformer(runs, tmp_path):
    pytest.importorskip("transformers", reason="needs the hf extra: pip install whiteformer[hf]")
    finals = [str(runs[name] / "final") for name in RUNS]
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    script = PIPELINE_SCRIPT.replace("PROMPT", repr(PROMPT))
    res = subprocess.run([sys.executable, "-c", script, *finals], capture_output=True, text=True, env=env,
                         stdin=subprocess.DEVNULL, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(next(line for line in res.stdout.splitlines() if line.startswith("RESULT "))[7:])
    for final in finals:
        r = got[final]
        model = from_pretrained(final).eval()
        prompt = torch.tensor([r["prompt_ids"]])
        with torch.no_grad():
            want = model.generate(prompt, 8, top_k=1)[0].tolist()  # whiteformer's own greedy decoding
        n = len(r["greedy"])
        assert r["greedy"] == want[:n] and n > len(r["prompt_ids"])  # (transformers stops at the eos token)
        assert r["text"].startswith(PROMPT) and r["text"] == r["decoded"] and len(r["text"]) > len(PROMPT)
    bpe, char = got[str(runs["bpe"] / "final")], got[str(runs["char"] / "final")]
    assert bpe["eos"] == 0 and char["eos"] is None
    chars = text_data.CharVocab.from_json(json.loads((runs["char"] / "final" / "vocab.json").read_text()))
    assert char["prompt_ids"] == chars.encode(PROMPT).tolist()
