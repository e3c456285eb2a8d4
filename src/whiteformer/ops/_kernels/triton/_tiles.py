"""Tile helpers shared by the Triton TSSA kernels, and the host-side launch settings.

Tensors are contiguous: ``w`` (B, H, N, p) row-major, per-token statistics (B, H, N), per-feature
statistics (B, H, p), the keep-mask (B, N) as uint8. ``bh = b * H + h`` indexes a sequence-head.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...constants import NORM_EPS

# tokens per program (non-causal) and per chunk (causal); tests set tiny values to cross boundaries
BLOCK_N = 64
CHUNK = 64

NORM_EPS_SQ = NORM_EPS * NORM_EPS  # clamp on the per-feature token energy (F.normalize semantics)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics dtype: float32 for float16/bfloat16/float32 inputs, float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tl_acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def block_p(p: int) -> int:
    return triton.next_power_of_2(p)


def mask_u8(mask, w: torch.Tensor) -> torch.Tensor:
    """The (B, N) keep-mask as uint8 (a 1-element dummy when there is none)."""
    if mask is None:
        return w.new_empty(1, dtype=torch.uint8)
    return mask.contiguous().view(torch.uint8)


def kernels_interpreted() -> bool:
    """Whether the kernels, and Triton's own library (``tl.sum``, ``tl.cumsum``: decorated when
    ``triton`` was imported), run in Triton's interpreter (``TRITON_INTERPRET=1`` at both imports)."""
    return not any(isinstance(f, triton.runtime.JITFunction) for f in (tile_offsets, tl.standard.sum))


@triton.jit
def tile_offsets(bh, start, N, P, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr):
    """Token indices (BLOCK,), element offsets (BLOCK, BLOCK_P) into a (B*H, N, P) tensor, and
    the in-range mask of the tile."""
    offs_n = start + tl.arange(0, BLOCK)
    offs_p = tl.arange(0, BLOCK_P)
    inside = (offs_n[:, None] < N) & (offs_p[None, :] < P)
    offs = (bh.to(tl.int64) * N + offs_n[:, None]) * P + offs_p[None, :]
    return offs_n, offs, inside


@triton.jit
def token_keep(mask_ptr, b, offs_n, N, HAS_MASK: tl.constexpr):
    """(BLOCK,) bool: token in range and kept by the (B, N) mask."""
    keep = offs_n < N
    if HAS_MASK:
        keep = keep & (tl.load(mask_ptr + b.to(tl.int64) * N + offs_n, mask=offs_n < N, other=0) != 0)
    return keep


@triton.jit
def load_tile(ptr, offs, inside, keep, ACC: tl.constexpr):
    """(BLOCK, BLOCK_P) tile in the statistics dtype, 0 outside the tensor and at padded tokens."""
    x = tl.load(ptr + offs, mask=inside, other=0.0).to(ACC)
    return tl.where(keep[:, None], x, 0.0)


@triton.jit
def w_block(x_ptr, mask_ptr, bh, H, blk, N, P, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
            BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    """Block ``blk`` of BLOCK tokens of sequence-head ``bh``: token indices, element offsets, the
    in-range mask, the kept tokens and the w tile (0 at padded tokens) in the statistics dtype."""
    offs_n, offs, inside = tile_offsets(bh, blk * BLOCK, N, P, BLOCK, BLOCK_P)
    keep = token_keep(mask_ptr, bh // H, offs_n, N, HAS_MASK)
    return offs_n, offs, inside, keep, load_tile(x_ptr, offs, inside, keep, ACC)


@triton.jit
def tok(ptr, bh, offs_n, N):
    """Per-token values (BLOCK,) of a (B*H, N) tensor, 0 past the end."""
    return tl.load(ptr + bh.to(tl.int64) * N + offs_n, mask=offs_n < N, other=0.0)


@triton.jit
def row(ptr, bh, blk, NB, P, BLOCK_P: tl.constexpr):
    """Row (BLOCK_P,) ``blk`` of a (B*H, NB, P) tensor of per-block values, 0 past P."""
    offs_p = tl.arange(0, BLOCK_P)
    return tl.load(ptr + (bh.to(tl.int64) * NB + blk) * P + offs_p, mask=offs_p < P, other=0.0)


@triton.jit
def put_tok(ptr, bh, offs_n, N, value):
    """Store per-token values (BLOCK,) into a (B*H, N) tensor."""
    tl.store(ptr + bh.to(tl.int64) * N + offs_n, value, mask=offs_n < N)


@triton.jit
def put_row(ptr, bh, blk, NB, P, value, BLOCK_P: tl.constexpr):
    """Store a row (BLOCK_P,) as row ``blk`` of a (B*H, NB, P) tensor of per-block values."""
    offs_p = tl.arange(0, BLOCK_P)
    tl.store(ptr + (bh.to(tl.int64) * NB + blk) * P + offs_p, value, mask=offs_p < P)


@triton.jit
def energy_partials(x_ptr, mask_ptr, part_ptr, H, N, P, NB,
                    HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    """Grid (B*H, NB): per-block totals sum_n w_n^2 over kept tokens into part (B*H, NB, P)."""
    bh, nb = tl.program_id(0), tl.program_id(1)
    offs_n, offs, inside, keep, x = w_block(x_ptr, mask_ptr, bh, H, nb, N, P, HAS_MASK, BLOCK, BLOCK_P, ACC)
    put_row(part_ptr, bh, nb, NB, P, tl.sum(x * x, axis=0), BLOCK_P)
