r"""Triton TSSA (ToST Eq. (11), memberships Eqs. (32)-(34)): forward and hand-derived backward.

Per (b, h), kept tokens only (formulas and their derivation: :mod:`whiteformer.ops.tssa_fused`)::

    s_j = sum_n w_nj^2,  r_j = 1 / max(s_j, 1e-24),  R_n = sum_j w_nj^2 r_j
    Pi_n = softmax_heads(temp R)_n,  M = sum_n Pi_n,  c = 1 / (M + 1e-8),  T_j = sum_n Pi_n w_nj^2
    g_j = 1 / (1 + c T_j),  out_nj = -w_nj Pi_n g_j

Forward, three kernels over token blocks of ``BLOCK_N`` tokens (sums over blocks are reduced on
the host, in a fixed order, so results are deterministic):

1. ``energy_partials`` (:mod:`._tiles`) grid (B*H, blocks): partial s.
2. ``_pi``      grid (B, blocks): for each head the logits temp R (online softmax over heads),
   then Pi and the partial T, M (the second pass over the heads re-reads the same tiles).
3. ``_out``     grid (B*H, blocks): out.

Backward (G = dL/dout, gPi = dL/dPi), three kernels of the same shapes::

    q_j = sum_n w Pi G  (1.);  D = g^2 q,  K = c sum_j D_j c T_j                   (host)
    dPi_n = gPi_n - sum_j w g G + c sum_j D_j w^2 - K,  Lambda = Pi (dPi - sum_heads Pi dPi)
    dtemp += Lambda R,  lambda = temp Lambda,  partial sum_n lambda w^2               (2.)
    ds_j = -r_j^2 sum_n lambda w^2 (0 where s_j <= 1e-24)                          (host)
    dw = -Pi g G + 2 w (c D Pi + lambda r + ds)                                      (3.)

Saved for backward: w, Pi (statistics dtype, (B, H, N)), s, T (B, H, p), M (B, H).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...constants import PI_EPS
from . import _tiles
from ._tiles import acc_dtype, block_p, energy_partials, mask_u8, put_row, put_tok, row, tl_acc, tok, w_block

__all__ = ["tssa_triton"]


@triton.jit
def _pi(x_ptr, mask_ptr, r_ptr, temp_ptr, pi_ptr, t_part_ptr, m_part_ptr, H, N, P, NB,
        HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    b = tl.program_id(0)
    nb = tl.program_id(1)
    run_max = tl.full([BLOCK], float("-inf"), ACC)
    run_sum = tl.zeros([BLOCK], ACC)
    for h in range(H):  # logits, online softmax over heads; logits parked in pi_ptr
        bh = b * H + h
        offs_n, offs, inside, keep, x = w_block(x_ptr, mask_ptr, bh, H, nb, N, P, HAS_MASK, BLOCK, BLOCK_P, ACC)
        r = row(r_ptr, bh, 0, 1, P, BLOCK_P)
        logit = tl.load(temp_ptr + h) * tl.sum(x * x * r[None, :], axis=1)
        put_tok(pi_ptr, bh, offs_n, N, logit)
        new_max = tl.maximum(run_max, logit)
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.exp(logit - new_max)
        run_max = new_max
    for h in range(H):  # Pi and the partial moments T, M
        bh = b * H + h
        offs_n, offs, inside, keep, x = w_block(x_ptr, mask_ptr, bh, H, nb, N, P, HAS_MASK, BLOCK, BLOCK_P, ACC)
        logit = tok(pi_ptr, bh, offs_n, N)
        pi = tl.where(keep, tl.exp(logit - run_max) / run_sum, 0.0)
        put_tok(pi_ptr, bh, offs_n, N, pi)
        part = bh.to(tl.int64) * NB + nb
        put_row(t_part_ptr, bh, nb, NB, P, tl.sum(pi[:, None] * x * x, axis=0), BLOCK_P)
        tl.store(m_part_ptr + part, tl.sum(pi, axis=0))


@triton.jit
def _out(x_ptr, mask_ptr, pi_ptr, t_ptr, m_ptr, out_ptr, H, N, P, PI_EPS,
         HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    bh, nb = tl.program_id(0), tl.program_id(1)
    offs_n, offs, inside, keep, x = w_block(x_ptr, mask_ptr, bh, H, nb, N, P, HAS_MASK, BLOCK, BLOCK_P, ACC)
    pi = tok(pi_ptr, bh, offs_n, N)
    t = row(t_ptr, bh, 0, 1, P, BLOCK_P)
    c = 1.0 / (tl.load(m_ptr + bh) + PI_EPS)
    gain = 1.0 / (1.0 + c * t)
    out = -x * pi[:, None] * gain[None, :]
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _bwd_q(x_ptr, mask_ptr, pi_ptr, go_ptr, q_part_ptr, H, N, P, NB,
           HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    bh, nb = tl.program_id(0), tl.program_id(1)
    offs_n, offs, inside, keep, x = w_block(x_ptr, mask_ptr, bh, H, nb, N, P, HAS_MASK, BLOCK, BLOCK_P, ACC)
    go = tl.load(go_ptr + offs, mask=inside, other=0.0).to(ACC)
    pi = tok(pi_ptr, bh, offs_n, N)
    put_row(q_part_ptr, bh, nb, NB, P, tl.sum(x * pi[:, None] * go, axis=0), BLOCK_P)


@triton.jit
def _bwd_lambda(x_ptr, mask_ptr, pi_ptr, go_ptr, gpi_ptr, gain_ptr, cd_ptr, k_ptr, r_ptr, temp_ptr,
                lam_ptr, logit_ptr, dtemp_part_ptr, ds_part_ptr, H, N, P, NB,
                HAS_MASK: tl.constexpr, HAS_GPI: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
                ACC: tl.constexpr):
    b = tl.program_id(0)
    nb = tl.program_id(1)
    pi_dpi = tl.zeros([BLOCK], ACC)
    for h in range(H):  # dL/dPi (parked in lam_ptr) and R/temp-free logits R (in logit_ptr)
        bh = b * H + h
        offs_n, offs, inside, keep, x = w_block(x_ptr, mask_ptr, bh, H, nb, N, P, HAS_MASK, BLOCK, BLOCK_P, ACC)
        go = tl.load(go_ptr + offs, mask=inside, other=0.0).to(ACC)
        gain = row(gain_ptr, bh, 0, 1, P, BLOCK_P)
        cd = row(cd_ptr, bh, 0, 1, P, BLOCK_P)
        r = row(r_ptr, bh, 0, 1, P, BLOCK_P)
        x2 = x * x
        dpi = tl.sum(x2 * cd[None, :] - x * go * gain[None, :], axis=1) - tl.load(k_ptr + bh)
        if HAS_GPI:
            dpi += tok(gpi_ptr, bh, offs_n, N).to(ACC)
        pi = tok(pi_ptr, bh, offs_n, N)
        pi_dpi += pi * dpi
        put_tok(lam_ptr, bh, offs_n, N, dpi)
        put_tok(logit_ptr, bh, offs_n, N, tl.sum(x2 * r[None, :], axis=1))
    for h in range(H):  # softmax backward over heads: Lambda, lambda = temp Lambda
        bh = b * H + h
        offs_n, offs, inside, keep, x = w_block(x_ptr, mask_ptr, bh, H, nb, N, P, HAS_MASK, BLOCK, BLOCK_P, ACC)
        pi = tok(pi_ptr, bh, offs_n, N)
        dpi = tok(lam_ptr, bh, offs_n, N)
        big_lam = pi * (dpi - pi_dpi)
        big_r = tok(logit_ptr, bh, offs_n, N)
        tl.store(dtemp_part_ptr + (b.to(tl.int64) * NB + nb) * H + h, tl.sum(big_lam * big_r, axis=0))
        lam = tl.load(temp_ptr + h) * big_lam
        put_tok(lam_ptr, bh, offs_n, N, lam)
        put_row(ds_part_ptr, bh, nb, NB, P, tl.sum(lam[:, None] * x * x, axis=0), BLOCK_P)


@triton.jit
def _bwd_dw(x_ptr, mask_ptr, pi_ptr, go_ptr, gain_ptr, cd_ptr, r_ptr, ds_ptr, lam_ptr, dw_ptr, H, N, P,
            HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    bh, nb = tl.program_id(0), tl.program_id(1)
    offs_n, offs, inside, keep, x = w_block(x_ptr, mask_ptr, bh, H, nb, N, P, HAS_MASK, BLOCK, BLOCK_P, ACC)
    go = tl.load(go_ptr + offs, mask=inside, other=0.0).to(ACC)
    gain = row(gain_ptr, bh, 0, 1, P, BLOCK_P)
    cd = row(cd_ptr, bh, 0, 1, P, BLOCK_P)
    r = row(r_ptr, bh, 0, 1, P, BLOCK_P)
    ds = row(ds_ptr, bh, 0, 1, P, BLOCK_P)
    pi = tok(pi_ptr, bh, offs_n, N)
    lam = tok(lam_ptr, bh, offs_n, N)
    dw = -pi[:, None] * gain[None, :] * go
    dw += 2.0 * x * (cd[None, :] * pi[:, None] + lam[:, None] * r[None, :] + ds[None, :])
    tl.store(dw_ptr + offs, dw.to(dw_ptr.dtype.element_ty), mask=inside)


def _meta(w: Tensor, mask: Optional[Tensor], block: int) -> dict:
    return dict(HAS_MASK=mask is not None, BLOCK=block, BLOCK_P=block_p(w.shape[-1]), ACC=tl_acc(w.dtype))


# ------------------------------------------------------------------------------ custom ops


@torch.library.custom_op("whiteformer::tssa_triton_fwd", mutates_args=())
def _fwd(w: Tensor, temp: Tensor, mask: Optional[Tensor], block: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    b, h, n, p = w.shape
    acc, nb = acc_dtype(w.dtype), triton.cdiv(n, block)
    meta, m8 = _meta(w, mask, block), mask_u8(mask, w)
    part = w.new_empty(b, h, nb, p, dtype=acc)
    energy_partials[(b * h, nb)](w, m8, part, h, n, p, nb, **meta)
    s = part.sum(2)
    r = s.clamp_min(_tiles.NORM_EPS_SQ).reciprocal()
    pi = w.new_empty(b, h, n, dtype=acc)
    m_part = w.new_empty(b, h, nb, dtype=acc)
    _pi[(b, nb)](w, m8, r, temp, pi, part, m_part, h, n, p, nb, **meta)
    t, m = part.sum(2), m_part.sum(2)
    out = torch.empty_like(w)
    _out[(b * h, nb)](w, m8, pi, t, m, out, h, n, p, PI_EPS, **meta)
    return out, pi, s, t, m


@_fwd.register_fake
def _(w, temp, mask, block):
    b, h, n, p = w.shape
    acc = acc_dtype(w.dtype)
    return (torch.empty_like(w), w.new_empty(b, h, n, dtype=acc), w.new_empty(b, h, p, dtype=acc),
            w.new_empty(b, h, p, dtype=acc), w.new_empty(b, h, dtype=acc))


@torch.library.custom_op("whiteformer::tssa_triton_bwd", mutates_args=())
def _bwd(grad_out: Tensor, grad_pi: Optional[Tensor], w: Tensor, temp: Tensor, mask: Optional[Tensor],
         pi: Tensor, s: Tensor, t: Tensor, m: Tensor, block: int) -> Tuple[Tensor, Tensor]:
    b, h, n, p = w.shape
    acc, nb = acc_dtype(w.dtype), triton.cdiv(n, block)
    meta, m8 = _meta(w, mask, block), mask_u8(mask, w)
    c = (m + PI_EPS).reciprocal()  # (B, H)
    d = c[..., None] * t
    gain = (1.0 + d).reciprocal()  # (B, H, p)
    part = w.new_empty(b, h, nb, p, dtype=acc)
    _bwd_q[(b * h, nb)](w, m8, pi, grad_out, part, h, n, p, nb, **meta)
    cd = c[..., None] * gain * gain * part.sum(2)  # c D
    k = (cd * d).sum(-1).contiguous()  # K = c sum_j D_j d_j
    r = s.clamp_min(_tiles.NORM_EPS_SQ).reciprocal()
    lam = w.new_empty(b, h, n, dtype=acc)
    big_r = w.new_empty(b, h, n, dtype=acc)
    dtemp_part = w.new_empty(b, nb, h, dtype=acc)
    gpi = grad_pi if grad_pi is not None else lam
    _bwd_lambda[(b, nb)](w, m8, pi, grad_out, gpi, gain, cd, k, r, temp, lam, big_r, dtemp_part, part,
                         h, n, p, nb, HAS_GPI=grad_pi is not None, **meta)
    ds = torch.where(s > _tiles.NORM_EPS_SQ, -r * r * part.sum(2), 0.0)
    dw = torch.empty_like(w)
    _bwd_dw[(b * h, nb)](w, m8, pi, grad_out, gain, cd, r, ds, lam, dw, h, n, p, **meta)
    return dw, dtemp_part.sum((0, 1))


@_bwd.register_fake
def _(grad_out, grad_pi, w, temp, mask, pi, s, t, m, block):
    return torch.empty_like(w), w.new_empty(w.shape[1], dtype=acc_dtype(w.dtype))


def _setup(ctx, inputs, output):
    w, temp, mask, block = inputs
    _, pi, s, t, m = output
    ctx.block = block
    ctx.save_for_backward(w, temp, mask, pi, s, t, m)


def _backward(ctx, g_out, g_pi, *_):
    w, temp, mask, pi, s, t, m = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph: differentiable recomputation in PyTorch
        from ...tssa.parallel import tssa_parallel
        from ..fused import _double_backward

        dw, dtemp = _double_backward(tssa_parallel(w, temp, mask), (w, temp), (g_out, g_pi))
        return dw, dtemp, None, None
    g_out = torch.zeros_like(w) if g_out is None else g_out.contiguous()
    g_pi = None if g_pi is None else g_pi.contiguous()
    dw, dtemp = _bwd(g_out, g_pi, w, temp, mask, pi, s, t, m, ctx.block)
    return dw, dtemp.view_as(temp), None, None


_fwd.register_autograd(_backward, setup_context=_setup)


def tssa_triton(w: Tensor, temp: Tensor, attn_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """TSSA through the Triton kernels (no dropout): w (B, H, N, p) float16/bfloat16/float32/
    float64, temp (H, 1), attn_mask (B, N) bool or None -> (out (B, H, N, p) in w's dtype,
    pi (B, H, N) in w's dtype). Inputs are assumed validated (see :func:`whiteformer.ops.tssa`)."""
    w = w.contiguous()
    temp_acc = temp.to(acc_dtype(w.dtype)).contiguous()
    out, pi, _, _, _ = _fwd(w, temp_acc, None if attn_mask is None else attn_mask.contiguous(), _tiles.BLOCK_N)
    return out, pi.to(w.dtype)
