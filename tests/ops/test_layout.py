"""The token layout (:class:`whiteformer.ops.TokenLayout`): one validation of ``attn_mask`` /
``cu_seqlens``, its views, and the ops and layers given a ``layout=`` instead of the raw arguments
(the same results, nothing read again)."""
import pytest
import torch

from whiteformer.attention import CausalSelfAttention, CausalTSSA
from whiteformer.models.decoder import RotaryCausalAttention
from whiteformer.ops import TokenLayout, causal_tssa, tssa

CU = torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32)  # an empty document and one of a single token


def test_of_validates_once_with_each_message():
    x = torch.randn(1, 9, 4)
    with pytest.raises(ValueError, match=r"with cu_seqlens, x must hold the packed documents in one row \(1, N, C\)"):
        TokenLayout.of(torch.randn(2, 9, 4), cu_seqlens=CU)
    with pytest.raises(ValueError, match="attn_mask and cu_seqlens cannot be combined"):
        TokenLayout.of(x, torch.ones(1, 9, dtype=torch.bool), CU)
    with pytest.raises(ValueError, match=r"cu_seqlens must be on x's device \(cpu\), got meta"):
        TokenLayout.of(x, cu_seqlens=CU.to("meta"))
    with pytest.raises(ValueError, match="cu_seqlens must end at the number of packed tokens"):
        TokenLayout.of(x, cu_seqlens=CU[:-1])
    with pytest.raises(ValueError, match="non-decreasing"):
        TokenLayout.of(x, cu_seqlens=torch.tensor([0, 5, 3, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"attn_mask must have shape \(B, N\) = \(1, 9\)"):
        TokenLayout.of(x, torch.ones(1, 8, dtype=torch.bool))


def test_views():
    packed = TokenLayout.of(torch.randn(1, 9, 4), cu_seqlens=CU)
    assert packed.lengths == [3, 0, 5, 1] and packed.longest == 5 and packed.packed
    assert packed.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0]]
    assert packed.packing.mask.sum(dim=1).tolist() == [3, 0, 5, 1]
    assert packed.padded().mask is packed.packing.mask and packed.padded().longest == 5
    assert packed.positions is packed.positions  # kept, not rebuilt
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # 0/1 integers, as transformers passes them
    padded = TokenLayout.of(torch.randn(2, 5, 4), mask)
    assert padded.mask.dtype == torch.bool and padded.longest == 5 and padded.real.tolist() == [3, 5]
    assert padded.positions.tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    dense = TokenLayout.of(torch.randn(2, 5, 4))
    assert dense.longest == 5 and dense.positions.shape == (2, 5) and not dense.packed


@pytest.mark.parametrize("op", [tssa, causal_tssa])
def test_ops_given_a_layout_equal_the_raw_arguments(op):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1, 2, 9, 3, generator=g, dtype=torch.float64)
    layout = TokenLayout.of(w, cu_seqlens=CU, token_dim=2)
    torch.testing.assert_close(op(w, 1.0, layout=layout), op(w, 1.0, cu_seqlens=CU))
    mask = torch.rand(2, 9, generator=g) > 0.3
    mask[:, -1] = True
    w2 = torch.randn(2, 2, 9, 3, generator=g, dtype=torch.float64)
    torch.testing.assert_close(op(w2, 1.0, layout=TokenLayout.of(w2, mask, token_dim=2)), op(w2, 1.0, attn_mask=mask))
    with pytest.raises(ValueError, match="pass either layout or attn_mask / cu_seqlens / group"):
        op(w, 1.0, cu_seqlens=CU, layout=layout)
    with pytest.raises(ValueError, match="layout describes 1 sequences of 9 tokens, w has 2 of 9"):
        op(w2, 1.0, layout=layout)
    with pytest.raises(TypeError, match="layout must be a TokenLayout"):
        op(w, 1.0, layout=CU)


def test_layers_given_a_layout_read_nothing_again():
    """The layers trust a model's layout: the same outputs, and no host read of cu_seqlens."""
    torch.manual_seed(0)
    layers = [CausalTSSA(8, num_heads=2, max_len=16).double(), CausalSelfAttention(8, num_heads=2).double(),
              RotaryCausalAttention(8, 2, 1, 4).double()]
    x = torch.randn(1, 9, 8, dtype=torch.float64)
    layout = TokenLayout.of(x, cu_seqlens=CU)
    assert layout.packing.mask.shape == (4, 5) and layout.longest == 5  # built once, as a model's forward does
    for layer in layers:
        expected = layer(x, cu_seqlens=CU)
        tolist = torch.Tensor.tolist
        reads = []
        torch.Tensor.tolist = lambda t: reads.append(1) or tolist(t)
        try:
            out = layer(x, layout=layout)
        finally:
            torch.Tensor.tolist = tolist
        torch.testing.assert_close(out, expected)
        assert not reads, type(layer).__name__
        with pytest.raises(ValueError, match="pass either layout or attn_mask"):
            layer(x, torch.ones(1, 9, dtype=torch.bool), layout=layout)


@pytest.mark.parametrize("reduce", ["sum", "amax", "max_abs"])
def test_segment_reductions_equal_each_document_alone(reduce):
    from whiteformer.ops import layout

    x = torch.randn(3, int(CU[-1]), 5, dtype=torch.float64)
    x[1, 4, 2] = -1e30  # a large negative value: max |x| is not amax
    seg = layout.segments(CU, (CU[1:] - CU[:-1]).tolist(), x.device)
    got = getattr(layout, f"segment_{reduce}")(x.abs() if reduce == "amax" else x, seg)
    for s in range(len(CU) - 1):
        doc = x[:, int(CU[s]):int(CU[s + 1])]
        if reduce == "sum":
            want = doc.sum(1)
        else:  # 0 for the empty document
            want = doc.abs().amax(1) if doc.shape[1] else torch.zeros(3, 5, dtype=x.dtype)
        assert torch.equal(got[:, s], want), (reduce, s)
