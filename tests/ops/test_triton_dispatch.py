"""The public ops on the Triton kernels: ``WHITEFORMER_BACKEND=triton`` runs them on
CPU tensors through Triton's interpreter with the same signatures, outputs and autograd as the
PyTorch path; clear errors when they cannot run; nothing changes without the variable. A GPU
test (skipped without CUDA) compares the compiled kernels with the PyTorch path on the GPU.

``TRITON_INTERPRET`` is set by tests/conftest.py before anything imports triton (see
tests/ops/test_triton_kernels.py)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'whiteformer[triton]')")

import whiteformer.ops._kernels.triton as tri  # noqa: E402
from whiteformer.attention import TSSA, CausalTSSA  # noqa: E402
from whiteformer.ops import causal_tssa, causal_tssa_step, tssa  # noqa: E402
from whiteformer.ops._kernels import BACKENDS, ENV_BACKEND, ENV_DISABLE, kernel_for  # noqa: E402
from whiteformer.ops._kernels.triton import _tiles  # noqa: E402
from whiteformer.ops._kernels.triton import causal_tssa as tri_causal  # noqa: E402
from whiteformer.ops._kernels.triton import causal_tssa_step as tri_step  # noqa: E402
from whiteformer.ops._kernels.triton import tssa as tri_tssa  # noqa: E402
from whiteformer.ops._kernels.triton._scaling import kernel_scale  # noqa: E402
from whiteformer.ops.reference import causal_tssa_reference, tssa_reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

if not _tiles.kernels_interpreted() and not torch.cuda.is_available():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it)",
                allow_module_level=True)


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of the three Triton entry points; env: no kernel switches set."""
    monkeypatch.delenv(ENV_DISABLE, raising=False)
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    monkeypatch.setattr(_tiles, "BLOCK_N_MAX", 2)
    monkeypatch.setattr(_tiles, "CHUNK", 4)
    counts = {"tssa": 0, "causal_tssa": 0, "causal_tssa_step": 0}
    for mod, name, op in ((tri_tssa, "tssa_triton", "tssa"), (tri_causal, "causal_tssa_triton", "causal_tssa"),
                          (tri_step, "causal_tssa_step_triton", "causal_tssa_step")):
        def counted(*args, _fn=getattr(mod, name), _op=op):
            counts[_op] += 1
            return _fn(*args)
        monkeypatch.setattr(mod, name, counted)
    return counts


def _close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.detach().abs().max()) + 1e-7)


def _inputs(b=2, h=3, n=6, p=4):
    w = torch.randn(b, h, n, p, requires_grad=True)
    temp = ((torch.rand(h, 1) + 0.5) * min(1.0, 8 / p)).requires_grad_(True)  # logits O(1) at any head dim
    bias = (torch.randn(h, 10, 1) * 0.3).requires_grad_(True)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[-1, :2] = False  # left padding
    return w, temp, bias, mask


def test_registered_for_cuda():
    entry = BACKENDS["cuda"]
    assert entry.name == "triton" and set(entry.kernels) == {"tssa", "causal_tssa", "causal_tssa_step"}
    assert {torch.float16, torch.bfloat16, torch.float32} <= set(entry.dtypes)


@pytest.mark.parametrize("p", [4, 16, 32, 64, 128, 256])
def test_forced_backend_public_ops_match_reference(calls, monkeypatch, p):
    w, temp, bias, mask = _inputs(p=p)
    monkeypatch.setenv(ENV_BACKEND, "triton")
    out, pi = tssa(w, temp, mask, return_pi=True)
    ref_out, ref_pi = tssa_reference(w, temp, mask, return_pi=True)
    _close(out, ref_out)
    _close(pi, ref_pi)
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad((out * g).sum(), (w, temp)), torch.autograd.grad((ref_out * g).sum(), (w, temp))):
        _close(a, r)
    out, pi, state = causal_tssa(w, temp, bias, mask, return_pi=True, return_state=True)
    ref_out, ref_pi = causal_tssa_reference(w, temp, bias, mask, return_pi=True)
    _close(out, ref_out)
    _close(pi, ref_pi)
    params = (w, temp, bias)
    for a, r in zip(torch.autograd.grad((out * g).sum(), params), torch.autograd.grad((ref_out * g).sum(), params)):
        _close(a, r)
    assert torch.equal(state.t, mask.sum(-1))
    # continuing token by token from the state = running the longer sequence (per-sequence positions)
    x = torch.randn(2, 3, p)
    step, pi_t, new_state = causal_tssa_step(x, state, temp, bias, return_pi=True)
    with torch.no_grad():
        full = causal_tssa_reference(torch.cat([w, x[:, :, None]], 2), temp, bias,
                                     torch.cat([mask, torch.ones(2, 1, dtype=torch.bool)], 1))
    _close(step, full[:, :, -1])
    assert torch.equal(new_state.t, state.t + 1)
    assert calls == {"tssa": 1, "causal_tssa": 1, "causal_tssa_step": 1}


def test_layers_unchanged_under_the_forced_backend(calls, monkeypatch):
    x = torch.randn(2, 6, 16)
    for layer in (TSSA(16, num_heads=4), CausalTSSA(16, num_heads=4, max_len=8)):
        layer.eval()
        monkeypatch.setenv(ENV_BACKEND, "torch")
        expected = layer(x)
        monkeypatch.setenv(ENV_BACKEND, "triton")
        _close(layer(x), expected)
    assert calls["tssa"] == 1 and calls["causal_tssa"] == 1


def test_double_backward_through_the_kernels(calls, monkeypatch):
    """create_graph=True (gradient penalties): the backward recomputes in PyTorch, differentiably."""
    w, temp, bias, mask = _inputs(1, 2, 5, 3)

    def penalty(fn):
        out = fn()
        (gw,) = torch.autograd.grad(out.square().sum(), w, create_graph=True)
        return torch.autograd.grad(gw.square().sum(), (w, temp))

    for fn in (lambda: tssa(w, temp, mask), lambda: causal_tssa(w, temp, bias, mask)):
        monkeypatch.setenv(ENV_BACKEND, "torch")
        expected = penalty(fn)
        monkeypatch.setenv(ENV_BACKEND, "triton")
        for a, r in zip(penalty(fn), expected):
            _close(a, r, 1e-4)
    assert calls["tssa"] == 1 and calls["causal_tssa"] == 1


def test_default_choice_on_cpu_and_the_switches(calls, monkeypatch):
    w, temp, _, _ = _inputs()
    w = w.detach().half()  # a dtype the CPU C++ kernel does not take: no build of it here
    tssa(w, temp)
    causal_tssa(w, temp)
    causal_tssa_step(w[:, :, 0], None, temp)
    assert calls == {"tssa": 0, "causal_tssa": 0, "causal_tssa_step": 0}  # CPU: never without the variable
    monkeypatch.setenv(ENV_BACKEND, "triton")
    monkeypatch.setenv(ENV_DISABLE, "1")
    tssa(w, temp)
    assert calls["tssa"] == 0 and kernel_for("tssa", w) is None  # the disable switch wins


def test_clear_error_without_triton(calls, monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "triton")
    monkeypatch.setattr(tri, "_import_error", lambda: "the 'triton' package is not installed (pip install x)")
    w, temp, _, _ = _inputs()
    with pytest.raises(RuntimeError, match="WHITEFORMER_BACKEND=triton: the 'triton' package is not installed"):
        tssa(w, temp)
    monkeypatch.delenv(ENV_BACKEND)
    assert not tri.triton_available()  # not forced: CUDA tensors would take the PyTorch path


def test_clear_error_on_cpu_without_the_interpreter(tmp_path):
    code = textwrap.dedent("""
        import torch
        from whiteformer.ops import tssa
        tssa(torch.randn(1, 2, 3, 4), torch.ones(2, 1))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(WHITEFORMER_BACKEND="triton", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "RuntimeError: WHITEFORMER_BACKEND=triton on cpu tensors runs Triton's interpreter: set " \
           "TRITON_INTERPRET=1 in the environment before triton is first imported" in res.stderr, res.stderr[-2000:]


def test_custom_ops_pass_opcheck():
    """Fake (meta) implementations, schemas and autograd registrations agree with the kernels."""
    w = torch.randn(1, 2, 3, 2, dtype=torch.float64)
    temp = torch.rand(2, 1, dtype=torch.float64) + 0.5
    mask = torch.tensor([[True, False, True]])
    tests = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(tri_tssa._fwd, (w, temp, mask), test_utils=tests)
    torch.library.opcheck(tri_causal._fwd, (w, temp, torch.randn(1, 2, 3, dtype=torch.float64), mask),
                          test_utils=tests)
    x, e = torch.randn(2, 2, 2, dtype=torch.float64), torch.rand(2, 2, 2, dtype=torch.float64)
    m = torch.rand(2, 2, dtype=torch.float64)
    scl = kernel_scale(x, 1)[1]  # the per-(sequence, head) [1 / c, c, eps / c^2]
    torch.library.opcheck(tri_step._fwd, (x, e, m, e.clone(), temp.view(2), None, scl), test_utils=tests)


GPU_SCRIPT = """
import torch
from whiteformer.ops import causal_tssa, tssa
import os
for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 1e-2), (torch.bfloat16, 5e-2)):
    w = torch.randn(2, 8, 1000, 64, device="cuda", dtype=dtype, requires_grad=True)
    temp = torch.rand(8, 1, device="cuda", requires_grad=True)
    bias = torch.randn(8, 1024, 1, device="cuda", requires_grad=True)
    mask = torch.rand(2, 1000, device="cuda") > 0.2
    for fn, params in ((lambda: tssa(w, temp, mask), (w, temp)), (lambda: causal_tssa(w, temp, bias, mask), (w, temp, bias))):
        res = {}
        for backend in ("triton", "torch"):
            os.environ["WHITEFORMER_BACKEND"] = backend
            out = fn()
            res[backend] = (out, *torch.autograd.grad(out.float().square().sum(), params))
        for a, b in zip(*res.values()):
            err = (a.double() - b.double()).abs().max() / b.double().abs().max()
            assert err < tol, (dtype, float(err))
print("ok")
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernels_match_the_pytorch_path():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels, not the interpreter
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", GPU_SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
