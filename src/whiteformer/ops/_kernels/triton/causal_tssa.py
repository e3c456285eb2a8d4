r"""Triton causal TSSA (ToST Eq. (28), memberships Eq. (39)) in chunked form: forward and
hand-derived backward.

Per (b, h), prefix sums over kept tokens s <= t (formulas: :mod:`whiteformer.ops.causal_tssa`,
backward derivation: :mod:`whiteformer.ops._kernels.fused`)::

    E_t = sum w_s^2,  rho_t = w_t^2 / max(E_t, 1e-12),  logit_t = temp (sum_j rho_tj + lb_t)
    Pi_t = softmax_heads,  Q_t = sum Pi_s w_s^2,  M_t = sum Pi_s,  c_t = 1 / (M_t + 1e-8)
    g_t = 1 / (1 + c_t Q_t),  out_t = -w_t Pi_t g_t                    (lb = p * pos_bias[pos])

Chunked form (grid (B, chunks) of :mod:`._tiles`: a program holds one sequence, all heads, one
chunk walked in sub-blocks): a prefix sum at token t is the chunk's starting value (the "chunk
state", an exclusive prefix over the chunks' totals, computed on the host) plus the running sum of
the chunk's earlier sub-blocks (carried in registers) plus a prefix sum inside the sub-block
(``tl.cumsum``). Forward, three passes over ``w`` (E is needed before any Pi, Q and M before any
output):

1. ``chunk_energy`` (:mod:`._tiles`): per-chunk totals of w^2                 -> E at chunk starts.
2. ``_pi``: logits of every head, the softmax over heads, Pi, per-chunk totals of Pi w^2 and Pi
                                                                              -> Q, M at chunk starts.
3. ``_out``: out.

Backward (G = dL/dout; gE, gQ, gM the gradients of the returned final sums)::

    D_t = g_t^2 w_t Pi_t G_t,  dQ_t = c_t D_t,  dM_t = -c_t sum_j D_tj c_t Q_tj
    U_s = gQ + sum_{t>=s} dQ_t,  V_s = gM + sum_{t>=s} dM_t        (suffix sums)
    dPi_s = gPi_s - sum_j w g G + sum_j U_sj w_sj^2 + V_s,  Lambda = Pi (dPi - sum_heads Pi dPi)
    lambda = temp Lambda (= dL/dlb),  dtemp = sum Lambda (sum_j rho + lb)
    dE_t = -lambda_t w_t^2 / E_t^2 (0 where E_t <= 1e-12),  W_s = gE + sum_{t>=s} dE_t
    dw = -Pi g G + 2 w (U Pi + lambda B / E^2 + W),  B_t = E_t - w_t^2,  W_t = sum_{s>t} dE_s
    (lambda / 1e-12 in place of lambda B / E^2 where the clamp is active)

in three passes over (w, G): per-chunk totals of dQ, dM; dPi, Lambda, lambda and per-chunk
totals of dE; dw. A suffix sum inside a chunk is the chunk's inclusive suffix state (host) minus
the chunk's running sum before the token (the prefix walk of the forward). Kept for backward:
w, Pi and lb (B, H, N), and the chunk states E, Q (B, H, chunks, p), M (B, H, chunks).

Scale-safe form (:mod:`._scaling`): every kernel reads the per-(b, h) power of two k of
:mod:`whiteformer.ops.scaling` and works on x = w / k: E, Q and the clamp 1e-12 are in units of
k^2, the gain is g = 1 / (1 / k + k c Q) (= k / (1 + dots)), out = -x Pi g, dQ gains a factor k
and dw = dL/dx / k. With k = 1 (|w| <= 2^32) these are the formulas above.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...constants import PI_EPS
from . import _tiles
from ._scaling import chunk_scale
from ._tiles import (
    acc_dtype,
    add_pi_sums,
    chunk_energy,
    chunk_program,
    div,
    group_program,
    head_scales,
    load_go_pi,
    mask_u8,
    per_head,
    put_rows,
    rows,
    softmax_heads,
    sub_block,
    tl_acc,
)

__all__ = ["causal_tssa_triton"]


@triton.jit
def _cum(x, reverse: tl.constexpr = False):
    """Prefix sums over the tokens (axis 1) of a sub-block's (BLOCK_H, BLOCK_N[, BLOCK_P]) tile,
    from the end if ``reverse``. A one-token sub-block is its own prefix sum: no scan there (a scan
    over a dimension of 1 still holds registers; at 32 heads of 128 the lambda kernel would spill)."""
    if x.shape[1] == 1:
        return x
    return tl.cumsum(x, axis=1, reverse=reverse)


@triton.jit
def _gain(x2, pi, q_run, m_run, inv_k, k, PI_EPS):
    """For a sub-block after running sums q_run (BLOCK_H, BLOCK_P), m_run (BLOCK_H,): c_t
    (BLOCK_H, BLOCK_N), d_t = c_t Q_t and the gain g_t = 1 / (1 / k + k d_t) (BLOCK_H, BLOCK_N,
    BLOCK_P), k (BLOCK_H,) the head's scale (full-range division: far from 1, k d_t exceeds 2^126)."""
    q = q_run[:, None, :] + _cum(pi[:, :, None] * x2)
    inv_m = div(1.0, m_run[:, None] + _cum(pi) + PI_EPS)
    d = q * inv_m[:, :, None]
    return inv_m, d, 1.0 / (inv_k[:, None, None] + k[:, None, None] * d)


@triton.jit
def _bwd_tile(go_ptr, pi_ptr, tok, in_tok, offs, inside, x, q_run, m_run, inv_k, k, PI_EPS, ACC: tl.constexpr):
    """What every backward pass first computes on a sub-block (x = w / k loaded): G, Pi, x^2,
    d_t = c_t Q_t, the gain g_t and dQ_t = c_t D_t = k c_t g_t^2 x_t Pi_t G_t ((BLOCK_H, BLOCK_N,
    BLOCK_P); Pi: (BLOCK_H, BLOCK_N))."""
    go, pi = load_go_pi(go_ptr, pi_ptr, tok, in_tok, offs, inside, ACC)
    x2 = x * x
    inv_m, d, gain = _gain(x2, pi, q_run, m_run, inv_k, k, PI_EPS)
    # in the PyTorch path's order (G x Pi g^2, times k, times c): no overflow of k c when k ~ 2^127
    return go, pi, x2, d, gain, gain * gain * x * pi[:, :, None] * go * k[:, None, None] * inv_m[:, :, None]


@triton.jit
def _energy(x2, e_run):
    """E_t (BLOCK_H, BLOCK_N, BLOCK_P) for a sub-block after the running sum e_run."""
    return e_run[:, None, :] + _cum(x2)


@triton.jit
def _energy_grad(lam, x2, energy, eps):
    """dL/dE_t = -lambda_t x_t^2 / E_t^2, 0 where the clamp max(E_t, eps) is active (eps
    (BLOCK_H, 1, 1): 1e-12 in units of the head's scale; divided twice, E_t^2 may underflow)."""
    safe = tl.maximum(energy, eps)
    return tl.where(energy > eps, div(div(-lam[:, :, None] * x2, safe), safe), 0.0)


@triton.jit
def _suffix(after, part):
    """Suffix sums from each token of a sub-block (inclusive): ``after`` = the sum over the tokens
    after the sub-block, plus a reverse prefix sum inside it (no subtraction: exact)."""
    return tl.expand_dims(after, 1) + _cum(part, True)


@triton.jit
def _pi(x_ptr, mask_ptr, scl_ptr, e0_ptr, lb_ptr, temp_ptr, pi_ptr, q_part_ptr, m_part_ptr, H, N, P, NC,
        has_mask, has_lb, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    b, c, bh, in_h, in_hp, lo, hi = chunk_program(H, N, P, CHUNK, BLOCK_H, BLOCK_P)
    inv_k, k, eps = head_scales(scl_ptr, bh, in_h)
    eps = eps[:, None, None]
    temp = tl.load(temp_ptr + tl.arange(0, BLOCK_H), mask=in_h, other=0.0)
    e_run = rows(e0_ptr, bh, c, NC, P, in_hp, BLOCK_P)
    q_acc = tl.zeros([BLOCK_H, BLOCK_P], ACC)
    m_acc = tl.zeros([BLOCK_H], ACC)
    for start in range(lo, hi, BLOCK_N):
        tok, in_tok, offs, inside, keep, x = sub_block(x_ptr, mask_ptr, b, bh, in_h, inv_k, start, N, P, has_mask,
                                                       BLOCK_N, BLOCK_P, ACC)
        x2 = x * x
        logit = tl.sum(div(x2, tl.maximum(_energy(x2, e_run), eps)), axis=2)
        if has_lb:
            logit += tl.load(lb_ptr + tok, mask=in_tok, other=0.0)
        pi = tl.where(keep[None, :], softmax_heads(temp[:, None] * logit, in_h), 0.0)
        tl.store(pi_ptr + tok, pi, mask=in_tok)
        e_run += tl.sum(x2, axis=1)
        q_acc, m_acc = add_pi_sums(q_acc, m_acc, pi, x2)
    put_rows(q_part_ptr, bh, c, NC, P, in_hp, q_acc, BLOCK_P)
    tl.store(m_part_ptr + bh * NC + c, m_acc, mask=in_h)


@triton.jit
def _out(x_ptr, mask_ptr, scl_ptr, pi_ptr, q0_ptr, m0_ptr, out_ptr, H, N, P, NC, PI_EPS,
         has_mask, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
         BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    b, c, bh, in_h, in_hp, lo, hi = chunk_program(H, N, P, CHUNK, BLOCK_H, BLOCK_P)
    inv_k, k, eps = head_scales(scl_ptr, bh, in_h)
    eps = eps[:, None, None]
    q_run = rows(q0_ptr, bh, c, NC, P, in_hp, BLOCK_P)
    m_run = per_head(m0_ptr, bh, c, NC, in_h)
    for start in range(lo, hi, BLOCK_N):
        tok, in_tok, offs, inside, keep, x = sub_block(x_ptr, mask_ptr, b, bh, in_h, inv_k, start, N, P, has_mask,
                                                       BLOCK_N, BLOCK_P, ACC)
        pi = tl.load(pi_ptr + tok, mask=in_tok, other=0.0)
        x2 = x * x
        _, _, gain = _gain(x2, pi, q_run, m_run, inv_k, k, PI_EPS)
        tl.store(out_ptr + offs, (-x * pi[:, :, None] * gain).to(out_ptr.dtype.element_ty), mask=inside)
        q_run, m_run = add_pi_sums(q_run, m_run, pi, x2)


@triton.jit
def _bwd_chunk(x_ptr, mask_ptr, scl_ptr, pi_ptr, go_ptr, q0_ptr, m0_ptr, dq_part_ptr, dm_part_ptr, H, N, P, NC, PI_EPS,
               has_mask, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    b, c, bh, in_h, in_hp, lo, hi = chunk_program(H, N, P, CHUNK, BLOCK_H, BLOCK_P)
    inv_k, k, eps = head_scales(scl_ptr, bh, in_h)
    eps = eps[:, None, None]
    q_run = rows(q0_ptr, bh, c, NC, P, in_hp, BLOCK_P)
    m_run = per_head(m0_ptr, bh, c, NC, in_h)
    dq_acc = tl.zeros([BLOCK_H, BLOCK_P], ACC)
    dm_acc = tl.zeros([BLOCK_H], ACC)
    for start in range(lo, hi, BLOCK_N):
        tok, in_tok, offs, inside, keep, x = sub_block(x_ptr, mask_ptr, b, bh, in_h, inv_k, start, N, P, has_mask,
                                                       BLOCK_N, BLOCK_P, ACC)
        go, pi, x2, d, gain, dq = _bwd_tile(go_ptr, pi_ptr, tok, in_tok, offs, inside, x, q_run, m_run, inv_k, k, PI_EPS,
                                             ACC)
        dq_acc += tl.sum(dq, axis=1)
        dm_acc -= tl.sum(tl.sum(dq * d, axis=2), axis=1)
        q_run, m_run = add_pi_sums(q_run, m_run, pi, x2)
    put_rows(dq_part_ptr, bh, c, NC, P, in_hp, dq_acc, BLOCK_P)
    tl.store(dm_part_ptr + bh * NC + c, dm_acc, mask=in_h)


@triton.jit
def _bwd_lambda(x_ptr, mask_ptr, scl_ptr, pi_ptr, go_ptr, gpi_ptr, lb_ptr, temp_ptr, e0_ptr, q0_ptr, m0_ptr, u_ptr, v_ptr,
                lam_ptr, dtemp_part_ptr, de_part_ptr, H, N, P, NC, PI_EPS,
                has_mask, has_lb, has_gpi, CHUNK: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    b, c, bh, in_h, in_hp, lo, hi = chunk_program(H, N, P, CHUNK, BLOCK_H, BLOCK_P)
    inv_k, k, eps = head_scales(scl_ptr, bh, in_h)
    eps = eps[:, None, None]
    temp = tl.load(temp_ptr + tl.arange(0, BLOCK_H), mask=in_h, other=0.0)
    e_run = rows(e0_ptr, bh, c, NC, P, in_hp, BLOCK_P)
    q_run = rows(q0_ptr, bh, c, NC, P, in_hp, BLOCK_P)
    m_run = per_head(m0_ptr, bh, c, NC, in_h)
    u_after = rows(u_ptr, bh, c, NC, P, in_hp, BLOCK_P)  # U, V from the chunk's start; then after each sub-block
    v_after = per_head(v_ptr, bh, c, NC, in_h)
    de_acc = tl.zeros([BLOCK_H, BLOCK_P], ACC)
    dtemp_acc = tl.zeros([BLOCK_H], ACC)
    for start in range(lo, hi, BLOCK_N):
        tok, in_tok, offs, inside, keep, x = sub_block(x_ptr, mask_ptr, b, bh, in_h, inv_k, start, N, P, has_mask,
                                                       BLOCK_N, BLOCK_P, ACC)
        go, pi, x2, d, gain, dq = _bwd_tile(go_ptr, pi_ptr, tok, in_tok, offs, inside, x, q_run, m_run, inv_k, k, PI_EPS,
                                             ACC)
        dm = -tl.sum(dq * d, axis=2)
        u_after -= tl.sum(dq, axis=1)
        v_after -= tl.sum(dm, axis=1)
        u = _suffix(u_after, dq)
        v = _suffix(v_after, dm)
        dpi = tl.sum(u * x2 - x * gain * go, axis=2) + v
        if has_gpi:
            dpi += tl.load(gpi_ptr + tok, mask=in_tok, other=0.0).to(ACC)
        big_lam = pi * (dpi - tl.sum(pi * dpi, axis=0)[None, :])  # softmax backward over heads
        energy = _energy(x2, e_run)
        logit = tl.sum(div(x2, tl.maximum(energy, eps)), axis=2)
        if has_lb:
            logit += tl.load(lb_ptr + tok, mask=in_tok, other=0.0)
        dtemp_acc += tl.sum(big_lam * logit, axis=1)
        lam = temp[:, None] * big_lam
        tl.store(lam_ptr + tok, lam, mask=in_tok)
        de_acc += tl.sum(_energy_grad(lam, x2, energy, eps), axis=1)
        e_run += tl.sum(x2, axis=1)
        q_run, m_run = add_pi_sums(q_run, m_run, pi, x2)
    tl.store(dtemp_part_ptr + (b.to(tl.int64) * NC + c) * H + tl.arange(0, BLOCK_H), dtemp_acc, mask=in_h)
    put_rows(de_part_ptr, bh, c, NC, P, in_hp, de_acc, BLOCK_P)


@triton.jit
def _bwd_dw(x_ptr, mask_ptr, scl_ptr, pi_ptr, go_ptr, lam_ptr, e0_ptr, q0_ptr, m0_ptr, u_ptr, w_ptr, dw_ptr,
            H, N, P, NC, PI_EPS,
            has_mask, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    b, c, bh, in_h, in_hp, lo, hi = group_program(H, N, P, CHUNK, BLOCK_H, BLOCK_P)
    inv_k, k, eps = head_scales(scl_ptr, bh, in_h)
    eps = eps[:, None, None]
    e0 = rows(e0_ptr, bh, c, NC, P, in_hp, BLOCK_P)
    # this chunk's total of dL/dE in float64 (dE_t = -lambda w^2 / E^2 is large where E_t is small,
    # e.g. at a sequence's first token): the suffix after a sub-block is then (total - running sum)
    # with no rounding of the large terms left over, and it reads only w and lambda
    e_run = e0
    de_total = tl.zeros([BLOCK_H, BLOCK_P], tl.float64)
    for start in range(lo, hi, BLOCK_N):
        tok, in_tok, offs, inside, keep, x2 = sub_block(x_ptr, mask_ptr, b, bh, in_h, inv_k, start, N, P, has_mask,
                                                        BLOCK_N, BLOCK_P, ACC)
        x2 = x2 * x2
        lam = tl.load(lam_ptr + tok, mask=in_tok, other=0.0)
        de_total += tl.sum(_energy_grad(lam, x2, _energy(x2, e_run), eps), axis=1).to(tl.float64)
        e_run += tl.sum(x2, axis=1)
    w_after = rows(w_ptr, bh, c, NC, P, in_hp, BLOCK_P).to(tl.float64) + de_total  # W at the chunk start
    e_run = e0
    q_run = rows(q0_ptr, bh, c, NC, P, in_hp, BLOCK_P)
    m_run = per_head(m0_ptr, bh, c, NC, in_h)
    u_after = rows(u_ptr, bh, c, NC, P, in_hp, BLOCK_P)
    for start in range(lo, hi, BLOCK_N):
        tok, in_tok, offs, inside, keep, x = sub_block(x_ptr, mask_ptr, b, bh, in_h, inv_k, start, N, P, has_mask,
                                                       BLOCK_N, BLOCK_P, ACC)
        go, pi, x2, d, gain, dq = _bwd_tile(go_ptr, pi_ptr, tok, in_tok, offs, inside, x, q_run, m_run, inv_k, k, PI_EPS,
                                             ACC)
        lam = tl.load(lam_ptr + tok, mask=in_tok, other=0.0)
        energy = _energy(x2, e_run)
        de = _energy_grad(lam, x2, energy, eps)
        u_after -= tl.sum(dq, axis=1)
        w_after -= tl.sum(de, axis=1).to(tl.float64)
        u = _suffix(u_after, dq)
        # a token's own ratio w^2 / E has the gradient 1 / E - w^2 / E^2 = B / E^2 (B = E - w^2,
        # the earlier tokens' energy, exactly 0 at a sequence's first token): its two terms of size
        # 1 / E cancel there, so they are never formed apart; W sums the later tokens' dL/dE only,
        # the tile's suffix minus the token's own term taken in float64 (the own term is the large
        # one at the first tokens: no rounding of it is left in W)
        de64 = de.to(tl.float64)
        before = energy - x2
        later = (w_after[:, None, :] + (_cum(de64, True) - de64)).to(ACC)
        safe = tl.maximum(energy, eps)
        own = tl.where(energy > eps, div(div(lam[:, :, None] * before, safe), safe), div(lam[:, :, None], safe))
        dw = -pi[:, :, None] * gain * go
        dw += 2.0 * x * (u * pi[:, :, None] + own + later)
        dw = dw * inv_k[:, None, None]  # dL/dw = dL/dx / k
        tl.store(dw_ptr + offs, dw.to(dw_ptr.dtype.element_ty), mask=inside)
        e_run += tl.sum(x2, axis=1)
        q_run, m_run = add_pi_sums(q_run, m_run, pi, x2)


def _launch(w: Tensor, mask: Optional[Tensor]):
    """(grid, constexprs and options, the uint8 mask) of the sequence kernels for w (B, H, N, p)."""
    b, h, n, p = w.shape
    t = _tiles.tiles(h, p, w.dtype)
    meta = dict(t.meta(), has_mask=mask is not None, CHUNK=t.chunk, ACC=tl_acc(w.dtype))
    return (b, triton.cdiv(n, t.chunk)), meta, mask_u8(mask, w)


def _prefix(part: Tensor) -> Tensor:
    """Exclusive prefix over chunks (dim 2) of per-chunk totals: the chunk states."""
    out = torch.zeros_like(part)
    out[:, :, 1:] = part[:, :, :-1].cumsum(2)  # exactly the earlier chunks (no "inclusive - own")
    return out


def _suffix_incl(part: Tensor, final_grad: Optional[Tensor]) -> Tensor:
    """Sum over this and the later chunks (dim 2) of per-chunk totals, plus the final state's gradient."""
    incl = part.flip(2).cumsum(2).flip(2)
    return incl if final_grad is None else incl + final_grad.unsqueeze(2)


def _suffix_after(part: Tensor, final_grad: Optional[Tensor]) -> Tensor:
    """Sum over the later chunks (dim 2) of per-chunk totals, plus the final state's gradient."""
    after = torch.zeros_like(part)
    after[:, :, :-1] = part[:, :, 1:].flip(2).cumsum(2).flip(2)
    return after if final_grad is None else after + final_grad.unsqueeze(2)


# ------------------------------------------------------------------------------ custom ops


@torch.library.custom_op("whiteformer::causal_tssa_triton_fwd", mutates_args=())
def _fwd(w: Tensor, temp: Tensor, lb: Optional[Tensor], mask: Optional[Tensor]
         ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    b, h, n, p = w.shape
    acc = acc_dtype(w.dtype)
    grid, meta, m8 = _launch(w, mask)
    nc = grid[1]
    part, amax = w.new_empty(b, h, nc, p, dtype=torch.float64), w.new_empty(b, h, nc, p, dtype=acc)
    chunk_energy[grid](w, m8, part, amax, h, n, p, nc, **meta)
    _, scl, part = chunk_scale(part, amax.amax(-1), acc)  # the scale from the chunks' maxima, sums in its units
    e0, e_fin = _prefix(part), part.sum(2)
    pi = w.new_empty(b, h, n, dtype=acc)
    q_part, m_part = w.new_empty(b, h, nc, p, dtype=acc), w.new_empty(b, h, nc, dtype=acc)
    _pi[grid](w, m8, scl, e0, pi if lb is None else lb, temp, pi, q_part, m_part, h, n, p, nc,
              has_lb=lb is not None, **meta)
    q0, m0 = _prefix(q_part), _prefix(m_part)
    out = torch.empty_like(w)
    _out[grid](w, m8, scl, pi, q0, m0, out, h, n, p, nc, PI_EPS, **meta)
    return out, pi, e_fin, m_part.sum(2), q_part.sum(2), e0, q0, m0, scl


@_fwd.register_fake
def _(w, temp, lb, mask):
    b, h, n, p = w.shape
    acc, nc = acc_dtype(w.dtype), _launch(w, mask)[0][1]
    new = lambda *shape: w.new_empty(*shape, dtype=acc)  # noqa: E731
    return (torch.empty_like(w), new(b, h, n), new(b, h, p), new(b, h), new(b, h, p), new(b, h, nc, p),
            new(b, h, nc, p), new(b, h, nc), new(b, h, 3))


@torch.library.custom_op("whiteformer::causal_tssa_triton_bwd", mutates_args=())
def _bwd(grad_out: Tensor, grad_pi: Optional[Tensor], grad_e: Optional[Tensor], grad_m: Optional[Tensor],
         grad_q: Optional[Tensor], w: Tensor, temp: Tensor, lb: Optional[Tensor], mask: Optional[Tensor],
         scl: Tensor, pi: Tensor, e0: Tensor, q0: Tensor, m0: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    b, h, n, p = w.shape
    acc = acc_dtype(w.dtype)
    grid, meta, m8 = _launch(w, mask)
    nc = grid[1]
    dq_part, dm_part = w.new_empty(b, h, nc, p, dtype=acc), w.new_empty(b, h, nc, dtype=acc)
    _bwd_chunk[grid](w, m8, scl, pi, grad_out, q0, m0, dq_part, dm_part, h, n, p, nc, PI_EPS, **meta)
    u, v = _suffix_incl(dq_part, grad_q), _suffix_incl(dm_part, grad_m)
    lam = w.new_empty(b, h, n, dtype=acc)
    dtemp_part = w.new_empty(b, nc, h, dtype=acc)
    de_part = dq_part  # reused: its totals are folded into u already
    _bwd_lambda[grid](w, m8, scl, pi, grad_out, lam if grad_pi is None else grad_pi, lam if lb is None else lb, temp,
                      e0, q0, m0, u, v, lam, dtemp_part, de_part, h, n, p, nc, PI_EPS,
                      has_lb=lb is not None, has_gpi=grad_pi is not None, **meta)
    w_after = _suffix_after(de_part, grad_e)
    dw = torch.empty_like(w)
    groups, group_meta = _tiles.tiles(h, p, w.dtype).group_meta(h)  # no softmax over heads: head groups
    _bwd_dw[grid + (groups,)](w, m8, scl, pi, grad_out, lam, e0, q0, m0, u, w_after, dw, h, n, p, nc, PI_EPS,
                              **dict(meta, **group_meta))
    return dw, lam, dtemp_part.sum((0, 1))


@_bwd.register_fake
def _(grad_out, grad_pi, grad_e, grad_m, grad_q, w, temp, lb, mask, scl, pi, e0, q0, m0):
    b, h, n, _ = w.shape
    acc = acc_dtype(w.dtype)
    return torch.empty_like(w), w.new_empty(b, h, n, dtype=acc), w.new_empty(h, dtype=acc)


def _setup(ctx, inputs, output):
    _, pi, _, _, _, e0, q0, m0, scl = output
    ctx.mark_non_differentiable(e0, q0, m0, scl)
    ctx.save_for_backward(*inputs, scl, pi, e0, q0, m0)


def _backward(ctx, g_out, g_pi, g_e, g_m, g_q, *_):
    w, temp, lb, mask, scl, pi, e0, q0, m0 = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph: differentiable recomputation in PyTorch
        from ...causal_tssa.parallel import causal_tssa_parallel
        from ..fused import _double_backward

        inputs = (w, temp) if lb is None else (w, temp, lb)
        grads = _double_backward(causal_tssa_parallel(w, temp, lb, mask), inputs, (g_out, g_pi, g_e, g_m, g_q))
        return grads[0], grads[1], grads[2] if lb is not None else None, None
    g_out = torch.zeros_like(w) if g_out is None else g_out.contiguous()
    g_pi, g_e, g_m, g_q = (None if g is None else g.contiguous() for g in (g_pi, g_e, g_m, g_q))
    dw, dlb, dtemp = _bwd(g_out, g_pi, g_e, g_m, g_q, w, temp, lb, mask, scl, pi, e0, q0, m0)
    return dw, dtemp.view_as(temp), dlb if lb is not None else None, None


_fwd.register_autograd(_backward, setup_context=_setup)


def causal_tssa_triton(
    w: Tensor, temp: Tensor, logit_bias: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None
) -> Tuple[Tensor, ...]:
    """Causal TSSA through the Triton kernels (no dropout).

    Args:
        w: (B, H, N, p) float16/bfloat16/float32/float64; temp: (H, 1); logit_bias: (B or 1, H, N)
            added to ``sum_p ratio`` before the temperature (``p * pos_bias`` at each token's
            position) or None; attn_mask: (B, N) bool keep-mask or None.

    Returns:
        out (B, H, N, p) and pi (B, H, N) in w's dtype, the final running sums sum_sq (B, H, p),
        sum_pi (B, H), sum_sq_pi (B, H, p) in the statistics dtype (differentiable) in units of
        their scale (B, H), the power of two of :mod:`whiteformer.ops.scaling` (as the PyTorch path).
    """
    w = w.contiguous()
    b, h, n, _ = w.shape
    acc = acc_dtype(w.dtype)
    lb = None if logit_bias is None else logit_bias.to(acc).expand(b, h, n).contiguous()
    mask = None if attn_mask is None else attn_mask.contiguous()
    out, pi, e, m, q, _, _, _, scl = _fwd(w, temp.to(acc).contiguous(), lb, mask)
    return out, pi.to(w.dtype), e, m, q, scl[..., 1]
