r"""Triton causal TSSA (ToST Eq. (28), memberships Eq. (39)) in chunked form: forward and
hand-derived backward.

Per (b, h), prefix sums over kept tokens s <= t (formulas: :mod:`whiteformer.ops.causal_tssa`,
backward derivation: :mod:`whiteformer.ops.tssa_fused`)::

    E_t = sum w_s^2,  rho_t = w_t^2 / max(E_t, 1e-12),  logit_t = temp (sum_j rho_tj + lb_t)
    Pi_t = softmax_heads,  Q_t = sum Pi_s w_s^2,  M_t = sum Pi_s,  c_t = 1 / (M_t + 1e-8)
    g_t = 1 / (1 + c_t Q_t),  out_t = -w_t Pi_t g_t                    (lb = p * pos_bias[pos])

Chunked form: tokens are cut into chunks of ``CHUNK``; a prefix sum is the chunk's starting
value (the "chunk state", an exclusive prefix over chunks, computed on the host from per-chunk
totals) plus a prefix sum inside the chunk (``tl.cumsum``). Forward kernels:

1. ``energy_partials`` (:mod:`._tiles`) grid (B*H, chunks): per-chunk totals of w^2           -> E at chunk starts.
2. ``_pi``      grid (B, chunks): logits for every head (online softmax over heads), then Pi and
   per-chunk totals of Pi w^2 and Pi                                    -> Q, M at chunk starts.
3. ``_out``     grid (B*H, chunks): out.

Backward (G = dL/dout; gE, gQ, gM the gradients of the returned final sums)::

    D_t = g_t^2 w_t Pi_t G_t,  dQ_t = c_t D_t,  dM_t = -c_t sum_j D_tj c_t Q_tj
    U_s = gQ + sum_{t>=s} dQ_t,  V_s = gM + sum_{t>=s} dM_t        (suffix sums, chunked likewise)
    dPi_s = gPi_s - sum_j w g G + sum_j U_sj w_sj^2 + V_s,  Lambda = Pi (dPi - sum_heads Pi dPi)
    lambda = temp Lambda (= dL/dlb),  dtemp = sum Lambda (sum_j rho + lb)
    dE_t = -lambda_t w_t^2 / E_t^2 (0 where E_t <= 1e-12),  W_s = gE + sum_{t>=s} dE_t
    dw = -Pi g G + 2 w (U Pi + lambda / max(E, 1e-12) + W)

in three kernels: per-chunk totals of dQ, dM (grid (B*H, chunks)); dPi, Lambda, lambda and
per-chunk totals of dE (grid (B, chunks)); dw (grid (B*H, chunks)). Kept for backward: w, Pi
and lb (B, H, N), and the chunk states E, Q (B, H, N / CHUNK, p), M (B, H, N / CHUNK).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...constants import PI_EPS, RATIO_EPS
from . import _tiles
from ._tiles import acc_dtype, block_p, energy_partials, mask_u8, put_row, put_tok, row, tl_acc, tok, w_block

__all__ = ["causal_tssa_triton"]


@triton.jit
def _gain(x2, pi, q0_ptr, m0_ptr, bh, c, NC, P, PI_EPS, BLOCK_P: tl.constexpr):
    """c_t (BLOCK,), the ratio d_t = c_t Q_t and the gain g_t = 1 / (1 + d_t) (BLOCK, BLOCK_P)."""
    q = row(q0_ptr, bh, c, NC, P, BLOCK_P)[None, :] + tl.cumsum(pi[:, None] * x2, axis=0)
    m = tl.load(m0_ptr + bh.to(tl.int64) * NC + c) + tl.cumsum(pi, axis=0)
    inv_m = 1.0 / (m + PI_EPS)
    d = q * inv_m[:, None]
    return inv_m, d, 1.0 / (1.0 + d)


@triton.jit
def _energy_grad(lam, x2, energy, RATIO_EPS):
    """dL/dE_t = -lambda_t w_t^2 / E_t^2, 0 where the clamp max(E_t, 1e-12) is active."""
    safe = tl.maximum(energy, RATIO_EPS)
    return tl.where(energy > RATIO_EPS, -lam[:, None] * x2 / (safe * safe), 0.0)


@triton.jit
def _pi(x_ptr, mask_ptr, e0_ptr, lb_ptr, temp_ptr, pi_ptr, q_part_ptr, m_part_ptr, H, N, P, NC, RATIO_EPS,
        HAS_MASK: tl.constexpr, HAS_LB: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
        ACC: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    run_max = tl.full([BLOCK], float("-inf"), ACC)
    run_sum = tl.zeros([BLOCK], ACC)
    for h in range(H):  # logits (parked in pi_ptr), online softmax over heads
        bh = b * H + h
        offs_n, offs, inside, _, x = w_block(x_ptr, mask_ptr, bh, H, c, N, P, HAS_MASK, BLOCK, BLOCK_P, ACC)
        x2 = x * x
        energy = row(e0_ptr, bh, c, NC, P, BLOCK_P)[None, :] + tl.cumsum(x2, axis=0)
        logit = tl.sum(x2 / tl.maximum(energy, RATIO_EPS), axis=1)
        if HAS_LB:
            logit += tok(lb_ptr, bh, offs_n, N)
        logit = tl.load(temp_ptr + h) * logit
        put_tok(pi_ptr, bh, offs_n, N, logit)
        new_max = tl.maximum(run_max, logit)
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.exp(logit - new_max)
        run_max = new_max
    for h in range(H):  # Pi and the chunk totals of Pi w^2 and Pi
        bh = b * H + h
        offs_n, offs, inside, keep, x = w_block(x_ptr, mask_ptr, bh, H, c, N, P, HAS_MASK, BLOCK, BLOCK_P, ACC)
        pi = tl.where(keep, tl.exp(tok(pi_ptr, bh, offs_n, N) - run_max) / run_sum, 0.0)
        put_tok(pi_ptr, bh, offs_n, N, pi)
        part = bh.to(tl.int64) * NC + c
        put_row(q_part_ptr, bh, c, NC, P, tl.sum(pi[:, None] * x * x, axis=0), BLOCK_P)
        tl.store(m_part_ptr + part, tl.sum(pi, axis=0))


@triton.jit
def _out(x_ptr, mask_ptr, pi_ptr, q0_ptr, m0_ptr, out_ptr, H, N, P, NC, PI_EPS,
         HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    bh, c = tl.program_id(0), tl.program_id(1)
    offs_n, offs, inside, _, x = w_block(x_ptr, mask_ptr, bh, H, c, N, P, HAS_MASK, BLOCK, BLOCK_P, ACC)
    pi = tok(pi_ptr, bh, offs_n, N)
    _, _, gain = _gain(x * x, pi, q0_ptr, m0_ptr, bh, c, NC, P, PI_EPS, BLOCK_P)
    tl.store(out_ptr + offs, (-x * pi[:, None] * gain).to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _bwd_chunk(x_ptr, mask_ptr, pi_ptr, go_ptr, q0_ptr, m0_ptr, dq_part_ptr, dm_part_ptr, H, N, P, NC, PI_EPS,
               HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    bh, c = tl.program_id(0), tl.program_id(1)
    offs_n, offs, inside, _, x = w_block(x_ptr, mask_ptr, bh, H, c, N, P, HAS_MASK, BLOCK, BLOCK_P, ACC)
    go = tl.load(go_ptr + offs, mask=inside, other=0.0).to(ACC)
    pi = tok(pi_ptr, bh, offs_n, N)
    inv_m, d, gain = _gain(x * x, pi, q0_ptr, m0_ptr, bh, c, NC, P, PI_EPS, BLOCK_P)
    dq = inv_m[:, None] * gain * gain * x * pi[:, None] * go  # c D
    part = bh.to(tl.int64) * NC + c
    put_row(dq_part_ptr, bh, c, NC, P, tl.sum(dq, axis=0), BLOCK_P)
    tl.store(dm_part_ptr + part, -tl.sum(tl.sum(dq * d, axis=1), axis=0))


@triton.jit
def _suffix(x, pi, go, u0_ptr, v0_ptr, q0_ptr, m0_ptr, bh, c, NC, P, PI_EPS, BLOCK_P: tl.constexpr):
    """Gain g, U (BLOCK, BLOCK_P) and V (BLOCK,): suffix sums of dQ, dM from token t onwards."""
    inv_m, d, gain = _gain(x * x, pi, q0_ptr, m0_ptr, bh, c, NC, P, PI_EPS, BLOCK_P)
    dq = inv_m[:, None] * gain * gain * x * pi[:, None] * go
    u = row(u0_ptr, bh, c, NC, P, BLOCK_P)[None, :] + tl.cumsum(dq, axis=0, reverse=True)
    v = tl.load(v0_ptr + bh.to(tl.int64) * NC + c) - tl.cumsum(tl.sum(dq * d, axis=1), axis=0, reverse=True)
    return gain, u, v


@triton.jit
def _bwd_lambda(x_ptr, mask_ptr, pi_ptr, go_ptr, gpi_ptr, lb_ptr, temp_ptr, e0_ptr, q0_ptr, m0_ptr, u0_ptr, v0_ptr,
                lam_ptr, logit_ptr, dtemp_part_ptr, de_part_ptr, H, N, P, NC, RATIO_EPS, PI_EPS,
                HAS_MASK: tl.constexpr, HAS_LB: tl.constexpr, HAS_GPI: tl.constexpr, BLOCK: tl.constexpr,
                BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    pi_dpi = tl.zeros([BLOCK], ACC)
    for h in range(H):  # dL/dPi (parked in lam_ptr) and logit / temp (in logit_ptr)
        bh = b * H + h
        offs_n, offs, inside, _, x = w_block(x_ptr, mask_ptr, bh, H, c, N, P, HAS_MASK, BLOCK, BLOCK_P, ACC)
        go = tl.load(go_ptr + offs, mask=inside, other=0.0).to(ACC)
        pi = tok(pi_ptr, bh, offs_n, N)
        gain, u, v = _suffix(x, pi, go, u0_ptr, v0_ptr, q0_ptr, m0_ptr, bh, c, NC, P, PI_EPS, BLOCK_P)
        x2 = x * x
        dpi = tl.sum(u * x2 - x * gain * go, axis=1) + v
        if HAS_GPI:
            dpi += tok(gpi_ptr, bh, offs_n, N).to(ACC)
        pi_dpi += pi * dpi
        put_tok(lam_ptr, bh, offs_n, N, dpi)
        energy = row(e0_ptr, bh, c, NC, P, BLOCK_P)[None, :] + tl.cumsum(x2, axis=0)
        logit = tl.sum(x2 / tl.maximum(energy, RATIO_EPS), axis=1)
        if HAS_LB:
            logit += tok(lb_ptr, bh, offs_n, N)
        put_tok(logit_ptr, bh, offs_n, N, logit)
    for h in range(H):  # Lambda, lambda = temp Lambda, chunk totals of dL/dE
        bh = b * H + h
        offs_n, offs, inside, _, x = w_block(x_ptr, mask_ptr, bh, H, c, N, P, HAS_MASK, BLOCK, BLOCK_P, ACC)
        pi = tok(pi_ptr, bh, offs_n, N)
        big_lam = pi * (tok(lam_ptr, bh, offs_n, N) - pi_dpi)
        tl.store(dtemp_part_ptr + (b.to(tl.int64) * NC + c) * H + h,
                 tl.sum(big_lam * tok(logit_ptr, bh, offs_n, N), axis=0))
        lam = tl.load(temp_ptr + h) * big_lam
        put_tok(lam_ptr, bh, offs_n, N, lam)
        x2 = x * x
        energy = row(e0_ptr, bh, c, NC, P, BLOCK_P)[None, :] + tl.cumsum(x2, axis=0)
        de = _energy_grad(lam, x2, energy, RATIO_EPS)
        put_row(de_part_ptr, bh, c, NC, P, tl.sum(de, axis=0), BLOCK_P)


@triton.jit
def _bwd_dw(x_ptr, mask_ptr, pi_ptr, go_ptr, lam_ptr, e0_ptr, q0_ptr, m0_ptr, u0_ptr, v0_ptr, w0_ptr, dw_ptr,
            H, N, P, NC, RATIO_EPS, PI_EPS,
            HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    bh, c = tl.program_id(0), tl.program_id(1)
    offs_n, offs, inside, _, x = w_block(x_ptr, mask_ptr, bh, H, c, N, P, HAS_MASK, BLOCK, BLOCK_P, ACC)
    go = tl.load(go_ptr + offs, mask=inside, other=0.0).to(ACC)
    pi = tok(pi_ptr, bh, offs_n, N)
    lam = tok(lam_ptr, bh, offs_n, N)
    gain, u, _ = _suffix(x, pi, go, u0_ptr, v0_ptr, q0_ptr, m0_ptr, bh, c, NC, P, PI_EPS, BLOCK_P)
    x2 = x * x
    energy = row(e0_ptr, bh, c, NC, P, BLOCK_P)[None, :] + tl.cumsum(x2, axis=0)
    de = _energy_grad(lam, x2, energy, RATIO_EPS)
    wsum = row(w0_ptr, bh, c, NC, P, BLOCK_P)[None, :] + tl.cumsum(de, axis=0, reverse=True)
    dw = -pi[:, None] * gain * go + 2.0 * x * (u * pi[:, None] + lam[:, None] / tl.maximum(energy, RATIO_EPS) + wsum)
    tl.store(dw_ptr + offs, dw.to(dw_ptr.dtype.element_ty), mask=inside)


def _meta(w: Tensor, mask: Optional[Tensor], chunk: int) -> dict:
    return dict(HAS_MASK=mask is not None, BLOCK=chunk, BLOCK_P=block_p(w.shape[-1]), ACC=tl_acc(w.dtype))


def _prefix(part: Tensor) -> Tensor:
    """Exclusive prefix over chunks (dim 2) of per-chunk totals: the chunk states."""
    out = torch.zeros_like(part)
    out[:, :, 1:] = part[:, :, :-1].cumsum(2)  # exactly the earlier chunks (no "inclusive - own")
    return out


def _suffix_after(part: Tensor, final_grad: Optional[Tensor]) -> Tensor:
    """Sum over the later chunks (dim 2) of per-chunk totals, plus the final state's gradient."""
    after = torch.zeros_like(part)
    after[:, :, :-1] = part[:, :, 1:].flip(2).cumsum(2).flip(2)
    return after if final_grad is None else after + final_grad.unsqueeze(2)


# ------------------------------------------------------------------------------ custom ops


@torch.library.custom_op("whiteformer::causal_tssa_triton_fwd", mutates_args=())
def _fwd(w: Tensor, temp: Tensor, lb: Optional[Tensor], mask: Optional[Tensor], chunk: int
         ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    b, h, n, p = w.shape
    acc, nc = acc_dtype(w.dtype), triton.cdiv(n, chunk)
    meta, m8 = _meta(w, mask, chunk), mask_u8(mask, w)
    part = w.new_empty(b, h, nc, p, dtype=acc)
    energy_partials[(b * h, nc)](w, m8, part, h, n, p, nc, **meta)
    e0, e_fin = _prefix(part), part.sum(2)
    pi = w.new_empty(b, h, n, dtype=acc)
    q_part, m_part = w.new_empty(b, h, nc, p, dtype=acc), w.new_empty(b, h, nc, dtype=acc)
    _pi[(b, nc)](w, m8, e0, pi if lb is None else lb, temp, pi, q_part, m_part, h, n, p, nc, RATIO_EPS,
                 HAS_LB=lb is not None, **meta)
    q0, m0 = _prefix(q_part), _prefix(m_part)
    out = torch.empty_like(w)
    _out[(b * h, nc)](w, m8, pi, q0, m0, out, h, n, p, nc, PI_EPS, **meta)
    return out, pi, e_fin, m_part.sum(2), q_part.sum(2), e0, q0, m0


@_fwd.register_fake
def _(w, temp, lb, mask, chunk):
    b, h, n, p = w.shape
    acc, nc = acc_dtype(w.dtype), -(-n // chunk)
    new = lambda *shape: w.new_empty(*shape, dtype=acc)  # noqa: E731
    return (torch.empty_like(w), new(b, h, n), new(b, h, p), new(b, h), new(b, h, p), new(b, h, nc, p),
            new(b, h, nc, p), new(b, h, nc))


@torch.library.custom_op("whiteformer::causal_tssa_triton_bwd", mutates_args=())
def _bwd(grad_out: Tensor, grad_pi: Optional[Tensor], grad_e: Optional[Tensor], grad_m: Optional[Tensor],
         grad_q: Optional[Tensor], w: Tensor, temp: Tensor, lb: Optional[Tensor], mask: Optional[Tensor],
         pi: Tensor, e0: Tensor, q0: Tensor, m0: Tensor, chunk: int) -> Tuple[Tensor, Tensor, Tensor]:
    b, h, n, p = w.shape
    acc, nc = acc_dtype(w.dtype), triton.cdiv(n, chunk)
    meta, m8 = _meta(w, mask, chunk), mask_u8(mask, w)
    eps = (RATIO_EPS, PI_EPS)
    dq_part, dm_part = w.new_empty(b, h, nc, p, dtype=acc), w.new_empty(b, h, nc, dtype=acc)
    _bwd_chunk[(b * h, nc)](w, m8, pi, grad_out, q0, m0, dq_part, dm_part, h, n, p, nc, PI_EPS, **meta)
    u0, v0 = _suffix_after(dq_part, grad_q), _suffix_after(dm_part, grad_m)
    lam, logit = w.new_empty(b, h, n, dtype=acc), w.new_empty(b, h, n, dtype=acc)
    dtemp_part = w.new_empty(b, nc, h, dtype=acc)
    de_part = dq_part  # reused: its totals are folded into u0 already
    _bwd_lambda[(b, nc)](w, m8, pi, grad_out, lam if grad_pi is None else grad_pi, lam if lb is None else lb, temp,
                         e0, q0, m0, u0, v0, lam, logit, dtemp_part, de_part, h, n, p, nc, *eps,
                         HAS_LB=lb is not None, HAS_GPI=grad_pi is not None, **meta)
    w0 = _suffix_after(de_part, grad_e)
    dw = torch.empty_like(w)
    _bwd_dw[(b * h, nc)](w, m8, pi, grad_out, lam, e0, q0, m0, u0, v0, w0, dw, h, n, p, nc, *eps, **meta)
    return dw, lam, dtemp_part.sum((0, 1))


@_bwd.register_fake
def _(grad_out, grad_pi, grad_e, grad_m, grad_q, w, temp, lb, mask, pi, e0, q0, m0, chunk):
    b, h, n, _ = w.shape
    acc = acc_dtype(w.dtype)
    return torch.empty_like(w), w.new_empty(b, h, n, dtype=acc), w.new_empty(h, dtype=acc)


def _setup(ctx, inputs, output):
    w, temp, lb, mask, chunk = inputs
    _, pi, _, _, _, e0, q0, m0 = output
    ctx.chunk = chunk
    ctx.mark_non_differentiable(e0, q0, m0)
    ctx.save_for_backward(w, temp, lb, mask, pi, e0, q0, m0)


def _backward(ctx, g_out, g_pi, g_e, g_m, g_q, *_):
    w, temp, lb, mask, pi, e0, q0, m0 = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph: differentiable recomputation in PyTorch
        from ...causal_tssa.parallel import causal_tssa_parallel
        from ..fused import _double_backward

        inputs = (w, temp) if lb is None else (w, temp, lb)
        grads = _double_backward(causal_tssa_parallel(w, temp, lb, mask), inputs, (g_out, g_pi, g_e, g_m, g_q))
        return grads[0], grads[1], grads[2] if lb is not None else None, None, None
    g_out = torch.zeros_like(w) if g_out is None else g_out.contiguous()
    g_pi, g_e, g_m, g_q = (None if g is None else g.contiguous() for g in (g_pi, g_e, g_m, g_q))
    dw, dlb, dtemp = _bwd(g_out, g_pi, g_e, g_m, g_q, w, temp, lb, mask, pi, e0, q0, m0, ctx.chunk)
    return dw, dtemp.view_as(temp), dlb if lb is not None else None, None, None


_fwd.register_autograd(_backward, setup_context=_setup)


def causal_tssa_triton(
    w: Tensor, temp: Tensor, logit_bias: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Causal TSSA through the Triton kernels (no dropout).

    Args:
        w: (B, H, N, p) float16/bfloat16/float32/float64; temp: (H, 1); logit_bias: (B or 1, H, N)
            added to ``sum_p ratio`` before the temperature (``p * pos_bias`` at each token's
            position) or None; attn_mask: (B, N) bool keep-mask or None.

    Returns:
        out (B, H, N, p) and pi (B, H, N) in w's dtype, and the final running sums sum_sq (B, H, p),
        sum_pi (B, H), sum_sq_pi (B, H, p) in the statistics dtype (differentiable).
    """
    w = w.contiguous()
    b, h, n, _ = w.shape
    acc = acc_dtype(w.dtype)
    lb = None if logit_bias is None else logit_bias.to(acc).expand(b, h, n).contiguous()
    mask = None if attn_mask is None else attn_mask.contiguous()
    out, pi, e, m, q, _, _, _ = _fwd(w, temp.to(acc).contiguous(), lb, mask, _tiles.CHUNK)
    return out, pi.to(w.dtype), e, m, q
