"""Checkpoints: own format (safetensors + config.json) round trips, official ToST conversion,
mismatch errors."""
import argparse
import json
import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from whiteformer import create_model
from whiteformer.models import from_pretrained
from whiteformer.models.load import load_checkpoint
from whiteformer.models.read import read_state_dict
from whiteformer.models.save import PretrainedMixin

# A tiny official-layout ToST: D 32, 4 heads, 2 blocks, p16 (4 conv stages 3->4->8->16->32), 7 classes.
D, HEADS, DEPTH, CLASSES, IMG = 32, 4, 2, 7, 64
TINY = dict(embed_dim=D, num_heads=HEADS, depth=DEPTH, num_classes=CLASSES, img_size=IMG)


def _randomise(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random values for every parameter and buffer (incl. BatchNorm statistics)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.dtype.is_floating_point:
                v = torch.randn(t.shape, generator=g) * 0.2
                if name.endswith("running_var"):
                    v = v.abs() + 0.5
                t.copy_(v)
            elif name.endswith("num_batches_tracked"):
                t.fill_(11)
    return model


# ----------------------------------------------------------------------------- own format
def test_save_pretrained_round_trip(tmp_path):
    model = _randomise(create_model("tost_t12_p16", img_size=32, patch_size=4, depth=2, num_classes=3,
                                    embed_dim=48, num_heads=4, mlp_ratio=2.0)).eval()
    x = torch.randn(2, 3, 32, 32)
    out = model.save_pretrained(tmp_path / "ckpt")
    assert out == tmp_path / "ckpt"
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors", "whiteformer_auto.py"]  # no temp
    config = json.loads((out / "config.json").read_text())
    assert config["model_name"] == "tost_t12_p16"
    assert config["init_kwargs"]["embed_dim"] == 48 and config["init_kwargs"]["img_size"] == 32

    # The saved constructor arguments are the defaults: no overrides needed to load the variant back.
    loaded = create_model("tost_t12_p16", checkpoint_path=str(out)).eval()
    assert loaded.embed_dim == 48 and len(loaded.blocks) == 2
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert torch.equal(from_pretrained(out).eval()(x), model(x))

    # Caller overrides win over the saved ones (here a drop rate, which does not change weights).
    again = create_model("tost_t12_p16", checkpoint_path=out, drop_path_rate=0.1)
    assert again.blocks[0].drop_path.drop_prob == pytest.approx(0.1)

    # The .safetensors file alone loads into a model built with the same arguments.
    bare = create_model("tost_t12_p16", img_size=32, patch_size=4, depth=2, num_classes=3, embed_dim=48,
                        num_heads=4, mlp_ratio=2.0)
    load_checkpoint(bare, out / "model.safetensors")
    torch.testing.assert_close(bare.eval()(x), model(x), rtol=0, atol=0)

    # Saving again over the same directory replaces the files atomically.
    model.head.bias.data.add_(1.0)
    model.save_pretrained(out)
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors", "whiteformer_auto.py"]
    assert torch.equal(create_model("tost_t12_p16", checkpoint_path=out).head.bias, model.head.bias)


@pytest.mark.parametrize("name", ["eca_t", "dmst_t12_p16", "xcit_s12_p16"])
def test_round_trip_other_attentions(tmp_path, name):
    kw = dict(img_size=32, patch_size=8, depth=1, num_classes=4, embed_dim=64)
    if name == "eca_t":
        kw["attn_kwargs"] = {"rank": 2}
    model = _randomise(create_model(name, **kw)).eval()
    x = torch.randn(1, 3, 32, 32)
    model.save_pretrained(tmp_path)
    loaded = create_model(name, checkpoint_path=tmp_path).eval()
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_checkpoint_from_other_model_name_raises(tmp_path):
    create_model("tost_t12_p16", img_size=32, depth=1).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="saved from model 'tost_t12_p16'"):
        create_model("dmst_t12_p16", checkpoint_path=tmp_path)


def test_tied_weights_saved_once_and_restored(tmp_path):
    class Tied(PretrainedMixin, nn.Module):
        def __init__(self, vocab: int = 11, dim: int = 6, scale=(1, 2)):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.out = nn.Linear(dim, vocab, bias=False)
            self.out.weight = self.emb.weight

    m = Tied(vocab=13)
    assert m.init_kwargs == {"vocab": 13, "dim": 6, "scale": (1, 2)}
    m.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["emb.weight"]
    sd = read_state_dict(tmp_path)
    assert sorted(sd) == ["emb.weight", "out.weight"] and torch.equal(sd["out.weight"], m.emb.weight)
    m2 = Tied(vocab=13)
    load_checkpoint(m2, tmp_path)
    assert torch.equal(m2.out.weight, m.emb.weight) and m2.out.weight is m2.emb.weight
    assert json.loads((tmp_path / "config.json").read_text())["init_kwargs"]["scale"] == [1, 2]


def test_unserialisable_init_kwargs_raise(tmp_path):
    class WithCallable(PretrainedMixin, nn.Module):
        def __init__(self, act=nn.GELU):
            super().__init__()
            self.lin = nn.Linear(2, 2)

    with pytest.raises(TypeError, match="act"):
        WithCallable().save_pretrained(tmp_path)


# ----------------------------------------------------------------------------- errors
def test_mismatched_checkpoints_raise_listing_keys(tmp_path):
    create_model("tost_t12_p16", **TINY).save_pretrained(tmp_path / "a")
    weights = tmp_path / "a" / "model.safetensors"
    deeper = create_model("tost_t12_p16", **{**TINY, "depth": 3})
    with pytest.raises(ValueError, match=r"missing keys \(\d+\): blocks\.2\."):
        load_checkpoint(deeper, weights)
    shallower = create_model("tost_t12_p16", **{**TINY, "depth": 1})
    with pytest.raises(ValueError, match=r"unexpected keys \(\d+\): blocks\.1\."):
        load_checkpoint(shallower, weights)
    other_head = create_model("tost_t12_p16", **{**TINY, "num_classes": 5})
    with pytest.raises(ValueError, match=r"mismatched shapes \(2\): head\.bias \(7,\) vs model \(5,\)"):
        load_checkpoint(other_head, weights)
    # Non-strict: everything but the head is loaded, and the report says what was skipped.
    report = load_checkpoint(other_head, weights, strict=False)
    assert [k for k, _, _ in report["mismatched"]] == ["head.bias", "head.weight"]
    ref = create_model("tost_t12_p16", checkpoint_path=tmp_path / "a")
    assert torch.equal(other_head.blocks[1].attn.qkv.weight, ref.blocks[1].attn.qkv.weight)


def test_bad_paths_raise(tmp_path):
    m = create_model("tost_t12_p16", **TINY)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(m, tmp_path / "nope.pth")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_checkpoint(m, tmp_path)
    (tmp_path / "w.txt").write_text("x")
    with pytest.raises(ValueError, match="unsupported checkpoint"):
        load_checkpoint(m, tmp_path / "w.txt")
    torch.save({"model": {"a": 1}}, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match="not tensors"):
        load_checkpoint(m, tmp_path / "bad.pth")


# ----------------------------------------------------------------------------- official ToST
def _official_state_dict(seed: int = 0):
    """Random tensors with the official ``tost_cab_*`` key layout and shapes (the
    state_dict of github RobinWu218/ToST ``tost_vision/tost.py``) for the TINY configuration."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    sd = {"cls_token": r(1, 1, D)}
    chans = [3, D // 8, D // 4, D // 2, D]
    for i in range(4):
        p = f"patch_embed.proj.{2 * i}"
        sd[f"{p}.0.weight"] = r(chans[i + 1], chans[i], 3, 3, scale=0.5)
        sd[f"{p}.1.weight"] = 1 + r(chans[i + 1])
        sd[f"{p}.1.bias"] = r(chans[i + 1])
        sd[f"{p}.1.running_mean"] = r(chans[i + 1])
        sd[f"{p}.1.running_var"] = r(chans[i + 1]).abs() + 0.5
        sd[f"{p}.1.num_batches_tracked"] = torch.tensor(1234)

    def block_common(p):
        sd[f"{p}.gamma1"] = 1 + r(D)
        sd[f"{p}.gamma2"] = 1 + r(D)
        for n in ("norm1", "norm2"):
            sd[f"{p}.{n}.weight"] = 1 + r(D)
            sd[f"{p}.{n}.bias"] = r(D)
        sd[f"{p}.mlp.fc1.weight"] = r(4 * D, D)
        sd[f"{p}.mlp.fc1.bias"] = r(4 * D)
        sd[f"{p}.mlp.fc2.weight"] = r(D, 4 * D)
        sd[f"{p}.mlp.fc2.bias"] = r(D)

    for i in range(DEPTH):
        p = f"blocks.{i}"
        block_common(p)
        sd[f"{p}.attn.temp"] = 1 + r(HEADS, 1)
        sd[f"{p}.attn.qkv.weight"] = r(D, D)
        sd[f"{p}.attn.qkv.bias"] = r(D)
        sd[f"{p}.attn.to_out.0.weight"] = r(D, D)
        sd[f"{p}.attn.to_out.0.bias"] = r(D)
    for i in range(2):
        p = f"cls_attn_blocks.{i}"
        block_common(p)
        sd[f"{p}.attn.qkv.weight"] = r(3 * D, D)
        sd[f"{p}.attn.qkv.bias"] = r(3 * D)
        sd[f"{p}.attn.proj.weight"] = r(D, D)
        sd[f"{p}.attn.proj.bias"] = r(D)
    sd["norm.weight"] = 1 + r(D)
    sd["norm.bias"] = r(D)
    sd["head.weight"] = r(CLASSES, D)
    sd["head.bias"] = r(CLASSES)
    sd["pos_embeder.token_projection.weight"] = r(D, 64, 1, 1)
    sd["pos_embeder.token_projection.bias"] = r(D)
    return sd


def _own_key(official_key: str) -> str:
    """Where each official key must land in our model."""
    k = official_key.replace("pos_embeder.", "pos_embed.")
    return k.replace(".attn.to_out.0.", ".attn.proj.")


def _official_forward(sd, x):
    """The official ``tost_cab`` forward (eval mode), written out literally from its definition:
    conv stem, DETR/XCiT Fourier encoding, TSSA blocks, CaiT class attention (tokens_norm=True)."""
    ln = lambda t, p: F.layer_norm(t, (D,), sd[p + ".weight"], sd[p + ".bias"], eps=1e-6)  # noqa: E731
    lin = lambda t, p: F.linear(t, sd[p + ".weight"], sd.get(p + ".bias"))  # noqa: E731

    # Patch embedding: [conv3x3 s2 + BN] x 4 with GELU between.
    h = x
    for i in range(4):
        p = f"patch_embed.proj.{2 * i}"
        h = F.conv2d(h, sd[p + ".0.weight"], stride=2, padding=1)
        h = F.batch_norm(h, sd[p + ".1.running_mean"], sd[p + ".1.running_var"], sd[p + ".1.weight"],
                         sd[p + ".1.bias"], training=False, eps=1e-5)
        if i < 3:
            h = F.gelu(h)
    B, _, Hp, Wp = h.shape
    tokens = h.flatten(2).transpose(1, 2)

    # Fourier position encoding with an all-False mask (cumsum of ones), hidden 32, T 10000.
    ones = torch.ones(B, Hp, Wp)
    ye = ones.cumsum(1)
    xe = ones.cumsum(2)
    ye = ye / (ye[:, -1:, :] + 1e-6) * 2 * math.pi
    xe = xe / (xe[:, :, -1:] + 1e-6) * 2 * math.pi
    dim_t = torch.arange(32, dtype=torch.float32)
    dim_t = 10000 ** (2 * torch.div(dim_t, 2, rounding_mode="floor") / 32)
    px, py = xe[..., None] / dim_t, ye[..., None] / dim_t
    px = torch.stack((px[..., 0::2].sin(), px[..., 1::2].cos()), dim=4).flatten(3)
    py = torch.stack((py[..., 0::2].sin(), py[..., 1::2].cos()), dim=4).flatten(3)
    pos = torch.cat((py, px), dim=3).permute(0, 3, 1, 2)
    pos = F.conv2d(pos, sd["pos_embeder.token_projection.weight"], sd["pos_embeder.token_projection.bias"])
    h = tokens + pos.reshape(B, -1, tokens.shape[1]).permute(0, 2, 1)

    # TSSA blocks (as github RobinWu218/ToST ``tost_vision/tost.py`` computes them).
    for i in range(DEPTH):
        p = f"blocks.{i}"
        y = ln(h, p + ".norm1")
        w = lin(y, p + ".attn.qkv").reshape(B, -1, HEADS, D // HEADS).permute(0, 2, 1, 3)  # b h n d
        w_normed = F.normalize(w, dim=-2)
        Pi = torch.softmax((w_normed ** 2).sum(-1) * sd[p + ".attn.temp"], dim=1)  # b h n
        dots = (Pi / (Pi.sum(-1, keepdim=True) + 1e-8)).unsqueeze(-2) @ (w ** 2)
        attn = 1.0 / (1 + dots)
        out = -(w * Pi.unsqueeze(-1)) * attn
        out = out.permute(0, 2, 1, 3).reshape(B, -1, D)
        h = h + sd[p + ".gamma1"] * lin(out, p + ".attn.to_out.0")
        h = h + sd[p + ".gamma2"] * lin(F.gelu(lin(ln(h, p + ".norm2"), p + ".mlp.fc1")), p + ".mlp.fc2")

    # CLS token + 2 class-attention blocks.
    h = torch.cat([sd["cls_token"].expand(B, -1, -1), h], dim=1)
    for i in range(2):
        p = f"cls_attn_blocks.{i}"
        y = ln(h, p + ".norm1")
        qkv = lin(y, p + ".attn.qkv").reshape(B, -1, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        a = ((q[:, :, :1] * k).sum(-1) * (D // HEADS) ** -0.5).softmax(-1)
        cls = (a.unsqueeze(2) @ v).transpose(1, 2).reshape(B, 1, D)
        attn_out = torch.cat([lin(cls, p + ".attn.proj"), y[:, 1:]], dim=1)
        h = h + sd[p + ".gamma1"] * attn_out
        h = ln(h, p + ".norm2")  # tokens_norm=True: all tokens
        cls = sd[p + ".gamma2"] * lin(F.gelu(lin(h[:, :1], p + ".mlp.fc1")), p + ".mlp.fc2")
        h = h + torch.cat([cls, h[:, 1:]], dim=1)
    feat = ln(h, "norm")[:, 0]
    return lin(feat, "head")


@pytest.mark.parametrize("wrap", ["plain", "training_script", "compiled_ddp"])
def test_official_tost_checkpoint_converts_and_matches(tmp_path, wrap):
    sd = _official_state_dict()
    path = tmp_path / "checkpoint.pth"
    if wrap == "plain":
        torch.save(sd, path)
    elif wrap == "training_script":  # what tost_vision/main.py writes (args is an argparse.Namespace)
        torch.save({"model": sd, "optimizer": {"state": {}, "param_groups": []}, "epoch": 3,
                    "args": argparse.Namespace(model="tost_cab_tiny_12_p16", lr=5e-4)}, path)
    else:
        torch.save({"state_dict": {"module._orig_mod." + k: v for k, v in sd.items()}}, path)

    model = create_model("tost_t12_p16", checkpoint_path=str(path), **TINY).eval()

    # Every official weight lands where it should, and nothing else is left.
    own = model.state_dict()
    assert sorted(own) == sorted(_own_key(k) for k in sd)
    for k, v in sd.items():
        assert torch.equal(own[_own_key(k)], v), k

    x = torch.randn(2, 3, IMG, IMG)
    with torch.no_grad():
        torch.testing.assert_close(model(x), _official_forward(sd, x), rtol=1e-5, atol=1e-5)


def test_official_conversion_is_identity_on_own_keys():
    m = create_model("tost_t12_p16", **TINY)
    sd = m.state_dict()
    assert m.convert_state_dict(dict(sd)).keys() == sd.keys()


def test_official_checkpoint_with_wrong_config_lists_keys(tmp_path):
    torch.save({"model": _official_state_dict()}, tmp_path / "c.pth")
    with pytest.raises(ValueError, match=r"(?s)missing keys.*blocks\.2\..*"):
        create_model("tost_t12_p16", checkpoint_path=tmp_path / "c.pth", **{**TINY, "depth": 3})
    with pytest.raises(ValueError, match=r"mismatched shapes .*attn\.temp \(4, 1\) vs model \(2, 1\)"):
        create_model("tost_t12_p16", checkpoint_path=tmp_path / "c.pth", **{**TINY, "num_heads": 2})
