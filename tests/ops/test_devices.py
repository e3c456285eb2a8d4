"""Every operand of an operator must be on the device of its main input: a clear
ValueError naming the argument, before any kernel runs (the fused CPU kernel used to read a
``meta`` temp as garbage and return NaN). Also sparsemax's argument checks."""
import pytest
import torch

from whiteformer.ops import (
    CausalTSSAState,
    causal_tssa,
    causal_tssa_step,
    class_attention,
    dmsa,
    eca_compress,
    eca_expand,
    eca_omega,
    mhsa,
    mhsa_explicit,
    mssa,
    rotary,
    sparsemax,
    tssa,
    xca,
)

B, H, N, P = 2, 3, 6, 4


def _meta(t):
    return t.to("meta")


def _mask():
    m = torch.ones(B, N, dtype=torch.bool)
    m[1, 0] = False
    return m


def _tssa_cases():
    w, temp, bias, mask = torch.randn(B, H, N, P), torch.rand(H, 1) + 0.5, torch.zeros(H, 8, 1), _mask()
    yield "temp", lambda: tssa(w, _meta(temp))
    yield "attn_mask", lambda: tssa(w, temp, _meta(mask))
    yield "temp", lambda: causal_tssa(w, _meta(temp))
    yield "pos_bias", lambda: causal_tssa(w, temp, _meta(bias))
    yield "attn_mask", lambda: causal_tssa(w, temp, bias, _meta(mask))
    w_t = torch.randn(B, H, P)
    _, state = causal_tssa_step(w_t, None, temp, bias)
    yield "temp", lambda: causal_tssa_step(w_t, state, _meta(temp))
    yield "pos_bias", lambda: causal_tssa_step(w_t, state, temp, _meta(bias))
    for field in ("sum_sq", "sum_pi", "sum_sq_pi"):
        bad = state._replace(**{field: _meta(getattr(state, field))})
        yield f"state.{field}", lambda bad=bad: causal_tssa_step(w_t, bad, temp, bias)
    yield "state.t", lambda: causal_tssa_step(w_t, CausalTSSAState(*state[:3], _meta(torch.tensor([1, 1]))), temp)


def _other_cases():
    s, logits, mask = torch.randn(B, H, N, P), torch.randn(B, N, H), _mask()
    yield "logits", lambda: dmsa(s, _meta(logits))
    yield "attn_mask", lambda: dmsa(s, logits, _meta(mask))
    z = torch.randn(B, N)
    yield "mask", lambda: sparsemax(z, mask=_meta(mask))
    x = torch.randn(B, N, 8)
    yield "positions", lambda: rotary(x, positions=_meta(torch.arange(N)))
    omega = eca_omega(N, 2, seed=0)
    yield "omega", lambda: eca_expand(x, _meta(omega))
    yield "attn_mask", lambda: eca_expand(x, omega, attn_mask=_meta(mask))
    U = torch.randn(8, 8)
    yield "U", lambda: eca_compress(x, _meta(U), omega, 1.0, 2)
    yield "omega", lambda: eca_compress(x, U, _meta(omega), 1.0, 2)
    yield "temperature", lambda: eca_compress(x, U, omega, _meta(torch.ones(2)), 2)
    yield "attn_mask", lambda: eca_compress(x, U, omega, 1.0, 2, attn_mask=_meta(mask))
    q = torch.randn(B, H, N, P)
    for fn in (mhsa, mhsa_explicit):
        yield "k", lambda fn=fn: fn(q, _meta(q), q)
        yield "v", lambda fn=fn: fn(q, q, _meta(q))
        yield "attn_mask", lambda fn=fn: fn(q, q, q, _meta(mask))
    yield "attn_mask", lambda: mssa(q, _meta(mask))
    yield "temperature", lambda: xca(q, q, q, _meta(torch.ones(H, 1, 1)))
    yield "attn_mask", lambda: xca(q, q, q, torch.ones(H, 1, 1), _meta(mask))
    yield "q_cls", lambda: class_attention(_meta(q[:, :, :1]), q, q)
    yield "v", lambda: class_attention(q[:, :, :1], q, _meta(q))
    yield "attn_mask", lambda: class_attention(q[:, :, :1], q, q, _meta(mask))


CASES = list(_tssa_cases()) + list(_other_cases())


@pytest.mark.parametrize("name,call", CASES, ids=[f"{i}-{name}" for i, (name, _) in enumerate(CASES)])
def test_operand_on_another_device_is_a_clear_error(name, call):
    with pytest.raises(ValueError, match=rf"^{name} must be on \w+'s device \(cpu\), got meta"):
        call()


def test_tssa_ops_run_on_meta():
    """All operands on one device (meta here: shapes only) is fine, whatever kernel is registered."""
    w, temp = torch.empty(B, H, N, P, device="meta"), torch.empty(H, 1, device="meta")
    assert tssa(w, temp).shape == w.shape
    out, state = causal_tssa(w, temp, torch.empty(H, 8, 1, device="meta"), return_state=True)
    assert out.shape == w.shape and state.sum_sq.shape == (B, H, P)
    out_t, _ = causal_tssa_step(w[:, :, 0], state, temp)
    assert out_t.shape == (B, H, P) and out_t.device.type == "meta"


def test_sparsemax_arguments():
    with pytest.raises(ValueError, match="sparsemax over an empty dimension: z has size 0 along dim -1"):
        sparsemax(torch.empty(3, 0))
    with pytest.raises(ValueError, match="size 0 along dim 0"):
        sparsemax(torch.empty(0, 3), dim=0)
    assert sparsemax(torch.empty(0, 3)).shape == (0, 3)  # empty batch, non-empty simplex: fine
    with pytest.raises(ValueError, match=r"dim must be an int in \[-2, 1\]"):
        sparsemax(torch.randn(2, 3), dim=2)
    with pytest.raises(ValueError, match="at least one dimension"):
        sparsemax(torch.tensor(1.0))
    with pytest.raises(TypeError, match="z must be a floating tensor"):
        sparsemax(torch.ones(3, dtype=torch.long))
    with pytest.raises(TypeError, match="mask must be a bool"):
        sparsemax(torch.randn(2, 3), mask=torch.ones(2, 3))
    torch.testing.assert_close(sparsemax(torch.tensor([2.0, 0.0, -1.0])), torch.tensor([1.0, 0.0, 0.0]))
