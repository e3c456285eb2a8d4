"""Byte-level document classification and document matching on Shakespeare's plays: offline
stand-ins for LRA Text (IMDB reviews, Maas et al., 2011) and LRA Retrieval (ACL Anthology pairs,
Radev et al., 2013).

A corpus (default: the shipped ``corpus/shakespeare_small.txt``, *Julius Caesar* and *King Lear*;
``path`` takes any Gutenberg-style file such as Shakespeare's complete works, ``complete_works.txt.xz``)
is cut into plays at their title lines (a title, a blank line, ``by William Shakespeare``) and each
play into **speeches**: blank-line separated blocks whose first line is a speaker name ending in
``.`` (``BRUTUS.``, ``Kent.``). The speaker lines are dropped, so the model reads only what is said.

A document is a run of consecutive speeches of one play, joined by newlines and cut to a length
drawn uniformly in [``min_length``, ``max_length``] bytes. The first ``1 - test_fraction`` of each
play's speeches feed the "train" split, the rest "test", so no text is shared between the splits.

- ``shakespeare-plays``: which play a document comes from (classes = the plays; 2 for the shipped
  corpus, binary like IMDB), classes balanced;
- ``shakespeare-pairs``: do two documents come from the same play (label 1) or not (0), balanced;
  tokens (N, 2, L) for a dual encoder.

Tokens are UTF-8 bytes + 1 (vocabulary 257), padding id 0 on the right (the LRA byte-level setup).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from ..._checks import is_int
from .base import SequenceDataset
from .registry import check_split, register_dataset
from .text import default_corpus_path, read_text

__all__ = ["split_plays", "speeches", "plays", "play_pairs", "BYTE_VOCAB"]

BYTE_VOCAB: List[str] = ["<pad>"] + [f"<{b:02x}>" if not 32 <= b < 127 else chr(b) for b in range(256)]
_HEADINGS = ("ACT ", "SCENE", "Scene ", "PERSONS", "THE END", "Dramatis")


def split_plays(text: str) -> List[Tuple[str, str]]:
    """``(title, text)`` of each work headed by a title line followed by ``by William Shakespeare``."""
    lines = text.split("\n")
    heads = [i - 2 for i, line in enumerate(lines)
             if line.strip() == "by William Shakespeare" and i >= 2 and lines[i - 2].strip()]
    return [(lines[h].strip(), "\n".join(lines[h + 3:(heads[k + 1] if k + 1 < len(heads) else len(lines))]))
            for k, h in enumerate(heads)]


def speeches(play_text: str) -> List[str]:
    """What is said in each speech of a play (speaker lines, headings and stage-direction blocks
    dropped), in order."""
    out = []
    for block in play_text.split("\n\n"):
        lines = [ln.rstrip() for ln in block.strip("\n").split("\n")]
        if len(lines) < 2:
            continue
        head = lines[0].strip()
        if not head.endswith(".") or len(head) > 40 or head.startswith("[") or head.startswith(_HEADINGS):
            continue
        body = "\n".join(ln.strip() for ln in lines[1:] if ln.strip())
        if body:
            out.append(body)
    return out


def _load(path: Optional[str], min_speeches: int, max_plays: Optional[int]) -> Dict[str, List[str]]:
    src = path if path is not None else default_corpus_path()
    works = [(t, speeches(body)) for t, body in split_plays(read_text(src))]
    found = {t: sp for t, sp in works if len(sp) >= min_speeches}
    if max_plays is not None:
        found = dict(list(found.items())[:max_plays])
    if len(found) < 2:
        raise ValueError(f"{str(src)!r}: found {len(found)} play(s) with >= {min_speeches} speeches; need at least 2 "
                         "(titles followed by 'by William Shakespeare', speeches headed by a speaker line)")
    return found


class _Documents:
    """Draws documents of one split: runs of consecutive speeches of a play, cut to a random length."""

    def __init__(self, by_play: Dict[str, List[str]], split: str, test_fraction: float, min_length: int,
                 max_length: int, rng: np.random.Generator):
        self.parts = []
        for sp in by_play.values():
            cut = int(round(len(sp) * (1.0 - test_fraction)))
            part = sp[:cut] if split == "train" else sp[cut:]
            if not part:
                raise ValueError("test_fraction leaves a split without speeches; choose it in (0, 1)")
            self.parts.append(part)
        self.min_length, self.max_length, self.rng = min_length, max_length, rng

    def draw(self, play: int) -> bytes:
        part = self.parts[play]
        target = int(self.rng.integers(self.min_length, self.max_length + 1))
        i = int(self.rng.integers(len(part)))
        out = b""
        while len(out) < target:  # wraps around within the split's speeches
            out += part[i % len(part)].encode("utf-8") + b"\n"
            i += 1
        return out[:target]


def _encode(docs: List[bytes], max_length: int) -> Tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.zeros(len(docs), max_length, dtype=torch.long)
    for k, d in enumerate(docs):
        tokens[k, :len(d)] = torch.from_numpy(np.frombuffer(d, dtype=np.uint8).astype(np.int64) + 1)
    return tokens, torch.tensor([len(d) for d in docs], dtype=torch.long)


def _prepare(name, split, n_train, n_test, path, min_length, max_length, test_fraction, max_plays, min_speeches,
             seed, stream):
    """(split, n, plays' speeches, document drawer, rng) of one split, arguments checked."""
    split = check_split(name, split)
    n = n_train if split == "train" else n_test
    if not is_int(n) or n <= 0:
        raise ValueError(f"num_{split} must be a positive integer, got {n!r}")
    if not 1 <= min_length <= max_length:
        raise ValueError(f"need 1 <= min_length <= max_length, got {min_length}, {max_length}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    by_play = _load(path, min_speeches, max_plays)
    rng = np.random.default_rng([seed, 0 if split == "train" else 1, stream])
    return split, n, by_play, _Documents(by_play, split, test_fraction, min_length, max_length, rng), rng


@register_dataset("shakespeare-plays", reads="file",
                  help="which play a byte-level document comes from (LRA Text / IMDB stand-in)")
def plays(split: str = "train", path: Optional[str] = None, data_dir: Optional[str] = None, num_train: int = 2000,
          num_test: int = 500, min_length: int = 256, max_length: int = 1024, test_fraction: float = 0.2,
          max_plays: Optional[int] = None, min_speeches: int = 50, seed: int = 0) -> SequenceDataset:
    """Which play a byte-level document comes from (see module docstring); "val" = "test"."""
    split, n, by_play, docs, rng = _prepare("shakespeare-plays", split, num_train, num_test, path or data_dir,
                                            min_length, max_length, test_fraction, max_plays, min_speeches, seed, 11)
    labels = rng.permutation(np.arange(n) % len(by_play))
    tokens, lengths = _encode([docs.draw(int(c)) for c in labels], max_length)
    return SequenceDataset(tokens, lengths, torch.from_numpy(labels.astype(np.int64)), len(by_play), BYTE_VOCAB,
                           pad_id=0, name=f"shakespeare-plays/{split}", kind="tokens", classes=list(by_play))


@register_dataset("shakespeare-pairs", reads="file",
                  help="whether two byte-level documents come from the same play (LRA Retrieval stand-in)")
def play_pairs(split: str = "train", path: Optional[str] = None, data_dir: Optional[str] = None,
               num_train: int = 2000, num_test: int = 500, min_length: int = 256, max_length: int = 1024,
               test_fraction: float = 0.2, max_plays: Optional[int] = None, min_speeches: int = 50,
               seed: int = 0) -> SequenceDataset:
    """Do two byte-level documents come from the same play (1) or not (0); tokens (N, 2, L)."""
    split, n, by_play, docs, rng = _prepare("shakespeare-pairs", split, num_train, num_test, path or data_dir,
                                            min_length, max_length, test_fraction, max_plays, min_speeches, seed, 13)
    labels = rng.permutation(np.arange(n) % 2)
    k = len(by_play)
    first, second = [], []
    for same in labels:
        a = int(rng.integers(k))
        b = a if same else (a + 1 + int(rng.integers(k - 1))) % k
        first.append(docs.draw(a))
        second.append(docs.draw(b))
    t1, l1 = _encode(first, max_length)
    t2, l2 = _encode(second, max_length)
    return SequenceDataset(torch.stack([t1, t2], 1), torch.stack([l1, l2], 1), torch.from_numpy(labels.astype(np.int64)),
                           2, BYTE_VOCAB, pad_id=0, name=f"shakespeare-pairs/{split}", kind="tokens",
                           classes=["different", "same"])
