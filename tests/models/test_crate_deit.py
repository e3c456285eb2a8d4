"""CRATE and timm-compatible DeiT: configs, parameter counts, timm key layout and protocol,
official CRATE checkpoint conversion, position-embedding resampling, save/load."""
import math

import pytest
import torch
import torch.nn.functional as F

from whiteformer.attention.baselines import MHSA
from whiteformer.layers import resample_abs_pos_embed
from whiteformer.models import create_model, list_models

# ---------------------------------------------------------------------------- parameter counts
# CRATE: official CRATE_tiny/small/base/large (paper: 6.09M/13.12M/22.80M/77.64M);
# DeiT: timm deit_{tiny,small,base}_patch16_224 (5,717,416 / 22,050,664 / 86,567,656).
PARAMS = {
    "crate_t": 6.09e6, "crate_s": 13.12e6, "crate_b": 22.80e6, "crate_l": 77.64e6,
    "deit_t_p16": 5.7e6, "deit_s_p16": 22.1e6, "deit_b_p16": 86.6e6,
}
TIMM_EXACT = {"deit_t_p16": 5_717_416, "deit_s_p16": 22_050_664, "deit_b_p16": 86_567_656}


def _meta_count(name, **kw):
    with torch.device("meta"):
        model = create_model(name, **kw)
    return sum(p.numel() for p in model.parameters())


def test_registered():
    names = set(list_models())
    assert set(PARAMS) <= names


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_param_count_full_config(name):
    n = _meta_count(name)
    assert abs(n - PARAMS[name]) / PARAMS[name] < 0.005, n
    if name in TIMM_EXACT:
        assert n == TIMM_EXACT[name]


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_build_and_forward_small(name):
    # full width and heads, reduced depth / resolution / classes for speed
    model = create_model(name, img_size=32, num_classes=7, depth=1).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        y = model(x)
    assert y.shape == (2, 7) and torch.isfinite(y).all()


# ---------------------------------------------------------------------------- DeiT = timm layout
TIMM_TINY_KEYS = [  # timm VisionTransformer(img_size=28, patch_size=4, in_chans=1, num_classes=10,
    # embed_dim=48, depth=2, num_heads=3).state_dict()
    ("cls_token", (1, 1, 48)), ("pos_embed", (1, 50, 48)),
    ("patch_embed.proj.weight", (48, 1, 4, 4)), ("patch_embed.proj.bias", (48,)),
    ("blocks.0.norm1.weight", (48,)), ("blocks.0.norm1.bias", (48,)),
    ("blocks.0.attn.qkv.weight", (144, 48)), ("blocks.0.attn.qkv.bias", (144,)),
    ("blocks.0.attn.proj.weight", (48, 48)), ("blocks.0.attn.proj.bias", (48,)),
    ("blocks.0.norm2.weight", (48,)), ("blocks.0.norm2.bias", (48,)),
    ("blocks.0.mlp.fc1.weight", (192, 48)), ("blocks.0.mlp.fc1.bias", (192,)),
    ("blocks.0.mlp.fc2.weight", (48, 192)), ("blocks.0.mlp.fc2.bias", (48,)),
    ("blocks.1.norm1.weight", (48,)), ("blocks.1.norm1.bias", (48,)),
    ("blocks.1.attn.qkv.weight", (144, 48)), ("blocks.1.attn.qkv.bias", (144,)),
    ("blocks.1.attn.proj.weight", (48, 48)), ("blocks.1.attn.proj.bias", (48,)),
    ("blocks.1.norm2.weight", (48,)), ("blocks.1.norm2.bias", (48,)),
    ("blocks.1.mlp.fc1.weight", (192, 48)), ("blocks.1.mlp.fc1.bias", (192,)),
    ("blocks.1.mlp.fc2.weight", (48, 192)), ("blocks.1.mlp.fc2.bias", (48,)),
    ("norm.weight", (48,)), ("norm.bias", (48,)),
    ("head.weight", (10, 48)), ("head.bias", (10,)),
]


def _tiny_deit(**kw):
    cfg = dict(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=48, depth=2, num_heads=3)
    cfg.update(kw)
    return create_model("deit_t_p16", **cfg)


def test_deit_state_dict_is_timm_layout():
    sd = _tiny_deit().state_dict()
    assert [(k, tuple(v.shape)) for k, v in sd.items()] == TIMM_TINY_KEYS


def test_deit_layer_scale_keys_as_timm():
    keys = set(_tiny_deit(init_values=1e-5).state_dict())
    assert {"blocks.0.ls1.gamma", "blocks.0.ls2.gamma"} <= keys


def test_deit_avg_pool_uses_fc_norm_as_timm():
    keys = set(_tiny_deit(global_pool="avg").state_dict())
    assert "fc_norm.weight" in keys and "norm.weight" not in keys


def test_deit_issue_small_variant_and_attention_instances():
    model = create_model("deit_t_p16", img_size=28, patch_size=4, in_chans=1, num_classes=10, depth=4).eval()
    y = model(torch.randn(3, 1, 28, 28))
    assert y.shape == (3, 10) and torch.isfinite(y).all()
    assert len(model.blocks) == 4
    for blk in model.blocks:
        assert isinstance(blk.attn, MHSA) and blk.attn.num_heads == 3
        assert blk.attn.qkv.bias is not None and blk.norm1.eps == 1e-6
    assert model.pos_embed.shape == (1, 50, 192) and model.cls_token.shape == (1, 1, 192)


def _reference_vit(model, x):
    """ViT forward written out from the state dict (timm Block semantics, eval mode)."""
    sd = model.state_dict()
    d = sd["cls_token"].shape[-1]
    heads = model.blocks[0].attn.num_heads
    t = F.conv2d(x, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=model.patch_embed.patch_size)
    t = t.flatten(2).transpose(1, 2)
    t = torch.cat([sd["cls_token"].expand(x.shape[0], -1, -1), t], 1) + sd["pos_embed"]
    for i in range(len(model.blocks)):
        p = f"blocks.{i}."
        h = F.layer_norm(t, (d,), sd[p + "norm1.weight"], sd[p + "norm1.bias"], 1e-6)
        qkv = (h @ sd[p + "attn.qkv.weight"].T + sd[p + "attn.qkv.bias"]).reshape(*h.shape[:2], 3, heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v
        a = a.transpose(1, 2).reshape(h.shape)
        t = t + a @ sd[p + "attn.proj.weight"].T + sd[p + "attn.proj.bias"]
        h = F.layer_norm(t, (d,), sd[p + "norm2.weight"], sd[p + "norm2.bias"], 1e-6)
        h = F.gelu(h @ sd[p + "mlp.fc1.weight"].T + sd[p + "mlp.fc1.bias"])
        t = t + h @ sd[p + "mlp.fc2.weight"].T + sd[p + "mlp.fc2.bias"]
    t = F.layer_norm(t, (d,), sd["norm.weight"], sd["norm.bias"], 1e-6)
    return t[:, 0] @ sd["head.weight"].T + sd["head.bias"], t


def test_deit_forward_matches_written_out_vit():
    model = _tiny_deit().double().eval()
    x = torch.randn(2, 1, 28, 28, dtype=torch.float64)
    ref_logits, ref_tokens = _reference_vit(model, x)
    torch.testing.assert_close(model(x), ref_logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(model.forward_features(x), ref_tokens, rtol=1e-10, atol=1e-10)


def test_deit_timm_protocol():
    model = _tiny_deit().eval()
    x = torch.randn(2, 1, 28, 28)
    feats = model.forward_features(x)
    assert feats.shape == (2, 50, 48)
    torch.testing.assert_close(model.forward_head(feats), model(x))
    torch.testing.assert_close(model.forward_head(feats, pre_logits=True), feats[:, 0])
    assert model.no_weight_decay() == {"pos_embed", "cls_token"}
    named = dict(model.named_parameters())
    assert all(n in named for n in model.no_weight_decay())

    final, inter = model.forward_intermediates(x)
    torch.testing.assert_close(final, feats)
    assert len(inter) == 2 and inter[0].shape == (2, 48, 7, 7)
    last = model.forward_intermediates(x, indices=1, norm=True, output_fmt="NLC", intermediates_only=True)
    assert len(last) == 1
    torch.testing.assert_close(last[0], feats[:, 1:])
    pairs = model.forward_intermediates(x, indices=[-1], norm=True, return_prefix_tokens=True,
                                        intermediates_only=True)
    torch.testing.assert_close(pairs[0][1], feats[:, :1])
    torch.testing.assert_close(pairs[0][0], feats[:, 1:].reshape(2, 7, 7, 48).permute(0, 3, 1, 2))
    first = model.forward_intermediates(x, indices=[0], stop_early=True, output_fmt="NLC")[1][0]
    assert first.shape == (2, 49, 48) and not torch.allclose(first, last[0])
    with pytest.raises(ValueError, match="out of range"):
        model.forward_intermediates(x, indices=[5])
    with pytest.raises(ValueError, match="output_fmt"):
        model.forward_intermediates(x, output_fmt="NHWC")

    model.reset_classifier(4)
    assert model(x).shape == (2, 4) and model.init_kwargs["num_classes"] == 4
    model.reset_classifier(0, global_pool="avg")
    torch.testing.assert_close(model(x), feats[:, 1:].mean(1))


@pytest.mark.parametrize("name", ["tost_t12_p16", "crate_t", "deit_t_p16"])
def test_head_arguments_checked_by_every_vision_family(name):
    tiny = dict(img_size=32, patch_size=8, embed_dim=48, depth=1, num_heads=4)
    with pytest.raises(ValueError, match=r"global_pool must be one of \['token', 'avg'\], got 'max'"):
        create_model(name, global_pool="max", **tiny)
    with pytest.raises(ValueError, match=r"global_pool must be one of \['token', 'avg'\], got None"):
        create_model(name, global_pool=None, **tiny)
    with pytest.raises(ValueError, match="num_classes must be a non-negative integer, got -1"):
        create_model(name, num_classes=-1, **tiny)
    model = create_model(name, num_classes=3, global_pool="avg", **tiny)
    assert (model.num_classes, model.global_pool) == (3, "avg")
    assert model.init_kwargs["num_classes"] == 3 and model.init_kwargs["global_pool"] == "avg"


def test_deit_bad_inputs():
    model = _tiny_deit()
    with pytest.raises(ValueError, match=r"\(B, 1, 28, 28\)"):
        model(torch.randn(2, 1, 32, 32))
    with pytest.raises(ValueError, match="4 dimensions"):
        model(torch.randn(1, 28, 28))
    with pytest.raises(ValueError, match="divisible"):
        _tiny_deit(embed_dim=50)
    with pytest.raises(ValueError, match="global_pool"):
        _tiny_deit(global_pool="max")
    with pytest.raises(ValueError, match="divisible by patch_size"):
        _tiny_deit(img_size=30)
    with pytest.raises(TypeError, match="unknown argument"):
        _tiny_deit(num_head=3)


def test_deit_train_mode_drop_path_finite():
    model = _tiny_deit(drop_path_rate=0.2, drop_rate=0.1, attn_drop_rate=0.1, proj_drop_rate=0.1).train()
    dpr = [getattr(b.drop_path1, "drop_prob", 0.0) for b in model.blocks]
    assert dpr == pytest.approx([0.0, 0.2])
    y = model(torch.randn(4, 1, 28, 28))
    y.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(model.pos_embed.grad).all()


# ---------------------------------------------------------------------------- pos_embed resampling
def test_resample_matches_timm_values():
    # values produced by timm.layers.resample_abs_pos_embed (bicubic, antialias=True)
    pe = torch.tensor([100.0] + [float(i) for i in range(9)]).reshape(1, 10, 1)
    up = resample_abs_pos_embed(pe, (4, 4))[0, :, 0]
    expect_up = [100.0, -0.20895522832870483, 0.39987853169441223, 1.2866886854171753, 1.8955225944519043,
                 1.6175459623336792, 2.226379871368408, 3.113189935684204, 3.7220239639282227,
                 4.277976036071777, 4.886810302734375, 5.773620128631592, 6.382453918457031,
                 6.104477405548096, 6.713311672210693, 7.60012149810791, 8.208954811096191]
    torch.testing.assert_close(up, torch.tensor(expect_up), rtol=0, atol=1e-5)
    down = resample_abs_pos_embed(pe, (2, 2))[0, :, 0]
    expect_down = [100.0, 1.2391648292541504, 2.619582176208496, 5.3804168701171875, 6.760834217071533]
    torch.testing.assert_close(down, torch.tensor(expect_down), rtol=0, atol=1e-5)
    assert resample_abs_pos_embed(pe, (3, 3)) is pe
    with pytest.raises(ValueError, match="square grid"):
        resample_abs_pos_embed(torch.zeros(1, 9, 2), (2, 2))


def test_timm_checkpoint_loads_with_prefix_and_resampled_pos_embed(tmp_path):
    src = _tiny_deit().eval()
    sd = {f"module.{k}": v for k, v in src.state_dict().items()}
    path = tmp_path / "deit.pth"
    torch.save({"model": sd, "epoch": 3}, path)
    same = create_model("deit_t_p16", img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=48,
                        depth=2, num_heads=3, checkpoint_path=str(path)).eval()
    x = torch.randn(2, 1, 28, 28)
    torch.testing.assert_close(same(x), src(x), rtol=0, atol=0)

    big = create_model("deit_t_p16", img_size=36, patch_size=4, in_chans=1, num_classes=10, embed_dim=48,
                       depth=2, num_heads=3, checkpoint_path=str(path)).eval()
    assert big.pos_embed.shape == (1, 82, 48)
    torch.testing.assert_close(big.pos_embed[:, :1], src.pos_embed[:, :1])
    expect = resample_abs_pos_embed(src.pos_embed.detach(), (9, 9))
    torch.testing.assert_close(big.pos_embed.detach(), expect)
    torch.testing.assert_close(big.blocks[1].attn.qkv.weight, src.blocks[1].attn.qkv.weight)
    assert torch.isfinite(big(torch.randn(1, 1, 36, 36))).all()


@pytest.mark.parametrize("name,kw", [
    ("deit_t_p16", dict(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=48, depth=2, num_heads=3)),
    ("crate_t", dict(img_size=32, patch_size=8, num_classes=5, embed_dim=48, depth=2, num_heads=4)),
])
def test_save_pretrained_round_trip(tmp_path, name, kw):
    model = create_model(name, **kw).eval()
    model.save_pretrained(tmp_path / "ckpt")
    again = create_model(name, checkpoint_path=str(tmp_path / "ckpt")).eval()
    x = torch.randn(2, model.patch_embed.in_chans, *model.patch_embed.img_size)
    torch.testing.assert_close(again(x), model(x), rtol=0, atol=0)


# ---------------------------------------------------------------------------- CRATE
def _official_crate_state_dict(dim=48, depth=2, heads=4, dim_head=12, patch=8, img=32, chans=3, classes=5,
                               dtype=torch.float64):
    """Random tensors in the official CRATE ``model/crate.py`` key layout."""
    n = (img // patch) ** 2
    pd = chans * patch * patch
    inner = heads * dim_head
    shapes = {
        "pos_embedding": (1, n + 1, dim), "cls_token": (1, 1, dim),
        "to_patch_embedding.1.weight": (pd,), "to_patch_embedding.1.bias": (pd,),
        "to_patch_embedding.2.weight": (dim, pd), "to_patch_embedding.2.bias": (dim,),
        "to_patch_embedding.3.weight": (dim,), "to_patch_embedding.3.bias": (dim,),
    }
    for i in range(depth):
        p = f"transformer.layers.{i}."
        shapes.update({
            p + "0.norm.weight": (dim,), p + "0.norm.bias": (dim,),
            p + "0.fn.qkv.weight": (inner, dim),
            p + "0.fn.to_out.0.weight": (dim, inner), p + "0.fn.to_out.0.bias": (dim,),
            p + "1.norm.weight": (dim,), p + "1.norm.bias": (dim,),
            p + "1.fn.weight": (dim, dim),
        })
    shapes.update({"mlp_head.0.weight": (dim,), "mlp_head.0.bias": (dim,),
                   "mlp_head.1.weight": (classes, dim), "mlp_head.1.bias": (classes,)})
    g = torch.Generator().manual_seed(0)
    sd = {}
    for k, s in shapes.items():
        scale = 1.0 / math.sqrt(s[-1]) if len(s) == 2 else 0.5
        sd[k] = torch.randn(s, generator=g, dtype=dtype) * scale + (1.0 if k.endswith("norm.weight") else 0.0)
    return sd


def _official_crate_forward(sd, x, heads, patch, pool="cls", eta=0.1, lambd=0.1):
    """Official CRATE forward written out (patches (p1 p2 c); PreNorm MSSA + residual; PreNorm ISTA)."""
    b, c, hh, ww = x.shape
    t = x.reshape(b, c, hh // patch, patch, ww // patch, patch).permute(0, 2, 4, 3, 5, 1)
    t = t.reshape(b, -1, patch * patch * c)
    ln = lambda z, k: F.layer_norm(z, z.shape[-1:], sd[k + ".weight"], sd[k + ".bias"], 1e-5)  # noqa: E731
    t = ln(t, "to_patch_embedding.1")
    t = t @ sd["to_patch_embedding.2.weight"].T + sd["to_patch_embedding.2.bias"]
    t = ln(t, "to_patch_embedding.3")
    t = torch.cat([sd["cls_token"].expand(b, -1, -1), t], 1) + sd["pos_embedding"]
    depth = len({k.split(".")[2] for k in sd if k.startswith("transformer.layers.")})
    for i in range(depth):
        p = f"transformer.layers.{i}."
        h = ln(t, p + "0.norm")
        w = (h @ sd[p + "0.fn.qkv.weight"].T).reshape(b, h.shape[1], heads, -1).transpose(1, 2)
        a = torch.softmax(w @ w.transpose(-1, -2) * w.shape[-1] ** -0.5, -1) @ w
        a = a.transpose(1, 2).reshape(b, h.shape[1], -1)
        z = t + a @ sd[p + "0.fn.to_out.0.weight"].T + sd[p + "0.fn.to_out.0.bias"]
        h = ln(z, p + "1.norm")
        d = sd[p + "1.fn.weight"]
        t = F.relu(h + eta * (h @ d - (h @ d.T) @ d) - eta * lambd)  # D^T h - D^T D h (row vectors)
    pooled = t.mean(1) if pool == "mean" else t[:, 0]
    return ln(pooled, "mlp_head.0") @ sd["mlp_head.1.weight"].T + sd["mlp_head.1.bias"]


@pytest.mark.parametrize("pool", ["token", "avg"])
def test_crate_official_checkpoint_matches_official_forward(tmp_path, pool):
    sd = _official_crate_state_dict()
    path = tmp_path / "crate.pth"
    torch.save({"model": sd}, path)
    model = create_model("crate_t", img_size=32, patch_size=8, num_classes=5, embed_dim=48, depth=2, num_heads=4,
                         global_pool=pool).double()
    from whiteformer.models.load import load_checkpoint

    load_checkpoint(model, path)
    model.eval()
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    ref = _official_crate_forward(sd, x, heads=4, patch=8, pool="mean" if pool == "avg" else "cls")
    torch.testing.assert_close(model(x), ref, rtol=1e-10, atol=1e-10)


def test_crate_structure_and_protocol():
    model = create_model("crate_t", img_size=32, patch_size=8, num_classes=5, embed_dim=48, depth=3,
                         num_heads=4).eval()
    keys = list(model.state_dict())
    assert keys[:4] == ["cls_token", "pos_embed", "patch_embed.patch_norm.weight", "patch_embed.patch_norm.bias"]
    assert "blocks.0.ista.weight" in keys and "blocks.0.attn.to_out.0.weight" in keys and "fc_norm.weight" in keys
    assert "blocks.0.attn.qkv.bias" not in keys  # MSSA projection has no bias
    blk = model.blocks[0]
    assert blk.ista.eta == 0.1 and blk.ista.lambd == 0.1
    x = torch.randn(2, 3, 32, 32)
    feats = model.forward_features(x)
    assert feats.shape == (2, 17, 48)
    assert (feats >= 0).all()  # ISTA output (ReLU) with no residual around it
    torch.testing.assert_close(model.forward_head(feats), model(x))
    final, inter = model.forward_intermediates(x, indices=2, output_fmt="NLC")
    torch.testing.assert_close(final, feats)
    torch.testing.assert_close(inter[-1], feats[:, 1:])
    assert model.no_weight_decay() == {"pos_embed", "cls_token"}
    model.reset_classifier(3)
    assert model(x).shape == (2, 3)
    with pytest.raises(ValueError, match=r"\(B, 3, 32, 32\)"):
        model(torch.randn(2, 3, 16, 16))


def test_crate_official_pos_embed_resampled():
    sd = _official_crate_state_dict(dtype=torch.float32)  # 4x4 grid
    model = create_model("crate_t", img_size=48, patch_size=8, num_classes=5, embed_dim=48, depth=2, num_heads=4)
    conv = model.convert_state_dict(sd)
    assert conv["pos_embed"].shape == (1, 37, 48)
    model.load_state_dict(conv)
    assert torch.isfinite(model(torch.randn(1, 3, 48, 48))).all()
