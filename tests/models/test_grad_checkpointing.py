"""timm's ``set_grad_checkpointing`` on every model family: the same loss and gradients as without,
and the blocks really recomputed in backward."""
import pytest
import torch

from tiny_models import FAMILIES, tiny


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_set_grad_checkpointing_same_loss_and_gradients(name):
    model, inputs, loss_of = tiny(name)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(1)  # the same dropout masks in both runs
    loss = loss_of(model(*inputs))
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    model.set_grad_checkpointing(True)
    blocks = model.transformer.h if hasattr(model, "transformer") else model.blocks
    calls = []
    hook = blocks[0].register_forward_pre_hook(lambda *a: calls.append(1))
    torch.manual_seed(1)
    loss2 = loss_of(model(*inputs))
    grads2 = torch.autograd.grad(loss2, params, allow_unused=True)
    hook.remove()
    assert len(calls) == 2, "the first block should run again in backward"
    torch.testing.assert_close(loss2, loss)
    for a, b in zip(grads2, grads):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a, b)
    with torch.no_grad():  # no gradients recorded: nothing to checkpoint
        calls.clear()
        model(*inputs)
    model.set_grad_checkpointing(False)
    assert not model.grad_checkpointing
    with pytest.raises(TypeError, match="enable"):
        model.set_grad_checkpointing("yes")


def test_dropout_replays_under_checkpointing():
    from whiteformer.models import create_model

    torch.manual_seed(0)
    model = create_model("tost_lm_base", vocab_size=40, dim=16, depth=2, num_heads=2, max_len=16, dropout=0.3).train()
    idx = torch.randint(0, 40, (2, 12))
    torch.manual_seed(1)
    loss = model(idx, idx)[1]
    grads = torch.autograd.grad(loss, list(model.parameters()))
    model.set_grad_checkpointing()
    torch.manual_seed(1)
    loss2 = model(idx, idx)[1]
    grads2 = torch.autograd.grad(loss2, list(model.parameters()))
    torch.testing.assert_close(loss2, loss)
    for a, b in zip(grads2, grads):
        torch.testing.assert_close(a, b)
