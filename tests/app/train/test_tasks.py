"""The tasks name what they take: the language-model tasks (LMTask, SequenceTask) share their summary,
model-kind check and model check (train/tasks/base.py: CausalLMData), each worded for its data; every
task lists the run options its constructor takes, and every registered model states its kind."""
import inspect

import pytest
import torch.nn as nn

from whiteformer.app.config import ConfigError
from whiteformer.app.train.tasks import TASKS, LMTask, SequenceTask
from whiteformer.models import list_models
from whiteformer.models.registry import model_class


class _Data:
    name = "toy"
    vocab_size = 10


def _model(vocab=None) -> nn.Module:
    m = nn.Linear(2, 2)
    if vocab is not None:
        m.vocab_size = vocab
    return m


@pytest.mark.parametrize("task, holds, hint", [
    (LMTask, "text", "; the dataset holds characters: use a causal language model (tost_lm_*, gpt_*)"),
    (SequenceTask, "token sequences", "; the dataset holds characters / tokens: use a causal language model "
                                      "(tost_lm_*, gpt_*), which for ListOps answers with the token after the expression"),
])
def test_language_model_tasks_summary_hint_and_check(task, holds, hint):
    assert task.describe_data(_Data) == "vocabulary 10"
    with pytest.raises(ConfigError, match=r"cannot build model 'tost_t12_p16' for toy \(vocabulary 10\): a model of kind "
                                          r"'image classifier'" + hint.replace("*", r"\*").replace("(", r"\(")
                                          .replace(")", r"\)")):
        task.check_model_kind("tost_t12_p16", "image classifier", _Data)
    task.check_model_kind("tost_lm_base", "causal language model", _Data)
    task.check_model_kind("my_model", None, _Data)  # a model that states no kind is built and checked after
    with pytest.raises(ConfigError, match=rf"dataset 'toy' holds {holds}, but the model \(Linear\) is not a language"):
        task.check_model(_model(), _Data)
    with pytest.raises(ConfigError, match="has a vocabulary of 10 tokens, the model 5"):
        task.check_model(_model(5), _Data)
    task.check_model(_model(12), _Data)


def test_every_registered_model_states_its_class_and_kind():
    kinds = {t for task in TASKS.values() for t in task.model_kinds}
    for name in list_models():
        cls = model_class(name)
        assert isinstance(cls, type) and issubclass(cls, nn.Module), name
        assert getattr(cls, "model_kind", None) in kinds, (name, cls)
    assert model_class("tost_lm_base").length_free_kwargs == {"pos_emb": False, "pos_bias": False}
    assert model_class("gpt_base").length_free_kwargs == {}


@pytest.mark.parametrize("kind", sorted(TASKS))
def test_task_options_are_constructor_arguments(kind):
    """Task.from_options passes the options a task names; each must be a keyword of its constructor."""
    task = TASKS[kind]
    params = inspect.signature(task.__init__).parameters
    assert set(task.options) <= set(params), set(task.options) - set(params)
    assert set(params) - set(task.options) <= {"self", "train_ds", "eval_ds", "dist"}
