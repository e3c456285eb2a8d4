"""normalize_ranks: per-head ranks of the compressed layers from an int or one int per head."""
import pytest
import torch

from whiteformer.compress.ranks import normalize_ranks


def test_an_int_is_every_head_and_a_sequence_is_one_per_head():
    assert normalize_ranks(3, 4, 8) == (3, 3, 3, 3)
    assert normalize_ranks([0, 2, 8], 3, 8) == (0, 2, 8)
    assert normalize_ranks(torch.tensor([1, 2]), 2, 4, "qk_rank") == (1, 2)


def test_bad_ranks_are_refused_naming_the_argument():
    with pytest.raises(TypeError, match="vo_ranks must be an int or a sequence of ints, got bool"):
        normalize_ranks(True, 2, 4, "vo_ranks")
    with pytest.raises(TypeError, match="ranks must be an int or a sequence of 2 ints, got str"):
        normalize_ranks("2", 2, 4)
    with pytest.raises(ValueError, match=r"ranks must have one rank per head \(3\), got 2"):
        normalize_ranks([1, 2], 3, 4)
    with pytest.raises(ValueError, match=r"ranks out of range: each rank must be in \[0, 4\], got \(1, 5\)"):
        normalize_ranks([1, 5], 2, 4)
    with pytest.raises(ValueError, match=r"qk_rank out of range: each rank must be in \[1, 4\], got \(0, 2\)"):
        normalize_ranks([0, 2], 2, 4, "qk_rank", allow_zero=False)
    with pytest.raises(ValueError, match="ranks must not all be zero"):
        normalize_ranks(0, 3, 4)


@pytest.mark.parametrize("ranks", [[2.5, 3], (2, 3.0), torch.tensor([2.5, 3.0]), [True, 2], torch.tensor([True, False])])
def test_non_integer_ranks_are_refused_not_truncated(ranks):
    with pytest.raises(TypeError, match=r"ranks must hold ints \(one rank per head\)"):
        normalize_ranks(ranks, 2, 4)
