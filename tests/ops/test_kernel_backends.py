"""The kernel plug of whiteformer.ops._kernels: a backend registered under a name runs on any
device when WHITEFORMER_BACKEND names it (how the Triton kernels are tested on CPU), with the
documented kernel signatures; unknown names are a clear error; ``torch`` forces the PyTorch path."""
import pytest
import torch

from whiteformer.ops import causal_tssa, causal_tssa_step, tssa
from whiteformer.ops._kernels import BACKENDS, ENV_BACKEND, kernel_for, register_backend
from whiteformer.ops.causal_tssa.parallel import causal_tssa_parallel
from whiteformer.ops.causal_tssa.recurrent import causal_tssa_recurrent
from whiteformer.ops.reference import causal_tssa_reference, tssa_reference
from whiteformer.ops.tssa.parallel import tssa_parallel


@pytest.fixture
def fake_backend(monkeypatch):
    """A backend named "fake" for a device type no tensor here has; its kernels count calls."""
    calls = {"tssa": 0, "causal_tssa": 0, "causal_tssa_step": 0}

    def counted(op, fn):
        def kernel(*args):
            calls[op] += 1
            return fn(*args)
        return kernel

    monkeypatch.setattr("whiteformer.ops._kernels.registry.BACKENDS", BACKENDS.copy())
    register_backend("fakedev", (torch.float32,), lambda: True, name="fake", kernels={
        "tssa": counted("tssa", tssa_parallel),
        "causal_tssa": counted("causal_tssa", causal_tssa_parallel),
        "causal_tssa_step": counted("causal_tssa_step", causal_tssa_recurrent),
    })
    return calls


def _inputs(b=2, h=3, n=7, p=4):
    return torch.randn(b, h, n, p), torch.rand(h, 1) + 0.5, torch.randn(h, 16, 1) * 0.3


def test_forced_backend_runs_every_op_on_any_device(fake_backend, monkeypatch):
    w, temp, bias = _inputs()
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, :2] = False
    monkeypatch.setenv(ENV_BACKEND, "fake")
    torch.testing.assert_close(tssa(w, temp, mask), tssa_reference(w, temp, mask), rtol=1e-5, atol=1e-6)
    out, state = causal_tssa(w, temp, bias, mask, return_state=True)
    torch.testing.assert_close(out, causal_tssa_reference(w, temp, bias, mask), rtol=1e-5, atol=1e-6)
    step, _ = causal_tssa_step(torch.randn(2, 3, 4), state, temp, bias)
    assert step.shape == (2, 3, 4)
    assert fake_backend == {"tssa": 1, "causal_tssa": 1, "causal_tssa_step": 1}
    # a dtype the backend does not declare: the default choice, with a warning
    with pytest.warns(RuntimeWarning, match="no tssa kernel for torch.float64"):
        tssa(w.double(), temp.double())
    assert fake_backend["tssa"] == 1
    # dropout in training always takes the PyTorch path
    tssa(w, temp, attn_drop=0.5, training=True)
    assert fake_backend["tssa"] == 1


def test_backend_names(fake_backend, monkeypatch):
    w, temp, _ = _inputs()
    monkeypatch.setenv(ENV_BACKEND, "no-such-backend")
    with pytest.raises(ValueError, match="WHITEFORMER_BACKEND='no-such-backend'.*fake"):
        tssa(w, temp)
    for name in ("torch", "auto", ""):
        monkeypatch.setenv(ENV_BACKEND, name)
        assert kernel_for("tssa", w) is None
        tssa(w, temp)
    assert fake_backend["tssa"] == 0


def test_register_backend_rejects_unknown_ops(monkeypatch):
    monkeypatch.setattr("whiteformer.ops._kernels.registry.BACKENDS", BACKENDS.copy())
    with pytest.raises(ValueError, match="unknown op names"):
        register_backend("fakedev", (torch.float32,), lambda: True, kernels={"tsa": tssa_parallel})
