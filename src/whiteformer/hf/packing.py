"""Packed batches from ``transformers`` (``DataCollatorWithFlattening``) -> ``cu_seqlens``.

The collator concatenates the documents of a batch into one row, ``input_ids`` (1, T), with
``position_ids`` restarting at 0 at each document and, with ``return_flash_attn_kwargs=True``,
``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32 (S + 1,)). The wrappers turn either into the
``cu_seqlens`` of the whiteformer language models; positions they cannot honour raise.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from .._checks import check_instance, check_integer_tensor
from .._compile import compile_disabled

__all__ = ["packed_cu_seqlens", "mask_document_starts"]


def _from_position_ids(position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], batch: int,
                       tokens: int) -> Optional[torch.Tensor]:
    """None when ``position_ids`` are the ordinary ones (what the model derives from the mask),
    the documents' ``cu_seqlens`` when they restart at 0 in one unpadded row, else ``ValueError``
    (also for a shape other than the (batch, tokens) of ``input_ids``)."""
    check_integer_tensor(position_ids, "position_ids")
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    if position_ids.dim() != 2 or position_ids.shape[1] != tokens or position_ids.shape[0] not in (1, batch):
        raise ValueError(f"position_ids must have shape (B, T) = ({batch}, {tokens}) (or (1, T), (T,)), got "
                         f"{tuple(position_ids.shape)}")
    b, t = position_ids.shape
    if attention_mask is None:
        real = torch.ones(b, t, dtype=torch.bool, device=position_ids.device)
    else:
        real = attention_mask.to(position_ids.device) != 0
    expected = real.long().cumsum(dim=1) - 1
    if position_ids.shape == expected.shape and bool((position_ids == expected)[real].all()):
        return None
    pos = position_ids[0]
    steps = pos[1:] - pos[:-1]
    restarts = b == 1 and bool(real.all()) and int(pos[0]) == 0 and bool(((pos[1:] == 0) | (steps == 1)).all())
    if not restarts:
        raise ValueError(
            "position_ids that cannot be honoured: whiteformer language models take positions from attention_mask "
            "(padding) or from packed documents (one row, no padding, position_ids counting 0, 1, ... and "
            "restarting at 0 at each document, as DataCollatorWithFlattening makes); got shape "
            f"{tuple(position_ids.shape)}")
    starts = torch.nonzero(pos == 0).flatten()
    return torch.cat([starts, starts.new_tensor([t])]).to(torch.int32)


def packed_cu_seqlens(attention_mask: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
                      kwargs: Dict[str, Any], input_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """The documents' ``cu_seqlens`` of a packed batch of ``input_ids`` (B, T), or None; pops the
    collator's flash-attention keys (``cu_seq_lens_q/k``, ``max_length_q/k``, ``seq_idx``) from
    ``kwargs``. ``position_ids`` given with ``cu_seq_lens_q`` must describe the same documents, and
    ``attention_mask`` of a packed batch must be all 1 (or None)."""
    cu_q, cu_k = kwargs.pop("cu_seq_lens_q", None), kwargs.pop("cu_seq_lens_k", None)
    for key in ("max_length_q", "max_length_k", "seq_idx"):
        kwargs.pop(key, None)
    if cu_q is None and cu_k is None and position_ids is None:
        return None
    cu = _documents(cu_q, cu_k, position_ids, attention_mask, input_ids.shape[0], input_ids.shape[-1])
    if cu is not None and attention_mask is not None and not bool((attention_mask != 0).all()):
        raise ValueError("a packed batch has no padding: attention_mask must be all 1 (or None)")
    return cu


@compile_disabled("position_ids / cu_seq_lens_q: the transformers wrappers read them on the host to find packed "
                  "documents (one graph break); under torch.compile(fullgraph=True) leave position_ids out "
                  "(positions come from attention_mask) and pass one sequence per row")
def _documents(cu_q, cu_k, position_ids, attention_mask, batch: int, tokens: int) -> Optional[torch.Tensor]:
    """The ``cu_seqlens`` that ``cu_seq_lens_q/k`` and ``position_ids`` describe (checked to agree), or
    None for ordinary positions."""
    for name, value in (("cu_seq_lens_q", cu_q), ("cu_seq_lens_k", cu_k)):
        check_instance(value, name, torch.Tensor, "an int32 tensor of shape (S + 1,)", optional=True)
    if cu_q is not None and cu_k is not None and not torch.equal(cu_q.cpu(), cu_k.cpu()):
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k differ: a causal language model attends within the same "
                         "documents for queries and keys")
    cu = cu_q if cu_q is not None else cu_k
    from_positions = None if position_ids is None else _from_position_ids(position_ids, attention_mask, batch, tokens)
    if cu is None or position_ids is None:
        return from_positions if cu is None else cu
    if from_positions is None:  # ordinary positions: one document per row
        from_positions = torch.tensor([0, tokens], dtype=torch.int32)
    if not torch.equal(from_positions.cpu().long(), torch.unique_consecutive(cu.cpu().long())):
        raise ValueError(f"position_ids and cu_seq_lens_q describe different documents (position_ids restart at "
                         f"{from_positions.tolist()[:-1]}, cu_seq_lens_q = {cu.tolist()})")
    return cu


def mask_document_starts(labels: torch.Tensor, cu_seqlens: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """``labels`` (1, T) with every document's first label but the row's set to ``ignore_index``:
    after ``transformers``' shift, no document's last token is trained to predict the next one's start."""
    starts = cu_seqlens[1:-1].to(labels.device, torch.long)
    starts = starts[(starts > 0) & (starts < labels.shape[1])]
    return labels.index_fill(1, starts, ignore_index)
