"""Generation of a :class:`~whiteformer.models.lm.CausalLM`: sampling (temperature, top-k, nucleus),
stopping at an end-of-sequence token as ``transformers`` does, the preallocated output, and the
context crop past the model's context limit (as nanoGPT)."""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..._checks import check_eps, check_int, is_real
from .._context_parallel import one_process

__all__ = ["MIN_TEMPERATURE", "MODEL_EOS", "check_temperature", "until_eos", "LMGeneration"]


#: the smallest positive sampling temperature: ``logits / temperature`` overflows float32 for tiny ones
#: (1e-45 turns a logit of 1 into inf), and sampling that cold is greedy in effect (``temperature=0``)
MIN_TEMPERATURE = 1e-6


def check_temperature(temperature) -> None:
    """``temperature``: 0 (greedy) or a finite number >= :data:`MIN_TEMPERATURE` (ValueError otherwise)."""
    check_eps(temperature, "temperature")
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {temperature!r}: "
                         f"logits / temperature would overflow; sampling that cold is greedy, pass 0")


class _ModelEos:
    """The type of :data:`MODEL_EOS`."""

    def __repr__(self) -> str:
        return "MODEL_EOS"


#: ``generate``'s default ``eos_token_id``: the model's own (``model.eos_token_id``; None: it has none)
MODEL_EOS = _ModelEos()


def until_eos(ids: torch.Tensor, start: int, eos_token_id: Optional[int]) -> torch.Tensor:
    """A generated row ids (T,) without its first eos at or after ``start`` (the prompt's length) and
    what follows (the padding of a finished sequence); whole when ``eos_token_id`` is None or absent."""
    if eos_token_id is None:
        return ids
    hits = (ids[start:] == eos_token_id).nonzero()
    return ids[: start + int(hits[0, 0])] if len(hits) else ids


def _output_buffer(idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The (B, T + max_new_tokens) output of generate; a ValueError naming ``max_new_tokens`` when it
    cannot fit in the memory free on the device (checked before allocating, and on the allocator's
    refusal)."""
    from ..factory import free_memory_bytes

    B, t = idx.shape
    need = B * (t + max_new_tokens) * idx.element_size()
    if idx.device.type == "cuda":
        free = torch.cuda.mem_get_info(idx.device)[0]
    else:
        free = free_memory_bytes() if idx.device.type == "cpu" else None
    problem = f"max_new_tokens={max_new_tokens} asks for an output of {B} x {t + max_new_tokens} tokens " \
              f"({need / 2**30:.3g} GiB)"
    if free is not None and need > free:
        raise ValueError(f"{problem}, more than the {free / 2**30:.3g} GiB free on {idx.device}; generate fewer tokens")
    try:
        return idx.new_empty(B, t + max_new_tokens)
    except (RuntimeError, MemoryError) as err:  # torch.OutOfMemoryError is a RuntimeError
        raise ValueError(f"{problem}, which cannot be allocated on {idx.device} ({str(err).splitlines()[0]}); "
                         f"generate fewer tokens") from None


class LMGeneration:
    """:meth:`generate` of a :class:`~whiteformer.models.lm.CausalLM` (its prefill/step, embedding and
    blocks)."""

    @staticmethod
    def _sample(logits: torch.Tensor, temperature: float, top_k: Optional[int], top_p: Optional[float],
                generator: Optional[torch.Generator]) -> torch.Tensor:
        """logits (B, V) -> next ids (B,). Greedy (argmax) when temperature == 0 or top_k == 1."""
        if temperature == 0 or top_k == 1:
            return logits.argmax(dim=-1)
        logits = logits.float() / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if top_p is not None and top_p < 1.0:  # nucleus: the smallest set of tokens holding top_p of the mass
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop = sorted_p.cumsum(dim=-1) - sorted_p >= top_p  # mass before this token already >= top_p
            probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

    def _check_generation_length(self, t: int, max_new_tokens: int) -> None:
        """With ``crop=False``: every fed position must be within the context limit."""
        limit = self.context_limit
        needed = t + max_new_tokens - 1  # the last sampled token is never fed back
        if limit is not None and needed > limit:
            raise ValueError(
                f"generating {max_new_tokens} tokens after a prompt of {t} needs {needed} positions, more "
                f"than the context limit {limit} (max_len); pass crop=True (the default) to crop the context, "
                f"or build the model with {self._length_free_hint()} for unlimited length")

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None, *, use_cache: bool = True,
                 crop: bool = True, generator: Optional[torch.Generator] = None,
                 eos_token_id: Union[int, None, _ModelEos] = MODEL_EOS, ignore_eos: bool = False) -> torch.Tensor:
        """Append up to ``max_new_tokens`` tokens to idx (B, T); returns (B, T + n), n <= max_new_tokens.

        Stopping (as ``transformers``): a sequence that generates ``eos_token_id`` (by default the
        model's own, :attr:`eos_token_id`) is finished; its later positions hold ``eos_token_id``
        (padding), and generation ends as soon as every sequence is finished (n < max_new_tokens), at
        the cost of one read of a flag per generated token. ``eos_token_id=None``, ``ignore_eos=True``,
        or a model without one, generate all ``max_new_tokens`` tokens. An eos in the prompt does not count.

        Sampling: ``logits / temperature``, optional top-k filter, optional nucleus filter
        (``top_p`` in (0, 1]: the smallest set of most likely tokens holding that much probability),
        multinomial (with ``generator`` if given). ``temperature=0`` or ``top_k=1`` is greedy; a
        positive temperature is at least :data:`MIN_TEMPERATURE`. The (B, T + max_new_tokens) output
        must fit in the memory free on ``idx``'s device (else a ``ValueError`` naming ``max_new_tokens``).

        ``use_cache=True``: ToST carries the recurrent causal-TSSA state (constant memory and
        time per token, whatever the position); GPT carries a key/value cache. ``use_cache=False``
        re-runs the whole sequence every token (as nanoGPT); both give the same tokens. The tokens
        are written into one preallocated (B, T + max_new_tokens) tensor, so memory stays flat
        over long generations.

        Length: a model with a context limit (learned ``wpe``, or ToST's ``pos_bias``; see
        :attr:`context_limit`) crops the context to its last ``max_len`` tokens once the sequence
        is longer, as nanoGPT does: past that point every token re-runs the cropped window (the
        recurrent state or cache is rebuilt from it, since the positions shift). ``crop=False``
        raises ``ValueError`` before generating instead. Without a limit nothing is cropped.
        """
        one_process(self, "generate")
        self._check_idx(idx)
        check_int(max_new_tokens, "max_new_tokens", 0)
        if not isinstance(ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(ignore_eos).__name__}")
        eos = self.eos_token_id if isinstance(eos_token_id, _ModelEos) else eos_token_id
        eos = None if ignore_eos or eos is None else self._check_eos(eos, self.vocab_size)
        check_temperature(temperature)
        if top_k is not None:
            check_int(top_k, "top_k", 1)
        if top_p is not None and (not is_real(top_p)
                                  or not 0.0 < top_p <= 1.0):
            raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
        limit = self.context_limit
        if not crop:
            self._check_generation_length(idx.shape[1], max_new_tokens)
        if max_new_tokens == 0:
            return idx
        B, t = idx.shape
        out = _output_buffer(idx, max_new_tokens)
        out[:, :t] = idx
        state = None
        if use_cache and (limit is None or t <= limit):  # internal calls: idx checked above, sampled ids in range
            h, state = self._prefill_hidden(idx)
            logits = self.lm_head(h[:, -1])
        else:
            logits = self._window_logits(out[:, :t], limit)
        finished = None if eos is None else torch.zeros(B, dtype=torch.bool, device=idx.device)
        for i in range(max_new_tokens):
            nxt = self._sample(logits, temperature, top_k, top_p, generator)
            if finished is not None:
                nxt = nxt.masked_fill(finished, eos)  # a finished sequence is padded
                finished |= nxt == eos
            out[:, t] = nxt
            t += 1
            if i == max_new_tokens - 1:
                break
            if finished is not None and bool(finished.all()):  # the one host read of this token
                return out[:, :t].contiguous()
            if state is not None and (limit is None or t <= limit):  # feeding position t - 1
                h, state = self._step_hidden(out[:, t - 1], state)
                logits = self.lm_head(h)
            else:
                state = None
                logits = self._window_logits(out[:, :t], limit)
        return out

    def _window_logits(self, seq: torch.Tensor, window: Optional[int]) -> torch.Tensor:
        """Next-token logits (B, V) from the last ``window`` tokens of seq (all when None; ids checked
        or sampled by generate, within the context limit)."""
        if window is not None and seq.shape[1] > window:
            seq = seq[:, -window:]
        return self.lm_head(self._blocks(self._embed(seq))[:, -1])
