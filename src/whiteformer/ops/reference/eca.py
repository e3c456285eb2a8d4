"""Reference ECAttention operators (ECAttention paper, Eqs. 4-8, Algorithms 1, 2 and 4), written for
clarity: one sequence and one head at a time, explicit projection matrices I - Q Q^T.

Padding is handled literally: each sequence is cut to its real tokens (in order) and processed
alone with the first n rows of omega. No QR fallback: a failing Cholesky raises.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

__all__ = ["orthonormal_basis_reference", "eca_expand_reference", "eca_compress_reference"]


def orthonormal_basis_reference(Y: torch.Tensor, eps: float = 1e-2) -> torch.Tensor:
    """Algorithm 4: Y (m, r) (or batched) -> Q = Yn L^{-T} with L = chol(Yn^T Yn + eps I)."""
    Yn = F.normalize(Y, p=2.0, dim=-2)
    eye = torch.eye(Y.shape[-1], dtype=Y.dtype, device=Y.device)
    G = Yn.transpose(-1, -2) @ Yn + eps * eye
    L = torch.linalg.cholesky(G)
    C = torch.linalg.solve_triangular(L.transpose(-1, -2), eye, upper=True)  # L^T C = I
    return Yn @ C


def _real_tokens(x: torch.Tensor, attn_mask: Optional[torch.Tensor], b: int) -> torch.Tensor:
    """Indices of the real tokens of sequence b (all tokens without a mask)."""
    if attn_mask is None:
        return torch.arange(x.shape[1], device=x.device)
    return torch.nonzero(attn_mask[b], as_tuple=False).flatten()


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dt = torch.float32
    for t in tensors:
        if t.dtype == torch.float64:
            dt = torch.float64
    return dt


def eca_expand_reference(
    x: torch.Tensor, omega: torch.Tensor, eps: float = 1e-2, attn_mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Eq. 5 / Algorithm 1: out_n = (I - Q Q^T) z_n, Q = basis(Z Omega); x (B, N, C), omega (N, R)."""
    dt = _compute_dtype(x)
    xs, om = x.to(dt), omega.to(dt)
    out = torch.zeros_like(xs)
    C = x.shape[-1]
    for b in range(x.shape[0]):
        idx = _real_tokens(x, attn_mask, b)
        if idx.numel() == 0:
            continue
        Z = xs[b, idx].T  # (C, n)
        Q = orthonormal_basis_reference(Z @ om[: idx.numel()], eps)  # (C, R)
        P_null = torch.eye(C, dtype=dt, device=x.device) - Q @ Q.T
        out[b, idx] = (P_null @ Z).T
    return out.to(x.dtype)


def eca_compress_reference(
    x: torch.Tensor,
    U: torch.Tensor,
    omega: torch.Tensor,
    temperature: Union[torch.Tensor, float],
    num_heads: int,
    eps: float = 1e-2,
    attn_mask: Optional[torch.Tensor] = None,
    return_pi: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Eqs. 6-8 / Algorithm 2 with Eq. 7 memberships:
    out_n = sum_k pi_kn U_k (I - Q_k Q_k^T) U_k^T z_n,
    pi_n = softmax_k(||Q_k Q_k^T U_k^T z_n||^2 / (2 temperature)), Q_k = basis(U_k^T Z Omega).
    x (B, N, C), U (C, H*p), omega (N, r), temperature scalar or (H,). pi (B, H, N), 0 at padding."""
    dt = _compute_dtype(x, U)
    xs, Us, om = x.to(dt), U.to(dt), omega.to(dt)
    temp = torch.as_tensor(temperature, dtype=dt, device=x.device).reshape(-1)
    temp = temp.expand(num_heads) if temp.numel() == 1 else temp
    B, N, C = x.shape
    p = U.shape[1] // num_heads
    out = torch.zeros(B, N, C, dtype=dt, device=x.device)
    pi_all = torch.zeros(B, num_heads, N, dtype=dt, device=x.device)
    for b in range(B):
        idx = _real_tokens(x, attn_mask, b)
        n = idx.numel()
        if n == 0:
            continue
        Z = xs[b, idx].T  # (C, n)
        nulls, logits = [], []
        for k in range(num_heads):
            U_k = Us[:, k * p:(k + 1) * p]  # (C, p)
            A_k = U_k.T @ Z  # codes (p, n)
            Q_k = orthonormal_basis_reference(A_k @ om[:n], eps)  # (p, r)
            P_col = Q_k @ Q_k.T
            col = P_col @ A_k
            nulls.append(U_k @ (A_k - col))  # U_k (I - Q_k Q_k^T) a_k, (C, n)
            logits.append((col**2).sum(dim=0) / (2.0 * temp[k]))  # (n,)
        pi = torch.softmax(torch.stack(logits), dim=0)  # over heads, (H, n)
        out[b, idx] = sum(pi[k] * nulls[k] for k in range(num_heads)).T
        pi_all[b][:, idx] = pi
    out = out.to(x.dtype)
    return (out, pi_all.to(x.dtype)) if return_pi else out
