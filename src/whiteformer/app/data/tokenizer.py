"""Subword tokenizers of the language-model data, built on the ``tokenizers`` library.

- :func:`load_tokenizer`: a ``tokenizer.json`` file (``tokenizers``), or a folder that transformers'
  ``AutoTokenizer`` loads (a fast tokenizer: its ``tokenizers`` backend is used).
- :func:`train_bpe`: a byte-level BPE (GPT-2's scheme: the 256 bytes, merges learnt from the text,
  and the end-of-document token :data:`EOD_TOKEN`) of a chosen vocabulary size.
- :func:`char_tokenizer`: the character vocabulary of ``--dataset text`` as a ``tokenizers``
  word-level tokenizer (one token per character), so that it too is saved as transformers' files.

A :class:`TextTokenizer` is the backend with its end-of-document token (``eod_token`` / ``eod_id``,
which packed documents end with); :meth:`TextTokenizer.files` are the files ``transformers``
reads beside a model (``tokenizer.json``, ``tokenizer_config.json`` and, when there is an
end-of-document token, a ``generation_config.json`` that stops generation at it).

Needs ``tokenizers`` (``pip install 'whiteformer[data]'``; transformers brings it too); loading a
folder and writing ``tokenizer_config.json`` need ``transformers`` (``pip install 'whiteformer[hf]'``).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from ..._checks import is_int
from ..._nesting import parse_bounded

__all__ = ["EOD_TOKEN", "TextTokenizer", "load_tokenizer", "train_bpe", "check_bpe_size", "char_tokenizer",
           "same_tokenizer", "text_chunks", "is_panic", "native_errors",
           "check_tokenizer_file", "MAX_VOCAB"]

#: the end-of-document token of the trained tokenizers (GPT-2's)
EOD_TOKEN = "<|endoftext|>"
#: special tokens taken as end-of-document in a loaded ``tokenizer.json``, in order of preference
EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
#: byte-level BPE: the 256 bytes and the end-of-document token come before any merge
MIN_BPE_VOCAB = 257
#: the largest vocabulary read or trained (2**24 ids; the largest published ones hold about 2**18)
MAX_VOCAB = 1 << 24
#: the largest tokenizer.json read (the largest published ones are some tens of MB)
MAX_TOKENIZER_BYTES = 1 << 29
_CHUNK = 1 << 20


def _tokenizers():
    try:
        import tokenizers
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("subword tokenizers need the 'tokenizers' package: pip install 'whiteformer[data]'") \
            from err
    return tokenizers


def is_panic(err: BaseException) -> bool:
    """A Rust library's panic surfaced by pyo3 (``pyo3_runtime.PanicException``, which derives from
    ``BaseException``, not ``Exception``): e.g. ``tokenizers`` when a pre-tokenizer's regular
    expression backtracks past its limit."""
    return type(err).__name__ == "PanicException"


def describe_panic(err: BaseException) -> str:
    """The first line of a panic's message, with a hint for a tokenizer's regex."""
    first = (str(err).strip().splitlines() or ["(no message)"])[0]
    hint = (" (a regular expression of the tokenizer backtracks too much on this text: simplify its pattern)"
            if "retry-limit" in first or "Regex" in first else "")
    return first + hint


@contextmanager
def native_errors(what: str) -> Iterator[None]:
    """A panic of the ``tokenizers`` library inside the block -> ``ValueError`` "{what}: ...".
    What the native code writes to the standard error meanwhile (Rust's panic report) is held back
    and dropped with a panic, so that the error is one line; anything else it wrote is passed on."""
    with tempfile.TemporaryFile() as held:
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError, AttributeError):  # no file descriptor 2 to hold back
            saved = None
        if saved is not None:
            os.dup2(held.fileno(), 2)
        panicked = False
        try:
            yield
        except BaseException as err:  # noqa: BLE001 - only a panic is converted, the rest re-raised
            if not is_panic(err):
                raise
            panicked = True
            raise ValueError(f"{what}: {describe_panic(err)}") from None
        finally:
            if saved is not None:
                os.dup2(saved, 2)
                os.close(saved)
                if not panicked and held.tell():
                    held.seek(0)
                    os.write(2, held.read())


def text_chunks(text: str, size: int = _CHUNK) -> Iterator[str]:
    """``text`` in pieces of about ``size`` characters, each ending at a line end where there is one
    (as transformers' ``run_clm`` reads a text file line by line); their concatenation is ``text``."""
    start = 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            nl = text.rfind("\n", start, end)
            end = nl + 1 if nl >= start else end
        yield text[start:end]
        start = end


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` (``backend``) with its end-of-document token.

    Attributes: ``eod_token`` (str or None), ``eod_id`` (int or None), ``bos_token`` (the token
    transformers' tokenizer calls ``bos_token``; default the end-of-document token, as GPT-2's),
    ``vocab_size`` (the largest id + 1: what a model's embedding must cover).
    """

    unit = "token"

    def __init__(self, backend, eod_token: Optional[str] = None, bos_token: Optional[str] = None):
        self.backend = backend
        vocab = backend.get_vocab(with_added_tokens=True)
        if not vocab:
            raise ValueError("the tokenizer has an empty vocabulary")
        for name, tok in (("eod_token", eod_token), ("bos_token", bos_token)):
            if tok is not None and tok not in vocab:
                raise ValueError(f"{name} {tok!r} is not in the tokenizer's vocabulary")
        self.eod_token = eod_token
        self.eod_id: Optional[int] = vocab[eod_token] if eod_token is not None else None
        self.bos_token = bos_token if bos_token is not None else eod_token
        self.vocab_size = max(vocab.values()) + 1
        self._files: Dict[Optional[int], Dict[str, str]] = {}

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str) -> torch.Tensor:
        """(T,) int64 ids of ``text`` (no special tokens added; an end-of-document token written in
        the text is one token)."""
        try:
            with native_errors("the tokenizer failed on the text"):
                ids = self.backend.encode(text, add_special_tokens=False).ids
        except ValueError:
            raise
        except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception (a character it lacks)
            raise ValueError(f"cannot encode the text: {err}") from None
        return torch.tensor(ids, dtype=torch.long)

    def encode_corpus(self, text: str, chunk_size: int = _CHUNK) -> torch.Tensor:
        """(T,) int64 ids of a long text, encoded in line-aligned pieces of about ``chunk_size``
        characters (:func:`text_chunks`) in parallel."""
        with native_errors("the tokenizer failed on the text"):
            encoded = self.backend.encode_batch(list(text_chunks(text, chunk_size)), add_special_tokens=False)
        parts = [np.asarray(e.ids, dtype=np.int64) for e in encoded]
        return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))

    def token_to_id(self, token: str) -> Optional[int]:
        """The id of ``token`` (a special token such as ``<|endoftext|>`` too), or None."""
        return self.backend.token_to_id(token)

    def decode(self, ids) -> str:
        ids = ids.tolist() if isinstance(ids, (torch.Tensor, np.ndarray)) else list(ids)
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_transformers(self, model_max_length: Optional[int] = None):
        """transformers' fast tokenizer of this backend, with ``eos_token`` / ``bos_token`` set."""
        try:
            from transformers import PreTrainedTokenizerFast
        except ImportError as err:
            raise ImportError("a transformers tokenizer needs transformers: pip install 'whiteformer[hf]'") from err
        kw = {} if model_max_length is None else {"model_max_length": int(model_max_length)}
        if self.eod_token is not None:
            kw["eos_token"] = self.eod_token
        if self.bos_token is not None:
            kw["bos_token"] = self.bos_token
        return PreTrainedTokenizerFast(tokenizer_object=self.backend, **kw)

    def files(self, model_max_length: Optional[int] = None) -> Dict[str, str]:
        """{file name: text} of the files transformers reads beside a model: what
        ``save_pretrained`` of :meth:`to_transformers` writes, and ``generation_config.json`` (stop
        at the end-of-document token) when there is one. Without transformers: ``tokenizer.json``.
        Made once per ``model_max_length`` (every checkpoint of a run saves them)."""
        if model_max_length not in self._files:
            self._files[model_max_length] = self._make_files(model_max_length)
        return dict(self._files[model_max_length])

    def _make_files(self, model_max_length: Optional[int]) -> Dict[str, str]:
        try:
            hf = self.to_transformers(model_max_length)
        except ImportError:
            return {"tokenizer.json": self.backend.to_str()}
        with tempfile.TemporaryDirectory() as tmp:
            hf.save_pretrained(tmp)
            files = {name: (Path(tmp) / name).read_text(encoding="utf-8") for name in sorted(os.listdir(tmp))}
        if self.eod_id is not None:
            bos = self.backend.token_to_id(self.bos_token)
            files["generation_config.json"] = json.dumps(
                {"bos_token_id": bos, "eos_token_id": self.eod_id, "pad_token_id": self.eod_id}, indent=2) + "\n"
        return files


def same_tokenizer(a: str, b: str) -> bool:
    """Whether two ``tokenizer.json`` texts give the same ids (the same model -- vocabulary, merges --
    and the same added tokens), whatever their formatting or the library version that wrote them."""
    try:
        ja, jb = json.loads(a), json.loads(b)
    except ValueError:
        return False

    def added(j):
        return sorted((t.get("id"), t.get("content")) for t in j.get("added_tokens") or [] if isinstance(t, dict))

    return isinstance(ja, dict) and isinstance(jb, dict) and ja.get("model") == jb.get("model") and \
        added(ja) == added(jb)


def _find_eod(backend) -> Optional[str]:
    special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    return next((t for t in EOD_CANDIDATES if t in special), None)


def load_tokenizer(path: Union[str, os.PathLike], eod_token: Optional[str] = None) -> TextTokenizer:
    """The tokenizer at ``path``: a ``tokenizer.json`` file, or a folder that transformers'
    ``AutoTokenizer`` loads (nothing is downloaded). ``eod_token``: the end-of-document token
    (default: the folder's ``eos_token``; for a file, the first special token of :data:`EOD_CANDIDATES`)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"tokenizer must be a path (a tokenizer.json or a tokenizer folder), got {type(path).__name__}")
    p = Path(os.path.expanduser(str(path)))
    if not p.exists():
        raise FileNotFoundError(f"tokenizer {str(p)!r} does not exist (give a tokenizer.json or a tokenizer folder)")
    if p.is_dir():
        return _load_folder(p, eod_token)
    check_tokenizer_file(p)
    tk = _tokenizers()
    try:
        backend = tk.Tokenizer.from_file(str(p))
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception on a bad file
        raise ValueError(f"tokenizer {str(p)!r} is not a tokenizers tokenizer.json: {err}") from None
    return TextTokenizer(backend, eod_token if eod_token is not None else _find_eod(backend))


def check_tokenizer_file(path: Path) -> None:
    """``ValueError`` unless ``path`` is a ``tokenizer.json`` of bounded size whose vocabulary ids
    (the model's ``vocab`` and the ``added_tokens``) are integers in [0, :data:`MAX_VOCAB`): read
    with Python's parser (nesting bounded) before ``tokenizers`` sizes its tables by the largest id,
    where a 5 KB file naming id 4,000,000,000 made it allocate 17 GB and abort the process."""
    size = path.stat().st_size
    if size > MAX_TOKENIZER_BYTES:
        raise ValueError(f"tokenizer {str(path)!r} has {size} bytes, more than a tokenizer.json holds (at most "
                         f"{MAX_TOKENIZER_BYTES})")
    try:
        spec = parse_bounded(lambda: json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, UnicodeDecodeError) as err:  # (NestingError is a ValueError)
        raise ValueError(f"tokenizer {str(path)!r} is not a tokenizers tokenizer.json: {err}") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        raise ValueError(f"tokenizer {str(path)!r} is not a tokenizers tokenizer.json (a JSON object with a 'model')")
    vocab = spec["model"].get("vocab")
    ids = list(vocab.values()) if isinstance(vocab, dict) else []
    added = spec.get("added_tokens") or []
    if not isinstance(added, list):
        raise ValueError(f"tokenizer {str(path)!r}: added_tokens must be a list, got {type(added).__name__}")
    ids += [t.get("id") for t in added if isinstance(t, dict)]
    if isinstance(vocab, list) and len(vocab) > MAX_VOCAB:  # (a Unigram model: ids are the positions)
        ids.append(len(vocab) - 1)
    bad = [i for i in ids if not (is_int(i) and 0 <= i < MAX_VOCAB)]
    if bad:
        raise ValueError(f"tokenizer {str(path)!r} has a vocabulary id {bad[0]!r}; ids must be integers in "
                         f"[0, {MAX_VOCAB}) (no vocabulary is larger)")


#: the JSON files transformers' AutoTokenizer reads from a folder besides tokenizer.json
FOLDER_JSON = ("config.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def _check_folder_json(p: Path) -> None:
    """The JSON files AutoTokenizer reads from ``p``, parsed here first with their nesting bounded
    (a file nested 100,000 levels deep was a ``RecursionError`` inside transformers)."""
    for name in FOLDER_JSON:
        f = p / name
        if f.is_file():
            try:
                parse_bounded(lambda: json.loads(f.read_text(encoding="utf-8")))
            except (ValueError, UnicodeDecodeError) as err:  # (NestingError is a ValueError)
                raise ValueError(f"tokenizer folder {str(p)!r}: {name} is not valid JSON: {err}") from None


def _load_folder(p: Path, eod_token: Optional[str]) -> TextTokenizer:
    if (p / "tokenizer.json").is_file():  # what AutoTokenizer reads first
        check_tokenizer_file(p / "tokenizer.json")
    _check_folder_json(p)
    try:
        from transformers import AutoTokenizer
    except ImportError as err:
        raise ImportError(f"tokenizer folder {str(p)!r} is read by transformers' AutoTokenizer: pip install "
                          f"'whiteformer[hf]' (or give its tokenizer.json)") from err
    try:
        hf = AutoTokenizer.from_pretrained(str(p), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, RecursionError) as err:
        raise ValueError(f"tokenizer folder {str(p)!r} is not one AutoTokenizer loads: "
                         f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"tokenizer folder {str(p)!r} holds a slow (Python) tokenizer; save it as a fast one "
                         f"(tokenizer.json) to use it")
    eod = eod_token if eod_token is not None else (hf.eos_token or _find_eod(backend))
    return TextTokenizer(backend, eod, hf.bos_token)


def check_bpe_size(vocab_size) -> None:
    """``ValueError`` unless ``vocab_size`` is an int of at least :data:`MIN_BPE_VOCAB`."""
    if not is_int(vocab_size) or vocab_size < MIN_BPE_VOCAB:
        raise ValueError(f"train_tokenizer must be a vocabulary size of at least {MIN_BPE_VOCAB} (the 256 bytes "
                         f"and the end-of-document token), got {vocab_size!r}")


def train_bpe(texts: Union[str, Iterable[str]], vocab_size: int, eod_token: str = EOD_TOKEN) -> TextTokenizer:
    """A byte-level BPE of ``vocab_size`` tokens (the 256 bytes, ``eod_token`` and the merges
    learnt from ``texts``, one string or an iterable of them) with ``ByteLevel`` pre-tokenizer and
    decoder, as GPT-2's. A text too small to learn that many merges gives fewer tokens."""
    check_bpe_size(vocab_size)
    tk = _tokenizers()
    backend = tk.Tokenizer(tk.models.BPE())
    backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eod_token], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    pieces = text_chunks(texts) if isinstance(texts, str) else (c for t in texts for c in text_chunks(t))
    backend.train_from_iterator(pieces, trainer=trainer)
    return TextTokenizer(backend, eod_token)


def char_tokenizer(chars: Sequence[str]) -> TextTokenizer:
    """One token per character, character ``chars[i]`` -> id ``i`` (a word-level model over a split
    into single characters; decoding joins them). A character outside ``chars`` is an error."""
    tk = _tokenizers()
    backend = tk.Tokenizer(tk.models.WordLevel({c: i for i, c in enumerate(chars)}))
    backend.pre_tokenizer = tk.pre_tokenizers.Split(tk.Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = tk.decoders.Fuse()
    return TextTokenizer(backend)
