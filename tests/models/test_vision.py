"""Vision model zoo: the ToST/XCiT shell, its registered variants and building blocks."""
import math

import pytest
import torch
import torch.nn.functional as F

import whiteformer
from whiteformer import create_model, list_models
from whiteformer.layers import ISTA, ConvPatchEmbed, DropPath, FourierPositionalEncoding, Mlp
from whiteformer.models.vision import Block, ToSTVision

VISION = [
    "tost_t12_p16", "tost_s12_p16", "tost_t24_p16", "tost_s24_p16", "tost_m24_p16",
    "tost_t12_p8", "tost_s12_p8", "tost_t24_p8", "tost_s24_p8", "tost_m24_p8",
    "dmst_t12_p16", "dmst_s12_p16",
    "eca_t", "eca_s", "eca_m", "eca_b", "eca_bplus", "eca_l",
    "xcit_s12_p16", "vit_cab_s12_p16",
]

# (measured count, reference count, relative tolerance). Official ToST counts within 0.5%,
# ECA (ECAttention paper Table 3) at the paper's printed precision (T, S with p = 64) or within 0.5% (M, B, B+, L:
# the paper prints 14.7M/21.0M/57.7M/70M); the others are exact measured values of this shell.
_TOST_T, _TOST_S = 5_769_328, 22_589_944
PARAM_COUNTS = {
    "tost_t12_p16": (_TOST_T, 5.769e6, 0.005),
    "tost_s12_p16": (_TOST_S, 22.590e6, 0.005),
    "tost_t24_p16": (10_223_008, 10.22e6, 0.005),
    "tost_s24_p16": (40_344_664, 40.35e6, 0.005),
    "tost_m24_p16": (71_481_064, 71.48e6, 0.005),
    "tost_t12_p8": (5_759_560, 5_759_560, 0.0),
    "tost_m24_p8": (71_408_936, 71_408_936, 0.0),
    # DMSA = TSSA without temp (H per block) + membership Linear(D, H, bias=False) per block.
    "dmst_t12_p16": (5_778_496, _TOST_T + 12 * (192 * 4 - 4), 0.0),
    "dmst_s12_p16": (22_626_712, _TOST_S + 12 * (384 * 8 - 8), 0.0),
    "eca_t": (1_762_660 + 12 * 192 * (4 * 64 - 192), 1.91e6, 0.0),  # L d (K p - d) = 4 d^2 more than p = 48
    "eca_s": (6_613_948 + 12 * 384 * (8 * 64 - 384), 7.2e6, 0.0),
    "eca_m": (14_722_672, 14.7e6, 0.005),
    "eca_b": (21_038_776, 21.0e6, 0.005),
    "eca_bplus": (57_706_672, 57.7e6, 0.005),
    "eca_l": (70_314_196, 70.0e6, 0.005),
    # XCA / MHSA: qkv is (3D, D), i.e. 2 D^2 more per block than TSSA's (D, D).
    "xcit_s12_p16": (26_138_104, _TOST_S - 12 * 8 + 12 * (2 * 384 * 384 + 2 * 384) + 12 * 8, 0.0),
    "vit_cab_s12_p16": (26_138_008, _TOST_S - 12 * 8 + 12 * (2 * 384 * 384 + 2 * 384), 0.0),
}


def _small(name, **kw):
    """A small variant of ``name``: 32 px, patch 4, one block (ECA: rank 2)."""
    args = dict(img_size=32, patch_size=4, depth=1, num_classes=5)
    if name.startswith(("tost_m", "eca_m", "eca_b", "eca_l")):
        args["embed_dim"] = 128  # the full widths are built on the meta device (parameter counts)
    if name.startswith("eca"):
        args["attn_kwargs"] = {"rank": 2}
    args.update(kw)
    return create_model(name, **args)


def test_all_vision_models_registered():
    names = set(list_models())
    assert set(VISION) <= names
    assert list_models("eca_*") == sorted(n for n in VISION if n.startswith("eca_"))
    assert whiteformer.list_models() == list_models()


@pytest.mark.parametrize("name", VISION)
def test_builds_and_forward_small(name):
    model = _small(name).eval()
    assert isinstance(model, ToSTVision) and model.model_name == name
    x = torch.randn(2, 3, 32, 32)
    y = model(x)
    assert y.shape == (2, 5) and torch.isfinite(y).all()
    assert model.num_classes == 5 and model.num_features == model.embed_dim


@pytest.mark.parametrize("name", sorted(PARAM_COUNTS))
def test_parameter_counts_full_configs(name):
    measured, reference, tol = PARAM_COUNTS[name]
    with torch.device("meta"):  # ECA included (its default sketch seed is drawn on the CPU generator)
        model = create_model(name)
    n = sum(p.numel() for p in model.parameters())
    assert n == measured
    if tol == 0.0 and isinstance(reference, float):  # the paper's printed precision: 1.91M, 7.2M
        digits = len(f"{reference / 1e6:g}".split(".")[-1])
        assert round(n / 1e6, digits) == reference / 1e6
    else:
        assert abs(n - reference) <= tol * reference + 0.5


def test_p8_has_one_stage_less_than_p16():
    with torch.device("meta"):
        p16 = create_model("tost_t12_p16")
        p8 = create_model("tost_t12_p8")
    n16 = sum(p.numel() for p in p16.parameters())
    n8 = sum(p.numel() for p in p8.parameters())
    # p16 stages 3->24->48->96->192; p8 stages 3->48->96->192 (conv weights + BN affine).
    stages16 = 3 * 24 * 9 + 24 * 48 * 9 + 48 * 96 * 9 + 96 * 192 * 9 + 2 * (24 + 48 + 96 + 192)
    stages8 = 3 * 48 * 9 + 48 * 96 * 9 + 96 * 192 * 9 + 2 * (48 + 96 + 192)
    assert n16 - n8 == stages16 - stages8


def test_small_variant_one_call_mnist():
    model = create_model("tost_t12_p16", img_size=28, patch_size=4, depth=4, num_classes=10, in_chans=1)
    assert len(model.blocks) == 4 and model.num_patches == 49
    y = model(torch.randn(3, 1, 28, 28))
    assert y.shape == (3, 10)
    with pytest.raises(ValueError, match="channels"):
        model(torch.randn(3, 3, 28, 28))


def test_overrides_reach_the_constructor():
    m = create_model("tost_s12_p16", img_size=64, depth=2, num_heads=4, embed_dim=64, num_classes=3,
                     mlp_ratio=2.0, drop_path_rate=0.1)
    assert m.embed_dim == 64 and len(m.blocks) == 2 and m.blocks[0].attn.num_heads == 4
    assert m.blocks[0].mlp.fc1.out_features == 128 and m.head.out_features == 3
    assert m.blocks[0].drop_path.drop_prob == pytest.approx(0.1)
    assert m.init_kwargs["embed_dim"] == 64 and m.init_kwargs["attn"] == "tssa"
    assert type(m.blocks[0].attn).__name__ == "TSSA"
    assert type(create_model("dmst_t12_p16", depth=1, img_size=32).blocks[0].attn).__name__ == "DMSA"
    assert type(create_model("xcit_s12_p16", depth=1, img_size=32).blocks[0].attn).__name__ == "XCA"
    assert type(create_model("vit_cab_s12_p16", depth=1, img_size=32).blocks[0].attn).__name__ == "MHSA"
    # eta: 1.0 for 12 blocks, 1e-5 for 24 (official), on the blocks and the class-attention blocks.
    assert torch.all(create_model("tost_t12_p16", depth=1).blocks[0].gamma1 == 1.0)
    deep = create_model("tost_t24_p16", depth=1, img_size=32)
    assert torch.all(deep.blocks[0].gamma2 == 1e-5) and torch.all(deep.cls_attn_blocks[1].gamma1 == 1e-5)


def test_bad_overrides_raise():
    with pytest.raises(TypeError, match="unknown argument"):
        create_model("tost_t12_p16", no_such_option=1)
    with pytest.raises(ValueError, match="divisible by patch_size"):
        create_model("tost_t12_p16", img_size=30, patch_size=4)
    with pytest.raises(ValueError, match="patch_size must be one of"):
        create_model("tost_t12_p16", img_size=24, patch_size=3)
    with pytest.raises(ValueError, match="patch_size must be one of"):
        create_model("tost_t12_p16", img_size=32, patch_size=32)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        create_model("tost_t12_p16", embed_dim=190)
    with pytest.raises(ValueError, match="unknown attention"):
        create_model("tost_t12_p16", attn="no_such_attention")
    with pytest.raises(TypeError, match=r"attn must be a registered attention name \(str\), got int"):
        create_model("tost_t12_p16", attn=3)
    with pytest.raises(TypeError, match="attn_kwargs must be a dict or None, got list"):
        create_model("tost_t12_p16", attn_kwargs=[("rank", 2)])
    with pytest.raises(ValueError, match="mlp must be one of"):
        create_model("tost_t12_p16", mlp="moe")
    with pytest.raises(ValueError, match="drop_path_rate"):
        create_model("tost_t12_p16", drop_path_rate=1.5)
    with pytest.raises(ValueError, match="cls_attn_layers"):
        create_model("tost_t12_p16", cls_attn_layers=0)
    with pytest.raises(ValueError, match="unknown model"):
        create_model("tost_nonexistent")
    with pytest.raises(TypeError):  # unknown attention kwarg reaches the layer's constructor
        create_model("tost_t12_p16", img_size=32, depth=1, attn_kwargs={"bogus": 1})
    with pytest.raises(ValueError, match="attn_drop"):  # ECA has no attention dropout to honour
        create_model("eca_t", img_size=32, depth=1, attn_drop_rate=0.1)


def test_bad_inputs_raise():
    m = _small("tost_t12_p16")
    with pytest.raises(ValueError, match="4 dimensions"):
        m(torch.randn(3, 32, 32))
    with pytest.raises(TypeError, match="floating"):
        m(torch.zeros(1, 3, 32, 32, dtype=torch.long))


def test_attn_kwargs_pass_through():
    m = create_model("eca_t", img_size=32, depth=2, attn_kwargs={"rank": 3, "alpha_init": 0.2})
    for blk in m.blocks:
        assert blk.attn.rank == 3
        assert float(blk.attn.alpha.detach()) == pytest.approx(0.2)
    assert m.init_kwargs["attn_kwargs"] == {"head_dim": 64, "rank": 3, "alpha_init": 0.2}  # merged with eca_t's p


def test_patch_embed_stages():
    for patch, convs in ((16, 4), (8, 3), (4, 2), (2, 1)):
        pe = ConvPatchEmbed(img_size=32, patch_size=patch, in_chans=3, embed_dim=64)
        conv = [m for m in pe.modules() if isinstance(m, torch.nn.Conv2d)]
        bns = [m for m in pe.modules() if isinstance(m, torch.nn.BatchNorm2d)]
        gelus = [m for m in pe.modules() if isinstance(m, torch.nn.GELU)]
        assert len(conv) == convs and len(bns) == convs and len(gelus) == convs - 1
        assert all(c.stride == (2, 2) and c.kernel_size == (3, 3) and c.bias is None for c in conv)
        assert [c.out_channels for c in conv] == [64 // 2 ** (convs - 1 - i) for i in range(convs)]
        tokens, grid = pe(torch.randn(2, 3, 32, 32))
        assert grid == (32 // patch, 32 // patch) and tokens.shape == (2, (32 // patch) ** 2, 64)
    with pytest.raises(ValueError, match="multiple of 8"):
        ConvPatchEmbed(img_size=32, patch_size=16, embed_dim=60)


def _official_fourier(hidden, temperature, B, H, W):
    """The DETR/XCiT formula with an all-False padding mask, literally (cumsum of ones)."""
    not_mask = torch.ones(B, H, W)
    y = not_mask.cumsum(1, dtype=torch.float32)
    x = not_mask.cumsum(2, dtype=torch.float32)
    y = y / (y[:, -1:, :] + 1e-6) * (2 * math.pi)
    x = x / (x[:, :, -1:] + 1e-6) * (2 * math.pi)
    k = torch.arange(hidden, dtype=torch.float32)
    dim_t = temperature ** (2 * torch.div(k, 2, rounding_mode="floor") / hidden)
    px, py = x[..., None] / dim_t, y[..., None] / dim_t
    px = torch.stack((px[..., 0::2].sin(), px[..., 1::2].cos()), dim=4).flatten(3)
    py = torch.stack((py[..., 0::2].sin(), py[..., 1::2].cos()), dim=4).flatten(3)
    return torch.cat((py, px), dim=3).permute(0, 3, 1, 2)


@pytest.mark.parametrize("hw", [(2, 2), (7, 5), (14, 14)])
def test_fourier_encoding_matches_xcit_formula(hw):
    pe = FourierPositionalEncoding(hidden_dim=32, dim=16, temperature=10000)
    H, W = hw
    feats = pe.features(H, W)
    ref = _official_fourier(32, 10000, 1, H, W)
    assert torch.equal(feats, ref)
    out = pe(3, H, W)
    expect = F.conv2d(ref, pe.token_projection.weight, pe.token_projection.bias).flatten(2).transpose(1, 2)
    assert out.shape == (3, H * W, 16)
    torch.testing.assert_close(out[1], expect[0], rtol=1e-6, atol=1e-6)


def test_any_resolution_and_train_mode():
    m = create_model("tost_t12_p16", img_size=32, patch_size=4, depth=2, num_classes=4, drop_path_rate=0.2,
                     drop_rate=0.1, embed_dim=32)
    m.train()
    for size in (32, 48, 20):
        y = m(torch.randn(2, 3, size, size))
        assert y.shape == (2, 4) and torch.isfinite(y).all()
    y.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters() if p.requires_grad)


def test_timm_protocol():
    m = _small("tost_t12_p16", depth=3, embed_dim=32).eval()
    x = torch.randn(2, 3, 32, 32)
    feats = m.forward_features(x)
    assert feats.shape == (2, 1 + 64, m.embed_dim)
    torch.testing.assert_close(m.forward_head(feats), m(x))
    torch.testing.assert_close(m.forward_head(feats, pre_logits=True), feats[:, 0])
    torch.testing.assert_close(m.head(feats[:, 0]), m(x))

    final, inter = m.forward_intermediates(x, output_fmt="NLC")
    torch.testing.assert_close(final, feats)
    assert len(inter) == 3 and all(t.shape == (2, 64, m.embed_dim) for t in inter)
    # The last intermediate is what the class-attention head consumes.
    torch.testing.assert_close(m._head_tokens(inter[-1]), feats)
    sub = m.forward_intermediates(x, indices=[0, -1], output_fmt="NLC", intermediates_only=True)
    torch.testing.assert_close(sub[0], inter[0])
    torch.testing.assert_close(sub[1], inter[2])
    with pytest.raises(ValueError, match="out of range"):
        m.forward_intermediates(x, indices=[3])
    inter_pi, stats = m.forward_intermediates(x, return_pi=True, output_fmt="NLC", intermediates_only=True)
    assert len(stats) == 3 and stats[0]["pi"].shape == (2, m.num_heads, 64)
    torch.testing.assert_close(stats[0]["pi"].sum(1), torch.ones(2, 64))  # softmax over heads
    torch.testing.assert_close(inter_pi[-1], inter[-1])
    with pytest.raises(ValueError, match="return_pi"):
        _small("vit_cab_s12_p16", embed_dim=48).forward_intermediates(x, return_pi=True)

    nwd = m.no_weight_decay()
    assert "cls_token" in nwd and "blocks.0.attn.temp" in nwd and "blocks.2.attn.temp" in nwd
    assert all(n in dict(m.named_parameters()) for n in nwd)
    assert not any(n.endswith("qkv.weight") or n.endswith("fc1.weight") for n in nwd)
    assert "blocks.0.attn.temperature" in _small("xcit_s12_p16", embed_dim=32).no_weight_decay()

    m.reset_classifier(7)
    assert m.num_classes == 7 and m(x).shape == (2, 7) and m.init_kwargs["num_classes"] == 7
    m.reset_classifier(0)
    assert m(x).shape == (2, m.embed_dim)
    torch.testing.assert_close(m(x), feats[:, 0])


def test_ista_block_formula_and_mlp_option():
    ista = ISTA(16)
    x = torch.randn(4, 5, 16)
    D = ista.weight
    expect = torch.relu(x + 0.1 * (x @ D - x @ D.T @ D) - 0.1 * 0.1)  # rows: D^T x, D^T D x
    torch.testing.assert_close(ista(x), expect)
    m = create_model("tost_t12_p16", img_size=32, depth=2, mlp="ista")
    assert isinstance(m.blocks[0].mlp, ISTA) and m.blocks[0].mlp.weight.shape == (192, 192)
    assert isinstance(m.cls_attn_blocks[0].mlp, Mlp)  # the class-attention head keeps its MLP
    assert torch.isfinite(m(torch.randn(1, 3, 32, 32))).all()


def test_eca_block_uses_the_layer_update_once():
    torch.manual_seed(1)
    blk = Block(32, 4, attn="eca", attn_kwargs={"rank": 2}, mlp="none", prenorm=False).eval()
    assert blk.mlp is None and blk.gamma1 is None
    x = torch.randn(2, 16, 32)
    torch.testing.assert_close(blk(x), x + blk.attn(x))  # x_{l+1} = x_l + alpha E(x_l) - beta C(x_l)
    pre = Block(32, 4, attn="eca", attn_kwargs={"rank": 2}, mlp="none").eval()
    torch.testing.assert_close(pre(x), x + pre.attn(pre.norm1(x)))
    m = _small("eca_t")
    assert all(b.mlp is None for b in m.blocks)
    assert not [n for n, _ in m.named_parameters() if ".fc1." in n and n.startswith("blocks.")]


def test_mlp_and_drop_path_blocks():
    mlp = Mlp(8, 32, out_features=4)
    assert mlp.fc1.weight.shape == (32, 8) and mlp.fc2.weight.shape == (4, 32)
    x = torch.randn(4, 8)
    torch.testing.assert_close(mlp(x), mlp.fc2(F.gelu(mlp.fc1(x))))
    dp = DropPath(0.5)
    z = torch.ones(1000, 3)
    assert torch.equal(dp.eval()(z), z)
    out = dp.train()(z)
    kept = out[:, 0] != 0
    assert torch.all(out[kept] == 2.0) and 300 < int(kept.sum()) < 700
    assert torch.all((out == 0).all(1) | (out == 2.0).all(1))  # whole samples dropped
    with pytest.raises(ValueError, match="drop_path_rate"):  # the model's door; the block trusts it
        create_model("tost_t12_p16", img_size=32, depth=1, drop_path_rate=1.0)


def test_float64_and_bf16_autocast():
    m = _small("tost_t12_p16", depth=2, embed_dim=32).eval()
    x = torch.randn(2, 3, 32, 32)
    y32 = m(x)
    m64 = _small("tost_t12_p16", depth=2, embed_dim=32).eval()
    m64.load_state_dict(m.state_dict())
    m64 = m64.double()
    y64 = m64(x.double())
    assert y64.dtype == torch.float64
    torch.testing.assert_close(y64.float(), y32, rtol=1e-4, atol=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yb = m(x * 100)
    assert torch.isfinite(yb).all()


def _eca_old_layer(attn, z):
    """What ECAttention returned before it followed the contract: z + alpha E(z) - beta C(z) (Eq. 4),
    from the reference operators."""
    from whiteformer.ops.reference import eca_compress_reference, eca_expand_reference

    n = z.shape[1]
    e = eca_expand_reference(z, attn.omega_for(n, "expand", dtype=z.dtype), attn.eps)
    c = eca_compress_reference(z, attn.U, attn.omega_for(n, "compress", dtype=z.dtype), attn.temperature,
                               attn.num_heads, attn.eps)
    return z + attn.alpha * e - attn.beta * c


@pytest.mark.parametrize("name", ["eca_t", "eca_b"])
@pytest.mark.parametrize("prenorm", [True, False])
def test_eca_models_unchanged_by_the_update_contract(name, prenorm):
    """The ECA models compute what they computed when the layer returned ``z + update`` and the
    block subtracted z again: pre-norm ``x + (layer(norm1(x)) - norm1(x))``, else ``x = layer(x)``."""
    torch.manual_seed(0)
    kw = {"embed_dim": 64} if name == "eca_b" else {}
    model = _small(name, depth=2, prenorm=prenorm, **kw).double().eval()
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.alpha_raw.add_(0.5)
            blk.attn.beta_raw.add_(0.3)
    images = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    x = model._embed(images)
    for blk in model.blocks:
        if prenorm:
            z = blk.norm1(x)
            x = x + (_eca_old_layer(blk.attn, z) - z)
        else:
            x = _eca_old_layer(blk.attn, x)
    expect = model.forward_head(model._head_tokens(x))
    torch.testing.assert_close(model(images), expect)


def test_eca_model_head_dims_and_attn_kwargs_merge():
    with torch.device("meta"):
        assert create_model("eca_t").blocks[0].attn.U.shape == (192, 4 * 64)
        assert create_model("eca_b").blocks[0].attn.U.shape == (512, 512)  # p = 32
        t = create_model("eca_t", attn_kwargs={"rank": 5})
    assert t.blocks[0].attn.head_dim == 64 and t.blocks[0].attn.rank == 5
    assert create_model("eca_t", depth=1, attn_kwargs={"head_dim": 48}).blocks[0].attn.U.shape == (192, 192)
