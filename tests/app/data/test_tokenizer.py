"""Subword tokenizers of the text dataset: byte-level BPE training, loading a tokenizer.json or a
transformers folder, the character tokenizer, the files saved beside a model, and ``--dataset text``
with ``tokenizer`` / ``train_tokenizer``."""
import json
import sys

import pytest
import torch

from whiteformer.app.data import build_dataset
from whiteformer.app.data import text as text_data
from whiteformer.app.data.text import CharVocab, default_corpus_path, read_text
from whiteformer.app.data.tokenizer import (
    EOD_TOKEN,
    TextTokenizer,
    char_tokenizer,
    load_tokenizer,
    same_tokenizer,
    text_chunks,
    train_bpe,
)

pytest.importorskip("tokenizers", reason="needs the data extra: pip install whiteformer[data]")

TEXT = read_text(default_corpus_path())[:40_000]
ODD = "caf\u00e9 na\u00efve \u00fcber \u4e2d\u6587 \U0001f600\r\n\ttabs  and   spaces\n\n\nend"


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(TEXT, 300)


def test_text_chunks_end_at_line_ends_and_join_to_the_text():
    text = "ab\ncd\n" * 50 + "no newline at all" * 20
    parts = list(text_chunks(text, size=16))
    assert "".join(parts) == text and len(parts) > 10
    assert all(p.endswith("\n") for p in parts[:-1] if "\n" in p)
    assert list(text_chunks("")) == []


def test_trained_bpe_has_the_bytes_the_eod_token_and_the_merges(bpe):
    assert bpe.vocab_size == 300 == len(bpe)
    assert bpe.eod_token == EOD_TOKEN and bpe.eod_id == bpe.backend.token_to_id(EOD_TOKEN)
    ids = bpe.encode(TEXT[:2000])
    assert ids.dtype == torch.long and len(ids) < 0.85 * 2000  # merges learnt: fewer tokens than bytes
    for s in (TEXT[:3000], ODD, ""):  # byte-level: every text round-trips, unseen characters included
        assert bpe.decode(bpe.encode(s)) == s
    both = bpe.encode(f"one{EOD_TOKEN}two")  # the end-of-document token written in the text is one token
    assert (both == bpe.eod_id).sum() == 1 and bpe.decode(both) == f"one{EOD_TOKEN}two"


def test_training_is_deterministic_and_the_size_is_checked(bpe):
    assert train_bpe(TEXT, 300).backend.to_str() == bpe.backend.to_str()
    for bad in (256, 300.0, True, "512"):
        with pytest.raises(ValueError, match="train_tokenizer must be a vocabulary size of at least 257"):
            train_bpe(TEXT, bad)
    assert train_bpe("tiny text", 5000).vocab_size < 300  # too little text for the merges asked


def test_corpus_encoding_in_chunks_round_trips(bpe):
    long = (TEXT[:5000] + ODD) * 4
    ids = bpe.encode_corpus(long, chunk_size=1000)
    assert bpe.decode(ids) == long and abs(len(ids) - len(bpe.encode(long))) < 40
    assert ids.dtype == torch.long and ids.max() < bpe.vocab_size


def test_load_a_tokenizer_json(bpe, tmp_path):
    bpe.backend.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert tok.eod_id == bpe.eod_id and tok.vocab_size == 300
    assert torch.equal(tok.encode(ODD), bpe.encode(ODD))
    assert load_tokenizer(str(tmp_path / "tokenizer.json"), eod_token=None).eod_token == EOD_TOKEN
    with pytest.raises(ValueError, match="eod_token 'nope' is not in the tokenizer's vocabulary"):
        load_tokenizer(tmp_path / "tokenizer.json", eod_token="nope")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a tokenizers tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.json")
    with pytest.raises(TypeError, match="tokenizer must be a path"):
        load_tokenizer(3)


def test_saved_files_load_in_transformers_and_as_a_folder(bpe, tmp_path):
    pytest.importorskip("transformers", reason="needs the hf extra: pip install whiteformer[hf]")
    from transformers import AutoTokenizer

    files = bpe.files(model_max_length=64)
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(files)
    config = json.loads(files["tokenizer_config.json"])
    assert config["eos_token"] == config["bos_token"] == EOD_TOKEN and config["model_max_length"] == 64
    assert json.loads(files["generation_config.json"]) == {"bos_token_id": bpe.eod_id, "eos_token_id": bpe.eod_id,
                                                           "pad_token_id": bpe.eod_id}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.eos_token_id == bpe.eod_id and hf(ODD).input_ids == bpe.encode(ODD).tolist()
    assert hf.decode(bpe.encode(ODD)) == ODD
    folder = load_tokenizer(tmp_path)  # a folder goes through AutoTokenizer
    assert folder.eod_id == bpe.eod_id and torch.equal(folder.encode(TEXT[:500]), bpe.encode(TEXT[:500]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is not one AutoTokenizer loads"):
        load_tokenizer(tmp_path / "empty")


def test_char_tokenizer_matches_the_character_vocabulary(tmp_path):
    vocab = CharVocab(sorted(set(TEXT)))
    tok = char_tokenizer(vocab.chars)
    sample = TEXT[1000:3000]
    assert torch.equal(tok.encode(sample), vocab.encode(sample)) and tok.decode(vocab.encode(sample)) == sample
    assert tok.vocab_size == len(vocab) and tok.eod_id is None
    with pytest.raises(ValueError, match="cannot encode"):
        tok.encode("\u00e9")
    files = vocab.files()
    assert json.loads(files["vocab.json"]) == vocab.to_json() and "generation_config.json" not in files
    (tmp_path / "tokenizer.json").write_text(files["tokenizer.json"])
    assert load_tokenizer(tmp_path / "tokenizer.json").decode(vocab.encode("KING\n\n")) == "KING\n\n"


# ----------------------------------------------------------------------------- the text dataset
def test_text_dataset_trains_a_bpe_on_the_train_split(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT + ODD)
    va = build_dataset("text", "val", path=str(path), train_tokenizer=300)
    tr = build_dataset("text", "train", path=str(path), train_tokenizer=300)
    assert tr.vocab is va.vocab and tr.vocab_size == 300 and tr.vocab.eod_id is not None
    text = read_text(path)  # ("\r\n" read as "\n")
    cut = int(len(text) * 0.9)
    assert tr.vocab.decode(tr.tokens) == text[:cut] and va.vocab.decode(va.tokens) == text[cut:]
    assert train_bpe(text[:cut], 300).backend.to_str() == tr.vocab.backend.to_str()  # train split only
    x, y = tr.get_windows(torch.tensor([0, 7]), 16)
    assert x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_text_dataset_reads_a_given_tokenizer(bpe, tmp_path):
    bpe.backend.save(str(tmp_path / "tokenizer.json"))
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    tr = build_dataset("text", "train", data_dir=str(path), tokenizer=str(tmp_path / "tokenizer.json"))
    assert tr.vocab_size == 300 and torch.equal(tr.tokens, bpe.encode_corpus(TEXT[:int(len(TEXT) * 0.9)]))
    with pytest.raises(ValueError, match="not both"):
        build_dataset("text", "train", tokenizer=str(tmp_path / "tokenizer.json"), train_tokenizer=300)
    with pytest.raises(ValueError, match="at least 257"):
        build_dataset("text", "train", train_tokenizer=100)
    with pytest.raises(FileNotFoundError, match="tokenizer .* does not exist"):
        build_dataset("text", "train", tokenizer=str(tmp_path / "nope.json"))


def test_without_tokenizers_or_transformers(bpe, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # no transformers: tokenizer.json alone
    files = TextTokenizer(bpe.backend, EOD_TOKEN).files()
    assert set(files) == {"tokenizer.json"} and same_tokenizer(files["tokenizer.json"], bpe.backend.to_str())
    with pytest.raises(ImportError, match=r"AutoTokenizer: pip install 'whiteformer\[hf\]'"):
        load_tokenizer(tmp_path)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    monkeypatch.setattr(text_data, "_TRAINED", {})
    with pytest.raises(ImportError, match=r"pip install 'whiteformer\[data\]'"):
        train_bpe(TEXT, 300)
    with pytest.raises(ImportError, match=r"pip install 'whiteformer\[data\]'"):
        build_dataset("text", "train", train_tokenizer=300)
    vocab = CharVocab(sorted(set(TEXT)))
    assert set(vocab.files()) == {"vocab.json"}  # whiteformer generate still reads a character run


# ----------------------------------------------------------------------------- untrusted tokenizer files
def _word_level(vocab, added=(), pre_tokenizer=None):
    """A tokenizer.json text of a word-level model with ``vocab`` {token: id} (the JSON written
    by hand, as an attacker would, not by tokenizers)."""
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": list(added),
                       "normalizer": None, "pre_tokenizer": pre_tokenizer or {"type": "Whitespace"},
                       "post_processor": None, "decoder": None,
                       "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "a"}})


def _added(i):
    return {"id": i, "content": "<x>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
            "special": True}


@pytest.mark.parametrize("case", [
    {"vocab": {"a": 0, "b": 4_000_000_000}}, {"vocab": {"a": 0, "b": 1 << 24}}, {"vocab": {"a": 0, "b": -1}},
    {"vocab": {"a": 0, "b": "7"}}, {"vocab": {"a": 0, "b": 2.5}}, {"vocab": {"a": 0, "b": None}},
    {"vocab": {"a": 0}, "added": [_added(4_000_000_000)]}, {"vocab": {"a": 0}, "added": [_added("1")]},
    {"vocab": {"a": 0}, "added": [{"content": "<x>"}]},
])
def test_vocabulary_ids_are_checked_before_tokenizers_reads_the_file(tmp_path, monkeypatch, case):
    """A 5 KB tokenizer.json with one id of 4,000,000,000 made tokenizers allocate 17 GB and abort
    the process (prepare-text); the ids are read and bounded first, and tokenizers never sees it."""
    import tokenizers

    path = tmp_path / "tokenizer.json"
    path.write_text(_word_level(case["vocab"], case.get("added", ())))
    opened = []
    monkeypatch.setattr(tokenizers.Tokenizer, "from_file", lambda p: opened.append(p))
    with pytest.raises(ValueError, match=r"vocabulary id .*ids must be integers in \[0, 16777216\)"):
        load_tokenizer(path)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(path.read_text())
    with pytest.raises(ValueError, match="vocabulary id"):
        load_tokenizer(folder)
    assert opened == []


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "tokenizer_config.json",
                                  "special_tokens_map.json", "added_tokens.json"])
def test_a_deeply_nested_json_in_a_tokenizer_folder_is_refused(bpe, tmp_path, name):
    """A config.json nested 100,000 levels deep was a RecursionError inside transformers' AutoTokenizer."""
    pytest.importorskip("transformers")
    folder = tmp_path / "folder"
    folder.mkdir()
    bpe.backend.save(str(folder / "tokenizer.json"))
    deep = "[" * 100_000 + "]" * 100_000
    (folder / name).write_text('{"model_type": "gpt2", "x": ' + deep + "}")
    with pytest.raises(ValueError, match="nests lists or mappings more than 100 levels deep"):
        load_tokenizer(folder)


def backtracking_tokenizer(tmp_path):
    """A tokenizer.json whose Split regex backtracks past the regex engine's limit on a long run of
    'a's: the tokenizers library panics (pyo3's PanicException, a BaseException)."""
    path = tmp_path / "backtracks.json"
    path.write_text(_word_level({chr(97 + i): i for i in range(26)}, pre_tokenizer={
        "type": "Split", "pattern": {"Regex": "(a|a?)+$"}, "behavior": "Isolated", "invert": False}))
    return path


def test_a_tokenizer_that_panics_is_a_value_error_without_the_native_report(tmp_path, capfd):
    tok = load_tokenizer(backtracking_tokenizer(tmp_path))
    assert tok.encode("abc").numel() >= 1  # (an ordinary text encodes)
    for encode in (tok.encode, tok.encode_corpus):
        with pytest.raises(ValueError, match="the tokenizer failed on the text: .*retry-limit.*backtracks"):
            encode("a" * 5000 + "b")
    assert "panicked" not in capfd.readouterr().err  # Rust's report of the panic is held back
