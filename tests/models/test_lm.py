"""Causal language models (causal ToST and the GPT baseline in the nanoGPT shell): parameter
counts, official-checkpoint conversion against a written-out official forward, recurrent /
KV-cache generation against full re-forward, length limits, save/load, bad inputs."""
import math

import pytest
import torch
import torch.nn.functional as F

from whiteformer.models import create_model, list_models
from whiteformer.models.lm import check_temperature
from whiteformer.models.load import load_checkpoint

TOST = ["tost_lm_base", "tost_lm_medium", "tost_lm_large"]
GPT = ["gpt_base", "gpt_medium", "gpt_large"]
DIMS = {"base": (12, 12, 768), "medium": (24, 16, 1024), "large": (36, 20, 1280)}
PAPER = {"tost_lm_base": 110.38e6, "tost_lm_medium": 304.71e6, "tost_lm_large": 656.45e6}
TINY = dict(vocab_size=61, dim=32, depth=2, num_heads=4, max_len=48)


def _expected_count(name, vocab=50304, block=1024):
    """nanoGPT convention: every parameter once (tied wte/lm_head once), wpe included."""
    depth, heads, d = DIMS[name.split("_")[-1]]
    per_block = 4 * d + 4 * d * d + 4 * d * d  # ln_1, ln_2, gamma1, gamma2; c_fc; mlp.c_proj
    per_block += (heads + heads * block + 2 * d * d) if name.startswith("tost") else 4 * d * d
    return vocab * d + block * d + depth * per_block + d


def test_registered():
    assert set(TOST + GPT) <= set(list_models())


@pytest.mark.parametrize("name", TOST + GPT)
def test_param_count_full_config(name):
    with torch.device("meta"):
        model = create_model(name)
    n = sum(p.numel() for p in model.parameters())
    assert n == model.get_num_params() == _expected_count(name)
    if name in PAPER:
        assert abs(n - PAPER[name]) / PAPER[name] < 0.005, n
    assert model.get_num_params(non_embedding=True) == n - 1024 * DIMS[name.split("_")[-1]][2]


@pytest.mark.parametrize("name", TOST + GPT)
def test_build_and_forward_small(name):
    # full width and heads of the config, one layer, small vocabulary and context
    model = create_model(name, vocab_size=101, depth=1, max_len=16).eval()
    idx = torch.randint(0, 101, (2, 9))
    with torch.no_grad():
        logits, loss = model(idx, torch.randint(0, 101, (2, 9)))
    assert logits.shape == (2, 9, 101) and torch.isfinite(logits).all() and torch.isfinite(loss)
    assert model.lm_head.weight is model.transformer.wte.weight


def _randomize(model, scale=0.3):
    """Large random weights so that attention matters (layer scale 1)."""
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("gamma1") or n.endswith("gamma2"):
                p.fill_(1.0)
            elif n.endswith("pos_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif n.endswith("temp"):
                p.copy_(1.0 + torch.rand(p.shape, generator=g))
            elif "ln" in n:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def _tiny(name, **kw):
    return _randomize(create_model(name, **{**TINY, **kw})).eval()


# ---------------------------------------------------------------------------- generation
@pytest.mark.parametrize("name", ["tost_lm_base", "gpt_base"])
@pytest.mark.parametrize("greedy", [dict(temperature=0), dict(temperature=0.7, top_k=1)])
def test_cached_generation_equals_full_reforward(name, greedy):
    model = _tiny(name)
    idx = torch.randint(0, 61, (2, 5))
    fast = model.generate(idx, 40, **greedy)
    slow = model.generate(idx, 40, use_cache=False, **greedy)
    assert fast.shape == (2, 45) and torch.equal(fast[:, :5], idx)
    assert torch.equal(fast, slow)
    # and the tokens are the argmax of a plain forward over each prefix
    logits, _ = model(fast[:, :-1])
    assert torch.equal(logits[:, 4:].argmax(-1), fast[:, 5:])
    assert len(set(fast[0, 5:].tolist())) > 3  # non-degenerate continuation


@pytest.mark.parametrize("name", ["tost_lm_base", "gpt_base"])
def test_sampled_generation_same_with_and_without_cache(name):
    model = _tiny(name)
    idx = torch.randint(0, 61, (3, 4))
    a = model.generate(idx, 20, temperature=1.3, top_k=8, generator=torch.Generator().manual_seed(7))
    b = model.generate(idx, 20, temperature=1.3, top_k=8, generator=torch.Generator().manual_seed(7),
                       use_cache=False)
    assert torch.equal(a, b)
    c = model.generate(idx, 20, temperature=1.3, top_k=8, generator=torch.Generator().manual_seed(8))
    assert not torch.equal(a, c)


def _force_eos_at(model, eos, steps):
    """The logits of generation call c (0: after the prompt) put row r's whole mass on ``eos`` when
    ``steps[r] == c``, and none on it otherwise (a hook on lm_head, counting the calls of its last position)."""
    calls = [0]

    def hook(module, args, logits):
        last = logits if logits.dim() == 2 else logits[:, -1]
        last = last.clone()
        for r, k in enumerate(steps):
            if k == calls[0]:
                last[r] = float("-inf")
            last[r, eos] = 1e4 if k == calls[0] else float("-inf")
        calls[0] += 1
        return last if logits.dim() == 2 else torch.cat([logits[:, :-1], last[:, None]], dim=1)

    return model.lm_head.register_forward_hook(hook)


@pytest.mark.parametrize("name", ["tost_lm_base", "gpt_base"])
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, top_k=20)])
@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_stops_each_sequence_at_eos(name, sampling, use_cache):
    """Generation ran past the end-of-sequence token: a sequence that samples eos_token_id is
    finished (its later positions padded with eos), and the loop ends when every one is; ignore_eos /
    eos_token_id=None generate all max_new_tokens."""
    model, eos, T = _tiny(name), 7, 3
    steps = [2, 5, 0]  # the generation step at which each row's logits force eos
    idx = torch.randint(0, 61, (3, T))
    idx[0, 1] = eos  # an eos in the prompt does not end anything
    kw = dict(use_cache=use_cache, **sampling)
    handle = _force_eos_at(model, eos, steps)
    try:
        out = model.generate(idx, 10, eos_token_id=eos, generator=torch.Generator().manual_seed(0), **kw)
    finally:
        handle.remove()
    assert out.shape == (3, T + max(steps) + 1) and torch.equal(out[:, :T], idx)
    for r, k in enumerate(steps):
        assert out[r, T + k] == eos and not (out[r, T:T + k] == eos).any() and (out[r, T + k:] == eos).all()
    for ignore in (dict(ignore_eos=True), dict(eos_token_id=None), {}):  # {}: the model has no eos_token_id
        handle = _force_eos_at(model, eos, steps)
        try:
            full = model.generate(idx, 10, generator=torch.Generator().manual_seed(0), **kw,
                                  **({"eos_token_id": eos} if "ignore_eos" in ignore else {}), **ignore)
        finally:
            handle.remove()
        assert full.shape == (3, T + 10)
        for r, k in enumerate(steps):  # the same tokens up to each row's eos
            assert torch.equal(full[r, :T + k + 1], out[r, :T + k + 1])


def test_a_saved_language_model_keeps_its_eos_token_id_and_generate_stops_there(tmp_path):
    """A model built with eos_token_id saves it in config.json; its generate stops there by default."""
    from whiteformer import from_pretrained

    model = _tiny("tost_lm_base", eos_token_id=7)
    model.save_pretrained(tmp_path / "m")
    loaded = from_pretrained(tmp_path / "m").eval()
    assert loaded.eos_token_id == 7
    handle = _force_eos_at(loaded, 7, [4])
    try:
        out = loaded.generate(torch.tensor([[1, 2]]), 20, temperature=0)
    finally:
        handle.remove()
    assert out.shape == (1, 2 + 5) and out[0, -1] == 7
    for bad in (61, -1, 2.0, True):
        with pytest.raises((ValueError, TypeError), match="eos_token_id"):
            create_model("tost_lm_base", **TINY, eos_token_id=bad)
        with pytest.raises((ValueError, TypeError), match="eos_token_id"):
            model.generate(torch.tensor([[1, 2]]), 2, eos_token_id=bad)
    with pytest.raises(TypeError, match="ignore_eos must be a bool"):
        model.generate(torch.tensor([[1, 2]]), 2, ignore_eos="yes")


@pytest.mark.parametrize("use_cache", [True, False])
def test_the_eos_check_reads_the_device_once_per_generated_token(use_cache, monkeypatch):
    """Stopping at eos costs at most one host read (a bool of a tensor) per generated token."""
    model = _tiny("tost_lm_base")
    idx = torch.randint(0, 61, (2, 3))
    reads = [0]
    real = torch.Tensor.__bool__

    def counting(self):
        reads[0] += 1
        return real(self)

    monkeypatch.setattr(torch.Tensor, "__bool__", counting)
    counts = []
    for eos in (None, 7):
        reads[0] = 0
        with torch.no_grad():
            n = model.generate(idx, 12, temperature=0, eos_token_id=eos, use_cache=use_cache).shape[1] - 3
        counts.append((reads[0], n))
    (without, n0), (with_eos, n1) = counts
    assert with_eos - without <= n1 <= n0


@pytest.mark.parametrize("name", ["tost_lm_base", "gpt_base"])
def test_prefill_and_step_match_forward(name):
    model = _tiny(name).double()
    idx = torch.randint(0, 61, (2, 12))
    full, _ = model(idx)
    pre, state = model.prefill(idx[:, :7])
    torch.testing.assert_close(pre, full[:, :7])
    for t in range(7, 12):
        step_logits, state = model.step(idx[:, t], state)
        torch.testing.assert_close(step_logits, full[:, t], rtol=1e-9, atol=1e-9)
    assert state.pos == 12
    # stepping from scratch (no prefill) gives the same
    state = None
    for t in range(12):
        step_logits, state = model.step(idx[:, t], state)
    torch.testing.assert_close(step_logits, full[:, -1], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", ["tost_lm_base", "gpt_base"])
def test_padded_batch_matches_each_sequence_alone(name):
    """Left and right padding via attn_mask: every real token's logits, and the steps after a
    padded prefill, equal those of its sequence run alone."""
    model = _tiny(name).double().eval()
    a, b = torch.randint(0, 61, (1, 9)), torch.randint(0, 61, (1, 5))
    nxt = torch.randint(0, 61, (2, 3))
    pad = torch.zeros(1, 4, dtype=torch.long)
    for left in (True, False):
        idx = torch.cat([a, torch.cat([pad, b], 1) if left else torch.cat([b, pad], 1)])
        mask = idx.new_ones(idx.shape, dtype=torch.bool)
        mask[1] = torch.arange(9) >= 4 if left else torch.arange(9) < 5
        logits, _ = model(idx, attn_mask=mask)
        torch.testing.assert_close(logits[0], model(a)[0][0])
        torch.testing.assert_close(logits[1, mask[1]], model(b)[0][0])
        assert bool(torch.isfinite(logits).all())
        if not left:
            continue
        _, state = model.prefill(idx, attn_mask=mask)
        _, alone_a = model.prefill(a)
        _, alone_b = model.prefill(b)
        for t in range(3):
            got, state = model.step(nxt[:, t], state)
            want_a, alone_a = model.step(nxt[:1, t], alone_a)
            want_b, alone_b = model.step(nxt[1:, t], alone_b)
            torch.testing.assert_close(got, torch.cat([want_a, want_b]), rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="without any real token"):
        model(idx, attn_mask=torch.zeros_like(mask))
    with pytest.raises(ValueError, match="attn_mask must have shape"):
        model(idx, attn_mask=mask[:, :3])


def test_tost_state_is_constant_size_gpt_cache_grows():
    tost, gpt = _tiny("tost_lm_base"), _tiny("gpt_base")
    idx = torch.randint(0, 61, (2, 3))

    def sizes(state):
        return [sum(t.numel() for t in s if isinstance(t, torch.Tensor)) for s in state.layers]

    _, st = tost.prefill(idx)
    first = sizes(st)
    for t in range(30):
        _, st = tost.step(idx[:, t % 3], st)
    assert sizes(st) == first  # constant memory whatever the position
    assert first[0] == 2 * (2 * 32 + 4 + 32)  # (B, H, p) x 2 running sums + (B, H) mass + (B, H, p) scale

    _, kv = gpt.prefill(idx)
    n0 = sizes(kv)[0]
    _, kv = gpt.step(idx[:, 0], kv)
    assert sizes(kv)[0] == n0 + 2 * 2 * 32  # one more key and value per sequence


def test_tost_generation_past_max_len_errors_without_crop_or_unlimited():
    model = _tiny("tost_lm_base", max_len=16)
    idx = torch.randint(0, 61, (1, 6))
    assert model.generate(idx, 11, temperature=0).shape == (1, 17)  # 16 positions fed: ok
    with pytest.raises(ValueError, match="context limit 16"):
        model.generate(idx, 12, temperature=0, crop=False)
    with pytest.raises(ValueError, match="context limit 16"):
        model(torch.randint(0, 61, (1, 17)))
    # position bias only (no learned wpe): the limit stays
    only_bias = _tiny("tost_lm_base", max_len=16, pos_emb=False)
    with pytest.raises(ValueError, match="pos_bias=False"):
        only_bias.generate(idx, 12, temperature=0, crop=False)
    free = _tiny("tost_lm_base", max_len=16, pos_emb=False, pos_bias=False)
    assert free.context_limit is None and "transformer.wpe.weight" not in free.state_dict()
    out = free.generate(idx, 30, temperature=0)
    assert torch.equal(out, free.generate(idx, 30, temperature=0, use_cache=False))


def test_tost_generation_past_max_len_crops_like_gpt():
    """Absolute positions: past max_len the context is cropped to the last max_len tokens and the
    recurrent state rebuilt from that window (as GPT / nanoGPT)."""
    for kw in (dict(), dict(pos_emb=False)):  # learned wpe + pos_bias, or pos_bias alone
        model = _tiny("tost_lm_base", max_len=16, **kw)
        idx = torch.randint(0, 61, (2, 6))
        out = model.generate(idx, 25, temperature=0)
        assert out.shape == (2, 31) and torch.equal(out[:, :6], idx)
        assert torch.equal(out, model.generate(idx, 25, temperature=0, use_cache=False))
        logits, _ = model(out[:, -17:-1])  # the last token is predicted from the last 16 tokens only
        assert torch.equal(logits[:, -1].argmax(-1), out[:, -1])
        # within the limit the recurrent steps are used and agree with the full forward
        logits, _ = model(out[:, :16])
        assert torch.equal(logits[:, 5:].argmax(-1), out[:, 6:17])


def test_gpt_generation_past_max_len_crops_like_nanogpt():
    model = _tiny("gpt_base", max_len=16)
    idx = torch.randint(0, 61, (2, 6))
    out = model.generate(idx, 25, temperature=0)
    assert out.shape == (2, 31)
    assert torch.equal(out, model.generate(idx, 25, temperature=0, use_cache=False))
    # the last token is predicted from the last 16 tokens only
    logits, _ = model(out[:, -17:-1])
    assert torch.equal(logits[:, -1].argmax(-1), out[:, -1])
    free = _tiny("gpt_base", max_len=16, pos_emb=False)
    out = free.generate(idx, 25, temperature=0)
    logits, _ = free(out[:, :-1])  # no crop without a learned position embedding
    assert torch.equal(logits[:, 5:].argmax(-1), out[:, 6:])


# ---------------------------------------------------------------------------- official checkpoints
def _official_state_dict(tssa, depth=2, heads=4, d=32, vocab=61, block=64, dtype=torch.float64, seed=0):
    """Random tensors in the official ToST / nanoGPT layout (the state_dict of github
    RobinWu218/ToST ``tost_lang/model_TSSA.py``)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.3, shift=0.0):
        return torch.randn(shape, generator=g, dtype=dtype) * scale + shift

    sd = {"transformer.wte.weight": r(vocab, d), "transformer.wpe.weight": r(block, d)}
    for i in range(depth):
        p = f"transformer.h.{i}."
        sd[p + "gamma1"] = r(d, shift=1.0)
        sd[p + "gamma2"] = r(d, shift=1.0)
        sd[p + "ln_1.weight"] = r(d, scale=0.1, shift=1.0)
        if tssa:
            sd[p + "attn.temp"] = r(heads, 1, shift=1.0)
            sd[p + "attn.denom_bias"] = r(heads, block, 1, scale=0.5)
            sd[p + "attn.c_attn.weight"] = r(d, d)
        else:
            sd[p + "attn.c_attn.weight"] = r(3 * d, d)
        sd[p + "attn.c_proj.weight"] = r(d, d)
        sd[p + "ln_2.weight"] = r(d, scale=0.1, shift=1.0)
        sd[p + "mlp.c_fc.weight"] = r(4 * d, d)
        sd[p + "mlp.c_proj.weight"] = r(d, 4 * d)
    sd["transformer.ln_f.weight"] = r(d, scale=0.1, shift=1.0)
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return sd


def _official_forward(sd, idx, heads, tssa):
    """The official GPT forward (eval) of github RobinWu218/ToST ``tost_lang/model_TSSA.py``, written out."""
    b, t = idx.shape
    d = sd["transformer.wte.weight"].shape[1]
    depth = len({k.split(".")[2] for k in sd if k.startswith("transformer.h.")})
    ln = lambda z, k: F.layer_norm(z, (d,), sd[k], None, 1e-5)  # noqa: E731
    x = sd["transformer.wte.weight"][idx] + sd["transformer.wpe.weight"][:t]
    for i in range(depth):
        p = f"transformer.h.{i}."
        h = ln(x, p + "ln_1.weight")
        if tssa:
            w = (h @ sd[p + "attn.c_attn.weight"].T).view(b, t, heads, d // heads).transpose(1, 2)
            w_sq = w ** 2
            denom = torch.cumsum(w_sq, dim=-2).clamp_min(1e-12)
            w_normed = w_sq / denom + sd[p + "attn.denom_bias"][:, :t, :]
            pi = F.softmax(torch.sum(w_normed, dim=-1) * sd[p + "attn.temp"], dim=1)
            dots = torch.cumsum(w_sq * pi.unsqueeze(-1), dim=-2) / (pi.cumsum(dim=-1) + 1e-8).unsqueeze(-1)
            y = -(w * pi.unsqueeze(-1)) * (1.0 / (1 + dots))
        else:
            q, k, v = (h @ sd[p + "attn.c_attn.weight"].T).split(d, dim=2)
            q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / math.sqrt(d // heads)
            att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        y = y.transpose(1, 2).reshape(b, t, d) @ sd[p + "attn.c_proj.weight"].T
        x = x + sd[p + "gamma1"] * y
        h = ln(x, p + "ln_2.weight")
        x = x + sd[p + "gamma2"] * (F.gelu(h @ sd[p + "mlp.c_fc.weight"].T) @ sd[p + "mlp.c_proj.weight"].T)
    return ln(x, "transformer.ln_f.weight") @ sd["lm_head.weight"].T


@pytest.mark.parametrize("name,tssa", [("tost_lm_base", True), ("gpt_base", False)])
def test_official_checkpoint_matches_official_forward(tmp_path, name, tssa):
    sd = _official_state_dict(tssa)
    wrapped = {f"_orig_mod.{k}": v for k, v in sd.items()}
    if not tssa:  # nanoGPT's non-flash path stores its causal mask as a buffer
        wrapped["_orig_mod.transformer.h.0.attn.bias"] = torch.ones(1, 1, 64, 64).tril()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": wrapped, "model_args": dict(n_layer=2, n_head=4), "iter_num": 10}, path)
    model = create_model(name, vocab_size=61, dim=32, depth=2, num_heads=4, max_len=64).double()
    load_checkpoint(model, path)
    model.eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    idx = torch.randint(0, 61, (2, 40))
    ref = _official_forward(sd, idx, heads=4, tssa=tssa)
    logits, _ = model(idx)
    torch.testing.assert_close(logits, ref, rtol=1e-10, atol=1e-10)
    if tssa:
        torch.testing.assert_close(model.transformer.h[1].attn.pos_bias, sd["transformer.h.1.attn.denom_bias"])


def test_official_checkpoint_float32_and_generation():
    sd = _official_state_dict(True, dtype=torch.float32)
    model = create_model("tost_lm_base", vocab_size=61, dim=32, depth=2, num_heads=4, max_len=64).eval()
    model.load_state_dict(model.convert_state_dict(sd))
    idx = torch.randint(0, 61, (2, 30))
    torch.testing.assert_close(model(idx)[0], _official_forward(sd, idx, 4, True), rtol=1e-4, atol=1e-4)
    # greedy generation = argmax of the official forward at every step
    out = model.generate(idx[:, :5], 20, temperature=0)
    ref = _official_forward(sd, out[:, :-1], 4, True)
    assert torch.equal(ref[:, 4:].argmax(-1), out[:, 5:])


def test_convert_crops_and_checks_position_tables():
    sd = _official_state_dict(True, block=64, dtype=torch.float32)
    short = create_model("tost_lm_base", vocab_size=61, dim=32, depth=2, num_heads=4, max_len=32).eval()
    short.load_state_dict(short.convert_state_dict(sd))  # cropped to 32 rows, as nanoGPT crop_block_size
    idx = torch.randint(0, 61, (1, 32))
    torch.testing.assert_close(short(idx)[0], _official_forward(sd, idx, 4, True), rtol=1e-4, atol=1e-4)

    no_bias = create_model("tost_lm_base", vocab_size=61, dim=32, depth=2, num_heads=4, max_len=64, pos_bias=False)
    with pytest.raises(ValueError, match="non-zero position bias"):
        no_bias.convert_state_dict(sd)
    zero = {k: (torch.zeros_like(v) if k.endswith("denom_bias") else v) for k, v in sd.items()}
    no_bias.load_state_dict(no_bias.convert_state_dict(zero))
    no_wpe = create_model("tost_lm_base", vocab_size=61, dim=32, depth=2, num_heads=4, max_len=64, pos_emb=False)
    with pytest.raises(ValueError, match="pos_emb=False"):
        no_wpe.convert_state_dict(sd)
    # lm_head missing (stored once): filled from the tied embedding
    one = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    conv = short.convert_state_dict(one)
    assert conv["lm_head.weight"] is conv["transformer.wte.weight"]


@pytest.mark.parametrize("name", ["tost_lm_base", "gpt_base"])
def test_save_pretrained_round_trip(tmp_path, name):
    model = _tiny(name)
    model.save_pretrained(tmp_path / "m")
    again = create_model(name, checkpoint_path=str(tmp_path / "m")).eval()
    assert again.init_kwargs == model.init_kwargs
    assert again.lm_head.weight is again.transformer.wte.weight
    idx = torch.randint(0, 61, (2, 10))
    torch.testing.assert_close(again(idx)[0], model(idx)[0], rtol=0, atol=0)


# ---------------------------------------------------------------------------- shell details
def test_init_matches_official():
    model = create_model("tost_lm_base", vocab_size=500, dim=256, depth=4, num_heads=8, max_len=32)
    blk = model.transformer.h[0]
    assert torch.equal(blk.gamma1, torch.full((256,), 1e-5)) and torch.equal(blk.gamma2, blk.gamma1)
    assert torch.equal(blk.attn.temp, torch.ones(8, 1)) and torch.equal(blk.attn.pos_bias, torch.zeros(8, 32, 1))
    assert blk.ln_1.bias is None and blk.attn.qkv.bias is None and blk.mlp.c_fc.bias is None
    assert model.transformer.ln_f.bias is None
    proj_std = 0.02 / math.sqrt(2 * 4)
    assert abs(blk.attn.proj.weight.std().item() - proj_std) < 0.05 * proj_std
    assert abs(blk.mlp.c_proj.weight.std().item() - proj_std) < 0.05 * proj_std
    assert abs(blk.mlp.c_fc.weight.std().item() - 0.02) < 0.05 * 0.02
    assert abs(model.transformer.wpe.weight.std().item() - 0.02) < 0.05 * 0.02
    with_bias = create_model("gpt_base", vocab_size=50, dim=32, depth=1, num_heads=4, bias=True)
    assert with_bias.transformer.h[0].attn.qkv.bias is not None
    assert torch.equal(with_bias.transformer.h[0].ln_1.bias, torch.zeros(32))


def test_no_weight_decay_and_intermediates():
    model = _tiny("tost_lm_base")
    nwd = model.no_weight_decay()
    assert nwd == {f"transformer.h.{i}.attn.{n}" for i in range(2) for n in ("temp", "pos_bias")}
    assert nwd <= dict(model.named_parameters()).keys()
    assert _tiny("gpt_base").no_weight_decay() == set()
    idx = torch.randint(0, 61, (2, 7))
    final, inter = model.forward_intermediates(idx)
    assert len(inter) == 2 and inter[0].shape == (2, 7, 32)
    torch.testing.assert_close(final, model.forward_features(idx))
    last = model.forward_intermediates(idx, indices=[-1], norm=True, intermediates_only=True)
    torch.testing.assert_close(last[0], final)
    torch.testing.assert_close(model.lm_head(final), model(idx)[0])


def test_half_precision_finite():
    model = _tiny("tost_lm_base").to(torch.bfloat16)
    logits, loss = model(torch.randint(0, 61, (2, 12)), torch.randint(0, 61, (2, 12)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all() and torch.isfinite(loss)
    out = model.generate(torch.randint(0, 61, (1, 3)), 5, temperature=0)
    assert out.shape == (1, 8)


def test_train_step_with_dropout_and_loss_ignore_index():
    model = create_model("tost_lm_base", **TINY, dropout=0.1).train()
    idx = torch.randint(0, 61, (2, 10))
    targets = idx.clone()
    targets[:, :5] = -1
    _, loss = model(idx, targets)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(model.transformer.h[0].attn.qkv.weight.grad).all()
    model.eval()
    logits, loss = model(idx, targets)
    torch.testing.assert_close(loss, F.cross_entropy(logits[:, 5:].reshape(-1, 61), idx[:, 5:].reshape(-1)))


def test_bad_inputs():
    model = _tiny("tost_lm_base")
    with pytest.raises(TypeError, match="integer tensor"):
        model(torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"shape \(B, T\)"):
        model(torch.randint(0, 61, (5,)))
    with pytest.raises(ValueError, match=r"token ids in \[0, 61\]"):
        model(torch.tensor([[0, 61]]))
    with pytest.raises(ValueError, match="non-empty"):
        model(torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="targets must be a tensor of shape"):
        model(torch.randint(0, 61, (2, 5)), torch.randint(0, 61, (2, 4)))
    for bad in (torch.zeros(2, 5), torch.zeros(2, 5, dtype=torch.bool)):
        with pytest.raises(TypeError, match=f"targets must be an integer tensor of token ids, got {bad.dtype}"):
            model(torch.randint(0, 61, (2, 5)), bad)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(torch.randint(0, 61, (1, 3)), -1)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(torch.randint(0, 61, (1, 3)), 2, temperature=-1.0)
    for bad in (-1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match=rf"^temperature must be a finite number >= 0, got {bad!r}$"):
            check_temperature(bad)
    with pytest.raises(ValueError, match="temperature must be 0 .greedy. or at least 1e-06, got 1e-09"):
        check_temperature(1e-9)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(torch.randint(0, 61, (1, 3)), 2, top_k=0)
    with pytest.raises(ValueError, match="idx_t"):
        model.step(torch.randint(0, 61, (1, 3)))
    with pytest.raises(ValueError, match="divisible"):
        create_model("tost_lm_base", dim=30, num_heads=4)
    with pytest.raises(TypeError, match="unknown argument"):
        create_model("tost_lm_base", num_classes=10)


def test_forward_generate_and_step_arguments_refused_by_message():
    model = _tiny("tost_lm_base")
    idx = torch.randint(0, 61, (2, 5))
    with pytest.raises(ValueError, match=r"^loss_chunk needs targets"):
        model(idx, loss_chunk=2)
    with pytest.raises(ValueError, match=r"with cu_seqlens, idx must hold the packed documents in one row \(1, T\)"):
        model(idx, cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens must be on idx's device \(cpu\), got meta"):
        model(idx[:1], cu_seqlens=torch.tensor([0, 5], dtype=torch.int32, device="meta"))
    for top_p in (0.0, 1.5, "0.9"):
        with pytest.raises(ValueError, match=r"top_p must be a number in \(0, 1\]"):
            model.generate(idx, 1, top_p=top_p)
    with pytest.raises(TypeError, match="state must be an LMState with 2 layer states"):
        model.step(idx[:, 0], (0, ()))
    with pytest.raises(ValueError, match=r"mlp_ratio must give an MLP width int\(dim \* mlp_ratio\) >= 1"):
        create_model("tost_lm_base", **{**TINY, "mlp_ratio": 0.01})
    with pytest.raises(TypeError, match="unknown argument"):
        create_model("gpt_base", pos_bias=False)
    assert torch.equal(model.generate(torch.tensor([[1, 2]]), 0), torch.tensor([[1, 2]]))


@pytest.mark.parametrize("name", ["tost_lm_base", "gpt_base"])
def test_targets_outside_the_vocabulary_are_named(name):
    """targets outside [0, V) other than -1 (ignored): a ValueError naming them, on the plain and the chunked
    loss (an IndexError / RuntimeError from inside the cross-entropy), with a hint for transformers' -100."""
    model = _tiny(name)
    idx = torch.randint(0, 61, (2, 6))
    for loss_chunk in (None, 4):
        with pytest.raises(ValueError, match=r"targets hold token ids outside \[0, 60\].*\[61\]"):
            model(idx, idx.index_fill(1, torch.tensor([2]), 61), loss_chunk=loss_chunk)
        with pytest.raises(ValueError, match=r"\[-100\].*-100 is transformers' ignore index; here it is -1"):
            model(idx, idx.index_fill(1, torch.tensor([0]), -100), loss_chunk=loss_chunk)
    assert torch.isfinite(model(idx, idx.index_fill(1, torch.tensor([0]), -1))[1])


@pytest.mark.parametrize("name", ["tost_lm_base", "gpt_base"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_checks_its_ids_once(name, use_cache, monkeypatch):
    """generate checks idx at its door; prefill, the steps and the re-run windows it makes trust it
    (each check reads the ids' min and max: one host sync per token before)."""
    model = _tiny(name).eval()
    names, check = [], model._check_idx
    monkeypatch.setattr(model, "_check_idx", lambda idx, name="idx": (names.append(name), check(idx, name))[1])
    out = model.generate(torch.randint(0, 61, (2, 3)), 6, temperature=0, use_cache=use_cache)
    assert out.shape == (2, 9) and names == ["idx"]
