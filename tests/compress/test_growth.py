"""Compression never silently grows the model: the CP rank is bounded by H p as
TruncAtt's (p per head) and IrrAtt's (H p in total) are, and ranks whose attention (QK + VO MACs)
or MLP cost exceeds the original's are refused unless ``allow_growth`` / ``--allow-growth``."""
import json

import pytest
import torch

from whiteformer.app.cli import main
from whiteformer.compress import compress, compress_attention
from whiteformer.models import create_model

DIM, HEADS = 32, 4  # a 32-wide DeiT, head dim 8: H p = 32


def _deit():
    return create_model("deit_t_p16", img_size=16, patch_size=8, in_chans=1, num_classes=3, depth=2,
                        embed_dim=DIM, num_heads=HEADS).eval()


@pytest.mark.parametrize("rank", [33, 500, 100000])
def test_cp_rank_above_h_p_is_refused(rank):
    with pytest.raises(ValueError, match=r"qk_rank out of range.*H \* p = 32"):
        compress(_deit(), qk="cp", qk_rank=rank, vo=None)
    with pytest.raises(ValueError, match="qk_rank out of range"):
        compress_attention(_deit().blocks[0].attn, qk="cp", qk_rank=rank, num_tokens=5)


def test_growing_compression_is_refused_unless_allowed():
    model = _deit()
    with pytest.raises(ValueError, match="block 0: CP rank R = 32 would cost .*x the attention MACs.*allow_growth"):
        compress(model, qk="cp", qk_rank=32, vo=None)
    new, report = compress(model, qk="cp", qk_rank=32, vo=None, allow_growth=True)
    assert report.mhsa_flops > report.mhsa_flops_orig and report.config["allow_growth"] is True
    # IrrAtt at full total rank with general fusion pays N^2 H B on top of the original QK MACs
    with pytest.raises(ValueError, match="grows the model"):
        compress_attention(model.blocks[0].attn, qk="irratt", qk_rank=32, fusion="general", num_tokens=5)
    # a rank-r MLP with r (in + out) > in out costs more than the dense MLP
    with pytest.raises(ValueError, match="MLP rank 32 for fc1"):
        compress(model, qk=None, vo=None, mlp_rank=32)
    # shrinking compressions pass unchanged
    small, rep = compress(model, qk="cp", qk_rank=4, vo="truncatt", vo_rank=4, mlp_rank=8)
    assert rep.mhsa_flops < rep.mhsa_flops_orig and rep.flops < rep.flops_orig


def test_cli_refuses_growth_and_cp_rank_out_of_range(tmp_path, capsys):
    _deit().save_pretrained(tmp_path / "orig")
    ckpt = str(tmp_path / "orig")
    assert main(["compress", "--checkpoint", ckpt, "--qk", "cp", "--qk-rank", "500", "--out", str(tmp_path / "a"),
                          "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "qk_rank out of range" in err
    assert main(["compress", "--checkpoint", ckpt, "--qk", "cp", "--qk-rank", "32", "--out", str(tmp_path / "b"),
                          "--quiet"]) == 2
    assert "--allow-growth" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert main(["compress", "--checkpoint", ckpt, "--qk", "cp", "--qk-rank", "32", "--allow-growth",
                          "--out", str(tmp_path / "c"), "--quiet"]) == 0
    report = json.loads((tmp_path / "c" / "compression_report.json").read_text())
    assert report["config"]["allow_growth"] is True and report["mhsa_flops"] > report["mhsa_flops_orig"]
    assert torch.isfinite(create_model("deit_t_p16", checkpoint_path=str(tmp_path / "c"))(
        torch.randn(1, 1, 16, 16))).all()
