"""The prefill/step protocol shared by the causal attention layers (CausalTSSA, CausalSelfAttention):
both implement ``CausalAttention``, and prefill on a prefix then step token by token gives the
outputs of one forward over the whole sequence (padded prefills included)."""
import pytest
import torch

from whiteformer.attention import CausalAttention, CausalSelfAttention, CausalTSSA, KVCache, build
from whiteformer.models.lm import CausalSelfAttention as LMCausalSelfAttention
from whiteformer.models.lm import KVCache as LMKVCache

DIM, HEADS = 24, 3


def _layers():
    torch.manual_seed(0)
    return {"causal_tssa": CausalTSSA(DIM, HEADS, max_len=16).double().eval(),
            "causal_mhsa": CausalSelfAttention(DIM, HEADS).double().eval()}


def test_both_layers_implement_the_protocol_and_models_lm_reexports():
    for layer in _layers().values():
        assert isinstance(layer, CausalAttention)
    assert not isinstance(torch.nn.Linear(2, 2), CausalAttention)
    assert LMCausalSelfAttention is CausalSelfAttention and LMKVCache is KVCache
    assert isinstance(build("causal_mhsa", DIM, num_heads=HEADS), CausalSelfAttention)


@pytest.mark.parametrize("name", ["causal_tssa", "causal_mhsa"])
@pytest.mark.parametrize("prefix", [0, 1, 5])
def test_prefill_then_step_equals_forward(name, prefix):
    layer = _layers()[name]
    x = torch.randn(2, 9, DIM, dtype=torch.float64)
    full = layer(x)
    outs, state = [], None
    if prefix:
        y, state = layer.prefill(x[:, :prefix])
        outs.append(y)
    for t in range(prefix, x.shape[1]):
        y_t, state = layer.step(x[:, t], state)
        outs.append(y_t[:, None])
    torch.testing.assert_close(torch.cat(outs, dim=1), full)


@pytest.mark.parametrize("name", ["causal_tssa", "causal_mhsa"])
def test_padded_prefill_then_step(name):
    """Left-padded prompts: after a masked prefill, stepping continues each sequence as if its
    padding were absent."""
    layer = _layers()[name]
    x = torch.randn(2, 6, DIM, dtype=torch.float64)
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1, :2] = False  # sequence 1: 2 pad tokens, then 2 real ones
    _, state = layer.prefill(x[:, :4], mask)
    y_t, _ = layer.step(x[:, 4], state)
    y_ref = layer(torch.cat([x[1:, 2:4], x[1:, 4:5]], dim=1))[:, -1]
    torch.testing.assert_close(y_t[1:], y_ref)


def test_step_refuses_a_foreign_state():
    layer = _layers()["causal_mhsa"]
    with pytest.raises(TypeError, match="state must be a KVCache or None, got tuple"):
        layer.step(torch.randn(2, DIM, dtype=torch.float64), state=(1, 2))


def test_packed_documents_come_in_one_unpadded_row():
    layer, cu = _layers()["causal_mhsa"], torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"with cu_seqlens, x must hold the packed documents in one row \(1, N, C\)"):
        layer(torch.randn(2, 5, DIM, dtype=torch.float64), cu_seqlens=cu)
    with pytest.raises(ValueError, match="attn_mask must be None"):
        layer(torch.randn(1, 5, DIM, dtype=torch.float64), torch.ones(1, 5, dtype=torch.bool), cu_seqlens=cu)


@pytest.mark.parametrize("name", ["causal_mhsa", "causal_tssa"])
def test_step_refuses_a_state_of_another_batch(name):
    """A cache of 2 sequences stepped with 3 tokens: a ValueError naming the state (the key/value
    cache failed inside torch.cat)."""
    layer = _layers()[name]
    _, state = layer.prefill(torch.randn(2, 5, DIM, dtype=torch.float64))
    with pytest.raises(ValueError, match="state"):
        layer.step(torch.randn(3, DIM, dtype=torch.float64), state)
