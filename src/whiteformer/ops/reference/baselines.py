"""Plain references for the baseline attentions (oracle for :mod:`whiteformer.ops.baselines`).

Each formula is written out with explicit matmuls, one sequence at a time. A (B, N) keep-mask is
handled in the most literal way: the real tokens of each sequence are selected, the formula is
applied to them alone, and the result is scattered back into zeros. Half inputs are computed in
float32 and cast back.
"""
from __future__ import annotations

import torch

__all__ = ["mhsa_reference", "xca_reference", "mssa_reference", "class_attention_reference"]


def _real_tokens(attn_mask, batch: int, n: int, device) -> list:
    """Indices of the real tokens of each sequence."""
    if attn_mask is None:
        return [torch.arange(n, device=device) for _ in range(batch)]
    return [attn_mask[b].nonzero().flatten() for b in range(batch)]


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    e = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


def mhsa_reference(q, k, v, attn_mask=None, causal=False, scale=None):
    """out = softmax(q k^T * scale [+ causal -inf above the diagonal]) v; q, k, v (B, H, N, p)."""
    B, H, N, p = q.shape
    scale = p ** -0.5 if scale is None else scale
    dt = _work_dtype(q)
    out = torch.zeros(B, H, N, p, dtype=dt, device=q.device)
    for b, idx in enumerate(_real_tokens(attn_mask, B, N, q.device)):
        n = idx.numel()
        if n == 0:
            continue
        qb, kb, vb = q[b][:, idx].to(dt), k[b][:, idx].to(dt), v[b][:, idx].to(dt)  # (H, n, p)
        logits = qb @ kb.transpose(-1, -2) * scale
        if causal:
            future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
            logits = logits.masked_fill(future, float("-inf"))
        out[b][:, idx] = _softmax(logits) @ vb
    return out.to(q.dtype)


def mssa_reference(w, attn_mask=None, scale=None):
    """CRATE MSSA: out = softmax(w w^T * scale) w, scale = p^-1/2; w (B, H, N, p)."""
    B, H, N, p = w.shape
    scale = p ** -0.5 if scale is None else scale
    dt = _work_dtype(w)
    out = torch.zeros(B, H, N, p, dtype=dt, device=w.device)
    for b, idx in enumerate(_real_tokens(attn_mask, B, N, w.device)):
        if idx.numel() == 0:
            continue
        wb = w[b][:, idx].to(dt)
        out[b][:, idx] = _softmax(wb @ wb.transpose(-1, -2) * scale) @ wb
    return out.to(w.dtype)


def xca_reference(q, k, v, temperature, attn_mask=None, eps=1e-12):
    """XCiT XCA per head: q_hat = q / max(||q||_tokens, eps) (column-wise over the N tokens), same for k;
    A = softmax(q_hat^T k_hat * t_h) (p x p); out = (A v^T)^T; q, k, v (B, H, N, p), temperature (H, 1, 1)."""
    B, H, N, p = q.shape
    dt = _work_dtype(q)
    t = torch.as_tensor(temperature, device=q.device).to(dt).reshape(-1)
    t = t.expand(H) if t.numel() == 1 else t
    out = torch.zeros(B, H, N, p, dtype=dt, device=q.device)
    for b, idx in enumerate(_real_tokens(attn_mask, B, N, q.device)):
        if idx.numel() == 0:
            continue
        for h in range(H):
            Q, K, V = q[b, h][idx].to(dt), k[b, h][idx].to(dt), v[b, h][idx].to(dt)  # (n, p)
            Qh = Q / Q.norm(dim=0, keepdim=True).clamp_min(eps)
            Kh = K / K.norm(dim=0, keepdim=True).clamp_min(eps)
            A = _softmax(Qh.T @ Kh * t[h])  # (p, p)
            out[b, h, idx] = (A @ V.T).T
    return out.to(q.dtype)


def class_attention_reference(q_cls, k, v, attn_mask=None, scale=None):
    """CaiT class attention: out_cls = softmax(q_cls k^T * scale) v over all tokens;
    q_cls (B, H, 1, p), k, v (B, H, N, p) -> (B, H, 1, p); zero if the class token is padded."""
    B, H, N, p = k.shape
    scale = p ** -0.5 if scale is None else scale
    dt = _work_dtype(k)
    out = torch.zeros(B, H, 1, p, dtype=dt, device=k.device)
    for b, idx in enumerate(_real_tokens(attn_mask, B, N, k.device)):
        if attn_mask is not None and not bool(attn_mask[b, 0]):
            continue
        kb, vb = k[b][:, idx].to(dt), v[b][:, idx].to(dt)
        out[b] = _softmax(q_cls[b].to(dt) @ kb.transpose(-1, -2) * scale) @ vb
    return out.to(k.dtype)
