"""Long-Range-Arena sequence classifiers (ToST paper, Sec. 4.3, Tables 3 and 7).

The ToST paper evaluates a **non-causal** ToST encoder on LRA (Tay et al., 2021), built on an
off-the-shelf PyTorch LRA code base; that shell is the usual LRA encoder::

    tokens (B, N) -> token embedding + learned position embedding -> dropout
      -> depth x block   pre-norm:  x = x + drop(attn(LN(x), mask)); x = x + drop(mlp(LN(x)))
                         post-norm: x = LN(x + drop(attn(x, mask)));  x = LN(x + drop(mlp(x)))
      -> LN (pre-norm only) -> pool (mean over real tokens, or a CLS token) -> head

    head:      Linear(D, mlp_dim) -> ReLU -> Linear(mlp_dim, classes)
    dual head: the two documents' pooled codes u, v -> [u, v, u * v, u - v] -> the same MLP
               (Retrieval: one shared encoder reads both documents)

The attention is any layer of the :mod:`whiteformer.attention` registry (``attn="tssa"`` for ToST,
``"mhsa"`` for the softmax Transformer baseline); padded positions are hidden from it with the
(B, N) keep-mask of the layer contract, and the mean pooling averages over real tokens only.

Table 7 of the ToST paper (registered as ``tost_lra_<task>``; ``transformer_lra_<task>`` is the
same shell with softmax attention):

=========== ====== ===== ===== ========= ========= ======================================
task        layers dim   heads MLP dim   pre-norm  input (LRA)
=========== ====== ===== ===== ========= ========= ======================================
ListOps     6      512   8     2048      yes       2k tokens of 16 symbols, 10 classes
Text        4      256   4     1024      yes       4k bytes, 2 classes (IMDB)
Retrieval   6      128   4     512       yes       2 x 4k bytes, 2 classes (AAN)
Image       8      64    8     128       yes       32x32 = 1024 grey pixels, 10 classes
Pathfinder  2      64    2     128       no        32x32 = 1024 pixels, 2 classes
=========== ====== ===== ===== ========= ========= ======================================

Dropout (Table 7): 0.1 except Image (0.0). The optimiser settings of Table 7 (lr, warm-up,
inverse-sqrt / linear decay, weight decay, batch size, iterations) are in :data:`TABLE7_OPTIM`.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Set

import torch
import torch.nn as nn

from .. import attention as _attention
from .._checks import (
    as_keep_mask,
    check_choice,
    check_divisible,
    check_int,
    check_mask,
    check_probability,
    check_token_ids,
    is_int,
)
from .._compile import can_read_values
from ..layers import GradCheckpointMixin, Mlp
from .registry import build_with_defaults, register_model
from .save import PretrainedMixin
from .vision import _attention_kwargs, check_attn_args

__all__ = ["LRABlock", "LRAClassifier", "TABLE7", "TABLE7_OPTIM", "LRA_TASKS"]

LRA_TASKS = ("listops", "text", "retrieval", "image", "pathfinder")

# ToST Table 7: architecture (depth L, width d, heads K, MLP dim, pre-norm, dropout).
TABLE7: Dict[str, Dict[str, Any]] = {
    "listops": dict(depth=6, embed_dim=512, num_heads=8, mlp_dim=2048, prenorm=True, drop_rate=0.1),
    "text": dict(depth=4, embed_dim=256, num_heads=4, mlp_dim=1024, prenorm=True, drop_rate=0.1),
    "retrieval": dict(depth=6, embed_dim=128, num_heads=4, mlp_dim=512, prenorm=True, drop_rate=0.1),
    "image": dict(depth=8, embed_dim=64, num_heads=8, mlp_dim=128, prenorm=True, drop_rate=0.0),
    "pathfinder": dict(depth=2, embed_dim=64, num_heads=2, mlp_dim=128, prenorm=False, drop_rate=0.1),
}

# ToST Table 7: optimisation (AdamW; "schedule" is the decay after the linear warm-up).
TABLE7_OPTIM: Dict[str, Dict[str, Any]] = {
    "listops": dict(batch_size=64, lr=1e-4, weight_decay=1e-2, steps=90000, warmup_steps=3000, schedule="inverse_sqrt"),
    "text": dict(batch_size=32, lr=1e-4, weight_decay=1e-2, steps=25000, warmup_steps=10000, schedule="linear"),
    "retrieval": dict(batch_size=64, lr=1e-4, weight_decay=4e-2, steps=91960, warmup_steps=10000, schedule="linear"),
    "image": dict(batch_size=64, lr=1e-4, weight_decay=2e-2, steps=180000, warmup_steps=9000, schedule="linear"),
    "pathfinder": dict(batch_size=256, lr=2e-4, weight_decay=0.0, steps=200000, warmup_steps=312, schedule="linear"),
}

# The LRA inputs (vocabulary incl. padding id 0 where sequences are padded, length, classes).
_INPUTS: Dict[str, Dict[str, Any]] = {
    "listops": dict(vocab_size=16, max_len=2048, num_classes=10, pad_id=0),
    "text": dict(vocab_size=257, max_len=4096, num_classes=2, pad_id=0),
    "retrieval": dict(vocab_size=257, max_len=4096, num_classes=2, pad_id=0, dual=True),
    "image": dict(vocab_size=256, max_len=1024, num_classes=10, pad_id=None),
    "pathfinder": dict(vocab_size=256, max_len=1024, num_classes=2, pad_id=None),
}

_POOLS = ("mean", "cls")


class LRABlock(nn.Module):
    """One encoder block, pre-norm or post-norm (see module docstring).

    Shapes: ``forward(x (B, N, C), attn_mask (B, N) bool or None) -> (B, N, C)``.
    """

    def __init__(self, dim: int, num_heads: int, mlp_dim: int, attn: str = "tssa",
                 attn_kwargs: Optional[Dict[str, Any]] = None, prenorm: bool = True, qkv_bias: bool = True,
                 drop: float = 0.0, attn_drop: float = 0.0, norm_eps: float = 1e-5):
        super().__init__()
        self.prenorm = bool(prenorm)
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = _attention.build(
            attn, dim, num_heads=num_heads, **_attention_kwargs(attn, qkv_bias, attn_drop, drop, attn_kwargs))
        self.drop1 = nn.Dropout(drop)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, mlp_dim, drop=drop)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.prenorm:
            x = x + self.drop1(self.attn(self.norm1(x), attn_mask=attn_mask))
            return x + self.mlp(self.norm2(x))
        x = self.norm1(x + self.drop1(self.attn(x, attn_mask=attn_mask)))
        return self.norm2(x + self.mlp(x))


class LRAClassifier(GradCheckpointMixin, PretrainedMixin, nn.Module):
    """Sequence classifier of the LRA benchmark with a pluggable attention (see module docstring).

    Args:
        vocab_size: token ids are in ``[0, vocab_size)``.
        num_classes: classes of the head.
        max_len: longest sequence (learned position embeddings; a CLS token takes one more).
        embed_dim, depth, num_heads, mlp_dim: width D, blocks, heads, hidden width of the block MLPs
            (also of the classifier head, as the LRA code).
        prenorm: pre-norm blocks and a final LayerNorm (True) or post-norm blocks (False).
        attn: name in the :mod:`whiteformer.attention` registry; ``attn_kwargs`` go to its
            constructor unchanged.
        qkv_bias: bias of the attention input projection.
        drop_rate, attn_drop_rate: dropout after the embeddings / in the blocks; attention dropout.
        pool: "mean" (average of the real tokens' codes) or "cls" (a learned token prepended).
        pad_id: token id of padding: when ``forward`` gets no ``attn_mask``, the keep-mask is
            ``tokens != pad_id`` (None: every position is real, e.g. pixel sequences).
        dual: two-document input (Retrieval): ``tokens`` (B, 2, N), one shared encoder, the head
            reads ``[u, v, u * v, u - v]``.

    Shapes: ``forward(tokens, attn_mask=None)``: tokens (B, N) int (or (B, 2, N) when ``dual``),
    attn_mask bool of the same shape (True = real token) -> logits (B, num_classes).
    ``forward_features(tokens, attn_mask)`` -> pooled codes (B, D) of (B, N) tokens.
    """

    model_kind = "sequence classifier"

    def __init__(self, vocab_size: int = 256, num_classes: int = 2, max_len: int = 1024, embed_dim: int = 64,
                 depth: int = 2, num_heads: int = 2, mlp_dim: int = 128, prenorm: bool = True, attn: str = "tssa",
                 attn_kwargs: Optional[Dict[str, Any]] = None, qkv_bias: bool = True, drop_rate: float = 0.0,
                 attn_drop_rate: float = 0.0, pool: str = "mean", pad_id: Optional[int] = 0, dual: bool = False):
        super().__init__()
        check_divisible(embed_dim, num_heads, "embed_dim")
        for name, v, low in (("vocab_size", vocab_size, 1), ("num_classes", num_classes, 1), ("max_len", max_len, 1),
                             ("depth", depth, 0), ("mlp_dim", mlp_dim, 1)):
            check_int(v, name, low)
        check_choice(pool, "pool", _POOLS)
        if pad_id is not None and (not is_int(pad_id)
                                   or not 0 <= pad_id < vocab_size):
            raise ValueError(f"pad_id must be None or a token id in [0, {vocab_size}), got {pad_id!r}")
        check_attn_args(attn, attn_kwargs)
        drop_rate = check_probability(drop_rate, "drop_rate")
        attn_drop_rate = check_probability(attn_drop_rate, "attn_drop_rate")
        self.vocab_size, self.num_classes, self.max_len = vocab_size, num_classes, max_len
        self.embed_dim, self.depth, self.num_heads, self.mlp_dim = embed_dim, depth, num_heads, mlp_dim
        self.prenorm, self.pool, self.pad_id, self.dual, self.attn_name = bool(prenorm), pool, pad_id, bool(dual), attn

        self.tok_embed = nn.Embedding(vocab_size, embed_dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, max_len + (pool == "cls"), embed_dim))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if pool == "cls" else None
        self.pos_drop = nn.Dropout(drop_rate)
        self.blocks = nn.ModuleList(
            LRABlock(embed_dim, num_heads, mlp_dim, attn=attn, attn_kwargs=attn_kwargs, prenorm=prenorm,
                     qkv_bias=qkv_bias, drop=drop_rate, attn_drop=attn_drop_rate) for _ in range(depth))
        self.norm = nn.LayerNorm(embed_dim) if prenorm else nn.Identity()
        head_in = 4 * embed_dim if dual else embed_dim
        self.head = nn.Sequential(nn.Linear(head_in, mlp_dim), nn.ReLU(), nn.Linear(mlp_dim, num_classes))
        self._init_weights()

    def _init_weights(self) -> None:
        nn.init.normal_(self.tok_embed.weight, std=0.02)
        nn.init.normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def no_weight_decay(self) -> Set[str]:
        names = {"pos_embed", "cls_token"}
        for prefix, mod in self.named_modules():
            fn = getattr(mod, "no_weight_decay", None)
            if prefix and callable(fn):
                names |= {f"{prefix}.{n}" for n in fn()}
        return names

    # ---- input checks -------------------------------------------------------------------------
    def _check_tokens(self, tokens, attn_mask, pair: bool):
        want = "(B, 2, N) (two documents: the model is dual)" if pair else "(B, N)"
        check_token_ids(tokens, "tokens", self.vocab_size, want, 3 if pair else 2)
        if pair and tokens.shape[1] != 2:
            raise ValueError(f"tokens must have shape {want}, got {tuple(tokens.shape)}")
        if tokens.shape[-1] > self.max_len:
            raise ValueError(f"sequence length {tokens.shape[-1]} exceeds the model's max_len {self.max_len}")
        if attn_mask is not None:
            if not isinstance(attn_mask, torch.Tensor) or attn_mask.shape != tokens.shape:
                got = tuple(attn_mask.shape) if isinstance(attn_mask, torch.Tensor) else type(attn_mask).__name__
                raise ValueError(f"attn_mask must be a bool tensor of the tokens' shape {tuple(tokens.shape)}, "
                                 f"got {got}")
            attn_mask = as_keep_mask(attn_mask)
        elif self.pad_id is not None:
            attn_mask = tokens != self.pad_id
        if attn_mask is not None and can_read_values() and not bool(attn_mask.any(-1).all()):
            raise ValueError("every sequence needs at least one real token (attn_mask / non-padding ids)")
        return attn_mask

    # ---- forward ------------------------------------------------------------------------------
    def _encode(self, tokens: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> torch.Tensor:
        b, n = tokens.shape
        x = self.tok_embed(tokens)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(b, -1, -1), x], dim=1)
            if attn_mask is not None:
                attn_mask = torch.cat([attn_mask.new_ones(b, 1), attn_mask], dim=1)
        x = self.pos_drop(x + self.pos_embed[:, : x.shape[1]])
        if attn_mask is not None and can_read_values() and bool(attn_mask.all()):
            attn_mask = None  # nothing to hide: the layers' unmasked (fast) path
        check_mask(attn_mask, b, x.shape[1], device=x.device)
        for blk in self.blocks:
            x = self.run_block(blk, x, attn_mask=attn_mask)
        x = self.norm(x)
        if self.cls_token is not None:
            return x[:, 0]
        if attn_mask is None:
            return x.mean(1)
        keep = attn_mask.unsqueeze(-1).to(x.dtype)
        return (x * keep).sum(1) / keep.sum(1)

    def forward_features(self, tokens: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Pooled codes (B, D) of one batch of (B, N) sequences (either encoder input)."""
        return self._encode(tokens, self._check_tokens(tokens, attn_mask, pair=False))

    def forward(self, tokens: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        attn_mask = self._check_tokens(tokens, attn_mask, pair=self.dual)
        if not self.dual:
            return self.head(self._encode(tokens, attn_mask))
        b = tokens.shape[0]
        both = self._encode(tokens.flatten(0, 1), None if attn_mask is None else attn_mask.flatten(0, 1))
        u, v = both.view(b, 2, -1).unbind(1)
        return self.head(torch.cat([u, v, u * v, u - v], dim=-1))


# ---------------------------------------------------------------------------- registry
def _lra(task: str, attn: str, overrides: Dict[str, Any]) -> LRAClassifier:
    return build_with_defaults(LRAClassifier, {**_INPUTS[task], **TABLE7[task], "attn": attn}, overrides)


@register_model
def tost_lra_listops(**kwargs) -> LRAClassifier:
    """ToST on LRA ListOps (Table 7): 6 pre-norm blocks, D 512, 8 heads, MLP 2048, TSSA."""
    return _lra("listops", "tssa", kwargs)


@register_model
def tost_lra_text(**kwargs) -> LRAClassifier:
    """ToST on LRA Text (Table 7): 4 pre-norm blocks, D 256, 4 heads, MLP 1024, TSSA; byte ids + 1."""
    return _lra("text", "tssa", kwargs)


@register_model
def tost_lra_retrieval(**kwargs) -> LRAClassifier:
    """ToST on LRA Retrieval (Table 7): dual encoder, 6 pre-norm blocks, D 128, 4 heads, MLP 512, TSSA."""
    return _lra("retrieval", "tssa", kwargs)


@register_model
def tost_lra_image(**kwargs) -> LRAClassifier:
    """ToST on LRA Image (Table 7): 8 pre-norm blocks, D 64, 8 heads, MLP 128, no dropout, TSSA."""
    return _lra("image", "tssa", kwargs)


@register_model
def tost_lra_pathfinder(**kwargs) -> LRAClassifier:
    """ToST on LRA Pathfinder (Table 7): 2 post-norm blocks, D 64, 2 heads, MLP 128, TSSA."""
    return _lra("pathfinder", "tssa", kwargs)


@register_model
def transformer_lra_listops(**kwargs) -> LRAClassifier:
    """Softmax-attention baseline on the ``tost_lra_listops`` shell."""
    return _lra("listops", "mhsa", kwargs)


@register_model
def transformer_lra_text(**kwargs) -> LRAClassifier:
    """Softmax-attention baseline on the ``tost_lra_text`` shell."""
    return _lra("text", "mhsa", kwargs)


@register_model
def transformer_lra_retrieval(**kwargs) -> LRAClassifier:
    """Softmax-attention baseline on the ``tost_lra_retrieval`` shell (dual encoder)."""
    return _lra("retrieval", "mhsa", kwargs)


@register_model
def transformer_lra_image(**kwargs) -> LRAClassifier:
    """Softmax-attention baseline on the ``tost_lra_image`` shell."""
    return _lra("image", "mhsa", kwargs)


@register_model
def transformer_lra_pathfinder(**kwargs) -> LRAClassifier:
    """Softmax-attention baseline on the ``tost_lra_pathfinder`` shell."""
    return _lra("pathfinder", "mhsa", kwargs)
