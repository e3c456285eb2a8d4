"""tost_gpt_base (HybridGPTLM): causal TSSA in the GPT shell, softmax kept in chosen blocks."""
import pytest
import torch

import whiteformer
from whiteformer.attention.causal import CausalSelfAttention, KVCache
from whiteformer.attention.tssa import CausalTSSA
from whiteformer.models.lm import GPTLM, ToSTLM

KW = dict(vocab_size=50, dim=32, depth=3, num_heads=4, max_len=64, bias=True, mlp_act="gelu_tanh")


def test_parameters_are_the_gpt_shells_with_tssa_attention():
    with torch.device("meta"):
        full = whiteformer.create_model("tost_gpt_base")
        tost, gpt = whiteformer.create_model("tost_lm_base"), whiteformer.create_model("gpt_base")
    assert full.get_num_params() == tost.get_num_params()  # the same shell and attention as ToST-base
    hybrid = whiteformer.create_model("tost_gpt_base", **KW, keep_softmax=[1])
    assert [type(b.attn) for b in hybrid.transformer.h] == [CausalTSSA, CausalSelfAttention, CausalTSSA]
    kept = whiteformer.create_model("gpt_base", **KW).state_dict()
    mine = hybrid.state_dict()
    assert all(mine[k].shape == v.shape for k, v in kept.items() if not k.startswith(("transformer.h.0.attn",
                                                                                      "transformer.h.2.attn")))
    assert isinstance(gpt, GPTLM) and isinstance(tost, ToSTLM)


def test_steps_equal_the_parallel_forward_and_only_kept_layers_grow(tmp_path):
    torch.manual_seed(0)
    model = whiteformer.create_model("tost_gpt_base", **KW, keep_softmax=[1], init_values=1.0).eval()
    idx = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        full, _ = model(idx)
        logits, state = model.prefill(idx[:, :6])
        steps = [logits[:, -1]]
        for t in range(6, 12):
            out, state = model.step(idx[:, t], state)
            steps.append(out)
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 5:], rtol=1e-4, atol=1e-4)
    assert isinstance(state.layers[1], KVCache) and not isinstance(state.layers[0], KVCache)
    model.save_pretrained(tmp_path / "m")
    loaded = whiteformer.from_pretrained(tmp_path / "m").eval()
    assert loaded.keep_softmax == [1]
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx)[0], full)


@pytest.mark.parametrize("keep", [[3], [0, 0], "0"])
def test_bad_keep_softmax_is_refused(keep):
    with pytest.raises((ValueError, TypeError), match="keep_softmax"):
        whiteformer.create_model("tost_gpt_base", **KW, keep_softmax=keep)
