"""The Llama-style decoder in transformers (whiteformer-decoder): a converted Llama saved by
whiteformer loads with AutoModelForCausalLM (in this process, and with trust_remote_code in one that
imports only transformers), keeps its untied head, gives the same logits, and its greedy
generate() equals whiteformer's, for softmax and hybrid layers, with left padding."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install whiteformer[hf]")

from transformers import AutoModelForCausalLM  # noqa: E402

import whiteformer  # noqa: E402
from whiteformer.convert import from_transformers  # noqa: E402
from whiteformer.hf import LORA_TARGET_MODULES  # noqa: E402

SRC = str(Path(__file__).resolve().parents[2] / "src")
V = 61


def _decoder(**over):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rope_theta=5e4, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    net = from_transformers(transformers.LlamaForCausalLM(config))
    if over:  # same shape, other layers: a fresh model of those arguments
        net = type(net)(**{**net.init_kwargs, **over}).eval()
        net.model_name = "decoder_base"
    return net


@pytest.mark.parametrize("over", [{}, {"attention": "tssa", "keep_softmax": [1]}], ids=["softmax", "hybrid"])
def test_a_saved_decoder_loads_with_auto_classes_and_generates_the_same(over, tmp_path):
    net = _decoder(**over)
    net.save_pretrained(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert type(model).__name__ == "WhiteformerDecoderForCausalLM"
    assert model.lm_head.weight is not model.transformer.wte.weight  # the untied head stays untied
    assert model.config.tie_word_embeddings is False and model.config.num_key_value_heads == 2
    idx = torch.randint(3, V, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, net(idx)[0])
    ref = net.generate(idx, 6, temperature=0)
    out = model.generate(idx, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    mask = torch.ones_like(idx)
    mask[1, :4] = 0  # left padding: row 1 is its last 5 tokens
    out = model.generate(idx, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                         pad_token_id=0)
    assert torch.equal(out[1:, 4:], net.generate(idx[1:, 4:], 4, temperature=0))


def test_the_folder_loads_in_a_process_that_imports_only_transformers(tmp_path):
    net = _decoder()
    net.save_pretrained(tmp_path / "m")
    idx = torch.randint(3, V, (1, 7))
    ref = net.generate(idx, 5, temperature=0)
    code = ("import sys, torch\nfrom transformers import AutoModelForCausalLM\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'm')!r}, trust_remote_code=True).eval()\n"
            f"out = m.generate(torch.tensor({idx.tolist()}), max_new_tokens=5, min_new_tokens=5, do_sample=False, "
            "pad_token_id=0)\nprint(out.tolist())\nprint('whiteformer' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"),
           "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert lines[-2] == str(ref.tolist())


def test_lora_targets_name_modules_of_both_kinds_of_layer():
    net = whiteformer.create_model("tost_decoder_base", vocab_size=V, dim=32, depth=2, num_heads=4,
                                   intermediate_size=48, keep_softmax=[0])
    names = [n for n, m in net.named_modules() if isinstance(m, torch.nn.Linear)]
    targets = LORA_TARGET_MODULES["whiteformer-decoder"]
    assert all(any(n.endswith(t) for n in names) for t in targets)  # every target exists in a hybrid
    assert all(any(n.endswith(t) for t in targets) for n in names if n.startswith("transformer.h."))
