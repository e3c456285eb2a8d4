r"""Triton TSSA (ToST Eq. (11), memberships Eqs. (32)-(34)): forward and hand-derived backward.

Per (b, h), kept tokens only (formulas and their derivation: :mod:`whiteformer.ops._kernels.fused`)::

    s_j = sum_n w_nj^2,  r_j = 1 / max(s_j, 1e-24),  R_n = sum_j w_nj^2 r_j
    Pi_n = softmax_heads(temp R)_n,  M = sum_n Pi_n,  c = 1 / (M + 1e-8),  T_j = sum_n Pi_n w_nj^2
    g_j = 1 / (1 + c T_j),  out_nj = -w_nj Pi_n g_j

Every kernel runs the grid (B, chunks) of :mod:`._tiles` (a program: one sequence, all heads, one
chunk of tokens walked in sub-blocks). Sums over tokens are per chunk, then over chunks on the
host in a fixed order (deterministic). Forward, three passes over ``w`` (the least possible: s
is needed before any Pi, and T before any output):

1. ``chunk_energy`` (:mod:`._tiles`): partial s.
2. ``_pi``: logits temp R of every head, the softmax over heads, Pi, partial T and M.
3. ``_out``: out.

Backward (G = dL/dout, gPi = dL/dPi), three passes over (w, G)::

    q_j = sum_n w Pi G  (1.);  D = g^2 q,  K = c sum_j D_j c T_j                   (host)
    dPi_n = gPi_n - sum_j w g G + c sum_j D_j w^2 - K,  Lambda = Pi (dPi - sum_heads Pi dPi)
    dtemp += Lambda R,  lambda = temp Lambda,  partial sum_n lambda w^2               (2.)
    ds_j = -r_j^2 sum_n lambda w^2 (0 where s_j <= 1e-24)                          (host)
    dw = -Pi g G + 2 w (c D Pi + lambda r + ds)                                      (3.)

Saved for backward: w, Pi (statistics dtype, (B, H, N)), s, T (B, H, p), M (B, H).

Scale-safe form (:mod:`._scaling`): the kernels read a power of two k_j per (b, h, feature j)
(a (BLOCK_H, BLOCK_P) tile, once per program) and work on x = w / k: s_j, T_j and the clamp
1e-24 are in units of k_j^2, g_j = 1 / (1 / k_j + k_j c T_j) (= k_j / (1 + dots_j)),
out = -x Pi g, D = k g^2 q and dw = dL/dx / k, per feature (s, T, g and dots are per feature and
R sums the scale-free ratios w_j^2 / s_j, so the scales do not mix). With k = 1 (|w| <= 2^32)
these are the formulas above.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...constants import PI_EPS
from . import _tiles
from ._scaling import chunk_feature_scale
from ._tiles import (
    acc_dtype,
    add_pi_sums,
    chunk_energy,
    chunk_program,
    div,
    feature_scales,
    load_go_pi,
    mask_u8,
    per_head,
    put_rows,
    rows,
    softmax_heads,
    sub_block,
    tl_acc,
)

__all__ = ["tssa_triton"]


@triton.jit
def _pi(x_ptr, mask_ptr, scl_ptr, r_ptr, temp_ptr, pi_ptr, t_part_ptr, m_part_ptr, H, N, P, NC,
        has_mask, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    b, c, bh, in_h, in_hp, lo, hi = chunk_program(H, N, P, CHUNK, BLOCK_H, BLOCK_P)
    inv_sc, sc, _ = feature_scales(scl_ptr, bh, in_hp, P, BLOCK_P)
    r = rows(r_ptr, bh, 0, 1, P, in_hp, BLOCK_P)
    temp = tl.load(temp_ptr + tl.arange(0, BLOCK_H), mask=in_h, other=0.0)
    t_acc = tl.zeros([BLOCK_H, BLOCK_P], ACC)
    m_acc = tl.zeros([BLOCK_H], ACC)
    for start in range(lo, hi, BLOCK_N):
        tok, in_tok, offs, inside, keep, x = sub_block(x_ptr, mask_ptr, b, bh, in_h, inv_sc, start, N, P, has_mask,
                                                       BLOCK_N, BLOCK_P, ACC)
        x2 = x * x
        pi = softmax_heads(temp[:, None] * tl.sum(x2 * r[:, None, :], axis=2), in_h)
        pi = tl.where(keep[None, :], pi, 0.0)
        tl.store(pi_ptr + tok, pi, mask=in_tok)
        t_acc, m_acc = add_pi_sums(t_acc, m_acc, pi, x2)
    put_rows(t_part_ptr, bh, c, NC, P, in_hp, t_acc, BLOCK_P)
    tl.store(m_part_ptr + bh * NC + c, m_acc, mask=in_h)


@triton.jit
def _out(x_ptr, mask_ptr, scl_ptr, pi_ptr, t_ptr, m_ptr, out_ptr, H, N, P, PI_EPS,
         has_mask, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
         BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    b, c, bh, in_h, in_hp, lo, hi = chunk_program(H, N, P, CHUNK, BLOCK_H, BLOCK_P)
    inv_sc, sc, _ = feature_scales(scl_ptr, bh, in_hp, P, BLOCK_P)
    inv_m = div(1.0, per_head(m_ptr, bh, 0, 1, in_h) + PI_EPS)
    # 1 / (1 / sc + sc c T) (full-range division: far from 1, its denominator exceeds 2^126)
    gain = 1.0 / (inv_sc + sc * (inv_m[:, None] * rows(t_ptr, bh, 0, 1, P, in_hp, BLOCK_P)))
    for start in range(lo, hi, BLOCK_N):
        tok, in_tok, offs, inside, keep, x = sub_block(x_ptr, mask_ptr, b, bh, in_h, inv_sc, start, N, P, has_mask,
                                                       BLOCK_N, BLOCK_P, ACC)
        pi = tl.load(pi_ptr + tok, mask=in_tok, other=0.0)
        out = -x * pi[:, :, None] * gain[:, None, :]
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _bwd_q(x_ptr, mask_ptr, scl_ptr, pi_ptr, go_ptr, q_part_ptr, H, N, P, NC,
           has_mask, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    b, c, bh, in_h, in_hp, lo, hi = chunk_program(H, N, P, CHUNK, BLOCK_H, BLOCK_P)
    inv_sc, sc, _ = feature_scales(scl_ptr, bh, in_hp, P, BLOCK_P)
    acc = tl.zeros([BLOCK_H, BLOCK_P], ACC)
    for start in range(lo, hi, BLOCK_N):
        tok, in_tok, offs, inside, keep, x = sub_block(x_ptr, mask_ptr, b, bh, in_h, inv_sc, start, N, P, has_mask,
                                                       BLOCK_N, BLOCK_P, ACC)
        go, pi = load_go_pi(go_ptr, pi_ptr, tok, in_tok, offs, inside, ACC)
        acc += tl.sum(x * pi[:, :, None] * go, axis=1)
    put_rows(q_part_ptr, bh, c, NC, P, in_hp, acc, BLOCK_P)


@triton.jit
def _bwd_lambda(x_ptr, mask_ptr, scl_ptr, pi_ptr, go_ptr, gpi_ptr, gain_ptr, cd_ptr, k_ptr, r_ptr, temp_ptr,
                lam_ptr, dtemp_part_ptr, ds_part_ptr, H, N, P, NC,
                has_mask, has_gpi, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    b, c, bh, in_h, in_hp, lo, hi = chunk_program(H, N, P, CHUNK, BLOCK_H, BLOCK_P)
    inv_sc, sc, _ = feature_scales(scl_ptr, bh, in_hp, P, BLOCK_P)
    k = per_head(k_ptr, bh, 0, 1, in_h)
    temp = tl.load(temp_ptr + tl.arange(0, BLOCK_H), mask=in_h, other=0.0)
    ds_acc = tl.zeros([BLOCK_H, BLOCK_P], ACC)
    dtemp_acc = tl.zeros([BLOCK_H], ACC)
    for start in range(lo, hi, BLOCK_N):
        tok, in_tok, offs, inside, keep, x = sub_block(x_ptr, mask_ptr, b, bh, in_h, inv_sc, start, N, P, has_mask,
                                                       BLOCK_N, BLOCK_P, ACC)
        go, pi = load_go_pi(go_ptr, pi_ptr, tok, in_tok, offs, inside, ACC)
        x2 = x * x
        dpi = tl.sum(x2 * rows(cd_ptr, bh, 0, 1, P, in_hp, BLOCK_P)[:, None, :]
                     - x * go * rows(gain_ptr, bh, 0, 1, P, in_hp, BLOCK_P)[:, None, :], axis=2) - k[:, None]
        if has_gpi:
            dpi += tl.load(gpi_ptr + tok, mask=in_tok, other=0.0).to(ACC)
        big_lam = pi * (dpi - tl.sum(pi * dpi, axis=0)[None, :])  # softmax backward over heads
        big_r = tl.sum(x2 * rows(r_ptr, bh, 0, 1, P, in_hp, BLOCK_P)[:, None, :], axis=2)
        dtemp_acc += tl.sum(big_lam * big_r, axis=1)
        lam = temp[:, None] * big_lam
        tl.store(lam_ptr + tok, lam, mask=in_tok)
        ds_acc += tl.sum(lam[:, :, None] * x2, axis=1)
    tl.store(dtemp_part_ptr + (b.to(tl.int64) * NC + c) * H + tl.arange(0, BLOCK_H), dtemp_acc, mask=in_h)
    put_rows(ds_part_ptr, bh, c, NC, P, in_hp, ds_acc, BLOCK_P)


@triton.jit
def _bwd_dw(x_ptr, mask_ptr, scl_ptr, pi_ptr, go_ptr, gain_ptr, cd_ptr, r_ptr, ds_ptr, lam_ptr, dw_ptr, H, N, P,
            has_mask, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    b, c, bh, in_h, in_hp, lo, hi = chunk_program(H, N, P, CHUNK, BLOCK_H, BLOCK_P)
    inv_sc, sc, _ = feature_scales(scl_ptr, bh, in_hp, P, BLOCK_P)
    for start in range(lo, hi, BLOCK_N):
        tok, in_tok, offs, inside, keep, x = sub_block(x_ptr, mask_ptr, b, bh, in_h, inv_sc, start, N, P, has_mask,
                                                       BLOCK_N, BLOCK_P, ACC)
        go, pi = load_go_pi(go_ptr, pi_ptr, tok, in_tok, offs, inside, ACC)
        pi = pi[:, :, None]
        lam = tl.load(lam_ptr + tok, mask=in_tok, other=0.0)[:, :, None]
        dw = -pi * rows(gain_ptr, bh, 0, 1, P, in_hp, BLOCK_P)[:, None, :] * go
        dw += 2.0 * x * (rows(cd_ptr, bh, 0, 1, P, in_hp, BLOCK_P)[:, None, :] * pi
                         + lam * rows(r_ptr, bh, 0, 1, P, in_hp, BLOCK_P)[:, None, :]
                         + rows(ds_ptr, bh, 0, 1, P, in_hp, BLOCK_P)[:, None, :])
        dw = dw * inv_sc[:, None, :]  # dL/dw = dL/dx / sc
        tl.store(dw_ptr + offs, dw.to(dw_ptr.dtype.element_ty), mask=inside)


def _launch(w: Tensor, mask: Optional[Tensor]):
    """(grid, constexprs and options, the uint8 mask) of the sequence kernels for w (B, H, N, p)."""
    b, h, n, p = w.shape
    t = _tiles.tiles(h, p, w.dtype)
    meta = dict(t.meta(), has_mask=mask is not None, CHUNK=t.chunk, ACC=tl_acc(w.dtype))
    return (b, triton.cdiv(n, t.chunk)), meta, mask_u8(mask, w)


# ------------------------------------------------------------------------------ custom ops


@torch.library.custom_op("whiteformer::tssa_triton_fwd", mutates_args=())
def _fwd(w: Tensor, temp: Tensor, mask: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    b, h, n, p = w.shape
    acc = acc_dtype(w.dtype)
    grid, meta, m8 = _launch(w, mask)
    part, amax = w.new_empty(b, h, grid[1], p, dtype=torch.float64), w.new_empty(b, h, grid[1], p, dtype=acc)
    chunk_energy[grid](w, m8, part, amax, h, n, p, grid[1], **meta)
    _, scl, part = chunk_feature_scale(part, amax, acc, _tiles.NORM_EPS_SQ)  # from the chunks' maxima
    s = part.sum(2)
    r = torch.maximum(s, scl[..., 2, :]).reciprocal()
    pi = w.new_empty(b, h, n, dtype=acc)
    m_part = w.new_empty(b, h, grid[1], dtype=acc)
    _pi[grid](w, m8, scl, r, temp, pi, part, m_part, h, n, p, grid[1], **meta)
    t, m = part.sum(2), m_part.sum(2)
    out = torch.empty_like(w)
    _out[grid](w, m8, scl, pi, t, m, out, h, n, p, PI_EPS, **meta)
    return out, pi, s, t, m, scl


@_fwd.register_fake
def _(w, temp, mask):
    b, h, n, p = w.shape
    acc = acc_dtype(w.dtype)
    return (torch.empty_like(w), w.new_empty(b, h, n, dtype=acc), w.new_empty(b, h, p, dtype=acc),
            w.new_empty(b, h, p, dtype=acc), w.new_empty(b, h, dtype=acc), w.new_empty(b, h, 3, p, dtype=acc))


@torch.library.custom_op("whiteformer::tssa_triton_bwd", mutates_args=())
def _bwd(grad_out: Tensor, grad_pi: Optional[Tensor], w: Tensor, temp: Tensor, mask: Optional[Tensor],
         scl: Tensor, pi: Tensor, s: Tensor, t: Tensor, m: Tensor) -> Tuple[Tensor, Tensor]:
    b, h, n, p = w.shape
    acc = acc_dtype(w.dtype)
    grid, meta, m8 = _launch(w, mask)
    nc = grid[1]
    c = (m + PI_EPS).reciprocal()  # (B, H)
    d = c[..., None] * t
    inv_sc, sc, eps = scl.unbind(-2)  # (B, H, p) each: 1 / sc, the scale sc, NORM_EPS^2 / sc^2
    gain = (inv_sc + sc * d).reciprocal()  # (B, H, p): sc / (1 + dots)
    part = w.new_empty(b, h, nc, p, dtype=acc)
    _bwd_q[grid](w, m8, scl, pi, grad_out, part, h, n, p, nc, **meta)
    cd = gain * gain * part.sum(2) * sc * c[..., None]  # c D, D = sc g^2 q (the PyTorch path's order)
    k = (cd * d).sum(-1).contiguous()  # K = c sum_j D_j d_j
    r = torch.maximum(s, eps).reciprocal()
    lam = w.new_empty(b, h, n, dtype=acc)
    dtemp_part = w.new_empty(b, nc, h, dtype=acc)
    gpi = grad_pi if grad_pi is not None else lam
    _bwd_lambda[grid](w, m8, scl, pi, grad_out, gpi, gain, cd, k, r, temp, lam, dtemp_part, part,
                      h, n, p, nc, has_gpi=grad_pi is not None, **meta)
    ds = torch.where(s > eps, -r * (r * part.sum(2)), 0.0)
    dw = torch.empty_like(w)
    _bwd_dw[grid](w, m8, scl, pi, grad_out, gain, cd, r, ds, lam, dw, h, n, p, **meta)
    return dw, dtemp_part.sum((0, 1))


@_bwd.register_fake
def _(grad_out, grad_pi, w, temp, mask, scl, pi, s, t, m):
    return torch.empty_like(w), w.new_empty(w.shape[1], dtype=acc_dtype(w.dtype))


def _setup(ctx, inputs, output):
    w, temp, mask = inputs
    _, pi, s, t, m, scl = output
    ctx.mark_non_differentiable(scl)
    ctx.save_for_backward(w, temp, mask, scl, pi, s, t, m)


def _backward(ctx, g_out, g_pi, *_):
    w, temp, mask, scl, pi, s, t, m = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph: differentiable recomputation in PyTorch
        from ...tssa.parallel import tssa_parallel
        from ..fused import _double_backward

        dw, dtemp = _double_backward(tssa_parallel(w, temp, mask), (w, temp), (g_out, g_pi))
        return dw, dtemp, None
    g_out = torch.zeros_like(w) if g_out is None else g_out.contiguous()
    g_pi = None if g_pi is None else g_pi.contiguous()
    dw, dtemp = _bwd(g_out, g_pi, w, temp, mask, scl, pi, s, t, m)
    return dw, dtemp.view_as(temp), None


_fwd.register_autograd(_backward, setup_context=_setup)


def tssa_triton(w: Tensor, temp: Tensor, attn_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """TSSA through the Triton kernels (no dropout): w (B, H, N, p) float16/bfloat16/float32/
    float64, temp (H, 1), attn_mask (B, N) bool or None -> (out (B, H, N, p) in w's dtype,
    pi (B, H, N) in w's dtype). Inputs are assumed validated (see :func:`whiteformer.ops.tssa`)."""
    w = w.contiguous()
    temp_acc = temp.to(acc_dtype(w.dtype)).contiguous()
    out, pi, _, _, _, _ = _fwd(w, temp_acc, None if attn_mask is None else attn_mask.contiguous())
    return out, pi.to(w.dtype)
