"""labels the transformers wrappers cannot train on are named before the model runs (not an
IndexError / RuntimeError from inside torch's cross-entropy), and headless models refuse labels
rather than dropping them."""
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("transformers", reason="needs the hf extra: pip install whiteformer[hf]")

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageClassification  # noqa: E402

import whiteformer.hf  # noqa: E402,F401
from hf_versions import cache_of  # noqa: E402

TINY = dict(vocab_size=61, dim=32, depth=2, num_heads=4, max_len=16)
LM = {"whiteformer-tost-lm": "tost_lm_base", "whiteformer-gpt": "gpt_base"}


@pytest.mark.parametrize("model_type", list(LM))
def test_language_model_labels(model_type):
    config = AutoConfig.for_model(model_type, model_name=LM[model_type], init_kwargs=TINY)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 61, (2, 6))
    with pytest.raises(ValueError, match=r"labels must have the shape of input_ids \(2, 6\).*got \(2, 4\)"):
        model(ids, labels=ids[:, :4])
    with pytest.raises(ValueError, match=r"labels must have the shape of input_ids \(1, 6\).*got \(1, 3\)"):
        model(ids[:1], labels=ids[:1, :3], position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))  # packed
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        model(ids, labels=ids.float())
    with pytest.raises(ValueError, match=r"labels hold token ids outside \[0, 60\].*\[61, 75\]"):
        model(ids, labels=ids.index_put((torch.tensor([0, 1]), torch.tensor([2, 3])), torch.tensor([61, 75])))
    with pytest.raises(ValueError, match=r"outside \[0, 60\].*\[-3\]"):
        model(ids, labels=ids.index_fill(1, torch.tensor([1]), -3))
    ignored = ids.index_fill(1, torch.tensor([0, 4]), -100)  # -100 = ignored, as in transformers
    assert torch.isfinite(model(ids, labels=ignored).loss)
    with pytest.raises(ValueError, match="headless"):
        AutoModel.from_config(config)(ids, labels=ids)


@pytest.mark.parametrize("model_type", list(LM))
def test_token_ids_outside_the_vocabulary_name_input_ids(model_type):
    config = AutoConfig.for_model(model_type, model_name=LM[model_type], init_kwargs=TINY)
    for model in (AutoModelForCausalLM.from_config(config), AutoModel.from_config(config)):
        with pytest.raises(ValueError, match=r"input_ids has token ids in \[0, 61\], expected \[0, 60\]"):
            model(torch.tensor([[0, 61, 5]]))
        with pytest.raises(TypeError, match="input_ids must be an integer tensor"):
            model(torch.tensor([[0.0, 1.0]]))
    model = AutoModelForCausalLM.from_config(config).eval()
    cache = cache_of(model(torch.tensor([[1, 2]]), use_cache=True))
    with pytest.raises(ValueError, match=r"input_ids has token ids in \[61, 61\]"):  # a token stepped from a cache
        model(torch.tensor([[61]]), cache=cache)


def test_classifier_labels():
    config = AutoConfig.for_model("whiteformer-vision", model_name="deit_t_p16",
                                  init_kwargs=dict(img_size=8, patch_size=4, in_chans=1, num_classes=10, depth=1,
                                                   embed_dim=16, num_heads=2))
    model = AutoModelForImageClassification.from_config(config).eval()
    x = torch.randn(2, 1, 8, 8)
    with pytest.raises(ValueError, match=r"class indices in \[0, 9\].*got \[10\]"):
        model(x, labels=torch.tensor([1, 10]))
    with pytest.raises(ValueError, match=r"class indices in \[0, 9\].*got \[-2\]"):
        model(x, labels=torch.tensor([-2, 1]))
    assert torch.isfinite(model(x, labels=torch.tensor([-100, 3])).loss)
    want = model(x, labels=torch.tensor([4, 3])).loss  # (transformers now fixes problem_type: single-label)
    torch.testing.assert_close(model(x, labels=torch.tensor([4, 3], dtype=torch.int32)).loss, want)
    with pytest.raises(TypeError, match="class indices"):
        model(x, labels=torch.tensor([4.0, 3.0]))
    config.problem_type = "multi_label_classification"
    with pytest.raises(TypeError, match="multi_label_classification"):
        model(x, labels=torch.ones(2, 10, dtype=torch.long))
    with pytest.raises(ValueError, match="headless"):
        AutoModel.from_config(config)(x, labels=torch.tensor([1, 2]))


def test_labels_that_are_not_a_tensor():
    from types import SimpleNamespace

    from whiteformer.hf.labels import check_classification_labels, check_lm_labels

    with pytest.raises(TypeError, match="labels must be a torch.Tensor, got list"):
        check_lm_labels([1, 2], torch.zeros(1, 2, dtype=torch.long), 61)
    with pytest.raises(TypeError, match="labels must be a torch.Tensor, got list"):
        check_classification_labels([1, 2], torch.zeros(2, 5), SimpleNamespace(problem_type=None))
