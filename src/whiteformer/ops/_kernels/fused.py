r"""Fused TSSA and causal TSSA (ToST, Wu et al., ICLR 2025, Eqs. (11), (28); memberships
Eqs. (32)-(34), (39)): custom ops with a hand-derived backward that saves only ``w``, ``Pi``
and O(B H p) statistics and recomputes everything else.

The ops are ``torch.library`` custom ops (``whiteformer::tssa_fused_fwd`` / ``_bwd``,
``whiteformer::causal_tssa_fused_fwd`` / ``_bwd``) with a CPU implementation (the C++/OpenMP
extension ``_kernels/tssa_cpu.cpp``, built by :mod:`.build`), a fake (meta) implementation and a
registered autograd formula, so they also work inside ``torch.compile(fullgraph=True)``. An eager
call on plain CPU tensors calls the extension directly (through a ``torch.autograd.Function`` with
the same formula when it records gradients), skipping the custom op's dispatch, which costs several
times the kernel's own time on short sequences. Another
device adds its kernels with ``register_kernel(device_type)`` on the four ops (see
:mod:`whiteformer.ops._kernels`). The dispatchers :mod:`whiteformer.ops.tssa.dispatch` /
:mod:`whiteformer.ops.causal_tssa.dispatch` call them when :func:`fused_supported`. A backward
that must itself be differentiable (``create_graph=True``, e.g. gradient penalties) recomputes
the gradients through the PyTorch paths (:func:`whiteformer.ops.tssa.parallel.tssa_parallel`,
:func:`whiteformer.ops.causal_tssa.parallel.causal_tssa_parallel`) instead of the kernel.
The epsilons (``1e-24 = NORM_EPS^2``, ``1e-8 = PI_EPS``, ``1e-12 = RATIO_EPS`` below) come from
:mod:`whiteformer.ops.constants`. The kernels square w unscaled; each forward also returns a flag
per batch row, set when some feature's total sum of squares there (formed anyway) exceeds
``SAFE_MAX ** 2`` or is not finite, i.e. whenever the row holds some |w| > ``SAFE_MAX``: those rows
then run the rescaled PyTorch path (:mod:`whiteformer.ops.scaling`), and ordinary inputs pay no
pass of their own for the check.

Non-causal TSSA, per (b, h), w of shape (N, p), kept tokens only (a padded token has Pi = 0,
out = 0 and gradient 0)::

    s_j = sum_n w_nj^2,   r_j = 1 / max(s_j, 1e-24)                 (F.normalize over tokens)
    R_n = sum_j w_nj^2 r_j,   logit_n = temp R_n,   Pi_n = softmax_heads(logit)_n
    M = sum_n Pi_n,  c = 1 / (M + 1e-8),  T_j = sum_n Pi_n w_nj^2,  d_j = c T_j,  g_j = 1 / (1 + d_j)
    out_nj = -w_nj Pi_n g_j

Backward, with G = dL/dout and gPi = dL/dPi (returned Pi)::

    q_j = sum_n w_nj Pi_n G_nj              (dL/dg_j = -q_j)
    D_j = dL/dd_j = g_j^2 q_j               (dg/dd = -g^2)
    dL/dT_j = c D_j,  dL/dM = -c^2 sum_j D_j T_j = -c sum_j D_j d_j =: -K
    dL/dPi_n = gPi_n - sum_j w_nj g_j G_nj + sum_j c D_j w_nj^2 - K
    Lambda_n = Pi_n (dL/dPi_n - sum_heads Pi dL/dPi)         (softmax over heads at token n)
    dL/dtemp = sum_{b, n} Lambda_n R_n,   lambda_n = temp Lambda_n = dL/dR_n
    dL/ds_j = -r_j^2 sum_n lambda_n w_nj^2   (0 where s_j <= 1e-24: the clamp is active)
    dL/dw_nj = -Pi_n g_j G_nj + 2 w_nj (c D_j Pi_n + lambda_n r_j + dL/ds_j)

Forward: 3 reads of w (energies; logits + softmax + Pi-moments, fused per token block; output)
and 1 write; backward: 3 reads of w, 2 of G, 1 write. Saved: w, Pi (an output), s, T, M.

Causal TSSA (prefix sums over tokens s <= t, per (b, h))::

    E_t = sum w_s^2,  rho_t = w_t^2 / max(E_t, 1e-12),  logit_t = temp (sum_j rho_tj + lb_t)
    Pi_t = softmax_heads,  Q_t = sum Pi_s w_s^2,  M_t = sum Pi_s,  c_t = 1 / (M_t + 1e-8)
    d_t = c_t Q_t,  g_t = 1 / (1 + d_t),  out_t = -w_t Pi_t g_t

where ``lb = p * pos_bias[position]`` (computed by the caller, so autograd handles the gather).
Backward: D_t = g_t^2 w_t Pi_t G_t; dL/dQ_t = c_t D_t; dL/dM_t = -c_t sum_j D_tj d_tj; their
reverse cumulative sums U_s, V_s (plus the gradients of the returned final state); then
dL/dPi_s = gPi_s - sum_j w g G + sum_j U_sj w_sj^2 + V_s, Lambda and lambda = temp Lambda
(= dL/dlb) as above, dL/dtemp = sum Lambda (sum_j rho + lb), dL/dE_t = -lambda_t w_t^2 / E_t^2
(0 where clamped) with reverse cumulative sum W_s, and
dL/dw = -Pi g G + 2 w (U Pi + lambda / max(E, 1e-12) + W). The forward reads w once and writes
out once (one sequential scan per sequence; with fewer sequences than threads, a two-stage
pipeline on two threads) and saves the prefix sums (E, Q, M) at every chunk start
(O(B H p N / 256), a few % of w). The backward needs at token s only sums over the later tokens
(U, V, W), so it sweeps each sequence once in reverse, chunk by chunk: a forward recompute of the
chunk from its checkpoint into an L2-sized scratch, then one reverse scan giving lambda, dtemp and
dw (w and G read once from memory, dw written once). With fewer sequences than threads the chunks
are swept in parallel instead: a first pass forms the chunk sums of dL/dQ and dL/dM, and a last
one adds ``2 w W`` (W at the chunk's end, which enters dw linearly).
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..scaling import rows_beyond_kernel_range
from .build import load_extension
from .registry import fused_supported

__all__ = ["tssa_fused", "causal_tssa_fused", "fused_supported", "by_rows", "rows_checked"]

# tokens per work item / causal checkpoint (0: kernel default, 256); tests use tiny values
CHUNK = 0
# causal forward schedule: 1 one pass per sequence (parallel over the batch); 0 a two-stage
# pipeline per sequence on two threads (logits/Pi, then out); -1 auto (1 when B >= threads)
CAUSAL_MODE = -1


def _ext():
    ext = load_extension()
    if ext is None:
        raise RuntimeError("whiteformer fused TSSA kernel is not available on this machine")
    return ext


def _rows(t: Tensor) -> Tensor:
    """The kernels need a contiguous feature axis; other strides are free."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _d64(t: Tensor, *shape) -> Tensor:
    return t.new_empty(shape, dtype=torch.float64)


def _eager(*tensors: Optional[Tensor]) -> bool:
    """Whether the extension may be called directly, without the custom op around it: plain CPU
    tensors, nothing tracing the call (torch.compile, export, ``torch.jit.trace``, a dispatch mode
    such as fake tensors) and no torch.func transform. A direct call skips the custom op's dispatch
    (about 4x the kernel's own time on a small sequence); inside a traced graph the custom op must
    run."""
    if (torch.compiler.is_compiling() or torch.jit.is_tracing() or _get_current_dispatch_mode() is not None
            or torch._C._are_functorch_transforms_active()):
        return False
    for t in tensors:  # a loop, not all() over a generator: this runs at every call
        if t is not None and (type(t) is not Tensor or not t.is_cpu):
            return False
    return True


def _records_grad(*tensors: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _Eager(torch.autograd.Function):
    """The custom ops' autograd formula (their ``setup_context`` and ``backward``) around a direct
    call of the extension, for eager calls that record gradients (:func:`_eager`): the same saved
    tensors and backward as the custom op, without its dispatch layers."""

    @staticmethod
    def forward(ctx, kind, *inputs):
        ctx.set_materialize_grads(False)
        ctx.kind = kind
        output = tuple(getattr(_ext(), _OPS[kind][0])(*inputs))
        _OPS[kind][1](ctx, inputs, output)
        ctx.mark_non_differentiable(*output[_OPS[kind][3]:])
        return output

    @staticmethod
    def backward(ctx, *grads):
        return (None, *_OPS[ctx.kind][2](ctx, *grads))


# ------------------------------------------------------------------------------ double backward
# create_graph=True: the same forward in the differentiable PyTorch paths (imported when needed:
# those packages import this module).


def _double_backward(outs, inputs, grads):
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
    return torch.autograd.grad([o for o, _ in pairs], inputs, [g.to(o.dtype) for o, g in pairs],
                               create_graph=True, allow_unused=True)


# ------------------------------------------------------------------------------ non-causal


def _flags(w: Tensor) -> Tensor:
    return w.new_empty(w.shape[0], dtype=torch.bool)


def by_rows(over: Optional[Tensor], kernel: Callable, fallback: Callable, w: Tensor, temp: Tensor,
            *per_row: Optional[Tensor]) -> Optional[Tuple[Tensor, ...]]:
    """None when ``over`` ((B,) bool: the batch rows holding some |w| past a kernel's range,
    :data:`~whiteformer.ops.constants.SAFE_MAX`; or None) flags no row, or while compiling (a
    compiled graph keeps the kernel's result). Else ``fallback`` (the rescaled PyTorch path) on
    the flagged rows and ``kernel`` on the others, both called as ``(w, temp, *per_row)`` on those
    rows alone (``per_row``: tensors with the batch first, or None; each row is its own sequence),
    the outputs (batch first) put back in batch order. The kernel reruns on its rows alone: its
    backward on a flagged row would not be finite. ``over`` is read on the host (B bools)."""
    if over is None or torch.compiler.is_compiling() or not bool(over.any()):
        return None

    def rows(fn, i):
        return fn(w.index_select(0, i), temp, *(None if t is None else t.index_select(0, i) for t in per_row))

    bad, good = over.nonzero()[:, 0], (~over).nonzero()[:, 0]
    parts = [rows(fallback, bad)] + ([rows(kernel, good)] if good.numel() else [])
    order = torch.cat([bad, good]).argsort()
    return tuple(torch.cat([p[k] for p in parts]).index_select(0, order) for k in range(len(parts[0])))


def rows_checked(kernel: Callable, fallback: Callable, w: Tensor, temp: Tensor, *per_row: Optional[Tensor]):
    """``kernel(w, temp, *per_row)`` of a registered backend, which squares w unscaled, with the
    batch rows of a CPU ``w`` holding some |w| > SAFE_MAX run through ``fallback`` instead (found by
    a pass over w, :func:`~whiteformer.ops.scaling.rows_beyond_kernel_range`; see :func:`by_rows`)."""
    split = by_rows(rows_beyond_kernel_range(w), kernel, fallback, w, temp, *per_row)
    return kernel(w, temp, *per_row) if split is None else split


@torch.library.custom_op("whiteformer::tssa_fused_fwd", mutates_args=(), device_types="cpu")
def _tssa_fwd(
    w: Tensor, temp: Tensor, mask: Optional[Tensor], chunk: int
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    out, pi, s, t, m, over = _ext().tssa_fwd(w, temp, mask, chunk)
    return out, pi, s, t, m, over


@_tssa_fwd.register_fake
def _(w, temp, mask, chunk):
    b, h, n, p = w.shape
    return (torch.empty_like(w), w.new_empty(b, h, n), _d64(w, b, h, p), _d64(w, b, h, p), _d64(w, b, h),
            _flags(w))


@torch.library.custom_op("whiteformer::tssa_fused_bwd", mutates_args=(), device_types="cpu")
def _tssa_bwd(
    grad_out: Tensor, grad_pi: Optional[Tensor], w: Tensor, temp: Tensor, mask: Optional[Tensor],
    pi: Tensor, s: Tensor, t: Tensor, m: Tensor, chunk: int,
) -> Tuple[Tensor, Tensor]:
    dw, dtemp = _ext().tssa_bwd(grad_out, grad_pi, w, temp, mask, pi, s, t, m, chunk)
    return dw, dtemp


@_tssa_bwd.register_fake
def _(grad_out, grad_pi, w, temp, mask, pi, s, t, m, chunk):
    return torch.empty_like(w), _d64(w, w.shape[0], w.shape[1])


def _tssa_setup(ctx, inputs, output):
    w, temp, mask, chunk = inputs
    _, pi, s, t, m, _ = output
    ctx.chunk = chunk
    ctx.save_for_backward(w, temp, mask, pi, s, t, m)


def _tssa_backward(ctx, g_out, g_pi, *_):
    w, temp, mask, pi, s, t, m = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph: differentiable recomputation
        from ..tssa.parallel import tssa_parallel

        return (*_double_backward(tssa_parallel(w, temp, mask), (w, temp), (g_out, g_pi)), None, None)
    g_out = torch.zeros_like(w) if g_out is None else _rows(g_out)
    g_pi = None if g_pi is None else g_pi.contiguous()
    bwd = _ext().tssa_bwd if _eager(g_out, g_pi, w) else _tssa_bwd
    dw, dtemp = bwd(g_out, g_pi, w, temp, mask, pi, s, t, m, ctx.chunk)
    return dw, dtemp.sum(0).to(temp.dtype).view_as(temp), None, None


_tssa_fwd.register_autograd(_tssa_backward, setup_context=_tssa_setup)


def tssa_fused(w: Tensor, temp: Tensor, attn_mask: Optional[Tensor] = None,
               fallback: Optional[Callable] = None) -> Tuple[Tensor, Tensor]:
    """Fused TSSA (no dropout): w (B, H, N, p) float32/float64 on a supported device, temp
    (H, 1), attn_mask (B, N) bool or None -> (out (B, H, N, p), pi (B, H, N)). Inputs are
    assumed validated (see :func:`whiteformer.ops.tssa`). The kernel squares w unscaled: the batch
    rows in which it saw an input past its range (a sum of squares above ``SAFE_MAX ** 2``) are
    run through ``fallback`` (the rescaled PyTorch path, ``tssa_parallel``'s arguments) when
    given, the other rows through the kernel alone (each row is its own sequence)."""
    w = _rows(w)
    mask = None if attn_mask is None else attn_mask.contiguous()
    args = (w, temp.to(w.dtype).contiguous(), mask, CHUNK)
    if not _eager(w, temp, mask):
        out, pi, _, _, _, over = _tssa_fwd(*args)
    elif _records_grad(w, temp):
        out, pi, _, _, _, over = _Eager.apply("tssa", *args)
    else:
        out, pi, _, _, _, over = _ext().tssa_fwd(*args)
    split = None if fallback is None else by_rows(over, tssa_fused, fallback, w, temp, mask)
    return (out, pi) if split is None else split


# ------------------------------------------------------------------------------ causal


@torch.library.custom_op("whiteformer::causal_tssa_fused_fwd", mutates_args=(), device_types="cpu")
def _causal_fwd(
    w: Tensor, temp: Tensor, lb: Optional[Tensor], mask: Optional[Tensor], mode: int, chunk: int
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    out, pi, ec, qc, mc, over = _ext().causal_fwd(w, temp, lb, mask, mode, chunk)
    return out, pi, ec, qc, mc, over


@_causal_fwd.register_fake
def _(w, temp, lb, mask, mode, chunk):
    b, h, n, p = w.shape
    size = chunk if chunk > 0 else 256
    nc = (n + size - 1) // size + 1
    return (torch.empty_like(w), w.new_empty(b, h, n), _d64(w, b, nc, h, p), _d64(w, b, nc, h, p),
            _d64(w, b, nc, h), _flags(w))


@torch.library.custom_op("whiteformer::causal_tssa_fused_bwd", mutates_args=(), device_types="cpu")
def _causal_bwd(
    grad_out: Tensor, grad_pi: Optional[Tensor], grad_e: Optional[Tensor], grad_q: Optional[Tensor],
    grad_m: Optional[Tensor], w: Tensor, temp: Tensor, lb: Optional[Tensor], mask: Optional[Tensor],
    pi: Tensor, ec: Tensor, qc: Tensor, mc: Tensor, mode: int, chunk: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    dw, dlb, dtemp = _ext().causal_bwd(grad_out, grad_pi, grad_e, grad_q, grad_m, w, temp, lb, mask, pi, ec, qc,
                                       mc, mode, chunk)
    return dw, dlb, dtemp


@_causal_bwd.register_fake
def _(grad_out, grad_pi, grad_e, grad_q, grad_m, w, temp, lb, mask, pi, ec, qc, mc, mode, chunk):
    b, h, n, _ = w.shape
    return torch.empty_like(w), w.new_empty(b, h, n), _d64(w, b, h)


def _causal_setup(ctx, inputs, output):
    w, temp, lb, mask, mode, chunk = inputs
    _, pi, ec, qc, mc, _ = output
    ctx.mode, ctx.chunk = mode, chunk
    ctx.has_lb = lb is not None
    ctx.save_for_backward(w, temp, lb, mask, pi, ec, qc, mc)


def _last(g: Optional[Tensor]) -> Optional[Tensor]:
    # only the final prefix sums (the returned state) are visible to callers
    return None if g is None else g[:, -1].contiguous()


def _causal_backward(ctx, g_out, g_pi, g_ec, g_qc, g_mc, _):
    w, temp, lb, mask, pi, ec, qc, mc = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph: differentiable recomputation
        from ..causal_tssa.parallel import causal_tssa_parallel

        inputs = (w, temp) if lb is None else (w, temp, lb)
        out, pi, sum_sq, sum_pi, sum_sq_pi, _ = causal_tssa_parallel(w, temp, lb, mask)  # scale 1 in range
        grads = _double_backward((out, pi, sum_sq, sum_sq_pi, sum_pi), inputs,
                                 (g_out, g_pi, _last(g_ec), _last(g_qc), _last(g_mc)))
        return grads[0], grads[1], grads[2] if lb is not None else None, None, None, None
    g_out = torch.zeros_like(w) if g_out is None else _rows(g_out)
    g_pi = None if g_pi is None else g_pi.contiguous()
    bwd = _ext().causal_bwd if _eager(g_out, g_pi, w) else _causal_bwd
    dw, dlb, dtemp = bwd(g_out, g_pi, _last(g_ec), _last(g_qc), _last(g_mc), w, temp, lb, mask, pi, ec, qc, mc,
                         ctx.mode, ctx.chunk)
    return dw, dtemp.sum(0).to(temp.dtype).view_as(temp), dlb if ctx.has_lb else None, None, None, None


_causal_fwd.register_autograd(_causal_backward, setup_context=_causal_setup)

# the extension's function, setup_context, backward and the index of the first output without a
# gradient, by kind (for _Eager)
_OPS = {"tssa": ("tssa_fwd", _tssa_setup, _tssa_backward, 2),
        "causal": ("causal_fwd", _causal_setup, _causal_backward, 5)}


def causal_tssa_fused(
    w: Tensor, temp: Tensor, logit_bias: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
    fallback: Optional[Callable] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Fused causal TSSA (no dropout).

    Args:
        w: (B, H, N, p) float32/float64; temp: (H, 1); logit_bias: (B or 1, H, N) added to
            ``sum_p ratio`` before the temperature (``p * pos_bias`` at each token's position),
            or None; attn_mask: (B, N) bool keep-mask or None; fallback: the rescaled PyTorch
            path (``causal_tssa_parallel``'s arguments) for the batch rows past the kernel's
            range, as in :func:`tssa_fused`.

    Returns:
        out (B, H, N, p), pi (B, H, N), the final running sums sum_sq (B, H, p),
        sum_pi (B, H), sum_sq_pi (B, H, p) (float64; differentiable) and their scale (B, H, p) (the
        power of two per feature they are in units of: 1 from the kernel, the fallback's own on its
        rows).
    """
    w = _rows(w)
    b, h, n, _ = w.shape
    lb = None if logit_bias is None else logit_bias.to(w.dtype).expand(b, h, n).contiguous()
    mask = None if attn_mask is None else attn_mask.contiguous()
    args = (w, temp.to(w.dtype).contiguous(), lb, mask, CAUSAL_MODE, CHUNK)
    if not _eager(w, temp, lb, mask):
        out, pi, ec, qc, mc, over = _causal_fwd(*args)
    elif _records_grad(w, temp, lb):
        out, pi, ec, qc, mc, over = _Eager.apply("causal", *args)
    else:
        out, pi, ec, qc, mc, over = _ext().causal_fwd(*args)
    bias = None if logit_bias is None else logit_bias.expand(b, h, n)
    split = None if fallback is None else by_rows(over, causal_tssa_fused, fallback, w, temp, bias, mask)
    if split is not None:
        return split
    # sums in w's units: scale 1 (the rows past the kernel's range took the fallback, which returns its own)
    return out, pi, ec.select(1, -1), mc.select(1, -1), qc.select(1, -1), ec.new_ones(b, h, ec.shape[-1])
