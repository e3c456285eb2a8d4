"""LRA sequence classifiers (ToST Table 7): registered sizes, padding, pooling, dual encoder, errors."""
from __future__ import annotations

import pytest
import torch

from whiteformer import create_model, list_models
from whiteformer.models.lra import LRAClassifier

# ToST Table 7: (layers, feature dim, heads, MLP dim, pre-norm, dropout)
TABLE7 = {
    "listops": (6, 512, 8, 2048, True, 0.1),
    "text": (4, 256, 4, 1024, True, 0.1),
    "retrieval": (6, 128, 4, 512, True, 0.1),
    "image": (8, 64, 8, 128, True, 0.0),
    "pathfinder": (2, 64, 2, 128, False, 0.1),
}


@pytest.mark.parametrize("task", sorted(TABLE7))
@pytest.mark.parametrize("family,attn", [("tost", "TSSA"), ("transformer", "MHSA")])
def test_registered_sizes_follow_table7(task, family, attn):
    depth, dim, heads, mlp_dim, prenorm, drop = TABLE7[task]
    m = create_model(f"{family}_lra_{task}")
    assert (m.depth, m.embed_dim, m.num_heads, m.mlp_dim, m.prenorm) == (depth, dim, heads, mlp_dim, prenorm)
    assert len(m.blocks) == depth
    blk = m.blocks[0]
    assert type(blk.attn).__name__ == attn and blk.attn.num_heads == heads
    assert blk.mlp.fc1.out_features == mlp_dim and blk.mlp.fc1.in_features == dim
    assert blk.prenorm is prenorm and isinstance(m.norm, torch.nn.LayerNorm) is prenorm
    assert blk.mlp.drop1.p == drop
    assert m.dual is (task == "retrieval")
    assert m.head[0].in_features == (4 * dim if task == "retrieval" else dim)


def test_both_families_registered():
    names = list_models("*_lra_*")
    assert names == sorted(f"{f}_lra_{t}" for f in ("tost", "transformer") for t in TABLE7)


def _small(**kw):
    torch.manual_seed(0)
    base = dict(vocab_size=20, num_classes=3, max_len=32, embed_dim=16, depth=2, num_heads=2, mlp_dim=32)
    return LRAClassifier(**{**base, **kw}).eval()


@pytest.mark.parametrize("attn", ["tssa", "mhsa"])
@pytest.mark.parametrize("pool", ["mean", "cls"])
@pytest.mark.parametrize("prenorm", [True, False])
def test_padding_is_invisible(attn, pool, prenorm):
    """Right padding (ids = pad_id) changes nothing: same logits as the unpadded sequence."""
    m = _small(attn=attn, pool=pool, prenorm=prenorm)
    x = torch.randint(1, 20, (2, 11))
    padded = torch.cat([x, torch.zeros(2, 9, dtype=torch.long)], 1)
    torch.testing.assert_close(m(padded), m(x), atol=1e-5, rtol=1e-5)
    # an explicit mask does the same for a model without a padding id
    m2 = _small(attn=attn, pool=pool, prenorm=prenorm, pad_id=None)
    m2.load_state_dict(m.state_dict())
    junk = torch.cat([x, torch.randint(0, 20, (2, 9))], 1)
    mask = torch.arange(20)[None].expand(2, -1) < 11
    torch.testing.assert_close(m2(junk, attn_mask=mask), m(x), atol=1e-5, rtol=1e-5)
    # without the mask the junk is read: far above the 1e-5 agreement with the mask (the shift is about
    # 5e-4 with a class token on some torch versions' random draws, 1e-3 on others)
    assert (m2.forward_features(junk) - m.forward_features(x)).abs().max() > 1e-4


def test_variable_lengths_in_one_batch():
    m = _small()
    a, b = torch.randint(1, 20, (1, 7)), torch.randint(1, 20, (1, 13))
    batch = torch.zeros(2, 13, dtype=torch.long)
    batch[0, :7], batch[1] = a[0], b[0]
    out = m(batch)
    torch.testing.assert_close(out[0], m(a)[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], m(b)[0], atol=1e-5, rtol=1e-5)


def test_dual_encoder_reads_u_v_features():
    m = _small(dual=True, num_classes=2)
    x = torch.randint(1, 20, (3, 2, 10))
    out = m(x)
    u, v = m.forward_features(x[:, 0]), m.forward_features(x[:, 1])
    torch.testing.assert_close(out, m.head(torch.cat([u, v, u * v, u - v], -1)))
    # swapping the documents changes the logits only through the asymmetric (u - v, order) parts
    assert out.shape == (3, 2)


def test_gradients_reach_every_parameter():
    m = _small(pool="cls").train()
    m(torch.randint(1, 20, (2, 12))).sum().backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing


def test_any_registered_attention_and_save_load(tmp_path):
    m = _small(attn="dmsa")
    assert type(m.blocks[0].attn).__name__ == "DMSA"
    m = create_model("tost_lra_pathfinder", depth=1, max_len=16).eval()
    m.save_pretrained(tmp_path / "m")
    again = create_model("tost_lra_pathfinder", checkpoint_path=str(tmp_path / "m")).eval()
    x = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(again(x), m(x))


def test_no_weight_decay_names_exist():
    m = _small(pool="cls")
    names = dict(m.named_parameters())
    nwd = m.no_weight_decay()
    assert {"pos_embed", "cls_token", "blocks.0.attn.temp"} <= nwd
    assert nwd <= set(names)


@pytest.mark.parametrize("bad,err,msg", [
    (torch.randn(2, 5), TypeError, "integer tensor"),
    (torch.randint(0, 20, (2, 40)), ValueError, "max_len"),
    (torch.full((2, 5), 25), ValueError, "expected \\[0, 19\\]"),
    (torch.randint(1, 20, (2, 2, 5)), ValueError, "shape \\(B, N\\)"),
    (torch.zeros(2, 5, dtype=torch.long), ValueError, "at least one real token"),
])
def test_bad_input_is_a_clear_error(bad, err, msg):
    with pytest.raises(err, match=msg):
        _small()(bad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="pool"):
        _small(pool="max")
    with pytest.raises(ValueError, match="pad_id"):
        _small(pad_id=99)
    with pytest.raises(ValueError, match="unknown attention|not registered|available"):
        _small(attn="nope")
    with pytest.raises(ValueError, match="attn_mask"):
        _small()(torch.randint(1, 20, (2, 5)), attn_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="two documents"):
        _small(dual=True)(torch.randint(1, 20, (2, 5)))
