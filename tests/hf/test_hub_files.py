"""The transformers wrapper's save_pretrained writes what the Hub's two audiences read: transformers'
files and auto_map, timm's config.json fields (architecture, num_classes, model_args, pretrained_cfg)
and the model card; push_to_hub=True uploads the folder once it is complete (the Hub's API is
replaced by a recorder: nothing leaves the machine)."""
import json
import os
from types import SimpleNamespace

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("transformers", reason="needs the hf extra: pip install whiteformer[hf]")

import huggingface_hub  # noqa: E402
from huggingface_hub.errors import EntryNotFoundError  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForImageClassification  # noqa: E402

import whiteformer  # noqa: E402
from whiteformer.hf import ToSTLMConfig, WhiteformerVisionConfig  # noqa: E402

VISION = dict(img_size=32, patch_size=8, num_classes=5, depth=1, embed_dim=32, num_heads=4)
LM = dict(vocab_size=61, dim=32, depth=1, num_heads=4, max_len=64)


def _wrapper(kind):
    torch.manual_seed(0)
    if kind == "vision":
        return AutoModelForImageClassification.from_config(WhiteformerVisionConfig("tost_t12_p16", VISION)).eval()
    return AutoModelForCausalLM.from_config(ToSTLMConfig("tost_lm_base", LM)).eval()


@pytest.mark.parametrize("kind", ["vision", "lm"])
def test_wrapper_save_writes_timm_fields_and_a_model_card(kind, tmp_path):
    model = _wrapper(kind)
    out = tmp_path / kind
    model.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    net = model.whiteformer
    assert cfg["architecture"] == net.model_name == cfg["model_name"]
    assert cfg["model_args"] == cfg["init_kwargs"] == json.loads(json.dumps(net.init_kwargs))
    assert cfg["architectures"] == [type(model).__name__] and "AutoConfig" in cfg["auto_map"]  # transformers' too
    if kind == "vision":  # (timm's fields of an image classifier; a language model has no pretrained_cfg)
        assert cfg["num_classes"] == 5 and cfg["pretrained_cfg"]["input_size"] == [3, 32, 32]
        assert cfg["pretrained_cfg"]["architecture"] == net.model_name
    card = (out / "README.md").read_text()
    front = card.split("---")[1]
    assert "library_name: whiteformer" in front
    assert ("pipeline_tag: image-classification" if kind == "vision" else "pipeline_tag: text-generation") in front
    assert "Token Statistics Transformer" in card and "arXiv:2412.17810" in card
    auto = "AutoModelForImageClassification" if kind == "vision" else "AutoModelForCausalLM"
    assert f"{auto}.from_pretrained(" in card and "trust_remote_code=True" in card
    net.save_pretrained(tmp_path / "own")  # the zoo's own save writes the same card
    assert (tmp_path / "own" / "README.md").read_text() == card
    # the same folder loads back both ways, with the same outputs
    x = torch.randn(2, 3, 32, 32) if kind == "vision" else torch.randint(0, 61, (2, 7))
    back = type(model).from_pretrained(out).eval()
    own = whiteformer.from_pretrained(out).eval()
    with torch.no_grad():
        want = net(x)
        want = want[0] if isinstance(want, tuple) else want
        got = own(x)
        torch.testing.assert_close(got[0] if isinstance(got, tuple) else got, want, rtol=0, atol=0)
        torch.testing.assert_close(back(x).logits[:, -1] if kind == "lm" else back(x).logits,
                                   want[:, -1] if kind == "lm" else want, rtol=0, atol=0)
    # a later save replaces its own card; a README of the user's is kept
    model.save_pretrained(out)
    assert (out / "README.md").read_text() == card
    (out / "README.md").write_text("my notes\n")
    model.save_pretrained(out)
    assert (out / "README.md").read_text() == "my notes\n"
    assert json.loads((out / "config.json").read_text())["architecture"] == net.model_name


@pytest.fixture
def hub(monkeypatch):
    """The Hub's API replaced by a recorder: create_repo, create_commit (the uploaded files' contents)
    and the repository's model card (``hub.card``: None for none)."""
    rec = SimpleNamespace(repos=[], commits=[], card=None)

    def create_repo(self, repo_id, **kwargs):
        rec.repos.append((repo_id, kwargs))
        return SimpleNamespace(repo_id="user/" + repo_id)

    def create_commit(self, repo_id, operations, **kwargs):
        files = {op.path_in_repo: open(op.path_or_fileobj, "rb").read() for op in operations}
        rec.commits.append(dict(repo_id=repo_id, files=files, **kwargs))

    def load(cls, repo_id, **kwargs):
        if rec.card is None:
            raise EntryNotFoundError(f"{repo_id} has no README.md")
        return huggingface_hub.ModelCard(rec.card)

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", create_commit)
    monkeypatch.setattr(huggingface_hub.ModelCard, "load", classmethod(load))
    return rec


def test_push_to_hub_uploads_the_complete_folder(hub, tmp_path):
    model = _wrapper("vision")
    model.save_pretrained(tmp_path / "my-model", push_to_hub=True, private=True, commit_message="first")
    assert hub.repos == [("my-model", {"exist_ok": True, "private": True, "token": None})]
    (commit,) = hub.commits
    assert commit["repo_id"] == "user/my-model" and commit["commit_message"] == "first"
    files = commit["files"]
    assert set(files) == {"config.json", "model.safetensors", "whiteformer_auto.py", "README.md"}
    assert files == {name: (tmp_path / "my-model" / name).read_bytes() for name in files}  # the saved folder's
    assert json.loads(files["config.json"])["architecture"] == "tost_t12_p16"
    assert b"library_name: whiteformer" in files["README.md"]
    # the repository's own card stays there: the next upload leaves README.md out
    hub.card = "---\nlicense: mit\n---\nThe author's card.\n"
    model.save_pretrained(tmp_path / "my-model", push_to_hub=True, repo_id="org/other")
    assert hub.repos[-1][0] == "org/other" and "README.md" not in hub.commits[-1]["files"]
    assert "whiteformer_auto.py" in hub.commits[-1]["files"]


def test_push_to_hub_uploads_whiteformers_folder_and_card(hub):
    model = _wrapper("lm")
    model.push_to_hub("tiny-lm", commit_message="hello", tags=["mine"])
    (commit,) = hub.commits
    files = commit["files"]
    assert set(files) >= {"config.json", "model.safetensors", "whiteformer_auto.py", "README.md"}
    assert commit["repo_id"] == "user/tiny-lm" and commit["commit_message"] == "hello"
    card = files["README.md"].decode()
    assert "library_name: whiteformer" in card and "- mine" in card.split("---")[1] and "arXiv:2412.17810" in card
    assert json.loads(files["config.json"])["architecture"] == "tost_lm_base"
    # a repository whose card is its author's: the card is tagged, not replaced (as transformers does)
    hub.card = "---\nlicense: mit\n---\nThe author's card.\n"
    model.push_to_hub("tiny-lm", tags=["mine"])
    card = hub.commits[-1]["files"]["README.md"].decode()
    assert "The author's card." in card and "- mine" in card and "library_name: whiteformer" not in card
