"""One way to name a checkpoint: a saved model directory, a run directory (its final/) or that
final/; ``whiteformer.from_pretrained`` reads the name from config.json; a different
``num_classes`` resets the head (as timm); absurd sizes in a config.json are refused before
anything is allocated."""
import json

import pytest
import torch

import whiteformer
from whiteformer import create_model

TINY = dict(img_size=16, patch_size=4, depth=1, embed_dim=32, num_heads=4, num_classes=3)


@pytest.fixture
def run_dir(tmp_path):
    torch.manual_seed(0)
    model = create_model("tost_t12_p16", **TINY).eval()
    model.save_pretrained(tmp_path / "run" / "final")
    (tmp_path / "run" / "checkpoints").mkdir()
    return tmp_path / "run", model


@pytest.mark.parametrize("where", ["run", "run/final"])
def test_from_pretrained_and_create_model_accept_run_or_final(run_dir, where):
    run, model = run_dir
    path = run.parent / where
    x = torch.randn(2, 3, 16, 16)
    a = whiteformer.from_pretrained(path).eval()
    b = create_model("tost_t12_p16", checkpoint_path=path).eval()
    assert a.model_name == "tost_t12_p16"
    torch.testing.assert_close(a(x), model(x), rtol=0, atol=0)
    torch.testing.assert_close(b(x), model(x), rtol=0, atol=0)


def test_other_num_classes_resets_the_head(run_dir):
    run, model = run_dir
    new = create_model("tost_t12_p16", num_classes=5, checkpoint_path=run)
    assert new.head.weight.shape == (5, 32)
    assert torch.equal(new.blocks[0].attn.qkv.weight, model.blocks[0].attn.qkv.weight)
    also = whiteformer.from_pretrained(run, num_classes=7)
    assert also.head.out_features == 7 and torch.equal(also.cls_token, model.cls_token)
    # without num_classes the saved head is kept; a mismatch elsewhere still fails loudly
    assert torch.equal(create_model("tost_t12_p16", checkpoint_path=run).head.weight, model.head.weight)
    with pytest.raises(ValueError, match="mismatched shapes"):
        create_model("tost_t12_p16", num_classes=5, embed_dim=64, checkpoint_path=run)


def test_paths_without_a_model_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no model"):
        whiteformer.from_pretrained(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        create_model("tost_t12_p16", checkpoint_path=tmp_path / "nowhere")


def test_feature_arguments_are_checked():
    with pytest.raises(TypeError, match="features_only must be a bool, got str"):
        create_model("tost_t12_p16", features_only="yes", **TINY)
    with pytest.raises(ValueError, match="go with features_only=True"):
        create_model("tost_t12_p16", out_indices=[0], **TINY)
    with pytest.raises(TypeError, match=r"feature_cfg must be a dict \(output_fmt, norm\), got list"):
        create_model("tost_t12_p16", features_only=True, feature_cfg=["NLC"], **TINY)


def test_absurd_config_sizes_refused_before_allocation(run_dir):
    run, _ = run_dir
    cfg_path = run / "final" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["init_kwargs"].update(embed_dim=4_000_000, num_heads=4)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="parameters"):
        whiteformer.from_pretrained(run)
