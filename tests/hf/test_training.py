"""Training through transformers: packed batches (DataCollatorWithFlattening), gradient
checkpointing, the LM's HF contract (resize_token_embeddings, generate past max_len, masks)."""
import os

import pytest
import torch
import torch.nn.functional as F

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install whiteformer[hf]")

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, DataCollatorWithFlattening  # noqa: E402

import whiteformer.hf  # noqa: E402,F401
from hf_versions import activation_checkpointing, cache_of  # noqa: E402

TINY = dict(vocab_size=61, dim=32, depth=2, num_heads=4, max_len=16)
LM = {"whiteformer-tost-lm": "tost_lm_base", "whiteformer-gpt": "gpt_base"}


def _lm(model_type, **over):
    config = AutoConfig.for_model(model_type, model_name=LM[model_type], init_kwargs={**TINY, **over})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # layer scale and position bias away from their tiny / zero init
        for p in model.parameters():
            if p.dim() == 1 or p.shape[-1] == 1:
                p.normal_(std=0.5)
    return model


DOCS = [[5, 9, 2, 7, 1], [3], [8, 8, 4, 60, 11, 2, 6], [0, 13]]


@pytest.mark.parametrize("flash_kwargs", [False, True])
@pytest.mark.parametrize("model_type", list(LM))
def test_flattened_batch_equals_each_document_alone(model_type, flash_kwargs):
    model = _lm(model_type)
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(
        [{"input_ids": d} for d in DOCS])
    assert ("cu_seq_lens_q" in batch) == flash_kwargs
    out = model(**batch)
    assert cache_of(out) is None
    alone = [model(torch.tensor([d]), use_cache=False).logits[0] for d in DOCS]
    torch.testing.assert_close(out.logits[0], torch.cat(alone))
    # the loss: every document's shifted next-token loss inside itself
    total = sum(F.cross_entropy(a[:-1], torch.tensor(d[1:], dtype=torch.long), reduction="sum")
                for a, d in zip(alone, DOCS))
    torch.testing.assert_close(out.loss, total / sum(len(d) - 1 for d in DOCS))
    # labels = input_ids (no separators): the wrapper still keeps the loss inside the documents
    plain = model(batch["input_ids"], labels=batch["input_ids"], position_ids=batch["position_ids"])
    torch.testing.assert_close(plain.loss, out.loss)
    # gradients: those of the documents run alone
    grads = torch.autograd.grad(out.loss, list(model.parameters()))
    want = torch.autograd.grad(total / sum(len(d) - 1 for d in DOCS), list(model.parameters()))
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("model_type", list(LM))
def test_headless_model_takes_packed_batches(model_type):
    """AutoModel (hidden states only) honours a flattened batch too; it ignored position_ids and
    cu_seq_lens_q and mixed the documents."""
    model = _lm(model_type)
    head = AutoModel.from_config(model.config).eval()
    head.load_state_dict(model.state_dict())
    for flash_kwargs in (False, True):
        batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)([{"input_ids": d} for d in DOCS])
        batch.pop("labels")
        out = head(**batch, output_hidden_states=True)
        for i, (a, b) in enumerate(zip(*(torch.tensor([0] + [len(d) for d in DOCS]).cumsum(0)[k:] for k in (0, 1)))):
            alone = head(torch.tensor([DOCS[i]]), output_hidden_states=True)
            torch.testing.assert_close(out.last_hidden_state[:, a:b], alone.last_hidden_state)
            torch.testing.assert_close(out.hidden_states[1][:, a:b], alone.hidden_states[1])
    with pytest.raises(ValueError, match="position_ids that cannot be honoured"):
        head(torch.randint(0, 61, (2, 6)), position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]] * 2))


def test_packed_batches_that_cannot_be_honoured_raise():
    model = _lm("whiteformer-tost-lm")
    ids = torch.randint(0, 61, (2, 6))
    with pytest.raises(ValueError, match="position_ids that cannot be honoured"):
        model(ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]] * 2))
    with pytest.raises(ValueError, match="position_ids that cannot be honoured"):
        model(ids[:1], position_ids=torch.tensor([[3, 4, 5, 6, 7, 8]]))
    with pytest.raises(ValueError, match="without a cache"):
        model(ids[:1], position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]), use_cache=True)
    with pytest.raises(ValueError, match="differ"):
        model(ids[:1], cu_seq_lens_q=torch.tensor([0, 3, 6], dtype=torch.int32),
              cu_seq_lens_k=torch.tensor([0, 2, 6], dtype=torch.int32))
    # position_ids that contradict cu_seq_lens_q, or that do not fit input_ids, are refused, not ignored
    with pytest.raises(ValueError, match="describe different documents"):
        model(ids[:1], position_ids=torch.arange(6)[None], cu_seq_lens_q=torch.tensor([0, 3, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"position_ids must have shape \(B, T\) = \(2, 6\).*got \(1, 5\)"):
        model(ids, position_ids=torch.arange(5)[None])
    with pytest.raises(TypeError, match="position_ids must be an integer tensor"):
        model(ids[:1], position_ids=torch.tensor([[0.0, 1, 2, 0, 1, 2]]))
    with pytest.raises(TypeError, match="position_ids must be an integer tensor, got list"):
        model(ids[:1], position_ids=[[0, 1, 2, 0, 1, 2]])
    with pytest.raises(TypeError, match="cu_seq_lens_q must be an int32 tensor"):
        model(ids[:1], cu_seq_lens_q=[0, 3, 6])
    cu, pad = torch.tensor([0, 3, 6], dtype=torch.int32), torch.tensor([[1, 1, 1, 1, 1, 0]])
    for net in (model, AutoModel.from_config(model.config)):  # the headless model too
        with pytest.raises(ValueError, match="a packed batch has no padding: attention_mask must be all 1"):
            net(ids[:1], attention_mask=pad, cu_seq_lens_q=cu, use_cache=False)
    with pytest.raises(ValueError, match=r"input_ids must have shape \(B, T\)"):
        model(ids[0], position_ids=torch.tensor([0, 1, 2, 0, 1, 2]))
    torch.testing.assert_close(  # position_ids and cu_seq_lens_q that agree: the packed documents
        model(ids[:1], position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]),
              cu_seq_lens_q=torch.tensor([0, 3, 6], dtype=torch.int32)).logits[0, 3:],
        model(ids[:1, 3:], use_cache=False).logits[0])
    # ordinary positions (as generate derives them, padding included) are accepted
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    pos = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)
    torch.testing.assert_close(model(ids, attention_mask=mask, position_ids=pos).logits,
                               model(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("model_type", list(LM))
def test_gradient_checkpointing_enable_same_loss_and_gradients(model_type):
    model = _lm(model_type).train()
    ids = torch.randint(0, 61, (2, 9))
    loss = model(ids, labels=ids).loss
    grads = torch.autograd.grad(loss, list(model.parameters()))
    model.gradient_checkpointing_enable()
    assert model.whiteformer.grad_checkpointing and activation_checkpointing(model)
    calls = []
    hook = model.whiteformer.transformer.h[0].register_forward_pre_hook(lambda *a: calls.append(1))
    loss2 = model(ids, labels=ids).loss
    grads2 = torch.autograd.grad(loss2, list(model.parameters()))
    assert len(calls) == 2  # the block ran again in backward: it was checkpointed
    hook.remove()
    torch.testing.assert_close(loss2, loss)
    for a, b in zip(grads2, grads):
        torch.testing.assert_close(a, b)
    model.gradient_checkpointing_disable()
    assert not model.whiteformer.grad_checkpointing


def test_trainer_with_gradient_checkpointing_and_packed_batches(tmp_path):
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(0)
    docs = [{"input_ids": torch.randint(0, 61, (int(n),), generator=g).tolist()}
            for n in torch.randint(2, 12, (32,), generator=g)]
    model = _lm("whiteformer-tost-lm").train()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=True)
    trainer = Trainer(model=model, args=args, train_dataset=docs, data_collator=DataCollatorWithFlattening())
    trainer.train()
    assert model.whiteformer.grad_checkpointing
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize("model_type", list(LM))
def test_trainer_label_smoothing_shifts_the_labels(model_type, tmp_path):
    """Trainer(label_smoothing_factor=...) computes the loss itself and shifts the labels only for causal
    LMs it knows by class name; unknown, every position was trained to predict its own token."""
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_pt_utils import LabelSmoother

    model = _lm(model_type).train()
    ids = torch.randint(0, 61, (2, 8))
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, label_smoothing_factor=0.1)
    loss = Trainer(model=model, args=args).compute_loss(model, {"input_ids": ids, "labels": ids})
    want = LabelSmoother(epsilon=0.1)({"logits": model(ids).logits}, ids, shift_labels=True)
    torch.testing.assert_close(loss, want)


@pytest.mark.parametrize("model_type", list(LM))
def test_resize_token_embeddings_round_trips(model_type, tmp_path):
    model = _lm(model_type)
    model.resize_token_embeddings(70)
    assert model.config.vocab_size == 70 and model.config.init_kwargs["vocab_size"] == 70
    net = model.whiteformer
    assert net.vocab_size == 70 and net.lm_head.weight is net.transformer.wte.weight
    ids = torch.tensor([[65, 3, 69, 10]])  # ids of the new rows are accepted ...
    logits = model(ids).logits
    assert logits.shape == (1, 4, 70)
    with pytest.raises(ValueError, match=r"expected \[0, 69\]"):  # ... and checked against the new size
        model(torch.tensor([[70]]))
    model.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert back.config.vocab_size == 70
    torch.testing.assert_close(back(ids).logits, logits)
    model.resize_token_embeddings(50)  # shrinking too
    assert model(torch.tensor([[49, 1]])).logits.shape == (1, 2, 50)


@pytest.mark.parametrize("model_type", list(LM))
def test_generate_past_max_len_crops_like_whiteformer_generate(model_type):
    model = _lm(model_type)  # max_len 16: a 10-token prompt and 20 new tokens go past it
    idx = torch.randint(1, 61, (2, 10))  # (no pad id 0 in the prompts: no inferred padding)
    out = model.generate(idx, max_new_tokens=20, do_sample=False, pad_token_id=0)
    want = model.whiteformer.generate(idx, 20, temperature=0)
    assert torch.equal(out, want)
    long_prompt = torch.randint(1, 61, (1, 20))  # a prompt longer than max_len is cropped too
    assert torch.equal(model.generate(long_prompt, max_new_tokens=3, do_sample=False, pad_token_id=0),
                       model.whiteformer.generate(long_prompt, 3, temperature=0))


@pytest.mark.parametrize("dtype", [torch.long, torch.int32])
def test_integer_attention_masks_everywhere(dtype):
    model = _lm("whiteformer-tost-lm")
    ids = torch.randint(0, 61, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=dtype)
    torch.testing.assert_close(model(ids, attention_mask=mask).logits[0, 2:],
                               model(ids[:1, 2:]).logits[0])
    with pytest.raises(TypeError, match="additive"):
        model(ids, attention_mask=mask.float())


def test_vision_wrapper_gradient_checkpointing():
    from transformers import AutoModelForImageClassification

    config = AutoConfig.for_model("whiteformer-vision", model_name="tost_t12_p16",
                                  init_kwargs=dict(img_size=16, patch_size=4, depth=2, embed_dim=32, num_classes=3))
    model = AutoModelForImageClassification.from_config(config).train()
    x, y = torch.randn(2, 3, 16, 16), torch.tensor([0, 2])
    loss = model(pixel_values=x, labels=y).loss
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    model.gradient_checkpointing_enable()
    assert model.whiteformer.grad_checkpointing
    loss2 = model(pixel_values=x, labels=y).loss
    grads2 = torch.autograd.grad(loss2, list(model.parameters()), allow_unused=True)
    torch.testing.assert_close(loss2, loss)
    for a, b in zip(grads2, grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)
