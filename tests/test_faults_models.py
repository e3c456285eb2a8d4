"""Faults in the models / layers / analysis / compression side (issue "Reliability", items 7-9):
each test reproduces a failure that used to pass silently or crash deep inside torch."""
import gc
import json
import warnings

import pytest
import torch
from safetensors.torch import save_file

from whiteformer import create_model
from whiteformer.analysis import coding_rate, layerwise_report
from whiteformer.attention import build, list_attention
from whiteformer.compress import compress
from whiteformer.models.load import load_checkpoint
from whiteformer.models.read import read_state_dict


def _lm(name="tost_lm_base", **kw):
    torch.manual_seed(0)
    return create_model(name, vocab_size=61, dim=32, depth=2, num_heads=4, max_len=64, **kw).eval()


def _deit():
    torch.manual_seed(0)
    return create_model("deit_t_p16", img_size=16, patch_size=8, depth=2, embed_dim=32, num_heads=4,
                        num_classes=3).eval()


# ----------------------------------------------------------------------------- safetensors aliases
def _write(path, tensors, aliases):
    meta = {"format": "pt"}
    if aliases is not None:
        meta["whiteformer_aliases"] = aliases if isinstance(aliases, str) else json.dumps(aliases)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=meta)


def test_alias_between_untied_tensors_is_refused(tmp_path):
    model = _deit()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    del sd["norm.bias"]  # the metadata would silently fill it with another (32,) tensor
    _write(tmp_path / "m.safetensors", sd, {"norm.bias": "blocks.0.norm1.bias"})
    with pytest.raises(ValueError, match="does not tie"):
        load_checkpoint(model, tmp_path / "m.safetensors")


def test_alias_shadowing_a_stored_tensor_is_refused(tmp_path):
    model = _deit()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    _write(tmp_path / "m.safetensors", sd, {"norm.weight": "norm.bias"})  # both stored, different values
    with pytest.raises(ValueError, match="different tensor under that name"):
        read_state_dict(tmp_path / "m.safetensors")


@pytest.mark.parametrize("meta", ["{not json", json.dumps(["a", "b"]), json.dumps({"x": "no.such.key"})])
def test_bad_alias_metadata_gives_a_clear_error(tmp_path, meta):
    model = _deit()
    _write(tmp_path / "m.safetensors", model.state_dict(), meta)
    with pytest.raises(ValueError, match="whiteformer_aliases"):
        read_state_dict(tmp_path / "m.safetensors")


def test_tied_lm_weights_still_round_trip(tmp_path):
    model = _lm()
    model.save_pretrained(tmp_path / "lm")
    again = create_model("tost_lm_base", checkpoint_path=tmp_path / "lm")
    assert again.lm_head.weight.data_ptr() == again.transformer.wte.weight.data_ptr()
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)


# ----------------------------------------------------------------------------- generation
def _live_tensors():
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on some torch module objects warns about deprecations
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


@pytest.mark.parametrize("name", ["tost_lm_base", "gpt_base"])
def test_generate_keeps_no_per_token_tensors(name):
    """The generated tokens go into one preallocated buffer: the number of live tensors does not grow
    with the number of tokens (it grew by one (B, 1) tensor per token before)."""
    model = _lm(name, pos_emb=False, **({"pos_bias": False} if name.startswith("tost") else {}))
    counts = {}
    step = model._step_hidden  # what generate calls per token (its ids are checked once, at its door)

    def counting_step(idx_t, state, states=None):
        counts[state.pos] = _live_tensors()
        return step(idx_t, state, states)

    model._step_hidden = counting_step
    idx = torch.randint(0, 61, (1, 3))
    out = model.generate(idx, 60, temperature=0)
    assert out.shape == (1, 63)
    # ToST's state has a constant size; GPT's KV cache grows inside its two tensors per layer:
    # either way the number of live tensors stays the same from token to token
    assert counts[60] == counts[10], counts


@pytest.mark.parametrize("kw,match", [(dict(temperature=float("nan")), "temperature"),
                                      (dict(temperature=float("inf")), "temperature"),
                                      (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
                                      (dict(top_p=float("nan")), "top_p")])
def test_generate_rejects_bad_sampling_options(kw, match):
    with pytest.raises(ValueError, match=match):
        _lm().generate(torch.randint(0, 61, (1, 3)), 4, **kw)


def test_top_p_keeps_the_nucleus():
    model = _lm()
    idx = torch.randint(0, 61, (1, 3))
    g = torch.Generator().manual_seed(0)
    tiny = model.generate(idx, 8, temperature=1.0, top_p=1e-6, generator=g)  # nucleus = the argmax alone
    assert torch.equal(tiny, model.generate(idx, 8, temperature=0))


# ----------------------------------------------------------------------------- losses and dtypes
def test_lm_loss_with_every_target_ignored_is_zero_with_a_warning():
    model = _lm().train()
    idx = torch.randint(0, 61, (2, 5))
    with pytest.warns(RuntimeWarning, match="ignored"):
        _, loss = model(idx, torch.full_like(idx, -1))
    assert loss.item() == 0.0
    loss.backward()  # still part of the graph
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, loss = model(idx, idx)
    assert torch.isfinite(loss) and loss > 0


@pytest.mark.parametrize("name", ["tssa", "mhsa", "dmsa", "truncatt", "causal_tssa", "xca"])
def test_half_input_to_a_float_layer_names_x_and_both_dtypes(name):
    layer = build(name, 32, num_heads=4)
    x = torch.randn(2, 5, 32, dtype=torch.float16)
    with pytest.raises(TypeError, match=r"x has dtype torch.float16 .* torch.float32"):
        layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts for the matmuls: accepted
        assert layer(x.bfloat16()).shape == x.shape


@pytest.mark.parametrize("name", list_attention())
def test_input_on_another_device_names_x_and_both_devices(name):
    layer = build(name, 32, num_heads=4)  # on the CPU
    with pytest.raises(ValueError, match=r"x is on device meta but the layer's parameters are on cpu"):
        layer(torch.empty(2, 5, 32, device="meta"))
    if hasattr(layer, "step"):  # the causal layers' one-token path as well
        with pytest.raises(ValueError, match=r"x_t is on device meta .* on cpu"):
            layer.step(torch.empty(2, 32, device="meta"))
    with torch.device("meta"):  # a layer on meta with an input on meta: shapes only, no error
        out = build(name, 32, num_heads=4)(torch.empty(2, 5, 32))
    assert (out[0] if isinstance(out, tuple) else out).shape == (2, 5, 32)


# ----------------------------------------------------------------------------- analysis / compression
def test_nan_calibration_is_refused_before_cholesky(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("reached Cholesky")

    monkeypatch.setattr(torch.linalg, "cholesky", boom)
    calib = torch.randn(2, 3, 16, 16)
    calib[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="calib contains NaN"):
        compress(_deit(), qk="truncatt", qk_rank=4, calib=calib)


def test_coding_rate_and_compress_on_meta():
    z = torch.empty(2, 10, 8, device="meta")
    r = coding_rate(z)
    assert r.device.type == "meta" and r.shape == (2,)
    with torch.device("meta"):
        model = create_model("deit_t_p16", img_size=16, patch_size=8, depth=2, embed_dim=32, num_heads=4)
    with pytest.raises(ValueError, match="meta device"):
        compress(model, qk="truncatt", qk_rank=4)


def test_layerwise_report_out_dir_that_is_a_file(tmp_path):
    model = create_model("tost_t12_p16", img_size=16, patch_size=4, depth=1, embed_dim=32, num_heads=4,
                         num_classes=3)
    (tmp_path / "f").write_text("user file")
    with pytest.raises(ValueError, match="not a directory"):
        layerwise_report(model, torch.randn(1, 3, 16, 16), out_dir=tmp_path / "f", plot=False)
    with pytest.raises(ValueError, match="is a file"):
        layerwise_report(model, torch.randn(1, 3, 16, 16), out_dir=tmp_path / "f" / "sub", plot=False)
    assert (tmp_path / "f").read_text() == "user file"
