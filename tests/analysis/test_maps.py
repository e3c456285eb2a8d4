"""Membership maps and class-token attention maps (PNG grids), and the viz-extra error."""
import sys

import pytest
import torch
import torch.nn.functional as F

import whiteformer
from whiteformer.analysis.capture import capture
from whiteformer.analysis.maps import class_attention_weights, cls_attention_maps, membership_maps, patch_grid
from whiteformer.analysis.report import layerwise_report

pytest.importorskip("matplotlib")
import matplotlib.image  # noqa: E402

TINY = dict(img_size=16, patch_size=4, depth=2, embed_dim=32, num_heads=4, num_classes=5)
VISION = {"tssa": "tost_t12_p16", "dmsa": "dmst_t12_p16", "eca": "eca_t"}


def _vision(attn: str, **kw):
    extra = {"attn_kwargs": {"rank": 2}} if attn == "eca" else {}
    return whiteformer.create_model(VISION[attn], **{**TINY, **extra, **kw}).eval()


@pytest.mark.parametrize("attn", ["tssa", "dmsa", "eca"])
def test_membership_maps_png_and_values(attn, tmp_path):
    model, x = _vision(attn), torch.randn(3, 3, 16, 16)
    out = tmp_path / "sub" / "pi.png"
    maps = membership_maps(model, x, out, layer=0, max_images=2, cell_size=1, dpi=40)
    assert maps.shape == (2, 4, 4, 4)
    with capture(model) as rec:
        model(x)
    torch.testing.assert_close(maps, rec.blocks[0].pi[:2].float().reshape(2, 4, 4, 4), rtol=0, atol=0)
    img = matplotlib.image.imread(str(out))
    assert img.shape[:2] == (2 * 40, (1 + 4) * 40)
    # the default layer is the last block
    last = membership_maps(model, x, tmp_path / "last.png", max_images=None, cell_size=1, dpi=40)
    assert last.shape == (3, 4, 4, 4)
    torch.testing.assert_close(last, rec.blocks[-1].pi.float().reshape(3, 4, 4, 4), rtol=0, atol=0)
    assert matplotlib.image.imread(str(tmp_path / "last.png")).shape[:2] == (120, 200)


def test_membership_maps_rectangular_grid(tmp_path):
    model, x = _vision("tssa"), torch.randn(1, 3, 8, 16)  # 2 x 4 patches
    maps = membership_maps(model, x, tmp_path / "rect.png", cell_size=1, dpi=30)
    assert maps.shape == (1, 4, 2, 4)
    assert patch_grid(model, (8, 16), 8) == (0, 2, 4)
    assert patch_grid(torch.nn.Linear(1, 1), (16, 32), 8) == (0, 2, 4)  # no patch_embed: factorisation


def test_cls_attention_weights_reproduce_layer_output_and_maps(tmp_path):
    model, x = _vision("tssa"), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        for blk in model.cls_attn_blocks:
            blk.attn.qkv.weight.normal_(0, 0.3)
    with capture(model) as rec:
        model(x)
    for r in rec.class_attention:
        attn, y = r.attn, r.input
        w = class_attention_weights(attn, y)  # (B, H, 1 + N)
        assert w.shape == (2, 4, 17)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4))
        v = F.linear(y, attn.qkv.weight[64:], attn.qkv.bias[64:]).reshape(2, 17, 4, 8).transpose(1, 2)
        cls = attn.proj((w[..., None] * v).sum(-2).reshape(2, 32))
        torch.testing.assert_close(cls, r.output[:, 0], rtol=1e-5, atol=1e-6)
    out = tmp_path / "cls.png"
    maps = cls_attention_maps(model, x, out, cell_size=1, dpi=40)
    assert maps.shape == (2, 4, 4, 4)
    w_last = class_attention_weights(rec.class_attention[-1].attn, rec.class_attention[-1].input)
    torch.testing.assert_close(maps, w_last[:, :, 1:].reshape(2, 4, 4, 4))
    assert matplotlib.image.imread(str(out)).shape[:2] == (80, 200)
    first = cls_attention_maps(model, x, tmp_path / "cls0.png", block=0, cell_size=1, dpi=40)
    w_first = class_attention_weights(rec.class_attention[0].attn, rec.class_attention[0].input)
    torch.testing.assert_close(first, w_first[:, :, 1:].reshape(2, 4, 4, 4))


def test_maps_bad_inputs(tmp_path):
    deit = whiteformer.create_model("deit_t_p16", **TINY).eval()
    x = torch.randn(1, 3, 16, 16)
    with pytest.raises(ValueError, match="no memberships"):
        membership_maps(deit, x, tmp_path / "a.png")
    with pytest.raises(ValueError, match="class-attention"):
        cls_attention_maps(deit, x, tmp_path / "b.png")
    model = _vision("tssa")
    with pytest.raises(ValueError, match="layer"):
        membership_maps(model, x, tmp_path / "c.png", layer=2)
    with pytest.raises(ValueError, match="images"):
        membership_maps(model, torch.randn(3, 16, 16), tmp_path / "d.png")
    with pytest.raises(ValueError, match="max_images"):
        membership_maps(model, x, tmp_path / "e.png", max_images=0)


def test_missing_matplotlib_names_viz_extra(monkeypatch, tmp_path):
    model, x = _vision("tssa"), torch.randn(1, 3, 16, 16)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes "import matplotlib" fail
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    for fn in (membership_maps, cls_attention_maps):
        with pytest.raises(ImportError, match=r"whiteformer\[viz\]"):
            fn(model, x, tmp_path / "x.png")
    with pytest.raises(ImportError, match="viz"):
        layerwise_report(model, x, out_dir=tmp_path)
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "layerwise_report.json").exists()
    # without a plot the report still works
    rep = layerwise_report(model, x, out_dir=tmp_path, plot=False)
    assert (tmp_path / "layerwise_report.json").exists() and len(rep.rows) == 2
