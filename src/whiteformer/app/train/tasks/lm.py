"""Language modelling on a token stream (characters or subword tokens of ``text``, token ids of
``tokens``): step ``s`` reads ``batch_size`` random windows of ``block_size + 1`` tokens whose
starts come from a generator seeded with ``(seed, s)``; each data-parallel group reads only its
slice of them, and under context parallelism each process of a group keeps its contiguous chunk of
every window. Evaluation reads evenly spread windows of the validation split. The dataset only
needs ``len(ds)`` (tokens) and ``get_windows(starts, block_size)``, so a token file is read window
by window.

A dataset with ``pack`` set (``data_args.pack=true``) gives packed documents: each process's
windows become one row of documents split at the end-of-document token, with their
``cu_seqlens`` (:func:`~whiteformer.app.data.packing.pack_windows`); the loss is then the mean
over the tokens of each document predicting the next token of the same document, and under
context parallelism the row is split into contiguous chunks with ``cu_seqlens`` describing the
whole row (a document may span processes; the model keeps the documents apart)."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

from ....models.lm import until_eos
from ....ops.context_parallel import token_chunk
from ...data.packing import PackedWindows, pack_windows
from ..distributed import DistInfo, all_reduce_sum
from .base import CausalLMData, ReportContext, Task, seeded_generator

__all__ = ["LMTask", "NoTargetsError", "check_targets"]


class NoTargetsError(ValueError):
    """Windows hold no token to predict (packed windows of end-of-document tokens only): a loss over
    them would be a perfect 0, so it is an error, reported as one line."""


def no_targets_message(ds, windows: int, block_size: int) -> str:
    why = (f"with block_size {block_size} every window is one token, which ends its document" if block_size < 2
           else f"every window holds only end-of-document tokens (id {ds.eod_id})")
    return (f"{ds.name}: the {windows} windows read have no token to predict (pack=true: a document's last token "
            f"predicts nothing, and {why}); a loss over them would be a perfect 0. Check the data (are its documents "
            f"empty?) or the end-of-document id")


def check_targets(ds, starts: torch.Tensor, block_size: int) -> None:
    """:class:`NoTargetsError` when the packed windows of ``ds`` at ``starts`` (``block_size``
    tokens each) hold no target: a window's tokens before its last are all end-of-document tokens."""
    x, _ = ds.get_windows(starts, block_size)
    if not bool((x[:, :-1] != ds.eod_id).any()):
        raise NoTargetsError(no_targets_message(ds, len(starts), block_size))


class LMTask(CausalLMData, Task):
    """Next-token prediction on random windows (see module docstring)."""

    kind = "lm"
    epoch_based = False
    requires_steps = True
    metric = "ppl"
    curve = ("eval_ppl", "perplexity")
    holds = "text"
    kind_hint = "; the dataset holds characters: use a causal language model (tost_lm_*, gpt_*)"
    options = Task.options + ("block_size", "eval_batches")
    #: the data's end-of-document id, where the language model records it (generate stops there)
    optional_model_kwargs = ("eos_token_id",)

    def __init__(self, train_ds, eval_ds, batch_size: int = 64, seed: int = 0, dist: Optional[DistInfo] = None,
                 bf16: bool = False, block_size: int = 128, eval_batches: int = 10):
        super().__init__(train_ds, eval_ds, batch_size, seed, dist, bf16)
        self.block_size = block_size
        self.eval_batches = eval_batches
        for ds in (train_ds, eval_ds):
            if len(ds) < block_size + 1:
                raise ValueError(f"{ds.name} has {len(ds)} tokens, fewer than block_size + 1 = {block_size + 1}; "
                                 f"lower block_size")
        for ds, starts in ((eval_ds, self.eval_starts(eval_ds)), (train_ds, self._train_starts(0))):
            if getattr(ds, "pack", False):
                check_targets(ds, starts, block_size)

    def _train_starts(self, step: int) -> torch.Tensor:
        """The window starts of ``step``'s global batch (every process's)."""
        high = len(self.train_ds) - self.block_size
        return torch.randint(0, high, (self.batch_size,), generator=seeded_generator(self.seed, 3, step))

    @classmethod
    def model_kwargs(cls, ds, *, finetune=None, block_size=None):
        kw: Dict[str, Any] = {"vocab_size": ds.vocab_size}
        if block_size is not None and finetune is None:  # a checkpoint keeps its own context limit
            kw["max_len"] = block_size
        if getattr(ds, "eod_id", None) is not None:
            kw["eos_token_id"] = ds.eod_id
        return kw, {}

    @property
    def steps_per_epoch(self) -> int:
        # Nominal epoch: as many window tokens as there are tokens.
        return max(1, len(self.train_ds) // (self.batch_size * self.block_size))

    def train_batch(self, step: int):
        return self._batch(self.train_ds, self._train_starts(step)[self.lo:self.hi])

    def _batch(self, ds, starts: torch.Tensor):
        """(x, y) of the windows at ``starts``, this process's share under context parallelism, on
        the device; packed (``ds.pack``): x a :class:`PackedWindows`, y (1, chunk) targets. Unpacked
        windows under context parallelism read only this process's chunk of each window."""
        packed = getattr(ds, "pack", False)
        if self.dist.cp_size > 1 and not packed:  # the documents of packed windows need whole windows
            part = self._part(self.block_size)
            if part.stop > part.start:
                return self._to(*ds.get_windows(starts + part.start, part.stop - part.start))
        x, y = ds.get_windows(starts, self.block_size)
        if packed:
            x, y = pack_windows(x, y, ds.eod_id)
            if self.dist.cp_size > 1:
                part = self._part(y.shape[1])
                x, y = PackedWindows(x.idx[:, part], x.cu_seqlens), y[:, part]
            return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        if self.dist.cp_size > 1:
            part = self._part(x.shape[1])
            x, y = x[:, part], y[:, part]
        return self._to(x, y)

    def _part(self, tokens: int) -> slice:
        """This rank's contiguous share of ``tokens`` tokens under context parallelism (the model
        combines the ranks' statistics; see ``--context-parallel``)."""
        return token_chunk(tokens, self.dist.cp_rank, self.dist.cp_size)

    def _forward_loss(self, model: nn.Module, x, y: torch.Tensor):
        """(the model's mean loss, this process's number of counted targets)."""
        with self.autocast():
            if isinstance(x, PackedWindows):
                _, loss = model(x.idx, targets=y, cu_seqlens=x.cu_seqlens)
                return loss, (y != -1).sum()
            _, loss = model(x, targets=y)
        return loss, torch.tensor(y.numel(), device=y.device)

    def loss(self, model: nn.Module, x, y: torch.Tensor):
        loss, count = self._forward_loss(model, x, y)
        return loss.float(), {"count": count.double()}

    def eval_starts(self, ds) -> torch.Tensor:
        n = self.eval_batches * self.batch_size
        max_start = len(ds) - self.block_size - 1
        return (torch.arange(n, dtype=torch.long) * max_start) // max(n - 1, 1)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, ds=None) -> Dict[str, float]:
        """Mean next-token cross-entropy over evenly spread windows, and perplexity."""
        ds = ds if ds is not None else self.eval_ds
        was_training = model.training
        model.eval()
        starts = self.eval_starts(ds)[self.dist.dp_rank::self.dist.dp_size]
        tot = torch.zeros(2, dtype=torch.float64, device=self.device)
        for i in self.eval_steps(range(0, len(starts), self.local_batch)):
            x, y = self._batch(ds, starts[i:i + self.local_batch])
            loss, count = self._forward_loss(model, x, y)  # context-parallel: the mean over the group's chunks
            tot[0] += loss.double() * count
            tot[1] += count
        all_reduce_sum(tot)
        model.train(was_training)
        if tot[1].item() == 0:
            raise NoTargetsError(no_targets_message(ds, len(starts), self.block_size))
        loss = tot[0].item() / tot[1].item()
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "n": int(tot[1].item())}

    def summary(self, res: Dict[str, float]) -> str:
        return f"loss {res['loss']:.4f} (perplexity {res['ppl']:.3f}, {res['n']} tokens)"

    def report_rows(self, results: Dict[str, Any], split: str = "validation") -> List[str]:
        final = results.get("final_eval", {})
        unit = getattr(getattr(self.train_ds, "vocab", None), "unit", "token")
        return [f"| validation loss | {final.get('loss', float('nan')):.4f} nats/{unit} |",
                f"| validation perplexity | {final.get('ppl', float('nan')):.3f} |"]

    def report_inputs(self, n: int = 16):
        return self.eval_ds.get_windows(self.eval_starts(self.eval_ds)[:n], self.block_size)

    def report_sections(self, model: nn.Module, ctx: ReportContext) -> List[str]:
        if not hasattr(model, "generate"):
            return []
        vocab = getattr(self.train_ds, "vocab", None)
        if vocab is None:
            ctx.notes.append(f"text sample skipped: {self.train_ds.name} has no tokenizer to decode its ids")
            return []
        try:
            device = next(model.parameters()).device
            limit = getattr(model, "context_limit", None) or 10**9
            t = max(1, min(32, limit // 4, len(self.eval_ds) - 1))
            prompt = self.eval_ds.get_windows(torch.zeros(1, dtype=torch.long), t)[0].to(device)
            g = torch.Generator(device=device).manual_seed(0)
            # A model with a position limit cannot generate past it (needs t + new - 1 <= limit).
            out = model.generate(prompt, min(300, limit - t + 1), temperature=0.8, generator=g)  # stops at its eos
            row = until_eos(out[0].cpu(), t, getattr(model, "eos_token_id", None))
            sample = vocab.decode(row)  # (whole: a subword token may hold part of a character)
        except Exception as err:  # noqa: BLE001 - an analysis must not fail the run
            ctx.notes.append(f"text sample skipped: {type(err).__name__}: {err}")
            return []
        ctx.results["sample"] = sample
        return ["## Sample", "", "```", sample, "```", ""]
