"""``torch.compile(fullgraph=True)`` of every model family: the forward and a training step trace
as one graph (no graph break: input checks that read values are skipped while tracing), with the
``aot_eager`` backend (no C compiler), and give the eager results."""
import pytest
import torch

from tiny_models import FAMILIES, tiny

pytestmark = pytest.mark.compile


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_forward_and_training_step_compile_without_graph_breaks(name):
    model, inputs, loss_of = tiny(name)
    model.eval()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(loss_of(compiled(*inputs)), loss_of(model(*inputs)))
    model.train()  # a training step: the compiled forward (and its AOT backward graph), then backward
    params = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(1)
    want = loss_of(model(*inputs))
    want_grads = torch.autograd.grad(want, params, allow_unused=True)
    torch.manual_seed(1)
    got = loss_of(compiled(*inputs))
    got.backward()
    torch.testing.assert_close(got, want)
    for p, g in zip(params, want_grads):
        if g is None:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5)


def test_packed_batches_compile_with_one_graph_break_and_fullgraph_names_why():
    import whiteformer

    model = whiteformer.create_model("tost_lm_base", dim=16, depth=1, num_heads=2).eval()
    idx, cu = torch.randint(0, 60, (1, 10)), torch.tensor([0, 4, 10], dtype=torch.int32)
    with torch.no_grad():
        want = model(idx, cu_seqlens=cu)[0]
        torch.testing.assert_close(torch.compile(model, backend="aot_eager")(idx, cu_seqlens=cu)[0], want)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="cu_seqlens: packed batches read their segment boundaries"):
            torch.compile(model, fullgraph=True, backend="aot_eager")(idx, cu_seqlens=cu)


def test_first_compile_in_a_fresh_process_traces_the_export_switch():
    """The export switch reads the ONNX exporter's flag module; a compile that imports that module
    while it traces must not invalidate its own guard (it did only in a fresh process, where no
    earlier test had imported it)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch, whiteformer
        m = whiteformer.create_model("tost_lm_base", dim=32, depth=2, num_heads=2, vocab_size=100,
                                     max_len=64).eval()
        idx = torch.randint(0, 100, (1, 16))
        with torch.no_grad():
            got = torch.compile(m, fullgraph=True, backend="aot_eager")(idx)  # the first call: compiles
            want = m(idx)
        torch.testing.assert_close(got, want)
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
