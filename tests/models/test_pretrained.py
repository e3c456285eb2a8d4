"""create_model(pretrained=True): weights named by pretrained_cfg (file, hf_hub_id), read offline
from a Hugging Face cache laid out as huggingface_hub lays it out, through the real huggingface_hub."""
import hashlib
import json
import os
import sys

import pytest
import torch

from test_checkpoint import TINY, _official_forward, _official_state_dict, _randomise
from whiteformer import create_model
from whiteformer.models.pretrained import NoPretrainedWeights
from whiteformer.models.registry import MODELS

constants = pytest.importorskip("huggingface_hub.constants")

SMALL = dict(img_size=32, patch_size=4, depth=2, num_classes=3, embed_dim=32, num_heads=4)
REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hub cache, offline (huggingface_hub reads both constants at each call)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def lay_out(cache, repo_id: str, files: dict) -> None:
    """Put ``files`` (name -> bytes) in the cache as a download of ``repo_id`` at ``main`` leaves them:
    blobs named by their hash, snapshots/REV/ links to them, refs/main naming REV."""
    root = cache / ("models--" + repo_id.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(REV)
    (root / "blobs").mkdir()
    snap = root / "snapshots" / REV
    snap.mkdir(parents=True)
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        (root / "blobs" / blob).write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), snap / name)


def _saved(tmp_path, name="tost_t12_p16", **kw):
    model = _randomise(create_model(name, **{**SMALL, **kw})).eval()
    model.save_pretrained(tmp_path / "saved")
    return model, tmp_path / "saved"


def _same_logits(a, b, shape=(2, 3, 32, 32)):
    x = torch.randn(shape)
    with torch.no_grad():
        torch.testing.assert_close(a.eval()(x), b.eval()(x), rtol=0, atol=0)


def test_hub_repository_from_the_offline_cache(tmp_path, hub_cache):
    model, saved = _saved(tmp_path)
    lay_out(hub_cache, "org/tiny-tost", {f: (saved / f).read_bytes() for f in ("model.safetensors", "config.json")})
    # the sizes come from the repository's config.json, as from a saved folder
    got = create_model("tost_t12_p16", pretrained=True, pretrained_cfg_overlay=dict(hf_hub_id="org/tiny-tost"))
    _same_logits(model, got)
    assert got.pretrained_cfg["hf_hub_id"] == "org/tiny-tost"
    # another number of classes: the head is fresh, the rest loaded (timm)
    five = create_model("tost_t12_p16", num_classes=5, pretrained=True,
                        pretrained_cfg_overlay=dict(hf_hub_id="org/tiny-tost"))
    assert five.head.weight.shape[0] == 5
    own, ref = five.state_dict(), model.state_dict()
    assert all(torch.equal(own[k], ref[k]) for k in own if not k.startswith("head."))


def test_registered_pretrained_cfg_names_the_weights(tmp_path, hub_cache):
    model, saved = _saved(tmp_path)
    lay_out(hub_cache, "org/published", {"model.safetensors": (saved / "model.safetensors").read_bytes()})
    entry = MODELS["tost_t12_p16"]
    MODELS.register("tost_published_test", entry, pretrained_cfg=dict(hf_hub_id="org/published"))
    try:
        # only the weights file: the sizes are the caller's
        got = create_model("tost_published_test", pretrained=True, **SMALL)
    finally:
        del MODELS["tost_published_test"]
    _same_logits(model, got)


def test_local_file_overlay(tmp_path):
    model, saved = _saved(tmp_path)
    got = create_model("tost_t12_p16", pretrained=True,
                       pretrained_cfg_overlay=dict(file=str(saved / "model.safetensors")), **SMALL)
    _same_logits(model, got)
    folder = create_model("tost_t12_p16", pretrained=True, pretrained_cfg_overlay=dict(file=str(saved)))
    _same_logits(model, folder)


def test_a_file_overlay_takes_the_sizes_of_the_config_beside_it(tmp_path):
    """pretrained_cfg_overlay=dict(file=".../model.safetensors") (the form docs/timm.md shows) of a
    saved model of another size than the default failed with "missing keys (132) ... mismatched shapes
    (12)": the config.json beside the file was not read. The caller's arguments still win."""
    from whiteformer import from_pretrained

    model, saved = _saved(tmp_path)  # SMALL sizes, not tost_t12_p16's defaults
    weights = saved / "model.safetensors"
    got = create_model("tost_t12_p16", pretrained=True, pretrained_cfg_overlay=dict(file=str(weights)))
    _same_logits(model, got)
    _same_logits(model, create_model("tost_t12_p16", checkpoint_path=weights))
    _same_logits(model, from_pretrained(weights))
    five = create_model("tost_t12_p16", num_classes=5, drop_path_rate=0.1, pretrained=True,
                        pretrained_cfg_overlay=dict(file=str(weights)))
    assert five.head.weight.shape[0] == 5 and five.init_kwargs["drop_path_rate"] == 0.1
    own, ref = five.state_dict(), model.state_dict()
    assert all(torch.equal(own[k], ref[k]) for k in own if not k.startswith("head."))
    with pytest.raises(ValueError, match="was saved from model 'tost_t12_p16'"):
        create_model("tost_s12_p16", pretrained=True, pretrained_cfg_overlay=dict(file=str(weights)))
    # a config.json beside the file that describes no model is not the file's: the sizes are the caller's
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_bytes(weights.read_bytes())
    for text in ('{"hello": 1}', "not json", '{"init_kwargs": 3}'):
        (other / "config.json").write_text(text)
        _same_logits(model, create_model("tost_t12_p16", checkpoint_path=other / "model.safetensors", **SMALL))


def test_official_tost_pth_goes_through_the_converter(tmp_path):
    sd = _official_state_dict()
    torch.save({"model": sd}, tmp_path / "official.pth")
    got = create_model("tost_t12_p16", pretrained=True, pretrained_cfg_overlay=dict(file=str(tmp_path / "official.pth")),
                       **TINY).eval()
    x = torch.randn(2, 3, TINY["img_size"], TINY["img_size"])
    with torch.no_grad():
        torch.testing.assert_close(got(x), _official_forward(sd, x), rtol=1e-5, atol=1e-5)


def test_timm_deit_repository(tmp_path, hub_cache):
    # timm's Hub layout: its own config.json (architecture, num_classes, pretrained_cfg) + timm-keyed weights
    from safetensors.torch import save as save_bytes

    args = dict(img_size=28, patch_size=4, in_chans=1, num_classes=10, depth=2)
    ref = _randomise(create_model("deit_t_p16", **args)).eval()
    timm_cfg = b'{"architecture": "deit_tiny_patch16_224", "num_classes": 10, "pretrained_cfg": {"tag": "fb_in1k"}}'
    lay_out(hub_cache, "timm/deit-tiny", {"model.safetensors": save_bytes(ref.state_dict()),
                                          "config.json": timm_cfg})
    got = create_model("deit_t_p16", pretrained=True, pretrained_cfg_overlay=dict(hf_hub_id="timm/deit-tiny"), **args)
    _same_logits(ref, got, (2, 1, 28, 28))


def test_no_published_weights_says_how_to_load_a_file():
    with pytest.raises(NoPretrainedWeights, match=r"no pretrained weights are published for 'tost_t12_p16'.*file="):
        create_model("tost_t12_p16", pretrained=True)
    with pytest.raises(ValueError, match="no pretrained weights are published"):  # language models too
        create_model("tost_lm_base", pretrained=True)


def test_argument_errors(tmp_path, hub_cache):
    with pytest.raises(TypeError, match="pretrained must be a bool"):
        create_model("tost_t12_p16", pretrained="yes")
    with pytest.raises(TypeError, match="pretrained_cfg_overlay must be a dict"):
        create_model("tost_t12_p16", pretrained=True, pretrained_cfg_overlay="org/name")
    with pytest.raises(TypeError, match=r"pretrained_cfg\['file'\] must be a str, got int"):
        create_model("tost_t12_p16", pretrained=True, pretrained_cfg_overlay=dict(file=3))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        create_model("tost_t12_p16", pretrained=True, pretrained_cfg_overlay=dict(file=str(tmp_path / "nope.pth")))
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE"):  # not in the cache, and offline
        create_model("tost_t12_p16", pretrained=True, pretrained_cfg_overlay=dict(hf_hub_id="org/absent"))
    with pytest.raises(ValueError, match="not both"):
        create_model("tost_t12_p16", pretrained=True, checkpoint_path=str(tmp_path),
                     pretrained_cfg_overlay=dict(file=str(tmp_path)))


def test_missing_huggingface_hub_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ImportError, match=r"pip install 'whiteformer\[hf\]'"):
        create_model("tost_t12_p16", pretrained=True, pretrained_cfg_overlay=dict(hf_hub_id="org/name"))


def test_save_pretrained_writes_timm_fields_and_a_model_card(tmp_path):
    model, saved = _saved(tmp_path)
    cfg = json.loads((saved / "config.json").read_text())
    assert cfg["architecture"] == "tost_t12_p16" and cfg["num_classes"] == 3
    assert cfg["model_args"] == cfg["init_kwargs"] and cfg["model_args"]["embed_dim"] == 32
    assert cfg["pretrained_cfg"]["input_size"] == [3, 32, 32] and cfg["pretrained_cfg"]["num_classes"] == 3
    card = (saved / "README.md").read_text()
    front = card.split("---")[1]
    assert "library_name: whiteformer" in front and "pipeline_tag: image-classification" in front
    assert "Token Statistics Transformer" in card and "arXiv:2412.17810" in card and "Ziyang Wu" in card
    # a later save replaces its own card; a README of the user's is kept
    model.save_pretrained(saved)
    assert (saved / "README.md").read_text() == card
    (saved / "README.md").write_text("my notes\n")
    model.save_pretrained(saved)
    assert (saved / "README.md").read_text() == "my notes\n"


def test_dmst_card_cites_its_paper(tmp_path):
    _, saved = _saved(tmp_path, "dmst_t12_p16")
    assert "arXiv:2601.17042" in (saved / "README.md").read_text()
