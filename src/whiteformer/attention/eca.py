"""ECAttention layer (ECAttention paper, Eq. 4; Algorithms 1-3): the update ``alpha * E(x) - beta * C(x)``.

Like every layer of :mod:`whiteformer.attention` it returns the update, not ``x + update``: the
ECA model (and any pre-norm block) adds the residual, ``x + alpha E(x) - beta C(x)`` (Eq. 4).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._checks import (
    check_choice,
    check_divisible,
    check_eps,
    check_finite_real,
    check_input_device,
    check_int,
    check_mask,
    check_sketch_rank,
    check_tokens_input,
    is_int,
)
from .._dtypes import autocast_off, stats_dtype
from .._utils import zero_padded
from ..ops.eca import _compress, _expand, eca_omega
from .registry import register_attention

__all__ = ["ECAttention"]

_EXPAND_STREAM, _COMPRESS_STREAM = 0, 1
_CACHE_SIZE = 16
DEFAULT_RANK = 20  # paper's recommended r (App. C.1), capped at the head dimension


def _inverse_softplus(v: float) -> float:
    return v + math.log(-math.expm1(-v))  # log(exp(v) - 1), stable for large v


def _orthogonal_init(weight: torch.Tensor) -> None:
    """``nn.init.orthogonal_``, computed in float32 for a float16 / bfloat16 weight (built under a half
    default dtype, e.g. ``from_config(config, dtype=torch.bfloat16)``), where the QR it needs does not run."""
    if weight.dtype in (torch.float32, torch.float64):
        nn.init.orthogonal_(weight)
        return
    with torch.no_grad():
        weight.copy_(nn.init.orthogonal_(torch.empty(weight.shape, dtype=torch.float32, device=weight.device)))


@register_attention("eca")
class ECAttention(nn.Module):
    """ECAttention update (Eq. 4): ``alpha (I - Q Q^T) z - beta sum_k pi_k U_k (I - Q_k Q_k^T) U_k^T z``.

    The layer returns the update only (timm's contract, like every other layer here); the
    residual is the caller's: ``z + ECAttention(z)`` is the paper's ``z + alpha E(z) - beta C(z)``
    (Eq. 4). The ECA models (``create_model("eca_*")``) add it in their pre-norm blocks, and
    ``alpha``, ``beta`` are the layer's own learned scales (``learned_scale = True``: a shell
    should not add a layer scale on top).

    Args:
        dim: C. num_heads: K (subspaces).
        rank: r, the sketch rank per head (compression). Default ``min(20, head_dim)``: the
            paper's r = 20, capped at the head dimension (a basis of a p-dimensional space has at
            most p vectors), so e.g. ``build("eca", 64, num_heads=4)`` (p = 16) gets r = 16.
            The expansion sketch has ``expand_rank`` columns, default ``min(num_heads * rank, dim)``
            (paper Alg. 1, Eq. 5: K r <= d). A sketch wider than the number of tokens N is
            allowed only with eps > 0 (the regularised basis is then a ridge projector onto
            range(Z)), ValueError otherwise.
        head_dim: p, the columns of each subspace basis U_k (default ``dim // num_heads``, which
            then must divide). The paper's Table 3 lists p independently of d / K (ECA-T/S:
            d / K = 48, but their parameter counts come out with p = 64).
        eps: Cholesky regulariser (paper default 1e-2, Table 10).
        alpha_init, beta_init: initial strengths (paper: 0.1 each).
        positive: alpha, beta = softplus(raw) with raw = inverse-softplus(init) (paper's
            recommended setting, Alg. 3, App. C.1); otherwise alpha, beta = raw, initialised to the
            init values.
        expand, compress: switch a module off (ablations, App. C.3); not both.
        seed: seed of the fixed Gaussian sketches (see below). Default: drawn from torch's CPU
            global RNG at construction (reproducible under ``torch.manual_seed``, different per
            layer; works under ``torch.device("meta")``). Stored as ``self.seed`` and, to travel
            with checkpoints, as the buffer ``omega_seed``.
        resample_omega: draw fresh sketches (``torch.randn``, global RNG) at every forward in
            training mode; eval mode always uses the fixed sketches.

    Parameters: ``U`` (dim, K*p), orthogonal init (for p = dim / K: sum_k U_k U_k^T = I as App.
    A.2 assumes; Alg. 2's pseudocode uses ``randn``, whose scale grows the compression output
    ~ dim); ``temperature`` (1,) ones (eta of Eq. 7); ``alpha_raw`` / ``beta_raw`` scalars.
    Disabled modules have no parameters.

    Memberships are Eq. 7, ``pi_n = softmax_k(||Q_k Q_k^T a_kn||^2 / (2 eta))`` (squared norm,
    1 / (2 eta), softmax over the K heads), not the printed form of Alg. 2 (norm / eta, softmax
    over tokens), which contradicts Eq. 7's shapes.

    Precision: the basis computation needs Cholesky, which has no half kernels, so under
    float16/bfloat16 inputs or bf16/fp16 autocast the whole layer runs in float32 (autocast is
    switched off inside) and returns the input dtype; float64 stays float64.

    Sketches: the paper fixes N in a random buffer; here any N works. Omega for N tokens is
    :func:`whiteformer.ops.eca.eca_omega` ``(N, cols, seed, stream)`` (stream 0 expansion, 1
    compression): the same N gives the same Omega, different layers (seeds) different ones, and
    Omega(n) is the first n rows of Omega(N), which makes a padded batch give on its real tokens
    exactly what each sequence alone gives. It is created on x's device in x's dtype and cached
    per (N, device, dtype) in eager mode (computed in the graph under ``torch.compile``).

    ``forward(x, attn_mask=None, return_pi=False)``: x (B, N, C) -> update (B, N, C); padded
    tokens (attn_mask False) get a zero update. ``return_pi=True`` returns
    ``(update, {"pi": (B, K, N)})`` (needs the compression module).
    """

    learned_scale = True  # alpha and beta scale the update: no extra layer scale in a block
    shell_options = ()  # no qkv projection and no dropout
    returns_pi = True  # forward(..., return_pi=True) -> (out, {"pi": memberships, ...}) when use_compress

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        rank: Optional[int] = None,
        eps: float = 1e-2,
        alpha_init: float = 0.1,
        beta_init: float = 0.1,
        positive: bool = True,
        expand: bool = True,
        compress: bool = True,
        *,
        head_dim: Optional[int] = None,
        expand_rank: Optional[int] = None,
        seed: Optional[int] = None,
        resample_omega: bool = False,
    ):
        super().__init__()
        if head_dim is None:
            self.head_dim = check_divisible(dim, num_heads)
        else:
            check_int(dim, "dim", 1)
            check_int(num_heads, "num_heads", 1)
            self.head_dim = check_int(head_dim, "head_dim", 1)
        self.dim, self.num_heads = dim, num_heads
        if not expand and not compress:
            raise ValueError("expand and compress cannot both be False: the layer would be the identity")
        self.rank = min(DEFAULT_RANK, self.head_dim) if rank is None else check_int(rank, "rank", 1)
        if expand_rank is None:
            self.expand_rank = min(num_heads * self.rank, dim)
        else:
            self.expand_rank = check_int(expand_rank, "expand_rank", 1)
        if compress and self.rank > self.head_dim:
            raise ValueError(f"rank ({rank}) must be <= the head dimension p ({self.head_dim})")
        if expand and self.expand_rank > dim:
            raise ValueError(f"expand_rank ({self.expand_rank}) must be <= dim ({dim})")
        self.eps = check_eps(eps)
        self.positive = bool(positive)
        self.use_expand, self.use_compress = bool(expand), bool(compress)
        self.resample_omega = bool(resample_omega)
        if seed is None:
            seed = int(torch.randint(0, 2**31 - 1, (), device="cpu").item())  # cpu: also under a meta default
        if not is_int(seed) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be a non-negative integer (< 2**63), got {seed!r}")
        self.seed = seed
        self.register_buffer("omega_seed", torch.tensor(seed, dtype=torch.int64))
        self._seed_read = (self.omega_seed, self.omega_seed._version)  # the buffer self.seed was read from
        self._omega_cache: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()

        def raw(init: float, name: str) -> nn.Parameter:
            init = check_finite_real(init, name)
            if self.positive:
                if init <= 0:
                    raise ValueError(f"{name} must be > 0 when positive=True (softplus), got {init!r}")
                init = _inverse_softplus(init)
            return nn.Parameter(torch.tensor(init))

        if self.use_expand:
            self.alpha_raw = raw(alpha_init, "alpha_init")
        else:
            self.register_parameter("alpha_raw", None)
        if self.use_compress:
            self.beta_raw = raw(beta_init, "beta_init")
            self.U = nn.Parameter(torch.empty(dim, num_heads * self.head_dim))
            if not self.U.is_meta:
                _orthogonal_init(self.U)
            self.temperature = nn.Parameter(torch.ones(1))
        else:
            self.register_parameter("beta_raw", None)
            self.register_parameter("U", None)
            self.register_parameter("temperature", None)

    # ---------------------------------------------------------------------------------------
    @property
    def alpha(self) -> Optional[torch.Tensor]:
        """Expansion strength (softplus(alpha_raw) when ``positive``); None when disabled."""
        if self.alpha_raw is None:
            return None
        return F.softplus(self.alpha_raw) if self.positive else self.alpha_raw

    @property
    def beta(self) -> Optional[torch.Tensor]:
        """Compression strength (softplus(beta_raw) when ``positive``); None when disabled."""
        if self.beta_raw is None:
            return None
        return F.softplus(self.beta_raw) if self.positive else self.beta_raw

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, rank={self.rank}, "
            f"expand_rank={self.expand_rank}, "
            f"eps={self.eps}, positive={self.positive}, expand={self.use_expand}, "
            f"compress={self.use_compress}, seed={self.seed}, resample_omega={self.resample_omega}"
        )

    def no_weight_decay(self):
        return {n for n in ("temperature", "alpha_raw", "beta_raw") if getattr(self, n) is not None}

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._sketch_seed()
        self._omega_cache.clear()

    def _sketch_seed(self) -> int:
        """``self.seed``, read again from the ``omega_seed`` buffer once that was replaced or written
        (a checkpoint loaded by setting tensors directly, as accelerate's ``load_checkpoint_and_dispatch``
        does, bypasses ``load_state_dict``): one host read per change, none while compiling."""
        buf = self.omega_seed
        if buf.is_meta or torch.compiler.is_compiling():
            return self.seed
        if self._seed_read[0] is not buf or self._seed_read[1] != buf._version:
            self.seed = int(buf)
            self._seed_read = (buf, buf._version)
        return self.seed

    # ---------------------------------------------------------------------------------------
    def omega_for(self, num_tokens: int, kind: str = "expand", *, device=None, dtype=None) -> torch.Tensor:
        """The sketch the layer uses for ``num_tokens`` tokens: ``kind`` "expand" (N, expand_rank)
        or "compress" (N, rank). In training mode with ``resample_omega`` a fresh ``torch.randn``
        draw (as each forward makes); otherwise the fixed seeded sketch."""
        check_choice(kind, "kind", ("expand", "compress"))
        cols, stream = (self.expand_rank, _EXPAND_STREAM) if kind == "expand" else (self.rank, _COMPRESS_STREAM)
        if isinstance(num_tokens, torch.Tensor) and torch.jit.is_tracing():
            num_tokens = int(num_tokens)  # a traced size (TorchScript ONNX export): the sketch is a constant
        device = torch.device("cpu") if device is None else torch.device(device)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if self.resample_omega and self.training:
            return torch.randn(num_tokens, cols, device=device, dtype=dtype)
        if torch.compiler.is_compiling():
            return eca_omega(num_tokens, cols, self.seed, stream, device=device, dtype=dtype)
        seed = self._sketch_seed()
        key = (num_tokens, cols, stream, seed, device, dtype)
        om = self._omega_cache.get(key)
        if om is None:
            om = eca_omega(num_tokens, cols, seed, stream, device=device, dtype=dtype)
            self._omega_cache[key] = om
            while len(self._omega_cache) > _CACHE_SIZE:
                self._omega_cache.popitem(last=False)
        return om

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, return_pi: bool = False):
        """x (B, N, C), attn_mask (B, N) bool keep-mask (True = real token) -> the update
        ``alpha E(x) - beta C(x)`` (B, N, C) (Eq. 4 without the residual; 0 at padded tokens), or
        ``(update, {"pi": (B, K, N)})`` with ``return_pi`` (Eq. 7 memberships). Computed in
        float32 for half inputs and under autocast (see the class docstring)."""
        check_tokens_input(x, "x", self.dim)
        check_input_device(x, next(self.parameters(), None))  # half inputs are fine (float32 statistics)
        attn_mask = check_mask(attn_mask, x.shape[0], x.shape[1], device=x.device)  # x's own errors first
        B, N, _ = x.shape
        x = zero_padded(x, attn_mask)  # padded tokens take no part (NaN/inf there reach nothing)
        if return_pi and not self.use_compress:
            raise ValueError("return_pi=True needs the compression module (compress=False has no memberships)")
        if self.use_expand:
            check_sketch_rank(self.expand_rank, N, self.dim, "dim", "expand_rank", self.eps)
        if self.use_compress:
            check_sketch_rank(self.rank, N, self.head_dim, "the head dimension p", "rank", self.eps)
        cd = stats_dtype(x)
        if self.U is not None:
            cd = torch.promote_types(cd, stats_dtype(self.U))
        pi = None
        with autocast_off(x):
            xc = x.to(cd)
            y = None
            if self.use_expand:
                omega = self.omega_for(N, "expand", device=x.device, dtype=x.dtype).to(cd)
                y = self.alpha.to(cd) * _expand(xc, omega, self.eps, attn_mask)  # checked above
            if self.use_compress:
                omega = self.omega_for(N, "compress", device=x.device, dtype=x.dtype).to(cd)
                c, pi = _compress(xc, self.U.to(cd), omega, self.temperature.to(cd), self.num_heads, self.eps,
                                  attn_mask)
                c = self.beta.to(cd) * c
                y = -c if y is None else y - c
        y = y.to(x.dtype)
        return (y, {"pi": pi.to(x.dtype)}) if return_pi else y
