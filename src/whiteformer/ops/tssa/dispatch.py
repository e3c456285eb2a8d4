"""The public :func:`tssa`: argument checks, then the kernel that runs it (see :mod:`.._kernels`)."""
from __future__ import annotations

import functools
from typing import Optional, Tuple, Union

import torch

from ..._checks import (
    check_finite,
    check_finite_real,
    check_heads_input,
    check_instance,
    check_probability,
    check_same_device,
    check_tensor,
    is_real,
)
from ..._dtypes import stats_dtype
from .._kernels import fused_supported, has_kernel, kernel_for
from .._kernels.fused import rows_checked, tssa_fused
from ..context_parallel import local_checks
from ..layout import TokenLayout, from_padded, to_padded
from .parallel import tssa_parallel
from .varlen import tssa_varlen

__all__ = ["tssa", "run"]


def check_temp(temp, heads: int, like: torch.Tensor, name: str = "temp") -> torch.Tensor:
    """TSSA's per-head temperature: a tensor of shape (H, 1), or a finite number, returned as the (H, 1)
    tensor of that value on ``like``'s device (in :func:`stats_dtype` of ``like``). NaN/inf raise:
    always for a number; for a tensor when it is on the CPU and torch.compile is not tracing (the
    check reads H values: no device synchronisation, no graph break)."""
    if is_real(temp):
        value = check_finite_real(temp, name)
        return torch.full((heads, 1), value, dtype=stats_dtype(like), device=like.device)
    check_tensor(temp, name, 2)
    if temp.shape != (heads, 1):
        raise ValueError(f"{name} must have shape (H, 1) = ({heads}, 1) to match w, got {tuple(temp.shape)}")
    if temp.device.type == "cpu" and not torch.compiler.is_compiling():
        check_finite(temp, name)
    return temp


def check_pos_bias(pos_bias, heads: int, name: str = "pos_bias") -> None:
    """Causal TSSA's position bias: None or a per-head, per-position bias of shape (H, T_max, 1)
    with T_max >= 1."""
    if pos_bias is None:
        return
    check_tensor(pos_bias, name, 3)
    if pos_bias.shape[0] != heads or pos_bias.shape[2] != 1 or pos_bias.shape[1] == 0:
        raise ValueError(
            f"{name} must have shape (H, T_max, 1) with H = {heads} and T_max >= 1, got {tuple(pos_bias.shape)}"
        )


def check_tssa_args(w, temp, attn_drop, group, pos_bias=None, layout=None, attn_mask=None):
    """The arguments that :func:`tssa` and :func:`~whiteformer.ops.causal_tssa` share besides the token
    layout (checked inside their ``local_checks``; the layout: :meth:`TokenLayout.of`): w (B, H, N, p)
    (N = 0 too on a rank of a split sequence), ``temp``, ``pos_bias``, their devices (and
    ``attn_mask``'s) and ``attn_drop``. Returns ``(temp (H, 1), attn_drop as a float)``."""
    split = layout_group(layout, group) is not None
    check_heads_input(w, allow_no_tokens=split)  # split: a rank may hold no tokens
    temp = check_temp(temp, w.shape[1], w)
    check_pos_bias(pos_bias, w.shape[1])
    check_same_device(w, temp=temp, pos_bias=pos_bias, attn_mask=attn_mask)
    drop = check_probability(attn_drop, "attn_drop")
    return temp, drop


def layout_group(layout, group):
    """The process group of a call given ``group`` and a ``layout`` (None or a TokenLayout, checked here)."""
    check_instance(layout, "layout", TokenLayout, "a TokenLayout (TokenLayout.of) or None", optional=True)
    return group if layout is None else layout.group


def check_layout_alone(layout, x: torch.Tensor, attn_mask, cu_seqlens, group, token_dim: int = 2,
                       name: str = "w") -> None:
    """A ``layout=`` (a TokenLayout) comes instead of ``attn_mask`` / ``cu_seqlens`` / ``group`` and
    describes ``x``."""
    check_instance(layout, "layout", TokenLayout, "a TokenLayout (TokenLayout.of) or None")
    if attn_mask is not None or cu_seqlens is not None or group is not None:
        raise ValueError("pass either layout or attn_mask / cu_seqlens / group: the layout already holds them")
    layout.check_matches(x.shape[0], x.shape[token_dim], name)


def tssa(
    w: torch.Tensor,
    temp: Union[torch.Tensor, float],
    attn_mask: Optional[torch.Tensor] = None,
    return_pi: bool = False,
    *,
    attn_drop: float = 0.0,
    training: bool = False,
    normalize: bool = True,
    group=None,
    cu_seqlens: Optional[torch.Tensor] = None,
    layout: Optional[TokenLayout] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Token Statistics Self-Attention (ToST Eq. (11), memberships Eq. (10)/(34)).

    Args:
        w: (B, H, N, p) projected tokens ``U_k^T Z`` per head.
        temp: (H, 1) temperature (``1 / (2 eta)`` in Eq. (10)), or one finite number for every head.
        attn_mask: optional (B, N) bool keep-mask (True = real token). Padded tokens take no
            part in any statistic (norms, membership sums, second moments) and their outputs
            are 0, so each real token gets the result of its sequence alone.
        return_pi: also return the memberships Pi.
        attn_drop: dropout probability on the gain ``1 / (1 + dots)`` (as the official layer).
        training: dropout is applied only when True.
        normalize: l2-normalise each feature over the tokens before computing Pi (Eq. (32)-(34),
            the official default). ``False`` gives ``Pi = softmax_heads(temp * sum_p w^2)``: the
            "no l2 normalisation" row of the ToST Table 8 ablation (always the PyTorch path).
        group: a ``torch.distributed`` process group over which the sequence is split (context
            parallelism): each rank passes its contiguous chunk of the tokens, w (B, H, N_r, p)
            (group rank order = sequence order; N_r may differ, every rank the same B, H, p and dtype;
            ``attn_mask`` is this chunk's, None where it has no padding), and gets exactly its rows
            of the unsplit op, forward and backward. Communication per call: all-reduces of (B, H, p) and (B, H, p + 1)
            sums, independent of N (:mod:`whiteformer.ops.context_parallel`). Always the
            PyTorch path: the fused kernels (C++ CPU, Triton) form their token sums internally
            and take no combined ones. With dropout, the gain's mask is the first rank's.
            ``None``: the op on this process's tokens alone.
        cu_seqlens: optional (S + 1,) int32 boundaries of S packed documents (FlashAttention's
            convention: starts at 0, non-decreasing, ends at N) with ``w`` of shape (1, H, N, p):
            each document is its own sequence (its own statistics and memberships), exactly as
            if run alone (:mod:`whiteformer.ops.layout`: the PyTorch path works on the packed
            tokens directly, the fused kernels on a padded layout if it wastes little). Not
            combined with ``attn_mask``. With a ``group``: the boundaries of the whole split row (the same on every rank); a document
            may span ranks.
        layout: instead of ``attn_mask`` / ``cu_seqlens`` / ``group``, their
            :class:`~whiteformer.ops.layout.TokenLayout` (``TokenLayout.of(w, ..., token_dim=2)``, or
            a model's, built once for all its blocks): nothing of it is validated or read again.

    Returns:
        out (B, H, N, p) in ``w``'s dtype; with ``return_pi``, ``(out, pi)`` with pi (B, H, N)
        (softmax over heads; 0 at padded tokens).

    Under float16/bfloat16 (or autocast) all statistics are computed in float32. Any finite ``w``
    gives a finite result: features whose largest |w_j| over the tokens exceeds 2^32 are rescaled
    by a power of two before squaring, each feature of each head by its own
    (:mod:`whiteformer.ops.scaling`, per packed document with ``cu_seqlens``; the
    kernels that square w unscaled hand such inputs to the PyTorch path). The formula is
    :func:`.parallel.tssa_parallel`; :func:`whiteformer.ops.reference.tssa_reference` is the literal
    one.
    """
    with local_checks(layout_group(layout, group), w):  # split: no rank waits in a collective
        temp, drop = check_tssa_args(w, temp, attn_drop, group, None, layout, attn_mask)
        check_instance(normalize, "normalize", bool, "a bool")
        if layout is not None:
            check_layout_alone(layout, w, attn_mask, cu_seqlens, group)
    if layout is None:  # the arguments that decide the collectives: the same on every rank
        layout = TokenLayout.of(w, attn_mask, cu_seqlens, group, token_dim=2, name="w", row="(1, H, total, p)",
                                same=[2 * normalize + (training and drop > 0)],
                                same_name="cu_seqlens, normalize and attn_drop (training)")
    return run(w, temp, layout=layout, return_pi=return_pi, attn_drop=drop, training=training, normalize=normalize)


def run(w: torch.Tensor, temp: torch.Tensor, *, layout: TokenLayout, return_pi: bool = False, attn_drop: float = 0.0,
        training: bool = False, normalize: bool = True):
    """:func:`tssa` on checked arguments: ``temp`` (H, 1), the ``layout`` of w's tokens
    (:meth:`TokenLayout.of`), ``attn_drop`` a probability. The entry of the layers, which check
    their own input; a model builds the layout once for all its blocks."""
    torch_only = not normalize or training and attn_drop
    group = layout.group
    if layout.packed and (group is not None or has_kernel("tssa", w, torch_only) and layout.pads_little):
        pk = layout.packing  # the fused kernels run the padded layout when it wastes little
        out, pi = run(to_padded(w, pk), temp, layout=layout.padded(), return_pi=True, attn_drop=attn_drop,
                      training=training, normalize=normalize)
        out, pi = from_padded(out, pk), from_padded(pi, pk)
        return (out, pi) if return_pi else out
    drop_p = attn_drop if training else 0.0
    attn_mask = layout.mask
    if layout.packed:  # the PyTorch path on the packed tokens, no padded layout
        out, pi = tssa_varlen(w, temp, layout.segments, drop_p, normalize=normalize)
    elif group is not None:
        out, pi = tssa_parallel(w, temp, attn_mask, drop_p, normalize=normalize, group=group)
    elif normalize and drop_p == 0.0:
        # the batch rows past a kernel's range take the rescaled PyTorch path
        kernel = kernel_for("tssa", w)
        if kernel is not None:  # a registered backend's: its rows are checked before the call
            kernel = functools.partial(rows_checked, kernel, tssa_parallel)
        elif fused_supported(w):  # the C++ kernel flags such rows itself: no pass over w
            kernel = functools.partial(tssa_fused, fallback=tssa_parallel)
        out, pi = kernel(w, temp, attn_mask) if kernel is not None else tssa_parallel(w, temp, attn_mask)
    else:
        out, pi = tssa_parallel(w, temp, attn_mask, drop_p, normalize=normalize)
    return (out, pi) if return_pi else out
