"""Model-level attention compression: compress(), its report, checkpoints, CLI, Sec. 3.3 constraints."""
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from whiteformer.app.cli import main
from whiteformer.compress import (
    CompressionReport,
    CPSlimAtt,
    IrrAtt,
    TruncAtt,
    apply_compression_spec,
    apply_fusion_constraints,
    compress,
    measure_latency,
    qk_factors,
)
from whiteformer.compress.constraints import project_fusion
from whiteformer.compress.model import collect_block_inputs
from whiteformer.models import create_model

F_, H_, P_ = 48, 3, 16  # tiny DeiT: embed 48, 3 heads of 16, img 32 / patch 8 -> N = 17 tokens


def tiny(**kw):
    cfg = dict(img_size=32, patch_size=8, in_chans=3, num_classes=5, depth=2, embed_dim=F_, num_heads=H_)
    cfg.update(kw)
    return create_model("deit_t_p16", **cfg).eval()


def rel(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


def images(n=4, size=32, chans=3, seed=1):
    return torch.randn(n, chans, size, size, generator=torch.Generator().manual_seed(seed))


def test_num_tokens_are_the_tokens_the_blocks_see():
    """N (rank budget, MACs) is counted on the model's forward, not re-stated from its attributes."""
    model = tiny()
    del model.patch_embed.num_patches  # not needed to know the token count
    _, rep = compress(model, qk="truncatt", qk_rank=4, vo=None, progress=False)
    assert rep.num_tokens == (32 // 8) ** 2 + 1  # patches + the class token
    _, rep = compress(model, qk="truncatt", qk_rank=4, vo=None, num_tokens=50, progress=False)
    assert rep.num_tokens == 50


def test_input_model_untouched():
    model = tiny()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    new, _ = compress(model, qk="irratt", qk_flops_ratio=0.5, vo_rank=8, mlp_rank=16, calib=images())
    assert new is not model
    assert all(type(b.attn).__name__ == "MHSA" for b in model.blocks)
    assert all(isinstance(b.mlp.fc1, torch.nn.Linear) for b in model.blocks)
    assert model.training and all(m.training for m in model.modules())
    assert all(b.attn.fused_attn for b in model.blocks)
    assert model.init_kwargs["compression"] is None
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(isinstance(b.attn, IrrAtt) for b in new.blocks)
    assert new.training  # the copy keeps the mode of the input


@pytest.mark.parametrize("kw", [
    dict(qk="truncatt", qk_rank=P_, vo_rank=P_),
    dict(qk=None, vo_rank=P_),
    dict(qk="irratt", qk_rank=(P_,) * H_, fusion="identity", vo_rank=P_, mlp_rank=F_, allow_growth=True),
])
def test_full_rank_reproduces_logits(kw):
    model = tiny()
    x = images()
    new, rep = compress(model, **kw)
    with torch.no_grad():
        assert rel(new(x), model(x)) <= 1e-4
    assert all(b["qk_rel_error"] < 1e-6 and b["vo_rel_error"] < 1e-6 for b in rep.to_dict()["blocks"])


@pytest.mark.parametrize("qk,extra", [("truncatt", {}), ("cp", {}), ("irratt", {}),
                                      ("irratt", {"fusion": "identity", "rank_allocation": "spectral"})])
def test_flops_budget_and_ratios(qk, extra):
    model = tiny()
    ratio = 0.5
    new, rep = compress(model, qk=qk, qk_flops_ratio=ratio, vo_rank=8, **extra)
    d = rep.to_dict()
    for b in d["blocks"]:
        assert b["compressed"] and b["method"] == qk
        assert b["qk_macs"] <= ratio * b["qk_macs_orig"]
        assert b["qk_flops_ratio"] == pytest.approx(b["qk_macs"] / b["qk_macs_orig"])
        # flop counter on the explicit path == the MACs formulas (x 2)
        assert b["attn_flops"] == 2 * (b["qk_macs"] + b["vo_macs"])
        assert b["attn_flops_orig"] == 2 * (b["qk_macs_orig"] + b["vo_macs_orig"])
    for key in ("mhsa_flops_ratio", "flops_ratio", "params_ratio"):
        assert 0 < d[key] < 1
    assert d["mhsa_flops_ratio"] < d["flops_ratio"]  # MLP, patch embedding, head are not compressed
    # independent count of the whole model (explicit attention path, one image)
    for m in new.modules():
        if hasattr(m, "fused_attn"):
            assert m.fused_attn  # restored after counting
            m.fused_attn = False
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        new(images(1))
    assert fc.get_total_flops() == d["flops"]
    assert d["params"] == sum(p.numel() for p in new.parameters())
    assert d["params_orig"] == sum(p.numel() for p in model.parameters())


def test_table1_ratios_deit_small():
    """IrrAtt paper, Table 1, DeiT-Small TruncAtt QK 16 / VO 32: MHSA FLOPs CR 37.5, FLOPs CR 76.2,
    # param CR 79.9 (%)."""
    model = create_model("deit_s_p16").eval()
    _, rep = compress(model, qk="truncatt", qk_rank=16, vo_rank=32)
    assert 100 * rep.mhsa_flops_ratio == pytest.approx(37.5, abs=0.05)
    assert 100 * rep.flops_ratio == pytest.approx(76.2, abs=0.05)
    assert 100 * rep.params_ratio == pytest.approx(79.9, abs=0.05)
    assert rep.flops_orig == pytest.approx(2 * 4.6e9, rel=0.01)  # "4.6B FLOPs" (MACs) for DeiT-S


def test_report_contents():
    model = tiny()
    new, rep = compress(model, qk="irratt", qk_rank=24, vo_rank=8, mlp_rank=(20, 24), blocks=[1])
    assert isinstance(rep, CompressionReport)
    d = json.loads(json.dumps(rep.to_dict()))
    for key in ("mhsa_flops_ratio", "flops_ratio", "params_ratio", "qk_macs_ratio", "flops", "flops_orig",
                "mhsa_flops", "mhsa_flops_orig", "params", "params_orig", "num_tokens", "config", "blocks"):
        assert key in d
    assert d["num_tokens"] == 17 and d["config"]["qk"] == "irratt"
    b0, b1 = d["blocks"]
    assert not b0["compressed"] and b0["method"] == "original" and b0["qk_ranks"] == [P_] * H_
    assert type(new.blocks[0].attn).__name__ == "MHSA"
    assert b1["compressed"] and len(b1["qk_ranks"]) == H_ and sum(b1["qk_ranks"]) == 24
    assert b1["vo_ranks"] == [8] * H_ and b1["mlp_rank"] == [20, 24]
    assert 0 < b1["qk_rel_error"] < 1 and 0 < b1["vo_rel_error"] < 1
    assert new.blocks[1].mlp.fc1.rank == 20 and new.blocks[1].mlp.fc2.rank == 24
    md = rep.to_markdown()
    assert "| QK block | QK rank | VO rank | MLP rank | MHSA FLOPs CR, % | FLOPs CR, % | # param CR, % |" in md
    assert "QK rank: per head for TruncAtt; the total over heads for IrrAtt" in md
    assert f"| IrrAtt | 24 | 8 | 20/24 | {100 * rep.mhsa_flops_ratio:.1f} |" in md
    assert md.count("\n| 0 |") == 1 and md.count("\n| 1 |") == 1


@pytest.mark.parametrize("kw", [
    dict(qk="irratt", qk_flops_ratio=0.6, vo_rank=8, mlp_rank=16),
    dict(qk="cp", qk_rank=20),
    dict(qk="truncatt", qk_rank=(4, 8, 12), vo_rank=(16, 8, 4), blocks=[0]),
])
def test_checkpoint_round_trip(tmp_path, kw):
    model = tiny(num_classes=7)
    new, _ = compress(model, **kw)
    new.save_pretrained(tmp_path / "c")
    again = create_model("deit_t_p16", checkpoint_path=str(tmp_path / "c")).eval()
    assert [type(b.attn) for b in again.blocks] == [type(b.attn) for b in new.blocks]
    x = images(3)
    with torch.no_grad():
        assert torch.equal(again(x), new(x))
    # compressing again the not-yet-compressed blocks keeps the earlier spec entries
    if kw.get("blocks") == [0]:
        more, rep = compress(again, qk="truncatt", qk_rank=8, blocks=[1])
        assert rep.to_dict()["blocks"][0]["details"].get("previously_compressed")
        more.save_pretrained(tmp_path / "d")
        last = create_model("deit_t_p16", checkpoint_path=str(tmp_path / "d")).eval()
        assert all(isinstance(b.attn, TruncAtt) for b in last.blocks)
        with torch.no_grad():
            assert torch.equal(last(x), more(x))


def _logits(x, y):
    """Logits of every pair of calibration tokens (the whitened metric's, across images too)."""
    x = x.reshape(-1, x.shape[-1])
    xa = torch.cat([x, x.new_ones(x.shape[0], 1)], dim=-1)
    return torch.einsum("ni,ijh,mj->hnm", xa, y, x)


def test_calibration_is_activation_aware():
    model = tiny()
    calib = images(6) * 2 + 0.5
    toks = collect_block_inputs(model, calib, mlp=True)
    with torch.no_grad():  # the hooks see the normed tokens entering attn / mlp
        h0 = model._embed_grid(calib)[0]
        assert torch.allclose(toks[0]["attn"], model.blocks[0].norm1(h0))
        h1 = model.blocks[0](h0)
        assert torch.allclose(toks[1]["attn"], model.blocks[1].norm1(h1))
        assert torch.allclose(toks[1]["mlp"], model.blocks[1].norm2(h1 + model.blocks[1].attn(toks[1]["attn"])))
    plain, _ = compress(model, qk="truncatt", qk_rank=4, vo_rank=4, mlp_rank=12)
    aware, rep = compress(model, qk="truncatt", qk_rank=4, vo_rank=4, mlp_rank=12, calib=calib)
    for i, b in enumerate(rep.to_dict()["blocks"]):
        assert b["activation_aware"]
        attn = model.blocks[i].attn
        y = (qk_factors(attn).to_tensor() * attn.scale).double()
        x = toks[i]["attn"].double()
        ref = _logits(x, y)
        err_aware = rel(_logits(x, aware.blocks[i].attn.qk_tensor().double()), ref)
        err_plain = rel(_logits(x, plain.blocks[i].attn.qk_tensor().double()), ref)
        assert err_aware <= err_plain + 1e-9  # optimal in the calibration metric (Eckart-Young)
        assert b["qk_rel_error"] == pytest.approx(err_aware, rel=1e-3)


def test_errors():
    model = tiny()
    tost = create_model("tost_t12_p16", img_size=32, num_classes=5, depth=1)
    with pytest.raises(ValueError, match="needs MHSA blocks with qkv/proj"):
        compress(tost, qk="truncatt", qk_rank=4)
    with pytest.raises(ValueError, match="blocks"):
        compress(torch.nn.Linear(3, 3), qk="truncatt", qk_rank=4)
    with pytest.raises(ValueError, match="one rank per head"):
        compress(model, qk="truncatt", qk_rank=(4, 4))
    with pytest.raises(ValueError, match="block 0: .*out of range"):
        compress(model, qk="truncatt", qk_rank=P_ + 1)
    with pytest.raises(ValueError, match="out of range"):
        compress(model, qk=None, vo_rank=P_ + 1)
    with pytest.raises(ValueError, match="out of range"):
        compress(model, qk=None, mlp_rank=F_ + 1)
    with pytest.raises(ValueError, match="qk must be one of"):
        compress(model, qk="svd", qk_rank=4)
    with pytest.raises(ValueError, match="exactly one of qk_rank and qk_flops_ratio"):
        compress(model, qk="irratt", qk_rank=8, qk_flops_ratio=0.5)
    with pytest.raises(ValueError, match="exactly one of qk_rank and qk_flops_ratio"):
        compress(model, qk="irratt")
    with pytest.raises(ValueError, match="qk_flops_ratio"):
        compress(model, qk="truncatt", qk_flops_ratio=1.5)
    with pytest.raises(ValueError, match="nothing to compress"):
        compress(model, qk=None)
    with pytest.raises(ValueError, match="vo=None"):
        compress(model, qk="truncatt", qk_rank=4, vo=None, vo_rank=4)
    with pytest.raises(ValueError, match="vo must be"):
        compress(model, qk="truncatt", qk_rank=4, vo="cp")
    with pytest.raises(ValueError, match="calib must have 4 dimensions"):
        compress(model, qk="truncatt", qk_rank=4, calib=torch.randn(2, 17, F_))
    with pytest.raises(TypeError, match="calib"):
        compress(model, qk="truncatt", qk_rank=4, calib=torch.zeros(2, 3, 32, 32, dtype=torch.long))
    with pytest.raises(ValueError, match="x must have shape"):
        compress(model, qk="truncatt", qk_rank=4, calib=images(2, size=16))
    with pytest.raises(ValueError, match="blocks must hold block indices"):
        compress(model, qk="truncatt", qk_rank=4, blocks=[2])
    new, _ = compress(model, qk="truncatt", qk_rank=4)
    with pytest.raises(ValueError, match="already compressed"):
        compress(new, qk="truncatt", qk_rank=2)
    spec = new.init_kwargs["compression"]
    with pytest.raises(ValueError, match="block entries"):
        apply_compression_spec(tiny(depth=3), spec)
    with pytest.raises(ValueError, match="does not fit"):
        apply_compression_spec(tiny(embed_dim=96), spec)
    with pytest.raises(ValueError, match="unknown attention spec type"):
        apply_compression_spec(tiny(), {"format": 1, "blocks": [{"attn": {**spec["blocks"][0]["attn"],
                                                                           "type": "foo"}}, None]})
    slim, _ = compress(tiny(), qk=None, vo=None, mlp_rank=4, progress=False)
    with pytest.raises(ValueError, match="mlp.fc1 must be an nn.Linear to replace, got LowRankLinear"):
        apply_compression_spec(slim, slim.init_kwargs["compression"])  # its MLPs are compressed already
    for bad in ({"attn": [1, 2]}, {"mlp": "fc1_rank=2"}):  # not dicts: a ValueError, not an AttributeError
        with pytest.raises(ValueError, match="block 0 must be a dict .* each a dict or None"):
            apply_compression_spec(tiny(), {"format": 1, "blocks": [bad, None]})


def _irratt(ranks, fusion):
    layer = IrrAtt(F_, H_, ranks=ranks, fusion="general").double()
    with torch.no_grad():
        layer.fusion.copy_(fusion)
    return layer


def test_fusion_constraints_projection_and_invariance():
    x = torch.randn(2, 9, F_, dtype=torch.float64)
    # one entry per column (a block-diagonal fusion up to permutation), with signs and scales
    C = torch.tensor([[0.0, -2.0, 0.0, 0.7], [1.5, 0.0, 0.0, 0.0], [0.0, 0.0, 0.3, 0.0]], dtype=torch.float64)
    layer = _irratt([3, 5, 4, 2], C)
    wrap = torch.nn.Sequential(layer)
    y0 = layer(x)
    assert apply_fusion_constraints(wrap) == 1
    S = layer.fusion.detach()
    assert (S >= 0).all() and torch.allclose(S @ S.T, torch.eye(H_, dtype=S.dtype))
    assert torch.allclose(layer(x), y0, atol=1e-10)  # only the (absent) off-head entries are dropped
    # plain projection: the fusion matrix becomes project_fusion(C) exactly
    layer2 = _irratt([3, 5, 4, 2], C + 0.05 * torch.randn(3, 4, dtype=torch.float64))
    target = project_fusion(layer2.fusion.detach().clone())
    apply_fusion_constraints(torch.nn.Sequential(layer2), absorb_scale=False)
    assert torch.equal(layer2.fusion.detach(), target)
    # CP SlimAtt S^H (H x R), dense: projected onto the constraint set
    cp_layer = CPSlimAtt(F_, H_, rank=7).double()
    with torch.no_grad():
        cp_layer.fusion.normal_()
    apply_fusion_constraints(cp_layer)
    S = cp_layer.fusion.detach()
    assert (S >= 0).all() and torch.allclose(S @ S.T, torch.eye(H_, dtype=S.dtype))
    assert ((S > 0).sum(0) <= 1).all()
    # fewer blocks than heads: the head without a block gets a zero row, no error
    few = _irratt([4, 6], torch.tensor([[1.0, 0.2], [0.1, -0.8], [0.3, 0.1]], dtype=torch.float64))
    apply_fusion_constraints(few)
    S = few.fusion.detach()
    assert (S >= 0).all() and torch.allclose(S.norm(dim=1), torch.tensor([1.0, 1.0, 0.0], dtype=S.dtype))
    assert apply_fusion_constraints(TruncAtt(F_, H_, qk_ranks=4)) == 0


def test_fusion_constraints_on_compressed_model():
    model = tiny()
    new, _ = compress(model, qk="irratt", qk_rank=30, vo_rank=8)
    n_general = sum(isinstance(m, IrrAtt) and m.fusion is not None for m in new.modules())
    assert apply_fusion_constraints(new) == n_general == 2
    for b in new.blocks:
        S = b.attn.fusion.detach()
        assert (S >= 0).all() and ((S > 0).sum(0) <= 1).all()
        assert torch.allclose(S.norm(dim=1)[S.norm(dim=1) > 0], torch.ones(1))


def _tiny_ckpt(tmp_path, **kw):
    cfg = dict(img_size=8, patch_size=4, in_chans=1, num_classes=10, depth=2, embed_dim=F_, num_heads=H_)
    cfg.update(kw)
    model = create_model("deit_t_p16", **cfg).eval()
    model.save_pretrained(tmp_path / "orig")
    return model, str(tmp_path / "orig")


def test_cli_end_to_end(tmp_path, capsys):
    model, ckpt = _tiny_ckpt(tmp_path)
    out = tmp_path / "out"
    rc = main(["compress", "--checkpoint", ckpt, "--model", "deit_t_p16", "--qk", "irratt", "--qk-flops-ratio", "0.5",
                        "--vo-rank", "8", "--mlp-rank", "16", "--out", str(out), "--quiet"])
    assert rc == 0
    for f in ("model.safetensors", "config.json", "compression_report.json", "compression_report.md"):
        assert (out / f).is_file()
    rep = json.loads((out / "compression_report.json").read_text())
    assert rep["flops_ratio"] < 1 and len(rep["blocks"]) == 2
    assert all(b["qk_macs"] <= 0.5 * b["qk_macs_orig"] for b in rep["blocks"])
    loaded = create_model("deit_t_p16", checkpoint_path=str(out)).eval()
    ref, _ = compress(model, qk="irratt", qk_flops_ratio=0.5, vo_rank=8, mlp_rank=16)
    x = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(loaded(x), ref.eval()(x))
    # usage / option errors -> exit code 2 with a message
    assert main(["compress", "--checkpoint", ckpt, "--qk", "truncatt", "--qk-rank", "99", "--out",
                          str(tmp_path / "bad")]) == 2
    assert "out of range" in capsys.readouterr().err
    assert main(["compress", "--checkpoint", ckpt, "--qk-rank", "4"]) == 2  # --out missing
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("whiteformer compress: error:") and "--out" in err
    assert main(["compress", "--checkpoint", ckpt, "--qk-rank", "4", "--calib", "8", "--out", str(tmp_path / "b")]) == 2
    assert "need --dataset" in capsys.readouterr().err


def test_cli_calib_finetune_constraints(tmp_path):
    pytest.importorskip("sklearn")
    from whiteformer.app.cli import COMMANDS
    from whiteformer.app.cli import main as wf_main

    assert "compress" in COMMANDS
    _, ckpt = _tiny_ckpt(tmp_path)
    out = tmp_path / "ft"
    rc = wf_main(["compress", "--checkpoint", ckpt, "--qk", "irratt", "--qk-rank", "24", "--vo-rank", "8",
                  "--dataset", "digits", "--calib", "32", "--finetune-epochs", "1", "--max-steps", "3",
                  "--batch-size", "32", "--lr", "1e-3", "--fusion-constraints", "--out", str(out), "--quiet"])
    assert rc == 0
    rep = json.loads((out / "compression_report.json").read_text())
    ft = rep["extra"]["finetune"]
    assert ft["steps"] == 3 and ft["fusion_constraints"] and 0 <= ft["acc_after"] <= 1
    assert rep["config"]["calib"] == [32, 1, 8, 8] and all(b["activation_aware"] for b in rep["blocks"])
    loaded = create_model("deit_t_p16", checkpoint_path=str(out))
    for b in loaded.blocks:
        S = b.attn.fusion.detach()
        assert (S >= 0).all() and ((S > 0).sum(0) <= 1).all()


def test_latency():
    model = tiny()
    lat = measure_latency(model, batch_size=2, runs=3, warmup=1)
    assert lat["median_ms"] > 0 and lat["runs"] == 3 and lat["batch_size"] == 2
    _, rep = compress(model, qk="truncatt", qk_rank=4, latency_batch=2, latency_runs=2)
    assert rep.latency["before_ms"] > 0 and rep.latency["after_ms"] > 0 and rep.latency["batch_size"] == 2
    assert "Latency (batch 2" in rep.to_markdown()
    with pytest.raises(ValueError, match="runs"):
        measure_latency(model, runs=0)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        measure_latency(model, [1.0])


def test_project_fusion_with_fewer_columns_than_heads():
    S = torch.tensor([[0.9, -0.2], [0.1, 0.7], [0.3, 0.1]], dtype=torch.float64)
    with pytest.raises(ValueError, match="at least as many columns as heads"):
        project_fusion(S)
    P = project_fusion(S, fewer_columns=True)
    assert torch.equal(P, torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=torch.float64))


def test_the_spec_goes_into_the_constructor_arguments_when_the_model_takes_it():
    """record_compression_spec writes the spec into init_kwargs (what save_pretrained saves) for a
    model whose constructor takes ``compression``, and warns for one whose constructor does not."""
    from whiteformer.compress.surgery import record_compression_spec

    deit = create_model("deit_t_p16", img_size=8, patch_size=4, in_chans=1, num_classes=10, depth=1, embed_dim=16,
                        num_heads=2)
    record_compression_spec(deit, {0: {"qk": "truncatt"}})
    assert deit.init_kwargs["compression"]["blocks"] == [{"qk": "truncatt"}]
    tost = create_model("tost_t12_p16", img_size=8, patch_size=4, in_chans=1, num_classes=10, depth=1,
                        embed_dim=16, num_heads=2)
    with pytest.warns(UserWarning, match="has no `compression` constructor argument"):
        record_compression_spec(tost, {0: {"qk": "truncatt"}})
    assert "compression" not in tost.init_kwargs and tost.compression["blocks"] == [{"qk": "truncatt"}]
