"""Decoupled Membership-Subspace Attention (DMSA), the attention operator of DMST
(Liu, Hou, Wang, Yan, "Interpretable and Sparse Linear Attention with Decoupled Membership-Subspace
Modeling via MCR^2 Objective"; Sec. III, Eqs. (13)-(21), Appendix B Algorithm 1).

The membership Pi is learned from the (rotary-encoded) input instead of being derived from the
subspaces as in TSSA, and the subspaces are sparse selections of one full space S:
``U_k^S = S * ST(Pi)`` (Eq. 13-15). As Algorithm 1 computes it, per head k with s = S^T Z split
into heads (N, p) and membership logits l (N, H):

    gate   = ST_heads( mean_n l_n )              (B, H)  soft thresholding = sparsemax, Eq. (13)-(14)
    w      = s * gate_k                          (U_k^S)^T Z
    Pi     = sigmoid(l)                          (B, H, N)  no temperature in DMSA
    dots   = sum_n Pi_n / (sum_n Pi_n + 1e-8) * w_n^2
    out_n  = -(w_n * Pi_n) / (1 + dots)          Eq. (18), grad f = 1/(1+x) as in TSSA

Ablations (options of :func:`dmsa`):

- ``sparsity`` (Table II): where ST acts. ``"heads"`` (DMSA): on the subspace axis, through the
  head gate on S above. ``"tokens"`` (TPUSA): "Pi is sparsified along the token dimension and used
  directly for computation" while U_k keeps its full learning: no gate on S (gate = 1) and
  ``Pi = ST_tokens(act(l))`` per head, i.e. sparsemax over the (real) tokens, so each head's Pi
  sums to 1 over tokens and some tokens are excluded from that head's compression. ``"both"``
  (TPSUSA): the head gate on S and the token-sparse Pi.
- ``activation``: the membership activation ``act`` giving Pi: ``"sigmoid"`` (Algorithm 1),
  ``"relu"``, ``"gelu"``, or ``"sparsemax"`` over heads (per token, sums to 1 over heads).
- ``gate_activation``: the sigma in ``U_k^S = S * sigma(Pi)`` that Table III ablates
  (``"sparsemax"`` = ST, the default; ``"sigmoid"``, ``"relu"``, ``"gelu"`` applied elementwise to
  the token-mean logits). Only meaningful when the gate exists (sparsity ``"heads"``/``"both"``).
- ``mode="channel"`` (Sec. III-C, Eq. 19-21): the gated channel-attention variant: the Diag(pi_k)
  weighting of the output is removed and only the sparse gate on the subspaces remains; the
  second moments in D_k stay Pi-weighted as Eq. (19) writes them: ``out_n = -w_n / (1 + dots)``.

This module is the efficient pure-PyTorch version (vectorised masking, its own sort-based
sparsemax so ``torch.compile(fullgraph=True)`` works); :func:`whiteformer.ops.reference.dmsa_reference`
is Algorithm 1 written literally.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from .._checks import (
    as_keep_mask,
    check_choice,
    check_heads_input,
    check_instance,
    check_mask,
    check_probability,
    check_same_device,
    check_tensor,
    is_int,
)
from .._dtypes import autocast_off
from .constants import PI_EPS  # added to the membership mass sum_n Pi_n (as TSSA)
from .scaling import head_scale

__all__ = ["dmsa", "sparsemax", "SPARSITY", "ACTIVATIONS", "GATE_ACTIVATIONS", "MODES", "check_dmsa_options"]


SPARSITY = ("heads", "tokens", "both")
ACTIVATIONS = ("sigmoid", "relu", "gelu", "sparsemax")
GATE_ACTIVATIONS = ("sparsemax", "sigmoid", "relu", "gelu")
MODES = ("membership", "channel")


def check_dmsa_options(sparsity: str, activation: str, mode: str, gate_activation: str = "sparsemax") -> None:
    """Raise ValueError (listing the choices) for an unknown or unusable option combination."""
    check_choice(sparsity, "sparsity", SPARSITY)
    check_choice(activation, "activation", ACTIVATIONS)
    check_choice(mode, "mode", MODES)
    check_choice(gate_activation, "gate_activation", GATE_ACTIVATIONS)
    if sparsity == "tokens" and gate_activation != "sparsemax":
        raise ValueError(f"gate_activation={gate_activation!r} needs the head gate on S, which sparsity='tokens' "
                         "(TPUSA) does not have; use sparsity='heads' or 'both'")




def sparsemax(z: torch.Tensor, dim: int = -1, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sparsemax (Martins & Astudillo, 2016) = the soft thresholding ST of DMSA Eq. (13)-(14).

    ``ST_j(z) = max(z_j - K(z), 0)`` with the threshold K(z) chosen so the result sums to 1
    (Euclidean projection onto the simplex): exact zeros below the threshold. Sort-based, gradients
    by autograd (equal to the sparsemax Jacobian away from ties); compiles with ``fullgraph=True``.

    Args:
        z: floating tensor.
        dim: the axis to normalise over.
        mask: optional bool (or 0/1 integer) tensor broadcastable to z, True / 1 = entry takes part. Masked entries get
            0 and do not affect the others (the result on the kept entries equals sparsemax of the
            kept entries alone); an axis with no kept entry gives all zeros.
    """
    check_tensor(z, "z")
    if z.dim() == 0:
        raise ValueError("sparsemax needs a tensor with at least one dimension, got a 0-d tensor")
    if not is_int(dim) or not -z.dim() <= dim < z.dim():
        raise ValueError(f"dim must be an int in [{-z.dim()}, {z.dim() - 1}] for z of shape {tuple(z.shape)}, "
                         f"got {dim!r}")
    if z.shape[dim] == 0:
        raise ValueError(f"sparsemax over an empty dimension: z has size 0 along dim {dim} (shape "
                         f"{tuple(z.shape)}); the simplex of 0 entries is empty")
    if mask is not None:
        check_instance(mask, "mask", torch.Tensor, "a bool (or 0/1 integer) tensor broadcastable to z")
        check_same_device(z, "z", mask=mask)
        mask = as_keep_mask(mask, "mask")
        try:
            fits = torch.broadcast_shapes(mask.shape, z.shape) == z.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to z's shape {tuple(z.shape)}")
    return _sparsemax(z, dim, mask)


def _sparsemax(z: torch.Tensor, dim: int, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """:func:`sparsemax` on checked arguments (``mask`` bool or None): the entry of :func:`_dmsa_torch`."""
    z = z.movedim(dim, -1)
    n = z.shape[-1]
    # sparsemax is shift invariant: subtracting the (constant) max only improves rounding
    if mask is None:
        zmax = z.detach().amax(dim=-1, keepdim=True)
        y = z - zmax
        zs, _ = torch.sort(y, dim=-1, descending=True)
        valid = None
    else:
        keep = torch.broadcast_to(mask, z.movedim(-1, dim).shape).movedim(dim, -1)
        zmax = z.detach().masked_fill(~keep, float("-inf")).amax(dim=-1, keepdim=True)
        zmax = torch.where(torch.isfinite(zmax), zmax, torch.zeros_like(zmax))
        y = torch.where(keep, z - zmax, torch.zeros_like(z))
        # kept entries first (descending), masked ones after; gather finite values only
        order = torch.argsort(y.detach().masked_fill(~keep, float("-inf")), dim=-1, descending=True)
        zs = y.gather(-1, order)
        valid = torch.arange(n, device=z.device) < keep.sum(dim=-1, keepdim=True)
        zs = torch.where(valid, zs, torch.zeros_like(zs))
    k = torch.arange(1, n + 1, device=z.device, dtype=z.dtype)
    cs = zs.cumsum(dim=-1)
    support = 1.0 + k * zs > cs
    if valid is not None:
        support = support & valid
    ksize = support.sum(dim=-1, keepdim=True).clamp_min(1)
    tau = (cs.gather(-1, ksize - 1) - 1.0) / ksize.to(z.dtype)
    out = torch.clamp(y - tau, min=0.0)
    if mask is not None:
        out = torch.where(keep, out, torch.zeros_like(out))
    return out.movedim(-1, dim)


def _elementwise(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "sigmoid":
        return torch.sigmoid(x)
    if name == "relu":
        return torch.relu(x)
    return F.gelu(x)


def _check_inputs(s, logits) -> None:
    check_heads_input(s, "s")
    check_tensor(logits, "logits", 3)
    B, H, N, _ = s.shape
    if logits.shape != (B, N, H):
        raise ValueError(f"logits must have shape (B, N, H) = ({B}, {N}, {H}) to match s (B, H, N, p), "
                         f"got {tuple(logits.shape)}")


def dmsa(
    s: torch.Tensor,
    logits: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    sparsity: str = "heads",
    activation: str = "sigmoid",
    mode: str = "membership",
    return_stats: bool = False,
    *,
    gate_activation: str = "sparsemax",
    attn_drop: float = 0.0,
    training: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
    """Decoupled Membership-Subspace Attention (DMSA Eq. (18); Algorithm 1; ablations Tables II-III,
    Sec. III-C). See the module docstring for the formulas and the reading of each option.

    Args:
        s: (B, H, N, p) the full-space projection S^T Z of the tokens, split into heads.
        logits: (B, N, H) membership logits (``Linear(dim, H, bias=False)`` of the rotary-encoded
            tokens; the layout the linear layer produces).
        attn_mask: optional (B, N) bool keep-mask (True = real token). Padded tokens take no part
            in any statistic (the token-mean for the gate, the token sparsemax, the Pi sums, the
            second moments) and their outputs are 0: each real token gets the result of its
            sequence alone.
        sparsity: ``"heads"`` (DMSA), ``"tokens"`` (TPUSA) or ``"both"`` (TPSUSA).
        activation: membership activation, ``"sigmoid"``, ``"relu"``, ``"gelu"`` or ``"sparsemax"``
            (over heads).
        mode: ``"membership"`` (Eq. 18) or ``"channel"`` (Eq. 19-21, no Pi weighting of the output).
        return_stats: also return ``{"pi": (B, H, N), "gate": (B, H)}`` (pi is 0 at padded tokens;
            gate is all ones for ``sparsity="tokens"``, which has no head gate).
        gate_activation: sigma of the gate ``U_k^S = S * sigma(.)`` (Table III); default ST (sparsemax).
        attn_drop: dropout probability on the gain ``1 / (1 + dots)`` (as TSSA).
        training: dropout is applied only when True.

    Returns:
        out (B, H, N, p) in the inputs' (promoted) dtype, and the stats dict with ``return_stats``.
        Under float16/bfloat16 (or autocast) all statistics are computed in float32.

    Raises:
        TypeError/ValueError for non-tensors, wrong shapes, N = 0, a bad mask, or unknown options.
    """
    _check_inputs(s, logits)
    attn_mask = check_mask(attn_mask, s.shape[0], s.shape[2])
    check_same_device(s, "s", logits=logits, attn_mask=attn_mask)
    check_dmsa_options(sparsity, activation, mode, gate_activation)
    check_probability(attn_drop, "attn_drop")
    out, pi, gate = _dmsa_torch(s, logits, attn_mask, sparsity, activation, mode, gate_activation,
                                float(attn_drop) if training else 0.0)
    return (out, {"pi": pi, "gate": gate}) if return_stats else out


def _dmsa_torch(s, logits, attn_mask, sparsity, activation, mode, gate_activation, drop_p):
    """Pure-PyTorch DMSA on validated inputs: returns (out (B,H,N,p), pi (B,H,N), gate (B,H))."""
    out_dtype = torch.promote_types(s.dtype, logits.dtype)
    sd = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype  # as stats_dtype
    with autocast_off(s):
        x = s.to(sd)
        lg = logits.to(sd).transpose(1, 2)  # (B, H, N)
        keep = None
        if attn_mask is not None:
            keep = attn_mask[:, None, :]  # (B, 1, N)
            # padded tokens: zero entries contribute nothing to any token sum below
            x = x.masked_fill(~keep.unsqueeze(-1), 0.0)
            lg = lg.masked_fill(~keep, 0.0)

        if sparsity == "tokens":
            gate = torch.ones(lg.shape[:2], dtype=sd, device=lg.device)
        else:
            if keep is None:
                mean = lg.mean(dim=-1)
            else:
                count = attn_mask.sum(dim=-1, keepdim=True).clamp_min(1).to(sd)  # (B, 1)
                mean = lg.sum(dim=-1) / count
            gate = _sparsemax(mean, -1, None) if gate_activation == "sparsemax" else _elementwise(gate_activation, mean)

        pi = _sparsemax(lg, 1, None) if activation == "sparsemax" else _elementwise(activation, lg)
        if sparsity != "heads":
            pi = _sparsemax(pi, -1, keep)
        elif keep is not None:
            pi = pi.masked_fill(~keep, 0.0)

        w = x * gate[:, :, None, None]
        # scaled by a power of two c (B, H, 1, 1) so that w^2 stays finite (whiteformer.ops.scaling):
        # w = c w', dots = c^2 dots', and c / (1 + dots) = 1 / (1 / c + c dots'), times w' below
        c = head_scale(w, 2)
        w = w / c
        c = c[..., 0]  # (B, H, 1)
        pi_w = pi / (pi.sum(dim=-1, keepdim=True) + PI_EPS)
        dots = torch.einsum("bhn,bhnp->bhp", pi_w, w * w)  # Pi-weighted second moments, in units of c^2
        gain = (c.reciprocal() + c * dots).reciprocal()
        if drop_p > 0.0:
            gain = F.dropout(gain, p=drop_p, training=True)
        if mode == "membership":
            out = -(w * pi.unsqueeze(-1)) * gain.unsqueeze(-2)
        else:
            out = -w * gain.unsqueeze(-2)  # padded w is 0, so padded outputs are 0
    return out.to(out_dtype), pi.to(out_dtype), gate.to(out_dtype)
