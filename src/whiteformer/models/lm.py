"""Causal language models in a nanoGPT-derived shell: causal ToST (causal TSSA) and its
softmax-attention GPT baseline (ToST, Wu et al., ICLR 2025, Section 5 / Appendix B).

Shell (as the official ``tost_lang/model_TSSA.py``): token embedding ``wte`` tied to ``lm_head``,
learned position embedding ``wpe`` (``max_len`` rows, optional), pre-LN blocks with layer scale::

    x = x + gamma1 * attn(ln_1(x))
    x = x + gamma2 * mlp(ln_2(x))          # mlp: c_fc (D -> 4D), GELU, c_proj (4D -> D)

then ``ln_f`` and ``lm_head``. No biases by default (LayerNorms without bias, as nanoGPT
``bias=False``). Init: normal(0, 0.02) for Linear/Embedding, ``0.02 / sqrt(2 L)`` for the two
residual output projections, layer scale ``init_values`` = 1e-5.

Keys follow nanoGPT (``transformer.wte``, ``transformer.h.{i}.ln_1``, ...), except the attention
parameters, which use the layer names ``qkv`` / ``proj`` / ``pos_bias`` (official ``c_attn`` /
``c_proj`` / ``denom_bias``; :meth:`CausalLM.convert_state_dict` renames them).

Generation: ToST keeps the constant-size recurrent state of causal TSSA (constant memory and
time per token); GPT keeps a key/value cache. A model built with ``eos_token_id`` (a run trained by
``whiteformer train`` records its data's end-of-document id there) stops each sequence at that token,
as ``transformers``' ``generate`` does.

Context parallelism (ToST only): after ``model.set_context_parallel(group)`` each rank of the
``torch.distributed`` group passes its contiguous chunk of every sequence (rank order = sequence
order, chunks may differ in length) to :meth:`CausalLM.forward`; positions are global, each rank
gets its rows of the logits, and the loss is the mean over all ranks' targets (the same value on
every rank). Its backward gives each rank ``R`` times its share of the parameter gradient
(``R`` the group size), so the *mean* of the gradients over the group (what
DistributedDataParallel does) is the unsplit gradient.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._checks import (
    check_choice,
    check_cu_seqlens,
    check_divisible,
    check_eps,
    check_finite_real,
    check_int,
    check_integer_tensor,
    check_mask,
    check_positive_real,
    check_probability,
    check_token_ids,
    is_real,
)
from .._compile import can_read_values
from .._dtypes import stats_dtype
from .._utils import apply_layer_scale, layer_scale_param
from ..attention.causal import CausalAttention, CausalSelfAttention, KVCache
from ..attention.context_parallel import ContextParallel
from ..attention.tssa import CausalTSSA
from ..layers import GradCheckpointMixin, feature_take_indices
from ..ops.context_parallel import all_reduce_sum, chunk_layout, local_checks
from ..ops.linear_cross_entropy import linear_cross_entropy
from ..ops.packing import segment_positions, split_cu_seqlens
from ._context_parallel import check_blocks_split, one_process
from .registry import build_with_defaults, register_model
from .save import PretrainedMixin

__all__ = ["CausalLM", "ToSTLM", "GPTLM", "CausalSelfAttention", "KVCache", "LMState", "MIN_TEMPERATURE",
           "MODEL_EOS", "check_temperature", "until_eos"]


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
    from .factory import free_memory_bytes

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


class LMState(NamedTuple):
    """Generation state of a :class:`CausalLM`: ``pos`` real tokens consumed (an int, or a (B,)
    integer tensor after a padded prefill: the next token's position per sequence), one state
    per block (a :class:`~whiteformer.ops.causal_tssa.CausalTSSAState` for ToST, a
    :class:`KVCache` for GPT)."""

    pos: Union[int, torch.Tensor]
    layers: Tuple[Any, ...]


#: the MLP activations of the GPT shell: exact GELU (nanoGPT), its tanh approximation (GPT-2's ``gelu_new``)
MLP_ACTS = {"gelu": "none", "gelu_tanh": "tanh"}


class LMMlp(nn.Module):
    """nanoGPT MLP: ``c_fc`` (D -> hidden), GELU (exact, or ``act="gelu_tanh"``: the tanh
    approximation of GPT-2), ``c_proj`` (hidden -> D), dropout."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, drop: float = 0.0, act: str = "gelu"):
        super().__init__()
        self.c_fc = nn.Linear(dim, hidden, bias=bias)
        self.act = nn.GELU(approximate=MLP_ACTS[act])
        self.c_proj = nn.Linear(hidden, dim, bias=bias)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(self.act(self.c_fc(x))))


class PreNormBlock(nn.Module):
    """A pre-norm block's passes over its ``ln_1`` and causal ``attn``; the subclass's ``_finish(x, h)``
    adds the attention update ``h`` and the MLP branch."""

    def _finish(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        return self._finish(x, self.attn(self.ln_1(x), attn_mask, **packed))

    def prefill(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Any]:
        h, state = self.attn.prefill(self.ln_1(x), attn_mask)
        return self._finish(x, h), state

    def step(self, x_t: torch.Tensor, state: Any) -> Tuple[torch.Tensor, Any]:
        h, state = self.attn.step(self.ln_1(x_t), state)
        return self._finish(x_t, h), state


class LMBlock(PreNormBlock):
    """Pre-LN block with layer scale: ``x + gamma1 * attn(ln_1(x))``, ``x + gamma2 * mlp(ln_2(x))``."""

    def __init__(self, dim: int, attn: CausalAttention, mlp_ratio: float = 4.0, bias: bool = False,
                 drop: float = 0.0, init_values: float = 1e-5, act: str = "gelu"):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-5, bias=bias)
        self.attn = attn
        self.ln_2 = nn.LayerNorm(dim, eps=1e-5, bias=bias)
        self.mlp = LMMlp(dim, int(dim * mlp_ratio), bias=bias, drop=drop, act=act)
        self.gamma1 = layer_scale_param(dim, init_values)
        self.gamma2 = layer_scale_param(dim, init_values)

    def _finish(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        x = x + apply_layer_scale(self.gamma1, h)
        return x + apply_layer_scale(self.gamma2, self.mlp(self.ln_2(x)))


class CausalLM(GradCheckpointMixin, ContextParallel, PretrainedMixin, nn.Module):
    """Shared shell of :class:`ToSTLM` and :class:`GPTLM` (see the module docstring).

    Subclasses provide ``_make_attn(i)`` and ``_attn_len_limit()``. ``eos_token_id`` (None or an id
    in [0, vocab_size)): the end-of-sequence / end-of-document token at which :meth:`generate` stops
    a sequence; saved with the model's other arguments.

    Parameter count convention (as the ToST paper's 110.38M for the base model): every parameter
    once (the tied ``wte`` / ``lm_head`` weight counted once), position embedding included:
    ``get_num_params()``.
    """

    model_kind = "causal language model"
    #: the constructor arguments that remove every length limit ({}: the model has none)
    length_free_kwargs: Dict[str, Any] = {}

    def __init__(self, vocab_size: int, dim: int, depth: int, num_heads: int, max_len: int,
                 pos_emb: bool, mlp_ratio: float, bias: bool, dropout: float, init_values: float,
                 mlp_act: str = "gelu", eos_token_id: Optional[int] = None, **attn_opts: Any):
        super().__init__()
        check_choice(mlp_act, "mlp_act", tuple(MLP_ACTS))
        check_int(vocab_size, "vocab_size", 1)
        self.eos_token_id = self._check_eos(eos_token_id, vocab_size) if eos_token_id is not None else None
        check_int(depth, "depth", 0)
        check_int(max_len, "max_len", 1)
        check_divisible(dim, num_heads)
        check_probability(dropout, "dropout")
        mlp_ratio = check_positive_real(mlp_ratio, "mlp_ratio")
        if int(dim * mlp_ratio) < 1:
            raise ValueError(f"mlp_ratio must give an MLP width int(dim * mlp_ratio) >= 1, got {mlp_ratio!r}")
        init_values = check_finite_real(init_values, "init_values")
        self.vocab_size, self.dim, self.depth, self.num_heads = vocab_size, dim, depth, num_heads
        self.max_len, self.has_pos_emb, self.bias, self.dropout = max_len, bool(pos_emb), bool(bias), dropout
        self.num_features = self.embed_dim = dim
        self._attn_opts = attn_opts

        modules = dict(wte=nn.Embedding(vocab_size, dim))
        if pos_emb:
            modules["wpe"] = nn.Embedding(max_len, dim)
        modules["drop"] = nn.Dropout(dropout)
        modules["h"] = nn.ModuleList([LMBlock(dim, self._make_attn(i), mlp_ratio, bias, dropout, init_values, mlp_act)
                                      for i in range(depth)])
        modules["ln_f"] = nn.LayerNorm(dim, eps=1e-5, bias=bias)
        self.transformer = nn.ModuleDict(modules)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self._init_weights(depth)

    # ---- construction -------------------------------------------------------------------------
    @staticmethod
    def _check_eos(eos_token_id, vocab_size: int) -> int:
        check_int(eos_token_id, "eos_token_id", 0)
        if eos_token_id >= vocab_size:
            raise ValueError(f"eos_token_id must be a token id in [0, {vocab_size - 1}] (vocab_size {vocab_size}), "
                             f"got {eos_token_id}")
        return int(eos_token_id)

    def _make_attn(self, i: int) -> nn.Module:  # pragma: no cover - abstract
        raise NotImplementedError

    def _attn_len_limit(self) -> Optional[int]:
        """Longest sequence the attention layers accept (None: unlimited)."""
        return None

    def _length_free_hint(self) -> str:
        """The constructor arguments that remove the context limit, as an error message names them."""
        return ", ".join(f"{k}={v!r}" for k, v in self.length_free_kwargs.items()) or "pos_emb=False"

    def _init_weights(self, depth: int) -> None:
        proj_std = 0.02 / math.sqrt(2 * max(depth, 1))
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                std = proj_std if name.endswith(("attn.proj", "mlp.c_proj")) else 0.02
                nn.init.normal_(m.weight, mean=0.0, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)

    @property
    def context_limit(self) -> Optional[int]:
        """Longest sequence :meth:`forward` accepts: ``max_len`` with a learned position
        embedding or a TSSA position bias, else None (unlimited)."""
        limits = [self.max_len] if self.has_pos_emb else []
        attn_limit = self._attn_len_limit()
        if attn_limit is not None:
            limits.append(attn_limit)
        return min(limits) if limits else None

    def get_num_params(self, non_embedding: bool = False) -> int:
        """Number of parameters, the tied embedding counted once; ``non_embedding=True``
        subtracts the position embedding (nanoGPT's default there)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and self.has_pos_emb:
            n -= self.transformer.wpe.weight.numel()
        return n

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        """Full names of parameters excluded from weight decay besides the 1-D ones: TSSA's
        ``temp`` and ``pos_bias`` (official ``temp`` / ``denom_bias``). ``wpe`` is decayed, as
        in the official training script."""
        out = set()
        for i, blk in enumerate(self.transformer.h):
            if hasattr(blk.attn, "no_weight_decay"):
                out |= {f"transformer.h.{i}.attn.{n}" for n in blk.attn.no_weight_decay()}
        return out

    # ---- checks -------------------------------------------------------------------------------
    def _check_idx(self, idx, name: str = "idx") -> None:
        check_token_ids(idx, name, self.vocab_size, allow_no_tokens=self.context_parallel_group is not None)

    def check_context_parallel(self) -> None:
        check_blocks_split(self, self.transformer.h)

    def _check_attn_mask(self, attn_mask, idx: torch.Tensor, whole: bool = True) -> Optional[torch.Tensor]:
        """A (B, T) keep-mask (bool, or 0/1 integers as in ``transformers``) -> bool or None;
        every sequence needs at least one real token (``whole=False``: checked by the caller)."""
        if attn_mask is None:
            return None
        attn_mask = check_mask(attn_mask, idx.shape[0], idx.shape[1], device=idx.device)
        if whole and can_read_values() and not bool(attn_mask.any(dim=1).all()):
            raise ValueError("attn_mask has a sequence without any real token (an all-False row)")
        return attn_mask

    def _check_len(self, t: Union[int, torch.Tensor]) -> None:
        if isinstance(t, torch.Tensor):
            if not can_read_values():
                return
            t = int(t.max())
        limit = self.context_limit
        if limit is not None and t > limit:
            raise ValueError(f"sequence length {t} exceeds the model's context limit {limit} (max_len; build the "
                             f"model with {self._length_free_hint()} to remove it)")

    def _check_targets(self, targets, idx: torch.Tensor) -> None:
        if not isinstance(targets, torch.Tensor) or targets.shape != idx.shape:
            raise ValueError(f"targets must be a tensor of shape {tuple(idx.shape)}, got "
                             f"{getattr(targets, 'shape', type(targets).__name__)}")
        check_integer_tensor(targets, "targets", "an integer tensor of token ids")
        if can_read_values():
            bad = (targets != -1) & ((targets < 0) | (targets >= self.vocab_size))
            if bool(bad.any()):
                hint = " (-100 is transformers' ignore index; here it is -1)" if bool((targets == -100).any()) else ""
                raise ValueError(f"targets hold token ids outside [0, {self.vocab_size - 1}] (-1 = ignored): "
                                 f"{sorted(set(targets[bad].tolist()))[:5]}{hint}")

    def _check_inputs(self, idx, attn_mask, cu_seqlens, targets=None, idx_checked: bool = False
                      ) -> Tuple[Optional[torch.Tensor], List[int]]:
        """This rank's checks of a forward's arguments, before any collective (context-parallel: a
        rank failing them stops every rank of the group, :class:`~whiteformer.ops.context_parallel.local_checks`).
        Returns the bool attn_mask and, for packed documents split over the group, the fingerprint of
        ``cu_seqlens`` (:func:`~whiteformer.ops.packing.split_cu_seqlens`) that the ranks compare.
        ``idx_checked``: the caller (the ``transformers`` wrapper's door) checked idx already."""
        group = self.context_parallel_group
        with local_checks(group, idx):
            if not idx_checked:
                self._check_idx(idx)
            attn_mask = self._check_attn_mask(attn_mask, idx, whole=group is None)
            if targets is not None:
                self._check_targets(targets, idx)
            if cu_seqlens is None:
                return attn_mask, []
            if idx.shape[0] != 1 or attn_mask is not None:
                raise ValueError(f"with cu_seqlens, idx must hold the packed documents in one row (1, T) and "
                                 f"attn_mask must be None; got idx of shape {tuple(idx.shape)}")
            if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device != idx.device:
                raise ValueError(f"cu_seqlens must be on idx's device ({idx.device}), got {cu_seqlens.device}")
            return attn_mask, [] if group is None else split_cu_seqlens(cu_seqlens)

    def _packed_positions(self, idx: torch.Tensor, cu_seqlens, fingerprint: Sequence[int]) -> torch.Tensor:
        """Packed documents (checked by :meth:`_check_inputs`), each within the context limit: the
        (1, T) positions within the documents (context-parallel: idx is this rank's chunk of the row
        that ``cu_seqlens`` describes)."""
        start, total = self._row_span(idx, fingerprint)
        lengths = check_cu_seqlens(cu_seqlens, total)
        self._check_len(max(lengths))
        return segment_positions(cu_seqlens, lengths, idx.device)[None, start:start + idx.shape[1]]

    def _row_span(self, idx: torch.Tensor, fingerprint: Sequence[int] = ()) -> Tuple[int, int]:
        """(first token's index in the whole row, the row's length): this rank's chunk when
        context-parallel (``fingerprint``: of the ``cu_seqlens``, checked equal on every rank), else (0, T)."""
        group = self.context_parallel_group
        if group is None:
            return 0, idx.shape[1]
        start, total, _ = chunk_layout(idx, group, name="idx", token_dim=1, same=fingerprint, same_name="cu_seqlens")
        return start, total

    # ---- forward ------------------------------------------------------------------------------
    def _embed(self, idx: torch.Tensor, start: Union[int, torch.Tensor] = 0,
               attn_mask: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token + position embedding. Positions count real tokens only: token t of a sequence
        gets ``start + (number of real tokens before it)`` (``start`` an int or (B,) tensor);
        ``positions`` (B, T), when given, are used as they are (packed documents)."""
        x = self.transformer.wte(idx)
        if self.has_pos_emb and positions is not None:
            x = x + self.transformer.wpe(positions)
        elif self.has_pos_emb:
            if attn_mask is None:
                pos = torch.arange(idx.shape[1], dtype=torch.long, device=idx.device).expand(idx.shape[0], -1)
            else:
                pos = (attn_mask.long().cumsum(dim=1) - 1).clamp_min(0)
            if isinstance(start, torch.Tensor):
                pos = pos + start.to(pos.device, torch.long)[:, None]
            else:
                pos = pos + start
            x = x + self.transformer.wpe(pos)
        return self.transformer.drop(x)

    def _real_len(self, idx: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> Union[int, torch.Tensor]:
        return idx.shape[1] if attn_mask is None else attn_mask.long().sum(dim=1)

    def forward_features(self, idx: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, *,
                         cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """idx (B, T) token ids, attn_mask (B, T) keep-mask (None: no padding; left or right
        padding allowed) -> final hidden states after ``ln_f`` (B, T, D). Each real token sees
        the real tokens of its own sequence only, at positions counted among them. Context-parallel
        (see the module docstring): idx and attn_mask are this rank's chunk (possibly empty), positions global.

        ``cu_seqlens`` (S + 1,) int32 (FlashAttention's convention): idx (1, T) holds S packed
        documents (``cu_seqlens[s]:cu_seqlens[s + 1]``), each its own sequence with positions
        from 0, exactly as if run alone; no ``attn_mask`` then. Context-parallel: ``cu_seqlens``
        describe the whole row (the same on every rank), a document may span ranks."""
        return self._run_blocks(idx, attn_mask, cu_seqlens)

    def _run_blocks(self, idx: torch.Tensor, attn_mask: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                    states: Optional[List[torch.Tensor]] = None, targets: Optional[torch.Tensor] = None,
                    idx_checked: bool = False) -> torch.Tensor:
        """Checks (``targets`` too, when given; idx unless ``idx_checked``), embedding, blocks, ``ln_f``;
        the embeddings and each block's output are appended to ``states`` when a list is given."""
        group = self.context_parallel_group
        attn_mask, fingerprint = self._check_inputs(idx, attn_mask, cu_seqlens, targets, idx_checked)
        if cu_seqlens is not None:
            x = self._embed(idx, positions=self._packed_positions(idx, cu_seqlens, fingerprint))
        else:
            start, real = 0, self._real_len(idx, attn_mask)
            if group is not None:
                start, _, real = chunk_layout(idx, group, attn_mask, name="idx", token_dim=1)
                if isinstance(real, torch.Tensor) and not bool((real > 0).all()):
                    raise ValueError("attn_mask has a sequence without any real token on any rank (an all-False row)")
            self._check_len(real)
            x = self._embed(idx, start, attn_mask)
        return self._blocks(x, attn_mask, cu_seqlens, states)

    def _blocks(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, cu_seqlens=None,
                states: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
        """Embeddings x (B, T, D) of checked inputs through the blocks and ``ln_f``."""
        if states is not None:
            states.append(x)
        for blk in self.transformer.h:
            x = self.run_block(blk, x, attn_mask, cu_seqlens)
            if states is not None:
                states.append(x)
        return self.transformer.ln_f(x)

    def forward_hidden_states(self, idx: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, *,
                              cu_seqlens: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """idx, attn_mask, cu_seqlens as :meth:`forward_features` -> ``(final hidden after ln_f
        (B, T, D), [embeddings, block 1 output, ..., block L output])``, each (B, T, D) (what
        ``transformers``' ``output_hidden_states`` reports)."""
        states: List[torch.Tensor] = []
        return self._run_blocks(idx, attn_mask, cu_seqlens, states), states

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None,
                attn_mask: Optional[torch.Tensor] = None, loss_chunk: Optional[int] = None,
                cu_seqlens: Optional[torch.Tensor] = None
                ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """idx (B, T) -> ``(logits (B, T, V), loss)``; ``attn_mask`` (B, T) keep-mask for padded
        batches, ``cu_seqlens`` for packed documents in idx (1, T) (see :meth:`forward_features`).
        With ``cu_seqlens`` the loss never crosses a document boundary: the target of each
        document's last token (but the row's last) is ignored, since it would be the next
        document's first token.

        Unlike nanoGPT, logits are returned for **all** positions even without targets. ``loss``
        is the mean next-token cross-entropy against ``targets`` (B, T) (``-1`` = ignored; 0 with a
        ``RuntimeWarning`` when every target is ignored), or None.

        ``loss_chunk`` (with ``targets``): compute the loss ``loss_chunk`` positions at a time with
        :func:`whiteformer.ops.linear_cross_entropy`, so the (B, T, V) logits (1.6 GB in float32
        for 8k tokens of a 50k vocabulary, kept for backward) are never formed; returns
        ``(None, loss)`` with the same loss and gradients as the plain path.

        Context-parallel: the loss is the mean over the targets of every rank of the group.
        """
        with local_checks(self.context_parallel_group, idx):
            if loss_chunk is not None and targets is None:
                raise ValueError("loss_chunk needs targets (it computes the loss without forming the logits)")
        h = self._run_blocks(idx, attn_mask, cu_seqlens, targets=targets)  # forward_features, targets checked too
        if targets is not None:
            if cu_seqlens is not None:
                start, total = self._row_span(idx)
                ends = cu_seqlens[1:-1].to(targets.device, torch.long)
                ends = ends[(ends > 0) & (ends < total)] - 1 - start  # last token of each document but the row's last
                ends = ends[(ends >= 0) & (ends < idx.shape[1])]  # ... on this rank's chunk
                targets = targets.long().index_fill(1, ends, -1)
        if loss_chunk is not None and self.context_parallel_group is not None:
            flat = targets.reshape(-1).long()
            counted = (flat != -1).sum()
            total = (h * 0.0).sum()
            if bool(counted):
                total = linear_cross_entropy(h.reshape(-1, h.shape[-1]), self.lm_head.weight, flat,
                                             chunk_size=loss_chunk, ignore_index=-1) * counted
            return None, self._mean_loss(total, counted)
        if loss_chunk is not None:
            flat = targets.reshape(-1).long()
            if can_read_values() and not bool((flat != -1).any()):
                warnings.warn("every target is -1 (ignored): the loss is 0", RuntimeWarning, stacklevel=2)
                return None, (h * 0.0).sum()
            loss = linear_cross_entropy(h.reshape(-1, h.shape[-1]), self.lm_head.weight, flat,
                                        chunk_size=loss_chunk, ignore_index=-1)
            return None, loss
        logits = self.lm_head(h)
        loss = None
        if targets is not None:
            flat = targets.reshape(-1).long()
            total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(stats_dtype(logits)), flat,
                                    ignore_index=-1, reduction="sum")
            loss = self._mean_loss(total, (flat != -1).sum())
        return logits, loss

    def _mean_loss(self, total: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
        """``total / counted``, both summed over the context-parallel group when there is one."""
        group = self.context_parallel_group
        if group is not None:
            total, counted = all_reduce_sum(total, group), all_reduce_sum(counted, group)
        if can_read_values() and not bool(counted):  # every target ignored: 0 (not 0/0 = NaN), still part of the graph
            warnings.warn("every target is -1 (ignored): the loss is 0", RuntimeWarning, stacklevel=3)
        return total / counted.clamp_min(1)

    def forward_intermediates(self, idx: torch.Tensor, indices: Optional[Union[int, Sequence[int]]] = None,
                              norm: bool = False, stop_early: bool = False, intermediates_only: bool = False):
        """timm-style: outputs of the blocks selected by ``indices`` (None: all, int n: last n,
        list: those), each (B, T, D) (``ln_f`` applied when ``norm``). Returns the list when
        ``intermediates_only``, else ``(final hidden after ln_f, list)``."""
        one_process(self, "forward_intermediates")
        self._check_idx(idx)
        self._check_len(idx.shape[1])
        take, max_index = feature_take_indices(self.depth, indices)
        blocks = self.transformer.h
        if stop_early or intermediates_only:
            blocks = blocks[: max_index + 1]
        x = self._embed(idx)
        inter = []
        for i, blk in enumerate(blocks):
            x = blk(x)
            if i in take:
                inter.append(self.transformer.ln_f(x) if norm else x)
        if intermediates_only:
            return inter
        return self.transformer.ln_f(x), inter

    # ---- recurrent / cached inference ------------------------------------------------------------
    def _check_prompt_mask(self, idx: torch.Tensor, attn_mask) -> Optional[torch.Tensor]:
        """A prompt's keep-mask (bool, or None), its real tokens within the context limit (idx checked)."""
        attn_mask = self._check_attn_mask(attn_mask, idx)
        self._check_len(self._real_len(idx, attn_mask))
        return attn_mask

    def _prefill_hidden(self, idx: torch.Tensor, attn_mask: Optional[torch.Tensor] = None
                        ) -> Tuple[torch.Tensor, LMState]:
        """:meth:`prefill` of checked arguments (:meth:`_check_prompt_mask`), without the ``lm_head``."""
        one_process(self, "prefill / generation")
        real = self._real_len(idx, attn_mask)
        x = self._embed(idx, 0, attn_mask)
        states = []
        for blk in self.transformer.h:
            x, st = blk.prefill(x, attn_mask)
            states.append(st)
        return self.transformer.ln_f(x), LMState(real, tuple(states))

    def prefill(self, idx: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, LMState]:
        """Run a prompt idx (B, T) (``attn_mask`` (B, T) keep-mask for a padded batch):
        ``(logits (B, T, V), state)`` to continue with :meth:`step`. Steps after a padded
        prefill continue each sequence from its own real tokens."""
        self._check_idx(idx)
        h, state = self._prefill_hidden(idx, self._check_prompt_mask(idx, attn_mask))
        return self.lm_head(h), state

    def step(self, idx_t: torch.Tensor, state: Optional[LMState] = None) -> Tuple[torch.Tensor, LMState]:
        """Feed one token per sequence, idx_t (B,) -> ``(logits (B, V), new state)``.

        ToST: constant memory and time per token; GPT: the key/value cache grows by one token.
        Raises ``ValueError`` past the context limit (see :attr:`context_limit`).
        """
        h, state = self._step_hidden(idx_t, self._check_step(idx_t, state))
        return self.lm_head(h), state

    def step_hidden_states(self, idx_t: torch.Tensor, state: Optional[LMState] = None
                           ) -> Tuple[torch.Tensor, LMState, List[torch.Tensor]]:
        """:meth:`step` with the per-block outputs of the new token: ``(final hidden after ln_f (B, D),
        new state, [embedding, block 1 output, ..., block L output])``, each (B, D) (the token's
        column of :meth:`forward_hidden_states`)."""
        states: List[torch.Tensor] = []
        h, state = self._step_hidden(idx_t, self._check_step(idx_t, state), states)
        return h, state, states

    def _check_step(self, idx_t, state) -> LMState:
        """:meth:`step`'s arguments: idx_t (B,) token ids and a state (:meth:`_check_state`), returned."""
        check_token_ids(idx_t, "idx_t", self.vocab_size, "(B,)", ndim=1)
        return self._check_state(state)

    def _check_state(self, state) -> LMState:
        """An LMState of this model (None: a new one) whose next position is within the context limit."""
        if state is None:
            state = LMState(0, (None,) * self.depth)
        elif not isinstance(state, LMState) or len(state.layers) != self.depth:
            raise TypeError(f"state must be an LMState with {self.depth} layer states (from prefill/step) or None")
        self._check_len(state.pos + 1)
        return state

    def _step_hidden(self, idx_t: torch.Tensor, state: LMState,
                     states: Optional[List[torch.Tensor]] = None) -> Tuple[torch.Tensor, LMState]:
        """One token of checked arguments (:meth:`_check_step`) through the blocks -> ``(hidden after
        ln_f (B, D), new state)``; the embedding and each block's output are appended to ``states``
        when a list is given."""
        one_process(self, "step")
        x = self._embed(idx_t[:, None], state.pos)[:, 0]
        if states is not None:
            states.append(x)
        new = []
        for blk, st in zip(self.transformer.h, state.layers):
            x, st = blk.step(x, st)
            new.append(st)
            if states is not None:
                states.append(x)
        return self.transformer.ln_f(x), LMState(state.pos + 1, tuple(new))

    # ---- generation ---------------------------------------------------------------------------
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

    # ---- checkpoints --------------------------------------------------------------------------
    def convert_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Map an official ToST / nanoGPT language-model state_dict (``_orig_mod.`` stripped by
        the loader) onto this model's keys; own keys pass unchanged.

        - ``transformer.h.{i}.attn.c_attn`` / ``c_proj`` / ``denom_bias`` -> ``qkv`` / ``proj`` /
          ``pos_bias``; nanoGPT's causal-mask buffer ``attn.bias`` (4-D) is dropped;
        - a missing ``lm_head.weight`` or ``transformer.wte.weight`` is filled from the other (tied);
        - ``wpe`` / ``pos_bias`` longer than this model's ``max_len`` are cropped to it (as
          nanoGPT ``crop_block_size``); a position embedding or a non-zero position bias the model
          does not have raises ``ValueError`` (all-zero position biases are dropped).
        """
        out: Dict[str, torch.Tensor] = {}
        for key, val in state_dict.items():
            new = key
            if ".attn." in key:
                head, tail = key.rsplit(".attn.", 1)
                if tail == "bias" and val.dim() == 4:
                    continue  # nanoGPT causal mask buffer
                tail = {"c_attn.weight": "qkv.weight", "c_attn.bias": "qkv.bias",
                        "c_proj.weight": "proj.weight", "c_proj.bias": "proj.bias",
                        "denom_bias": "pos_bias"}.get(tail, tail)
                new = f"{head}.attn.{tail}"
            out[new] = val
        if "lm_head.weight" not in out and "transformer.wte.weight" in out:
            out["lm_head.weight"] = out["transformer.wte.weight"]
        if "transformer.wte.weight" not in out and "lm_head.weight" in out:
            out["transformer.wte.weight"] = out["lm_head.weight"]
        wpe = out.get("transformer.wpe.weight")
        if wpe is not None:
            if not self.has_pos_emb:
                raise ValueError("checkpoint has a learned position embedding (transformer.wpe.weight) but the "
                                 "model was built with pos_emb=False")
            if wpe.shape[0] > self.max_len:
                out["transformer.wpe.weight"] = wpe[: self.max_len]
        modules = dict(self.named_modules())
        for key in [k for k in out if k.endswith(".attn.pos_bias")]:
            val, mod = out[key], modules.get(key[: -len(".pos_bias")])
            if mod is None:
                continue  # unknown module: the strict load reports it
            if getattr(mod, "pos_bias", None) is None:
                if bool((val != 0).any()):
                    raise ValueError(f"checkpoint has a non-zero position bias {key} but the model was built "
                                     f"with pos_bias=False")
                del out[key]
            elif val.dim() == 3 and val.shape[1] > mod.pos_bias.shape[1]:
                out[key] = val[:, : mod.pos_bias.shape[1]]
        return out


class ToSTLM(CausalLM):
    """Causal ToST language model: :class:`~whiteformer.attention.tssa.CausalTSSA` blocks in the
    nanoGPT shell (official ``tost_lang/model_TSSA.py`` with ``TSSA=True``).

    ``pos_bias=False`` drops TSSA's per-position membership bias and, with ``pos_emb=False``,
    removes every length limit.
    """

    hf_model_type = "whiteformer-tost-lm"
    length_free_kwargs = {"pos_emb": False, "pos_bias": False}

    def __init__(self, vocab_size: int = 50304, dim: int = 768, depth: int = 12, num_heads: int = 12,
                 max_len: int = 1024, pos_emb: bool = True, pos_bias: bool = True, mlp_ratio: float = 4.0,
                 bias: bool = False, dropout: float = 0.0, init_values: float = 1e-5,
                 eos_token_id: Optional[int] = None):
        super().__init__(vocab_size, dim, depth, num_heads, max_len, pos_emb, mlp_ratio, bias, dropout, init_values,
                         eos_token_id=eos_token_id, pos_bias=bool(pos_bias))

    def _make_attn(self, i: int) -> nn.Module:
        return CausalTSSA(self.dim, num_heads=self.num_heads, max_len=self.max_len,
                          pos_bias=self._attn_opts["pos_bias"],
                          qkv_bias=self.bias, proj_bias=self.bias, attn_drop=self.dropout, proj_drop=self.dropout)

    def _attn_len_limit(self) -> Optional[int]:
        return self.max_len if self._attn_opts["pos_bias"] else None


class GPTLM(CausalLM):
    """Softmax-attention GPT baseline in the same shell (official ``model_TSSA.py`` with
    ``TSSA=False``): :class:`CausalSelfAttention` with a key/value cache.

    Generation past ``max_len`` with a learned ``wpe`` crops the context as nanoGPT does.
    ``mlp_act="gelu_tanh"``: the MLP's GELU is the tanh approximation (GPT-2's ``gelu_new``; the
    shell of :func:`whiteformer.convert.from_transformers` for a transformers GPT-2).
    """

    hf_model_type = "whiteformer-gpt"

    def __init__(self, vocab_size: int = 50304, dim: int = 768, depth: int = 12, num_heads: int = 12,
                 max_len: int = 1024, pos_emb: bool = True, mlp_ratio: float = 4.0, bias: bool = False,
                 dropout: float = 0.0, init_values: float = 1e-5, mlp_act: str = "gelu",
                 eos_token_id: Optional[int] = None):
        super().__init__(vocab_size, dim, depth, num_heads, max_len, pos_emb, mlp_ratio, bias, dropout, init_values,
                         mlp_act, eos_token_id=eos_token_id)

    def _make_attn(self, i: int) -> nn.Module:
        return CausalSelfAttention(self.dim, num_heads=self.num_heads, qkv_bias=self.bias, proj_bias=self.bias,
                                   attn_drop=self.dropout, proj_drop=self.dropout)



_SIZES = dict(base=dict(dim=768, depth=12, num_heads=12),
              medium=dict(dim=1024, depth=24, num_heads=16),
              large=dict(dim=1280, depth=36, num_heads=20))


@register_model
def tost_lm_base(**kwargs) -> ToSTLM:
    """Causal ToST-base: 12 layers, 12 heads, D 768 (110.38M with vocabulary 50304)."""
    return build_with_defaults(ToSTLM, _SIZES["base"], kwargs)


@register_model
def tost_lm_medium(**kwargs) -> ToSTLM:
    """Causal ToST-medium: 24 layers, 16 heads, D 1024 (304.71M)."""
    return build_with_defaults(ToSTLM, _SIZES["medium"], kwargs)


@register_model
def tost_lm_large(**kwargs) -> ToSTLM:
    """Causal ToST-large: 36 layers, 20 heads, D 1280 (656.45M)."""
    return build_with_defaults(ToSTLM, _SIZES["large"], kwargs)


@register_model
def gpt_base(**kwargs) -> GPTLM:
    """Softmax GPT baseline, GPT-2 base dims (12/12/768), same shell as ToST."""
    return build_with_defaults(GPTLM, _SIZES["base"], kwargs)


@register_model
def gpt_medium(**kwargs) -> GPTLM:
    """Softmax GPT baseline, GPT-2 medium dims (24/16/1024)."""
    return build_with_defaults(GPTLM, _SIZES["medium"], kwargs)


@register_model
def gpt_large(**kwargs) -> GPTLM:
    """Softmax GPT baseline, GPT-2 large dims (36/20/1280)."""
    return build_with_defaults(GPTLM, _SIZES["large"], kwargs)
