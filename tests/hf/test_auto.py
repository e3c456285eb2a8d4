"""transformers without a prior ``import whiteformer``: folders load through the Auto classes with
``trust_remote_code=True`` in a fresh process (auto_map + whiteformer_auto.py), the Auto classes know
whiteformer once ``import whiteformer`` ran (lazily: no transformers import), headless AutoModel
classes, output_hidden_states, the attributes transformers / accelerate read, and
pipeline("feature-extraction")."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install whiteformer[hf]")

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageClassification  # noqa: E402

import whiteformer  # noqa: E402
from hf_versions import cache_of  # noqa: E402

SRC = str(Path(__file__).resolve().parents[2] / "src")
TINY = dict(vocab_size=61, dim=32, depth=2, num_heads=4, max_len=64)
VISION_KW = dict(img_size=32, patch_size=8, num_classes=5, depth=2)


def _env(tmp_path):
    return {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"),
            "OMP_NUM_THREADS": "1"}


def _run(code, tmp_path):
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(tmp_path), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_registers_when_transformers_auto_models_load_first(tmp_path):
    """transformers' Auto model classes imported before whiteformer: the registration runs while
    whiteformer.models is still loading and must not fail (a RuntimeWarning, here an error)."""
    out = _run("import warnings; warnings.simplefilter('error', RuntimeWarning)\n"
               "from transformers import AutoConfig, AutoModelForCausalLM\n"
               "import whiteformer\n"
               "print(AutoConfig.for_model('whiteformer-tost-lm').__class__.__name__)", tmp_path)
    assert out.strip() == "ToSTLMConfig"


# The script run in a fresh process: never imports whiteformer itself.
REMOTE_SCRIPT = r"""
import json, sys, torch
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageClassification
cases = json.load(open(sys.argv[1]))
# whiteformer missing: the folder's module says how to install it
sys.modules["whiteformer"] = None
try:
    AutoModelForCausalLM.from_pretrained(cases[0]["dir"], trust_remote_code=True)
    print("NO ERROR")
except ImportError as err:
    print("missing:", err)
del sys.modules["whiteformer"]
assert not any(m.startswith("whiteformer") for m in sys.modules)
auto = dict(AutoModel=AutoModel, AutoModelForCausalLM=AutoModelForCausalLM,
            AutoModelForImageClassification=AutoModelForImageClassification)
for case in cases:
    model = auto[case["auto"]].from_pretrained(case["dir"], trust_remote_code=True).eval()
    x = torch.load(case["input"])
    with torch.no_grad():
        out = model(x)
    got = out.logits if hasattr(out, "logits") else out.last_hidden_state
    want = torch.load(case["want"])
    print(case["dir"], type(model).__name__, bool(torch.equal(got, want)))
"""


def test_saved_folders_load_in_a_fresh_process_without_importing_whiteformer(tmp_path):
    from whiteformer.hf import WhiteformerVisionConfig

    cases = []

    def case(name, folder, auto, x, want):
        torch.save(x, tmp_path / f"{name}_x.pt")
        torch.save(want, tmp_path / f"{name}_want.pt")
        cases.append(dict(dir=str(folder), auto=auto, input=str(tmp_path / f"{name}_x.pt"),
                          want=str(tmp_path / f"{name}_want.pt")))

    idx = torch.randint(0, 61, (2, 7))
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        for name in ("tost_lm_base", "gpt_base"):  # saved by whiteformer's own save_pretrained
            net = whiteformer.create_model(name, **TINY).eval()
            net.save_pretrained(tmp_path / name)
            case(name, tmp_path / name, "AutoModelForCausalLM", idx, net(idx)[0])
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "tost_lm_base").eval()  # saved by the wrapper
        hf.save_pretrained(tmp_path / "tost_hf")
        case("tost_hf", tmp_path / "tost_hf", "AutoModel", idx, hf.whiteformer.forward_features(idx))
        for name in ("deit_t_p16", "tost_t12_p16"):
            net = whiteformer.create_model(name, **VISION_KW).eval()
            net.save_pretrained(tmp_path / name)
            case(name, tmp_path / name, "AutoModelForImageClassification", images, net(images))
        case("deit_base", tmp_path / "deit_t_p16", "AutoModel", images,
             whiteformer.from_pretrained(tmp_path / "deit_t_p16").forward_features(images))
    for c in cases:
        config = json.loads((Path(c["dir"]) / "config.json").read_text())
        assert set(config["auto_map"]) >= {"AutoConfig", "AutoModel"}
        assert (Path(c["dir"]) / "whiteformer_auto.py").is_file()
    assert WhiteformerVisionConfig().auto_map["AutoModelForImageClassification"] == \
        "whiteformer_auto.WhiteformerForImageClassification"
    WhiteformerVisionConfig().save_pretrained(tmp_path / "config_only")  # a configuration alone carries its module
    assert (tmp_path / "config_only" / "whiteformer_auto.py").is_file()
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    out = _run(REMOTE_SCRIPT.replace("sys.argv[1]", repr(str(tmp_path / "cases.json"))), tmp_path)
    assert "missing:" in out and "pip install 'whiteformer[hf]'" in out, out
    lines = [line.split() for line in out.splitlines() if line.startswith(str(tmp_path))]
    assert len(lines) == len(cases) and all(ok == "True" for *_, ok in lines), out
    assert [t for _, t, _ in lines] == ["ToSTForCausalLM", "WhiteformerGPTForCausalLM", "ToSTModel",
                                        "WhiteformerForImageClassification", "WhiteformerForImageClassification",
                                        "WhiteformerVisionModel"]


def test_import_whiteformer_registers_lazily(tmp_path):
    """``import whiteformer`` imports no transformers; the Auto classes know whiteformer when loaded."""
    net = whiteformer.create_model("gpt_base", **TINY).eval()
    net.save_pretrained(tmp_path / "gpt")
    code = ("import sys, torch, whiteformer\n"
            "assert not [m for m in sys.modules if m.startswith(('transformers', 'peft'))]\n"
            "from transformers import AutoConfig, AutoModelForCausalLM\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'gpt')!r})\n"  # no trust_remote_code
            "print(type(m).__name__, AutoConfig.for_model('whiteformer-vision').model_type)\n")
    assert _run(code, tmp_path).split() == ["WhiteformerGPTForCausalLM", "whiteformer-vision"]


@pytest.mark.parametrize("model_type,name", [("whiteformer-tost-lm", "tost_lm_base"), ("whiteformer-gpt", "gpt_base")])
def test_lm_hidden_states_and_headless_model(model_type, name):
    config = AutoConfig.for_model(model_type, model_name=name, init_kwargs=TINY)
    lm = AutoModelForCausalLM.from_config(config).eval()
    base = AutoModel.from_config(config).eval()
    base.load_state_dict(lm.state_dict())
    idx = torch.randint(1, 61, (2, 6))
    mask = torch.ones_like(idx)
    mask[1, :2] = 0  # left padding
    with torch.no_grad():
        out = lm(idx, attention_mask=mask, output_hidden_states=True, use_cache=False)
        plain = lm(idx, attention_mask=mask, use_cache=False)
        head = base(idx, attention_mask=mask, output_hidden_states=True)
        net = lm.whiteformer
        emb = net.transformer.drop(net.transformer.wte(idx) + net.transformer.wpe((mask.cumsum(1) - 1).clamp_min(0)))
    assert type(head).__name__ == "BaseModelOutputWithPast" and out.hidden_states is not None
    assert len(out.hidden_states) == TINY["depth"] + 1 == len(head.hidden_states)
    torch.testing.assert_close(out.logits, plain.logits, rtol=0, atol=0)
    torch.testing.assert_close(out.hidden_states[0], emb)
    torch.testing.assert_close(head.last_hidden_state, out.hidden_states[-1])  # last: after ln_f (as GPT-2)
    torch.testing.assert_close(net.lm_head(head.last_hidden_state), plain.logits)
    with torch.no_grad():  # block 1 output -> block 2 -> ln_f gives the final state
        x = net.transformer.h[1](out.hidden_states[1], mask.bool())
    torch.testing.assert_close(net.transformer.ln_f(x), out.hidden_states[-1])
    cached = lm(idx, use_cache=True, output_hidden_states=True)  # prompt through the cache: same states
    torch.testing.assert_close(cached.hidden_states[1], lm(idx, use_cache=False, output_hidden_states=True)
                               .hidden_states[1])
    with torch.no_grad():  # tokens stepped from the cache: the columns of the whole sequence's states
        step = lm(idx[:, :2], cache=cache_of(cached), output_hidden_states=True)
        whole = lm(torch.cat([idx, idx[:, :2]], 1), use_cache=False, output_hidden_states=True)
    assert len(step.hidden_states) == TINY["depth"] + 1
    for h_step, h_whole in zip(step.hidden_states, whole.hidden_states):
        torch.testing.assert_close(h_step, h_whole[:, -2:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step.logits, whole.logits[:, -2:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="headless"):
        base(idx, use_cache=True)
    gen = lm.generate(idx, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                      output_hidden_states=True, return_dict_in_generate=True)
    assert torch.equal(gen.sequences, lm.generate(idx, attention_mask=mask, max_new_tokens=3, do_sample=False,
                                                  pad_token_id=0))
    assert [tuple(h[-1].shape) for h in gen.hidden_states] == [(2, 6, 32), (2, 1, 32), (2, 1, 32)]
    lm.config.output_hidden_states = True  # what from_pretrained(d, output_hidden_states=True) sets
    base.config.output_hidden_states = True
    with torch.no_grad():
        torch.testing.assert_close(lm(idx, use_cache=False).hidden_states[1],
                                   lm(idx, use_cache=False, output_hidden_states=True).hidden_states[1])
        assert len(base(idx).hidden_states) == TINY["depth"] + 1
        assert lm(idx, use_cache=False, output_hidden_states=False).hidden_states is None
    docs = [torch.randint(1, 61, (1, n)) for n in (4, 3)]  # packed documents: position_ids restart at 0
    packed = lm(torch.cat(docs, 1), position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2]]), use_cache=False,
                output_hidden_states=True)
    for doc, (a, b) in zip(docs, ((0, 4), (4, 7))):
        alone = lm(doc, use_cache=False, output_hidden_states=True)
        for h_packed, h_alone in zip(packed.hidden_states, alone.hidden_states):
            torch.testing.assert_close(h_packed[:, a:b], h_alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed.logits[:, a:b], alone.logits, rtol=1e-5, atol=1e-5)
    assert lm._tied_weights_keys == {"lm_head.weight": "transformer.wte.weight"}
    blocks = {type(m).__name__ for m in lm.modules()}
    assert "LMBlock" in blocks and set(lm._no_split_modules) & blocks == {"LMBlock"}
    assert isinstance(lm.supports_gradient_checkpointing, bool)


@pytest.mark.parametrize("name", ["tost_t12_p16", "deit_t_p16", "crate_t", "eca_t"])
def test_vision_hidden_states_and_headless_model(name):
    net = whiteformer.create_model(name, **VISION_KW).eval()
    config = AutoConfig.for_model("whiteformer-vision", model_name=name, init_kwargs=net.init_kwargs)
    cls = AutoModelForImageClassification.from_config(config).eval()
    cls.load_state_dict(net.state_dict())
    base = AutoModel.from_config(config).eval()
    base.load_state_dict(net.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = cls(pixel_values=x, output_hidden_states=True)
        head = base(pixel_values=x, output_hidden_states=True)
        want = net(x)
        feats = net.forward_features(x)
        inter = net.forward_intermediates(x, output_fmt="NLC", return_prefix_tokens=True, intermediates_only=True)
    torch.testing.assert_close(out.logits, want, rtol=0, atol=0)
    assert len(out.hidden_states) == VISION_KW["depth"] + 1 == len(head.hidden_states)
    torch.testing.assert_close(head.last_hidden_state, feats)
    torch.testing.assert_close(head.pooler_output, net.forward_head(feats, pre_logits=True))
    for h, (spatial, prefix) in zip(out.hidden_states[1:], inter):  # block outputs, prefix tokens first
        torch.testing.assert_close(h, torch.cat([prefix, spatial], dim=1))
    assert out.hidden_states[0].shape == out.hidden_states[1].shape
    cls.config.output_hidden_states = True  # what from_pretrained(d, output_hidden_states=True) sets
    with torch.no_grad():
        assert len(cls(pixel_values=x).hidden_states) == VISION_KW["depth"] + 1
    assert set(cls._no_split_modules) & {type(m).__name__ for m in cls.modules()}


def test_feature_extraction_pipeline():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast, pipeline

    words = ["[PAD]", "[UNK]"] + "the cat sat on a mat".split()
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                        model_input_names=["input_ids", "attention_mask"])
    config = AutoConfig.for_model("whiteformer-tost-lm", model_name="tost_lm_base", init_kwargs=TINY)
    model = AutoModel.from_config(config).eval()
    extract = pipeline("feature-extraction", model=model, tokenizer=tokenizer)
    got = torch.tensor(extract("the cat sat on a mat"))
    ids = tokenizer("the cat sat on a mat", return_tensors="pt")
    with torch.no_grad():
        want = model(**ids).last_hidden_state
    assert got.shape == (1, 6, 32)
    torch.testing.assert_close(got, want)


def test_no_split_modules_names_only_blocks_the_wrapped_models_have():
    from whiteformer.hf.modeling import WhiteformerPreTrainedModel

    names = set()
    for name in ("tost_t12_p16", "deit_t_p16", "crate_t", "eca_t", "tost_lm_base", "gpt_base", "decoder_base"):
        kw = VISION_KW if not name.endswith("_base") else dict(depth=1)
        names |= {type(m).__name__ for m in whiteformer.create_model(name, **kw).modules()}
    assert set(WhiteformerPreTrainedModel._no_split_modules) <= names
