"""whiteformer.convert.from_transformers: tiny random transformers models built from configs here
(GPT-2, Llama with GQA / rope_theta / llama3 rope scaling / untied head, Qwen2 with q/k/v biases,
Mistral) give the same logits in float32 and the same greedy tokens, from the object and from a
saved folder; each config field the shells cannot honour is refused by name."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install whiteformer[hf]")

from whiteformer import from_pretrained  # noqa: E402
from whiteformer.convert import from_transformers  # noqa: E402
from whiteformer.models.decoder import DecoderLM  # noqa: E402
from whiteformer.models.decoder.layers import rope_inv_freq  # noqa: E402
from whiteformer.models.lm import GPTLM  # noqa: E402

V = 97
_DECODER = dict(vocab_size=V, hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
CONFIGS = {
    "gpt2": lambda **kw: transformers.GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                                 bos_token_id=1, eos_token_id=2, initializer_range=0.2, **kw),
    "llama": lambda **kw: transformers.LlamaConfig(**{**_DECODER, "num_key_value_heads": 2, "rope_theta": 5e5,
                                                      "rope_scaling": LLAMA3, "tie_word_embeddings": False, **kw}),
    "qwen2": lambda **kw: transformers.Qwen2Config(**{**_DECODER, "num_key_value_heads": 2,
                                                      "tie_word_embeddings": True, **kw}),
    "mistral": lambda **kw: transformers.MistralConfig(**{**_DECODER, "num_key_value_heads": 1,
                                                          "sliding_window": None, **kw}),
}
SHELL = {"gpt2": GPTLM, "llama": DecoderLM, "qwen2": DecoderLM, "mistral": DecoderLM}


def _source(kind, **kw):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind](**kw)).eval()
    # weights of std 0.2 (initializer_range): activations of order 1, where GELU's tanh approximation differs
    with torch.no_grad():  # gains and biases away from their init (ones / zeros), so that a dropped one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.add_(0.2 * torch.randn_like(p))
    return model


def _logits(model, idx):
    with torch.no_grad():
        out = model(idx)
    return out.logits if hasattr(out, "logits") else out[0]


@pytest.fixture(params=sorted(CONFIGS))
def kind(request):
    return request.param


def test_logits_equal_transformers_from_the_model_and_from_its_folder(kind, tmp_path):
    source = _source(kind)
    idx = torch.randint(0, V, (2, 40))
    ref = _logits(source, idx)
    net = from_transformers(source)
    assert type(net) is SHELL[kind] and not net.training
    torch.testing.assert_close(_logits(net, idx), ref, atol=1e-5, rtol=0)
    source.save_pretrained(tmp_path / "hf")
    folder = from_transformers(tmp_path / "hf")
    torch.testing.assert_close(_logits(folder, idx), ref, atol=1e-5, rtol=0)


def test_greedy_generation_equals_transformers(kind):
    source = _source(kind)
    prompt = torch.randint(3, V, (1, 7))
    ref = source.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12, pad_token_id=0)
    net = from_transformers(source)
    assert torch.equal(net.generate(prompt, 12, temperature=0), ref)


def test_the_weights_are_copies_and_the_head_is_tied_as_in_the_source(kind):
    source = _source(kind)
    net = from_transformers(source)
    tied = source.config.tie_word_embeddings
    assert (net.lm_head.weight is net.transformer.wte.weight) == tied
    with torch.no_grad():
        net.lm_head.weight.zero_()
    assert source.get_output_embeddings().weight.abs().sum() > 0


def test_llama3_rope_frequencies_are_transformers(tmp_path):
    source = _source("llama")
    ours = rope_inv_freq(8, 5e5, from_transformers(source).rope_scaling)
    torch.testing.assert_close(ours, source.model.rotary_emb.inv_freq)
    assert not torch.equal(ours, rope_inv_freq(8, 5e5))  # the scaling is exercised


def test_an_imported_model_saves_and_loads_as_a_whiteformer_model(tmp_path):
    source = _source("qwen2")
    net = from_transformers(source)
    net.save_pretrained(tmp_path / "wf")
    back = from_pretrained(tmp_path / "wf").eval()
    idx = torch.randint(0, V, (1, 9))
    torch.testing.assert_close(_logits(back, idx), _logits(source, idx), atol=1e-5, rtol=0)


def test_the_tssa_variant_of_an_imported_shape_runs_with_a_constant_state():
    net = from_transformers(_source("llama"))
    kwargs = {**net.init_kwargs, "attention": "tssa", "keep_softmax": [0]}
    hybrid = type(net)(**kwargs).eval()
    sizes = []
    for n in (5, 30):
        _, state = hybrid.prefill(torch.randint(0, V, (1, n)))
        sizes.append([t.shape for t in state.layers[1][:3]])
        assert state.layers[0].k.shape[2] == n  # the kept softmax layer caches keys
    assert sizes[0] == sizes[1]
    assert hybrid.generate(torch.randint(0, V, (1, 4)), 3, temperature=0).shape == (1, 7)


@pytest.mark.parametrize("kind, kw, field", [
    ("mistral", dict(sliding_window=16), "sliding_window"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0), "use_sliding_window"),
    ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}),
     "rope_type"),
    ("llama", dict(hidden_act="gelu"), "hidden_act"),
    ("gpt2", dict(activation_function="relu"), "activation_function"),
    ("gpt2", dict(layer_norm_epsilon=1e-6), "layer_norm_epsilon"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    ("gpt2", dict(tie_word_embeddings=False), "tie_word_embeddings"),
    ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
])
def test_a_field_the_shell_cannot_honour_is_named(kind, kw, field):
    with pytest.raises(ValueError, match=field) as err:
        from_transformers(_source(kind, **kw))
    assert "cannot be honoured by the whiteformer shell; supported:" in str(err.value)  # ours, not transformers


def test_an_unknown_model_type_and_qwen3_are_refused_by_name(tmp_path):
    qwen3 = transformers.Qwen3Config(**{**_DECODER, "num_key_value_heads": 2, "head_dim": 8})
    with pytest.raises(ValueError, match=r"model_type='qwen3'.*q/k"):
        from_transformers(transformers.AutoModelForCausalLM.from_config(qwen3))
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"model_type='bert'.*'gpt2', 'llama', 'qwen2', 'mistral'"):
        from_transformers(folder)


def test_a_folder_without_weights_or_a_wrong_argument_is_refused(tmp_path):
    source = _source("mistral")
    source.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="weights"):
        from_transformers(tmp_path / "hf")
    with pytest.raises(TypeError, match="model_or_folder"):
        from_transformers(torch.nn.Linear(2, 2))


def test_a_pickled_folder_is_read_weights_only(tmp_path):
    source = _source("llama")
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_text(source.config.to_json_string())
    torch.save(source.state_dict(), folder / "pytorch_model.bin")
    idx = torch.randint(0, V, (1, 9))
    torch.testing.assert_close(_logits(from_transformers(folder), idx), _logits(source, idx), atol=1e-5, rtol=0)


def test_a_vit_classifier_converts_from_the_model_and_from_its_folder(tmp_path):
    config = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=64, num_labels=5)
    torch.manual_seed(0)
    source = transformers.ViTForImageClassification(config).eval()
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ref = source(images).logits
        torch.testing.assert_close(from_transformers(source)(images), ref, atol=1e-5, rtol=0)
        source.save_pretrained(tmp_path / "vit")
        torch.testing.assert_close(from_transformers(tmp_path / "vit")(images), ref, atol=1e-5, rtol=0)


def test_llama_attention_and_mlp_biases_and_a_head_dim_of_its_own(tmp_path):
    source = _source("llama", attention_bias=True, mlp_bias=True, head_dim=16)
    net = from_transformers(source)
    assert net.qkv_bias and net.proj_bias and net.head_dim == 16 and net.transformer.h[0].mlp.up_proj.bias is not None
    idx = torch.randint(0, V, (2, 30))
    torch.testing.assert_close(_logits(net, idx), _logits(source, idx), atol=1e-5, rtol=0)


def test_a_sharded_folder_is_read_whole(tmp_path):
    source = _source("qwen2")
    source.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    idx = torch.randint(0, V, (1, 12))
    torch.testing.assert_close(_logits(from_transformers(tmp_path / "hf"), idx), _logits(source, idx), atol=1e-5,
                               rtol=0)


def test_a_half_precision_source_gives_a_model_of_its_dtype():
    source = _source("mistral").to(torch.bfloat16)
    net = from_transformers(source)
    assert {p.dtype for p in net.parameters()} == {torch.bfloat16}
    idx = torch.randint(0, V, (1, 12))
    ref, got = _logits(source, idx).float(), _logits(net, idx).float()
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()  # bf16 rounding (float32 statistics here)


def test_the_sources_end_of_sequence_id_is_carried(kind, tmp_path):
    source = _source(kind)
    assert from_transformers(source).eos_token_id == 2  # the config's
    source.generation_config.eos_token_id = [5, 2]  # the generation config's wins; the first of a list
    assert from_transformers(source).eos_token_id == 5
    source.save_pretrained(tmp_path / "src")
    assert from_transformers(tmp_path / "src").eos_token_id == 5
    generation = tmp_path / "src" / "generation_config.json"
    generation.write_text(json.dumps({**json.loads(generation.read_text()), "eos_token_id": V}))
    assert from_transformers(tmp_path / "src").eos_token_id is None  # outside the vocabulary: none
    generation.unlink()
    assert from_transformers(tmp_path / "src").eos_token_id == 2
