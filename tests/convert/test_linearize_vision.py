"""linearize on image classifiers: a softmax ViT / DeiT or ToST-shell teacher -> its TSSA student."""
import pytest
import torch
import torch.nn.functional as F

import whiteformer
from whiteformer.convert import from_transformers, linearize

transformers = pytest.importorskip("transformers")

CLASSES = 4


def _blobs(seed: int, n: int = 8, batch: int = 16, size: int = 16):
    """``n`` (images (B, 1, size, size), labels (B,)) batches: noise plus a bright square in the
    quadrant the label names (something to learn)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    half = size // 2
    for _ in range(n):
        y = torch.randint(0, CLASSES, (batch,), generator=g)
        x = 0.3 * torch.randn(batch, 1, size, size, generator=g)
        for b, label in enumerate(y.tolist()):
            r, c = divmod(label, 2)
            x[b, 0, r * half + 2:r * half + 6, c * half + 2:c * half + 6] += 2.0
        out.append((x, y))
    return out


def _train(model, steps: int = 60):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for x, y in _blobs(1, n=steps):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def vit():
    """A tiny transformers ViT, imported, then trained a little on the blobs."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=1, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=64, num_labels=CLASSES)
    return _train(from_transformers(transformers.ViTForImageClassification(config).eval()))


@pytest.fixture(scope="module")
def tost():
    """The ToST vision shell with softmax attention (a DeiT-style teacher with a class-attention head)."""
    torch.manual_seed(0)
    return _train(whiteformer.create_model("vit_cab_s12_p16", img_size=16, patch_size=4, in_chans=1, embed_dim=32,
                                           depth=3, num_heads=4, num_classes=CLASSES))


def test_vit_transfer_and_finetune_beat_the_plain_swap(vit):
    before = {k: v.clone() for k, v in vit.state_dict().items()}
    student, result = linearize(vit, _blobs(2), transfer_steps=30, finetune_steps=30, lr=3e-3,
                                eval_batch=_blobs(3, n=1)[0], progress=False)
    assert all(torch.equal(v, vit.state_dict()[k]) for k, v in before.items())  # the teacher is untouched
    assert result.tssa_layers == [0, 1]
    assert all(a < b for a, b in zip(result.transfer_after, result.transfer_before))
    assert result.kl_finetune < result.kl_swap
    assert type(student) is type(vit) and student.attn_name == "tssa" and not student.training
    assert [type(b.attn).__name__ for b in student.blocks] == ["TSSA", "TSSA"]


def test_vit_plain_swap_copies_the_values_and_everything_else(vit):
    student, result = linearize(vit, _blobs(2, n=1), transfer_steps=0, finetune_steps=0, progress=False)
    assert result.kl_swap == result.kl_transfer == result.kl_finetune
    d = vit.embed_dim
    theirs = vit.state_dict()
    for k, v in student.state_dict().items():
        if ".attn." not in k:
            assert torch.equal(v, theirs[k]), k  # patch embedding, positions, norms, MLPs, head
    for src, dst in zip(vit.blocks, student.blocks):
        assert torch.equal(dst.attn.qkv.weight, src.attn.qkv.weight[2 * d:])
        assert torch.equal(dst.attn.qkv.bias, src.attn.qkv.bias[2 * d:])
        assert torch.equal(dst.attn.proj.weight, src.attn.proj.weight)
    q, _ = linearize(vit, _blobs(2, n=1), transfer_steps=0, finetune_steps=0, init="qk", progress=False)
    assert torch.equal(q.blocks[1].attn.qkv.weight, vit.blocks[1].attn.qkv.weight[:d])


def test_tost_shell_hybrid_with_lora_round_trips(tost, tmp_path):
    student, result = linearize(tost, _blobs(2), keep_softmax=[1], transfer_steps=20, finetune_steps=20, lr=3e-3,
                                lora_rank=4, eval_batch=_blobs(3, n=1)[0], progress=False)
    assert result.tssa_layers == [0, 2] and result.kl_finetune < result.kl_swap
    assert [type(b.attn).__name__ for b in student.blocks] == ["TSSA", "MHSA", "TSSA"]
    assert student.keep_softmax == [1] and not any("lora" in k for k in student.state_dict())
    t = tost.state_dict()
    for k, v in student.state_dict().items():
        if not k.startswith(("blocks.0.attn.", "blocks.2.attn.")):
            assert torch.equal(v, t[k]), k  # the kept block, the stem, the class-attention head
    student.save_pretrained(tmp_path / "student")
    loaded = whiteformer.from_pretrained(tmp_path / "student").eval()
    x = _blobs(4, n=1)[0][0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), student(x))


def test_images_without_labels_train_on_the_kl_alone(tost):
    images = [x for x, _ in _blobs(2, n=2)]
    _, result = linearize(tost, images, transfer_steps=2, finetune_steps=2, progress=False)
    assert len(result.finetune_history) == 2 and all(v == v for v in result.finetune_history)


def test_vision_batches_and_teachers_are_checked(tost):
    x, y = _blobs(2, n=1)[0]
    with pytest.raises(ValueError, match="labels"):
        linearize(tost, [(x, y + CLASSES)], progress=False)
    with pytest.raises(ValueError, match="images"):
        linearize(tost, [(x[0], y)], progress=False)
    with pytest.raises(TypeError, match="image-classifier"):
        linearize(tost, [{"idx": y}], progress=False)
    tssa = whiteformer.create_model("tost_t12_p16", img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=1,
                                    num_heads=4, num_classes=CLASSES)
    with pytest.raises(ValueError, match="teacher must be .* got ToSTVision with attn='tssa'"):
        linearize(tssa, [x], progress=False)
    with pytest.raises(ValueError, match="keep_softmax"):
        linearize(tost, [x], keep_softmax=[3], progress=False)


def test_vision_shells_build_hybrids():
    kw = dict(img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=3, num_heads=4, num_classes=CLASSES)
    vit = whiteformer.create_model("vit", **kw, attn="tssa", keep_softmax=[2])
    assert [type(b.attn).__name__ for b in vit.blocks] == ["TSSA", "TSSA", "MHSA"]
    assert vit(torch.randn(2, 1, 16, 16)).shape == (2, CLASSES)
    for name in ("vit", "vit_cab_s12_p16"):
        with pytest.raises(ValueError, match="keep_softmax"):
            whiteformer.create_model(name, **kw, keep_softmax=[0])  # softmax everywhere already
        with pytest.raises(ValueError, match="keep_softmax"):
            whiteformer.create_model(name, **kw, attn="tssa", keep_softmax=[3])
