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
