"""Model sizes and hyper-parameters from untrusted places (``create_model`` arguments, a
``config.json``, a transformers configuration) are checked before anything is built: sizes against
the bounds of ``whiteformer.models.size`` (an arithmetic parameter estimate), non-finite or
non-positive hyper-parameters with a ValueError naming the argument."""
import json
import math

import pytest
import torch
import torch.nn as nn

from whiteformer import ops
from whiteformer.models import create_model, from_pretrained, list_models, registry, size

TINY_VISION = dict(img_size=16, patch_size=8, depth=1, embed_dim=32, num_heads=4, num_classes=3)
TINY_LM = dict(vocab_size=61, dim=32, depth=1, num_heads=4, max_len=16)


def _refuse_building(monkeypatch):
    """Fail if a layer holding parameters is constructed with memory (on the meta device, which
    allocates nothing, the size check counts them): the bounds must act before building."""
    for cls in (nn.Linear, nn.Conv2d, nn.Embedding, nn.LayerNorm):
        def refuse(self, *args, _init=cls.__init__, **kwargs):
            if torch.get_default_device().type != "meta":
                raise AssertionError(f"{type(self).__name__} was built before the size check")
            _init(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", refuse)


@pytest.fixture
def nothing_built(monkeypatch):
    _refuse_building(monkeypatch)


# ----------------------------------------------------------------------------- item 8: size bounds


@pytest.mark.parametrize("name, over, match", [
    ("deit_t_p16", dict(depth=10**9), "blocks"),
    ("tost_t12_p16", dict(cls_attn_layers=10**6), "blocks"),
    ("deit_t_p16", dict(embed_dim=2**20, num_heads=1), "parameters"),
    ("deit_t_p16", dict(img_size=2**20), "parameters"),
    ("crate_t", dict(embed_dim=2**18, num_heads=2**10), "parameters"),
    ("gpt_base", dict(vocab_size=10**12), "parameters"),
    ("tost_lm_base", dict(max_len=10**10), "parameters"),
    ("tost_lm_base", dict(dim=2**20, num_heads=4), "parameters"),
    ("tost_lra_text", dict(max_len=10**12), "parameters"),
    ("tost_t12_p16", dict(embed_dim=2**20, num_heads=1, mlp_ratio=4.0), "parameters"),
    ("tost_t12_p16", dict(in_chans=10**10), "parameters"),
    ("deit_t_p16", dict(num_classes=10**9), "parameters"),
    ("gpt_base", dict(dim=2**3000, num_heads=1), "parameters"),  # overflows float: still refused
])
def test_oversized_models_are_refused_before_building(nothing_built, name, over, match):
    with pytest.raises(ValueError, match=match):
        create_model(name, **over)


def test_oversized_config_json_is_refused_before_building(tmp_path, monkeypatch):
    model = create_model("tost_t12_p16", **TINY_VISION)
    model.save_pretrained(tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for key, value, match in (("depth", 200000, "blocks"), ("embed_dim", 2**20, "parameters")):
        bad = {**cfg, "init_kwargs": {**cfg["init_kwargs"], key: value, "num_heads": 1}}
        cfg_path.write_text(json.dumps(bad))
        with monkeypatch.context() as m:
            _refuse_building(m)
            with pytest.raises(ValueError, match=match):
                from_pretrained(tmp_path / "m")


def test_hf_config_with_huge_width_is_refused_before_allocation(nothing_built):
    transformers = pytest.importorskip("transformers")
    import whiteformer.hf  # noqa: F401  (registers the Auto classes)

    config = transformers.AutoConfig.for_model("whiteformer-tost-lm", model_name="tost_lm_base",
                                               init_kwargs={**TINY_LM, "dim": 2**20, "num_heads": 4})
    with pytest.raises(ValueError, match="parameters"):
        transformers.AutoModelForCausalLM.from_config(config)


def test_limits_follow_the_environment(monkeypatch):
    monkeypatch.setenv("WHITEFORMER_MAX_PARAMS", "1000")
    with pytest.raises(ValueError, match="WHITEFORMER_MAX_PARAMS"):
        create_model("deit_t_p16", **TINY_VISION)
    monkeypatch.setenv("WHITEFORMER_MAX_PARAMS", "lots")
    with pytest.raises(ValueError, match="WHITEFORMER_MAX_PARAMS"):
        create_model("deit_t_p16", **TINY_VISION)
    monkeypatch.delenv("WHITEFORMER_MAX_PARAMS")
    monkeypatch.setenv("WHITEFORMER_MAX_DEPTH", "2")
    with pytest.raises(ValueError, match="WHITEFORMER_MAX_DEPTH"):
        create_model("deit_t_p16", **{**TINY_VISION, "depth": 3})
    assert len(create_model("deit_t_p16", **{**TINY_VISION, "depth": 2}).blocks) == 2


def test_estimate_matches_the_built_models(monkeypatch):
    """The count the size check uses (from one- and two-block builds) is the real parameter count
    of every registered model (built whole on the meta device here), so the bound means what it says."""
    seen = {}
    check = registry.check_model_size

    def spy(model, args, estimate, depth_keys):
        seen["estimate"] = estimate
        check(model, args, estimate, depth_keys)

    monkeypatch.setattr(registry, "check_model_size", spy)
    for name in list_models():
        with torch.device("meta"):
            model = create_model(name)
        actual = sum(p.numel() for p in model.parameters())
        assert seen["estimate"] == actual, (name, seen["estimate"], actual)


def test_default_limits_admit_every_registered_model():
    assert size.max_params() == size.MAX_PARAMS and size.max_depth() == size.MAX_DEPTH
    assert size.MAX_PARAMS >= 10**9 and size.MAX_DEPTH >= 48


# ----------------------------------------------------------------------------- item 11: hyper-parameters


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("name, arg, kw", [
    ("tost_t12_p16", "eta", TINY_VISION),
    ("xcit_s12_p16", "eta", TINY_VISION),
    ("dmst_t12_p16", "eta", TINY_VISION),
    ("eca_t", "eta", TINY_VISION),
    ("crate_t", "eta", TINY_VISION),
    ("crate_t", "lambd", TINY_VISION),
    ("deit_t_p16", "init_values", TINY_VISION),
    ("tost_lm_base", "init_values", TINY_LM),
    ("gpt_base", "init_values", TINY_LM),
])
def test_nonfinite_hyperparameters_are_refused(name, arg, kw, value):
    with pytest.raises(ValueError, match=arg):
        create_model(name, **{**kw, arg: value})


@pytest.mark.parametrize("value", [-1, 0, math.nan, math.inf])
@pytest.mark.parametrize("name, kw", [("tost_t12_p16", TINY_VISION), ("deit_t_p16", TINY_VISION),
                                      ("eca_t", TINY_VISION), ("tost_lm_base", TINY_LM), ("gpt_base", TINY_LM)])
def test_bad_mlp_ratio_is_refused(name, kw, value):
    with pytest.raises(ValueError, match="mlp_ratio"):
        create_model(name, **{**kw, "mlp_ratio": value})


@pytest.mark.parametrize("arg, value", [("eta", "NaN"), ("eta", "Infinity"), ("mlp_ratio", "-1")])
def test_bad_hyperparameters_in_config_json(tmp_path, arg, value):
    create_model("tost_t12_p16", **TINY_VISION).save_pretrained(tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    text = cfg_path.read_text()
    cfg = json.loads(text)
    cfg["init_kwargs"][arg] = "@@"
    cfg_path.write_text(json.dumps(cfg).replace('"@@"', value))  # json's NaN / Infinity literals
    with pytest.raises(ValueError, match=arg):
        from_pretrained(tmp_path / "m")


@pytest.mark.parametrize("temp", [math.nan, math.inf, torch.full((2, 1), math.nan), torch.tensor([[1.0], [math.inf]])])
def test_nonfinite_tssa_temperature_is_refused(temp):
    w = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match="temp"):
        ops.tssa(w, temp)
    with pytest.raises(ValueError, match="temp"):
        ops.causal_tssa(w, temp)
    with pytest.raises(ValueError, match="temp"):
        ops.causal_tssa_step(w[:, :, 0], None, temp)


def test_tssa_accepts_a_number_as_temperature():
    w = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    torch.testing.assert_close(ops.tssa(w, 0.5), ops.tssa(w, torch.full((2, 1), 0.5, dtype=torch.float64)))
    torch.testing.assert_close(ops.causal_tssa(w, 2.0),
                               ops.causal_tssa(w, torch.full((2, 1), 2.0, dtype=torch.float64)))


def test_nonfinite_xca_temperature_is_refused():
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match="temperature"):
        ops.xca(q, q, q, math.nan)


@pytest.mark.parametrize("entry, match", [
    ({"attn": {"type": "cp_slimatt", "rank": 10**9}}, "rank out of range"),
    ({"mlp": {"fc1_rank": 10**9, "fc2_rank": 4}}, "rank out of range"),
])
def test_compression_spec_ranks_in_config_json_are_bounded(tmp_path, monkeypatch, entry, match):
    """A compressed checkpoint's config.json rebuilds its layers from the recorded ranks: a rank
    beyond what the layer can use (CP R > H p, an SVD rank > min(in, out)) is refused before any
    (huge) layer is built."""
    model = create_model("deit_t_p16", **TINY_VISION)
    model.save_pretrained(tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    attn = {"dim": 32, "num_heads": 4, "vo_ranks": [8] * 4, "qk_bias": True, "proj_bias": True}
    if "attn" in entry:
        entry = {"attn": {**attn, **entry["attn"]}}
    cfg["init_kwargs"]["compression"] = {"format": 1, "blocks": [entry]}
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        from_pretrained(tmp_path / "m")


def test_hf_config_json_with_a_huge_class_count_meets_the_size_check(tmp_path):
    """A huge init_kwargs num_classes in a config.json is refused by the size check, before transformers
    builds a label map with an entry per class (a MemoryError, or the process killed)."""
    transformers = pytest.importorskip("transformers")
    import whiteformer.hf  # noqa: F401  (registers the Auto classes)

    auto = transformers.AutoModelForImageClassification
    config = transformers.AutoConfig.for_model("whiteformer-vision", model_name="deit_t_p16", init_kwargs=TINY_VISION)
    auto.from_config(config).save_pretrained(tmp_path)
    data = {k: v for k, v in json.loads((tmp_path / "config.json").read_text()).items()
            if k not in ("id2label", "label2id")}
    (tmp_path / "config.json").write_text(json.dumps({**data, "init_kwargs": {**data["init_kwargs"], "num_classes": 10**12}}))
    with pytest.raises(ValueError, match="parameters"):
        auto.from_pretrained(tmp_path)
