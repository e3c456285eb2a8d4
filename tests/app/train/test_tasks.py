"""The language-model tasks (LMTask, SequenceTask) share their summary, model hint and model check
(train/tasks/base.py: CausalLMData), each worded for its data."""
import pytest
import torch.nn as nn

from whiteformer.app.config import ConfigError
from whiteformer.app.train.tasks import LMTask, SequenceTask


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
    assert task.model_hint("Linear.__init__() got an unknown argument 'vocab_size'") == hint
    assert task.model_hint("unknown argument 'in_chans'") == ""
    with pytest.raises(ConfigError, match=rf"dataset 'toy' holds {holds}, but the model \(Linear\) is not a language"):
        task.check_model(_model(), _Data)
    with pytest.raises(ConfigError, match="has a vocabulary of 10 tokens, the model 5"):
        task.check_model(_model(5), _Data)
    task.check_model(_model(12), _Data)
