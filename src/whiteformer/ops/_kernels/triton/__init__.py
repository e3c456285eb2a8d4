"""Triton kernels for TSSA, causal TSSA and the causal TSSA step (GPU path; issue 15).

One module per operator: :mod:`.tssa`, :mod:`.causal_tssa`, :mod:`.causal_tssa_step`; the
shared tile helpers live in :mod:`._tiles`. Each module holds the kernels, a
``torch.library`` custom op pair (forward, backward) with a fake implementation and a
registered autograd formula, and one public function with the signature of the fused CPU op.

When the kernels run (see :func:`use_triton`):

- CUDA tensors of a supported dtype (float16, bfloat16, float32, float64) when ``triton``
  imports, unless ``WHITEFORMER_DISABLE_KERNELS=1``;
- any device when ``WHITEFORMER_BACKEND=triton`` (read at each call): CPU tensors then run
  through Triton's interpreter, which needs ``TRITON_INTERPRET=1`` in the environment before
  the kernels are first imported (Triton reads it when a kernel is decorated).
  ``WHITEFORMER_BACKEND=torch`` forces the PyTorch path on every device.

Statistics are accumulated in float32 for float16/bfloat16/float32 inputs (float64 for float64).
"""
from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["ENV_BACKEND", "BACKENDS_ALLOWED", "DTYPES", "backend_choice", "triton_importable", "use_triton"]

ENV_BACKEND = "WHITEFORMER_BACKEND"
BACKENDS_ALLOWED = ("", "auto", "torch", "triton")
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def backend_choice() -> str:
    """``WHITEFORMER_BACKEND`` (lower-cased; ``""`` when unset). Unknown values raise ValueError."""
    value = os.environ.get(ENV_BACKEND, "").strip().lower()
    if value not in BACKENDS_ALLOWED:
        raise ValueError(f"{ENV_BACKEND} must be one of 'auto', 'torch', 'triton' (or unset), got {value!r}")
    return value


def triton_importable() -> bool:
    """True when the ``triton`` package is installed (without importing it)."""
    return importlib.util.find_spec("triton") is not None



def check_forced(device: torch.device) -> None:
    """Raise a clear RuntimeError when ``WHITEFORMER_BACKEND=triton`` cannot run on ``device``."""
    if not triton_importable():
        raise RuntimeError(
            f"{ENV_BACKEND}=triton but the 'triton' package is not installed "
            "(pip install 'whiteformer[triton]')"
        )
    if device.type != "cuda":
        from ._tiles import kernels_interpreted

        if not kernels_interpreted():
            raise RuntimeError(
                f"{ENV_BACKEND}=triton on {device.type} tensors runs Triton's interpreter: set "
                "TRITON_INTERPRET=1 in the environment before the first call (Triton reads it when "
                "the kernels are first imported)"
            )


def use_triton(x: torch.Tensor, disabled: bool) -> bool:
    """Whether the Triton kernels run on ``x`` (``disabled``: ``WHITEFORMER_DISABLE_KERNELS`` set).

    ``WHITEFORMER_BACKEND=triton`` forces them whatever the device (errors clearly if they cannot
    run); ``torch`` forbids them; otherwise CUDA tensors of a supported dtype use them when
    ``triton`` is installed and kernels are not disabled."""
    choice = backend_choice()
    if choice == "torch":
        return False
    if choice == "triton":
        if x.dtype not in DTYPES:
            raise TypeError(f"the Triton kernels support {[str(d) for d in DTYPES]}, got {x.dtype}")
        check_forced(x.device)
        return True
    return x.device.type == "cuda" and x.dtype in DTYPES and not disabled and triton_importable()
