import pytest
import torch.nn as nn

from whiteformer.attention import build, list_attention, register_attention
from whiteformer.attention.registry import get_attention_class


def test_unknown_name_raises_with_choices():
    with pytest.raises(ValueError, match="unknown attention"):
        build("no-such-attention", 16, num_heads=2)


def test_register_conflict_raises():
    from whiteformer.attention.registry import ATTENTION

    @register_attention("_test_dummy")
    class Dummy(nn.Module):
        def __init__(self, dim, num_heads=1):
            super().__init__()

    assert "_test_dummy" in list_attention()
    assert get_attention_class("_test_dummy") is Dummy

    try:
        with pytest.raises(ValueError, match="already registered"):

            @register_attention("_test_dummy")
            class Other(nn.Module):
                pass
    finally:
        ATTENTION.pop("_test_dummy", None)
    assert "_test_dummy" not in list_attention()


def test_one_registry_class_behind_every_extension_point():
    """attention, models, datasets, tasks, CLI commands and kernel backends share whiteformer._registry.Registry."""
    from whiteformer._registry import Registry
    from whiteformer.app.cli import ANALYSES, COMMANDS
    from whiteformer.app.data import DATASETS
    from whiteformer.app.train.tasks import TASKS
    from whiteformer.attention.registry import ATTENTION
    from whiteformer.models.registry import MODELS
    from whiteformer.ops._kernels import BACKENDS

    for reg in (ATTENTION, MODELS, DATASETS, TASKS, COMMANDS, ANALYSES, BACKENDS):
        assert isinstance(reg, Registry) and len(reg) > 0
    for reg, typo, fix in ((ATTENTION, "tsa", "tssa"), (MODELS, "tost_t12_p1", "tost_t12_p16"),
                           (DATASETS, "digit", "digits"), (TASKS, "imag", "image"), (COMMANDS, "trian", "train")):
        with pytest.raises(ValueError, match=f"unknown {reg.kind} '{typo}' \\(did you mean '{fix}'"):
            reg.get(typo)


def test_registry_register_get_list_metadata():
    from whiteformer._registry import Registry

    reg = Registry("widget", choices="{count} known: {names}")

    @reg.register("beta", colour="blue")
    def beta():
        return 2

    reg.register("alpha", len)
    assert reg.get("beta") is beta and reg["alpha"] is len and "alpha" in reg
    assert reg.list() == ["alpha", "beta"] and reg.list("b*") == ["beta"]
    assert reg.metadata("beta") == {"colour": "blue"} and reg.metadata("alpha") == {}
    assert reg.get("gamma", None) is None
    with pytest.raises(ValueError, match=r"unknown widget 'bet' \(did you mean 'beta'\?\); 2 known: alpha, beta"):
        reg.get("bet")
    with pytest.raises(ValueError, match="unknown widget 3"):
        reg.get(3)
    reg.register("beta", beta)  # the same object again is fine
    with pytest.raises(ValueError, match="widget name 'beta' is already registered to beta"):
        reg.register("beta", len)
    with pytest.raises(TypeError, match="non-empty str"):
        reg.register("", len)
    swap = Registry("slot", replace=True)
    swap.register("a", 1)
    swap.register("a", 2)
    assert swap["a"] == 2 and reg.copy().list() == reg.list() and reg.pop("alpha") is len and "alpha" not in reg


@pytest.mark.parametrize("name", [n for n in list_attention() if not n.startswith("_")])
def test_shell_options_are_what_the_layer_takes(name):
    """A model passes a layer exactly the shell options it declares (``shell_options``), so the
    declaration must name each one of qkv_bias / attn_drop / proj_drop its constructor takes."""
    import inspect

    from whiteformer.attention.registry import SHELL_OPTIONS, get_attention_class, shell_options

    params = inspect.signature(get_attention_class(name).__init__).parameters
    assert set(shell_options(name)) == {k for k in SHELL_OPTIONS if k in params}


def test_a_dropout_the_layer_cannot_take_is_refused():
    from whiteformer.models import create_model

    with pytest.raises(ValueError, match=r"attention 'eca' \(ECAttention\) has no 'attn_drop'"):
        create_model("tost_t12_p16", attn="eca", attn_drop_rate=0.1, depth=1, embed_dim=32, num_heads=2)
    m = create_model("tost_t12_p16", attn="eca", depth=1, embed_dim=32, num_heads=2, img_size=32)
    assert type(m.blocks[0].attn).__name__ == "ECAttention"


@pytest.mark.parametrize("name", [n for n in list_attention() if not n.startswith("_")])
def test_returns_pi_is_declared_by_the_layers_that_take_return_pi(name):
    """The white-box tools ask a layer's ``returns_pi`` for memberships; it must match ``forward``."""
    import inspect

    cls = get_attention_class(name)
    assert getattr(cls, "returns_pi", False) == ("return_pi" in inspect.signature(cls.forward).parameters)
