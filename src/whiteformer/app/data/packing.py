"""Packed documents: a batch of training windows cut from a token stream whose documents end
with an end-of-document token, laid out as the one row of ``cu_seqlens`` documents that the
language models read (:meth:`whiteformer.models.lm.CausalLM.forward`).

Each window of ``block_size`` tokens splits after every end-of-document token: a document keeps
its end token (the model learns to end documents) and a window's first and last documents may be
pieces of longer ones. The ``B`` windows of a batch become one row of ``B * block_size`` tokens
whose ``cu_seqlens`` hold every document boundary and every window boundary, so no token attends
across either and the positions restart at 0 in each document.

Targets follow the packed-sequence convention of ``transformers``' ``DataCollatorWithFlattening``
(and the models' own rule for ``cu_seqlens``): every token predicts the next token of its own
document; the last token of each document in the window (its end token, or the window's last
token) predicts nothing (target ``-1``). So the loss of a packed batch is the loss of its
documents run alone, and no target crosses a boundary: a document's first token is never the
target of the previous document's last.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..._checks import is_int

__all__ = ["PackedWindows", "pack_windows", "resolve_eod_id"]


class PackedWindows(NamedTuple):
    """The inputs of a packed batch: ``idx`` (1, B * T) token ids and ``cu_seqlens`` (S + 1,) int32
    (FlashAttention's convention: document ``s`` is ``idx[0, cu_seqlens[s]:cu_seqlens[s + 1]]``)."""

    idx: torch.Tensor
    cu_seqlens: torch.Tensor

    def to(self, device, non_blocking: bool = False) -> "PackedWindows":
        return PackedWindows(self.idx.to(device, non_blocking=non_blocking),
                             self.cu_seqlens.to(device, non_blocking=non_blocking))


def pack_windows(x: torch.Tensor, y: torch.Tensor, eod_id: int):
    """Windows ``x`` (B, T) of a token stream and their next tokens ``y`` (B, T) ->
    ``(PackedWindows(idx (1, B * T), cu_seqlens (S + 1,) int32), targets (1, B * T))`` with the
    documents split after each ``eod_id`` token and at each window's end, and ``targets`` = ``y``
    with ``-1`` at each document's last token (see the module docstring)."""
    ends = x == eod_id
    ends[:, -1] = True  # a window's last token ends its last document
    flat = ends.reshape(-1)
    bounds = torch.nonzero(flat).flatten() + 1
    cu = torch.cat([bounds.new_zeros(1), bounds]).to(torch.int32)
    targets = y.long().masked_fill(ends, -1).reshape(1, -1)
    return PackedWindows(x.reshape(1, -1), cu), targets


def resolve_eod_id(vocab, vocab_size: int, eod_id=None, eod: Optional[str] = None, name: str = "dataset") -> int:
    """The end-of-document token id of packed windows: ``eod_id`` (an int in [0, vocab_size)), else
    the id of the token ``eod`` in ``vocab`` (a character of a character vocabulary: ``stoi``; or a
    token of a tokenizer: ``token_to_id``), else the vocabulary's own ``eod_id`` (a tokenizer's
    end-of-text token). A clear ``ValueError`` when none gives one."""
    if eod_id is not None and eod is not None:
        raise ValueError(f"{name}: give the end-of-document token as eod_id or eod, not both")
    if eod is not None:
        if not isinstance(eod, str) or not eod:
            raise TypeError(f"{name}: eod must be a non-empty string (the end-of-document token), got {eod!r}")
        lookup = getattr(vocab, "token_to_id", None)
        eod_id = lookup(eod) if callable(lookup) else getattr(vocab, "stoi", {}).get(eod)
        if eod_id is None:
            raise ValueError(f"{name}: the end-of-document token eod={eod!r} is not in the vocabulary")
    if eod_id is None:
        eod_id = getattr(vocab, "eod_id", None)
    if eod_id is None:
        raise ValueError(f"{name}: pack=true needs an end-of-document token: give data_args.eod_id=ID or "
                         f"data_args.eod=TOKEN (for a character vocabulary, the character that ends each document, "
                         f"e.g. a newline; token files: the eod_id of meta.json)")
    if not is_int(eod_id) or not 0 <= eod_id < vocab_size:
        raise ValueError(f"{name}: eod_id must be a token id in [0, {vocab_size - 1}], got {eod_id!r}")
    return int(eod_id)
