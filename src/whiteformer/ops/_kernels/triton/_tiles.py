"""Tile choice and the tile helpers shared by the Triton TSSA kernels.

Layout: tensors are contiguous: ``w`` (B, H, N, p) row-major, per-token values (B, H, N),
per-feature values (B, H, p), per-chunk values (B, H, NC, p) or (B, H, NC), the keep-mask (B, N)
as uint8, the scales per head (B, H, 3) or per head and feature (B, H, 3, p) (:mod:`._scaling`).
``bh = b * H + h`` indexes a sequence-head.

**Programs and tiles (one rule, :func:`tiles`).** Every sequence kernel runs a grid (B, NC): one
program per sequence ``b`` and chunk of ``CHUNK`` tokens, holding **all heads** (the softmax over
heads needs them together, so each pass reads ``w`` once). A program walks its chunk in
sub-blocks of ``BLOCK_N`` tokens; each step holds (BLOCK_H, BLOCK_N, BLOCK_P) tiles
(BLOCK_H, BLOCK_P: the head count and head dim rounded up to powers of two). The budget:

- ``TILE_ELEMS`` 32-bit values per tile (float64 values count twice):
  ``BLOCK_N = TILE_ELEMS / (BLOCK_H * BLOCK_P)`` rounded down to a power of two, within
  [1, ``BLOCK_N_MAX``] and at most ``CHUNK``;
- ``THREAD_ELEMS`` values of a tile per thread: ``num_warps = tile / (32 * THREAD_ELEMS)`` within
  [``MIN_WARPS``, ``MAX_WARPS``]. A tile larger than the budget (H * p > TILE_ELEMS at BLOCK_N = 1,
  e.g. 32 heads of 128) holds more values per thread at 8 warps: 16 warps would cap a thread at
  128 registers (65536 per SM), where the causal backward spilled;
- the kernels with no softmax over heads that hold the most registers (the causal ``_bwd_dw``) run
  in head groups of ``head_group`` heads, half the budget's tile at the same warps (half the values
  per thread: ``group_meta``, grid (B, NC, groups), :func:`group_program`); where the heads cannot
  halve the tile (one head) these kernels walk sub-blocks of ``group_block_n`` tokens instead;
- ``num_stages = 1``: the kernels stream each tile once, so software pipelining would only
  add live registers (Triton pipelines loads of loops with num_stages > 1);
- ``maxnreg``: up to 255 registers per thread (65536 / threads where that is lower): without it
  ptxas capped some kernels at 128 registers and spilled (the causal backward at head dim 32).

The kernels hold about six such tiles at once (w, dL/dout, w^2, prefix sums, ...), so
``THREAD_ELEMS`` values of each per thread keep them within the registers, with no stack frame;
the compile test (tests/ops/test_triton_compile.py, and ``make triton-matrix`` on every supported
Triton) checks every launched specialisation for sm_80 and sm_90. The head
dim is never split: at head dim 256 a token row of 8 heads is 2048 values, one sub-block of one
token. Tests set tiny ``CHUNK`` and ``BLOCK_N_MAX`` to cross sub-block and chunk boundaries.

Reductions over tokens are per chunk (in registers, in token order) and then over chunks on the
host (``torch`` sums and cumulative sums in a fixed order): results are deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch
import triton
import triton.language as tl

from ...constants import NORM_EPS
from ._compat import div

TILE_ELEMS = 2048  # 32-bit values in one (BLOCK_H, BLOCK_N, BLOCK_P) tile
THREAD_ELEMS = 8  # values of one tile per thread
MIN_WARPS, MAX_WARPS = 2, 8
BLOCK_N_MAX = 64
CHUNK = 256  # tokens per program: per-chunk statistics are 1/CHUNK of w's size

NORM_EPS_SQ = NORM_EPS * NORM_EPS  # clamp on the per-feature token energy (F.normalize semantics)


@dataclass(frozen=True)
class Tiles:
    """Launch shape of the sequence kernels for one (heads, head dim, dtype)."""

    block_h: int
    block_n: int
    block_p: int
    chunk: int
    num_warps: int
    num_stages: int = 1
    head_group: int = 0  # heads per program of the head-group kernels (0: block_h)
    group_block_n: int = 0  # tokens per sub-block of the head-group kernels (0: block_n)

    def meta(self) -> dict:
        """Constexprs and launch options common to the kernels."""
        return dict(BLOCK_H=self.block_h, BLOCK_N=self.block_n, BLOCK_P=self.block_p, **options(self.num_warps))

    def group_meta(self, heads: int) -> Tuple[int, dict]:
        """(head groups, constexprs and options) of a kernel run in head groups (grid (B, NC, groups))."""
        group, block_n = self.head_group or self.block_h, self.group_block_n or self.block_n
        if (group, block_n) == (self.block_h, self.block_n):
            return 1, self.meta()
        return -(-heads // group), dict(self.meta(), BLOCK_H=group, BLOCK_N=block_n)


def options(num_warps: int) -> dict:
    """Launch options for ``num_warps`` (see the module docstring)."""
    return dict(num_warps=num_warps, num_stages=1, maxnreg=min(255, 65536 // (32 * num_warps)))


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def warps_for(elements: int) -> int:
    """Warps for a tile of ``elements`` 32-bit values (THREAD_ELEMS per thread)."""
    return max(MIN_WARPS, min(MAX_WARPS, _pow2_floor(elements // (32 * THREAD_ELEMS))))


def tiles(heads: int, head_dim: int, dtype: torch.dtype) -> Tiles:
    """The tile rule of the module docstring."""
    block_h, block_p = triton.next_power_of_2(heads), triton.next_power_of_2(head_dim)
    words = 2 if dtype == torch.float64 else 1
    block_n = min(_pow2_floor(TILE_ELEMS // (block_h * block_p * words)), BLOCK_N_MAX, CHUNK)
    chunk = max(CHUNK, block_n)
    group = min(block_h, _pow2_floor(TILE_ELEMS // (2 * block_n * block_p * words)))
    group_n = min(block_n, _pow2_floor(TILE_ELEMS // (2 * group * block_p * words)))  # < block_n: one head
    return Tiles(block_h, block_n, block_p, chunk, warps_for(block_h * block_n * block_p * words), head_group=group,
                 group_block_n=group_n)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics dtype: float32 for float16/bfloat16/float32 inputs, float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tl_acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def mask_u8(mask, w: torch.Tensor) -> torch.Tensor:
    """The (B, N) keep-mask as uint8 (a 1-element dummy when there is none)."""
    if mask is None:
        return w.new_empty(1, dtype=torch.uint8)
    return mask.contiguous().view(torch.uint8)


def kernels_interpreted() -> bool:
    """Whether the kernels, and Triton's own library (``tl.sum``, ``tl.cumsum``: decorated when
    ``triton`` was imported), run in Triton's interpreter (``TRITON_INTERPRET=1`` at both imports)."""
    return not any(isinstance(f, triton.runtime.JITFunction) for f in (heads_of, tl.standard.sum))


@triton.jit
def heads_of(b, H, P, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    """Sequence-head indices ``bh`` (BLOCK_H,) int64 of sequence b, the real heads (BLOCK_H,)
    and the real (head, feature) pairs (BLOCK_H, BLOCK_P)."""
    offs_h = tl.arange(0, BLOCK_H)
    in_h = offs_h < H
    return b.to(tl.int64) * H + offs_h, in_h, in_h[:, None] & (tl.arange(0, BLOCK_P)[None, :] < P)


@triton.jit
def chunk_program(H, N, P, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    """A sequence kernel's program (grid (B, NC)): its sequence b and chunk c, :func:`heads_of` b,
    and the chunk's tokens [lo, hi) (walked in sub-blocks: ``for start in range(lo, hi, BLOCK_N)``)."""
    b, c = tl.program_id(0), tl.program_id(1)
    bh, in_h, in_hp = heads_of(b, H, P, BLOCK_H, BLOCK_P)
    return b, c, bh, in_h, in_hp, c * CHUNK, tl.minimum(N, (c + 1) * CHUNK)


@triton.jit
def group_program(H, N, P, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    """:func:`chunk_program` of a kernel run in head groups (grid (B, NC, groups): no softmax over
    heads): group g holds heads [g * BLOCK_H, (g + 1) * BLOCK_H)."""
    b, c, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_h = g * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = offs_h < H
    in_hp = in_h[:, None] & (tl.arange(0, BLOCK_P)[None, :] < P)
    return b, c, b.to(tl.int64) * H + offs_h, in_h, in_hp, c * CHUNK, tl.minimum(N, (c + 1) * CHUNK)


@triton.jit
def rows(ptr, bh, idx, NI, P, in_hp, BLOCK_P: tl.constexpr):
    """Row ``idx`` of every head of a (B*H, NI, P) tensor: (BLOCK_H, BLOCK_P), 0 outside."""
    offs = (bh * NI + idx)[:, None] * P + tl.arange(0, BLOCK_P)[None, :]
    return tl.load(ptr + offs, mask=in_hp, other=0.0)


@triton.jit
def put_rows(ptr, bh, idx, NI, P, in_hp, value, BLOCK_P: tl.constexpr):
    """Store (BLOCK_H, BLOCK_P) as row ``idx`` of every head of a (B*H, NI, P) tensor."""
    offs = (bh * NI + idx)[:, None] * P + tl.arange(0, BLOCK_P)[None, :]
    tl.store(ptr + offs, value, mask=in_hp)


@triton.jit
def per_head(ptr, bh, idx, NI, in_h):
    """Entry ``idx`` of every head of a (B*H, NI) tensor: (BLOCK_H,), 0 outside."""
    return tl.load(ptr + bh * NI + idx, mask=in_h, other=0.0)


@triton.jit
def head_scales(scl_ptr, bh, in_h):
    """The per-head ``1 / c``, ``c`` (exact powers of two) and clamp ``eps`` in units of c
    (BLOCK_H,) of a (B*H, 3) tensor (see :mod:`._scaling`; 1 outside the real heads, so that
    padded heads stay finite)."""
    return (tl.load(scl_ptr + 3 * bh, mask=in_h, other=1.0), tl.load(scl_ptr + 3 * bh + 1, mask=in_h, other=1.0),
            tl.load(scl_ptr + 3 * bh + 2, mask=in_h, other=1.0))


@triton.jit
def feature_scales(scl_ptr, bh, in_hp, P, BLOCK_P: tl.constexpr):
    """The per-feature ``1 / c``, ``c`` (exact powers of two) and clamp ``eps`` in units of c^2
    (BLOCK_H, BLOCK_P) of a (B*H, 3, P) tensor (see :mod:`._scaling`; 1 outside the real heads
    and features, so that padded ones stay finite), loaded once per program."""
    offs = (bh * 3)[:, None] * P + tl.arange(0, BLOCK_P)[None, :]
    return (tl.load(scl_ptr + offs, mask=in_hp, other=1.0), tl.load(scl_ptr + offs + P, mask=in_hp, other=1.0),
            tl.load(scl_ptr + offs + 2 * P, mask=in_hp, other=1.0))


@triton.jit
def sub_block(x_ptr, mask_ptr, b, bh, in_h, inv_c, start, N, P, has_mask, BLOCK_N: tl.constexpr,
              BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    """Sub-block of BLOCK_N tokens from ``start`` for every head: per-token offsets into
    (B*H, N) tensors (BLOCK_H, BLOCK_N), their in-range mask, element offsets into (B*H, N, P)
    tensors and their in-range mask (BLOCK_H, BLOCK_N, BLOCK_P), the kept tokens (BLOCK_N,), and
    the tile x = w / c (BLOCK_H, BLOCK_N, BLOCK_P) in the statistics dtype (``inv_c``: 1 / c, powers
    of two, per head (BLOCK_H,) or per head and feature (BLOCK_H, BLOCK_P)), 0 outside and at
    padded tokens."""
    offs_n = start + tl.arange(0, BLOCK_N)
    in_n = offs_n < N
    tok = bh[:, None] * N + offs_n[None, :]
    in_tok = in_h[:, None] & in_n[None, :]
    offs_p = tl.arange(0, BLOCK_P)
    offs = tok[:, :, None] * P + offs_p[None, None, :]
    inside = in_tok[:, :, None] & (offs_p < P)[None, None, :]
    keep = in_n
    if has_mask:
        keep = keep & (tl.load(mask_ptr + b.to(tl.int64) * N + offs_n, mask=in_n, other=0) != 0)
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(ACC)
    if len(inv_c.shape) == 1:
        x = x * inv_c[:, None, None]
    else:
        x = x * inv_c[:, None, :]
    return tok, in_tok, offs, inside, keep, tl.where(keep[None, :, None], x, 0.0)


@triton.jit
def load_go_pi(go_ptr, pi_ptr, tok, in_tok, offs, inside, ACC: tl.constexpr):
    """The backward passes' per-sub-block inputs: dL/dout (BLOCK_H, BLOCK_N, BLOCK_P) in the
    statistics dtype and Pi (BLOCK_H, BLOCK_N), 0 outside."""
    return tl.load(go_ptr + offs, mask=inside, other=0.0).to(ACC), tl.load(pi_ptr + tok, mask=in_tok, other=0.0)


@triton.jit
def add_pi_sums(q, m, pi, x2):
    """Running sums after a sub-block: q + sum_n Pi_n w_n^2 (BLOCK_H, BLOCK_P), m + sum_n Pi_n (BLOCK_H,)."""
    return q + tl.sum(pi[:, :, None] * x2, axis=1), m + tl.sum(pi, axis=1)


@triton.jit
def softmax_heads(logit, in_h):
    """Softmax over the heads (axis 0) of (BLOCK_H, BLOCK_N) logits, padded heads excluded."""
    logit = tl.where(in_h[:, None], logit, float("-inf"))
    e = tl.exp(logit - tl.max(logit, axis=0)[None, :])
    return div(e, tl.sum(e, axis=0)[None, :])


@triton.jit
def chunk_energy(x_ptr, mask_ptr, part_ptr, amax_ptr, H, N, P, NC,
                 has_mask, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    """Grid (B, NC): per-chunk totals sum_n w_n^2 over kept tokens into part (B, H, NC, P), in
    float64 (no float32 / bfloat16 value overflows there: the host divides them by the scale c^2,
    :mod:`._scaling`), and the chunk's largest |w| per head and feature into amax (B, H, NC, P):
    the scale costs no extra read of w."""
    b, c, bh, in_h, in_hp, lo, hi = chunk_program(H, N, P, CHUNK, BLOCK_H, BLOCK_P)
    one = tl.full([BLOCK_H], 1.0, ACC)
    acc = tl.zeros([BLOCK_H, BLOCK_P], tl.float64)
    top = tl.zeros([BLOCK_H, BLOCK_P], ACC)
    for start in range(lo, hi, BLOCK_N):
        tok, in_tok, offs, inside, keep, x = sub_block(x_ptr, mask_ptr, b, bh, in_h, one, start, N, P, has_mask,
                                                       BLOCK_N, BLOCK_P, ACC)
        x64 = x.to(tl.float64)
        acc += tl.sum(x64 * x64, axis=1)
        top = tl.maximum(top, tl.max(tl.abs(x), axis=1))
    put_rows(part_ptr, bh, c, NC, P, in_hp, acc, BLOCK_P)
    put_rows(amax_ptr, bh, c, NC, P, in_hp, top, BLOCK_P)
