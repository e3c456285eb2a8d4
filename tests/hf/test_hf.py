"""whiteformer in Hugging Face transformers (whiteformer.hf): Auto classes, forward/loss,
generate() (greedy = whiteformer's own, sampling, beam search, left padding), the constant-size ToST
cache, checkpoints loading both ways, vision classifiers, Trainer, torch.compile, bad input."""
import inspect
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install whiteformer[hf]")

from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification, Trainer, TrainingArguments  # noqa: E402

import whiteformer  # noqa: E402
import whiteformer.hf  # noqa: E402,F401
from hf_versions import cache_of  # noqa: E402
from whiteformer.hf import WhiteformerCache  # noqa: E402

TINY = dict(vocab_size=61, dim=32, depth=2, num_heads=4, max_len=64)
LM = {"whiteformer-tost-lm": "tost_lm_base", "whiteformer-gpt": "gpt_base"}


def _lm(model_type, **over):
    config = AutoConfig.for_model(model_type, model_name=LM[model_type], init_kwargs={**TINY, **over})
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type", list(LM))
def test_forward_loss_is_shifted_cross_entropy(model_type):
    model = _lm(model_type)
    assert type(model).__name__ == {"whiteformer-tost-lm": "ToSTForCausalLM",
                                    "whiteformer-gpt": "WhiteformerGPTForCausalLM"}[model_type]
    idx = torch.randint(0, 61, (2, 9))
    labels = idx.clone()
    labels[0, :3] = -100
    out = model(idx, labels=labels)
    logits, _ = model.whiteformer(idx)
    torch.testing.assert_close(out.logits, logits)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, 61), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, want)
    assert isinstance(cache_of(out), WhiteformerCache) and cache_of(out).get_seq_length() == 9


@pytest.mark.parametrize("model_type", list(LM))
def test_greedy_generate_equals_whiteformer_generate(model_type):
    model = _lm(model_type)
    idx = torch.randint(0, 61, (2, 6))
    out = model.generate(idx, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(out, model.whiteformer.generate(idx, 12, temperature=0))
    assert torch.equal(out, model.generate(idx, max_new_tokens=12, do_sample=False, pad_token_id=0, use_cache=False))


@pytest.mark.parametrize("model_type", list(LM))
def test_sampling_and_beam_search_match_the_uncached_model(model_type):
    """The cached path (state carried, beams reordered) picks the same tokens as re-running the
    whole sequence each step (use_cache=False)."""
    model = _lm(model_type).double()
    idx = torch.randint(0, 61, (2, 5))
    kw = dict(max_new_tokens=8, pad_token_id=0)
    runs = []
    for use_cache in (True, False):
        torch.manual_seed(3)
        runs.append(model.generate(idx, do_sample=True, top_k=10, use_cache=use_cache, **kw))
    assert torch.equal(runs[0], runs[1]) and runs[0].shape == (2, 13)
    beams = [model.generate(idx, num_beams=3, num_return_sequences=2, do_sample=False, use_cache=c, **kw)
             for c in (True, False)]
    assert beams[0].shape == (4, 13) and torch.equal(beams[0], beams[1])
    assert not torch.equal(beams[0][0], beams[0][1])  # two different beams returned


@pytest.mark.parametrize("model_type", list(LM))
def test_left_padded_batch_generates_each_prompt_as_alone(model_type):
    model = _lm(model_type)
    a, b = torch.randint(1, 61, (1, 7)), torch.randint(1, 61, (1, 3))
    batch = torch.cat([a, torch.cat([torch.zeros(1, 4, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    out = model.generate(batch, attention_mask=mask, max_new_tokens=9, do_sample=False, pad_token_id=0)
    assert torch.equal(out[0, 7:], model.generate(a, max_new_tokens=9, do_sample=False, pad_token_id=0)[0, 7:])
    assert torch.equal(out[1, 7:], model.generate(b, max_new_tokens=9, do_sample=False, pad_token_id=0)[0, 3:])


@pytest.mark.parametrize("model_type", list(LM))
def test_generate_restarts_from_a_prompt_cache(model_type):
    """transformers' prompt reuse: generate(full_ids, past_key_values=<cache of a prefix>) feeds only the
    uncached tokens (they were fed again on top of the cached prefix, silently wrong tokens)."""
    import copy

    model = _lm(model_type)
    prefix = torch.randint(1, 61, (2, 5))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :2] = 0  # the second prompt left-padded
    prefix[1, :2] = 0
    full = torch.cat([prefix, torch.randint(1, 61, (2, 3))], 1)
    with torch.no_grad():
        cached = cache_of(model(prefix, attention_mask=mask[:, :5], use_cache=True))
    want = model.generate(full, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    got = model.generate(full, attention_mask=mask, past_key_values=copy.deepcopy(cached), max_new_tokens=4,
                         do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


def test_tost_cache_size_does_not_grow_gpt_cache_does():
    sizes = {}
    for model_type in LM:
        model = _lm(model_type, pos_emb=False, **({"pos_bias": False} if "tost" in model_type else {}))
        out = model(torch.randint(0, 61, (2, 5)), use_cache=True)
        cache, first = cache_of(out), cache_of(out).nbytes()
        for _ in range(40):  # (past_key_values is the older name of the cache argument)
            out = model(torch.randint(0, 61, (2, 1)), past_key_values=cache, use_cache=True)
        assert cache.get_seq_length() == 45
        sizes[model_type] = (first, cache.nbytes())
    first, last = sizes["whiteformer-tost-lm"]
    assert first == last > 0
    first, last = sizes["whiteformer-gpt"]
    assert last == first * 45 // 5
    model, idx = _lm("whiteformer-tost-lm"), torch.randint(0, 61, (2, 5))
    caches = [cache_of(model.generate(idx, max_new_tokens=n, do_sample=False, pad_token_id=0,
                                      return_dict_in_generate=True)) for n in (3, 30)]
    assert caches[1].get_seq_length() == 34 and caches[0].nbytes() == caches[1].nbytes()


@pytest.mark.parametrize("name", ["tost_lm_base", "gpt_base"])
def test_checkpoints_load_both_ways(tmp_path, name):
    net = whiteformer.create_model(name, **TINY).eval()
    net.save_pretrained(tmp_path / "own")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "own").eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    idx = torch.randint(0, 61, (2, 8))
    torch.testing.assert_close(model(idx).logits, net(idx)[0], rtol=0, atol=0)
    model.save_pretrained(tmp_path / "hf")
    assert not [f for f in os.listdir(tmp_path / "hf") if f.endswith((".bin", ".pt", ".pth", ".pkl"))]
    back = whiteformer.create_model(name, checkpoint_path=str(tmp_path / "hf")).eval()
    torch.testing.assert_close(back(idx)[0], net(idx)[0], rtol=0, atol=0)


def test_official_tost_checkpoint_through_the_zoo(tmp_path):
    from test_lm import _official_state_dict

    sd = _official_state_dict(True, dtype=torch.float32)
    torch.save({"model": {f"_orig_mod.{k}": v for k, v in sd.items()}}, tmp_path / "ckpt.pt")
    net = whiteformer.create_model("tost_lm_base", vocab_size=61, dim=32, depth=2, num_heads=4, max_len=64,
                                   checkpoint_path=str(tmp_path / "ckpt.pt")).eval()
    net.save_pretrained(tmp_path / "converted")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "converted").eval()
    idx = torch.randint(0, 61, (1, 10))
    torch.testing.assert_close(model(idx).logits, net(idx)[0], rtol=0, atol=0)
    assert torch.equal(model.generate(idx, max_new_tokens=5, do_sample=False, pad_token_id=0),
                       net.generate(idx, 5, temperature=0))


VISION = {"tost_t12_p16": {}, "dmst_t12_p16": {}, "eca_t": {}, "deit_t_p16": {}, "crate_t": {},
          "xcit_s12_p16": {}, "vit_cab_s12_p16": {}}


@pytest.mark.parametrize("name", list(VISION))
def test_vision_classifiers(tmp_path, name):
    kw = dict(img_size=32, patch_size=8, num_classes=5, depth=1)
    net = whiteformer.create_model(name, **kw).eval()
    net.save_pretrained(tmp_path)
    model = AutoModelForImageClassification.from_pretrained(tmp_path).eval()
    assert type(model).__name__ == "WhiteformerForImageClassification" and model.config.num_labels == 5
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 4])
    out = model(pixel_values=x, labels=y)
    torch.testing.assert_close(out.logits, net(x), rtol=0, atol=0)
    torch.testing.assert_close(out.loss, F.cross_entropy(net(x), y))



def test_vision_from_config_labels_follow_the_model():
    config = AutoConfig.for_model("whiteformer-vision", model_name="deit_t_p16",
                                  init_kwargs=dict(img_size=32, patch_size=16, depth=1))
    model = AutoModelForImageClassification.from_config(config)
    assert model.config.num_labels == 1000 and model.config.init_kwargs["embed_dim"] == 192
    out = model(pixel_values=torch.randn(2, 3, 32, 32), labels=torch.tensor([0, 999]))
    assert out.logits.shape == (2, 1000) and torch.isfinite(out.loss)


def test_trainer_reduces_the_loss(tmp_path):
    from torch.utils.data import Dataset

    class Patterns(Dataset):
        """Generated text: repeated random 4-token motifs (a language a tiny model learns fast)."""

        def __init__(self, n):
            g = torch.Generator().manual_seed(0)
            motifs = torch.randint(0, 61, (n, 4), generator=g)
            self.ids = motifs.repeat(1, 6)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    model = _lm("whiteformer-tost-lm").train()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=16, max_steps=40,
                             learning_rate=1e-2, logging_steps=5, save_strategy="no", report_to=[],
                             use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Patterns(64))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) >= 4 and losses[-1] < 0.8 * losses[0], losses


@pytest.mark.compile
def test_torch_compile_forward():
    model = _lm("whiteformer-tost-lm")
    idx = torch.randint(0, 61, (2, 8))
    compiled = torch.compile(model, backend="aot_eager")
    torch.testing.assert_close(compiled(idx, labels=idx).loss, model(idx, labels=idx).loss)
    # position_ids are read on the host (packed documents or not): one graph break without fullgraph ...
    packed = dict(input_ids=idx[:1], labels=idx[:1], position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]))
    torch.testing.assert_close(compiled(**packed).loss, model(**packed).loss)
    torch._dynamo.reset()
    full = torch.compile(model, fullgraph=True, backend="aot_eager")
    # ... with fullgraph an error that says what to do (torch 2.7's compiler.disable takes no reason to show)
    says = "reason" in inspect.signature(torch.compiler.disable).parameters
    with pytest.raises(Exception, match="leave position_ids out" if says else None):
        full(idx, labels=idx, position_ids=torch.arange(8)[None].expand(2, -1))
    torch.testing.assert_close(full(idx, labels=idx).loss, model(idx, labels=idx).loss)
    torch._dynamo.reset()


def test_bad_input():
    with pytest.raises(ValueError, match="not a registered whiteformer model"):
        whiteformer.hf.ToSTLMConfig(model_name="tost_lm_huge")
    with pytest.raises(TypeError, match="init_kwargs must be a dict of constructor arguments, got list"):
        whiteformer.hf.ToSTLMConfig(model_name="tost_lm_base", init_kwargs=[("dim", 32)])
    with pytest.raises(ValueError, match="not a whiteformer-tost-lm model"):
        AutoModelForCausalLM.from_config(whiteformer.hf.ToSTLMConfig(model_name="gpt_base", init_kwargs=TINY))
    with pytest.raises(ValueError):
        AutoConfig.for_model("whiteformer-nope")
    model = _lm("whiteformer-tost-lm")
    with pytest.raises(ValueError, match="inputs_embeds"):
        model(inputs_embeds=torch.randn(1, 3, 32))
    with pytest.raises(TypeError, match="WhiteformerCache"):
        model(torch.tensor([[1]]), cache=object())
    with pytest.raises(TypeError, match="WhiteformerCache"):  # a packed batch too
        model(torch.tensor([[1, 2, 1, 2]]), cache=object(), position_ids=torch.tensor([[0, 1, 0, 1]]),
              use_cache=False)
    out = model(torch.tensor([[1, 2]]), use_cache=True)
    with pytest.raises(ValueError, match="must be real"):
        model(torch.tensor([[3]]), attention_mask=torch.tensor([[1, 1, 0]]), cache=cache_of(out))
    # the library, the transformers formats of hf/ the models use included, imports without transformers;
    # the integration's classes say what to install
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import whiteformer, whiteformer.models, whiteformer.compress, whiteformer.hf\n"
            "from whiteformer.models.formats.vit_weights import convert_hf_vit_state_dict\n"
            "try:\n    whiteformer.hf.ToSTLMConfig\nexcept ImportError as e:\n    print(e)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "pip install whiteformer[hf]" in res.stdout, res.stderr


def test_each_unsupported_option_is_refused_by_name():
    """What the wrappers do not implement raises a ValueError / TypeError saying so, instead of
    being ignored (each refusal at the door where a user passes it)."""
    from transformers import AutoModel

    model = _lm("whiteformer-tost-lm")
    head = AutoModel.from_config(model.config).eval()
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="input_ids is required: a \\(B, T\\) tensor of token ids"):
        model(attention_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match="output_attentions is not supported by whiteformer models"):
        model(ids, output_attentions=True)
    with pytest.raises(ValueError, match="return_dict=False is not supported"):
        head(ids, return_dict=False)
    with pytest.raises(ValueError, match="labels: ToSTModel is headless .* with AutoModelForCausalLM"):
        head(ids, labels=ids)
    with pytest.raises(ValueError, match="ToSTModel is headless and keeps no cache"):
        head(ids, use_cache=True)
    with pytest.raises(ValueError, match="pass the cache once \\(cache or past_key_values\\), not both"):
        model(ids, cache=WhiteformerCache(), past_key_values=WhiteformerCache())
    # (what activation_checkpointing_enable(every_n_layers=2) hands the model in recent transformers)
    with pytest.raises(ValueError, match="checkpoint every block \\(every_n_layers=1\\), got 2"):
        model._set_gradient_checkpointing(True, every_n_layers=2)
    with pytest.raises(ValueError, match="a whiteformer cache cannot be cropped"):
        WhiteformerCache().crop(1)
    with pytest.raises(TypeError, match="ToSTForCausalLM needs a ToSTLMConfig, got WhiteformerVisionConfig"):
        whiteformer.hf.ToSTForCausalLM(_vision().config)
    vision = _vision()
    with pytest.raises(ValueError, match="pixel_values is required: a \\(B, C, H, W\\) image tensor"):
        vision(labels=torch.tensor([1]))
    with pytest.raises(ValueError, match="labels: WhiteformerVisionModel is headless"):
        AutoModel.from_config(vision.config)(torch.randn(1, 1, 8, 8), labels=torch.tensor([1]))


def _vision(**init):
    config = AutoConfig.for_model("whiteformer-vision", model_name="deit_t_p16",
                                  init_kwargs=dict(img_size=8, patch_size=4, in_chans=1, num_classes=10, depth=1,
                                                   embed_dim=16, num_heads=2, **init))
    return AutoModelForImageClassification.from_config(config).eval()


def test_labels_of_the_wrong_shape_are_named():
    x = torch.randn(2, 1, 8, 8)
    with pytest.raises(ValueError, match=r"labels must have shape \(2,\) or \(2, 1\) .*got \(3,\)"):
        _vision()(x, labels=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"labels must have shape \(2, 10\) .*multi_label.*got \(2,\)"):
        _vision()(x, labels=torch.tensor([1.5, 2.0]))  # float labels: multi-label targets, one per class
    model = _vision()
    assert model(x, labels=torch.tensor([1, 2])).loss.shape == ()
    assert model(x, labels=torch.tensor([[1], [2]])).loss.shape == ()  # (B, 1), as transformers' own view(-1)


def test_num_labels_passed_in_sets_the_head(tmp_path):
    """transformers' fine-tuning idiom: from_pretrained(d, num_labels=4, ignore_mismatched_sizes=True) gives
    a new 4-way head on the loaded body (the head kept its saved 10 outputs before)."""
    _vision().save_pretrained(tmp_path / "ten")
    model = AutoModelForImageClassification.from_pretrained(tmp_path / "ten", num_labels=4,
                                                            ignore_mismatched_sizes=True).eval()
    assert model.config.num_labels == 4 and model.config.init_kwargs["num_classes"] == 4
    x = torch.randn(2, 1, 8, 8)
    assert model(x).logits.shape == (2, 4)
    saved = AutoModelForImageClassification.from_pretrained(tmp_path / "ten").eval()
    torch.testing.assert_close(model.whiteformer.forward_features(x), saved.whiteformer.forward_features(x))
    model.save_pretrained(tmp_path / "four")
    assert AutoModelForImageClassification.from_pretrained(tmp_path / "four")(x).logits.shape == (2, 4)
    config = AutoConfig.for_model("whiteformer-vision", model_name="deit_t_p16", num_labels=3,
                                  init_kwargs=dict(img_size=8, patch_size=4, in_chans=1, depth=1, embed_dim=16,
                                                   num_heads=2))
    assert AutoModelForImageClassification.from_config(config)(x).logits.shape == (2, 3)
    config.id2label = {0: "cat", 1: "dog"}
    two = AutoModelForImageClassification.from_config(config)
    assert two(x).logits.shape == (2, 2) and two.config.id2label == {0: "cat", 1: "dog"}


def test_half_checkpoint_reads_float_pixels(tmp_path):
    _vision().half().save_pretrained(tmp_path / "fp16")
    model = AutoModelForImageClassification.from_pretrained(tmp_path / "fp16")
    assert model.dtype == torch.float16
    out = model(torch.randn(2, 1, 8, 8))  # float32 pixels are cast to the model's dtype
    assert out.logits.dtype == torch.float16 and torch.isfinite(out.logits).all()


def test_integer_weights_are_refused_not_cast(tmp_path):
    from safetensors.torch import load_file, save_file

    _vision().save_pretrained(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    sd = load_file(weights)
    sd["head.weight"] = (sd["head.weight"] * 100).long()
    save_file(sd, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'head.weight' holds integer values \(I64\)"):
        AutoModelForImageClassification.from_pretrained(tmp_path / "m")


def test_config_json_that_is_not_an_object(tmp_path):
    from whiteformer.hf import WhiteformerForImageClassification

    _vision().save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object.*got a list"):
        WhiteformerForImageClassification.from_pretrained(tmp_path / "m")


@pytest.mark.parametrize("model_type", list(LM))
def test_assisted_decoding_is_refused_as_unsupported(model_type):
    model = _lm(model_type)
    idx = torch.randint(0, 61, (1, 5))
    for kw in (dict(assistant_model=_lm(model_type)), dict(prompt_lookup_num_tokens=2)):
        with pytest.raises(ValueError, match="assisted decoding .* is not supported"):
            model.generate(idx, max_new_tokens=3, pad_token_id=0, **kw)


def _hf_vit(kind="vit", labels=5):
    from transformers import DeiTConfig, DeiTForImageClassification, ViTConfig, ViTForImageClassification

    cfg_cls, model_cls = (ViTConfig, ViTForImageClassification) if kind == "vit" else \
        (DeiTConfig, DeiTForImageClassification)
    config = cfg_cls(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=80,
                     image_size=32, patch_size=8, num_labels=labels)
    model = model_cls(config).eval()
    with torch.no_grad():  # non-trivial norms and biases (transformers inits them to 1 / 0)
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("target", ["dir", "file", "state_dict"])
def test_transformers_vit_converts_to_deit_with_equal_logits(tmp_path, target):
    from whiteformer.models.formats.vit_weights import convert_hf_vit_state_dict

    hf = _hf_vit()
    hf.save_pretrained(tmp_path)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want = hf(pixel_values=x).logits
    if target == "state_dict":  # the in-memory layout of recent transformers (vit.layers.{i}.attention.q_proj)
        net = whiteformer.create_model("deit_t_p16", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4,
                                       mlp_ratio=2.5, num_classes=5, norm_eps=1e-12).eval()
        net.load_state_dict(convert_hf_vit_state_dict(hf.state_dict()))
    else:
        path = tmp_path if target == "dir" else tmp_path / "model.safetensors"
        kw = {} if target == "dir" else dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4,
                                             mlp_ratio=2.5, norm_eps=1e-12)
        net = whiteformer.create_model("deit_s_p16", num_classes=5, checkpoint_path=str(path), **kw).eval()
    with torch.no_grad():
        got = net(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_transformers_vit_directory_compresses(tmp_path, capsys):
    import json

    from whiteformer.app.cli import main

    _hf_vit().save_pretrained(tmp_path / "hf")
    rc = main(["compress", "--checkpoint", str(tmp_path / "hf"), "--qk", "truncatt", "--qk-rank", "4",
                        "--vo-rank", "4", "--out", str(tmp_path / "out"), "--quiet"])
    assert rc == 0
    rep = json.loads((tmp_path / "out" / "compression_report.json").read_text())
    assert len(rep["blocks"]) == 2 and rep["flops_ratio"] < 1
    assert whiteformer.from_pretrained(tmp_path / "out")(torch.randn(1, 3, 32, 32)).shape == (1, 5)


def test_transformers_deit_distillation_is_refused(tmp_path):
    _hf_vit("deit").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="distillation token"):
        whiteformer.create_model("deit_t_p16", checkpoint_path=str(tmp_path))
    with pytest.raises(ValueError, match="loads into the vit / deit_\\* models"):
        whiteformer.create_model("tost_t12_p16", checkpoint_path=str(tmp_path))


@pytest.mark.parametrize("extra", ["other.weight", "vit.encoder.layer.0.foo.weight", "vit.blah", "cls_classifier.weight"])
def test_transformers_vit_unknown_key_is_refused(extra):
    from whiteformer.models.formats.vit_weights import convert_hf_vit_state_dict

    state = _hf_vit().state_dict()
    assert {"blocks.0.attn.qkv.weight", "head.weight"} <= set(convert_hf_vit_state_dict(state))
    with pytest.raises(ValueError, match=f"unexpected key '{extra}' in a transformers ViT/DeiT state dict"):
        convert_hf_vit_state_dict({**state, extra: torch.zeros(1)})


@pytest.mark.parametrize("model_type", list(LM))
def test_forward_checks_input_ids_once(model_type, monkeypatch):
    """The wrapper's forward checks input_ids at its door; the model's prefill and steps from the
    cache trust it."""
    model = _lm(model_type)
    names, check = [], model.whiteformer._check_idx
    monkeypatch.setattr(model.whiteformer, "_check_idx",
                        lambda idx, name="idx", values=True: (names.append(name), check(idx, name, values))[1])
    out = model(torch.tensor([[1, 2, 3]]), use_cache=True)
    model(torch.tensor([[4, 5]]), cache=cache_of(out), use_cache=True)
    model(torch.tensor([[1, 2, 3]]))
    assert names == ["input_ids"] * 3


@pytest.mark.parametrize("model_type", list(LM))
def test_generate_reads_no_input_value_per_token(model_type, monkeypatch):
    """generate() checks its prompt's ids once at its door; the forward of each generated token reads
    none of its inputs' values (ids, mask, state length): the host reads grow by transformers' own per
    token, the same at every depth, and the ids are range-checked once. (The PyTorch path: the C++
    kernel also reads, per call, its flag of rows past its range, a read of host memory.)"""
    from torch.overrides import TorchFunctionMode

    from whiteformer.ops._kernels import ENV_BACKEND

    monkeypatch.setenv(ENV_BACKEND, "torch")

    class Reads(TorchFunctionMode):
        count = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Reads.count += getattr(func, "__name__", "") in ("tolist", "item", "cpu", "__bool__", "__int__", "__index__")
            return func(*args, **(kwargs or {}))

    idx = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # left padding: each state's position is a tensor
    counts, checked = {}, []
    for depth in (2, 6):
        model = _lm(model_type, depth=depth)
        check = model.whiteformer._check_idx
        monkeypatch.setattr(model.whiteformer, "_check_idx",
                            lambda ids, name="idx", values=True: (checked.append(values), check(ids, name, values))[1])
        for n in (3, 9):
            Reads.count = 0
            with torch.no_grad(), Reads():
                model.generate(idx, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)
            counts[depth, n] = Reads.count
    assert counts[2, 3] == counts[6, 3] and counts[2, 9] == counts[6, 9], counts
    assert checked.count(True) == 4, checked  # once per generate() (the prompt), never per generated token
