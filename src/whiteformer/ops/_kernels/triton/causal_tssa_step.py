r"""Triton causal TSSA step (recurrent form of ToST Eq. (28)/(39), used by generation): one
fused kernel per sequence for the forward and one for the backward.

Per sequence b, all heads in one (H, p) tile, with the running sums E0, M0, Q0 of the state in
units of the per-head power of two k (:mod:`whiteformer.ops.scaling`; the wrapper brings the
state to the new k, the larger of the state's and the token's), x = w / k and
eps = max(1e-12 / k^2, tiny)::

    E = E0 + x^2,  R = sum_j x_j^2 / max(E_j, eps) + lb,  Pi = softmax_heads(temp R)
    M = M0 + Pi,  Q = Q0 + Pi x^2,  c = 1 / (M + 1e-8),  g = 1 / (1 / k + k c Q),  out = -x Pi g

(g = k / (1 + dots) with dots = k^2 c Q in w's units: the 1 / k term keeps the gain finite
where dots would overflow.) Backward (G = dL/dout; gPi, gE, gM, gQ the gradients of pi and of
the new state)::

    dQ = gQ + k c g^2 x Pi G,  dM = gM - sum_j dQ_j^(c) c Q_j      (dQ^(c) = the second term of dQ)
    dPi = gPi - sum_j x g G + dM + sum_j dQ_j x_j^2,  Lambda = Pi (dPi - sum_heads Pi dPi)
    lambda = temp Lambda (= dL/dlb),  dtemp = Lambda R
    dE = gE - lambda x^2 / E^2 (0 where E <= eps),  dw = (-Pi g G + 2 x (dQ Pi + lambda / max(E, eps) + dE)) / k

and dE0 = dE, dM0 = dM, dQ0 = dQ.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...constants import PI_EPS
from . import _tiles
from ._scaling import kernel_scale
from ._tiles import acc_dtype, div, head_scales, tl_acc

__all__ = ["causal_tssa_step_triton"]


@triton.jit
def _forward(x_ptr, e0_ptr, m0_ptr, q0_ptr, temp_ptr, lb_ptr, scl_ptr, b, H, P, PI_EPS,
             has_lb, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    """The step for sequence b: offsets, masks and every intermediate the backward needs."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_p = tl.arange(0, BLOCK_P)
    in_h = offs_h < H
    inside = in_h[:, None] & (offs_p[None, :] < P)
    offs = (b.to(tl.int64) * H + offs_h[:, None]) * P + offs_p[None, :]
    heads = b.to(tl.int64) * H + offs_h
    inv_k, k, eps = head_scales(scl_ptr, heads, in_h)  # 1 / k, k (exact powers of two), max(1e-12 / k^2, tiny)
    eps = eps[:, None]
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(ACC) * inv_k[:, None]
    x2 = x * x
    energy = tl.load(e0_ptr + offs, mask=inside, other=0.0) + x2
    ratio = tl.sum(div(x2, tl.maximum(energy, eps)), axis=1)
    if has_lb:
        ratio += tl.load(lb_ptr + heads, mask=in_h, other=0.0)
    logit = tl.where(in_h, tl.load(temp_ptr + offs_h, mask=in_h, other=0.0) * ratio, float("-inf"))
    pi = tl.exp(logit - tl.max(logit, axis=0))
    pi = div(pi, tl.sum(pi, axis=0))
    mass = tl.load(m0_ptr + heads, mask=in_h, other=0.0) + pi
    sq_pi = tl.load(q0_ptr + offs, mask=inside, other=0.0) + x2 * pi[:, None]
    inv_m = div(1.0, mass + PI_EPS)
    # full-range division: the denominator lies in [2^-127, 2^129] when k is far from 1
    gain = 1.0 / (inv_k[:, None] + k[:, None] * (sq_pi * inv_m[:, None]))
    return offs, inside, heads, in_h, inv_k, k, eps, x, x2, energy, ratio, pi, mass, sq_pi, inv_m, gain


@triton.jit
def _step_fwd(x_ptr, e0_ptr, m0_ptr, q0_ptr, temp_ptr, lb_ptr, scl_ptr, out_ptr, pi_ptr, e_ptr, m_ptr, q_ptr,
              H, P, PI_EPS,
              has_lb, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    b = tl.program_id(0)
    offs, inside, heads, in_h, inv_k, k, eps, x, x2, energy, ratio, pi, mass, sq_pi, inv_m, gain = _forward(
        x_ptr, e0_ptr, m0_ptr, q0_ptr, temp_ptr, lb_ptr, scl_ptr, b, H, P, PI_EPS, has_lb, BLOCK_H,
        BLOCK_P, ACC)
    tl.store(out_ptr + offs, (-x * pi[:, None] * gain).to(out_ptr.dtype.element_ty), mask=inside)
    tl.store(pi_ptr + heads, pi, mask=in_h)
    tl.store(e_ptr + offs, energy, mask=inside)
    tl.store(m_ptr + heads, mass, mask=in_h)
    tl.store(q_ptr + offs, sq_pi, mask=inside)


@triton.jit
def _step_bwd(go_ptr, gpi_ptr, ge_ptr, gm_ptr, gq_ptr, x_ptr, e0_ptr, m0_ptr, q0_ptr, temp_ptr, lb_ptr, scl_ptr,
              dx_ptr, de_ptr, dm_ptr, dq_ptr, dtemp_ptr, dlb_ptr, H, P, PI_EPS,
              has_lb, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    b = tl.program_id(0)
    offs, inside, heads, in_h, inv_k, k, eps, x, x2, energy, ratio, pi, mass, sq_pi, inv_m, gain = _forward(
        x_ptr, e0_ptr, m0_ptr, q0_ptr, temp_ptr, lb_ptr, scl_ptr, b, H, P, PI_EPS, has_lb, BLOCK_H,
        BLOCK_P, ACC)
    go = tl.load(go_ptr + offs, mask=inside, other=0.0).to(ACC)
    dq_c = gain * gain * x * pi[:, None] * go * k[:, None] * inv_m[:, None]  # the PyTorch path's order
    dq = tl.load(gq_ptr + offs, mask=inside, other=0.0) + dq_c
    dm = tl.load(gm_ptr + heads, mask=in_h, other=0.0) - tl.sum(dq_c * sq_pi * inv_m[:, None], axis=1)
    dpi = tl.load(gpi_ptr + heads, mask=in_h, other=0.0) + dm + tl.sum(dq * x2 - x * gain * go, axis=1)
    big_lam = pi * (dpi - tl.sum(pi * dpi, axis=0))
    lam = tl.load(temp_ptr + tl.arange(0, BLOCK_H), mask=in_h, other=0.0) * big_lam
    safe = tl.maximum(energy, eps)
    de = tl.load(ge_ptr + offs, mask=inside, other=0.0)
    de += tl.where(energy > eps, div(div(-lam[:, None] * x2, safe), safe), 0.0)
    dx = (-pi[:, None] * gain * go + 2.0 * x * (dq * pi[:, None] + div(lam[:, None], safe) + de)) * inv_k[:, None]
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=inside)
    tl.store(de_ptr + offs, de, mask=inside)
    tl.store(dm_ptr + heads, dm, mask=in_h)
    tl.store(dq_ptr + offs, dq, mask=inside)
    tl.store(dtemp_ptr + heads, big_lam * ratio, mask=in_h)
    tl.store(dlb_ptr + heads, lam, mask=in_h)


def _meta(x: Tensor, lb: Optional[Tensor]) -> dict:
    """Constexprs and launch options: one (BLOCK_H, BLOCK_P) tile per sequence, warps by the tile
    rule of :mod:`._tiles`; BLOCK_H at least 2 (a one-head tile crashed Triton 3.3.1's compiler;
    the padded head is masked)."""
    t = _tiles.tiles(x.shape[1], x.shape[2], x.dtype)
    words = 2 if x.dtype == torch.float64 else 1
    block_h = max(2, t.block_h)
    return dict(has_lb=lb is not None, BLOCK_H=block_h, BLOCK_P=t.block_p, ACC=tl_acc(x.dtype),
                **_tiles.options(_tiles.warps_for(block_h * t.block_p * words)))


@torch.library.custom_op("whiteformer::causal_tssa_step_triton_fwd", mutates_args=())
def _fwd(x: Tensor, e0: Tensor, m0: Tensor, q0: Tensor, temp: Tensor, lb: Optional[Tensor], scl: Tensor
         ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    b, h, p = x.shape
    out, pi, m = torch.empty_like(x), torch.empty_like(m0), torch.empty_like(m0)
    e, q = torch.empty_like(e0), torch.empty_like(q0)
    _step_fwd[(b,)](x, e0, m0, q0, temp, m0 if lb is None else lb, scl, out, pi, e, m, q, h, p, PI_EPS, **_meta(x, lb))
    return out, pi, e, m, q


@_fwd.register_fake
def _(x, e0, m0, q0, temp, lb, scl):
    return torch.empty_like(x), torch.empty_like(m0), torch.empty_like(e0), torch.empty_like(m0), torch.empty_like(q0)


@torch.library.custom_op("whiteformer::causal_tssa_step_triton_bwd", mutates_args=())
def _bwd(grad_out: Tensor, grad_pi: Tensor, grad_e: Tensor, grad_m: Tensor, grad_q: Tensor, x: Tensor, e0: Tensor,
         m0: Tensor, q0: Tensor, temp: Tensor, lb: Optional[Tensor], scl: Tensor
         ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    b, h, p = x.shape
    dx, de, dq = torch.empty_like(x), torch.empty_like(e0), torch.empty_like(q0)
    dm, dtemp, dlb = torch.empty_like(m0), torch.empty_like(m0), torch.empty_like(m0)
    _step_bwd[(b,)](grad_out, grad_pi, grad_e, grad_m, grad_q, x, e0, m0, q0, temp, m0 if lb is None else lb, scl,
                    dx, de, dm, dq, dtemp, dlb, h, p, PI_EPS, **_meta(x, lb))
    return dx, de, dm, dq, dtemp.sum(0), dlb


@_bwd.register_fake
def _(grad_out, grad_pi, grad_e, grad_m, grad_q, x, e0, m0, q0, temp, lb, scl):
    return (torch.empty_like(x), torch.empty_like(e0), torch.empty_like(m0), torch.empty_like(q0),
            m0.new_empty(x.shape[1]), torch.empty_like(m0))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, g_out, g_pi, g_e, g_m, g_q):
    x, e0, m0, q0, temp, lb, scl = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph: differentiable recomputation in PyTorch
        from ...causal_tssa.recurrent import causal_tssa_recurrent
        from ..fused import _double_backward

        inputs = (x, e0, m0, q0, temp) if lb is None else (x, e0, m0, q0, temp, lb)
        outs = causal_tssa_recurrent(x, e0, m0, q0, temp.view(-1, 1), None if lb is None else lb.unsqueeze(-1),
                                     scl[..., 1])
        grads = _double_backward(outs[:5], inputs, (g_out, g_pi, g_e, g_m, g_q))
        return (*grads[:5], grads[5] if lb is not None else None, None)
    zero = lambda g, like: torch.zeros_like(like) if g is None else g.contiguous()  # noqa: E731
    dx, de, dm, dq, dtemp, dlb = _bwd(zero(g_out, x), zero(g_pi, m0), zero(g_e, e0), zero(g_m, m0), zero(g_q, q0),
                                      x, e0, m0, q0, temp, lb, scl)
    return dx, de, dm, dq, dtemp.view_as(temp), dlb if lb is not None else None, None


_fwd.register_autograd(_backward, setup_context=_setup)


def causal_tssa_step_triton(
    w_t: Tensor, sum_sq: Tensor, sum_pi: Tensor, sum_sq_pi: Tensor, temp: Tensor, logit_bias: Optional[Tensor] = None,
    scale: Optional[Tensor] = None,
) -> Tuple[Tensor, ...]:
    """One causal TSSA step through the fused Triton kernel.

    Args:
        w_t: (B, H, p) float16/bfloat16/float32/float64; sum_sq, sum_sq_pi: (B, H, p) and sum_pi:
            (B, H), the running sums of the state in units of ``scale`` (B, H), or (B, H, p) per
            feature (taken in units of each head's largest), a power of two, or None for 1;
            temp: (H, 1); logit_bias: (H, 1) or (B, H, 1) (``p * pos_bias`` at position t; also
            (H,) or (B, H)) or None.

    Returns:
        out_t (B, H, p) and pi_t (B, H) in w_t's dtype, the new sums sum_sq, sum_pi, sum_sq_pi in
        the statistics dtype (all differentiable) and their scale (B, H): the larger of ``scale``
        and ``w_t``'s own (:mod:`whiteformer.ops.scaling`).
    """
    x = w_t.contiguous()
    b, h, _ = x.shape
    acc = acc_dtype(x.dtype)
    lb = None if logit_bias is None else logit_bias.to(acc).reshape(-1, h).expand(b, h).contiguous()
    if scale is not None and scale.dim() == 3:  # a per-feature state: its sums in units of the head's largest
        head = scale.to(acc).amax(-1)
        f = scale.to(acc) / head.unsqueeze(-1)  # powers of two <= 1: exact
        sum_sq, sum_sq_pi, scale = sum_sq.to(acc) * f * f, sum_sq_pi.to(acc) * f * f, head
    k, scl = kernel_scale(x, 1, scale)
    r = (k if scale is None else k / scale.to(acc)).reciprocal().unsqueeze(-1)  # <= 1, exact: the sums in units of k
    state = [(t.to(acc) * r * r if t.dim() == 3 else t.to(acc)).contiguous() for t in (sum_sq, sum_pi, sum_sq_pi)]
    out, pi, e, m, q = _fwd(x, state[0], state[1], state[2], temp.to(acc).reshape(h).contiguous(), lb, scl)
    return out, pi.to(x.dtype), e, m, q, k
