"""Input validation shared by ops and layers.

Every public operator validates its arguments with these helpers so that bad input
raises a ``ValueError``/``TypeError`` that names the argument and what was expected,
instead of failing deep inside torch or silently producing NaN.
"""
from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Sequence

import torch

from ._compile import can_read_values, compile_disabled

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(x, name: str, ndim: int | Sequence[int] | None = None, *, floating: bool = True) -> None:
    """Check that ``x`` is a tensor with the given number of dims and a floating dtype."""
    check_instance(x, name, torch.Tensor, "a torch.Tensor")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if x.dim() not in allowed:
            want = " or ".join(str(a) for a in allowed)
            raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(x.shape)}")
    if floating and x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating tensor (float16/bfloat16/float32/float64), got {x.dtype}"
        )


def check_nonempty(x: torch.Tensor, name: str, dim: int, what: str = "tokens") -> None:
    """Raise if ``x.shape[dim] == 0`` (e.g. a sequence of zero tokens)."""
    if x.shape[dim] == 0:
        raise ValueError(f"{name} has no {what} (size 0 along dim {dim}, shape {tuple(x.shape)})")


def check_divisible(dim: int, num_heads: int, dim_name: str = "dim") -> int:
    """Return the head dimension ``dim // num_heads`` or raise a clear error."""
    check_int(num_heads, "num_heads", 1)
    check_int(dim, dim_name, 1)
    if dim % num_heads != 0:
        raise ValueError(f"{dim_name} ({dim}) must be divisible by num_heads ({num_heads})")
    return dim // num_heads


def as_keep_mask(attn_mask, name: str = "attn_mask") -> torch.Tensor | None:
    """A keep-mask as bool (True = real token): bool as it is, integer 0/1 (``transformers``' long
    masks) converted; a float (additive) mask is refused with a ``TypeError``. Values other than
    0/1 raise ``ValueError`` (not checked while ``torch.compile`` traces: that would read values)."""
    if attn_mask is None or not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype == torch.bool:
        return attn_mask
    if attn_mask.is_floating_point() or attn_mask.is_complex():
        raise TypeError(f"{name} must be a bool or 0/1 integer keep-mask (True/1 = real token), got {attn_mask.dtype}: "
                        f"float (additive) masks are not supported; pass (mask == 0) for an additive 0/-inf mask")
    if can_read_values() and attn_mask.device.type != "meta" \
            and bool(((attn_mask != 0) & (attn_mask != 1)).any()):
        raise ValueError(f"{name} must hold 0/1 (or bool) values, 1/True = real token")
    return attn_mask != 0


def check_mask(attn_mask, batch: int, tokens: int, name: str = "attn_mask",
               device: torch.device | None = None) -> torch.Tensor | None:
    """Validate a (B, N) keep-mask (True / 1 = real token: bool, or 0/1 integers as ``transformers``
    passes them, see :func:`as_keep_mask`), on ``device`` when given (the input's); returns it as
    bool, or None."""
    if attn_mask is None:
        return None
    check_instance(attn_mask, name, torch.Tensor, "a bool tensor of shape (B, N)")
    if device is not None and attn_mask.device != device:
        raise ValueError(f"{name} must be on the input's device ({device}), got {attn_mask.device}")
    attn_mask = as_keep_mask(attn_mask, name)
    if attn_mask.shape != (batch, tokens):
        raise ValueError(
            f"{name} must have shape (B, N) = ({batch}, {tokens}), got {tuple(attn_mask.shape)}"
        )
    return attn_mask


@compile_disabled("cu_seqlens: packed batches read their segment boundaries on the host (one graph break); "
                  "torch.compile(fullgraph=True) cannot trace them, compile without fullgraph or pass one "
                  "sequence per row (attn_mask) instead")
def check_cu_seqlens(cu_seqlens, total: int | None, name: str = "cu_seqlens") -> list:
    """Validate packed-sequence boundaries (FlashAttention's convention): a 1-D integer tensor
    (int32, or int64) of shape (S + 1,) with ``cu_seqlens[0] = 0``, non-decreasing, ending at
    ``total`` (the packed token count; None: not checked here, for a row split over processes whose
    total needs every rank's chunk); segment s is tokens ``cu_seqlens[s]:cu_seqlens[s + 1]``.
    Returns the S segment lengths as Python ints (reads the values: one host sync)."""
    check_instance(cu_seqlens, name, torch.Tensor, "an int32 tensor of shape (S + 1,)")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must have dtype torch.int32 (FlashAttention's convention) or torch.int64, "
                        f"got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"{name} must have shape (S + 1,) with S >= 1 segments, got {tuple(cu_seqlens.shape)}")
    bounds = [int(v) for v in cu_seqlens.tolist()]
    if bounds[0] != 0:
        raise ValueError(f"{name} must start at 0, got {bounds[0]}")
    if any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{name} must be non-decreasing (cumulative sequence lengths), got {bounds}")
    if total is not None:
        check_cu_seqlens_total(bounds[-1], total, name)
    return [b - a for a, b in zip(bounds, bounds[1:])]


def check_cu_seqlens_total(end: int, total: int, name: str = "cu_seqlens") -> None:
    """The last boundary ``end`` of checked ``cu_seqlens`` is the packed token count ``total``."""
    if end != total:
        raise ValueError(f"{name} must end at the number of packed tokens ({total}), got {end}")


def check_tokens_input(x, name: str = "x", dim: int | None = None, like: torch.Tensor | None = None,
                       allow_no_tokens: bool = False, attn_mask=None) -> torch.Tensor | None:
    """Check a layer input of shape (B, N, C) (and C == dim when given; with ``like``, one of the
    layer's weights, the device must be its device (:func:`check_input_device`) and the dtype its
    dtype outside autocast (:func:`check_input_dtype`)); N = 0 only with ``allow_no_tokens`` (a
    rank's empty chunk of a sequence split over processes). Returns ``attn_mask`` checked as the
    (B, N) keep-mask of ``x`` (:func:`check_mask`, on x's device) as bool, or None."""
    check_tensor(x, name, 3)
    if not allow_no_tokens:
        check_nonempty(x, name, 1)
    if dim is not None and x.shape[-1] != dim:
        raise ValueError(f"{name} must have last dimension {dim} (the layer's dim), got shape {tuple(x.shape)}")
    if like is not None:
        check_input_device(x, like, name)
        check_input_dtype(x, like, name)
    return check_mask(attn_mask, x.shape[0], x.shape[1], device=x.device)


TOKEN_ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_token_ids(ids, name: str, vocab_size: int, shape: str = "(B, T)", ndim: int = 2,
                    allow_no_tokens: bool = False, values: bool = True) -> None:
    """Token ids of a model's input: an integer tensor (``TOKEN_ID_DTYPES``) of ``ndim`` dims (``shape``
    in the message), not empty (no tokens only with ``allow_no_tokens``), each in [0, vocab_size)
    (one host read of the smallest and largest; ``values=False``: not read, for ids the caller
    produced itself, e.g. sampled ones)."""
    check_instance(ids, name, torch.Tensor, "a torch.Tensor of token ids")
    if ids.dtype not in TOKEN_ID_DTYPES:
        raise TypeError(f"{name} must be an integer tensor of token ids, got {ids.dtype}")
    if ids.dim() != ndim:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(ids.shape)}")
    if ids.shape[0] == 0 or ids.shape[-1] == 0 and not allow_no_tokens:
        raise ValueError(f"{name} must be non-empty, got shape {tuple(ids.shape)}")
    lo, hi = torch.stack(torch.aminmax(ids)).tolist() if values and can_read_values() and ids.numel() else (0, 0)
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{name} has token ids in [{lo}, {hi}], expected [0, {vocab_size - 1}]")


def check_step_input(x_t, dim: int, like: torch.Tensor, name: str = "x_t") -> None:
    """Check one generated token's input (B, C) of a causal layer: C == dim, on the device of
    ``like`` (one of the layer's weights)."""
    check_tensor(x_t, name, 2)
    if x_t.shape[-1] != dim:
        raise ValueError(f"{name} must have shape (B, {dim}), got {tuple(x_t.shape)}")
    check_input_device(x_t, like, name)


def check_input_device(x: torch.Tensor, param: torch.Tensor | None, name: str = "x") -> None:
    """A layer input must be on its parameters' device: a ``ValueError`` naming ``name`` and both
    devices, instead of torch's device error deep inside the layer or, on the ``meta`` device, a
    result without values."""
    if param is not None and x.device != param.device:
        raise ValueError(f"{name} is on device {x.device} but the layer's parameters are on {param.device}: move "
                         f"the input ({name}.to({str(param.device)!r})) or the layer (.to({str(x.device)!r}))")


# ----------------------------------------------------------------------------- scalar arguments


def is_int(value) -> bool:
    """An integer that is not a bool (``True`` is an ``int`` to Python, never a size or an index here)."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A real number (int or float, NumPy scalars included) that is not a bool."""
    return isinstance(value, Real) and not isinstance(value, bool)


def check_instance(value, name: str, types, what: str, *, optional: bool = False, error: type = TypeError):
    """``value`` is an instance of ``types`` (or None when ``optional``); otherwise ``error`` says
    "{name} must be {what}, got {type name}". Returns ``value``."""
    if not (isinstance(value, types) or optional and value is None):
        raise error(f"{name} must be {what}, got {type(value).__name__}")
    return value


def check_integer_tensor(x, name: str, what: str = "an integer tensor") -> torch.Tensor:
    """``x`` is a tensor of an integer dtype (ids, labels, positions: not bool, float or complex);
    otherwise a ``TypeError`` "{name} must be {what}, got {its dtype, or its type}". Returns ``x``."""
    if not isinstance(x, torch.Tensor) or x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
        raise TypeError(f"{name} must be {what}, got {getattr(x, 'dtype', type(x).__name__)}")
    return x


def check_choice(value, name: str, choices: Sequence):
    """``value`` is one of ``choices`` (option names, None included); returns it."""
    if isinstance(value, torch.Tensor) or value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def check_int(value, name: str, minimum: int | None = None) -> int:
    """An integer (not a bool) ``>= minimum`` when given; returns it as an ``int``."""
    if not is_int(value) or (minimum is not None and value < minimum):
        what = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(
            minimum, f"an integer >= {minimum}")
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return int(value)


def check_finite_real(value, name: str, allow_none: bool = False) -> float | None:
    """A finite real number (not a bool, not NaN or +-inf; also None when ``allow_none``); returns
    it as a float (or None). The check of hyper-parameters that scale weights (layer-scale inits,
    step sizes): a non-finite one would give an all-NaN model instead of an error."""
    if value is None and allow_none:
        return None
    if not is_real(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number{' or None' if allow_none else ''}, got {value!r}")
    return float(value)


def check_positive_real(value, name: str) -> float:
    """A finite real number > 0 (ratios, widths' multipliers); returns it as a float."""
    if not is_real(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_probability(value, name: str = "p") -> float:
    """A dropout-style probability in [0, 1) (1 would drop everything); returns it as a float.
    The one probability check of the package: dropout, attention dropout, drop-path rates."""
    if not is_real(value) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a float in [0, 1), got {value!r}")
    return float(value)


# ----------------------------------------------------------------------------- operator arguments


def check_heads_input(w, name: str = "w", allow_no_tokens: bool = False) -> None:
    """``w``: (B, H, N, p) floating, with H, p > 0 and N > 0 (N = 0 too with ``allow_no_tokens``:
    a rank's empty chunk of a sequence split over processes)."""
    check_tensor(w, name, 4)
    check_nonempty(w, name, 1, "heads")
    if not allow_no_tokens:
        check_nonempty(w, name, 2, "tokens")
    check_nonempty(w, name, 3, "features (head dim p)")


def check_eps(eps, name: str = "eps") -> float:
    """A finite number >= 0; returns it as a float."""
    if not is_real(eps) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {eps!r}")
    return float(eps)


def check_sketch_rank(rank: int, tokens: int, features: int, features_name: str,
                      what: str = "rank (columns of omega)", eps: float = 0.0) -> None:
    """The sketch rank R of an orthonormal basis of range(Z Omega) is at most ``features``.

    R may exceed the number of tokens N only when ``eps > 0``: then range(Z Omega) has at most N
    dimensions, the Gram matrix is singular, and the eps-regularised basis acts as a ridge
    projector onto range(Z). The ECA paper's own configurations need this (ECA-B/B+/L sketch
    16 * 20 = 320 columns over 196 tokens, with the fixed eps = 1e-2); with ``eps = 0`` it raises.
    """
    if rank < 1:
        raise ValueError(f"{what} must be >= 1, got {rank}")
    if rank > tokens and eps <= 0:
        raise ValueError(
            f"{what} = {rank} must be <= the number of tokens N ({tokens}) when eps = 0: the "
            f"range of the N token features has at most N dimensions (use eps > 0 to allow it)"
        )
    if rank > features:
        raise ValueError(
            f"{what} = {rank} must be <= {features_name} ({features}): the "
            f"basis of a {features}-dimensional space has at most {features} vectors"
        )


def check_same_device(w: torch.Tensor, name: str = "w", **operands) -> None:
    """Every tensor in ``operands`` (name=value; None and non-tensors are skipped) is on ``w``'s
    device, so that no kernel reads memory of another device (a CPU kernel handed a ``meta`` or
    CUDA pointer)."""
    for arg, value in operands.items():
        if isinstance(value, torch.Tensor) and value.device != w.device:
            raise ValueError(f"{arg} must be on {name}'s device ({w.device}), got {value.device}")


_FEW = 64  # at most this many values: check_finite reads them on the host


def check_finite(x: torch.Tensor, name: str) -> None:
    """Raise if ``x`` holds NaN or inf (skipped on the ``meta`` device, which has no values). A few
    values on the CPU (a per-head temperature, checked at every call of an op) are read as Python
    floats: a tenth of the time of ``isfinite(x).all()``."""
    if x.device.type == "cpu" and x.numel() <= _FEW and x.dtype.is_floating_point:
        finite = all(map(math.isfinite, x.detach().reshape(-1).tolist()))
    else:
        finite = x.device.type == "meta" or bool(torch.isfinite(x).all())
    if not finite:
        raise ValueError(f"{name} contains NaN or inf")



def check_input_dtype(x: torch.Tensor, param: torch.Tensor, name: str = "x") -> None:
    """A layer input must have its parameters' dtype (outside autocast, which casts for the matmuls);
    otherwise a ``TypeError`` names ``name`` and both dtypes instead of torch's "mat1 and mat2"."""
    if x.dtype == param.dtype or not param.dtype.is_floating_point:
        return
    dev = x.device.type
    if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
        return
    raise TypeError(f"{name} has dtype {x.dtype} but the layer's parameters are {param.dtype}: cast the input "
                    f"({name}.to({param.dtype})) or the layer (.to({x.dtype})), or run under torch.autocast")


def check_keep_softmax(keep_softmax, depth: int, attention: str, arg: str = "attention",
                       softmax: str = "softmax") -> list:
    """``keep_softmax`` (the blocks of a hybrid that stay softmax): None or distinct layer indices in
    [0, depth), only when the model's attention ``arg=attention`` is not the softmax one -> sorted list."""
    if keep_softmax is None:
        return []
    if not isinstance(keep_softmax, (list, tuple)) or not all(is_int(i) for i in keep_softmax):
        raise TypeError(f"keep_softmax must be a list of layer indices, got {keep_softmax!r}")
    if keep_softmax and attention == softmax:
        raise ValueError(f"keep_softmax names the layers that stay softmax in a model of another attention; it "
                         f"needs {arg} other than {softmax!r} (e.g. {arg}='tssa'), got {arg}={attention!r}")
    bad = [i for i in keep_softmax if not 0 <= i < depth]
    if bad or len(set(keep_softmax)) != len(keep_softmax):
        raise ValueError(f"keep_softmax must hold distinct layer indices in [0, {depth}), got {list(keep_softmax)}")
    return sorted(int(i) for i in keep_softmax)
