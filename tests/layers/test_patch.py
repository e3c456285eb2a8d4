"""whiteformer.layers helpers no other test names: PatchGrid (patch geometry, image check),
to_2tuple, ConvPatchEmbed's sizes and feature_take_indices (timm's block selection)."""
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


def test_sizes_and_images_of_other_shapes_are_named():
    from whiteformer.layers import ConvPatchEmbed, to_2tuple

    assert to_2tuple(4, "patch_size") == (4, 4) and to_2tuple([2, 3], "img_size") == (2, 3)
    with pytest.raises(TypeError, match=r"img_size must be an int or a pair of ints, got \(1, 2, 3\)"):
        to_2tuple((1, 2, 3), "img_size")
    with pytest.raises(ValueError, match=r"patch_size must be positive, got \(0, 4\)"):
        to_2tuple((0, 4), "patch_size")
    dyn = PatchGrid(img_size=16, patch_size=8, in_chans=1, dynamic_img_size=True)
    assert dyn.input_grid(torch.zeros(1, 1, 24, 40)) == (3, 5)
    with pytest.raises(ValueError, match=r"x's height and width must be positive multiples of patch_size \(8, 8\)"):
        dyn.input_grid(torch.zeros(1, 1, 20, 16))
    with pytest.raises(ValueError, match="embed_dim must be a positive multiple of 8 for patch_size 16"):
        ConvPatchEmbed(img_size=32, patch_size=16, in_chans=1, embed_dim=20)
