"""Functional attention operators. Shapes: B batch, H heads, N tokens, p head dim.

Layout (in the manner of flash-linear-attention's ``fla/ops``): an operator with several
implementations (kernels) has its own folder, the others are one module each.

* ``tssa/``: :func:`tssa` (ToST Eq. (11)); ``dispatch.py`` (public function: checks, kernel
  choice), ``parallel.py`` (the one differentiable PyTorch implementation: fallback path and
  the fused kernels' double backward).
* ``causal_tssa/``: :func:`causal_tssa`, :func:`causal_tssa_step`, :class:`CausalTSSAState`
  (ToST Eq. (28)); ``dispatch.py``, ``parallel.py`` (prefix sums), ``recurrent.py`` (the step:
  the parallel form on one token from a state), ``state.py``.
* ``dmsa.py`` (+ ``rotary.py``), ``eca.py``, ``baselines.py`` (mhsa, xca, mssa, class_attention):
  one PyTorch implementation each.
* ``packing.py``: packed documents (``cu_seqlens``, FlashAttention's convention) for ``tssa`` /
  ``causal_tssa``: validation and the padded layout every kernel backend runs them in.
* ``reference/``: plain, literal versions of every operator, the oracle the main versions are
  tested against (forward and gradients, float64 gradcheck).
* ``context_parallel.py``: context parallelism (``group=`` of :func:`tssa`, :func:`causal_tssa`,
  :func:`class_attention`): autograd-aware collectives that combine the per-rank token sums of a
  sequence split over processes, the chunk layout, a byte log. The split ops run the PyTorch
  paths (no fused kernel takes combined statistics).
* ``constants.py``: the epsilons, shared by every implementation (also compiled into the C++
  kernel).
* ``_kernels/``: the kernel backends of the TSSA operators. ``__init__.py`` is the plug that
  chooses, per call, between a registered backend and the PyTorch path
  (:func:`~whiteformer.ops._kernels.register_backend`, documented there: how a device backend
  such as Triton on CUDA registers kernels for ``tssa`` / ``causal_tssa`` / ``causal_tssa_step``);
  ``fused.py`` the ``torch.library`` custom ops ``whiteformer::tssa_fused_fwd`` / ``_bwd`` and
  ``whiteformer::causal_tssa_fused_fwd`` / ``_bwd`` (hand-derived backward, fake tensors,
  ``torch.compile``); ``build.py`` builds and loads the C++/OpenMP CPU kernel ``tssa_cpu.cpp``.

While a graph is exported (``torch.export``, ``torch.onnx.export``) the TSSA operators take their
PyTorch path and ECA's basis uses matrix products only, so exported programs hold standard
operators (:func:`whiteformer.ops._kernels.exporting`).

Environment variables (read at each call in eager mode; fixed when a graph is compiled):

* ``WHITEFORMER_DISABLE_KERNELS=1``: always the PyTorch path.
* ``WHITEFORMER_BACKEND=<name>``: run the kernels of the backend registered under that name on any
  device (e.g. ``triton`` on CPU tensors under ``TRITON_INTERPRET=1``); ``torch`` means the
  PyTorch path, ``auto`` (or unset) the choice by device type and dtype.
* ``WHITEFORMER_KERNEL_CACHE``: where the C++ kernel is built and kept (default
  ``$XDG_CACHE_HOME/whiteformer/kernels``, i.e. ``~/.cache/whiteformer/kernels``), one directory
  per build key (source text, flags, Python, torch), shared by every checkout. The first use on a
  machine builds it (about a minute, announced on stderr) under an OS lock that dies with its
  process, so a killed build never blocks the next one.
* ``WHITEFORMER_KERNEL_BUILD_TIMEOUT``: seconds to wait for another process's build (default 600),
  then the PyTorch path with a warning.

Every operator checks its arguments (shapes, dtypes, devices) before any kernel runs and raises a
``ValueError``/``TypeError`` naming the argument.
"""

# --- tssa / causal_tssa ---
from .tssa import tssa  # noqa: F401
from .causal_tssa import CausalTSSAState, causal_tssa, causal_tssa_step  # noqa: F401
# --- the token layout of a batch (padding, packed documents, context parallelism), built once ---
from .layout import TokenLayout  # noqa: F401
# --- dmsa ---
from .dmsa import dmsa, sparsemax  # noqa: F401
from .rotary import rotary  # noqa: F401
# --- eca ---
from .eca import eca_compress, eca_expand, eca_omega, orthonormal_basis  # noqa: F401
from .eca import cholesky_fallback_count, cholesky_stats, reset_cholesky_fallback_count  # noqa: F401
# --- baselines: mhsa, xca, mssa, class_attention ---
from .baselines import class_attention, mhsa, mhsa_explicit, mssa, xca  # noqa: F401
# --- chunked LM-head cross-entropy ---
from .linear_cross_entropy import linear_cross_entropy  # noqa: F401

__all__ = ["tssa", "causal_tssa", "causal_tssa_step", "CausalTSSAState", "TokenLayout", "dmsa", "sparsemax", "rotary", "eca_compress",
           "eca_expand", "eca_omega", "orthonormal_basis", "cholesky_fallback_count", "cholesky_stats",
           "reset_cholesky_fallback_count", "class_attention", "mhsa", "mhsa_explicit", "mssa", "xca",
           "linear_cross_entropy"]
