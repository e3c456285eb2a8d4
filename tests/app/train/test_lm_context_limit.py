"""The context limit ``whiteformer train`` gives a language model (``build_model``): built from
scratch with ``unlimited_length`` (the command's default), a decoder, whose only limit is
``max_len``, has none (``model_args`` still win); without it, ``--block-size``. A ``--finetune``
checkpoint keeps its own ``max_len`` whatever ``--block-size``, and a block longer than its limit is
refused before training."""
import pytest

from whiteformer.app.config import ConfigError
from whiteformer.app.data import build_dataset
from whiteformer.app.train.build import build_model
from whiteformer.models import create_model

TINY = dict(dim=16, depth=1, num_heads=2, num_kv_heads=1, intermediate_size=24)


@pytest.fixture(scope="module")
def text():
    return build_dataset("text", "train")


@pytest.mark.parametrize("name", ["decoder_base", "tost_decoder_base"])
def test_a_decoder_from_scratch_has_no_length_limit_unless_asked(text, name):
    assert build_model(name, text, dict(TINY), block_size=15, unlimited_length=True).context_limit is None
    assert build_model(name, text, dict(TINY), block_size=15).context_limit == 15
    assert build_model(name, text, dict(TINY, max_len=20), block_size=15, unlimited_length=True).context_limit == 20


@pytest.mark.parametrize("name,args,limit", [
    ("tost_decoder_base", dict(TINY, max_len=None), None),   # a linearized model: no limit
    ("decoder_base", dict(TINY, max_len=64), 64),            # a converted one: max_position_embeddings
    ("gpt_base", dict(dim=16, depth=1, num_heads=2, max_len=64), 64),  # a position embedding of 64 rows
])
def test_a_finetune_checkpoint_keeps_its_context_limit(text, tmp_path, name, args, limit):
    create_model(name, vocab_size=text.vocab_size, **args).save_pretrained(tmp_path / "m")
    model = build_model(name, text, {}, finetune=str(tmp_path / "m"), block_size=15, unlimited_length=True)
    assert model.context_limit == limit
    if limit is not None:
        with pytest.raises(ConfigError, match=f"block_size 65 exceeds the context limit {limit} of the finetune "
                                              "checkpoint"):
            build_model(name, text, {}, finetune=str(tmp_path / "m"), block_size=65)
