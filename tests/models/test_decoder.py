"""The Llama-style decoder (softmax, causal TSSA, hybrid): the cached step against the full
forward, padded and packed batches against separate runs, the generation state's size, the
rotary embedding's invariants, save/load, bad arguments."""
import pytest
import torch

from whiteformer import create_model, from_pretrained
from whiteformer.attention import CausalTSSA, KVCache
from whiteformer.models.decoder import DecoderLM, RotaryCausalAttention
from whiteformer.models.decoder.layers import apply_rope, rope_cos_sin, rope_inv_freq
from whiteformer.ops import CausalTSSAState

TINY = dict(vocab_size=53, dim=32, depth=3, num_heads=4, num_kv_heads=2, intermediate_size=40)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
VARIANTS = {
    "softmax": dict(TINY, rope_theta=500.0, rope_scaling=LLAMA3, qkv_bias=True),
    "tssa": dict(TINY, attention="tssa"),
    "hybrid": dict(TINY, attention="tssa", keep_softmax=[1], tie_embeddings=False),
}


def _model(variant, **kw):
    torch.manual_seed(0)
    model = create_model("decoder_base", **{**VARIANTS[variant], **kw}).double().eval()
    with torch.no_grad():  # biases and gains away from their init, so that they matter
        for name, p in model.named_parameters():
            if name.endswith(("bias", "ln_1.weight", "ln_2.weight", "temp")):
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_cached_step_equals_the_full_forward(variant):
    model = _model(variant)
    idx = torch.randint(0, 53, (2, 11))
    with torch.no_grad():
        full = model(idx)[0]
        logits, state = model.prefill(idx[:, :4])
        steps = [logits[:, -1]]
        for t in range(4, 11):
            logits_t, state = model.step(idx[:, t], state)
            steps.append(logits_t)
    torch.testing.assert_close(logits, full[:, :4])
    torch.testing.assert_close(torch.stack(steps[:-1], 1), full[:, 3:10])
    torch.testing.assert_close(steps[-1], full[:, 10])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_generation_with_the_state_equals_re_running_the_sequence(variant):
    model = _model(variant)
    idx = torch.randint(0, 53, (2, 6))
    cached = model.generate(idx, 8, temperature=0)
    assert torch.equal(cached, model.generate(idx, 8, temperature=0, use_cache=False))


@pytest.mark.parametrize("variant", ["softmax", "hybrid"])
def test_a_left_padded_batch_equals_each_sequence_alone(variant):
    model = _model(variant)
    a, b = torch.randint(0, 53, (1, 7)), torch.randint(0, 53, (1, 4))
    idx = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), b], 1)])
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, :3] = False
    with torch.no_grad():
        logits, state = model.prefill(idx, attn_mask=mask)
        nxt = torch.randint(0, 53, (2,))
        step, _ = model.step(nxt, state)
        alone_a = model(torch.cat([a, nxt[:1, None]], 1))[0]
        alone_b = model(torch.cat([b, nxt[1:, None]], 1))[0]
    torch.testing.assert_close(logits[0], alone_a[0, :7])
    torch.testing.assert_close(logits[1, 3:], alone_b[0, :4])
    torch.testing.assert_close(step, torch.cat([alone_a[:, -1], alone_b[:, -1]]))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_packed_documents_equal_separate_runs(variant):
    model = _model(variant)
    docs = [torch.randint(0, 53, (1, n)) for n in (5, 1, 8)]
    cu = torch.tensor([0, 5, 6, 14], dtype=torch.int32)
    targets = torch.randint(0, 53, (1, 14))
    with torch.no_grad():
        packed, loss = model(torch.cat(docs, 1), targets, cu_seqlens=cu)
        alone = torch.cat([model(d)[0] for d in docs], 1)
    torch.testing.assert_close(packed, alone)
    assert torch.isfinite(loss)


def test_the_tssa_state_keeps_its_size_and_kept_softmax_layers_cache_keys():
    model = _model("hybrid")
    sizes = {}
    for n in (4, 40):
        _, state = model.prefill(torch.randint(0, 53, (1, n)))
        _, state = model.step(torch.tensor([3]), state)
        sizes[n] = [sum(t.numel() for t in s if isinstance(t, torch.Tensor)) for s in state.layers]
        assert [type(s) for s in state.layers] == [CausalTSSAState, KVCache, CausalTSSAState]
    assert sizes[4][0] == sizes[40][0] and sizes[4][2] == sizes[40][2]  # TSSA: constant
    assert sizes[40][1] > sizes[4][1]  # the softmax layer's cache grows with the prompt
    assert [type(b.attn) for b in model.transformer.h] == [CausalTSSA, RotaryCausalAttention, CausalTSSA]


def test_an_all_tssa_model_has_no_length_limit_and_a_constant_state():
    model = create_model("tost_decoder_base", **{**TINY, "depth": 2}).eval()
    assert model.context_limit is None and not model.keep_softmax
    states = [model.prefill(torch.randint(0, 53, (1, n)))[1] for n in (3, 300)]
    assert [[t.shape for t in s[:3]] for s in states[0].layers] == [[t.shape for t in s[:3]] for s in states[1].layers]


def test_the_context_limit_crops_generation_and_refuses_a_longer_forward():
    model = _model("softmax", max_len=8)
    with pytest.raises(ValueError, match="max_len=None"):
        model(torch.randint(0, 53, (1, 9)))
    out = model.generate(torch.randint(0, 53, (1, 6)), 5, temperature=0)
    assert out.shape == (1, 11)


def test_rope_preserves_norms_and_scores_depend_on_the_offset_only():
    inv = rope_inv_freq(8, 500.0, {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    plain = rope_inv_freq(8, 500.0)
    assert not torch.equal(inv, plain) and torch.equal(inv[0], plain[0])  # low frequencies scaled, the highest kept
    torch.testing.assert_close(rope_inv_freq(8, 500.0, {"rope_type": "linear", "factor": 2.0}), plain / 2)
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)

    def rot(x, pos):
        return apply_rope(x, *rope_cos_sin(torch.tensor([pos]), inv))

    torch.testing.assert_close(rot(q, 7).norm(), q.norm())
    torch.testing.assert_close((rot(q, 9) * rot(k, 4)).sum(), (rot(q, 25) * rot(k, 20)).sum())


def test_save_and_load_round_trip(tmp_path):
    model = _model("hybrid").float()
    model.save_pretrained(tmp_path / "m")
    back = from_pretrained(tmp_path / "m").eval()
    assert isinstance(back, DecoderLM) and back.keep_softmax == [1] and back.lm_head.weight is not \
        back.transformer.wte.weight
    idx = torch.randint(0, 53, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(back(idx)[0], model(idx)[0])


def test_tied_embeddings_share_one_weight():
    model = create_model("decoder_base", **TINY)
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.parametrize("kw, match", [
    (dict(num_kv_heads=3), "num_kv_heads"),
    (dict(head_dim=7), "head_dim"),
    (dict(keep_softmax=[0]), "attention='tssa'"),
    (dict(attention="tssa", keep_softmax=[3]), "keep_softmax"),
    (dict(attention="tssa", keep_softmax=[1, 1]), "keep_softmax"),
    (dict(attention="linear"), "attention"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "yarn"),
    (dict(rope_scaling={"rope_type": "linear"}), "factor"),
    (dict(rope_theta=0.0), "rope_theta"),
])
def test_bad_arguments_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        create_model("decoder_base", **{**TINY, **kw})


def test_every_parameter_gets_a_gradient_from_the_loss():
    model = _model("hybrid").train()
    idx = torch.randint(0, 53, (2, 9))
    model(idx, idx)[1].backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()
               or not p.grad.abs().sum() > 0]
    assert not missing


def test_an_all_tssa_decoder_exports_its_step_with_the_state_as_tensors():
    from whiteformer.models.lm_step import LMStep

    model = create_model("tost_decoder_base", **{**TINY, "depth": 2}).eval()
    step = LMStep(model).eval()
    _, state = model.prefill(torch.randint(0, 53, (2, 6)))
    tok = torch.randint(0, 53, (2,))
    ref, _ = model.step(tok, state)
    exported = torch.export.export(step, step.example_inputs(2), dynamic_shapes=step.dynamic_shapes()).module()
    flat = LMStep.state_tensors(state)
    torch.testing.assert_close(exported(tok, torch.full((2,), 6), *flat)[0], ref)
    with pytest.raises(TypeError, match="key/value cache"):
        LMStep(_model("hybrid"))
