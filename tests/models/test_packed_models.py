"""Packed documents (``cu_seqlens``) through the layers and the language models: each document
gets the result it has alone, forward and gradients; the loss never crosses a boundary."""
import pytest
import torch
import torch.nn.functional as F

from whiteformer.attention import TSSA, CausalTSSA
from whiteformer.attention.causal import CausalSelfAttention
from whiteformer.models import create_model

LENGTHS = [1, 6, 3, 9]


def _cu(lengths):
    return torch.tensor([0] + lengths).cumsum(0).to(torch.int32)


def _split(x, lengths, dim=1):
    return torch.split(x, lengths, dim=dim)


@pytest.mark.parametrize("layer", [TSSA(16, num_heads=2), CausalTSSA(16, num_heads=2, max_len=12),
                                   CausalSelfAttention(16, num_heads=2)], ids=lambda m: type(m).__name__)
def test_layer_packed_equals_alone(layer):
    torch.manual_seed(0)
    layer = layer.double()
    if getattr(layer, "pos_bias", None) is not None:
        torch.nn.init.normal_(layer.pos_bias, std=0.3)
    x = torch.randn(1, sum(LENGTHS), 16, dtype=torch.float64, requires_grad=True)
    y = layer(x, cu_seqlens=_cu(LENGTHS))
    alone = torch.cat([layer(part) for part in _split(x, LENGTHS)], dim=1)
    torch.testing.assert_close(y, alone)
    g = torch.randn_like(y)
    params = [p for p in layer.parameters()]
    got = torch.autograd.grad((y * g).sum(), [x, *params])
    want = torch.autograd.grad((alone * g).sum(), [x, *params])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_causal_tssa_prefill_packed_gives_one_state_per_document():
    torch.manual_seed(0)
    layer = CausalTSSA(16, num_heads=2, max_len=12)
    x = torch.randn(1, sum(LENGTHS), 16)
    _, state = layer.prefill(x, cu_seqlens=_cu(LENGTHS))
    assert state.t.tolist() == LENGTHS
    for s, part in enumerate(_split(x, LENGTHS)):
        _, alone = layer.prefill(part)
        torch.testing.assert_close(state.sum_sq_pi[s], alone.sum_sq_pi[0])


@pytest.mark.parametrize("name", ["tost_lm_base", "gpt_base"])
def test_lm_packed_equals_alone_and_loss_stays_in_documents(name):
    torch.manual_seed(0)
    model = create_model(name, vocab_size=50, dim=16, depth=2, num_heads=2, max_len=10)
    for p in model.parameters():  # layer scale and position bias away from their tiny/zero init
        if p.dim() == 1 or p.shape[-1] == 1:
            torch.nn.init.normal_(p, std=0.5)
    docs = [torch.randint(0, 50, (n,)) for n in LENGTHS]
    idx = torch.cat(docs)[None]
    stream_targets = torch.cat([idx[0, 1:], torch.tensor([-1])])[None]  # the row as one stream
    logits, loss = model(idx, stream_targets, cu_seqlens=_cu(LENGTHS))
    alone = torch.cat([model(d[None])[0] for d in docs], dim=1)
    torch.testing.assert_close(logits, alone)
    # expected: every document's next-token loss inside itself, summed over all documents
    total = sum(F.cross_entropy(model(d[None])[0][0, :-1], d[1:], reduction="sum") for d in docs if len(d) > 1)
    count = sum(len(d) - 1 for d in docs)
    torch.testing.assert_close(loss, total / count)
    _, chunked = model(idx, stream_targets, loss_chunk=5, cu_seqlens=_cu(LENGTHS))
    torch.testing.assert_close(chunked, loss)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    want = torch.autograd.grad(total / count, list(model.parameters()))
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b)


def test_lm_packed_checks():
    model = create_model("tost_lm_base", vocab_size=50, dim=16, depth=1, num_heads=2, max_len=8)
    idx = torch.randint(0, 50, (1, 12))
    model(idx, cu_seqlens=_cu([4, 8]))  # 12 tokens, no document longer than max_len
    with pytest.raises(ValueError, match="context limit"):
        model(idx, cu_seqlens=_cu([3, 9]))
    with pytest.raises(ValueError, match="one row"):
        model(idx.expand(2, -1), cu_seqlens=_cu([4, 8]))
    with pytest.raises(ValueError, match="end at"):
        model(idx, cu_seqlens=_cu([4, 7]))
