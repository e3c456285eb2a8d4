"""capture(): records per block without changing the model; layerwise_report on tiny models."""
import json
import math

import pytest
import torch
import torch.nn as nn

import whiteformer
from whiteformer.analysis import rates
from whiteformer.analysis.capture import attention_basis, capture
from whiteformer.analysis.report import COLUMNS, layerwise_report

TINY = dict(img_size=16, patch_size=4, depth=2, embed_dim=32, num_heads=4, num_classes=5)
VISION = {"tssa": "tost_t12_p16", "dmsa": "dmst_t12_p16", "eca": "eca_t"}


def _vision(attn: str, **kw):
    extra = {"attn_kwargs": {"rank": 2}} if attn == "eca" else {}
    model = whiteformer.create_model(VISION[attn], **{**TINY, **extra, **kw})
    # non-trivial weights: the init (std 0.02) makes TSSA memberships almost uniform
    with torch.no_grad():
        for blk in model.blocks:
            if hasattr(blk.attn, "qkv"):
                blk.attn.qkv.weight.normal_(0, 0.3)
            if hasattr(blk.attn, "membership"):
                blk.attn.membership.weight.normal_(0, 0.5)
    return model.eval()


def _images(b=3):
    return torch.randn(b, 3, 16, 16)


def _tiny_lm():
    return whiteformer.create_model("tost_lm_base", vocab_size=50, dim=32, depth=2, num_heads=4, max_len=16).eval()


def _assert_restored(model):
    for m in model.modules():
        assert "forward" not in m.__dict__, f"{type(m).__name__}.forward still patched"
        assert len(m._forward_hooks) == 0 and len(m._forward_pre_hooks) == 0
        assert len(m._forward_hooks_with_kwargs) == 0


# ----------------------------------------------------------------------------- capture
@pytest.mark.parametrize("attn", ["tssa", "dmsa", "eca"])
def test_capture_vision_bitwise_records_and_restores(attn):
    model, x = _vision(attn), _images()
    before = model(x)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    with capture(model) as rec:
        during = model(x)
    after = model(x)
    assert torch.equal(before, during) and torch.equal(before, after)
    _assert_restored(model)
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())

    assert len(rec.blocks) == len(model.blocks) == 2
    assert [r.name for r in rec.blocks] == ["blocks.0", "blocks.1"]
    assert len(rec.class_attention) == len(model.cls_attn_blocks)
    # reference values from the model's own analysis path
    feats, stats = model.forward_intermediates(x, return_pi=True, output_fmt="NLC", intermediates_only=True)
    for r, blk, f, st in zip(rec.blocks, model.blocks, feats, stats):
        assert r.block is blk and r.attn is blk.attn and r.calls == 1
        assert r.input.shape == r.output.shape == r.attn_input.shape == (3, 16, 32)
        assert torch.equal(r.output, f)
        assert torch.equal(r.attn_input, blk.norm1(r.input))
        assert r.pi.shape == (3, 4, 16) and torch.equal(r.pi, st["pi"])
        assert r.memberships.shape == (3, 16, 4)
        if attn == "dmsa":
            assert r.gate.shape == (3, 4) and torch.equal(r.gate, st["gate"])
        else:
            assert r.gate is None
    # the output of block 0 is the input of block 1
    assert torch.equal(rec.blocks[0].output, rec.blocks[1].input)


@pytest.mark.parametrize("attn", ["tssa", "eca"])
def test_pi_rows_sum_to_one_over_heads(attn):
    model, x = _vision(attn), _images()
    with capture(model) as rec:
        model(x)
    for r in rec.blocks:
        torch.testing.assert_close(r.pi.sum(1), torch.ones(3, 16), atol=1e-5, rtol=0)
        assert (r.pi >= 0).all()


def test_capture_restores_after_exception_and_keeps_user_patch():
    model, x = _vision("tssa"), _images()
    ref = model(x)
    user_forward = model.blocks[1].attn.forward  # an instance-level forward set by the user
    model.blocks[1].attn.forward = user_forward
    with pytest.raises(RuntimeError, match="boom"):
        with capture(model):
            model(x)
            raise RuntimeError("boom")
    assert model.blocks[1].attn.__dict__["forward"] is user_forward
    del model.blocks[1].attn.forward
    _assert_restored(model)
    assert torch.equal(model(x), ref)
    # an error raised by the model itself (bad input) also leaves it restored
    with pytest.raises(ValueError):
        with capture(model):
            model(torch.randn(2, 1, 16, 16))
    _assert_restored(model)


def test_capture_passes_through_forward_intermediates_return_pi():
    model, x = _vision("dmsa"), _images(2)
    feats, stats = model.forward_intermediates(x, return_pi=True, output_fmt="NLC", intermediates_only=True)
    with capture(model) as rec:
        feats2, stats2 = model.forward_intermediates(x, return_pi=True, output_fmt="NLC", intermediates_only=True)
    for a, b, s, t, r in zip(feats, feats2, stats, stats2, rec.blocks):
        assert torch.equal(a, b) and torch.equal(s["pi"], t["pi"]) and torch.equal(s["gate"], t["gate"])
        assert torch.equal(r.pi, s["pi"])


def test_capture_positional_return_pi_and_nested():
    attn = whiteformer.attention.TSSA(16, num_heads=2).eval()
    x = torch.randn(2, 5, 16)
    y_ref, st_ref = attn(x, None, True)
    with capture(attn) as outer:
        with capture(attn) as inner:
            y, st = attn(x, None, True)  # positional return_pi
            y2 = attn(x)
    assert torch.equal(y, y_ref) and torch.equal(st["pi"], st_ref["pi"]) and torch.equal(y2, y_ref)
    for rec in (outer, inner):
        assert len(rec.blocks) == 1 and rec.blocks[0].block is attn and rec.blocks[0].calls == 2
        assert torch.equal(rec.blocks[0].pi, st_ref["pi"])
    _assert_restored(attn)


def test_capture_lm_causal_tssa():
    lm, idx = _tiny_lm(), torch.randint(0, 50, (2, 12))
    ref, _ = lm(idx)
    with capture(lm) as rec:
        out, _ = lm(idx)
    assert torch.equal(out, ref) and torch.equal(lm(idx)[0], ref)
    _assert_restored(lm)
    assert [r.name for r in rec.blocks] == ["transformer.h.0", "transformer.h.1"]
    for r in rec.blocks:
        assert type(r.attn).__name__ == "CausalTSSA"
        assert r.output.shape == (2, 12, 32) and r.pi.shape == (2, 4, 12)
        torch.testing.assert_close(r.pi.sum(1), torch.ones(2, 12), atol=1e-5, rtol=0)
        assert torch.equal(attention_basis(r.attn), r.attn.qkv.weight.T)


@pytest.mark.parametrize("name", ["deit_t_p16", "crate_t"])
def test_capture_no_pi_models(name):
    model = whiteformer.create_model(name, **TINY).eval()
    x = _images(2)
    ref = model(x)
    with capture(model) as rec:
        out = model(x)
    assert torch.equal(out, ref)
    _assert_restored(model)
    assert len(rec.blocks) == 2 and all(r.pi is None and r.gate is None for r in rec.blocks)
    assert all(r.output.shape == (2, 17, 32) for r in rec.blocks)  # class token + 16 patches
    assert rec.class_attention == []


def test_capture_eca_without_compression_has_no_pi():
    model = whiteformer.create_model("eca_t", **TINY, attn_kwargs={"rank": 2, "compress": False}).eval()
    x = _images(2)
    ref = model(x)
    with capture(model) as rec:
        assert torch.equal(model(x), ref)
    assert all(r.pi is None and r.output is not None for r in rec.blocks)


def test_capture_bad_inputs():
    with pytest.raises(TypeError, match="nn.Module"):
        with capture("model"):
            pass
    with pytest.raises(ValueError, match="no attention layer"):
        with capture(nn.Sequential(nn.Linear(3, 3))):
            pass
    with pytest.raises(TypeError, match="attn_types"):
        with capture(nn.Linear(3, 3), attn_types=[int]):
            pass


def test_capture_custom_attn_types_and_clear():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with capture(net, attn_types=[nn.Linear]) as rec:
        net(torch.randn(2, 3, 4))
        assert len(rec) == 2 and rec[0].block is net[0]  # parent is a container: layer = block
        assert torch.equal(rec[0].output, rec[1].input)
        rec.clear()
        assert rec[0].output is None and rec[0].calls == 0


# ----------------------------------------------------------------------------- layerwise_report
def _per_head_bases(attn):
    W = attn.qkv.weight.detach().double()
    p = W.shape[0] // attn.num_heads
    return torch.stack([W[k * p:(k + 1) * p].T for k in range(attn.num_heads)])  # (K, d, p)


@pytest.mark.parametrize("attn", ["tssa", "dmsa", "eca"])
def test_layerwise_report_values(attn, tmp_path):
    model, x = _vision(attn), _images()
    eps = 0.5
    rep = layerwise_report(model, x, eps=eps, out_dir=tmp_path)
    assert len(rep.rows) == 2 and rep.num_samples == 3 and rep.features == "output"
    feats, stats = model.forward_intermediates(x, return_pi=True, output_fmt="NLC", intermediates_only=True)
    for row, blk, Z, st in zip(rep.rows, model.blocks, feats, stats):
        assert set(row) == set(COLUMNS)
        vals = [row[k] for k in ("R", "R_c", "delta_R", "R_c_var", "delta_R_var", "R_c_U")]
        assert all(isinstance(v, float) and math.isfinite(v) for v in vals)
        assert row["delta_R"] == pytest.approx(row["R"] - row["R_c"], abs=1e-9)
        assert row["delta_R_var"] == pytest.approx(row["R"] - row["R_c_var"], abs=1e-9)
        # independent recomputation: Z = block output, Pi = that layer's, U_k per head
        Z = Z.double()
        Pi = st["pi"].double().transpose(1, 2)
        if attn == "eca":
            Uk = blk.attn.U.detach().double().reshape(32, 4, blk.attn.head_dim).permute(1, 0, 2)
        else:
            Uk = _per_head_bases(blk.attn)
        if attn == "dmsa":
            Uk = st["gate"].double()[:, :, None, None] * Uk  # U_k^S = gate_k * S_k, per image
            Ps = Pi / Pi.sum(-1, keepdim=True)
            decoupled = True
        else:
            Ps, decoupled = Pi, False
        assert row["R"] == pytest.approx(rates.coding_rate(Z, eps).mean().item(), rel=1e-9)
        assert row["R_c"] == pytest.approx(rates.compression_rate(Z, Ps, eps).mean().item(), rel=1e-9)
        rv = rates.variational_compression_rate(Z, Pi, Uk, eps, decoupled=decoupled).mean().item()
        assert row["R_c_var"] == pytest.approx(rv, rel=1e-9)
        assert row["R_c_U"] == pytest.approx(rates.subspace_compression_rate(Z, Uk, eps).mean().item(), rel=1e-9)
    data = json.loads((tmp_path / "layerwise_report.json").read_text())
    assert data["rows"] == rep.rows and data["eps"] == eps
    import matplotlib.image

    img = matplotlib.image.imread(str(tmp_path / "layerwise_report.png"))
    assert img.shape[:2] == (400, 1500)
    md = rep.to_markdown().splitlines()
    assert len(md) == 2 + 2 and md[0].startswith("| layer | name")


def test_layerwise_report_input_features_and_flags_restored():
    model, x = _vision("tssa"), _images(2)
    model.train()
    model.blocks[0].eval()
    flags = [m.training for m in model.modules()]
    rep = layerwise_report(model, x, eps=1.0, features="input")
    assert [m.training for m in model.modules()] == flags
    _assert_restored(model)
    with capture(model) as rec, torch.no_grad():
        model.eval()(x)
    Z = rec.blocks[1].attn_input.double()
    assert rep.rows[1]["R"] == pytest.approx(rates.coding_rate(Z, 1.0).mean().item(), rel=1e-9)


def test_layerwise_report_lm_and_no_pi_models(tmp_path):
    rep = layerwise_report(_tiny_lm(), torch.randint(0, 50, (2, 10)), eps=0.5)
    assert [r["attn"] for r in rep.rows] == ["CausalTSSA"] * 2
    for row in rep.rows:
        assert all(math.isfinite(row[k]) for k in ("R", "R_c", "delta_R", "R_c_var", "R_c_U"))
        assert row["delta_R"] == pytest.approx(row["R"] - row["R_c"], abs=1e-9)
    deit = whiteformer.create_model("deit_t_p16", **TINY)
    rep = layerwise_report(deit, _images(2), out_dir=tmp_path, plot=False)
    assert (tmp_path / "layerwise_report.json").exists() and not (tmp_path / "layerwise_report.png").exists()
    for row in rep.rows:
        assert math.isfinite(row["R"])
        assert row["R_c"] is row["delta_R"] is row["R_c_var"] is row["R_c_U"] is None
    crate = whiteformer.create_model("crate_t", **TINY)
    rep = layerwise_report(crate, _images(2))
    assert all(r["R_c_U"] is not None and r["R_c"] is None for r in rep.rows)  # MSSA: U, no Pi


@pytest.mark.parametrize("make,panels", [
    (lambda: _vision("tssa"), ["variational compression", "rates", "subspace compression"]),
    (lambda: whiteformer.create_model("crate_t", **TINY).eval(), ["rates", "subspace compression"]),
    (lambda: whiteformer.create_model("deit_t_p16", **TINY).eval(), ["rates"]),
], ids=["tost", "crate", "deit"])
def test_layerwise_figure_of_own_models(make, panels, tmp_path):
    """Titled with the registry name; one panel per group of columns the model gives, each with
    labelled axes (no empty "not available" panel); rows are the blocks, numbered from 1."""
    model = make()
    rep = layerwise_report(model, _images(2), out_dir=tmp_path)
    assert rep.model == model.model_name and [r["layer"] for r in rep.rows] == [1, 2]
    fig = rep.figure()
    assert fig._suptitle.get_text() == model.model_name
    assert [ax.get_title() for ax in fig.axes] == panels
    for ax in fig.axes:
        assert ax.get_xlabel() == "layer" and ax.get_ylabel() and ax.lines
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2"]
    assert not [t for ax in fig.axes for t in ax.texts]
    import matplotlib.image

    assert matplotlib.image.imread(str(tmp_path / "layerwise_report.png")).shape[:2] == (400, 500 * len(panels))


def test_layerwise_report_bad_args():
    model, x = _vision("tssa"), _images(1)
    with pytest.raises(ValueError, match="features"):
        layerwise_report(model, x, features="middle")
    with pytest.raises(ValueError, match="eps"):
        layerwise_report(model, x, eps=0.0)
    with pytest.raises(TypeError, match="images_or_tokens"):
        layerwise_report(model, [x])
    with pytest.raises(TypeError, match="out_dir must be a str or Path, got int"):
        layerwise_report(model, x, out_dir=3)
