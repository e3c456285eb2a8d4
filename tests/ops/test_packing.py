"""Packed variable-length sequences (``cu_seqlens``, FlashAttention's convention): a packed row
gives each document the result it has alone, forward and gradients, on every kernel backend."""
import sys
from pathlib import Path

import pytest
import torch

from kernel_backends import BACKENDS, use_backend
from whiteformer.ops import causal_tssa, causal_tssa_step, tssa
from whiteformer.ops._kernels import ENV_BACKEND
from whiteformer.ops.reference import causal_tssa_reference, tssa_reference

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.packed_varlen import ERRORS_LENGTHS, error_lengths, packed_errors, separate  # noqa: E402

# segment lengths: 1, odd, longer than the kernels' tiny test chunks (set below), an empty one
LENGTHS = [1, 5, 0, 13, 2]


def _cu(lengths, dtype=torch.int32):
    return torch.tensor([0] + lengths, dtype=torch.long).cumsum(0).to(dtype)


def _inputs(lengths=LENGTHS, heads=3, p=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    w = torch.randn(1, heads, total, p, generator=g, dtype=dtype, requires_grad=True)
    temp = (torch.rand(heads, 1, generator=g, dtype=dtype) + 0.5).requires_grad_()
    bias = (0.3 * torch.randn(heads, 16, 1, generator=g, dtype=dtype)).requires_grad_()
    return w, temp, bias, _cu(lengths)


def _alone(fn, w, cu, *args):
    """Each document through ``fn`` (the unpacked op) alone, outputs and Pi concatenated."""
    bounds = cu.tolist()
    outs = [fn(w[:, :, a:b], *args) for a, b in zip(bounds, bounds[1:]) if b > a]
    return torch.cat([o for o, _ in outs], 2), torch.cat([p for _, p in outs], 2)


@pytest.fixture(params=sorted(BACKENDS))
def backend(request, monkeypatch):
    return use_backend(request.param, monkeypatch)


def _dtype(backend):
    return torch.float32 if backend == "triton" else torch.float64


def test_causal_packed_equals_alone(backend):
    w, temp, bias, cu = _inputs(dtype=_dtype(backend))
    out, pi = causal_tssa(w, temp, bias, return_pi=True, cu_seqlens=cu)
    ref_out, ref_pi = _alone(lambda z, *a: causal_tssa(z, *a, return_pi=True), w, cu, temp, bias)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(pi, ref_pi)
    lit_out, lit_pi = causal_tssa_reference(w, temp, bias, return_pi=True, cu_seqlens=cu)
    torch.testing.assert_close(out, lit_out)
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum() + pi.sum(), (w, temp, bias))
    ref_grads = torch.autograd.grad((ref_out * g).sum() + ref_pi.sum(), (w, temp, bias))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_tssa_packed_equals_alone(backend):
    w, temp, _, cu = _inputs(dtype=_dtype(backend))
    out, pi = tssa(w, temp, return_pi=True, cu_seqlens=cu)
    ref_out, ref_pi = _alone(lambda z, t: tssa(z, t, return_pi=True), w, cu, temp)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(pi, ref_pi)
    torch.testing.assert_close(out, tssa_reference(w, temp, cu_seqlens=cu))
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum() + pi.sum(), (w, temp))
    ref_grads = torch.autograd.grad((ref_out * g).sum() + ref_pi.sum(), (w, temp))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_packed_gradcheck_float64():
    w, temp, bias, cu = _inputs([1, 4, 3], heads=2, p=3)
    assert torch.autograd.gradcheck(lambda w, t, b: causal_tssa(w, t, b, return_pi=True, cu_seqlens=cu),
                                    (w, temp, bias))
    assert torch.autograd.gradcheck(lambda w, t: tssa(w, t, return_pi=True, cu_seqlens=cu), (w, temp))


def test_packed_state_per_document():
    w, temp, bias, cu = _inputs()
    _, state = causal_tssa(w, temp, bias, return_state=True, cu_seqlens=cu)
    assert state.sum_sq.shape == (len(LENGTHS), 3, 4)
    assert state.t.tolist() == LENGTHS
    bounds = cu.tolist()
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b == a:
            assert not state.sum_sq[s].detach().any() and not state.sum_pi[s].detach().any()
            continue
        _, alone = causal_tssa(w[:, :, a:b], temp, bias, return_state=True)
        for field in ("sum_sq", "sum_pi", "sum_sq_pi"):
            torch.testing.assert_close(getattr(state, field)[s], getattr(alone, field)[0])


def test_packed_documents_do_not_leak():
    w, temp, bias, cu = _inputs()
    out = causal_tssa(w, temp, bias, cu_seqlens=cu)
    w2 = w.detach().clone()
    w2[:, :, :6] = torch.randn_like(w2[:, :, :6])  # change the first documents only
    out2 = causal_tssa(w2, temp, bias, cu_seqlens=cu)
    torch.testing.assert_close(out[:, :, 6:], out2[:, :, 6:])


@pytest.mark.parametrize("bad, err, match", [
    (torch.tensor([0, 3, 7], dtype=torch.float32), TypeError, "int32"),
    (torch.tensor([[0, 7]], dtype=torch.int32), ValueError, r"\(S \+ 1,\)"),
    (torch.tensor([0], dtype=torch.int32), ValueError, r"\(S \+ 1,\)"),
    (torch.tensor([1, 7], dtype=torch.int32), ValueError, "start at 0"),
    (torch.tensor([0, 5, 3, 7], dtype=torch.int32), ValueError, "non-decreasing"),
    (torch.tensor([0, 3, 6], dtype=torch.int32), ValueError, "end at"),
    ([0, 7], TypeError, "cu_seqlens"),
])
def test_bad_cu_seqlens(bad, err, match):
    w = torch.randn(1, 2, 7, 4)
    temp = torch.ones(2, 1)
    for op in (tssa, causal_tssa):
        with pytest.raises(err, match=match):
            op(w, temp, cu_seqlens=bad)


def test_packed_refuses_batch_and_mask_and_long_documents():
    temp = torch.ones(2, 1)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"\(1, H, total, p\)"):
        causal_tssa(torch.randn(2, 2, 7, 4), temp, cu_seqlens=cu)
    with pytest.raises(ValueError, match="attn_mask and cu_seqlens"):
        tssa(torch.randn(1, 2, 7, 4), temp, torch.ones(1, 7, dtype=torch.bool), cu_seqlens=cu)
    with pytest.raises(ValueError, match="torch.distributed initialised"):  # split rows: test_context_parallel
        causal_tssa(torch.randn(1, 2, 7, 4), temp, group=object(), cu_seqlens=cu)
    # positions restart per document: 7 packed tokens fit a table of 4 when no document is longer
    bias = torch.zeros(2, 4, 1)
    causal_tssa(torch.randn(1, 2, 7, 4), temp, bias, cu_seqlens=cu)
    with pytest.raises(ValueError, match="T_max"):
        causal_tssa(torch.randn(1, 2, 7, 4), temp, bias, cu_seqlens=torch.tensor([0, 2, 7], dtype=torch.int32))


# ---- the native varlen PyTorch path (no padded layout) ----

@pytest.fixture
def native(monkeypatch):
    """The PyTorch backend, with the padded layout refused: the packed row must run natively."""
    from whiteformer.ops.layout import TokenLayout

    monkeypatch.setenv(ENV_BACKEND, "torch")

    def padded(*args, **kwargs):
        raise AssertionError("the PyTorch path laid the packed documents out as a padded batch")

    monkeypatch.setattr(TokenLayout, "padded", padded)


@pytest.mark.parametrize("lengths", [[1], [7], [1, 1, 1], [3] * 12 + [40] + [1, 0]], ids=str)
def test_native_packed_equals_alone(native, lengths):
    w, temp, bias, cu = _inputs(lengths, seed=len(lengths))
    bias = (0.3 * torch.randn(3, 40, 1, dtype=torch.float64)).requires_grad_()
    for fn, args in ((lambda z, *a, **k: causal_tssa(z, *a, return_pi=True, **k), (temp, bias)),
                     (lambda z, *a, **k: tssa(z, *a, return_pi=True, **k), (temp,))):
        out, pi = fn(w, *args, cu_seqlens=cu)
        ref_out, ref_pi = _alone(fn, w, cu, *args)
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(pi, ref_pi)
        g = torch.randn_like(out)
        grads = torch.autograd.grad((out * g).sum() + (pi * pi).sum(), (w, *args))
        ref_grads = torch.autograd.grad((ref_out * g).sum() + (ref_pi * ref_pi).sum(), (w, *args))
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b)
    ref = tssa(w, temp, normalize=False, cu_seqlens=cu)  # the Table 8 ablation, per document too
    torch.testing.assert_close(ref, _alone(lambda z, t: tssa(z, t, return_pi=True, normalize=False), w, cu, temp)[0])


def test_native_gradcheck_float64(native):
    w, temp, bias, cu = _inputs([1, 4, 0, 3], heads=2, p=3)
    assert torch.autograd.gradcheck(lambda w, t, b: causal_tssa(w, t, b, return_pi=True, cu_seqlens=cu),
                                    (w, temp, bias))
    assert torch.autograd.gradcheck(lambda w, t: tssa(w, t, return_pi=True, cu_seqlens=cu), (w, temp))


def test_native_state_per_document(native):
    w, temp, bias, cu = _inputs()
    _, state = causal_tssa(w, temp, bias, return_state=True, cu_seqlens=cu)
    assert state.t.tolist() == LENGTHS and state.sum_pi.shape == (len(LENGTHS), 3)
    bounds = cu.tolist()
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b > a:
            _, alone = causal_tssa(w[:, :, a:b], temp, bias, return_state=True)
            for field in ("sum_sq", "sum_pi", "sum_sq_pi"):
                torch.testing.assert_close(getattr(state, field)[s], getattr(alone, field)[0])
        else:
            assert not state.sum_sq[s].any() and not state.sum_sq_pi[s].any()


def test_native_half_close_to_float32(native):
    w, temp, bias, cu = _inputs([2, 9, 1, 15], dtype=torch.float32)
    for op, args in ((causal_tssa, (temp, bias)), (tssa, (temp,))):
        ref = op(w, *args, cu_seqlens=cu)
        half = op(w.bfloat16(), *args, cu_seqlens=cu)
        assert half.dtype == torch.bfloat16
        torch.testing.assert_close(half.float(), ref, atol=2e-2, rtol=2e-2)


def test_native_causal_prefix_sums_restart_exactly(native):
    """A small document after a long one with large values (sum of squares 1e8 times larger): its
    prefix sums must not carry the rounding of the earlier documents' float32 running total."""
    g = torch.Generator().manual_seed(3)
    big = 30.0 * torch.randn(1, 2, 3000, 4, generator=g)
    small = 0.1 * torch.randn(1, 2, 6, 4, generator=g)
    cu = _cu([3000, 6])
    temp = torch.ones(2, 1)
    out = causal_tssa(torch.cat([big, small], 2), temp, cu_seqlens=cu)
    torch.testing.assert_close(out[:, :, 3000:], causal_tssa(small, temp), rtol=1e-5, atol=1e-8)


def test_kernels_take_the_native_path_when_padding_is_large(monkeypatch):
    """With a fused kernel, a packed row whose padded layout would exceed PADDED_WASTE_MAX * total
    slots runs natively; a row of equal lengths keeps the kernel's padded layout."""
    from whiteformer.ops._kernels.build import fast_path_available
    from whiteformer.ops.layout import TokenLayout

    if not fast_path_available():
        pytest.skip("C++ kernel not built on this machine")
    monkeypatch.setenv(ENV_BACKEND, "cpu")
    calls = []
    monkeypatch.setattr(TokenLayout, "padded", lambda *a, _f=TokenLayout.padded, **k: calls.append(1) or _f(*a, **k))
    temp = torch.ones(3, 1)
    for lengths, padded in (([12] + [1] * 10, False), ([4, 4, 3], True)):
        w, _, _, cu = _inputs(lengths, dtype=torch.float32)
        for op in (tssa, causal_tssa):
            calls.clear()
            out = op(w, temp, cu_seqlens=cu)
            assert bool(calls) == padded, (lengths, op.__name__)
            torch.testing.assert_close(out, _alone(lambda z, t: op(z, t, return_pi=True), w, cu, temp)[0])


def test_native_dropout_keeps_documents_apart(native):
    """Dropout (always the PyTorch path, also with kernels) on the packed tokens: with the same
    random state, changing the first documents changes nothing in the others; some gains drop."""
    w, temp, bias, cu = _inputs()
    w2 = w.detach().clone()
    w2[:, :, :6] = torch.randn_like(w2[:, :, :6])
    for op, args in ((causal_tssa, (temp, bias)), (tssa, (temp,))):
        torch.manual_seed(0)
        out = op(w, *args, attn_drop=0.5, training=True, cu_seqlens=cu)
        torch.manual_seed(0)
        out2 = op(w2, *args, attn_drop=0.5, training=True, cu_seqlens=cu)
        torch.testing.assert_close(out[:, :, 6:], out2[:, :, 6:])
        assert (out == 0).any() and not torch.equal(out, op(w, *args, cu_seqlens=cu))


# ---- exact at realistic sizes: thousands of documents against each document run alone ----

def _assert_exact(op, lengths, heads=2, p=16):
    """float64: the packed row equals the separate runs to 1e-12 (relative to the largest value),
    forward and every gradient; float32: its error against float64 is within 4x the separate runs'
    own (or 4 roundings, eps, where the separate runs happen to be below one rounding)."""
    errs = packed_errors(op, lengths, torch.float64, heads=heads, p=p)["packed"]
    assert max(errs.values()) < 1e-12, errs
    errs = packed_errors(op, lengths, torch.float32, heads=heads, p=p)
    eps = torch.finfo(torch.float32).eps
    for k, e in errs["packed"].items():
        assert e <= 4 * max(errs["separate"][k], eps), (k, errs)


def _short_lengths(count, longest, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, longest + 1, (count,), generator=g).tolist()


@pytest.mark.parametrize("op", ["causal_tssa", "tssa"])
def test_native_exact_at_4000_documents(native, op):
    """4,000 short documents and one long one (65,536 tokens): a global prefix sum minus each
    document's offset was off by 0.15 % in the gradient of w here (28 % for 1,500 documents of
    16 tokens after one of 2,048)."""
    lengths = error_lengths(ERRORS_LENGTHS)
    assert len(lengths) == 4001 and sum(lengths) == 65536
    _assert_exact(op, lengths)


@pytest.mark.parametrize("backend", ["torch", "cpu"], indirect=True)  # Triton's interpreter: too slow here
@pytest.mark.parametrize("op", ["causal_tssa", "tssa"])
def test_exact_at_many_documents_per_backend(backend, op):
    """3,000 documents of 1 to 16 tokens on the PyTorch path and on the C++ kernel (its padded
    layout, documents crossing its chunks)."""
    _assert_exact(op, _short_lengths(3000, 16))


def test_native_issue_sized_gradient_exact(native):
    """1,500 documents of 16 tokens, then one of 2,048 (H 2, p 16, float64): the gradient of w of
    the packed row is that of the documents run alone."""
    lengths = [16] * 1500 + [2048]
    errs = packed_errors("causal_tssa", lengths, torch.float64, heads=2, p=16)["packed"]
    assert errs["grad_w"] < 1e-12, errs


def test_step_continues_each_packed_document():
    """The per-document states of a packed row (3,000 documents) are those of the documents run
    alone, and causal_tssa_step continues each of them alike."""
    from whiteformer.ops import CausalTSSAState

    lengths = _short_lengths(3000, 16, seed=1)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(1, 2, sum(lengths), 8, generator=g, dtype=torch.float64)
    temp = torch.ones(2, 1, dtype=torch.float64)
    bias = 0.3 * torch.randn(2, 17, 1, generator=g, dtype=torch.float64)
    _, packed = causal_tssa(w, temp, bias, return_state=True, cu_seqlens=_cu(lengths))

    def final_sums(x):  # each document's final sums, repeated at every one of its tokens
        state = causal_tssa(x, temp, bias, return_state=True)[1]
        return [t.unsqueeze(2).expand(-1, -1, x.shape[2], *t.shape[2:]) for t in state[:3]]

    last = torch.tensor(lengths).cumsum(0) - 1
    alone = CausalTSSAState(*(t[0][:, last].transpose(0, 1) for t in separate(final_sums, w, lengths)),
                            torch.tensor(lengths))
    for field in ("sum_sq", "sum_pi", "sum_sq_pi"):
        torch.testing.assert_close(getattr(packed, field), getattr(alone, field), rtol=1e-12, atol=0)
    w_t = torch.randn(len(lengths), 2, 8, generator=g, dtype=torch.float64)
    out, state = causal_tssa_step(w_t, packed, temp, bias)
    ref, _ = causal_tssa_step(w_t, alone, temp, bias)
    assert state.t.tolist() == [n + 1 for n in lengths]
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=0)


def test_segment_positions_of_checked_lengths():
    """The caller checks cu_seqlens once and passes the lengths it got: no second check here."""
    from whiteformer._checks import check_cu_seqlens
    from whiteformer.ops.layout import segment_positions

    cu = torch.tensor([0, 1, 4, 4, 6], dtype=torch.int32)
    lengths = check_cu_seqlens(cu, 6)
    assert segment_positions(cu, lengths, torch.device("cpu")).tolist() == [0, 0, 1, 2, 0, 1]
