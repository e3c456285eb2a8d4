"""A Triton the kernels cannot use (older than they support, or one a kernel does not compile
with) makes the Triton backend fall back to the PyTorch path with one warning naming the Triton
version, instead of failing at the first call; forced with ``WHITEFORMER_BACKEND=triton``, the
error is raised.

No GPU here: the Triton backend's own kernels are registered for CPU tensors in a copy of the
registry (they run through Triton's interpreter), so the public ops go the way CUDA tensors go.
"""
import ast
import warnings

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'whiteformer[triton]')")

import whiteformer.ops._kernels.triton as tri  # noqa: E402
from whiteformer.ops import causal_tssa, tssa  # noqa: E402
from whiteformer.ops._kernels import BACKENDS, ENV_BACKEND, ENV_DISABLE, register_backend  # noqa: E402
from whiteformer.ops._kernels.triton import _compat, _tiles  # noqa: E402
from whiteformer.ops._kernels.triton import tssa as tri_tssa  # noqa: E402
from whiteformer.ops.reference import causal_tssa_reference, tssa_reference  # noqa: E402

if not _tiles.kernels_interpreted() and not torch.cuda.is_available():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it)",
                allow_module_level=True)


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """The Triton backend (its kernels, its availability) registered for CPU tensors; nothing
    broken yet; counts the calls of the Triton TSSA function."""
    monkeypatch.delenv(ENV_DISABLE, raising=False)
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    monkeypatch.setattr(_tiles, "BLOCK_N_MAX", 2)
    monkeypatch.setattr(_tiles, "CHUNK", 4)
    monkeypatch.setattr(tri, "_broken", [])
    monkeypatch.setattr("whiteformer.ops._kernels.registry.BACKENDS", BACKENDS.copy())
    register_backend("cpu", tri.DTYPES, tri.triton_available, kernels=BACKENDS["cuda"].kernels)
    calls = []
    real = tri_tssa.tssa_triton

    def counted(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(tri_tssa, "tssa_triton", counted)
    return calls


def _compile_error():
    """The error Triton 3.8 raised for the kernels' former ``tl.fdiv(..., approx=True)``."""
    return _compat.compile_errors()[0](None, ast.Name("div"), "TypeError: fdiv() got an unexpected keyword "
                                                           "argument 'approx'")


def _inputs():
    return torch.randn(2, 3, 6, 4), torch.rand(3, 1) + 0.5, torch.randn(3, 8, 1) * 0.3


def test_the_kernels_run_when_triton_is_usable(triton_on_cpu):
    w, temp, _ = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = tssa(w, temp)
    torch.testing.assert_close(out, tssa_reference(w, temp), rtol=1e-5, atol=1e-6)
    assert len(triton_on_cpu) == 1


def test_a_compile_failure_falls_back_with_one_warning(triton_on_cpu, monkeypatch):
    def fails(*args):
        triton_on_cpu.append(args)
        raise _compile_error()

    monkeypatch.setattr(tri_tssa, "tssa_triton", fails)
    w, temp, bias = _inputs()
    with pytest.warns(RuntimeWarning) as record:
        first, second = tssa(w, temp), tssa(w, temp)
        out = causal_tssa(w, temp, bias)
    assert len(record) == 1, [str(r.message) for r in record]
    message = str(record[0].message)
    assert f"Triton {triton.__version__}" in message and "approx" in message and "PyTorch path" in message
    assert len(triton_on_cpu) == 1  # the PyTorch path from then on: no second try
    torch.testing.assert_close(first, tssa_reference(w, temp), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(second, first)
    torch.testing.assert_close(out, causal_tssa_reference(w, temp, bias), rtol=1e-5, atol=1e-6)


def test_a_too_old_triton_is_not_used_and_named_once(triton_on_cpu, monkeypatch):
    monkeypatch.setattr(_compat, "VERSION", (3, 2))
    monkeypatch.setattr(triton, "__version__", "3.2.0")
    w, temp, bias = _inputs()
    with pytest.warns(RuntimeWarning) as record:
        out = tssa(w, temp)
        causal_tssa(w, temp, bias)
    assert len(record) == 1 and "Triton 3.2.0 is older than 3.3" in str(record[0].message)
    assert triton_on_cpu == []
    torch.testing.assert_close(out, tssa_reference(w, temp), rtol=1e-5, atol=1e-6)


def test_forced_backend_raises_the_compile_error(triton_on_cpu, monkeypatch):
    monkeypatch.setattr(tri_tssa, "tssa_triton", lambda *args: (_ for _ in ()).throw(_compile_error()))
    monkeypatch.setenv(ENV_BACKEND, "triton")
    w, temp, _ = _inputs()
    with pytest.raises(_compat.compile_errors()[0], match="approx"):
        tssa(w, temp)
