"""Device hygiene: every registered model builds on the ``meta`` device (no
hard-coded CPU tensors, no ``.item()`` at construction), and the image models also run their
forward there. Token models check that their ids are in the vocabulary, which needs values, so
their forward is not run on meta."""
import pytest
import torch

from whiteformer import create_model, list_models


@pytest.mark.parametrize("name", list_models())
def test_every_registered_model_builds_on_meta(name):
    with torch.device("meta"):
        model = create_model(name)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(b.device.type == "meta" for b in model.buffers())
    if hasattr(model, "vocab_size"):
        return  # token-id range check reads values: not possible on meta
    x = torch.zeros(1, 3, 224, 224, device="meta")
    out = model(x)
    assert out.device.type == "meta" and out.shape == (1, 1000)


@pytest.mark.parametrize("name, kwargs", [("tost_t12_p16", dict(img_size=32, patch_size=16, depth=5)),
                                          ("gpt_base", dict(depth=3, dim=32, num_heads=2, vocab_size=64,
                                                            max_len=16))])
def test_create_model_counts_parameters_on_one_meta_build(name, kwargs, monkeypatch):
    """The size check counts parameters on the meta device once: create_model builds the model twice
    in all (once on meta, once for real), whatever the depth; the count is the real model's."""
    from whiteformer.models.registry import model_class

    cls = model_class(name)
    builds, counts = [], []
    init = cls.__init__

    def spy(self, *args, **kw):
        builds.append(torch.empty(0).device.type)
        init(self, *args, **kw)

    monkeypatch.setattr(cls, "__init__", spy)
    import whiteformer.models.registry as registry

    check = registry.check_model_size
    monkeypatch.setattr(registry, "check_model_size", lambda *a: (counts.append(a[2]), check(*a)))
    model = create_model(name, **kwargs)
    assert builds == ["meta", "cpu"]
    assert counts[-1] == sum(p.numel() for p in model.parameters())
