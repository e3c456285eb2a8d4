"""``whiteformer prepare-text``: text files -> the token files of ``--dataset tokens``.

    whiteformer prepare-text FILE_OR_DIR [...] --out DIR (--tokenizer PATH | --train-tokenizer N)
        [--documents file|blank-line] [--eod-token TEXT] [--val-fraction 0.1] [--overwrite] [--no-progress]

Writes ``DIR/train.bin``, ``DIR/val.bin`` (nanoGPT's format: the token ids back to back, uint16, or
uint32 for a vocabulary over 65536), ``DIR/tokenizer.json`` (the tokenizer used, which decodes them)
and ``DIR/meta.json`` (``vocab_size``, ``dtype``, ``eod_id``, ``eod_token``, ``tokenizer``,
``tokenizer_file``, the token and document counts, the sources).

- Inputs: text files (UTF-8; ``.gz`` / ``.xz`` are read compressed), a directory standing for its
  ``*.txt`` / ``*.txt.gz`` / ``*.txt.xz`` files (recursively, in sorted order).
- Documents: ``--documents file`` (default) makes each file one document; ``--documents blank-line``
  cuts each file at its blank lines (a line empty or only whitespace; a run of them is one cut), so
  every paragraph is a document. Documents are read and tokenized in line-aligned pieces of about
  :data:`PIECE_CHARS` characters (a longer line cut at whitespace), so a file larger than memory is
  prepared, whatever its line structure (a token may differ from the whole document's tokenization
  where a piece ends, as with transformers' line-by-line reading).
- The end-of-document token follows every document (``doc eod doc eod ...``, as nanoGPT's
  OpenWebText preparation). Its text is ``--eod-token``, by default the tokenizer's end-of-sequence
  token (a transformers folder's ``eos_token``), else ``<|endoftext|>``; a token the tokenizer lacks is
  added to it as a special token (saved in ``DIR/tokenizer.json``).
- Tokenizer: ``--tokenizer`` a ``tokenizer.json`` file, or a folder holding one or that
  ``transformers.AutoTokenizer`` loads (a fast tokenizer); ``--train-tokenizer N`` trains a byte-level
  BPE of N tokens (the end-of-document token included) on the training documents.
- Split: the last documents holding ``--val-fraction`` of the characters form ``val.bin`` (at least one
  document each side; a single document is cut at that character instead).

``DIR`` must be missing or empty unless ``--overwrite`` (which replaces only these four files); they are
written into a new folder beside ``DIR`` and moved in at the end, so a failed or killed run leaves
``DIR`` as it was. A tqdm bar shows the progress on a terminal.
"""
from __future__ import annotations

import argparse
import gzip
import json
import lzma
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .config import ConfigError, _h, check_path_option

__all__ = ["PrepareTextConfig", "run", "prepare_text", "PrepareResult", "iter_pieces", "bounded_lines", "input_files"]

TEXT_SUFFIXES = (".txt", ".txt.gz", ".txt.xz", ".txt.lzma")
#: documents are read and tokenized in line-aligned pieces of about this many characters
PIECE_CHARS = 1 << 20
#: pieces tokenized per ``encode_batch`` call (about this many characters)
BATCH_CHARS = 4 << 20


# ---------------------------------------------------------------------------------- tokenizer
def _tokenizer(path: Optional[str], train_size: Optional[int], eod_token: Optional[str], train_texts):
    """(:class:`~.data.tokenizer.TextTokenizer` with its end-of-document token, description, whether
    that token was added): the tokenizer at ``path`` (the token added to it as a special token when it
    lacks it), or a byte-level BPE of ``train_size`` tokens trained on ``train_texts()``."""
    from .data.tokenizer import EOD_TOKEN, TextTokenizer, load_tokenizer, train_bpe

    if train_size is not None:
        return train_bpe(train_texts(), train_size, eod_token or EOD_TOKEN), \
            f"byte-level BPE of {train_size} tokens trained on the training documents", False
    try:
        tok = load_tokenizer(path)
    except ValueError as err:
        raise ConfigError(f"--tokenizer: {err}") from None
    eod = eod_token or tok.eod_token or EOD_TOKEN
    added = tok.backend.token_to_id(eod) is None
    if added:
        tok.backend.add_special_tokens([eod])
    return TextTokenizer(tok.backend, eod, tok.bos_token), str(path), added


# ---------------------------------------------------------------------------------- documents
def _open_text(path: Path):
    opener = {".gz": gzip.open, ".xz": lzma.open, ".lzma": lzma.open}.get(path.suffix, open)
    return opener(path, "rt", encoding="utf-8", newline="")


def input_files(inputs: Sequence[str]) -> List[Path]:
    """The text files named by ``inputs`` (a directory: its text files, recursively, sorted)."""
    files: List[Path] = []
    for name in inputs:
        p = Path(os.path.expanduser(str(name)))
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(TEXT_SUFFIXES))
            if not found:
                raise FileNotFoundError(f"input directory {str(name)!r} holds no text files ({', '.join(TEXT_SUFFIXES)})")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"input {str(name)!r} " + ("is not a regular file" if p.exists() else "does not exist"))
    return files


def bounded_lines(f, window: int) -> Iterator[Tuple[str, bool]]:
    """``(text, whole)`` of the text file ``f`` (opened with ``newline=""``) in order, no text longer
    than ``window`` characters: each line (``whole``: it ends the line), a line longer than the
    window in parts cut before its last whitespace within the window (a subword keeps its leading
    space; a part with no whitespace at all is cut at the window, as is a ``\r\n`` that the window
    ends between). At most ``window`` characters are read at a time, whatever the line structure."""
    carry = ""
    while True:
        want = window - len(carry)
        part = f.readline(want)
        text, carry = carry + part, ""
        if not text:
            return
        if len(part) < want or text.endswith("\n"):  # a line end, or the file's end
            yield text, True
            continue
        if text.endswith("\r"):  # a line end, unless a "\n" follows: the part ends there either way
            yield text, False
            continue
        cut = max(text.rfind(" "), text.rfind("\t"))
        if cut <= 0:
            yield text, False
        else:
            yield text[:cut], False
            carry = text[cut:]


def iter_pieces(files: Sequence[Path], rule: str = "file",
                piece_chars: Optional[int] = None) -> Iterator[Tuple[str, bool]]:
    """``(text, ends_document)`` of the documents of ``files`` in order: each file (``rule="file"``), or
    each run of non-blank lines (``rule="blank-line"``: a line empty or only whitespace ends a
    document). A document comes in pieces of about ``piece_chars`` characters (at most twice that;
    the last one ``ends_document``; default :data:`PIECE_CHARS`), line-aligned where the lines are
    shorter (a longer line is cut at whitespace, :func:`bounded_lines`), so neither a file nor a line
    is held whole; empty documents are skipped."""
    piece_chars = piece_chars or PIECE_CHARS
    for path in files:
        try:
            with _open_text(path) as f:
                lines: List[str] = []
                size, started = 0, False
                blank = True  # the line read so far holds only whitespace (a long line comes in parts)
                for line, whole in bounded_lines(f, piece_chars):
                    blank = blank and not line.strip()
                    ends_blank, blank = blank and whole, blank or whole
                    if rule == "blank-line" and ends_blank:
                        if lines or started:
                            yield "".join(lines), True
                            lines, size, started = [], 0, False
                        continue
                    lines.append(line)
                    size += len(line)
                    if size >= piece_chars:
                        yield "".join(lines), False
                        lines, size, started = [], 0, True
                if lines or started:
                    yield "".join(lines), True
        except UnicodeDecodeError as err:
            raise ConfigError(f"input {str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start})") from None


def _split_point(lengths: List[int], val_fraction: float) -> Tuple[int, int]:
    """(first val document, characters of it that stay in train): the last documents holding at least
    ``val_fraction`` of the characters, one document at least on each side; one document is cut."""
    total = sum(lengths)
    want = val_fraction * total
    if len(lengths) == 1:
        cut = min(max(1, int(round(total * (1.0 - val_fraction)))), total - 1)
        return 0, cut
    acc, k = 0, len(lengths)
    while k > 1 and acc < want:
        k -= 1
        acc += lengths[k]
    return k, 0


class _TokenWriter:
    """Token ids appended to a file as ``dtype``, counted."""

    def __init__(self, path: Path, dtype):
        self.f = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.dtype, self.count = dtype, 0

    def write(self, ids: np.ndarray) -> None:
        ids.astype(self.dtype, copy=False).tofile(self.f)
        self.count += int(ids.size)

    def close(self) -> None:
        self.f.close()


@dataclass
class PrepareResult:
    out: Path
    vocab_size: int
    dtype: str
    eod_id: int
    train_tokens: int
    val_tokens: int
    train_documents: int
    val_documents: int


def _progress_bar(total: Optional[int], enabled: bool, desc: str):
    if not (enabled and sys.stderr.isatty()):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="char", unit_scale=True, dynamic_ncols=True, file=sys.stderr)


def _check_args(inputs, tokenizer, train_tokenizer, val_fraction, documents) -> None:
    from .._checks import is_int, is_real
    from .data.tokenizer import MAX_VOCAB, MIN_BPE_VOCAB

    if not inputs:
        raise ConfigError("prepare-text needs at least one input text file or directory")
    for name in inputs:
        check_path_option("inputs", name)
    if (tokenizer is None) == (train_tokenizer is None):
        raise ConfigError("give one of --tokenizer PATH (a tokenizer.json or a tokenizer folder) and "
                         "--train-tokenizer N (train a byte-level BPE of N tokens)")
    if train_tokenizer is not None and not (is_int(train_tokenizer) and MIN_BPE_VOCAB <= train_tokenizer <= MAX_VOCAB):
        raise ConfigError(f"--train-tokenizer must be an integer in [{MIN_BPE_VOCAB}, {MAX_VOCAB}] (the 256 bytes and "
                          f"the end-of-document token at least), got {train_tokenizer!r}")
    if not (is_real(val_fraction) and 0.0 < val_fraction < 1.0):
        raise ConfigError(f"--val-fraction must be in (0, 1), got {val_fraction!r}")
    if documents not in ("file", "blank-line"):
        raise ConfigError(f"--documents must be 'file' or 'blank-line', got {documents!r}")


def prepare_text(inputs: Sequence[str], out, *, tokenizer: Optional[str] = None, train_tokenizer: Optional[int] = None,
                 documents: str = "file", eod_token: Optional[str] = None, val_fraction: float = 0.1,
                 overwrite: bool = False, progress: bool = True, say=print) -> PrepareResult:
    """Tokenize ``inputs`` into ``out/train.bin``, ``val.bin``, ``tokenizer.json`` and ``meta.json``
    (see the module docstring). Arguments are checked before any file is read."""
    from .data.tokenizer import native_errors
    from .data.tokens import TOKEN_DTYPES
    from .train.outputs import check_output_dir, staged_output

    _check_args(inputs, tokenizer, train_tokenizer, val_fraction, documents)
    files = input_files(inputs)
    check_output_dir(out, overwrite=overwrite)
    if tokenizer is not None:  # its errors before the long pass over the text
        tok, described, added = _tokenizer(tokenizer, None, eod_token, None)
    # pass 1: the documents' lengths, for the split
    lengths: List[int] = []
    size = 0
    bar = _progress_bar(None, progress, "scan")
    for piece, end in iter_pieces(files, documents):
        size += len(piece)
        if end:
            lengths.append(size)
            size = 0
        if bar is not None:
            bar.update(len(piece))
    if bar is not None:
        bar.close()
    if not lengths:
        raise ConfigError(f"the inputs hold no text ({len(files)} file(s), all empty)")
    if len(lengths) == 1 and lengths[0] < 2:
        raise ConfigError("the inputs hold a single character; nothing to split into train and val")
    first_val, keep = _split_point(lengths, val_fraction)

    def split_pieces(train_only: bool = False) -> Iterator[Tuple[str, str, bool]]:
        """(split, text, ends_document): the pieces of pass 1, the cut document's split at ``keep``."""
        doc, pos = 0, 0
        for piece, end in iter_pieces(files, documents):
            if doc < first_val:
                yield "train", piece, end
            elif doc == first_val and pos < keep:
                if pos + len(piece) < keep:
                    yield "train", piece, False
                else:
                    yield "train", piece[:keep - pos], True
                    if not train_only:
                        yield "val", piece[keep - pos:], end
            elif train_only:
                return
            else:
                yield "val", piece, end
            pos = 0 if end else pos + len(piece)
            doc += int(end)

    if train_tokenizer is not None:
        say(f"training a byte-level BPE of {train_tokenizer} tokens on {first_val + (1 if keep else 0)} document(s)")
        tok, described, added = _tokenizer(None, train_tokenizer, eod_token,
                                           lambda: (text for _, text, _ in split_pieces(train_only=True)))
    elif added:
        say(f"note: the tokenizer has no {tok.eod_token!r}; added it as a special token (id {tok.eod_id})")
    eod, eod_id = tok.eod_token, tok.eod_id
    vocab_size = tok.vocab_size
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    counts = {"train": 0, "val": 0}
    with staged_output(out, overwrite=overwrite) as stage:
        writers = {s: _TokenWriter(stage / f"{s}.bin", TOKEN_DTYPES[dtype]) for s in ("train", "val")}
        bar = _progress_bar(sum(lengths), progress, "tokenize")
        try:
            batch: List[Tuple[str, str, bool]] = []
            size = 0

            def flush():
                try:
                    with native_errors(f"tokenizer {described!r} failed on the text"):
                        encoded = tok.backend.encode_batch([text for _, text, _ in batch], add_special_tokens=False)
                except ValueError as err:
                    raise ConfigError(str(err)) from None
                ids: dict = {"train": [], "val": []}
                for (split, text, end), enc in zip(batch, encoded):
                    ids[split] += enc.ids + [eod_id] if end else enc.ids
                    counts[split] += int(end)
                for split, part in ids.items():  # one write per split and batch
                    writers[split].write(np.asarray(part, dtype=np.int64))
                if bar is not None:
                    bar.update(sum(len(text) for _, text, _ in batch))
                batch.clear()

            for item in split_pieces():
                batch.append(item)
                size += len(item[1])
                if size >= BATCH_CHARS:
                    flush()
                    size = 0
            flush()
        finally:
            for w in writers.values():
                w.close()
            if bar is not None:
                bar.close()
        tok.backend.save(str(stage / "tokenizer.json"))
        meta = {"vocab_size": vocab_size, "dtype": dtype, "eod_id": eod_id, "eod_token": eod,
                "tokenizer": described, "tokenizer_file": "tokenizer.json",
                "train_tokens": writers["train"].count, "val_tokens": writers["val"].count,
                "train_documents": counts["train"], "val_documents": counts["val"],
                "documents": documents, "val_fraction": val_fraction, "sources": [str(f) for f in files]}
        (stage / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return PrepareResult(Path(out), vocab_size, dtype, eod_id, writers["train"].count, writers["val"].count,
                         counts["train"], counts["val"])


# ---------------------------------------------------------------------------------- command
@dataclass
class PrepareTextConfig:
    """``whiteformer prepare-text``: tokenize text files into the token files of ``--dataset tokens``.

    Writes train.bin / val.bin / meta.json / tokenizer.json for whiteformer train --dataset tokens --data-dir OUT."""

    inputs: List[str] = _h("UTF-8 text files (.gz / .xz read compressed) or directories (their *.txt[.gz|.xz] "
                           "files), the words before or between the options", default_factory=list)
    out: Optional[str] = _h("output directory (missing or empty unless --overwrite; required)", path=True,
                            default=None)
    tokenizer: Optional[str] = _h("a tokenizer.json, or a tokenizer folder (tokenizer.json / transformers)",
                                  path=True, default=None)
    train_tokenizer: Optional[int] = _h("train a byte-level BPE of this many tokens on the training documents "
                                        "instead", default=None)
    documents: str = _h("what one document is: a whole file (file), or a run of non-blank lines (blank-line)",
                        default="file")
    eod_token: Optional[str] = _h("end-of-document token text (none: the tokenizer's eos token, else "
                                  "<|endoftext|>)", default=None)
    val_fraction: float = _h("share of the characters (last documents) that form val.bin", default=0.1)
    overwrite: bool = _h("replace train.bin / val.bin / meta.json / tokenizer.json in a non-empty --out (other "
                         "files are kept)", default=False)
    progress: bool = _h("a progress bar on a terminal (--no-progress: none)", default=True)

    def validate(self) -> None:
        if self.out is None:
            raise ConfigError("prepare-text needs --out DIR (see whiteformer prepare-text --help)")
        _check_args(self.inputs, self.tokenizer, self.train_tokenizer, self.val_fraction, self.documents)


def run(args: argparse.Namespace) -> int:
    """``whiteformer prepare-text``: ``args`` parsed by :mod:`whiteformer.app.cli` (``-c FILE`` and
    ``args.overrides``: the input files and the options)."""
    from .config import config_from_args
    from .train.outputs import say

    cfg = config_from_args(PrepareTextConfig, args, positional="inputs")
    res = prepare_text(cfg.inputs, cfg.out, tokenizer=cfg.tokenizer, train_tokenizer=cfg.train_tokenizer,
                       documents=cfg.documents, eod_token=cfg.eod_token, val_fraction=cfg.val_fraction,
                       overwrite=cfg.overwrite, progress=cfg.progress, say=say)
    say(f"train.bin: {res.train_tokens} tokens ({res.train_documents} documents), val.bin: {res.val_tokens} tokens "
        f"({res.val_documents} documents); vocabulary {res.vocab_size} ({res.dtype}), end-of-document id {res.eod_id}")
    say(f"data: {res.out} (whiteformer train --dataset tokens --data-dir {res.out} ...)")
    return 0
