"""Cross-entropy of a linear head, computed chunk by chunk so the (M, V) logits never exist whole.

``loss = mean_{i: t_i != ignore} [ logsumexp_v(h_i . W_v) - h_i . W_{t_i} ]`` for hidden states
``h`` (M, D), head weight ``W`` (V, D) and targets ``t`` (M,): the language-model loss
``cross_entropy(h @ W^T, t)`` (reference: :func:`whiteformer.ops.reference.linear_cross_entropy_reference`).

With a 50k vocabulary the logits of 8k tokens take 1.6 GB in float32, and autograd keeps them (and
a softmax of the same size) for the backward pass. Here the tokens are processed ``chunk_size`` at
a time and, when gradients are needed, each chunk's gradients are formed right away from its
softmax ``P`` (the gradient of the mean loss w.r.t. the logits is ``(P - onehot(t)) / n_valid``):

    dL/dh_c = G_c W,    dL/dW += G_c^T h_c,

so the peak extra memory is one (chunk, V) block plus the (V, D) weight gradient, and the work is
the same three matmuls as the plain path (no recomputation). Softmax statistics are in float32
(also under bf16/fp16 autocast, as the plain path's ``logits.float()``).
"""
from __future__ import annotations

import torch

from .._checks import check_int, check_same_device, check_tensor
from .._compile import can_read_values

__all__ = ["linear_cross_entropy"]


def _check(h, weight, targets, chunk_size: int, ignore_index: int) -> None:
    check_tensor(h, "h", 2)
    check_tensor(weight, "weight", 2)
    if weight.shape[1] != h.shape[1]:
        raise ValueError(f"weight must be a (V, {h.shape[1]}) tensor (D of h), got {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError(f"weight has no classes (V = 0, shape {tuple(weight.shape)})")
    if not isinstance(targets, torch.Tensor) or targets.shape != h.shape[:1]:
        raise ValueError(f"targets must be a ({h.shape[0]},) tensor of class ids, got "
                         f"{getattr(targets, 'shape', type(targets).__name__)}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor of class ids, got {targets.dtype}")
    check_same_device(h, "h", weight=weight, targets=targets)
    dev = h.device.type
    if weight.dtype != h.dtype and not (torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev)):
        raise TypeError(f"weight has dtype {weight.dtype} but h has {h.dtype}: cast one of them, or run under "
                        "torch.autocast")
    check_int(chunk_size, "chunk_size", 1)
    check_int(ignore_index, "ignore_index")
    if can_read_values() and dev != "meta" and targets.numel():
        counted = targets != ignore_index
        bad = counted & ((targets < 0) | (targets >= weight.shape[0]))
        if bool(bad.any()):
            first = int(targets[bad][0])
            raise ValueError(f"targets must be class ids in [0, V = {weight.shape[0]}) or ignore_index "
                             f"({ignore_index}), got {first}")


def _work_dtype(h: torch.Tensor) -> torch.dtype:
    """float32 for half / bfloat16 / float32 inputs, float64 for float64."""
    return torch.promote_types(h.dtype, torch.float32)


def _chunk_logits(hc: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (hc @ weight.T).to(_work_dtype(hc))


def _chunk_nll_sum(logits: torch.Tensor, tc: torch.Tensor, valid: torch.Tensor):
    """Sum of -log softmax(logits)[t] over the valid rows, and the log-sum-exp (rows,)."""
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, tc.clamp_min(0)[:, None])[:, 0]
    return torch.where(valid, lse - picked, torch.zeros_like(lse)).sum(), lse


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk_size: int, ignore_index: int):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        valid_all = targets != ignore_index
        n_valid = valid_all.sum()
        dt = _work_dtype(h)
        inv = 1.0 / n_valid.to(dt)
        total = torch.zeros((), dtype=dt, device=h.device)
        gh = torch.empty_like(h) if need_h else None
        gw = torch.zeros(weight.shape, dtype=dt, device=weight.device) if need_w else None
        rows = torch.arange(min(chunk_size, h.shape[0]), device=h.device)
        for s in range(0, h.shape[0], chunk_size):
            hc, tc, valid = h[s:s + chunk_size], targets[s:s + chunk_size], valid_all[s:s + chunk_size]
            logits = _chunk_logits(hc, weight)
            nll, lse = _chunk_nll_sum(logits, tc, valid)
            total = total + nll
            # dL/dlogits = (softmax - onehot(t)) / n_valid on valid rows, 0 on ignored ones (in place)
            g = logits.sub_(lse[:, None]).exp_()
            g[rows[:hc.shape[0]], tc.clamp_min(0)] -= 1.0
            g.mul_((valid.to(g.dtype) * inv)[:, None])
            if need_h:
                gh[s:s + chunk_size] = (g.to(weight.dtype) @ weight).to(h.dtype)
            if need_w:
                gw.addmm_(g.T, hc.to(dt))
        ctx.save_for_backward(gh, None if gw is None else gw.to(weight.dtype))
        return total * inv

    @staticmethod
    def backward(ctx, grad_out):
        gh, gw = ctx.saved_tensors
        return (None if gh is None else gh * grad_out.to(gh.dtype),
                None if gw is None else gw * grad_out.to(gw.dtype), None, None, None)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         chunk_size: int = 1024, ignore_index: int = -1) -> torch.Tensor:
    """Mean cross-entropy of the logits ``h @ weight^T`` against ``targets``, by chunks of rows.

    Args:
        h: (M, D) hidden states (e.g. the final hidden states of all B * T positions).
        weight: (V, D) head weight (``lm_head.weight``).
        targets: (M,) class ids; ``ignore_index`` entries do not count (the mean is over the rest;
            NaN when every entry is ignored, as ``F.cross_entropy``).
        chunk_size: rows per chunk: peak extra memory ~ chunk_size x V floats.
    Returns:
        a float32 scalar (float64 for float64 inputs) equal to ``F.cross_entropy((h @ weight.T).float(), targets,
        ignore_index=ignore_index)``, differentiable w.r.t. ``h`` and ``weight``.
    """
    _check(h, weight, targets, chunk_size, ignore_index)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h, weight, targets, chunk_size, ignore_index)
    total = torch.zeros((), dtype=_work_dtype(h), device=h.device)
    valid_all = targets != ignore_index
    for s in range(0, h.shape[0], chunk_size):
        nll, _ = _chunk_nll_sum(_chunk_logits(h[s:s + chunk_size], weight), targets[s:s + chunk_size],
                                valid_all[s:s + chunk_size])
        total = total + nll
    return total / valid_all.sum().to(total.dtype)
