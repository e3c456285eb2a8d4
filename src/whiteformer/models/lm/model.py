"""The shell of the causal language models, :class:`CausalLM` (construction, embedding, blocks,
forward and loss), its two attention choices :class:`ToSTLM` (causal TSSA) and :class:`GPTLM`
(softmax), and their registered sizes (see :mod:`whiteformer.models.lm`)."""
from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..._checks import (
    check_choice,
    check_divisible,
    check_finite_real,
    check_int,
    check_positive_real,
    check_probability,
)
from ..._compile import can_read_values
from ..._dtypes import stats_dtype
from ...attention.causal import CausalSelfAttention
from ...attention.context_parallel import ContextParallel
from ...attention.tssa import CausalTSSA
from ...layers import GradCheckpointMixin, feature_take_indices
from ...ops.context_parallel import all_reduce_sum, local_checks
from ...ops.layout import TokenLayout
from ...ops.linear_cross_entropy import linear_cross_entropy
from .._context_parallel import check_blocks_split, one_process
from ..registry import build_with_defaults, register_model
from ..save import PretrainedMixin
from .blocks import MLP_ACTS, LMBlock
from .checks import LMInputChecks
from .convert import LMStateDictConversion
from .generation import LMGeneration
from .step import LMRecurrence

__all__ = ["CausalLM", "ToSTLM", "GPTLM"]


class CausalLM(LMInputChecks, LMRecurrence, LMGeneration, LMStateDictConversion, GradCheckpointMixin, ContextParallel,
               PretrainedMixin, nn.Module):
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

    def check_context_parallel(self) -> None:
        check_blocks_split(self, self.transformer.h)

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
        return self._hidden(idx, self._check_inputs(idx, attn_mask, cu_seqlens, targets, idx_checked), states)

    def _hidden(self, idx: torch.Tensor, layout: TokenLayout, states: Optional[List[torch.Tensor]] = None
                ) -> torch.Tensor:
        """Checked ids idx (B, T) of the tokens that ``layout`` describes through the embedding, the
        blocks (each handed the layout) and ``ln_f``."""
        return self._blocks(self._embed(idx, positions=layout.positions if self.has_pos_emb else None), layout, states)

    def _blocks(self, x: torch.Tensor, layout: Optional[TokenLayout] = None,
                states: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
        """Embeddings x (B, T, D) of checked inputs (their ``layout``; None: no padding, one sequence per
        row) through the blocks and ``ln_f``."""
        if states is not None:
            states.append(x)
        for blk in self.transformer.h:
            x = self.run_block(blk, x, None, None, layout)
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
        layout = self._check_inputs(idx, attn_mask, cu_seqlens, targets)  # targets checked too
        h = self._hidden(idx, layout)
        if targets is not None and layout.packed:
            ends = cu_seqlens[1:-1].to(targets.device, torch.long)
            ends = ends[(ends > 0) & (ends < layout.total)] - 1 - layout.start  # each document's last token but the row's
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
