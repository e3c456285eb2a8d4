"""timm's model API, checked the same way on every registered vision model: forward_intermediates
with timm's semantics, prune_intermediate_layers, create_model(features_only=True), group_matcher,
pretrained_cfg / default_cfg, reset_classifier(global_pool=...), set_grad_checkpointing; and
whiteformer.timm.register() (skipped where timm cannot import: here it needs a torchvision build for
this CPU torch that is not installed)."""
import re

import pytest
import torch
import torch.nn as nn

import whiteformer
from whiteformer.timm import vision_model_names

NAMES = vision_model_names()
# small enough for a test, every family's head count divides 48; ECA with a rank-2 sketch
SMALL = dict(img_size=16, patch_size=4, depth=2, num_classes=3, embed_dim=48)


def _small(name, **kw):
    torch.manual_seed(0)
    extra = {"attn_kwargs": {"rank": 2}} if name.startswith("eca_") else {}
    return whiteformer.create_model(name, **SMALL, **extra, **kw).eval()


def test_every_vision_family_is_covered():
    prefixes = {n.split("_")[0] for n in NAMES}
    assert prefixes == {"tost", "dmst", "eca", "xcit", "vit", "crate", "deit"}
    assert not [n for n in NAMES if n.startswith(("tost_lm", "gpt", "tost_lra", "transformer_lra"))]


@pytest.mark.parametrize("name", NAMES)
def test_timm_model_api(name):
    model = _small(name)
    x = torch.randn(2, 3, 16, 16)
    d, grid, depth = 48, (4, 4), 2
    npt = model.num_prefix_tokens
    with torch.no_grad():
        feats = model.forward_features(x)
        final, inter = model.forward_intermediates(x)
        torch.testing.assert_close(final, feats)  # timm: (forward_features output, intermediates)
        assert len(inter) == depth and all(t.shape == (2, d, *grid) for t in inter)  # NCHW maps
        last = model.forward_intermediates(x, indices=1, intermediates_only=True)  # int n: the last n
        assert len(last) == 1 and torch.equal(last[0], inter[-1])
        both = model.forward_intermediates(x, indices=[0, -1], output_fmt="NLC", intermediates_only=True)
        assert [t.shape for t in both] == [(2, 16, d)] * 2
        torch.testing.assert_close(both[0], inter[0].flatten(2).transpose(1, 2))
        normed = model.forward_intermediates(x, indices=[1], norm=True, output_fmt="NLC", intermediates_only=True)
        assert not torch.allclose(normed[0], both[1])  # norm=True applied the model's norm
        early_final, early = model.forward_intermediates(x, indices=[0], stop_early=True)
        assert torch.equal(early[0], inter[0]) and early_final.shape == final.shape
        pairs = model.forward_intermediates(x, return_prefix_tokens=True, intermediates_only=True)
        assert all(p.shape == (2, npt, d) and torch.equal(s, t) for (s, p), t in zip(pairs, inter))
        for bad in ([2], [-3], 3):
            with pytest.raises(ValueError):
                model.forward_intermediates(x, indices=bad)
        with pytest.raises(ValueError, match="output_fmt"):
            model.forward_intermediates(x, output_fmt="NHWC")

        # features_only: the maps of the chosen blocks, the model pruned after the last of them
        net = whiteformer.create_model(name, **SMALL, **({"attn_kwargs": {"rank": 2}} if name.startswith("eca_")
                                                          else {}), features_only=True, out_indices=[0])
        net.model.load_state_dict(model.state_dict(), strict=False)
        maps = net.eval()(x)
        assert len(net.model.blocks) == 1 and len(maps) == 1 and torch.equal(maps[0], inter[0])
        assert net.feature_info.channels() == [d] and net.feature_info.reduction() == [4]
        assert net.feature_info.module_name() == ["blocks.0"]
        assert net.model.num_classes == 0 and isinstance(net.model.head, nn.Identity)

    assert model.feature_info.module_name() == ["blocks.0", "blocks.1"] and model.feature_info.channels() == [d, d]

    # prune_intermediate_layers (timm's): keep up to the last wanted block, drop the head
    pruned = _small(name)
    assert pruned.prune_intermediate_layers([0, 1], prune_head=True) == [0, 1]
    assert len(pruned.blocks) == 2 and pruned.num_classes == 0
    assert pruned.prune_intermediate_layers(1, prune_head=False) == [1]

    # group_matcher: stem + one group per block + the final norm; the classifier is the rest
    groups = model.group_matcher()
    assert re.match(groups["stem"], "patch_embed.proj.weight")
    patterns = [groups["stem"]] + [p for g, v in groups.items() if g != "stem"
                                   for p in ([v] if isinstance(v, str) else [q for q, _ in v])]
    head = {n for n, _ in model.named_parameters() if n.startswith("head.")}
    unmatched = [n for n, _ in model.named_parameters() if n not in head and not any(re.match(p, n) for p in patterns)]
    assert not unmatched, unmatched
    block_rx = groups["blocks"] if isinstance(groups["blocks"], str) else groups["blocks"][0][0]
    assert {re.match(block_rx, n).group(1) for n, _ in model.named_parameters() if n.startswith("blocks.")} == \
        {"0", "1"}

    # pretrained_cfg / default_cfg
    cfg = model.pretrained_cfg
    assert cfg == model.default_cfg
    assert cfg["input_size"] == (3, 16, 16) and len(cfg["mean"]) == len(cfg["std"]) == 3
    assert cfg["num_classes"] == 3 and cfg["classifier"] == "head"
    modules = dict(model.named_modules())
    assert modules[cfg["classifier"]] is model.get_classifier()
    first = modules[cfg["first_conv"]]
    assert isinstance(first, (nn.Conv2d, nn.Linear))
    assert (first.in_channels if isinstance(first, nn.Conv2d) else first.in_features) in (3, 3 * 16)

    # reset_classifier with global_pool
    with torch.no_grad():
        token = model.forward_head(feats, pre_logits=True)
        model.reset_classifier(7, global_pool="avg")
        assert model.global_pool == "avg" and model(x).shape == (2, 7)
        avg = model.forward_head(feats, pre_logits=True)
    assert avg.shape == token.shape and not torch.allclose(avg, token)
    with pytest.raises(ValueError, match="global_pool"):
        model.reset_classifier(7, global_pool="max")

    # set_grad_checkpointing: same output with the blocks checkpointed
    model.train()
    torch.manual_seed(1)
    want = model(x)
    model.set_grad_checkpointing(True)
    torch.manual_seed(1)
    torch.testing.assert_close(model(x), want)
    model.set_grad_checkpointing(False)
    with pytest.raises(TypeError, match="enable must be a bool, got str"):
        model.set_grad_checkpointing("yes")


def test_timm_registry():
    timm = pytest.importorskip("timm", reason="timm does not import here (it needs a torchvision for this torch)")
    import whiteformer.timm

    names = whiteformer.timm.register()
    assert "whiteformer_tost_t12_p16" in names and timm.is_model("whiteformer_tost_t12_p16")
    model = timm.create_model("whiteformer_tost_t12_p16", img_size=32, patch_size=8, depth=1, num_classes=4)
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 4)
    feats = timm.create_model("whiteformer_deit_t_p16", img_size=32, depth=2, features_only=True, out_indices=[1])
    assert [f.shape for f in feats(torch.randn(1, 3, 32, 32))] == [(1, 192, 2, 2)]
