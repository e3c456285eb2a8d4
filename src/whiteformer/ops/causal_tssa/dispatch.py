"""The public :func:`causal_tssa` and :func:`causal_tssa_step`: argument checks, then the kernel
that runs them (see :mod:`.._kernels`)."""
from __future__ import annotations

import functools
from typing import Optional, Union

import torch

from ..._checks import (
    check_nonempty,
    check_probability,
    check_same_device,
    check_tensor,
)
from ..._compile import can_read_values
from ..._dtypes import stats_dtype
from .._kernels import fused_supported, has_kernel, kernel_for
from .._kernels.fused import causal_tssa_fused, rows_checked
from ..context_parallel import local_checks
from ..layout import TokenLayout, from_padded, to_padded
from ..tssa.dispatch import check_layout_alone, check_pos_bias, check_temp, check_tssa_args, layout_group
from .parallel import causal_tssa_parallel
from .recurrent import causal_tssa_recurrent
from .state import CausalTSSAState, check_state, feature_scale_of, position_logit_bias
from .varlen import causal_tssa_varlen

__all__ = ["causal_tssa", "run", "causal_tssa_step", "run_step"]


def causal_tssa(
    w: torch.Tensor,
    temp: Union[torch.Tensor, float],
    pos_bias: Optional[torch.Tensor] = None,
    attn_mask: Optional[torch.Tensor] = None,
    return_pi: bool = False,
    *,
    return_state: bool = False,
    attn_drop: float = 0.0,
    training: bool = False,
    group=None,
    cu_seqlens: Optional[torch.Tensor] = None,
    layout: Optional[TokenLayout] = None,
):
    """Causal Token Statistics Self-Attention (ToST Eq. (28) with memberships Eq. (39)).

    For each head, with w of shape (N, p) and prefix sums over tokens s <= t::

        ratio_t = w_t^2 / max(sum_{s<=t} w_s^2, 1e-12)                       (Eq. 35, squared)
        Pi_t    = softmax_heads( temp * (sum_p ratio_t + p * b_t) )          (Eq. 39, b = pos_bias)
        dots_t  = sum_{s<=t} Pi_s w_s^2 / (sum_{s<=t} Pi_s + 1e-8)
        out_t   = -(w_t * Pi_t) / (1 + dots_t)                                (Eq. 28)

    The bias is added to every feature's ratio before the sum over p, as the official code does,
    hence ``+ p * b_t``. ``out_t`` depends only on tokens ``<= t``.

    Args:
        w: (B, H, N, p) projected tokens per head.
        temp: (H, 1) temperature, or one finite number for every head.
        pos_bias: optional (H, T_max, 1) per-head, per-position bias on the membership logits
            (zeros at init). ``N > T_max`` raises ``ValueError`` (with ``attn_mask``: a sequence with more
            than ``T_max`` real tokens; padding has no position); ``None`` has no length limit.
        attn_mask: optional (B, N) bool keep-mask (True = real token). Padded tokens are left
            out of all cumulative statistics and their outputs (and Pi) are 0; a real token's
            position (for ``pos_bias``) is its index among the real tokens of its sequence, so
            each real token gets the result of its sequence alone (left or right padding).
        return_pi: also return Pi (B, H, N).
        return_state: also return the :class:`CausalTSSAState` after the last token (to
            continue with :func:`causal_tssa_step`); with a mask, ``t`` is the (B,) count of
            real tokens.
        attn_drop: dropout probability on the gain ``1 / (1 + dots)`` (official code).
        training: dropout is applied only when True.
        group: a ``torch.distributed`` process group over which the sequence is split (context
            parallelism): each rank passes its contiguous chunk of the tokens, w (B, H, N_r, p)
            (group rank order = sequence order; N_r may differ, every rank the same B, H, p and dtype;
            ``attn_mask`` is this chunk's, None where it has no padding) and gets exactly its rows
            of the unsplit op, forward and backward. Positions (``pos_bias``, the ``T_max`` limit
            on the whole length; with a mask, on each sequence's real tokens) are global. The sums of the earlier ranks'
            tokens come from an exclusive prefix over ranks of the per-rank totals (all-gathers
            of (B, H, p) and (B, H, 1 + p) sums and an all-reduce of the (B, H, p) input scales,
            independent of N;
            :mod:`whiteformer.ops.context_parallel`). ``return_state`` gives
            the state after this rank's last token. Always the PyTorch path: the fused kernels
            (C++ CPU, Triton) start their prefix sums at zero and take no combined statistics.
            ``None``: the op on this process's tokens alone.
        cu_seqlens: optional (S + 1,) int32 boundaries of S packed documents (FlashAttention's
            convention: starts at 0, non-decreasing, ends at N) with ``w`` of shape (1, H, N, p):
            each document is its own sequence (own statistics, memberships, positions 0.. for
            ``pos_bias``: the longest document must fit ``T_max``), exactly as if run alone
            (:mod:`whiteformer.ops.layout`: the PyTorch path works on the packed tokens
            directly, the fused kernels on a padded layout if it wastes little). ``return_state``
            then gives one state per document (batch S, ``t`` the (S,) lengths). Not combined with ``attn_mask``. With a
            ``group``: the boundaries of the whole split row (the same on every rank); a document
            may span ranks.
        layout: instead of ``attn_mask`` / ``cu_seqlens`` / ``group``, their
            :class:`~whiteformer.ops.layout.TokenLayout` (``TokenLayout.of(w, ..., token_dim=2)``, or
            a model's, built once for all its blocks): nothing of it is validated or read again.

    Returns:
        out (B, H, N, p) in ``w``'s dtype, or a tuple ``(out, [pi], [state])`` in that order.

    Any finite ``w`` gives a finite result: features whose largest |w_j| over the tokens exceeds
    2^32 are rescaled by a power of two before squaring, each feature of each head by its own
    (:mod:`whiteformer.ops.scaling`, per packed document with ``cu_seqlens``; the kernels that
    square w unscaled hand such inputs to the PyTorch path). The state keeps its sums in units of
    those powers of two (its ``scale`` (B, H, p)), so that steps from it are finite too and
    continue the sequence exactly as the parallel op. Limit: on the PyTorch path in float32
    statistics (``WHITEFORMER_BACKEND=torch``, bfloat16/float16, dropout, ``group``, packed rows
    with much padding; the C++ kernel's flagged rows run in float64 and are exact), tokens before
    a value more than ~2^63 times larger in their feature underflow to 0 in its scale and get wrong
    memberships and outputs.
    """
    temp, drop, layout = _door(w, temp, pos_bias, attn_mask, cu_seqlens, attn_drop, group, layout)
    return run(w, temp, pos_bias, layout=layout, return_pi=return_pi, return_state=return_state, attn_drop=drop,
               training=training)


def _door(w, temp, pos_bias, attn_mask, cu_seqlens, attn_drop, group, layout):
    """:func:`causal_tssa`'s checks -> ``(temp (H, 1), attn_drop, the TokenLayout)``."""
    with local_checks(layout_group(layout, group), w):  # split: a rank failing these stops every rank
        temp, drop = check_tssa_args(w, temp, attn_drop, group, pos_bias, layout, attn_mask)
        if layout is not None:
            check_layout_alone(layout, w, attn_mask, cu_seqlens, group)
    if layout is None:  # the table's length too: each rank checks the whole length against it
        layout = TokenLayout.of(w, attn_mask, cu_seqlens, group, token_dim=2, name="w", row="(1, H, total, p)",
                                same=[0 if pos_bias is None else pos_bias.shape[1]],
                                same_name="cu_seqlens and pos_bias (its length T_max)")
    return temp, drop, layout


def run(w: torch.Tensor, temp: torch.Tensor, pos_bias: Optional[torch.Tensor] = None, *, layout: TokenLayout,
        return_pi: bool = False, return_state: bool = False, attn_drop: float = 0.0, training: bool = False):
    """:func:`causal_tssa` on checked arguments: ``temp`` (H, 1), the ``layout`` of w's tokens (its
    mask, packed documents and group; :meth:`TokenLayout.of`), ``attn_drop`` a probability; the
    length limit of ``pos_bias`` is checked here. The entry of the layers, which check their own
    input; a model builds the layout once for all its blocks."""
    if pos_bias is not None and layout.longest > pos_bias.shape[1]:
        if layout.packed:
            raise ValueError(f"the longest packed document ({layout.longest} tokens) exceeds the positional bias "
                             f"table length T_max = {pos_bias.shape[1]} (pos_bias has shape {tuple(pos_bias.shape)})")
        raise ValueError(f"sequence length N = {layout.longest} exceeds the positional bias table length T_max = "
                         f"{pos_bias.shape[1]} (pos_bias has shape {tuple(pos_bias.shape)})")
    if layout.packed:  # the fused kernels run the padded layout when it wastes little, else the PyTorch path
        if layout.group is not None or has_kernel("causal_tssa", w, training and attn_drop) and layout.pads_little:
            pk = layout.packing
            out, pi, *state = run(to_padded(w, pk), temp, pos_bias, layout=layout.padded(), return_pi=True,
                                  return_state=return_state, attn_drop=attn_drop, training=training)
            res = (from_padded(out, pk),) + ((from_padded(pi, pk),) if return_pi else ()) + tuple(state)
            return res if len(res) > 1 else res[0]
        return _causal_varlen(w, temp, pos_bias, layout, attn_drop if training else 0.0, return_pi, return_state)
    n, p = w.shape[2], w.shape[3]
    drop_p = attn_drop if training else 0.0
    attn_mask, group, start = layout.mask, layout.group, layout.start
    if pos_bias is not None and isinstance(start, torch.Tensor):  # rows without real tokens on this rank
        start = start.clamp_max(pos_bias.shape[1] - 1)

    bias = None if pos_bias is None else position_logit_bias(pos_bias, p, n, attn_mask, start=start)
    kernel = None  # the batch rows past a kernel's range take the rescaled PyTorch path
    if drop_p == 0.0 and group is None:
        kernel = kernel_for("causal_tssa", w)
        if kernel is not None:  # a registered backend's: its rows are checked before the call
            kernel = functools.partial(rows_checked, functools.partial(_feature_scaled, kernel), causal_tssa_parallel)
            if bias is not None:  # per batch row, as the check may split the batch
                bias = bias.expand(w.shape[0], *bias.shape[-2:])
        elif fused_supported(w):  # the C++ kernel flags such rows itself: no pass over w
            kernel = functools.partial(causal_tssa_fused, fallback=_parallel_float64)
    if kernel is not None:
        out, pi, *sums = kernel(w, temp, bias, attn_mask)  # four sums: _feature_scaled, the C++ kernel
    else:
        out, pi, *sums = causal_tssa_parallel(w, temp, bias, attn_mask, drop_p, group=group)
    if not (return_pi or return_state):
        return out
    res = (out,)
    if return_pi:
        res += (pi,)
    if return_state:
        sd = stats_dtype(w)
        t = start + (n if attn_mask is None else attn_mask.long().sum(dim=-1))
        scale = torch.ones_like(sums[0]) if sums[3] is None else feature_scale_of(sums[3], p)
        res += (CausalTSSAState(*(s.to(sd) for s in sums[:3]), t, scale.to(sd)),)
    return res


def _feature_scaled(kernel, w: torch.Tensor, *args):
    """A registered ``causal_tssa`` kernel's outputs with their scale per feature (B, H, p): a (B, H)
    scale (one per head) taken for every feature, a kernel's three sums (in w's units) given scale 1,
    so that its rows and the fallback's fit together."""
    out, pi, *sums = kernel(w, *args)
    scale = torch.ones_like(sums[0]) if len(sums) == 3 or sums[3] is None else feature_scale_of(sums[3], w.shape[-1])
    return (out, pi, *sums[:3], scale)


def _parallel_float64(w: torch.Tensor, temp: torch.Tensor, bias: Optional[torch.Tensor], mask: Optional[torch.Tensor]):
    """:func:`causal_tssa_parallel` in float64 on the batch rows that the C++ kernel flags (some
    |w| > SAFE_MAX): w (B, H, N, p), temp (H, 1), bias (B, H, N) or None, mask (B, N) or None ->
    out, pi in ``w``'s dtype, the final sums (float64) and their scale (B, H, p). In float64 the
    squares of a float32 input (a float64 one runs as it is) in units of its feature's scale
    ``c_j`` (over all the tokens, at most 2^127) stay far inside the range at both ends (a nonzero
    |w / c_j|^2 is at least 2^-552), so the tokens before a far larger one in their feature keep
    their squares, which float32 prefix sums would underflow. The final sums in units of
    ``c_j^2`` are below ``4 N``, sum_sq at least 1 where ``c_j > 1`` (the largest token's share):
    the state's float32 holds them as it holds a step's."""
    out, pi, *sums = causal_tssa_parallel(w.double(), temp.double(), None if bias is None else bias.double(), mask)
    return (out.to(w.dtype), pi.to(w.dtype), *sums)


def _causal_varlen(w, temp, pos_bias, layout: TokenLayout, drop_p, return_pi, return_state):
    """:func:`causal_tssa` of a packed row (one process) on checked arguments, without a padded layout."""
    seg = layout.segments
    out, pi, *sums = causal_tssa_varlen(w, temp, seg, pos_bias, drop_p)
    res = (out,) + ((pi,) if return_pi else ())
    if return_state:
        res += (CausalTSSAState(*sums[:3], torch.tensor(seg.lengths, device=w.device), sums[3]),)
    return res if len(res) > 1 else res[0]


def causal_tssa_step(
    w_t: torch.Tensor,
    state: Optional[CausalTSSAState],
    temp: Union[torch.Tensor, float],
    pos_bias: Optional[torch.Tensor] = None,
    *,
    return_pi: bool = False,
    attn_drop: float = 0.0,
    training: bool = False,
):
    """One step of causal TSSA (recurrent form of :func:`causal_tssa`, same equations).

    Args:
        w_t: (B, H, p) the projected current token.
        state: :class:`CausalTSSAState` of the previous tokens, or None to start.
        temp: (H, 1) temperature, or one finite number for every head.
        pos_bias: optional (H, T_max, 1); raises ``ValueError`` once ``t`` reaches ``T_max``.
        return_pi: also return pi_t (B, H).

    Returns:
        ``(out_t, new_state)`` (or ``(out_t, pi_t, new_state)``) with out_t (B, H, p) in
        ``w_t``'s dtype. Stepping through a sequence reproduces :func:`causal_tssa`, for any
        finite ``w_t``: the state's sums are kept in units of its power-of-two ``scale``.
    """
    check_tensor(w_t, "w_t", 3)
    check_nonempty(w_t, "w_t", 1, "heads")
    check_nonempty(w_t, "w_t", 2, "features (head dim p)")
    temp = check_temp(temp, w_t.shape[1], w_t)
    check_pos_bias(pos_bias, w_t.shape[1])
    check_same_device(w_t, "w_t", temp=temp, pos_bias=pos_bias)
    drop = check_probability(attn_drop, "attn_drop")
    return run_step(w_t, state, temp, pos_bias, return_pi=return_pi, attn_drop=drop, training=training)


def run_step(w_t: torch.Tensor, state: Optional[CausalTSSAState], temp: torch.Tensor,
             pos_bias: Optional[torch.Tensor] = None, *, return_pi: bool = False, attn_drop: float = 0.0,
             training: bool = False, check_position: bool = True):
    """:func:`causal_tssa_step` on checked arguments (``temp`` (H, 1); the ``state`` and the length
    limit are checked here, the limit of a (B,) position by one host read unless ``check_position``
    is False: a language model that checked its state's position against its context limit): the
    entry of :meth:`whiteformer.attention.CausalTSSA.step`, which checks its own input (no host read
    of ``temp`` at each generated token)."""
    b, h, p = w_t.shape
    drop_p = attn_drop if training else 0.0
    sd = stats_dtype(w_t)
    if state is None:
        zeros = torch.zeros(b, h, p, dtype=sd, device=w_t.device)
        state = CausalTSSAState(zeros, torch.zeros(b, h, dtype=sd, device=w_t.device), zeros, 0,
                                torch.ones(b, h, p, dtype=sd, device=w_t.device))
    else:
        check_state(state, w_t)
    t = state.t
    bias = None
    if pos_bias is not None:
        t_max = pos_bias.shape[1]
        if isinstance(t, torch.Tensor):  # not read while a graph is traced (an exported step)
            too_long = check_position and can_read_values() and bool((t >= t_max).any())
        else:
            too_long = t >= t_max
        if too_long:
            raise ValueError(f"position t = {t} reached the positional bias table length T_max = {t_max}; "
                             f"causal TSSA with pos_bias cannot go past T_max tokens")
        bias = position_logit_bias(pos_bias, p, 1, start=t)  # (H, 1) or (B, H, 1)
    sums = tuple(s.to(sd) for s in state[:3])
    scale = None if state.scale is None else feature_scale_of(state.scale, p).to(sd)  # (B, H, p)
    kernel = kernel_for("causal_tssa_step", w_t) if drop_p == 0.0 else None
    if kernel is not None:
        out, pi, *sums, scale = kernel(w_t, *sums, temp, bias, scale)
    else:
        out, pi, *sums, scale = causal_tssa_recurrent(w_t, *sums, temp, bias, scale, drop_p)
    new_state = CausalTSSAState(*sums, t + 1, feature_scale_of(scale, p))
    return (out, pi, new_state) if return_pi else (out, new_state)
