"""PEFT on the transformers wrappers: LoRA without target_modules (whiteformer registers its default
targets with peft), a few training steps, adapter save/load, merge_and_unload = the adapted model."""
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("transformers", reason="needs the hf extra: pip install whiteformer[hf]")
peft = pytest.importorskip("peft", reason="needs the hf extra: pip install whiteformer[hf]")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification  # noqa: E402

import whiteformer  # noqa: E402,F401
from whiteformer.hf import LORA_TARGET_MODULES  # noqa: E402

TINY = dict(vocab_size=61, dim=32, depth=2, num_heads=4, max_len=64, init_values=1.0)  # (blocks count from the start)


def _adapted(model):
    """Names of the modules carrying a LoRA adapter."""
    return sorted({name.split(".lora_A")[0] for name, _ in model.named_parameters() if ".lora_A" in name})


@pytest.mark.parametrize("model_type,name", [("whiteformer-tost-lm", "tost_lm_base"), ("whiteformer-gpt", "gpt_base")])
def test_lora_round_trip_on_a_language_model(tmp_path, model_type, name):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, model_name=name, init_kwargs=TINY)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0))  # no target_modules
    suffixes = LORA_TARGET_MODULES[model_type]
    adapted = _adapted(model)
    assert len(adapted) == TINY["depth"] * len(suffixes)
    assert all(any(a.endswith(s) for s in suffixes) for a in adapted), adapted
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)

    ids = torch.randint(0, 61, (8, 12))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(8):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()

    again = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                      tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, want, rtol=0, atol=0)
        merged = again.merge_and_unload().eval()
        assert type(merged).__name__ == type(base).__name__ and not _adapted(merged)
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
        assert not torch.allclose(plain(input_ids=ids).logits, want, atol=1e-2)  # the adapter changed the model


@pytest.mark.parametrize("name", ["tost_t12_p16", "crate_t", "deit_t_p16", "eca_t"])
def test_lora_finds_its_targets_on_every_vision_family(name):
    net = whiteformer.create_model(name, img_size=32, patch_size=8, num_classes=5, depth=2)
    config = AutoConfig.for_model("whiteformer-vision", model_name=name, init_kwargs=net.init_kwargs)
    model = get_peft_model(AutoModelForImageClassification.from_config(config),
                           LoraConfig(r=2, modules_to_save=["head"]))
    adapted = _adapted(model)
    assert adapted and all(any(a.endswith(s) for s in LORA_TARGET_MODULES["whiteformer-vision"]) for a in adapted)
    assert not any("patch_embed" in a for a in adapted)
    x = torch.randn(2, 3, 32, 32)
    out = model(pixel_values=x, labels=torch.tensor([0, 3]))
    out.loss.backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert any("lora_B" in n for n in grads) and any("head" in n for n in grads)
