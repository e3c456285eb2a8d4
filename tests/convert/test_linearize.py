"""linearize: a softmax decoder -> its causal TSSA student (attention transfer, then fine-tuning)."""
import itertools

import numpy as np
import pytest
import torch

from whiteformer.convert import from_transformers, linearize
from whiteformer.ops.causal_tssa.state import CausalTSSAState

transformers = pytest.importorskip("transformers")

VOCAB = 24


def _patterns(seed: int, n: int = 8, batch: int = 8, length: int = 33):
    """``n`` batches of rows that repeat a random motif of 3 to 5 tokens (something to learn)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        rows = []
        for _ in range(batch):
            period = int(torch.randint(3, 6, (1,), generator=g))
            motif = torch.randint(0, VOCAB, (period,), generator=g)
            rows.append(motif.repeat(length // period + 1)[:length])
        out.append(torch.stack(rows))
    return out


def _trained(model):
    """``model`` trained a little on the patterns, in eval mode."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for b in _patterns(1, n=60):
        _, loss = model(b[:, :-1], b[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def teacher():
    """A tiny Llama (grouped key/value heads), imported, then trained a little on the patterns."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    return _trained(from_transformers(transformers.LlamaForCausalLM(config).eval()))


@pytest.fixture(scope="module")
def linearized(teacher):
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    student, result = linearize(teacher, _patterns(2), keep_softmax=[1], transfer_steps=40, finetune_steps=40,
                                lr=3e-3, eval_batch=_patterns(3, n=1)[0], progress=False)
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in before.items())  # the teacher is untouched
    return student, result


def test_transfer_loss_falls_and_kl_beats_the_plain_swap(linearized):
    student, result = linearized
    assert result.tssa_layers == [0, 2]
    assert all(a < b for a, b in zip(result.transfer_after, result.transfer_before))
    assert result.kl_finetune < result.kl_swap
    assert not student.training


def test_student_shell_and_kept_layers(teacher, linearized):
    student, _ = linearized
    assert student.attention == "tssa" and student.keep_softmax == [1]
    t = teacher.state_dict()
    for k, v in student.state_dict().items():
        if k.startswith("transformer.h.1.attn.") or not k.startswith("transformer.h.") or ".attn." not in k:
            assert torch.equal(v, t[k]), k  # kept softmax layer, embeddings, norms, MLPs, head


def test_generation_state_does_not_grow_with_the_prompt(linearized):
    student, _ = linearized
    sizes = {}
    for n in (4, 40):
        _, state = student.prefill(torch.randint(0, VOCAB, (1, n)))
        assert [isinstance(s, CausalTSSAState) for s in state.layers] == [True, False, True]
        sizes[n] = [sum(t.numel() for t in s if isinstance(t, torch.Tensor)) for s in state.layers]
    assert sizes[4][0] == sizes[40][0] and sizes[4][2] == sizes[40][2]
    assert sizes[40][1] > sizes[4][1]  # only the kept softmax layer's key/value cache grows
    out = student.generate(torch.randint(0, VOCAB, (1, 4)), max_new_tokens=6, temperature=0)
    assert out.shape == (1, 10)


def test_no_steps_is_the_plain_swap_with_value_output_init(teacher):
    student, result = linearize(teacher, _patterns(2, n=2), transfer_steps=0, finetune_steps=0, progress=False)
    assert result.kl_swap == result.kl_transfer == result.kl_finetune
    assert result.transfer_before == result.transfer_after
    for i in range(teacher.depth):
        src, dst = teacher.transformer.h[i].attn, student.transformer.h[i].attn
        assert torch.equal(dst.proj.weight, src.proj.weight)
        v = src.v_proj.weight.view(teacher.num_kv_heads, teacher.head_dim, -1)
        assert torch.equal(dst.qkv.weight, v.repeat_interleave(2, dim=0).reshape(teacher.dim, -1))


def test_lora_finetuning_merges_back(teacher):
    rng = torch.get_rng_state()
    student, result = linearize(teacher, _patterns(2, n=2), transfer_steps=2, finetune_steps=3, lora_rank=2,
                                progress=False)
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's random state is left as it was
    assert not any("lora" in k for k in student.state_dict())
    assert result.kl_finetune != result.kl_transfer  # the adapters trained and were merged in
    assert len(result.finetune_history) == 3


def test_packed_batches(teacher):
    idx = torch.cat(_patterns(4, n=1, batch=2, length=17).__iter__().__next__().unbind())[None]
    batch = {"idx": idx, "cu_seqlens": torch.tensor([0, 17, 34], dtype=torch.int32)}
    _, result = linearize(teacher, [batch], transfer_steps=2, finetune_steps=2, progress=False)
    assert len(result.transfer_history) == 2 and all(x == x for x in result.finetune_history)


@pytest.mark.parametrize("kwargs, name", [
    (dict(transfer_steps=-1), "transfer_steps"), (dict(finetune_steps=1.5), "finetune_steps"),
    (dict(init="kv"), "init"), (dict(lr=0), "lr"), (dict(lora_rank=0), "lora_rank"),
    (dict(kl_weight=-1.0), "kl_weight"), (dict(keep_softmax=[3]), "keep_softmax"),
])
def test_bad_arguments_name_the_argument(teacher, kwargs, name):
    with pytest.raises(ValueError, match=name):
        linearize(teacher, _patterns(2, n=1), progress=False, **kwargs)


def test_teacher_and_batches_are_checked(teacher):
    import whiteformer

    tssa = whiteformer.create_model("tost_decoder_base", vocab_size=VOCAB, dim=32, depth=1, num_heads=4,
                                    intermediate_size=64)
    with pytest.raises(ValueError, match="teacher"):
        linearize(tssa, _patterns(2, n=1), progress=False)
    for bad in (VOCAB, -1):
        with pytest.raises(ValueError, match="vocabulary"):
            linearize(teacher, [torch.full((2, 8), bad)], progress=False)
    with pytest.raises(ValueError, match="batches"):
        linearize(teacher, [], progress=False)
    with pytest.raises(ValueError, match="batches ran out"):
        linearize(teacher, iter(_patterns(2, n=3)), transfer_steps=2, finetune_steps=2, progress=False)


def _stopping(batches, after):
    """The batches, cycled, as an iterator that fails at draw ``after`` (an interrupted run)."""
    for k, b in enumerate(itertools.cycle(batches)):
        if k == after:
            raise RuntimeError("interrupted")
        yield b


@pytest.mark.parametrize("lora_rank, stop", [(None, 2), (2, 5)])  # stopped in stage 1; in stage 2 with adapters
def test_resume_ends_as_the_uninterrupted_run(teacher, tmp_path, lora_rank, stop):
    data, held = _patterns(2, n=3), _patterns(3, n=1)[0]
    kw = dict(keep_softmax=[1], transfer_steps=3, finetune_steps=3, lr=3e-3, lora_rank=lora_rank, eval_batch=held,
              progress=False)
    want, want_res = linearize(teacher, itertools.cycle(data), **kw)
    ckpt = tmp_path / "state.pt"
    teacher.train()
    try:
        with pytest.raises(RuntimeError, match="interrupted"):
            linearize(teacher, _stopping(data, stop), checkpoint=ckpt, checkpoint_every=1, **kw)
        assert teacher.training  # its mode is given back, an exception or not
    finally:
        teacher.eval()
    got, got_res = linearize(teacher, _stopping(data, 99), checkpoint=ckpt, resume=True, **kw)
    for k, v in want.state_dict().items():
        torch.testing.assert_close(got.state_dict()[k], v, rtol=0, atol=1e-6, msg=k)
    assert np.allclose(got_res.transfer_history, want_res.transfer_history, rtol=1e-5)
    assert np.allclose(got_res.finetune_history, want_res.finetune_history, rtol=1e-5)
    assert got_res.kl_finetune == pytest.approx(want_res.kl_finetune, rel=1e-5)
    with pytest.raises(ValueError, match="resume"):
        linearize(teacher, itertools.cycle(data), checkpoint=ckpt, resume=True, **{**kw, "finetune_steps": 4})
    with pytest.raises(ValueError, match="resume"):
        linearize(teacher, itertools.cycle(data), checkpoint=tmp_path / "none.pt", resume=True, **kw)


@pytest.fixture(scope="module")
def gpt2():
    """A tiny GPT-2 (the GPT shell), imported, then trained a little on the patterns."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=3, n_head=4)
    return _trained(from_transformers(transformers.GPT2LMHeadModel(config).eval()))


def test_gpt2_teacher_becomes_the_tost_gpt_shell(gpt2):
    from whiteformer.models.hybrid_lm import HybridGPTLM

    student, result = linearize(gpt2, _patterns(2), keep_softmax=[1], transfer_steps=40, finetune_steps=40,
                                lr=3e-3, eval_batch=_patterns(3, n=1)[0], progress=False)
    assert isinstance(student, HybridGPTLM) and student.keep_softmax == [1] and result.tssa_layers == [0, 2]
    assert all(a < b for a, b in zip(result.transfer_after, result.transfer_before))
    assert result.kl_finetune < result.kl_swap
    t = gpt2.state_dict()
    for k, v in student.state_dict().items():
        if k.startswith("transformer.h.1.attn.") or ".attn." not in k:
            assert torch.equal(v, t[k]), k  # kept softmax layer, embeddings, LayerNorms, MLPs, layer scales
    _, state = student.prefill(torch.randint(0, VOCAB, (1, 9)))
    assert [isinstance(s, CausalTSSAState) for s in state.layers] == [True, False, True]


def test_gpt2_plain_swap_starts_from_the_value_and_output_projections(gpt2):
    student, _ = linearize(gpt2, _patterns(2, n=1), transfer_steps=0, finetune_steps=0, progress=False)
    d = gpt2.dim
    for src, dst in zip(gpt2.transformer.h, student.transformer.h):
        assert torch.equal(dst.attn.qkv.weight, src.attn.qkv.weight[2 * d:])
        assert torch.equal(dst.attn.qkv.bias, src.attn.qkv.bias[2 * d:])
        assert torch.equal(dst.attn.proj.weight, src.attn.proj.weight)
        assert torch.equal(dst.attn.proj.bias, src.attn.proj.bias)
