"""generate() options a whiteformer language model cannot honour are refused with a ValueError naming
them (they were silently ignored, or crashed deep inside transformers' continuous batching)."""
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("transformers", reason="needs the hf extra: pip install whiteformer[hf]")

from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig  # noqa: E402

import whiteformer.hf  # noqa: E402,F401
from hf_versions import cache_arg, cache_of  # noqa: E402

TINY = dict(vocab_size=61, dim=32, depth=2, num_heads=4, max_len=32)
LM = {"whiteformer-tost-lm": "tost_lm_base", "whiteformer-gpt": "gpt_base"}
GREEDY = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)


def _lm(model_type):
    config = AutoConfig.for_model(model_type, model_name=LM[model_type], init_kwargs=TINY)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type", list(LM))
def test_generate_refuses_cache_implementations_it_cannot_honour(model_type):
    model, idx = _lm(model_type), torch.randint(1, 61, (2, 4))
    for impl in ("static", "offloaded", "quantized", "offloaded_static", "sliding_window"):
        with pytest.raises(ValueError, match=rf"cache_implementation='{impl}' is not supported.*'dynamic' or unset"):
            model.generate(idx, cache_implementation=impl, **GREEDY)
    with pytest.raises(ValueError, match="cache_implementation='static'"):  # from a GenerationConfig too
        model.generate(idx, generation_config=GenerationConfig(cache_implementation="static", **GREEDY))
    with pytest.raises(ValueError, match="continuous batching .* not supported"):
        model.generate(idx, cache_implementation="paged", **GREEDY)
    with pytest.raises(ValueError, match="continuous batching .* not supported"):
        model.generate_batch([[1, 2, 3]], generation_config=GenerationConfig(**GREEDY))
    with pytest.raises(ValueError, match="prefill_chunk_size=2 is not supported"):
        model.generate(idx, prefill_chunk_size=2, **GREEDY)
    want = model.generate(idx, **GREEDY)  # what the model does: its own cache, 'dynamic' named or not
    assert torch.equal(model.generate(idx, cache_implementation="dynamic", **GREEDY), want)
    assert torch.equal(want, model.generate(idx, use_cache=False, **GREEDY))


@pytest.mark.parametrize("model_type", list(LM))
def test_prompt_cache_with_beams_and_several_return_sequences(model_type):
    """generate(full, cache=<cache of a prefix>, num_beams=3 / num_return_sequences=2): the cache is
    expanded as the prompts are (it kept the prompts' batch size: an error from inside the attention)."""
    import copy

    model = _lm(model_type).double()
    idx = torch.randint(1, 61, (2, 6))
    with torch.no_grad():
        cached = cache_of(model(idx[:, :4], use_cache=True))
    for kw in (dict(num_beams=3, num_return_sequences=2), dict(do_sample=True, num_return_sequences=2)):
        kw = {**GREEDY, "max_new_tokens": 4, **kw}
        torch.manual_seed(0)
        want = model.generate(idx, **kw)
        torch.manual_seed(0)
        got = model.generate(idx, **cache_arg(copy.deepcopy(cached)), **kw)
        assert got.shape == (4, 10) and torch.equal(got, want)
    with pytest.raises(ValueError, match="the cache holds the state of 2 sequences, input_ids has 3 rows"):
        model(torch.randint(1, 61, (3, 1)), cache=copy.deepcopy(cached))


@pytest.mark.parametrize("model_type", list(LM))
def test_right_padded_prompts_are_refused(model_type):
    """A right-padded row continued from its pad token's logits (transformers only warns): the row's
    tokens differed from generating its prompt alone. Left padding gives the same tokens as alone."""
    model = _lm(model_type)
    a, b = torch.randint(1, 61, (1, 5)), torch.randint(1, 61, (1, 3))
    right = torch.cat([a, torch.cat([b, torch.zeros(1, 2, dtype=torch.long)], 1)])
    mask = torch.ones_like(right)
    mask[1, 3:] = 0
    with pytest.raises(ValueError, match=r"row\(s\) \[1\] end in padding \(right padding\).*padding_side = 'left'"):
        model.generate(right, attention_mask=mask, **GREEDY)
    with pytest.raises(ValueError, match=r"row\(s\) \[1\] end in padding"):  # the mask generate infers from the pads
        model.generate(right, **GREEDY)
    with pytest.raises(ValueError, match=r"row\(s\) \[1\] hold no real token"):
        model.generate(right, attention_mask=mask * torch.tensor([[1], [0]]), **GREEDY)
    left = torch.cat([a, torch.cat([torch.zeros(1, 2, dtype=torch.long), b], 1)])
    out = model.generate(left, attention_mask=mask.flip(1), **GREEDY)
    assert torch.equal(out[1, 2:], model.generate(b, **GREEDY)[0])


def test_caches_of_other_kinds_are_refused():
    """A StaticCache / offloading DynamicCache passed in was silently replaced (offloading) or failed on
    position_ids (static); an empty plain DynamicCache is replaced by the model's WhiteformerCache."""
    from transformers import DynamicCache, StaticCache

    from whiteformer.hf import WhiteformerCache

    model, idx = _lm("whiteformer-tost-lm"), torch.randint(1, 61, (2, 4))
    for cache in (StaticCache(config=model.config, max_cache_len=16), DynamicCache(offloading=True)):
        with pytest.raises(ValueError, match=rf"cache={type(cache).__name__}.* is not supported.*WhiteformerCache"):
            model.generate(idx, **cache_arg(cache), **GREEDY)
        with pytest.raises(ValueError, match=rf"cache={type(cache).__name__}.* is not supported"):
            model(idx, cache=cache)
    want = model.generate(idx, **GREEDY)
    mine = WhiteformerCache()
    assert torch.equal(model.generate(idx, **cache_arg(mine), **GREEDY), want) and mine.get_seq_length() == 6
    assert torch.equal(model.generate(idx, **cache_arg(DynamicCache()), **GREEDY), want)


@pytest.mark.parametrize("model_type", list(LM))
def test_logits_to_keep(model_type):
    """transformers' logits_to_keep was swallowed by **kwargs (every position's logits returned, and generate
    formed the prompt's (B, T, V) logits); now the columns asked for, as transformers' models."""
    model, idx = _lm(model_type), torch.randint(1, 61, (2, 7))
    assert model._supports_logits_to_keep()  # generate passes logits_to_keep=1
    full = model(idx, use_cache=False).logits
    for kw in (dict(use_cache=False), dict(use_cache=True), dict(use_cache=False, output_hidden_states=True)):
        torch.testing.assert_close(model(idx, logits_to_keep=2, **kw).logits, full[:, -2:])
    torch.testing.assert_close(model(idx, logits_to_keep=torch.tensor([0, 3])).logits, full[:, [0, 3]])
    torch.testing.assert_close(model(idx, logits_to_keep=0).logits, full)
    cache = cache_of(model(idx[:, :4], use_cache=True))  # tokens stepped from a cache
    torch.testing.assert_close(model(idx[:, 4:], cache=cache, logits_to_keep=1).logits, full[:, -1:],
                               rtol=1e-5, atol=1e-5)
    packed = model(idx[:1], position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]]), use_cache=False, logits_to_keep=3)
    assert packed.logits.shape == (1, 3, 61)
    with pytest.raises(ValueError, match="leave logits_to_keep at 0 with labels"):
        model(idx, labels=idx, logits_to_keep=1)
    with pytest.raises(ValueError, match="logits_to_keep must be >= 0"):
        model(idx, logits_to_keep=-1)
    with pytest.raises(TypeError, match="logits_to_keep must be an int"):
        model(idx, logits_to_keep=torch.tensor([[1]]))
    out = model.generate(idx, return_dict_in_generate=True, output_logits=True, **GREEDY)
    assert torch.equal(out.sequences, model.generate(idx, use_cache=False, **GREEDY))
    torch.testing.assert_close(out.logits[0], full[:, -1])


@pytest.mark.parametrize("model_type", list(LM))
def test_prompts_padded_past_max_len_generate_as_alone(model_type):
    """padding='max_length' past the model's max_len: every row's real tokens fit, so each row generates as
    alone (ToST's position bias checked the padded width: a ValueError from inside causal TSSA)."""
    model = _lm(model_type)
    a, b = torch.randint(1, 61, (1, 10)), torch.randint(1, 61, (1, 3))
    width = TINY["max_len"] + 8
    batch = torch.zeros(2, width, dtype=torch.long)
    batch[0, -10:], batch[1, -3:] = a, b
    mask = (batch != 0).long()
    out = model.generate(batch, attention_mask=mask, **{**GREEDY, "max_new_tokens": 4})
    assert torch.equal(out[0, -14:], model.whiteformer.generate(a, 4, temperature=0)[0])
    assert torch.equal(out[1, -7:], model.whiteformer.generate(b, 4, temperature=0)[0])


@pytest.mark.parametrize("model_type", list(LM))
def test_prompt_cache_holding_the_whole_prompt_is_refused(model_type):
    """A cache of the whole prompt (or more) passed in: transformers slices the prompt to its uncached tokens
    (none: input_ids[:, -0:] is the whole prompt again), so the prompt was fed twice (other tokens, silently),
    or an empty input raised from inside the model."""
    import copy

    model, idx = _lm(model_type), torch.randint(1, 61, (2, 6))
    with torch.no_grad():
        whole = cache_of(model(idx, use_cache=True))
        longer = cache_of(model(torch.cat([idx, idx], 1), use_cache=True))
    for cache, n in ((whole, 6), (longer, 12)):
        with pytest.raises(ValueError, match=rf"already holds {n} positions of this 6-position prompt"):
            model.generate(idx, **cache_arg(copy.deepcopy(cache)), **GREEDY)
    with torch.no_grad():
        prefix = cache_of(model(idx[:, :5], use_cache=True))  # all but the last token: reused
    assert torch.equal(model.generate(idx, **cache_arg(prefix), **GREEDY), model.generate(idx, **GREEDY))
