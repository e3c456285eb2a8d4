"""Language modelling on a text file: characters, or the tokens of a subword tokenizer.

The default corpus is the small public-domain text shipped with the package
(``whiteformer/app/data/corpus/shakespeare_small.txt``: *Julius Caesar* and *King Lear*, see the README
there); ``path`` (or ``data_dir``) points at any ``.txt``, ``.txt.xz`` or ``.txt.gz`` file, e.g.
Shakespeare's complete works as ``complete_works.txt.xz``.

The first ``1 - val_fraction`` of the characters form the "train" split, the rest "val" ("test" is
an alias). The vocabulary is, by default, the sorted set of characters of the whole file (shared by
the splits); ``tokenizer=PATH`` (a ``tokenizer.json`` or a transformers tokenizer folder) reads
subword tokens instead, and ``train_tokenizer=N`` trains a byte-level BPE of ``N`` tokens on the
train split (see :mod:`.tokenizer`; the run saves it beside the model). An end-of-document token
written in the text (``<|endoftext|>``) is one token. :class:`CharCorpus` holds the token ids; the
trainer cuts windows of ``block_size + 1``. With ``pack=True`` the windows are packed documents
(:mod:`.packing`), each ended by the tokenizer's end-of-document token, or by ``eod`` (a token; for
characters, the character ending each document, e.g. a newline) or ``eod_id``.
"""
from __future__ import annotations

import gzip
import hashlib
import lzma
import os
import warnings
from importlib import resources
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .packing import resolve_eod_id
from .registry import check_split, register_dataset
from .tokenizer import TextTokenizer, char_tokenizer, check_bpe_size, load_tokenizer, text_chunks, train_bpe

__all__ = ["CharCorpus", "CharVocab", "read_text", "default_corpus_path", "text"]


def default_corpus_path() -> Path:
    return Path(str(resources.files("whiteformer.app.data") / "corpus" / "shakespeare_small.txt"))


def read_text(path) -> str:
    """Read a (possibly .xz / .gz / .lzma compressed) UTF-8 text file."""
    path = Path(os.path.expanduser(str(path)))
    if not path.is_file():
        what = "is not a regular file" if path.exists() else "does not exist"
        raise FileNotFoundError(f"text file {str(path)!r} {what}")
    if path.suffix in (".xz", ".lzma"):
        opener = lzma.open
    elif path.suffix == ".gz":
        opener = gzip.open
    else:
        opener = open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read()


class CharVocab:
    """Characters <-> ids (the sorted characters of a corpus); no end-of-document token."""

    eod_id: Optional[int] = None
    unit = "char"

    def __init__(self, chars: Sequence[str]):
        self.chars: List[str] = list(chars)
        if len(set(self.chars)) != len(self.chars) or any(len(c) != 1 for c in self.chars):
            raise ValueError("vocabulary entries must be distinct single characters")
        self.stoi: Dict[str, int] = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> torch.Tensor:
        missing = sorted({c for c in s if c not in self.stoi})
        if missing:
            raise ValueError(f"characters {missing!r} are not in the vocabulary of {len(self)} characters")
        return torch.tensor([self.stoi[c] for c in s], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def to_json(self) -> dict:
        return {"type": "char", "chars": "".join(self.chars)}

    def files(self, model_max_length: Optional[int] = None) -> Dict[str, str]:
        """{file name: text} saved beside a model: ``vocab.json`` and transformers' tokenizer files
        (a one-token-per-character tokenizer, :func:`.tokenizer.char_tokenizer`)."""
        import json

        try:
            hf = char_tokenizer(self.chars).files(model_max_length)
        except ImportError:  # no tokenizers: vocab.json alone (whiteformer generate reads it)
            hf = {}
        return {"vocab.json": json.dumps(self.to_json()), **hf}

    @classmethod
    def from_json(cls, obj: dict) -> "CharVocab":
        if not isinstance(obj, dict) or obj.get("type") != "char" or not isinstance(obj.get("chars"), str):
            raise ValueError("not a character vocabulary (expected {'type': 'char', 'chars': ...})")
        return cls(list(obj["chars"]))


class CharCorpus:
    """Token ids of one split of a text corpus (``kind = "lm"``).

    Attributes: ``tokens`` (T,) int64, ``vocab`` (:class:`CharVocab` or :class:`.tokenizer.TextTokenizer`:
    ``encode`` / ``decode`` / ``eod_id`` / ``files``), ``vocab_size``, ``eod_id`` (the end-of-document
    token's id, or None) and ``pack`` (the trainer packs the windows' documents,
    :func:`~.packing.pack_windows`).
    ``get_windows(starts, block_size)`` -> (x, y) of shape (B, block_size), y = x shifted by one.
    """

    kind = "lm"

    def __init__(self, tokens: torch.Tensor, vocab: Union[CharVocab, TextTokenizer], name: str = "text",
                 source: str = "", eod_id: Optional[int] = None, pack: bool = False):
        eod_id = eod_id if eod_id is not None else getattr(vocab, "eod_id", None)
        if pack and eod_id is None:
            raise ValueError(f"{name}: packed documents need an end-of-document token id (eod_id)")
        self.tokens = tokens
        self.vocab = vocab
        self.vocab_size = len(vocab)
        self.name = name
        self.source = source
        self.eod_id = eod_id
        self.pack = bool(pack)

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def get_windows(self, starts: torch.Tensor, block_size: int):
        starts = torch.as_tensor(starts, dtype=torch.long)
        if len(self) < block_size + 1:
            raise ValueError(f"{self.name}: {len(self)} tokens are fewer than block_size + 1 = {block_size + 1}")
        offs = starts[:, None] + torch.arange(block_size + 1)
        chunk = self.tokens[offs]
        return chunk[:, :-1], chunk[:, 1:]


def _encode_fast(data: str, vocab: CharVocab) -> torch.Tensor:
    """Vectorised ``vocab.encode`` for a long string (code points -> ids via a lookup table)."""
    codes = np.frombuffer(data.encode("utf-32-le"), dtype=np.uint32)
    lut = np.full(int(codes.max()) + 1, -1, dtype=np.int64)
    lut[[ord(c) for c in vocab.chars]] = np.arange(len(vocab))
    return torch.from_numpy(lut[codes])


#: the last trained tokenizer, by (digest of its training text, size): the splits of a run train it once
_TRAINED: Dict[Tuple[str, int], TextTokenizer] = {}


def _trained_bpe(train_text: str, vocab_size: int) -> TextTokenizer:
    digest = hashlib.blake2b(digest_size=16)
    for piece in text_chunks(train_text):
        digest.update(piece.encode("utf-8"))
    key = (digest.hexdigest(), vocab_size)
    if key not in _TRAINED:
        tok = train_bpe(train_text, vocab_size)
        _TRAINED.clear()
        _TRAINED[key] = tok
    return _TRAINED[key]


@register_dataset("text", reads="file",
                  help="language modelling on a text file: characters or a BPE tokenizer (default: shipped corpus)")
def text(split: str = "train", path: Optional[str] = None, data_dir: Optional[str] = None,
         val_fraction: float = 0.1, tokenizer: Optional[str] = None,
         train_tokenizer: Optional[int] = None, pack: bool = False, eod_id: Optional[int] = None,
         eod: Optional[str] = None) -> CharCorpus:
    """Corpus ``split`` ("train" / "val"; "test" = "val") of ``path`` (default: shipped), read as
    characters, with ``tokenizer`` (a ``tokenizer.json`` or a transformers tokenizer folder), or with
    a byte-level BPE of ``train_tokenizer`` tokens trained on the train split.

    ``pack=True``: the windows are packed documents, each ended by the end-of-document token: ``eod_id``,
    the token ``eod`` (e.g. ``"\\n"`` for characters), or the tokenizer's own."""
    split = check_split("text", split, canonical=("train", "val"), aliases={"test": "val"})
    if path is not None and data_dir is not None and str(path) != str(data_dir):
        raise ValueError("text: give the corpus file as path or data_dir, not both")
    if tokenizer is not None and train_tokenizer is not None:
        raise ValueError("text: give tokenizer (a tokenizer to read) or train_tokenizer (a vocabulary size to "
                         "train), not both")
    src = path or data_dir
    if src is not None and Path(os.path.expanduser(str(src))).is_dir():
        raise ValueError(f"text: {str(src)!r} is a directory; pass the text file itself (.txt, .txt.xz, .txt.gz)")
    src = Path(src) if src is not None else default_corpus_path()
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    if not isinstance(pack, bool):
        raise TypeError(f"text: pack must be true or false, got {pack!r}")
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    if train_tokenizer is not None:
        check_bpe_size(train_tokenizer)
    data = read_text(src)
    if len(data) < 100:
        raise ValueError(f"text file {str(src)!r} is too short ({len(data)} characters)")
    cut = int(len(data) * (1.0 - val_fraction))
    if train_tokenizer is not None:
        tok = _trained_bpe(data[:cut], train_tokenizer)
    if tok is not None:
        vocab, part = tok, tok.encode_corpus(data[:cut] if split == "train" else data[cut:])
    else:
        vocab = CharVocab(sorted(set(data)))
        part = _encode_fast(data, vocab)
        part = part[:cut] if split == "train" else part[cut:]
    if pack or eod_id is not None or eod is not None:
        eod_id = resolve_eod_id(vocab, len(vocab), eod_id, eod, name="text")
    if pack and split == "train" and not bool((part == eod_id).any()):
        warnings.warn(f"text: pack=true, but the end-of-document token {vocab.decode([eod_id])!r} (id {eod_id}) never "
                      f"occurs in the train split of {str(src)!r}: every window is one document", UserWarning,
                      stacklevel=2)
    return CharCorpus(part, vocab, name=f"text/{split}", source=str(src), eod_id=eod_id, pack=pack)
