"""A transformers ViT through the compressor and back: compress() and `whiteformer compress` take the
transformers model or folder directly (converted inside, same logits), the model is named by its
sizes, and the compressed folder loads with AutoModelForImageClassification(trust_remote_code=True)
in a fresh process that never imports whiteformer, with the compressed model's logits."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("transformers", reason="needs the hf extra: pip install whiteformer[hf]")

import whiteformer  # noqa: E402
from test_hf import _hf_vit  # noqa: E402  (a small transformers ViT with non-trivial norms and biases)
from whiteformer.compress import compress  # noqa: E402
from whiteformer.models import from_transformers_vit  # noqa: E402
from whiteformer.models.formats.vit_weights import describe_sizes, model_name_for  # noqa: E402

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_names_follow_the_sizes():
    assert model_name_for(dict(embed_dim=192, depth=12, num_heads=3, patch_size=16, mlp_ratio=4.0)) == "deit_t_p16"
    assert model_name_for(dict(embed_dim=768, depth=12, num_heads=12, patch_size=16)) == "deit_b_p16"
    assert model_name_for(dict(embed_dim=64, depth=2, num_heads=4, patch_size=16)) == "vit"
    assert model_name_for(dict(embed_dim=192, depth=12, num_heads=3, patch_size=8)) == "vit"
    assert describe_sizes(dict(embed_dim=64, depth=2, num_heads=4, patch_size=(8, 8), img_size=(32, 32))) == \
        "D 64, 2 blocks, 4 heads, patch 8, 32 px"


def test_compress_takes_a_transformers_vit_object(tmp_path):
    hf = _hf_vit()
    x = torch.randn(3, 3, 32, 32)
    net = from_transformers_vit(hf).eval()
    assert net.model_name == "vit" and net.embed_dim == 32 and len(net.blocks) == 2 and net.num_classes == 5
    with torch.no_grad():
        torch.testing.assert_close(net(x), hf(pixel_values=x).logits, rtol=1e-5, atol=1e-6)
    small, report = compress(hf, qk="truncatt", qk_rank=4, vo="truncatt", vo_rank=4)
    assert len(report.blocks) == 2 and report.flops_ratio < 1
    want, _ = compress(net, qk="truncatt", qk_rank=4, vo="truncatt", vo_rank=4)  # the same as converting first
    with torch.no_grad():
        torch.testing.assert_close(small.eval()(x), want.eval()(x), rtol=0, atol=0)
    hf.save_pretrained(tmp_path / "hf")  # a transformers folder, by path
    from_folder, _ = compress(str(tmp_path / "hf"), qk="truncatt", qk_rank=4, vo="truncatt", vo_rank=4)
    with torch.no_grad():
        torch.testing.assert_close(from_folder.eval()(x), want.eval()(x), rtol=1e-6, atol=1e-6)
    wrapper_small, _ = compress(hf_wrapper(net), qk="truncatt", qk_rank=4, vo="truncatt", vo_rank=4)
    with torch.no_grad():
        torch.testing.assert_close(wrapper_small.eval()(x), want(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="distillation token"):
        from transformers import DeiTConfig, DeiTForImageClassificationWithTeacher

        compress(DeiTForImageClassificationWithTeacher(DeiTConfig(hidden_size=32, num_hidden_layers=1,
                                                                  num_attention_heads=4, intermediate_size=64,
                                                                  image_size=32, patch_size=8)),
                 qk="truncatt", qk_rank=2)


def hf_wrapper(net):
    from transformers import AutoConfig, AutoModelForImageClassification

    config = AutoConfig.for_model("whiteformer-vision", model_name=net.model_name, init_kwargs=net.init_kwargs)
    wrapper = AutoModelForImageClassification.from_config(config)
    wrapper.load_state_dict(net.state_dict())
    return wrapper


def test_cli_compresses_a_transformers_folder_and_transformers_loads_the_result(tmp_path, capsys):
    from whiteformer.app.cli import main

    hf = _hf_vit()
    hf.save_pretrained(tmp_path / "hf")
    rc = main(["compress", "--checkpoint", str(tmp_path / "hf"), "--qk", "truncatt", "--qk-rank", "4",
                        "--vo-rank", "4", "--out", str(tmp_path / "out")])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "compressing vit (D 32, 2 blocks, 4 heads, patch 8, 32 px;" in printed and "deit_b_p16" not in printed
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_name"] == "vit" and config["auto_map"]["AutoModelForImageClassification"]
    small = whiteformer.from_pretrained(tmp_path / "out").eval()
    assert small.init_kwargs["compression"]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = small(x)
    torch.save(x, tmp_path / "x.pt")
    torch.save(want, tmp_path / "want.pt")
    code = ("import sys, torch\n"
            "from transformers import AutoModelForImageClassification\n"
            f"m = AutoModelForImageClassification.from_pretrained({str(tmp_path / 'out')!r}, "
            "trust_remote_code=True).eval()\n"
            f"x, want = torch.load({str(tmp_path / 'x.pt')!r}), torch.load({str(tmp_path / 'want.pt')!r})\n"
            "with torch.no_grad():\n    got = m(pixel_values=x).logits\n"
            "print(type(m).__name__, bool(torch.equal(got, want)))\n")
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"),
           "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[-2:] == ["WhiteformerForImageClassification", "True"], res.stdout
