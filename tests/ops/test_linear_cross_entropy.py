"""Chunked LM-head cross-entropy: equal to the plain loss, forward and gradients."""
import pytest
import torch

from whiteformer import create_model
from whiteformer.ops import linear_cross_entropy
from whiteformer.ops.reference import linear_cross_entropy_reference


def _inputs(M=37, D=8, V=23, dtype=torch.float32, seed=0, ignore=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(M, D, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(V, D, generator=g, dtype=dtype, requires_grad=True)
    t = torch.randint(0, V, (M,), generator=g)
    if ignore:
        t[::5] = -1
    return h, w, t


@pytest.mark.parametrize("chunk", [1, 8, 37, 100])
def test_matches_reference_forward_and_gradients(chunk):
    h, w, t = _inputs()
    ref = linear_cross_entropy_reference(h, w, t)
    gh_ref, gw_ref = torch.autograd.grad(ref, (h, w))
    out = linear_cross_entropy(h, w, t, chunk_size=chunk)
    gh, gw = torch.autograd.grad(out, (h, w))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(gh, gh_ref)
    torch.testing.assert_close(gw, gw_ref)
    # scaled upstream gradient, and the no-grad path
    gh2, = torch.autograd.grad(3.0 * linear_cross_entropy(h, w, t, chunk_size=chunk), (h,))
    torch.testing.assert_close(gh2, 3.0 * gh_ref)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, t, chunk_size=chunk), ref.detach())


def test_gradcheck_float64():
    h, w, t = _inputs(M=9, D=4, V=6, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: linear_cross_entropy(a, b, t, chunk_size=4), (h, w))


def test_only_one_input_requires_grad():
    h, w, t = _inputs()
    w2 = w.detach()
    gh, = torch.autograd.grad(linear_cross_entropy(h, w2, t, chunk_size=5), (h,))
    gh_ref, = torch.autograd.grad(linear_cross_entropy_reference(h, w2, t), (h,))
    torch.testing.assert_close(gh, gh_ref)


def test_bf16_autocast_keeps_float32_loss():
    h, w, t = _inputs(M=16, D=8, V=11)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_cross_entropy(h, w, t, chunk_size=5)
        ref = linear_cross_entropy_reference(h, w, t)
    assert out.dtype == torch.float32 and torch.isfinite(out)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    gh, gw = torch.autograd.grad(out, (h, w))
    assert gh.dtype == h.dtype and gw.dtype == w.dtype


def test_bad_input_errors():
    h, w, t = _inputs()
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(h, w, t, chunk_size=0)
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(h, w[:, :3], t)
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(h, w, t[:3])
    with pytest.raises(TypeError, match="integer"):
        linear_cross_entropy(h, w, t.float())


@pytest.mark.parametrize("case, err, match", [
    ("negative target", ValueError, r"targets must be class ids in \[0, V = 23\).*got -5"),
    ("target >= V", ValueError, r"targets must be class ids.*got 23"),
    ("no classes", ValueError, r"weight has no classes \(V = 0"),
    ("weight float64", TypeError, "weight has dtype torch.float64 but h has torch.float32"),
    ("weight on meta", ValueError, "weight must be on h's device"),
    ("targets on meta", ValueError, "targets must be on h's device"),
    ("h not a tensor", TypeError, "h must be a torch.Tensor"),
])
def test_bad_arguments_are_named(case, err, match):
    """Each bad argument raises an error naming it, where torch would fail without naming it, or
    silently take a negative target as class 0, or read a weight on another device."""
    h, w, t = _inputs(ignore=False)
    h, w = h.detach(), w.detach()
    args = {
        "negative target": (h, w, torch.cat([torch.tensor([-5]), t[1:]])),
        "target >= V": (h, w, torch.cat([torch.tensor([23]), t[1:]])),
        "no classes": (h, w[:0], t),
        "weight float64": (h, w.double(), t),
        "weight on meta": (h, w.to("meta"), t),
        "targets on meta": (h, w, t.to("meta")),
        "h not a tensor": (h.tolist(), w, t),
    }[case]
    for grad in (False, True):
        with pytest.raises(err, match=match):
            linear_cross_entropy(args[0].requires_grad_(grad) if isinstance(args[0], torch.Tensor) else args[0],
                                 *args[1:])


def test_ignore_index_may_be_negative_and_meta_gives_a_meta_loss():
    h, w, t = _inputs(ignore=False)
    t = t.clone()
    t[::3] = -100
    loss = linear_cross_entropy(h, w, t, ignore_index=-100)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(h @ w.T, t, ignore_index=-100))
    meta = linear_cross_entropy(h.detach().to("meta"), w.detach().to("meta"), t.to("meta"))
    assert meta.device.type == "meta" and meta.shape == ()


@pytest.mark.parametrize("name", ["tost_lm_base", "gpt_base"])
def test_lm_loss_chunk_equals_plain_loss(name):
    kw = dict(vocab_size=97, dim=32, depth=2, num_heads=4, max_len=64)
    torch.manual_seed(0)
    model = create_model(name, **kw)
    idx = torch.randint(0, 97, (2, 24))
    tgt = torch.randint(0, 97, (2, 24))
    tgt[0, :3] = -1
    logits, plain = model(idx, tgt)
    g_plain = torch.autograd.grad(plain, list(model.parameters()))
    none, chunked = model(idx, tgt, loss_chunk=7)
    g_chunk = torch.autograd.grad(chunked, list(model.parameters()))
    assert none is None and logits.shape == (2, 24, 97)
    torch.testing.assert_close(chunked, plain)
    for a, b in zip(g_chunk, g_plain):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="loss_chunk needs targets"):
        model(idx, loss_chunk=7)


def test_gpt_explicit_softmax_matches_sdpa():
    torch.manual_seed(0)
    model = create_model("gpt_base", vocab_size=50, dim=32, depth=2, num_heads=4, max_len=32).eval()
    idx = torch.randint(0, 50, (2, 20))
    fused, _ = model(idx)
    for blk in model.transformer.h:
        blk.attn.fused_attn = False
    explicit, _ = model(idx)
    torch.testing.assert_close(explicit, fused, rtol=1e-5, atol=1e-5)


def test_gpt_explicit_softmax_matches_sdpa_with_padding():
    torch.manual_seed(0)
    model = create_model("gpt_base", vocab_size=50, dim=32, depth=2, num_heads=4, max_len=32).eval()
    idx = torch.randint(0, 50, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, :4] = False  # left padding
    fused, _ = model(idx, attn_mask=mask)
    for blk in model.transformer.h:
        blk.attn.fused_attn = False
    explicit, _ = model(idx, attn_mask=mask)
    torch.testing.assert_close(explicit, fused, rtol=1e-5, atol=1e-5)
