"""timm's dynamic_img_size / dynamic_img_pad on the families with learned absolute positions
(DeiT / ViT, CRATE): the position embedding is resized to each input's grid."""
import pytest
import torch
import torch.nn.functional as F

from whiteformer import create_model

SMALL = dict(img_size=16, patch_size=4, in_chans=3, num_classes=5, embed_dim=32, depth=2, num_heads=4)
FAMILIES = ["deit_t_p16", "crate_t"]


def _pair(name, new_size):
    """A dynamic model built at 16 x 16, and a fixed one built at ``new_size`` holding the same
    weights with the position embedding resized by hand (bicubic, antialiased, float32, as timm)."""
    torch.manual_seed(0)
    dyn = create_model(name, dynamic_img_size=True, **SMALL).eval()
    fixed = create_model(name, **{**SMALL, "img_size": new_size}).eval()
    sd = dict(dyn.state_dict())
    pe = sd["pos_embed"]
    grid = pe[:, 1:].reshape(1, 4, 4, -1).permute(0, 3, 1, 2).float()
    new_grid = (new_size[0] // 4, new_size[1] // 4)
    grid = F.interpolate(grid, size=new_grid, mode="bicubic", antialias=True)
    sd["pos_embed"] = torch.cat([pe[:, :1], grid.permute(0, 2, 3, 1).reshape(1, -1, pe.shape[-1])], dim=1)
    fixed.load_state_dict(sd)
    return dyn, fixed


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("size", [(24, 32), (8, 12), (16, 16)])
def test_dynamic_img_size_equals_resizing_the_position_embedding_by_hand(name, size):
    dyn, fixed = _pair(name, size)
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        torch.testing.assert_close(dyn(x), fixed(x), rtol=1e-5, atol=1e-5)
        feats, maps = dyn.forward_intermediates(x, indices=1)
    assert maps[0].shape == (2, 32, size[0] // 4, size[1] // 4)
    assert dyn.pretrained_cfg["fixed_input_size"] is False and fixed.pretrained_cfg["fixed_input_size"] is True


@pytest.mark.parametrize("name", FAMILIES)
def test_dynamic_img_pad_pads_right_and_bottom_with_zeros(name):
    torch.manual_seed(0)
    model = create_model(name, dynamic_img_size=True, dynamic_img_pad=True, **SMALL).eval()
    x = torch.randn(2, 3, 22, 29)
    padded = F.pad(x, (0, 3, 0, 2))  # up to 24 x 32
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(padded), rtol=0, atol=0)
    # padding alone: an image a little smaller than img_size fits its grid
    pad_only = create_model(name, dynamic_img_pad=True, **SMALL).eval()
    with torch.no_grad():
        assert pad_only(torch.randn(1, 3, 14, 15)).shape == (1, 5)


@pytest.mark.parametrize("name", FAMILIES)
def test_sizes_refused_with_the_flag_that_takes_them(name, tmp_path):
    fixed = create_model(name, **SMALL)
    with pytest.raises(ValueError, match=r"shape \(B, 3, 16, 16\).*dynamic_img_size=True"):
        fixed(torch.randn(1, 3, 24, 24))
    dyn = create_model(name, dynamic_img_size=True, **SMALL)
    with pytest.raises(ValueError, match="multiples of patch_size.*dynamic_img_pad=True"):
        dyn(torch.randn(1, 3, 22, 24))
    with pytest.raises(ValueError, match=r"shape \(B, 3, 16, 16\)"):  # channels are never dynamic
        dyn(torch.randn(1, 1, 24, 24))
    with pytest.raises(TypeError, match="dynamic_img_size must be a bool"):
        create_model(name, dynamic_img_size="yes", **SMALL)
    # the flag is a constructor argument: saved and loaded back with the model
    dyn.save_pretrained(tmp_path / "m")
    from whiteformer.models import from_pretrained

    assert from_pretrained(tmp_path / "m").patch_embed.dynamic_img_size is True


# --------------------------------------------------------------------------- the ToST shell (Fourier positions)
SHELL = dict(img_size=16, patch_size=4, in_chans=3, num_classes=5, embed_dim=32, depth=1, num_heads=4)
SHELL_FAMILIES = ["tost_t12_p16", "dmst_t12_p16", "eca_t", "xcit_s12_p16", "vit_cab_s12_p16"]


def _logits_with_positions_by_hand(model, x):
    """The shell's forward with the Fourier positions of x's grid projected by hand (1x1 conv = matmul)."""
    tokens, (hp, wp) = model.patch_embed(x)
    proj = model.pos_embed.token_projection
    feats = model.pos_embed.features(hp, wp).flatten(2).transpose(1, 2)  # (1, Hp*Wp, 2 * hidden)
    tokens = tokens + feats @ proj.weight.flatten(1).T + proj.bias
    for blk in model.blocks:
        tokens = blk(tokens)
    return model.forward_head(model._head_tokens(tokens))


@pytest.mark.parametrize("name", SHELL_FAMILIES)
def test_shell_dynamic_img_size_equals_positions_computed_for_the_grid(name):
    torch.manual_seed(0)
    dyn = create_model(name, dynamic_img_size=True, **SHELL).eval()
    x = torch.randn(2, 3, 24, 32)
    fixed = create_model(name, **{**SHELL, "img_size": (24, 32)}).eval()  # built for that size
    fixed.load_state_dict(dyn.state_dict())
    with torch.no_grad():
        logits = dyn(x)
        torch.testing.assert_close(logits, _logits_with_positions_by_hand(dyn, x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, fixed(x), rtol=0, atol=0)
        _, maps = dyn.forward_intermediates(x, indices=1)
    assert maps[0].shape == (2, 32, 6, 8)
    assert dyn.patch_embed.dynamic_img_size is True and dyn.pretrained_cfg["fixed_input_size"] is False


@pytest.mark.parametrize("name", SHELL_FAMILIES)
def test_shell_dynamic_img_pad_pads_right_and_bottom_with_zeros(name, tmp_path):
    torch.manual_seed(0)
    model = create_model(name, dynamic_img_size=True, dynamic_img_pad=True, **SHELL).eval()
    plain = create_model(name, **SHELL).eval()
    plain.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 22, 29)
    padded = F.pad(x, (0, 3, 0, 2))  # up to 24 x 32
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(padded), rtol=0, atol=0)
        torch.testing.assert_close(model(x), plain(padded), rtol=0, atol=0)
        # without the flag the stem takes x as it is (its convolutions pad the borders): another result
        assert plain(x).shape == (2, 5) and not torch.allclose(plain(x), model(x), atol=1e-4)
    model.save_pretrained(tmp_path / "m")  # constructor arguments: saved and loaded back
    from whiteformer.models import from_pretrained

    back = from_pretrained(tmp_path / "m").patch_embed
    assert (back.dynamic_img_size, back.dynamic_img_pad) == (True, True)


@pytest.mark.parametrize("name", SHELL_FAMILIES)
def test_shell_refuses_what_it_refused_without_the_flag(name):
    for flags in ({}, {"dynamic_img_size": True}):
        model = create_model(name, **flags, **SHELL)
        with pytest.raises(ValueError, match=r"^x must be a non-empty image batch with 3 channels \(B, 3, H, W\), "
                                             r"got shape \(1, 1, 24, 24\)$"):
            model(torch.randn(1, 1, 24, 24))
    with pytest.raises(TypeError, match="dynamic_img_pad must be a bool"):
        create_model(name, dynamic_img_pad=1, **SHELL)
