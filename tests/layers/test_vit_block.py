"""What a drop-in attention needs around it in a plain ViT: the class-attention readout,
XCiT's local patch interaction and the ready ViT block."""
import pytest
import torch

from whiteformer.attention import ClassAttention, list_attention
from whiteformer.layers import ClassAttentionPool, LocalPatchInteraction, ViTBlock

F64 = torch.float64


def test_class_attention_pool_is_cait_class_attention_on_a_learned_token():
    pool = ClassAttentionPool(16, num_heads=2, depth=2).double().eval()
    x = torch.randn(3, 7, 16, dtype=F64)
    cls = pool.cls_token.expand(3, -1, -1)
    for blk in pool.blocks:
        assert isinstance(blk.attn, ClassAttention)
        t = blk.norm1(torch.cat([cls, x], dim=1))
        q = blk.attn.qkv(t)[:, :1, :16].reshape(3, 1, 2, 8).transpose(1, 2)
        k, v = blk.attn.qkv(t)[:, :, 16:].reshape(3, 8, 2, 2, 8).permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, dim=-1) @ v  # one query: the class token
        cls = cls + blk.attn.proj(a.transpose(1, 2).reshape(3, 1, 16))
        cls = cls + blk.mlp(blk.norm2(cls))
    torch.testing.assert_close(pool(x), pool.norm(cls[:, 0]))
    assert pool.no_weight_decay() == {"cls_token"}


def test_class_attention_pool_ignores_padded_tokens_and_permutations():
    pool = ClassAttentionPool(16, num_heads=4).double().eval()
    x = torch.randn(2, 6, 16, dtype=F64)
    mask = torch.tensor([[True] * 4 + [False] * 2, [True] * 6])
    y = pool(x, mask)
    x2 = x.clone()
    x2[0, 4:] = 1e3
    torch.testing.assert_close(pool(x2, mask), y)
    torch.testing.assert_close(y[0], pool(x[:1, :4])[0])
    perm = torch.randperm(6)
    torch.testing.assert_close(pool(x[:, perm])[1], pool(x)[1])  # a pooling: order of the tokens is irrelevant


def test_class_attention_pool_bad_arguments():
    with pytest.raises(ValueError, match="depth"):
        ClassAttentionPool(16, num_heads=2, depth=0)
    with pytest.raises(ValueError, match="mlp_ratio"):
        ClassAttentionPool(16, num_heads=2, mlp_ratio=0)
    with pytest.raises(ValueError, match="divisible"):
        ClassAttentionPool(10, num_heads=4)
    with pytest.raises(ValueError, match="x must have 3"):
        ClassAttentionPool(16, num_heads=2)(torch.randn(4, 16))


def test_local_patch_interaction_is_local():
    lpi = LocalPatchInteraction(8).double().eval()
    x = torch.randn(2, 5 * 6, 8, dtype=F64)
    y = lpi(x, (5, 6))
    assert y.shape == x.shape
    x2 = x.clone()
    x2[:, 0] += 10.0  # the top-left token: only its 5x5 neighbourhood (two 3x3 convs) may change
    changed = (lpi(x2, (5, 6)) - y).abs().amax(dim=(0, 2)).reshape(5, 6) > 0
    assert changed[:3, :3].all() and not changed[3:].any() and not changed[:, 3:].any()
    with pytest.raises(ValueError, match="grid_size"):
        lpi(x, (5, 5))
    with pytest.raises(ValueError, match="kernel_size must be an odd positive int, got 2"):
        LocalPatchInteraction(8, kernel_size=2)


@pytest.mark.parametrize("attn", [n for n in list_attention() if n in ("tssa", "mhsa", "dmsa", "eca", "xca", "mssa")])
def test_vit_block_with_every_mixer(attn):
    kw = {"rank": 2} if attn == "eca" else None
    blk = ViTBlock(16, num_heads=2, attn=attn, attn_kwargs=kw, lpi=True).eval()
    x = torch.randn(2, 1 + 9, 16, requires_grad=True)
    y = blk(x, grid_size=(3, 3), num_prefix_tokens=1)
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_vit_block_layout_and_errors():
    blk = ViTBlock(16, num_heads=2, attn="tssa").double().eval()
    x = torch.randn(2, 5, 16, dtype=F64)
    h = x + blk.attn(blk.norm1(x))
    torch.testing.assert_close(blk(x), h + blk.mlp(blk.norm2(h)))
    scaled = ViTBlock(16, num_heads=2, attn="eca", attn_kwargs={"rank": 2}, layer_scale=1e-5)
    assert scaled.gamma1 is None and scaled.gamma2 is not None  # ECA's alpha/beta are its scale
    assert ViTBlock(16, num_heads=2, attn="tssa", layer_scale=1e-5).gamma1 is not None
    lpi = ViTBlock(16, num_heads=2, attn="tssa", lpi=True)
    with pytest.raises(ValueError, match="grid_size"):
        lpi(torch.randn(2, 9, 16))
    with pytest.raises(ValueError, match=r"attn_mask is not supported with lpi=True"):
        lpi(torch.randn(2, 9, 16), attn_mask=torch.ones(2, 9, dtype=torch.bool), grid_size=(3, 3))
    with pytest.raises(ValueError, match=r"num_prefix_tokens must be an int in \[0, N\), got 10"):
        lpi(torch.randn(2, 10, 16), grid_size=(3, 3), num_prefix_tokens=10)
    with pytest.raises(ValueError, match="grid_size"):
        lpi(torch.randn(2, 10, 16), grid_size=(3, 3))  # the [CLS] token was not declared as a prefix
    with pytest.raises(ValueError, match="unknown attention"):
        ViTBlock(16, num_heads=2, attn="nope")
    with pytest.raises(TypeError, match="attn_kwargs"):
        ViTBlock(16, num_heads=2, attn_kwargs=[1])
    with pytest.raises(TypeError, match="normalize must be a bool, got int"):
        ViTBlock(16, num_heads=2, attn="tssa", attn_kwargs={"normalize": 1})
