"""Synthetic union-of-subspaces data of the ECA toy experiment (ECA paper, Sec. 4.1).

K mutually orthogonal subspaces of R^d with orthonormal bases U_k (d x p) (the K p columns of one
QR factorisation of a Gaussian matrix, so the subspaces are orthogonal); a sample of class k is
``z = U_k a`` where only the first ``active`` entries of ``a`` are non-zero, ``a_active ~ N(0, I)``,
plus optional isotropic noise; sample i belongs to subspace ``i mod K`` (balanced classes). The
bases depend on ``seed`` only (shared by the splits); the train and test samples use different
streams. The paper's toy uses d = 384, K = 6, p = 64, active = 20; the defaults here are small
(d = 64 so that ``layout="image"`` gives 8 x 8 one-channel "images" a vision model can classify).

``layout``: "vector" (N, d) or "image" (N, 1, s, s) with s^2 = d.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .base import ArrayDataset
from .registry import check_split, register_dataset

__all__ = ["subspace_bases", "sample_subspaces", "subspaces"]


def subspace_bases(dim: int, num_subspaces: int, subspace_dim: int, seed: int = 0,
                   dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Orthonormal bases U (K, d, p) of K mutually orthogonal p-dim subspaces of R^d."""
    if num_subspaces * subspace_dim > dim:
        raise ValueError(f"num_subspaces * subspace_dim ({num_subspaces} * {subspace_dim}) must be <= dim ({dim}) "
                         "for mutually orthogonal subspaces")
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(dim, num_subspaces * subspace_dim, generator=g, dtype=torch.float64))
    return q.T.reshape(num_subspaces, subspace_dim, dim).transpose(1, 2).to(dtype).contiguous()


def sample_subspaces(bases: torch.Tensor, n: int, active: int, noise_std: float = 0.0,
                     seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """n samples (n, d) and labels (n,): sample i in subspace i mod K, ``z = U_k a``."""
    k, d, p = bases.shape
    if not 1 <= active <= p:
        raise ValueError(f"active must be in [1, subspace_dim={p}], got {active!r}")
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % k
    a = torch.zeros(n, p, dtype=bases.dtype)
    a[:, :active] = torch.randn(n, active, generator=g, dtype=torch.float64).to(bases.dtype)
    z = torch.einsum("ndp,np->nd", bases[labels], a)
    if noise_std > 0:
        z = z + noise_std * torch.randn(n, d, generator=g, dtype=torch.float64).to(bases.dtype)
    return z, labels


@register_dataset("subspaces", help="synthetic union of K orthogonal subspaces (ECA toy data), class = subspace")
def subspaces(split: str = "train", dim: int = 64, num_subspaces: int = 4, subspace_dim: int = 16,
              active: Optional[int] = None, num_train: int = 2000, num_test: int = 500, noise_std: float = 0.0,
              seed: int = 0, layout: str = "image") -> ArrayDataset:
    """Union-of-subspaces classification data for ``split`` ("train" / "test"; "val" = "test")."""
    split = check_split("subspaces", split)
    if layout not in ("image", "vector"):
        raise ValueError(f"layout must be 'image' or 'vector', got {layout!r}")
    side = int(round(math.sqrt(dim)))
    if layout == "image" and side * side != dim:
        raise ValueError(f"layout='image' needs dim to be a perfect square, got dim={dim}; use layout='vector'")
    bases = subspace_bases(dim, num_subspaces, subspace_dim, seed)
    n = num_train if split == "train" else num_test
    if n <= 0:
        raise ValueError(f"num_{split} must be a positive integer, got {n!r}")
    z, y = sample_subspaces(bases, n, active or subspace_dim, noise_std, seed=seed * 2 + 1 + (split == "test"))
    # Scale so that each coordinate has unit variance on average (E|z|^2 = active).
    z = (z * math.sqrt(dim / (active or subspace_dim))).float()
    data = z.reshape(n, 1, side, side) if layout == "image" else z
    ds = ArrayDataset(data, y, num_subspaces, kind=layout, name=f"subspaces/{split}")
    ds.bases = bases.float()
    return ds
