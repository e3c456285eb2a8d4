"""What differs between the Triton releases the kernels support (3.3 to 3.9): the one place that
reads the installed Triton's version or features. The kernels use only what all of them have.

- :func:`div`: float32 division with the hardware's approximate instruction. Triton 3.9 gives it
  as ``tl.fdiv(x, y, approx=True)`` (its plain ``/`` is the IEEE division, whose slow path is a
  call with a stack frame); before 3.9 ``approx`` does not exist and ``/`` on float32 already
  lowers to the full-range approximate ``div.full.f32`` (no call, no stack).
- Triton's interpreter before 3.7 cannot take a one-element tensor as a ``range`` bound under
  NumPy 2.4, and 3.6's cannot take a ``bool`` argument: :func:`_patch_interpreter`.
- :func:`unsupported`: why this Triton cannot run the kernels at all ('' when it can).
"""
from __future__ import annotations

import inspect
import re
from typing import Tuple

import triton
import triton.language as tl

__all__ = ["MIN_VERSION", "VERSION", "compile_errors", "div", "unsupported"]

MIN_VERSION = (3, 3)  # the oldest Triton the kernels are tested with (the one torch 2.7 pins)


def _parse(version: str) -> Tuple[int, int]:
    """``"3.6.0"`` (or ``"3.6.0+git1234"``) -> (3, 6)."""
    numbers = re.findall(r"\d+", version)[:2]
    return tuple(int(n) for n in numbers) + (0,) * (2 - len(numbers))


VERSION = _parse(triton.__version__)
_FDIV_APPROX = "approx" in inspect.signature(tl.fdiv).parameters


def unsupported() -> str:
    """'' when the installed Triton can run the kernels, else a sentence naming its version."""
    if VERSION < MIN_VERSION:
        oldest = ".".join(map(str, MIN_VERSION))
        return f"Triton {triton.__version__} is older than {oldest}, the oldest the kernels support"
    return ""


def compile_errors() -> tuple:
    """The exception types with which a kernel fails to compile (front end, MLIR passes, ptxas,
    resources), as this Triton names them: what the CUDA path falls back from."""
    from triton.compiler import errors as compiler_errors
    from triton.runtime import errors as runtime_errors

    names = (getattr(compiler_errors, "CompilationError", None), getattr(runtime_errors, "OutOfResources", None),
             getattr(runtime_errors, "PTXASError", None))
    return tuple(e for e in names if isinstance(e, type))


if _FDIV_APPROX:
    @triton.jit
    def div(x, y):
        """x / y: float32 through ``div.approx.f32`` (2 ulp for denominators in [2^-126, 2^126]:
        here >= 1e-24), float64 exactly."""
        if y.dtype == tl.float32:
            return tl.fdiv(x, y, approx=True)
        else:
            return x / y
else:
    @triton.jit
    def div(x, y):
        """x / y: float32 through ``div.full.f32`` (this Triton's float32 division), float64 exactly."""
        return x / y


def _patch_interpreter() -> None:
    """Two conversions of old interpreters, fixed as later Triton releases fix them (only the
    interpreter, ``TRITON_INTERPRET=1``, runs this code):

    - a one-element tensor as a Python integer (a ``range`` bound: ``for start in range(lo, hi,
      BLOCK_N)``): before 3.7, ``int(array)``, which NumPy 2.4 refuses for arrays of one
      dimension; squeezed first;
    - a ``bool`` launch argument (the kernels' ``has_mask`` flags): Triton 3.6 stores it in a
      32-bit array typed ``int1`` and refuses its own value; passed as an integer.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    index = getattr(interpreter, "_patch_lang_tensor", None)
    if VERSION < (3, 7) and index is not None and not getattr(index, "_whiteformer", False):
        def patch_lang_tensor(tensor, *args, **kwargs):
            index(tensor, *args, **kwargs)
            tensor.__index__ = lambda self: int(self.handle.data.squeeze())

        patch_lang_tensor._whiteformer = True
        interpreter._patch_lang_tensor = patch_lang_tensor
    convert = getattr(interpreter, "_implicit_cvt", None)
    if convert is not None and not getattr(convert, "_whiteformer", False):
        try:
            convert(True)
        except ValueError:
            def implicit_cvt(arg):
                return convert(int(arg) if isinstance(arg, bool) else arg)

            implicit_cvt._whiteformer = True
            interpreter._implicit_cvt = implicit_cvt


_patch_interpreter()
