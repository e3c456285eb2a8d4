"""whiteformer.layers helpers no other test names: PatchGrid (patch geometry, image check) and
feature_take_indices (timm's block selection)."""
import pytest
import torch

from whiteformer.layers import PatchGrid, feature_take_indices


def test_patch_grid_geometry_and_image_check():
    g = PatchGrid(img_size=(32, 48), patch_size=8, in_chans=1)
    assert g.grid_size == (4, 6) and g.num_patches == 24 and g.patch_size == (8, 8)
    g.check_images(torch.zeros(2, 1, 32, 48))
    with pytest.raises(ValueError, match=r"x must have shape \(B, 1, 32, 48\)"):
        g.check_images(torch.zeros(2, 3, 32, 48))
    with pytest.raises(ValueError, match="non-empty"):
        g.check_images(torch.zeros(0, 1, 32, 48))
    with pytest.raises(ValueError, match="divisible by patch_size"):
        PatchGrid(img_size=30, patch_size=8)
    with pytest.raises(ValueError, match="in_chans must be a positive int"):
        PatchGrid(img_size=32, patch_size=8, in_chans=0)


def test_feature_take_indices_as_timm():
    assert feature_take_indices(4) == ([0, 1, 2, 3], 3)
    assert feature_take_indices(4, 2) == ([2, 3], 3)  # the last n blocks
    assert feature_take_indices(4, [-1, 0, 0]) == ([0, 3], 3)  # negative ok, sorted, once each
    with pytest.raises(ValueError, match=r"must be in \[1, 4\]"):
        feature_take_indices(4, 5)
    with pytest.raises(ValueError, match="block index 4 is out of range for 4 blocks"):
        feature_take_indices(4, [4])
    with pytest.raises(TypeError, match="must be ints"):
        feature_take_indices(4, [1.0])
