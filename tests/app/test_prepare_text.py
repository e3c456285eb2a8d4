"""``whiteformer prepare-text``: text files -> train.bin / val.bin / tokenizer.json / meta.json that
``--dataset tokens`` trains from; documents, end-of-document tokens, the val split, the tokenizers it
takes, safe output and one-line errors."""
import json
import sys

import numpy as np
import pytest

from test_train import _one_thread  # noqa: F401  (autouse: one thread for the tiny models)
from whiteformer.app.cli import main

pytest.importorskip("tokenizers")
from tokenizers import Tokenizer  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly kings".split()


def _doc(seed, n=60):
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, n)) + ".\n"


def _corpus(tmp_path, n_files=5):
    src = tmp_path / "src"
    src.mkdir()
    docs = [_doc(i) for i in range(n_files)]
    for i, d in enumerate(docs):
        (src / f"doc{i}.txt").write_text(d)
    return src, docs


def _decode_docs(out, split):
    meta = json.loads((out / "meta.json").read_text())
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = np.fromfile(out / f"{split}.bin", dtype=meta["dtype"])
    assert ids[-1] == meta["eod_id"]  # every document ends with the end-of-document token
    cuts = np.flatnonzero(ids == meta["eod_id"])
    starts = np.r_[0, cuts[:-1] + 1]
    return [tok.decode(ids[a:b].tolist()) for a, b in zip(starts, cuts)]


def test_files_become_documents_split_by_fraction_and_train_a_model(tmp_path, capsys):
    src, docs = _corpus(tmp_path)
    out = tmp_path / "data"
    assert main(["prepare-text", str(src), "--train-tokenizer", "300", "--val-fraction", "0.3", "--out", str(out),
                 "--no-progress"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == 300 and meta["dtype"] == "uint16" and meta["eod_token"] == "<|endoftext|>"
    assert Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id("<|endoftext|>") == meta["eod_id"]
    # the last documents holding >= 30 % of the characters are val; both decode to their files, in order
    assert _decode_docs(out, "train") == docs[:3] and _decode_docs(out, "val") == docs[3:]
    assert (meta["train_documents"], meta["val_documents"]) == (3, 2)
    assert meta["train_tokens"] == (out / "train.bin").stat().st_size // 2
    assert "vocabulary 300 (uint16)" in capsys.readouterr().out

    run = tmp_path / "run"
    assert main(["train", "--model", "tost_lm_base", "model_args={dim: 32, depth: 1, num_heads: 2}", "--dataset",
                 "tokens", "--data-dir", str(out), "--steps", "2", "--batch-size", "4", "--block-size", "16",
                 "--eval-batches", "1", "--no-progress", "--no-tensorboard", "--num-threads", "1",
                 "--out", str(run)]) == 0
    assert json.loads((run / "final" / "config.json").read_text())["init_kwargs"]["vocab_size"] == 300
    assert "## Sample" in (run / "report.md").read_text(errors="replace")  # decoded by the directory's tokenizer
    # the directory's tokenizer is saved with the model: generate reads it
    saved = Tokenizer.from_file(str(run / "final" / "tokenizer.json"))
    assert saved.token_to_id("<|endoftext|>") == meta["eod_id"] and saved.get_vocab_size() == 300
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(run / "final"))
    assert hf.eos_token == "<|endoftext|>" and hf.decode(hf("the quick fox")["input_ids"]) == "the quick fox"
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(run), "--prompt", "the quick", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("the quick")


@pytest.mark.parametrize("piece_chars", [None, 7])
def test_blank_lines_separate_documents_and_one_document_is_cut(tmp_path, monkeypatch, piece_chars):
    """Also with documents read in pieces of a few characters (a file larger than memory)."""
    import whiteformer.app.prepare_text as prepare

    if piece_chars:
        monkeypatch.setattr(prepare, "PIECE_CHARS", piece_chars)
    text = "first para\nstill first\n\n\n  \nsecond para\n\nthird\n"
    (tmp_path / "a.txt").write_text(text)
    out = tmp_path / "data"
    assert main(["prepare-text", str(tmp_path / "a.txt"), "--documents", "blank-line", "--train-tokenizer", "260",
                 "--val-fraction", "0.2", "--out", str(out), "--no-progress"]) == 0
    assert _decode_docs(out, "train") + _decode_docs(out, "val") == ["first para\nstill first\n", "second para\n",
                                                                      "third\n"]
    # a single document: cut at the fraction of its characters, each side ending with the eod token
    one = tmp_path / "one"
    body = "".join(_doc(k, 20) for k in range(10))  # 10 lines
    (tmp_path / "b.txt").write_text(body)
    assert main(["prepare-text", str(tmp_path / "b.txt"), "--train-tokenizer", "280", "--out", str(one),
                 "--no-progress"]) == 0
    train, val = _decode_docs(one, "train"), _decode_docs(one, "val")
    assert len(train) == len(val) == 1 and train[0] + val[0] == body
    assert len(val[0]) == len(body) - round(len(body) * 0.9)


def test_a_given_tokenizer_file_or_folder_is_used_and_gets_an_eod_token(tmp_path, capsys):
    from tokenizers import decoders, models, pre_tokenizers

    src, docs = _corpus(tmp_path, 3)
    vocab = {w: i for i, w in enumerate(["[UNK]", *WORDS, ".", "\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.decoder = decoders.WordPiece()
    tok.save(str(tmp_path / "word.json"))
    out = tmp_path / "data"
    assert main(["prepare-text", str(src), "--tokenizer", str(tmp_path / "word.json"), "--out", str(out),
                 "--no-progress"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["eod_id"] == len(vocab) and meta["vocab_size"] == len(vocab) + 1  # added: the tokenizer had none
    assert "added it as a special token" in capsys.readouterr().out
    ids = np.fromfile(out / "train.bin", dtype=np.uint16)
    first = [vocab[w] for w in docs[0].rstrip(".\n").split(" ")] + [vocab["."], meta["eod_id"]]
    assert ids[:len(first)].tolist() == first

    # a transformers folder: its eos_token is the end-of-document token
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "hf"
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(tmp_path / "word.json")),
                            eos_token="fox").save_pretrained(str(folder))
    out2 = tmp_path / "data2"
    assert main(["prepare-text", str(src), "--tokenizer", str(folder), "--out", str(out2), "--no-progress"]) == 0
    meta2 = json.loads((out2 / "meta.json").read_text())
    assert (meta2["eod_token"], meta2["eod_id"], meta2["vocab_size"]) == ("fox", vocab["fox"], len(vocab))


def test_existing_output_is_kept_unless_overwrite(tmp_path, capsys):
    src, _ = _corpus(tmp_path, 3)
    out = tmp_path / "data"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "train.bin").write_bytes(b"old")
    args = ["prepare-text", str(src), "--train-tokenizer", "260", "--out", str(out), "--no-progress"]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not empty" in err[0] and "--overwrite" in err[0]
    assert (out / "train.bin").read_bytes() == b"old"
    assert main([*args, "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "train.bin").stat().st_size > 3


@pytest.mark.parametrize("argv, match", [
    (["MISSING", "--train-tokenizer", "300"], "input 'MISSING' does not exist"),
    (["SRC"], "give one of --tokenizer PATH"),
    (["SRC", "--train-tokenizer", "300", "--tokenizer", "t.json"], "give one of --tokenizer PATH"),
    (["SRC", "--train-tokenizer", "100"], "--train-tokenizer must be an integer in [257"),
    (["SRC", "--train-tokenizer", "300", "--val-fraction", "1.5"], "--val-fraction must be in (0, 1)"),
    (["SRC", "--tokenizer", "NOPE.json"], "NOPE.json' does not exist"),
    (["SRC", "--train-tokenizer", "300", "--documents", "pages"], "--documents must be 'file' or 'blank-line'"),
    (["SRC", "--train-tokenizer", "300", "--bogus"], "unknown option 'bogus' for PrepareTextConfig"),
    (["SRC", "--train-tokenizer", "abc"], "train_tokenizer must be an integer, got 'abc'"),
])
def test_usage_mistakes_are_one_error_line(tmp_path, capsys, argv, match):
    src, _ = _corpus(tmp_path, 2)
    argv = [str(src) if a == "SRC" else a for a in argv]
    capsys.readouterr()
    assert main(["prepare-text", *argv, "--out", str(tmp_path / "data"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("whiteformer prepare-text: error: ") and match in err[0], err
    assert not (tmp_path / "data").exists()


def test_a_progress_bar_is_drawn_on_a_terminal_only(tmp_path, capsys, monkeypatch):
    src, _ = _corpus(tmp_path, 2)
    assert main(["prepare-text", str(src), "--train-tokenizer", "260", "--out", str(tmp_path / "a")]) == 0
    quiet = capsys.readouterr().err
    assert "tokenize" not in quiet and "scan" not in quiet
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["prepare-text", str(src), "--train-tokenizer", "260", "--out", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    assert "scan: " in err and "tokenize: 100%" in err


def test_a_vocabulary_over_65536_writes_uint32_that_the_tokens_dataset_reads(tmp_path):
    import torch
    from tokenizers import models, pre_tokenizers

    from whiteformer.app.data import build_dataset

    vocab = {f"w{i}": i for i in range(70000)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))
    words = [f"w{i}" for i in (69999, 3, 65536, 65535, 12, 68000, 5, 7, 9, 11)]
    (tmp_path / "a.txt").write_text(" ".join(words) + "\n")
    (tmp_path / "b.txt").write_text("w1 w2\n")
    out = tmp_path / "data"
    assert main(["prepare-text", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--tokenizer",
                 str(tmp_path / "big.json"), "--out", str(out), "--no-progress"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["dtype"], meta["vocab_size"], meta["eod_id"]) == ("uint32", 70001, 70000)
    ds = build_dataset("tokens", "train", data_dir=str(out))
    x, y = ds.get_windows(torch.tensor([0]), len(words))
    assert x[0].tolist() == [int(w[1:]) for w in words] and y[0, -1] == 70000


def test_a_file_that_is_not_utf8_is_one_error_line_and_leaves_out_as_it_was(tmp_path, capsys):
    src, _ = _corpus(tmp_path, 2)
    (src / "bad.txt").write_bytes(b"fine words\n\xff\xfe not utf-8\n")
    out = tmp_path / "data"
    out.mkdir()
    (out / "train.bin").write_bytes(b"old")
    capsys.readouterr()
    assert main(["prepare-text", str(src), "--train-tokenizer", "260", "--out", str(out), "--overwrite",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.txt' is not UTF-8 text" in err[0], err
    assert sorted(p.name for p in out.iterdir()) == ["train.bin"] and (out / "train.bin").read_bytes() == b"old"


# ----------------------------------------------------------------------------- bounded reading
def test_bounded_lines_give_back_the_text_in_pieces_no_longer_than_the_window():
    """Any mix of words, spaces, tabs and the three line ends: the pieces join to the file, none is
    longer than the window, a cut inside a line falls before whitespace where there is some, and
    a piece is marked whole where a line ends ("\n", or a "\r" the window does not end at)."""
    import io
    import random

    from whiteformer.app.prepare_text import bounded_lines

    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab \t\n\r") if rng.random() < 0.3 else "x" for _ in range(rng.randint(0, 200)))
        window = rng.randint(1, 16)
        pieces = list(bounded_lines(io.StringIO(text, newline=""), window))
        assert "".join(p for p, _ in pieces) == text
        assert all(0 < len(p) <= window for p, _ in pieces)
        for (p, whole), (q, _) in zip(pieces, pieces[1:]):
            if not whole and not p.endswith("\r") and (" " in p[1:] or "\t" in p[1:]):
                assert q[0] in " \t"  # cut before the last whitespace within the window
        for i, (p, whole) in enumerate(pieces):
            assert whole >= p.endswith("\n") and (not whole or p.endswith(("\n", "\r")) or i == len(pieces) - 1)


@pytest.mark.parametrize("words", [True, False])
def test_a_file_without_newlines_is_read_in_bounded_pieces(tmp_path, monkeypatch, words):
    """A 51 MB file with no newline took 6 GB: the reader held a line whole. Now no read asks for,
    and no piece holds, more than about the window, whatever the line structure."""
    import whiteformer.app.prepare_text as pt

    rng = np.random.default_rng(0)
    text = " ".join(rng.choice(WORDS, 40_000)) if words else "x" * 200_000
    path = tmp_path / "one_line.txt"
    path.write_text(text)
    asked = []
    real_open = pt._open_text

    class Recording:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def readline(self, size=-1):
            asked.append(size)
            return self.f.readline(size)

        def read(self, size=-1):
            asked.append(size)
            return self.f.read(size)

        def __iter__(self):  # the old reader: whole lines
            asked.append(len(text))
            return iter(self.f)

    monkeypatch.setattr(pt, "_open_text", lambda p: Recording(real_open(p)))
    window = 1000
    pieces = list(pt.iter_pieces([path], "file", piece_chars=window))
    assert "".join(p for p, _ in pieces) == text and [e for _, e in pieces] == [False] * (len(pieces) - 1) + [True]
    assert max(len(p) for p, _ in pieces) < 2 * window and 0 < max(asked) <= window
    if words:  # cut at spaces: no word split in two
        assert all(p[-1] != " " and (i == 0 or p[0] == " ") for i, (p, _) in enumerate(pieces[:-1]))


def test_a_tokenizer_with_a_vocabulary_id_of_billions_is_one_error_line(tmp_path, capsys):
    """It drove prepare-text to 8.8 GB and a Rust abort (memory allocation of 17179869184 bytes failed)."""
    src, _ = _corpus(tmp_path, 2)
    bad = tmp_path / "big.json"
    tok = json.loads(Tokenizer(__import__("tokenizers").models.WordLevel({"a": 0}, unk_token="a")).to_str())
    tok["model"]["vocab"]["zz"] = 4_000_000_000
    bad.write_text(json.dumps(tok))
    rc = main(["prepare-text", str(src), "--tokenizer", str(bad), "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "vocabulary id 4000000000" in err, err
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_that_panics_is_one_error_line(tmp_path, capfd):
    """tokenizers' PanicException derives from BaseException, which main's `except Exception` missed:
    a traceback, after Rust's own report of the panic."""
    from test_tokenizer import backtracking_tokenizer

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a" * 5000 + "b")
    rc = main(["prepare-text", str(src), "--tokenizer", str(backtracking_tokenizer(tmp_path)),
               "--out", str(tmp_path / "out"), "--no-progress"])
    err = capfd.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "error: " in err and "backtracks" in err, err
    assert not (tmp_path / "out").exists()
