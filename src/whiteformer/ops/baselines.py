"""Baseline attention operators: softmax MHSA, XCiT's XCA, CRATE's MSSA and CaiT/XCiT class attention.

All operators take head-split tensors of shape (B, H, N, p) (B batch, H heads, N tokens, p head dim)
and an optional (B, N) bool keep-mask ``attn_mask`` (True = real token). With a mask, padded tokens
are excluded as keys and their outputs are 0, so every real token gets the same result as when its
sequence is run alone; a fully padded sequence gives zeros (never NaN). Padded positions of q, k, v
are zeroed first, so NaN/inf held by a padded token reaches no real token, forward or backward.

Under float16/bfloat16 the softmax logits, the softmax and the token-wise norms are computed in
float32 (also inside ``torch.autocast``); outputs are returned in the input dtype.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .._checks import (
    check_finite_real,
    check_heads_input,
    check_mask,
    check_probability,
    check_same_device,
    check_tensor,
    is_real,
)
from .._dtypes import autocast_off, stats_dtype
from .._utils import zero_padded
from .context_parallel import all_reduce_max, all_reduce_sum, chunk_layout, local_checks

__all__ = ["mhsa", "mhsa_explicit", "xca", "mssa", "class_attention"]


# ----------------------------------------------------------------------------- helpers


def _check_same(ref: torch.Tensor, other: torch.Tensor, ref_name: str, name: str) -> None:
    if other.shape != ref.shape:
        raise ValueError(f"{name} must have the shape of {ref_name} {tuple(ref.shape)}, got {tuple(other.shape)}")
    if other.dtype != ref.dtype:
        raise TypeError(f"{name} must have the dtype of {ref_name} ({ref.dtype}), got {other.dtype}")


def _check_attention(q, k, v, attn_mask, dropout_p, **operands):
    """The operands of :func:`mhsa`, :func:`mhsa_explicit` and :func:`xca`: q, k, v (B, H, N, p) of
    one shape, dtype and device, the (B, N) keep-mask and the tensors of ``operands`` (name=value)
    on their device, and the dropout probability; returns ``(keep, dropout_p)``."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        check_heads_input(t, name)
    _check_same(q, k, "q", "k")
    _check_same(q, v, "q", "v")
    keep = check_mask(attn_mask, q.shape[0], q.shape[2])
    check_same_device(q, "q", k=k, v=v, attn_mask=keep, **operands)
    return keep, check_probability(dropout_p, "dropout_p")


def _scale(scale, head_dim: int) -> float:
    if scale is None:
        return head_dim ** -0.5
    if not is_real(scale):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    return float(scale)


def _allowed(keep: torch.Tensor, q_keep: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """(B, 1, Nq, N) bool: which keys each query may attend to (``q_keep`` is the (B, Nq) keep-mask
    of the queries).

    Padded keys are excluded. Rows of padded queries are fully opened so that no row is empty
    (an all -inf row would give NaN); those outputs are zeroed afterwards.
    """
    allowed = keep[:, None, None, :]
    if causal:
        n = keep.shape[1]
        allowed = allowed & torch.ones(n, n, dtype=torch.bool, device=keep.device).tril()
    return allowed | ~q_keep[:, None, :, None]


def _zero_padded(out: torch.Tensor, q_keep: torch.Tensor) -> torch.Tensor:
    """Zero the outputs (B, H, Nq, p) of padded queries; ``q_keep`` is (B, Nq)."""
    return zero_padded(out, q_keep, 2)


# ----------------------------------------------------------------------------- softmax attention


def mhsa(q, k, v, attn_mask=None, *, causal: bool = False, scale=None, dropout_p: float = 0.0):
    """Softmax attention ``softmax(q k^T * scale) v`` (Vaswani et al. 2017, Eq. 1) through
    ``F.scaled_dot_product_attention`` (fused kernels; their logits/softmax accumulate in float32).

    Args:
        q, k, v: (B, H, N, p).
        attn_mask: optional (B, N) bool keep-mask; padded keys are excluded, padded outputs are 0.
        causal: token i attends to tokens j <= i only (may be combined with ``attn_mask``).
        scale: logit scale, default ``p ** -0.5``.
        dropout_p: dropout on the attention weights (pass 0 at evaluation).
    Returns:
        (B, H, N, p) in the dtype of ``q``.
    """
    keep, dropout_p = _check_attention(q, k, v, attn_mask, dropout_p)
    return _mhsa(q, k, v, keep, bool(causal), _scale(scale, q.shape[-1]), dropout_p)


def _mhsa(q, k, v, keep, causal: bool, s: float, dropout_p: float):
    """:func:`mhsa` on checked arguments (``keep`` bool or None, the scale ``s`` a float)."""
    if keep is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=bool(causal), scale=s)
    q, k, v = (zero_padded(t, keep, 2) for t in (q, k, v))
    allowed = _allowed(keep, keep, bool(causal))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=s)
    return _zero_padded(out, keep)


def mhsa_explicit(q, k, v, attn_mask=None, *, causal: bool = False, scale=None, dropout_p: float = 0.0):
    """Softmax attention written as explicit matmuls, ``A = softmax(q k^T * scale)``, ``out = A v``.

    Same contract as :func:`mhsa`. Its two matmuls are visible to ``torch.utils.flop_counter``
    (the fused SDPA CPU kernel is not), so use it for FLOP counting: 4 B H N^2 p FLOPs.
    Logits and softmax are computed in float32 under half precision.
    """
    keep, dropout_p = _check_attention(q, k, v, attn_mask, dropout_p)
    return _mhsa_explicit(q, k, v, keep, bool(causal), _scale(scale, q.shape[-1]), dropout_p)


def _mhsa_explicit(q, k, v, keep, causal: bool, s: float, dropout_p: float):
    """:func:`mhsa_explicit` on checked arguments (as :func:`_mhsa`)."""
    sd = stats_dtype(q)
    n = q.shape[2]
    q, k, v = (zero_padded(t, keep, 2) for t in (q, k, v))
    with autocast_off(q):
        logits = (q.to(sd) @ k.to(sd).transpose(-2, -1)) * s
        if keep is not None:
            logits = logits.masked_fill(~_allowed(keep, keep, bool(causal)), float("-inf"))
        elif causal:
            tri = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            logits = logits.masked_fill(~tri, float("-inf"))
        attn = logits.softmax(dim=-1)
        if dropout_p > 0:
            attn = F.dropout(attn, p=dropout_p)
        out = (attn @ v.to(sd)).to(q.dtype)
    return out if keep is None else _zero_padded(out, keep)


def mssa(w, attn_mask=None, *, scale=None, dropout_p: float = 0.0):
    """CRATE's multi-head subspace self-attention ``softmax(w w^T * scale) w`` with q = k = v = w
    (Yu et al. 2023, "White-Box Transformers via Sparse Rate Reduction"; scale ``p ** -0.5`` by
    default, as the official code), through ``F.scaled_dot_product_attention``.

    Args:
        w: (B, H, N, p) the subspace projections ``U_k^T z``.
        attn_mask: optional (B, N) bool keep-mask (padded keys excluded, padded outputs 0).
    Returns:
        (B, H, N, p).
    """
    check_heads_input(w)
    keep = check_mask(attn_mask, w.shape[0], w.shape[2])
    check_same_device(w, attn_mask=keep)
    return _mhsa(w, w, w, keep, False, _scale(scale, w.shape[-1]), check_probability(dropout_p, "dropout_p"))


# ----------------------------------------------------------------------------- XCA


def _check_temperature(temperature, heads: int, q: torch.Tensor) -> torch.Tensor:
    if is_real(temperature):
        value = check_finite_real(temperature, "temperature")
        return torch.full((1, heads, 1, 1), value, dtype=stats_dtype(q), device=q.device)
    check_tensor(temperature, "temperature")
    if temperature.numel() != heads or temperature.dim() > 3 or any(s != 1 for s in temperature.shape[1:]):
        raise ValueError(f"temperature must have shape (H, 1, 1) with H = {heads} heads, got {tuple(temperature.shape)}")
    return temperature.reshape(1, heads, 1, 1).to(stats_dtype(q))


def xca(q, k, v, temperature, attn_mask=None, *, dropout_p: float = 0.0):
    """Cross-covariance attention of XCiT (El-Nouby et al. 2021, Sec. 3.1), as the official code computes it.

    With q, k l2-normalised along the **token** axis, each head mixes channels:
    ``A = softmax(q_hat^T k_hat * temperature)`` (p x p), ``out = v A^T``, i.e. ``(A v^T)^T``.

    Args:
        q, k, v: (B, H, N, p).
        temperature: (H, 1, 1) tensor (one learnable scale per head) or a float.
        attn_mask: optional (B, N) keep-mask; padded tokens are zeroed in q, k, v before the
            normalisation and the covariance (so they are excluded) and their outputs are 0.
    Returns:
        (B, H, N, p). Norms, logits and softmax in float32 under half precision.
    """
    keep, dropout_p = _check_attention(q, k, v, attn_mask, dropout_p, temperature=temperature)
    return _xca(q, k, v, _check_temperature(temperature, q.shape[1], q), keep, dropout_p)


def _xca(q, k, v, temp, keep, dropout_p: float):
    """:func:`xca` on checked arguments (``temp`` (1, H, 1, 1) or (H, 1, 1), ``keep`` bool or None)."""
    sd = stats_dtype(q)
    with autocast_off(q):
        q, k, v32 = q.to(sd), k.to(sd), v.to(sd)
        q, k, v32 = (zero_padded(t, keep, 2) for t in (q, k, v32))
        q = F.normalize(q, dim=-2)
        k = F.normalize(k, dim=-2)
        attn = (q.transpose(-2, -1) @ k) * temp  # (B, H, p, p)
        attn = attn.softmax(dim=-1)
        if dropout_p > 0:
            attn = F.dropout(attn, p=dropout_p)
        out = v32 @ attn.transpose(-2, -1)
    return out.to(v.dtype)


# ----------------------------------------------------------------------------- class attention


def class_attention(q_cls, k, v, attn_mask=None, *, scale=None, dropout_p: float = 0.0, group=None):
    """Class attention of CaiT (Touvron et al. 2021, Sec. 3) as used by XCiT/ToST: only the class
    token queries, ``softmax(q_cls k^T * scale) v`` over all N tokens (the class token included).

    Args:
        q_cls: (B, H, 1, p) query of the class token (token 0).
        k, v: (B, H, N, p) keys and values of all tokens, class token first.
        attn_mask: optional (B, N) keep-mask; padded keys are excluded; if the class token itself
            is padded its output is 0.
        scale: default ``p ** -0.5``.
        group: a ``torch.distributed`` process group over which the tokens are split (context
            parallelism): on every rank k, v hold the class token (the same on every rank, counted
            once) followed by this rank's contiguous chunk; the softmax is combined over the ranks
            (max shift, then an all-reduce of ``[sum_j e_j v_j, sum_j e_j]``, (B, H, p + 1)), so
            every rank gets the unsplit output. No ``attn_mask`` with a group; dropout masks are
            per rank.
    Returns:
        (B, H, 1, p): the attention output of the class token.
    """
    with local_checks(group, k):  # split: a rank failing these stops every rank (no wait in a collective)
        for t, name in ((q_cls, "q_cls"), (k, "k"), (v, "v")):
            check_heads_input(t, name)
        if q_cls.shape[2] != 1:
            raise ValueError(f"q_cls must hold one query token, shape (B, H, 1, p), got {tuple(q_cls.shape)}")
        want = (q_cls.shape[0], q_cls.shape[1], k.shape[2], q_cls.shape[3])
        if tuple(k.shape) != want:
            raise ValueError(f"k must have shape (B, H, N, p) = {want} matching q_cls, got {tuple(k.shape)}")
        _check_same(k, v, "k", "v")
        if k.dtype != q_cls.dtype:
            raise TypeError(f"k must have the dtype of q_cls ({q_cls.dtype}), got {k.dtype}")
        keep = check_mask(attn_mask, k.shape[0], k.shape[2])
        check_same_device(k, "k", q_cls=q_cls, v=v, attn_mask=keep)
        dropout_p = check_probability(dropout_p, "dropout_p")
        s = _scale(scale, q_cls.shape[-1])
        if group is not None and keep is not None:
            raise ValueError("class_attention with a group takes no attn_mask")
    return _class_attention(q_cls, k, v, keep, s, dropout_p, group)


def _class_attention(q_cls, k, v, keep, s: float, dropout_p: float, group=None):
    """:func:`class_attention` on checked arguments (``keep`` bool or None, ``s`` the scale)."""
    if group is not None:
        return _class_attention_split(q_cls, k, v, s, dropout_p, group)
    if keep is None:
        return F.scaled_dot_product_attention(q_cls, k, v, dropout_p=dropout_p, scale=s)
    q_cls = zero_padded(q_cls, keep[:, :1], 2)
    k, v = zero_padded(k, keep, 2), zero_padded(v, keep, 2)
    allowed = _allowed(keep, keep[:, :1])
    out = F.scaled_dot_product_attention(q_cls, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=s)
    return _zero_padded(out, keep[:, :1])


def _class_attention_split(q_cls, k, v, scale: float, dropout_p: float, group):
    """Class attention over tokens split across ``group`` (see :func:`class_attention`)."""
    chunk_layout(k, group, name="k")
    sd = stats_dtype(q_cls)
    with autocast_off(q_cls):
        logits = torch.matmul(q_cls.to(sd), k.to(sd).transpose(-2, -1)) * scale  # (B, H, 1, N_r)
        if dist.get_rank(group) > 0:  # the class token's key counts on the first rank only
            logits = torch.cat([torch.full_like(logits[..., :1], float("-inf")), logits[..., 1:]], dim=-1)
        e = torch.exp(logits - all_reduce_max(logits.amax(dim=-1, keepdim=True), group))
        weights = F.dropout(e, p=dropout_p, training=True) if dropout_p > 0 else e
        sums = all_reduce_sum(torch.cat([torch.matmul(weights, v.to(sd)), e.sum(-1, keepdim=True)], dim=-1), group)
        out = sums[..., :-1] / sums[..., -1:]
    return out.to(q_cls.dtype)
