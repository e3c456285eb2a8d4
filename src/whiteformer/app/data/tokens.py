"""Pre-tokenised language-model data: nanoGPT's ``train.bin`` / ``val.bin``.

A data directory holds ``train.bin`` and ``val.bin``, each the raw token ids of one split back to
back (no header), as unsigned 16-bit integers (``dtype="uint16"``, nanoGPT's format) or 32-bit
(``dtype="uint32"``, for vocabularies over 65536), in the machine's byte order (little-endian on
x86 and ARM); and optionally ``meta.json``::

    {"vocab_size": 50257, "dtype": "uint16", "eod_id": 50256,
     "tokenizer": "gpt2/tokenizer.json", "tokenizer_file": "tokenizer.json"}

(``tokenizer``: what the ids were made with; ``tokenizer_file``: its copy in the directory, which
decodes the run report's text sample and is saved with the trained model as transformers' files;
``eod_id`` / ``eod_token``: the end-of-document token between documents.)

``whiteformer prepare-text`` (:mod:`whiteformer.app.prepare_text`) writes all three. The
vocabulary size comes from ``meta.json`` or ``vocab_size=V`` (``data_args.vocab_size=V``; it may
exceed the file's, e.g. nanoGPT's 50304 for GPT-2's 50257, never be smaller); the dtype from
``dtype=`` or ``meta.json`` (default uint16), and both must agree when both are given.

The files are never read whole, nor mapped: every batch reads only its windows of ``block_size + 1``
tokens from the file, so a file larger than the machine's memory (or its address space) trains. Which
windows a step reads, and which of them each data-parallel / context-parallel process takes, is the
language-model task's business (:class:`whiteformer.app.train.tasks.LMTask`), as for ``text``.

Checks: at build time the files' existence, a size that is a whole number of tokens, at least two
tokens, and the ids of a bounded sample (:data:`SAMPLE_CHUNKS` evenly spaced runs of
:data:`SAMPLE_TOKENS` tokens, both ends included) below the vocabulary size; then every batch read
checks its own ids (a :class:`TokenFileError` naming the file and the token's position).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from ..._checks import is_int
from ..._nesting import NestingError, parse_bounded
from .packing import resolve_eod_id
from .registry import check_split, register_dataset

__all__ = ["TokenFile", "TokenFileError", "TOKEN_DTYPES", "read_meta", "tokens"]

#: the dtypes a token file may hold (name -> numpy dtype)
TOKEN_DTYPES = {"uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32)}
#: the bounded sample checked when a token file is opened: this many runs ...
SAMPLE_CHUNKS = 64
#: ... of this many tokens each
SAMPLE_TOKENS = 4096
SPLIT_FILES = {"train": "train.bin", "val": "val.bin"}


class TokenFileError(ValueError):
    """A token file does not hold what it claims (an id outside the vocabulary, a size that is no
    whole number of tokens): a problem with the user's data, reported as one line."""


def read_meta(data_dir) -> Dict[str, Any]:
    """``data_dir/meta.json`` as a dict ({} when there is none); not a JSON object -> ``ValueError``."""
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        return {}
    try:
        meta = parse_bounded(lambda: json.loads(path.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{str(path)!r} is not valid JSON: {err}") from None
    except NestingError as err:
        raise ValueError(f"{str(path)!r} {err}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object such as {{\"vocab_size\": 50257}}, "
                         f"got {type(meta).__name__}")
    return meta


class TokenFile:
    """One split's token file, read window by window, batch by batch (``kind = "lm"``).

    ``len(ds)`` is the number of tokens; ``get_windows(starts, block_size)`` -> (x, y) int64 of shape
    (B, block_size), y = x shifted by one, read from the file at ``starts`` (B,). ``vocab``: the
    directory's tokenizer (:class:`~.tokenizer.TextTokenizer`, named by ``meta.json``'s
    ``tokenizer_file``; None when there is none), which decodes the report's sample and is saved
    beside the trained model; ``eod_id``: the end-of-document id recorded in ``meta.json`` or given (or
    None); ``pack``: the trainer packs the windows' documents (:func:`~.packing.pack_windows`).
    """

    kind = "lm"

    def __init__(self, path, dtype: str, vocab_size: int, name: str = "tokens", vocab=None,
                 eod_id: Optional[int] = None, pack: bool = False):
        if pack and eod_id is None:
            raise ValueError(f"{name}: packed documents need an end-of-document token id (eod_id)")
        self.path = Path(path)
        self.dtype = TOKEN_DTYPES[dtype]
        self.vocab_size = int(vocab_size)
        self.name = name
        self.vocab = vocab
        self.eod_id = eod_id
        self.pack = bool(pack)
        self.source = str(self.path)
        size = self.path.stat().st_size
        if size % self.dtype.itemsize:
            raise TokenFileError(f"{self.source!r} has {size} bytes, not a whole number of {dtype} tokens "
                                 f"({self.dtype.itemsize} bytes each); is data_args.dtype right?")
        self._len = size // self.dtype.itemsize
        if self._len < 2:
            raise TokenFileError(f"{self.source!r} holds {self._len} token(s); one training window needs at least "
                                 f"block_size + 1 >= 2")

    def __len__(self) -> int:
        return self._len

    def _read(self, starts, n: int) -> np.ndarray:
        """(len(starts), n) ids: the ``n`` tokens at each token offset of ``starts``, each run read on
        its own (the file is never mapped whole, so its size is bounded by neither memory nor the
        address space)."""
        out = np.empty((len(starts), n), dtype=self.dtype)
        with open(self.path, "rb") as f:
            for row, s in enumerate(starts):
                f.seek(int(s) * self.dtype.itemsize)
                got = np.fromfile(f, dtype=self.dtype, count=n)
                if got.size != n:  # the file shrank since it was opened
                    raise TokenFileError(f"{self.source!r} ends before token {int(s) + n} (it holds "
                                         f"{self._len} tokens when opened; was it changed during the run?)")
                out[row] = got
        return out

    def _check_ids(self, ids: np.ndarray, offsets: np.ndarray) -> None:
        """``ids`` (B, L) read at token offsets ``offsets`` (B,): all below the vocabulary size."""
        bad = ids >= self.vocab_size
        if bad.any():
            row, col = np.argwhere(bad)[0]
            raise TokenFileError(f"{self.source!r}: token {int(offsets[row]) + int(col)} has id {int(ids[row, col])}, "
                                 f"not below the vocabulary size {self.vocab_size} (wrong data_args.dtype or "
                                 f"vocab_size, or a file of another tokenizer?)")

    def check_sample(self) -> None:
        """Check the ids of the bounded sample (:data:`SAMPLE_CHUNKS` evenly spaced runs of
        :data:`SAMPLE_TOKENS`, the first and last included); reads at most their bytes."""
        n = min(SAMPLE_TOKENS, self._len)
        k = min(SAMPLE_CHUNKS, max(1, self._len // n))
        starts = (np.arange(k, dtype=np.int64) * (self._len - n)) // max(k - 1, 1)
        self._check_ids(self._read(starts, n), starts)

    def get_windows(self, starts: torch.Tensor, block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._len < block_size + 1:
            raise ValueError(f"{self.name}: {self._len} tokens are fewer than block_size + 1 = {block_size + 1}")
        offsets = torch.as_tensor(starts, dtype=torch.long).numpy()
        chunk = self._read(offsets, block_size + 1)
        self._check_ids(chunk, offsets)
        chunk = torch.from_numpy(chunk.astype(np.int64))
        return chunk[:, :-1], chunk[:, 1:]


def _dir_tokenizer(data_dir: Path, meta: Dict[str, Any]):
    """The :class:`~.tokenizer.TextTokenizer` of ``meta["tokenizer_file"]`` (a file in ``data_dir``)
    with ``meta["eod_token"]``, or None when there is none or it cannot be read: it only decodes the
    report's sample and is saved beside the trained model."""
    name = meta.get("tokenizer_file")
    if not isinstance(name, str) or os.path.isabs(name) or ".." in Path(name).parts:
        return None
    path = data_dir / name
    if not path.is_file():
        return None
    eod = meta.get("eod_token")
    try:
        from .tokenizer import load_tokenizer

        return load_tokenizer(path, eod if isinstance(eod, str) else None)
    except (ImportError, ValueError):
        return None


def _given_tokenizer(path, meta: Dict[str, Any], vocab_size: int):
    """The tokenizer at ``path`` (:func:`~.tokenizer.load_tokenizer`, with ``meta.json``'s ``eod_token``),
    checked to fit the vocabulary."""
    from .tokenizer import load_tokenizer

    eod = meta.get("eod_token")
    tok = load_tokenizer(path, eod if isinstance(eod, str) else None)
    if tok.vocab_size > vocab_size:
        raise ValueError(f"tokens: tokenizer {str(path)!r} has {tok.vocab_size} tokens, more than the vocabulary size "
                         f"{vocab_size}: it is not the tokenizer of these files")
    return tok


def _resolve(meta: Dict[str, Any], dtype: Optional[str], vocab_size: Optional[int], meta_path: str) -> Tuple[str, int]:
    """(dtype, vocab_size) from the arguments and ``meta.json``, checked."""
    meta_dtype = meta.get("dtype")
    if meta_dtype is not None and meta_dtype not in TOKEN_DTYPES:
        raise ValueError(f"{meta_path!r}: dtype must be one of {sorted(TOKEN_DTYPES)}, got {meta_dtype!r}")
    if dtype is not None and dtype not in TOKEN_DTYPES:
        raise ValueError(f"tokens: dtype must be one of {sorted(TOKEN_DTYPES)}, got {dtype!r}")
    if dtype is not None and meta_dtype is not None and dtype != meta_dtype:
        raise ValueError(f"tokens: data_args.dtype={dtype} but {meta_path!r} says {meta_dtype}")
    dtype = dtype or meta_dtype or "uint16"
    meta_vocab = meta.get("vocab_size")
    if meta_vocab is not None and not (is_int(meta_vocab) and meta_vocab > 0):
        raise ValueError(f"{meta_path!r}: vocab_size must be a positive integer, got {meta_vocab!r}")
    if vocab_size is not None and not (is_int(vocab_size) and vocab_size > 0):
        raise ValueError(f"tokens: vocab_size must be a positive integer, got {vocab_size!r}")
    if vocab_size is None and meta_vocab is None:
        pkl = Path(meta_path).with_suffix(".pkl")
        why = (f"{str(pkl)!r} (nanoGPT's pickle) is not read, since unpickling can run code" if pkl.is_file()
               else f"{meta_path!r} does not give it")
        raise ValueError(f"tokens: the vocabulary size is unknown: {why}; write {{\"vocab_size\": V}} in "
                         f"{meta_path!r} or pass data_args.vocab_size=V")
    if vocab_size is not None and meta_vocab is not None and vocab_size < meta_vocab:
        raise ValueError(f"tokens: data_args.vocab_size={vocab_size} is smaller than the vocabulary of "
                         f"{meta_path!r} ({meta_vocab})")
    vocab_size = int(vocab_size if vocab_size is not None else meta_vocab)
    top = int(np.iinfo(TOKEN_DTYPES[dtype]).max) + 1
    if meta_vocab is not None and meta_vocab > top:
        raise ValueError(f"tokens: a vocabulary of {meta_vocab} does not fit {dtype} ids (at most {top}); "
                         f"the files must be uint32 (data_args.dtype=uint32)")
    return dtype, vocab_size


@register_dataset("tokens", reads="directory",
                  help="language modelling on token ids: nanoGPT's train.bin / val.bin token files in data_dir")
def tokens(split: str = "train", data_dir: Optional[str] = None, dtype: Optional[str] = None,
           vocab_size: Optional[int] = None, pack: bool = False, eod_id: Optional[int] = None,
           eod: Optional[str] = None, tokenizer: Optional[str] = None) -> TokenFile:
    """Token file of ``split`` ("train" -> ``train.bin``, "val" -> ``val.bin``; "test" = "val").

    ``tokenizer``: the tokenizer the ids were made with (a ``tokenizer.json`` or a transformers
    tokenizer folder, e.g. GPT-2's for nanoGPT's OpenWebText files), in place of the one ``meta.json``
    names; it decodes the report's sample and is saved beside the model.

    ``pack=True``: the windows are packed documents, each ended by the end-of-document token:
    ``eod_id``, the token ``eod`` of the directory's tokenizer, or ``meta.json``'s ``eod_id``."""
    split = check_split("tokens", split, canonical=("train", "val"), aliases={"test": "val"})
    root = Path(os.path.expanduser(str(data_dir)))
    meta_path = str(root / "meta.json")
    meta = read_meta(root)
    dtype, vocab_size = _resolve(meta, dtype, vocab_size, meta_path)
    if not isinstance(pack, bool):
        raise TypeError(f"tokens: pack must be true or false, got {pack!r}")
    path = root / SPLIT_FILES[split]
    if not path.is_file():
        what = "is not a regular file" if path.exists() else "does not exist"
        raise FileNotFoundError(f"tokens: {str(path)!r} {what} (the {split} split; a data directory holds "
                                f"train.bin and val.bin, e.g. written by whiteformer prepare-text)")
    meta_eod = meta.get("eod_id")
    if meta_eod is not None and not (is_int(meta_eod) and 0 <= meta_eod < vocab_size):
        raise ValueError(f"{meta_path!r}: eod_id must be a token id in [0, {vocab_size - 1}], got {meta_eod!r}")
    tok = _dir_tokenizer(root, meta) if tokenizer is None else _given_tokenizer(tokenizer, meta, vocab_size)
    if pack or eod_id is not None or eod is not None:
        eod_id = resolve_eod_id(tok, vocab_size, meta_eod if eod_id is None and eod is None else eod_id, eod,
                                name="tokens")
    else:
        eod_id = meta_eod
    ds = TokenFile(path, dtype, vocab_size, name=f"tokens/{split}", vocab=tok, eod_id=eod_id, pack=pack)
    _check_count(meta, meta_path, split, ds)
    ds.check_sample()
    return ds


def _check_count(meta: Dict[str, Any], meta_path: str, split: str, ds: TokenFile) -> None:
    """``meta.json``'s ``<split>_tokens`` (written by ``prepare-text``), when there, is the file's
    number of tokens: a file of another dtype than meta.json says has twice or half as many."""
    key = f"{split}_tokens"
    want = meta.get(key)
    if want is None:
        return
    if not (is_int(want) and want >= 0):
        raise ValueError(f"{meta_path!r}: {key} must be a token count (an integer >= 0), got {want!r}")
    if want != len(ds):
        size = len(ds) * ds.dtype.itemsize
        other = [n for n, d in TOKEN_DTYPES.items() if d != ds.dtype and size == want * d.itemsize]
        hint = (f"; the file's size fits {want} {other[0]} tokens: was it written as {other[0]}?" if other
                else "; the file or meta.json was changed or truncated")
        raise TokenFileError(f"{ds.source!r} holds {len(ds)} {ds.dtype.name} tokens ({size} bytes) but {meta_path!r} "
                             f"says {key} = {want}{hint}")
