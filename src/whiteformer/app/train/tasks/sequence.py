"""Token sequences with one label (ListOps) read by a causal language model.

The answer is the next token after the expression: the model's logits at the last real token
restricted to the label tokens (ListOps: the digit tokens). Right padding is invisible to the
causal model at that position. Sequences are visited in the order of :mod:`.classification`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..distributed import DistInfo
from .base import CausalLMData, Task
from .classification import ClassificationTask

__all__ = ["SequenceTask"]


class SequenceTask(CausalLMData, ClassificationTask):
    """ListOps & co.: a causal language model over the sequence vocabulary answers with the next token;
    a sequence classifier's (B, classes) logits (``tost_lra_listops``) are used as they are."""

    holds = "token sequences"
    model_kinds = ("causal language model", "sequence classifier")
    kind_hint = ("; the dataset holds characters / tokens: use a causal language model (tost_lm_*, gpt_*), "
                 "which for ListOps answers with the token after the expression")
    options = Task.options + ("label_smoothing", "augment", "eval_batch_size", "label_token_ids")

    def __init__(self, train_ds, eval_ds, batch_size: int = 64, seed: int = 0, dist: Optional[DistInfo] = None,
                 bf16: bool = False, label_smoothing: float = 0.0, augment=None, eval_batch_size: int = 256,
                 label_token_ids: Optional[torch.Tensor] = None):
        super().__init__(train_ds, eval_ds, batch_size, seed, dist, bf16, label_smoothing, None, eval_batch_size)
        ds = self.train_ds
        if label_token_ids is None:
            label_token_ids = torch.tensor([ds.vocab.index(str(c)) for c in range(ds.num_classes)])
        self.label_token_ids = label_token_ids.to(self.device)

    @classmethod
    def model_kwargs(cls, ds, *, finetune=None, block_size=None):
        return {"vocab_size": ds.vocab_size, "max_len": ds.max_len}, {}

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = model(x)
        logits = out[0] if isinstance(out, tuple) else out  # (B, L, V)
        if logits.dim() == 2:  # a sequence classifier (tost_lra_listops & co.) answers directly
            return logits
        last = (x != self.train_ds.pad_id).sum(1).clamp_min(1) - 1
        at_end = logits[torch.arange(x.shape[0], device=x.device), last]  # (B, V)
        return at_end[:, self.label_token_ids]

    def report_inputs(self, n: int = 64):
        return self.eval_ds.get_batch(torch.arange(min(n, len(self.eval_ds))))
