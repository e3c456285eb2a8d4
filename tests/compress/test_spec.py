"""CompressSpec: compress()'s options checked once, passed down and recorded in the saved model."""
import dataclasses
import json

import pytest
import torch

from whiteformer.compress import CompressSpec, compress, compression_spec
from whiteformer.models import create_model


def tiny(**kw):
    cfg = dict(img_size=32, patch_size=8, in_chans=3, num_classes=5, depth=2, embed_dim=48, num_heads=3)
    cfg.update(kw)
    return create_model("deit_t_p16", **cfg).eval()


def images(n=2):
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def test_the_spec_is_frozen_normalised_and_json():
    spec = CompressSpec(qk="truncatt", qk_rank=[4, 4, 8], vo_rank=[2, 2, 2], mlp_rank=[8, 4], blocks=1,
                        cp_kwargs={"n_iter_max": 3})
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.qk_rank = 2
    assert spec.qk_rank == (4, 4, 8) and spec.vo_rank == (2, 2, 2) and spec.mlp_rank == (8, 4)
    assert spec.blocks == (1,)
    assert CompressSpec(qk="none", vo_rank=4).qk is None
    d = json.loads(json.dumps(spec.to_dict()))
    assert set(d) == set(CompressSpec.option_names())
    assert CompressSpec(**d) == spec  # what a saved model records rebuilds the same spec


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(qk="svd", qk_rank=4), ValueError, "qk must be one of"),
    (dict(qk="irratt", qk_rank=8, qk_flops_ratio=0.5), ValueError, "exactly one of qk_rank and qk_flops_ratio"),
    (dict(qk="irratt"), ValueError, "exactly one of qk_rank and qk_flops_ratio"),
    (dict(qk="truncatt", qk_flops_ratio=1.5), ValueError, "qk_flops_ratio must be a number in"),
    (dict(qk="truncatt", qk_rank=4, vo=None, vo_rank=4), ValueError, "vo=None"),
    (dict(qk="truncatt", qk_rank=4, vo="cp"), ValueError, "vo must be"),
    (dict(qk="truncatt", qk_rank="4"), TypeError, "qk_rank must be an int"),
    (dict(qk="truncatt", qk_rank=4, blocks=[]), ValueError, "blocks must not be empty"),
    (dict(qk="truncatt", qk_rank=4, num_tokens=0), ValueError, "num_tokens must be a positive integer"),
    (dict(qk="truncatt", qk_rank=4, seed=-1), ValueError, "seed must be a non-negative integer"),
    (dict(qk="truncatt", qk_rank=4, cp_kwargs=[1]), TypeError, "cp_kwargs must be a dict"),
    (dict(qk="truncatt", qk_rank=4, latency_batch=1, latency_runs=0), ValueError, "latency_runs must be"),
])
def test_each_option_check_runs_at_construction_and_in_compress(kwargs, error, match):
    with pytest.raises(error, match=match):
        CompressSpec(**kwargs)
    with pytest.raises(error, match=match):  # before the model is even looked at
        compress(torch.nn.Identity(), **kwargs)


def test_compress_refuses_a_spec_that_compresses_nothing():
    spec = CompressSpec(qk=None)  # compress_attention(qk=None) converts a block exactly; compress() refuses it
    with pytest.raises(ValueError, match="nothing to compress"):
        compress(torch.nn.Identity(), spec=spec)


def test_spec_argument_equals_the_keyword_arguments():
    model = tiny()
    kw = dict(qk="truncatt", qk_rank=(4, 8, 12), vo_rank=8, blocks=[0], progress=False)
    a, rep_a = compress(model, **kw)
    b, rep_b = compress(model, spec=CompressSpec(**kw))
    assert rep_a.config == rep_b.config
    x = images()
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
    with pytest.raises(ValueError, match="not both .*qk_rank"):
        compress(model, qk_rank=4, spec=CompressSpec(**kw))
    with pytest.raises(TypeError, match="spec must be a CompressSpec"):
        compress(model, spec=kw)


def test_the_saved_model_records_each_calls_spec(tmp_path):
    first = CompressSpec(qk="truncatt", qk_rank=4, vo_rank=8, blocks=[0], progress=False)
    new, _ = compress(tiny(), spec=first)
    new.save_pretrained(tmp_path / "a")
    loaded = create_model("deit_t_p16", checkpoint_path=str(tmp_path / "a")).eval()
    assert [CompressSpec(**d) for d in compression_spec(loaded)["options"]] == [first]
    second = CompressSpec(qk="irratt", qk_rank=6, fusion="identity", blocks=[1], progress=False)
    more, _ = compress(loaded, spec=second)
    more.save_pretrained(tmp_path / "b")
    last = create_model("deit_t_p16", checkpoint_path=str(tmp_path / "b")).eval()
    assert [CompressSpec(**d) for d in compression_spec(last)["options"]] == [first, second]
    x = images()
    with torch.no_grad():
        assert torch.equal(last(x), more(x))
