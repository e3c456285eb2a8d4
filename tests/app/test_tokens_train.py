"""``whiteformer train --dataset tokens``: a tiny run on train.bin / val.bin, the data-parallel and
context-parallel split of its windows, and the one-line errors of bad token files."""
import json

import numpy as np
import pytest
import torch

from test_train import _one_thread  # noqa: F401  (autouse: one thread for the tiny models)
from whiteformer.app.cli import main
from whiteformer.app.data import build_dataset
from whiteformer.app.train.build import make_task
from whiteformer.app.train.distributed import DistInfo

LM = ["--model", "tost_lm_base", "model_args={dim: 32, depth: 1, num_heads: 2}", "--dataset", "tokens", "--steps", "3",
      "--batch-size", "4", "--block-size", "16", "--eval-batches", "1", "--no-report", "--no-progress",
      "--no-tensorboard", "--num-threads", "1"]


def _token_dir(d, vocab=97, n_train=4000, n_val=600, seed=0, meta=True):
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    rng.integers(0, vocab, n_train).astype(np.uint16).tofile(d / "train.bin")
    rng.integers(0, vocab, n_val).astype(np.uint16).tofile(d / "val.bin")
    if meta:
        (d / "meta.json").write_text(json.dumps({"vocab_size": vocab}))
    return d


def test_a_tiny_run_trains_and_evaluates_on_token_files(tmp_path, capsys):
    d = _token_dir(tmp_path / "data")
    out = tmp_path / "run"
    assert main(["train", *LM, "--data-dir", str(d), "--out", str(out)]) == 0
    cfg = json.loads((out / "final" / "config.json").read_text())["init_kwargs"]
    assert cfg["vocab_size"] == 97
    logs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in r for r in logs) and all(np.isfinite(r.get("eval_loss", 0.0)) for r in logs)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["dataset"] == "tokens" and res["n"] > 0 and np.isfinite(res["loss"])
    # data_args.vocab_size pads the vocabulary (nanoGPT's 50304 for GPT-2's 50257)
    padded = tmp_path / "padded"
    assert main(["train", *LM, "--data-dir", str(d), "data_args.vocab_size=128", "--out", str(padded)]) == 0
    assert json.loads((padded / "final" / "config.json").read_text())["init_kwargs"]["vocab_size"] == 128


@pytest.mark.parametrize("world, cp", [(2, 1), (4, 2), (2, 2)])
def test_each_process_reads_its_share_of_the_one_process_batch(tmp_path, world, cp):
    """Data-parallel groups take consecutive slices of the global batch's windows; the processes of a
    context-parallel group take consecutive chunks of every window: together, the one-process batch."""
    d = _token_dir(tmp_path / "data")
    ds, ev = build_dataset("tokens", "train", data_dir=str(d)), build_dataset("tokens", "val", data_dir=str(d))
    read = []
    get_windows = ds.get_windows
    ds.get_windows = lambda starts, n: read.append((len(starts), n)) or get_windows(starts, n)
    opts = dict(batch_size=8, block_size=16, seed=5)
    x1, y1 = make_task(ds, ev, DistInfo(), **opts).train_batch(7)
    assert read == [(8, 16)]
    parts = {r: make_task(ds, ev, DistInfo(rank=r, world_size=world, cp_size=cp), **opts).train_batch(7)
             for r in range(world)}
    for which, full in ((0, x1), (1, y1)):
        groups = [torch.cat([parts[g * cp + c][which] for c in range(cp)], dim=1) for g in range(world // cp)]
        assert torch.equal(torch.cat(groups, dim=0), full)
    assert not torch.equal(parts[0][0], parts[1][0])
    # each process read only its windows, and only its chunk of them: the file is read once in all
    assert read[1:] == [(8 // (world // cp), 16 // cp)] * world


def _error(capsys, argv):
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err


@pytest.mark.parametrize("setup, extra, match", [
    (lambda d: (d / "val.bin").unlink(), [], "val.bin' does not exist"),
    (lambda d: (d / "meta.json").unlink(), [], "vocabulary size is unknown"),
    (lambda d: (d / "train.bin").write_bytes(b"\x00" * 33), [], "33 bytes, not a whole number of uint16 tokens"),
    (lambda d: np.full(50, 200, np.uint16).tofile(d / "train.bin"), [], "has id 200, not below the vocabulary size 97"),
    (lambda d: np.arange(10, dtype=np.uint16).tofile(d / "val.bin"), [], "10 tokens, fewer than block_size + 1 = 17"),
    (lambda d: None, ["data_args.dtype=uint8"], "dtype must be one of"),
])
def test_bad_token_files_are_one_error_line(tmp_path, capsys, setup, extra, match):
    d = _token_dir(tmp_path / "data")
    setup(d)
    rc, err = _error(capsys, ["train", *LM, "--data-dir", str(d), *extra, "--out", str(tmp_path / "run")])
    assert rc == 2 and len(err) == 1 and err[0].startswith("whiteformer train: error: "), err
    assert match in err[0]
    assert not (tmp_path / "run" / "final").exists()


def test_a_bad_id_found_while_training_is_one_error_line(tmp_path, capsys, monkeypatch):
    """An id the door's sample missed stops the run at the batch that reads it, as one line."""
    import whiteformer.app.data.tokens as tokens

    monkeypatch.setattr(tokens, "SAMPLE_CHUNKS", 1)
    monkeypatch.setattr(tokens, "SAMPLE_TOKENS", 2)
    d = _token_dir(tmp_path / "data", n_train=40)
    ids = np.fromfile(d / "train.bin", dtype=np.uint16)
    ids[10:30] = 500  # between the two sampled ends: every window of 17 from 40 tokens meets it
    ids.tofile(d / "train.bin")
    rc, err = _error(capsys, ["train", *LM, "--data-dir", str(d), "--out", str(tmp_path / "run")])
    assert rc == 2 and len(err) == 1 and "has id 500, not below the vocabulary size 97" in err[0], err


def _all_eod_dir(d, eod=0, n=3000):
    """Token files holding nothing but the end-of-document token (documents all empty)."""
    d.mkdir(parents=True, exist_ok=True)
    np.full(n, eod, dtype=np.uint16).tofile(d / "train.bin")
    np.full(n // 4, eod, dtype=np.uint16).tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"vocab_size": 97, "eod_id": eod}))
    return d


@pytest.mark.parametrize("case", ["all_eod", "block_size_1"])
def test_packed_windows_with_no_target_are_an_error_and_nothing_is_saved(tmp_path, capsys, case):
    """A packed run on empty documents reported `eval loss 0.0000 (perplexity 1.000, 0 tokens)`,
    exited 0 and saved final/: no target at all is an error, never a perfect score."""
    if case == "all_eod":
        d, argv = _all_eod_dir(tmp_path / "data"), []
    else:  # a window of one token ends its document: it predicts nothing
        d, argv = _token_dir(tmp_path / "data"), ["--block-size", "1", "data_args.eod_id=5"]
    out = tmp_path / "run"
    rc = main(["train", *LM, "--data-dir", str(d), "data_args.pack=true", *argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "no token to predict" in err, err
    assert not out.exists()


def test_eval_of_packed_windows_with_no_target_is_an_error(tmp_path, capsys):
    d = _token_dir(tmp_path / "data")
    (d / "meta.json").write_text(json.dumps({"vocab_size": 97, "eod_id": 0}))
    out = tmp_path / "run"
    assert main(["train", *LM, "--data-dir", str(d), "data_args.pack=true", "--out", str(out)]) == 0
    capsys.readouterr()
    empty = _all_eod_dir(tmp_path / "empty")
    assert main(["eval", "--checkpoint", str(out), "--data-dir", str(empty)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no token to predict" in err and "perplexity" not in err, err
