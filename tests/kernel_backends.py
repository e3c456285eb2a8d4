"""Every kernel backend a test runs the ops on: the PyTorch path (``torch``), the C++ kernels
(``cpu``) and the Triton kernels (``triton``, on CPU through Triton's interpreter, which
tests/conftest.py turns on). :func:`use_backend` selects one for a test through the environment
switches, with tiny chunks and token blocks, so that documents cross them."""
import pytest

from whiteformer.ops._kernels import ENV_BACKEND, ENV_DISABLE

BACKENDS = {
    "torch": {ENV_DISABLE: "1"},
    "cpu": {ENV_BACKEND: "cpu"},
    "triton": {ENV_BACKEND: "triton"},
}


def use_backend(name: str, monkeypatch) -> str:
    """Run the ops of this test on backend ``name`` (skipped where it cannot run); returns ``name``."""
    import whiteformer.ops._kernels.fused as fused
    import whiteformer.ops.layout as layout

    if name != "torch":  # the kernels' padded layout, however much it pads
        monkeypatch.setattr(layout, "PADDED_WASTE_MAX", float("inf"))
    if name == "cpu":
        from whiteformer.ops._kernels.build import fast_path_available

        if not fast_path_available():
            pytest.skip("C++ kernel not built on this machine")
        monkeypatch.setattr(fused, "CHUNK", 4)  # documents cross the kernel's chunk boundaries
    if name == "triton":
        pytest.importorskip("triton")
        from whiteformer.ops._kernels.triton import _tiles

        monkeypatch.setattr(_tiles, "BLOCK_N_MAX", 2)  # documents cross the kernels' token blocks and chunks
        monkeypatch.setattr(_tiles, "CHUNK", 4)
    for k, v in BACKENDS[name].items():
        monkeypatch.setenv(k, v)
    return name
