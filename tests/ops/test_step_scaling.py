"""Scale-safe generation: ``causal_tssa_step`` and the state of ``causal_tssa(return_state=True)``
keep their sums in units of a power-of-two scale, so that stepping (from nothing, or on from a
prefill: plain, padded or packed) continues any finite sequence exactly as the parallel op on the
whole sequence, up to float32's range."""
import pytest
import torch

from whiteformer.ops import CausalTSSAState, causal_tssa, causal_tssa_step
from whiteformer.ops.reference import causal_tssa_reference

# |w| up to ~4x the scale (randn); w^2 overflows float32 from ~1.8e19
SCALES = [1.0, 1e10, 1e19, 1e30, 3e38 / 4]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _sequence(seed, scale, dtype, b=2, h=3, n=9, p=4):
    """w (B, H, N, p) whose magnitude also changes along the sequence (small tokens before and
    after large ones, so that the state's scale grows mid-sequence), temp (H, 1), pos_bias."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(b, h, n, p, generator=g, dtype=torch.float64) * scale
    w[:, :, : n // 3] *= 1e-12  # early tokens far below the scale of the later ones
    w = w.clamp(-3e38, 3e38).to(dtype)
    temp = torch.rand(h, 1, generator=g) + 0.5
    bias = torch.randn(h, 16, 1, generator=g) * 0.3
    return w, temp, bias


def _steps(w, temp, bias, state=None):
    outs = []
    for t in range(w.shape[2]):
        o, state = causal_tssa_step(w[:, :, t], state, temp, bias)
        outs.append(o)
    return torch.stack(outs, 2), state


def _close(out, ref, dtype):
    """Finite and within ``dtype``'s error of ``ref``, relative to the row's largest |ref|."""
    assert torch.isfinite(out).all(), f"{(~torch.isfinite(out)).sum().item()} of {out.numel()} not finite"
    norm = ref.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    err = ((out.double() - ref.double()) / norm).abs().max().item()
    assert err <= 4 * TOL[dtype], f"max error {err:.2e} relative to the largest |out|"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("seed", [0, 1])
def test_steps_from_nothing_equal_the_parallel_op(dtype, scale, seed):
    w, temp, bias = _sequence(seed, scale, dtype)
    out, state = _steps(w, temp, bias)
    ref64 = causal_tssa(w.double(), temp.double(), bias.double())
    _close(out, ref64, dtype)
    _close(out, causal_tssa(w, temp, bias), dtype)
    for s in state[:3] + (state.scale,):
        assert torch.isfinite(s).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("split", [1, 4, 8])
def test_prefill_then_steps_equal_the_parallel_op(dtype, scale, split):
    w, temp, bias = _sequence(split, scale, dtype)
    ref64 = causal_tssa(w.double(), temp.double(), bias.double())
    head, state = causal_tssa(w[:, :, :split], temp, bias, return_state=True)
    tail, _ = _steps(w[:, :, split:], temp, bias, state)
    _close(torch.cat([head, tail], dim=2), ref64, dtype)


@pytest.mark.parametrize("scale", SCALES)
def test_small_tokens_after_a_large_prefill(scale):
    """The state's scale never shrinks: tokens far below it continue the sums in its units."""
    w, temp, bias = _sequence(3, scale, torch.float32)
    w = torch.cat([w[:, :, 5:], w[:, :, :5]], dim=2)  # large tokens first, then tiny ones
    head, state = causal_tssa(w[:, :, :4], temp, bias, return_state=True)
    tail, _ = _steps(w[:, :, 4:], temp, bias, state)
    _close(torch.cat([head, tail], dim=2), causal_tssa(w.double(), temp.double(), bias.double()), torch.float32)


@pytest.mark.parametrize("scale", [1e19, 1e30])
def test_padded_and_packed_prefills_then_steps(scale):
    """A left-padded batch and a packed row of documents: each sequence's steps continue it as the
    parallel op on that sequence alone."""
    w, temp, bias = _sequence(4, scale, torch.float32, b=2, n=10)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[1, :3] = False
    _, state = causal_tssa(w[:, :, :6], temp, bias, keep, return_state=True)
    tail, _ = _steps(w[:, :, 6:], temp, bias, state)
    for row, first in ((0, 0), (1, 3)):
        alone = causal_tssa(w[row:row + 1, :, first:].double(), temp.double(), bias.double())
        _close(tail[row:row + 1], alone[:, :, -4:], torch.float32)
    lengths = [3, 6]
    cu = torch.tensor([0, 3, 9], dtype=torch.int32)
    docs = [w[0, :, :3], w[1, :, :6]]
    _, state = causal_tssa(torch.cat(docs, dim=1)[None], temp, bias, return_state=True, cu_seqlens=cu)
    nxt = w[:, :, 6:]
    tail, _ = _steps(nxt, temp, bias, CausalTSSAState(*state[:3], state.t, state.scale))
    for s, (doc, n) in enumerate(zip(docs, lengths)):
        alone = causal_tssa(torch.cat([doc, nxt[s]], dim=1)[None].double(), temp.double(), bias.double())
        _close(tail[s:s + 1], alone[:, :, n:], torch.float32)


def test_ordinary_inputs_keep_unit_scale():
    """Below the scaling threshold the state's sums are in w's units (scale exactly 1)."""
    w, temp, bias = _sequence(5, 1.0, torch.float32)
    _, state = causal_tssa(w, temp, bias, return_state=True)
    assert (state.scale == 1).all()
    torch.testing.assert_close(state.sum_sq, (w.double() ** 2).sum(dim=2).float())
    _, state = _steps(w, temp, bias)
    assert (state.scale == 1).all()


def test_state_without_scale_is_in_w_units():
    """A state built by hand without ``scale`` (sums in w's units) continues as before."""
    w, temp, bias = _sequence(6, 1.0, torch.float32)
    _, state = causal_tssa(w[:, :, :5], temp, bias, return_state=True)
    plain = CausalTSSAState(*state[:4])
    a, _ = _steps(w[:, :, 5:], temp, bias, plain)
    b, _ = _steps(w[:, :, 5:], temp, bias, state)
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match=r"state.scale must have shape \(2, 3, 4\) \(or \(B, H\)"):
        causal_tssa_step(w[:, :, 5], state._replace(scale=torch.ones(3)), temp, bias)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_steps_after_a_packed_prefill_keep_each_documents_scale(seed):
    """Documents of very different scales packed in one row (one at 1e30, the others near 1): each
    document's state carries its own scale, and stepping it on equals that document alone."""
    g = torch.Generator().manual_seed(seed)
    h, p = 3, 4
    lengths = torch.randint(1, 7, (4,), generator=g).tolist()
    big = int(torch.randint(0, 4, (1,), generator=g))
    docs = [torch.randn(h, n, p, generator=g, dtype=torch.float64) * (1e30 if i == big else 1.0)
            for i, n in enumerate(lengths)]
    temp = torch.rand(h, 1, generator=g, dtype=torch.float64) + 0.5
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    _, state = causal_tssa(torch.cat(docs, dim=1)[None].float(), temp.float(), return_state=True, cu_seqlens=cu)
    nxt = torch.randn(len(docs), h, 3, p, generator=g, dtype=torch.float64)
    nxt[big] *= 1e30
    tail, _ = _steps(nxt.float(), temp.float(), None, state)
    for s, doc in enumerate(docs):
        alone = causal_tssa(torch.cat([doc, nxt[s]], dim=1)[None], temp)
        _close(tail[s:s + 1], alone[:, :, lengths[s]:], torch.float32)


def _one_huge_feature(dtype, token):
    """w (1, 3, 9, 4) of ordinary values but for one entry of 1e30 (head 1, token ``token``,
    feature 0), temp (3, 1), pos_bias."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1, 3, 9, 4, generator=g)
    w[0, 1, token, 0] = 1e30
    return w.to(dtype), torch.ones(3, 1), torch.randn(3, 16, 1, generator=g) * 0.3


def _close_columns(out, ref, dtype, norm):
    """Within ``dtype``'s error of ``ref`` relative to ``norm``: each (row, head, feature) column's
    largest |result| over the whole sequence."""
    assert torch.isfinite(out).all()
    err = ((out.double() - ref) / norm).abs().max().item()
    assert err <= 4 * TOL[dtype], f"max error {err:.2e} relative to the column's largest |out|"


# (huge token, prefill length): the steps after a prefill, or all of them; a prefill holding the huge token
# only where it is the first (the parallel op scales each feature over all its tokens, see tests/ops/test_scaling.py)
HUGE_SPLITS = [(0, 0), (4, 0), (8, 0), (0, 3), (4, 3), (8, 3), (8, 6), (0, 6)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("token,split", HUGE_SPLITS)
def test_one_huge_feature_prefill_then_steps(dtype, token, split):
    """One feature reaching 1e30 at ``token`` beside ordinary ones, generated token by token after a
    prefill of ``split`` tokens: the state's scale is per feature (B, H, p), so the other features'
    sums keep their units when that feature's scale grows (one scale per head sent them to 0).
    Each step runs with the scale of its own prefix, so the huge token may come at any step."""
    w, temp, bias = _one_huge_feature(dtype, token)
    ref = causal_tssa_reference(w.double(), temp.double(), bias.double())
    norm = ref.abs().amax(dim=-2, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    state = None
    if split:
        _, state = causal_tssa(w[:, :, :split], temp, bias, return_state=True)
    out, state = _steps(w[:, :, split:], temp, bias, state)
    _close_columns(out, ref[:, :, split:], dtype, norm)
    big = torch.zeros(1, 3, 4, dtype=torch.bool)
    big[0, 1, 0] = True
    assert state.scale.shape == (1, 3, 4) and (state.scale[big] == 2.0 ** 99).all() and (state.scale[~big] == 1).all()


def test_state_with_a_scale_per_head_still_steps():
    """A state whose scale is one per head (B, H) (saved before scales were per feature) is taken
    as that scale for every feature."""
    w, temp, bias = _sequence(7, 1e30, torch.float32)
    _, state = causal_tssa(w[:, :, :5], temp, bias, return_state=True)
    head = state.scale.amax(dim=-1)  # (B, H): the sums in units of it for every feature
    old = state._replace(sum_sq=state.sum_sq * (state.scale / head[..., None]) ** 2,
                         sum_sq_pi=state.sum_sq_pi * (state.scale / head[..., None]) ** 2, scale=head)
    a, new = _steps(w[:, :, 5:], temp, bias, old)
    b, _ = _steps(w[:, :, 5:], temp, bias, state)
    _close(a, b.double(), torch.float32)
    assert new.scale.shape == (2, 3, 4)
