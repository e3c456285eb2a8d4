"""Context parallelism: TSSA and causal TSSA on a sequence split over 2 and 3 CPU
processes (gloo) give exactly the rows of the unsplit op, forward and every gradient (weights
included), with masks, packed documents (cu_seqlens) spanning ranks, uneven chunks and a chunk of
one token; a ToST LM and a ToST vision model split the same way; the collectives' adjoints; the
checks. Each test spawns its processes once and runs all its cases in them (slow start-up)."""
import itertools
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")

B, H, P = 2, 3, 4
TOL = dict(rtol=1e-10, atol=1e-11)


def _init(rank: int, world: int, store: str, **kwargs) -> None:
    os.environ["WHITEFORMER_DISABLE_KERNELS"] = "1"  # the unsplit op: the PyTorch path, no C++ build
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, **kwargs)


def _shut_down() -> None:
    """No rank tears its connections down while another still uses them; then ``cleanup`` collects
    what still refers to the groups (autograd graphs, the tracebacks of caught errors) and destroys them."""
    from whiteformer.app.train.distributed import cleanup

    dist.barrier()
    cleanup()


def _inputs(n: int, seed: int, masked: bool, b: int = B):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(b, H, n, P, generator=g, dtype=torch.float64) * 2
    temp = torch.rand(H, 1, generator=g, dtype=torch.float64) + 0.5
    bias = torch.randn(H, n + 3, 1, generator=g, dtype=torch.float64) * 0.5
    g_out = torch.randn(b, H, n, P, generator=g, dtype=torch.float64)
    g_pi = torch.randn(b, H, n, generator=g, dtype=torch.float64)
    mask = None
    if masked:  # left padding in row 0, right padding + holes in row 1
        mask = torch.ones(B, n, dtype=torch.bool)
        mask[0, :2] = False
        mask[1, n - 3:] = False
        mask[1, 3] = False
    return w, temp, bias, mask, g_out, g_pi


def _run(op: str, w, temp, bias, mask, group, cu=None):
    """out, pi and (causal) the state sums of ``op`` on the leaf tensors given."""
    from whiteformer.ops import causal_tssa, tssa

    if op == "tssa":
        out, pi = tssa(w, temp, mask, return_pi=True, group=group, cu_seqlens=cu)
        return out, pi, []
    out, pi, state = causal_tssa(w, temp, bias, mask, return_pi=True, return_state=True, group=group,
                                 cu_seqlens=cu)
    return out, pi, [state.sum_sq, state.sum_pi, state.sum_sq_pi, state.t]


def _check_split(op: str, sizes, masked: bool, group, seed: int, bounds=None, mask=None) -> None:
    """Split over ``group`` (chunk ``sizes`` in group rank order) == unsplit, rows and gradients;
    ``bounds``: the cu_seqlens of one packed row (documents spanning ranks); ``mask``: this keep-mask
    (B, N) instead, a rank whose chunk has no padding passing None."""
    rank, n = dist.get_rank(group), sum(sizes)
    lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
    w, temp, bias, default_mask, g_out, g_pi = _inputs(n, seed, masked, 1 if bounds else B)
    mask = default_mask if mask is None else mask
    cu = None if bounds is None else torch.tensor(bounds, dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (w, temp, bias)]
    out, pi, state = _run(op, *leaves, mask, None, cu)
    g = torch.Generator().manual_seed(seed + 1)
    g_state = [torch.randn(s.shape, generator=g, dtype=torch.float64) for s in state[:3]]
    loss = (out * g_out).sum() + (pi * g_pi).sum() + sum((s * g).sum() for s, g in zip(state, g_state))
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)

    local = [w[:, :, lo:hi].clone().requires_grad_(), temp.clone().requires_grad_(), bias.clone().requires_grad_()]
    lmask = None if mask is None or bool(mask[:, lo:hi].all()) and not masked else mask[:, lo:hi]
    out_r, pi_r, state_r = _run(op, *local, lmask, group, cu)
    torch.testing.assert_close(out_r, out[:, :, lo:hi].detach(), **TOL)
    torch.testing.assert_close(pi_r, pi[:, :, lo:hi].detach(), **TOL)
    last = rank == len(sizes) - 1
    if state_r:  # the state after this rank's last token: the unsplit op on the prefix
        cut = None if bounds is None else torch.tensor([min(b, hi) for b in bounds], dtype=torch.int32)
        prefix = _run(op, w[:, :, :hi], temp, bias, None if mask is None else mask[:, :hi], None, cut)[2]
        for a, b in zip(state_r, prefix):
            torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), **TOL)
    loss_r = (out_r * g_out[:, :, lo:hi]).sum() + (pi_r * g_pi[:, :, lo:hi]).sum()
    if last:
        loss_r = loss_r + sum((s * g).sum() for s, g in zip(state_r, g_state))
    grads_r = torch.autograd.grad(loss_r, local, allow_unused=True)
    torch.testing.assert_close(grads_r[0], grads[0][:, :, lo:hi], **TOL)
    for mine, full in zip(grads_r[1:], grads[1:]):  # weights: each rank holds its share
        if full is None:
            assert mine is None
            continue
        total = mine.clone()
        dist.all_reduce(total, group=group)
        torch.testing.assert_close(total, full, **TOL)


def _collectives(group) -> None:
    """The autograd collectives' forward values and adjoints, and the byte log."""
    from whiteformer.ops.context_parallel import all_reduce_sum, count_communication, exclusive_prefix_sum

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    x = torch.full((3,), float(rank + 1), dtype=torch.float64, requires_grad=True)
    with count_communication() as log:
        y = all_reduce_sum(x, group)
        z = exclusive_prefix_sum(x, group)
        ((y * (rank + 1)).sum() + (z * (rank + 1)).sum()).backward()
    assert torch.equal(y.detach(), torch.full((3,), world * (world + 1) / 2, dtype=torch.float64))
    assert torch.equal(z.detach(), torch.full((3,), rank * (rank + 1) / 2, dtype=torch.float64))
    # d/dx_r: all-reduce of the weights (every rank) + the weights of the ranks after r
    later = sum(k + 1 for k in range(rank + 1, world))
    assert torch.equal(x.grad, torch.full((3,), world * (world + 1) / 2 + later, dtype=torch.float64))
    assert sorted(r.op for r in log.records) == ["all_gather", "all_gather", "all_reduce", "all_reduce"]
    assert log.payload_bytes == 4 * 3 * 8


def _check_huge_feature(group, sizes) -> None:
    """float32, one feature of 1e30 (on the first rank's first token) beside ordinary ones: the
    ranks agree on each feature's scale (an all-reduce of the per-feature maxima), so every rank's
    rows match the float64 reference of the whole sequence, its ordinary features included."""
    from whiteformer.ops import causal_tssa, tssa
    from whiteformer.ops.reference import causal_tssa_reference, tssa_reference

    rank = dist.get_rank(group)
    lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
    w = torch.randn(B, H, sum(sizes), P, generator=torch.Generator().manual_seed(21))
    w[0, 1, 0, 0] = 1e30
    temp = torch.ones(H, 1)
    for op, ref in ((tssa, tssa_reference), (causal_tssa, causal_tssa_reference)):
        want = ref(w.double(), temp.double())
        norm = want.abs().amax(dim=-2, keepdim=True)
        got = op(w[:, :, lo:hi], temp, group=group)
        err = ((got.double() - want[:, :, lo:hi]) / norm).abs().max().item()
        assert err < 4e-5, f"{op.__name__} rank {rank}: error {err:.2e} of the column's largest |result|"


def _check_lm(group, sizes) -> None:
    """A ToST LM (global position embedding and position bias) split as :func:`check_lm_split`; GPT refuses."""
    from whiteformer.models.lm import GPTLM, ToSTLM

    n = sum(sizes)
    torch.manual_seed(3)
    model = ToSTLM(vocab_size=11, dim=8, depth=2, num_heads=2, max_len=n + 2).double()
    with torch.no_grad():
        for blk in model.transformer.h:  # non-trivial position bias and layer scales
            blk.attn.pos_bias.normal_(0, 0.5)
            blk.gamma1.fill_(0.5)
            blk.gamma2.fill_(0.5)
    idx = torch.randint(0, 11, (2, n))
    targets = torch.randint(0, 11, (2, n))
    check_lm_split(model, group, sizes, idx, targets, {2: [0, 3, 7, 9], 3: [0, 2, 6, 9]}[len(sizes)])
    with pytest.raises(ValueError, match="ring attention"):
        GPTLM(vocab_size=11, dim=8, depth=1, num_heads=2).set_context_parallel(group)


def check_lm_split(model, group, sizes, idx, targets, bounds) -> None:
    """A float64 causal LM split over ``group`` (chunk ``sizes`` in group rank order) on idx and
    targets (2, N) (a padding mask, ignored targets; the loss ``loss_chunk`` tokens at a time; row 0
    as packed documents ``bounds`` spanning ranks): rows of the logits, the loss (same on every rank)
    and the gradients averaged over the group equal the unsplit model's; generation and
    intermediates refuse while split."""
    rank, n = dist.get_rank(group), sum(sizes)
    lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
    targets = targets.clone()
    targets[0, :3] = -1
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, :2] = False
    bounds = torch.tensor(bounds, dtype=torch.int32)
    masked = (dict(attn_mask=mask), dict(attn_mask=mask[:, lo:hi]))
    packed = (dict(cu_seqlens=bounds), dict(cu_seqlens=bounds))  # one row of documents spanning ranks
    for loss_chunk, rows, (kw_full, kw_split) in ((None, slice(None), masked), (4, slice(None), masked),
                                                  (None, slice(0, 1), packed)):
        model.zero_grad()
        logits, loss = model(idx[rows], targets[rows], loss_chunk=loss_chunk, **kw_full)
        loss.backward()
        full = {k: p.grad.clone() for k, p in model.named_parameters()}
        model.zero_grad()
        model.set_context_parallel(group)
        try:
            logits_r, loss_r = model(idx[rows, lo:hi], targets[rows, lo:hi], loss_chunk=loss_chunk, **kw_split)
            loss_r.backward()
            for what, call in (("generate", lambda: model.generate(idx[:, :2], 1)),
                               ("prefill / generation", lambda: model.prefill(idx[:, :2])),
                               ("step", lambda: model.step(idx[:, 0])),
                               ("forward_intermediates", lambda: model.forward_intermediates(idx[:, :2]))):
                with pytest.raises(ValueError, match=f"^{what} runs on one process; the model is context-parallel"):
                    call()
        finally:
            model.set_context_parallel(None)
        torch.testing.assert_close(loss_r, loss, **TOL)
        if logits is not None:
            torch.testing.assert_close(logits_r, logits[:, lo:hi], **TOL)
        for k, p in model.named_parameters():
            mean = p.grad.clone()
            dist.all_reduce(mean, group=group)
            torch.testing.assert_close(mean / len(sizes), full[k], **TOL, msg=k)

def _check_vision(group, img_size: int = 16) -> None:
    """A ToST vision model (BatchNorm stem in training mode, two class-attention blocks): the logits
    on every rank and the gradients averaged over the group equal the unsplit model's (``img_size``
    4: one patch, the other ranks hold none); XCA refuses."""
    import torch.nn.functional as F

    from whiteformer.models import create_model

    tiny = dict(img_size=img_size, patch_size=4, in_chans=1, num_classes=5, embed_dim=16, depth=2, num_heads=2)
    torch.manual_seed(4)
    model = create_model("tost_t12_p16", **tiny).double().train()
    x = torch.randn(3, 1, img_size, img_size, dtype=torch.float64)
    y = torch.tensor([0, 3, 4])
    logits = model(x)
    F.cross_entropy(logits, y).backward()
    full = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    model.set_context_parallel(group)
    try:
        logits_r = model(x)
        F.cross_entropy(logits_r, y).backward()
        with pytest.raises(ValueError, match="^forward_intermediates runs on one process; the model is context-par"):
            model.forward_intermediates(x)
    finally:
        model.set_context_parallel(None)
    torch.testing.assert_close(logits_r, logits, **TOL)
    for k, p in model.named_parameters():
        mean = p.grad.clone()
        dist.all_reduce(mean, group=group)
        torch.testing.assert_close(mean / dist.get_world_size(group), full[k], **TOL, msg=k)
    with pytest.raises(ValueError, match="context parallelism is for TSSA"):
        create_model("xcit_s12_p16", **tiny).set_context_parallel(group)


# one packed row of 1,500 tokens: 200 short documents, one of 300 tokens (600..900), 300 short ones
MANY_BOUNDS = [0, *itertools.accumulate([2, 1, 3] * 100 + [300] + [1, 2, 3] * 100)]


def _worker(rank: int, world: int, store: str) -> None:
    _init(rank, world, store)
    group = dist.group.WORLD
    _collectives(group)
    _check_huge_feature(group, {2: [5, 4], 3: [4, 1, 4]}[world])
    _check_lm(group, {2: [5, 4], 3: [4, 1, 4]}[world])
    _check_vision(group)
    # chunk sizes in rank order: uneven, one rank with a single token
    sizes = {2: [6, 1], 3: [3, 1, 5]}[world]
    # packed documents (an empty one; one spanning every rank boundary)
    bounds = {2: [0, 3, 3, 5, 7], 3: [0, 2, 2, 7, 9]}[world]
    for op in ("tssa", "causal_tssa"):
        for masked in (False, True):
            _check_split(op, sizes, masked, group, seed=11)
        _check_split(op, sizes, False, group, seed=13, bounds=bounds)
        # 500 short documents and a long one spanning a rank boundary
        _check_split(op, [1500 // world] * world, False, group, seed=14, bounds=MANY_BOUNDS)
    if world == 3:  # a subgroup: group ranks (0, 1) are global ranks (1, 2)
        sub = dist.new_group([1, 2])
        if rank in (1, 2):
            for op in ("tssa", "causal_tssa"):
                _check_split(op, [1, 4], True, sub, seed=12)
    _errors(group, rank)
    _shut_down()


def _errors(group, rank: int) -> None:
    from whiteformer.ops import causal_tssa, tssa

    w = torch.randn(B, H + (rank == 1), 3, P, dtype=torch.float64)
    with pytest.raises(ValueError, match="same shape on every rank of the group except the token count"):
        tssa(w, torch.ones(w.shape[1], 1, dtype=torch.float64), group=group)
    w = torch.randn(B, H, 3, P, dtype=torch.float64)
    bias = torch.zeros(H, 4, 1, dtype=torch.float64)  # room for 4 tokens, the split sequence has 3 * world
    with pytest.raises(ValueError, match="exceeds the positional bias table"):
        causal_tssa(w, torch.ones(H, 1, dtype=torch.float64), bias, group=group)
    cu = torch.tensor([0, 2 + (rank == 1), 3 * dist.get_world_size(group)], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens must be the same on every rank"):
        tssa(torch.randn(1, H, 3, P, dtype=torch.float64), torch.ones(H, 1, dtype=torch.float64), group=group,
             cu_seqlens=cu)
    with pytest.raises(TypeError, match="ProcessGroup"):
        tssa(w, torch.ones(H, 1, dtype=torch.float64), group="world")


def _ranks_that_differ_worker(rank: int, world: int, store: str) -> None:
    """What may differ between the ranks and what may not: a mask on some ranks only (a chunk
    without padding passes None) and a rank without tokens (``group_chunk`` of a sequence shorter
    than the group) give the unsplit rows and gradients; a dtype, ``cu_seqlens`` or ``normalize``
    that differs raises on every rank (not a crash or a hang in a collective)."""
    import datetime

    from whiteformer.ops import causal_tssa, tssa

    _init(rank, world, store, timeout=datetime.timedelta(seconds=60))
    group = dist.group.WORLD
    mask = torch.ones(B, 7, dtype=torch.bool)
    mask[0, :2] = False  # padding on rank 0's chunk only
    for op in ("tssa", "causal_tssa"):
        _check_split(op, [3, 4], False, group, seed=21, mask=mask)
        for masked in (False, True):
            _check_split(op, [5, 0], masked, group, seed=22)
        _check_split(op, [3, 0], False, group, seed=23, bounds=[0, 1, 3])
    _check_lm(group, [9, 0])  # the layers and the LM on an empty chunk too
    _check_vision(group, img_size=4)  # one patch: rank 1 holds none
    w = torch.randn(1, H, 2, P, dtype=torch.float64 if rank == 0 else torch.float32)
    with pytest.raises(ValueError, match="w must have the same dtype on every rank"):
        tssa(w, 1.0, group=group)
    w = torch.randn(1, H, 3, P, dtype=torch.float64)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32) if rank == 0 else None  # the boundaries on one rank only
    for op in (tssa, causal_tssa):
        with pytest.raises(ValueError, match="cu_seqlens.* must be the same on every rank"):
            op(w, 1.0, group=group, cu_seqlens=cu)
    with pytest.raises(ValueError, match="normalize .* must be the same on every rank"):
        tssa(w, 1.0, group=group, normalize=rank == 0)
    bias = torch.zeros(H, 8 - 4 * rank, 1, dtype=torch.float64)  # room for the 6 tokens on rank 0 only
    with pytest.raises(ValueError, match="pos_bias.* must be the same on every rank"):
        causal_tssa(w, 1.0, bias, group=group)
    _one_rank_fails(group, rank, timeout=60.0)
    _shut_down()


def _one_rank_fails(group, rank: int, timeout: float) -> None:
    """Rank 1 fails a local input check (every public entry point taking a group: ops, packed ops,
    layers, models) while rank 0's inputs are good: rank 1 raises its own error, rank 0 a ValueError
    naming rank 1 and its message, promptly (not after ``timeout``, waiting in a collective)."""
    import time

    from whiteformer.attention import TSSA, CausalTSSA, ClassAttention
    from whiteformer.models import create_model
    from whiteformer.models.lm import ToSTLM
    from whiteformer.ops import causal_tssa, class_attention, tssa

    bad = rank == 1
    f64 = dict(dtype=torch.float64)
    w = torch.randn(B, H, 3, P, **f64)
    temp = torch.ones(H, 1, **f64)
    mask = torch.ones(B, 3, dtype=torch.bool)
    packed = torch.randn(1, H, 3, P, **f64)
    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    cu_bad = torch.tensor([0, 4, 2, 6], dtype=torch.int32)  # decreasing on rank 1
    q = torch.randn(B, H, 1, P, **f64)
    k = torch.randn(B, H, 4, P, **f64)
    torch.manual_seed(5)
    layer, causal_layer, cls_layer = TSSA(8, num_heads=2).double(), CausalTSSA(8, num_heads=2).double(), \
        ClassAttention(8, num_heads=2).double()
    lm = ToSTLM(vocab_size=11, dim=8, depth=1, num_heads=2, max_len=16).double()
    vision = create_model("tost_t12_p16", img_size=16, patch_size=4, in_chans=1, num_classes=5, embed_dim=16,
                          depth=1, num_heads=2).double()
    idx = torch.randint(0, 11, (2, 3))
    x = torch.randn(2, 3, 8, **f64)
    nan_temp = temp.clone()
    nan_temp[1] = float("nan")
    cases = [  # (what rank 1's bad call raises, the call: bad or good arguments)
        (ValueError, r"temp must have shape \(H, 1\)", lambda b: tssa(w, temp[:2] if b else temp, group=group)),
        (ValueError, "temp contains NaN or inf", lambda b: tssa(w, nan_temp if b else temp, group=group)),
        (ValueError, "attn_mask must have shape", lambda b: tssa(w, temp, mask[:, :2] if b else mask, group=group)),
        (TypeError, "attn_mask must be a bool", lambda b: causal_tssa(w, temp, None, mask.double() if b else mask,
                                                                       group=group)),
        (ValueError, "w must have 4 dimensions", lambda b: tssa(w[0] if b else w, temp, group=group)),
        (ValueError, "pos_bias must have shape", lambda b: causal_tssa(w, temp, torch.zeros(H + b, 8, 1, **f64),
                                                                        group=group)),
        (ValueError, "cu_seqlens must be non-decreasing", lambda b: tssa(packed, temp, group=group,
                                                                         cu_seqlens=cu_bad if b else cu)),
        (ValueError, "cu_seqlens must be non-decreasing", lambda b: causal_tssa(packed, temp, group=group,
                                                                                cu_seqlens=cu_bad if b else cu)),
        (ValueError, r"temp must have shape \(H, 1\)", lambda b: tssa(packed, temp[:2] if b else temp, group=group,
                                                                       cu_seqlens=cu)),
        (ValueError, "q_cls must hold one query", lambda b: class_attention(k[:, :, :2] if b else q, k, k,
                                                                            group=group)),
        (ValueError, "x must have last dimension 8", lambda b: layer(x[..., :4] if b else x)),
        (ValueError, "attn_mask must have shape", lambda b: causal_layer(x, mask[:1] if b else mask)),
        (ValueError, "takes no attn_mask", lambda b: cls_layer(x, mask if b else None)),
        (ValueError, "token ids in", lambda b: lm(idx + 20 * b)),
        (ValueError, "targets hold token ids outside", lambda b: lm(idx, idx + 20 * b)),
        (ValueError, "cu_seqlens must be non-decreasing", lambda b: lm(idx[:1], cu_seqlens=cu_bad if b else cu)),
        (ValueError, "must have 4 dimensions", lambda b: vision(torch.randn(2, 1, 16, 16, **f64)[0 if b else slice(None)])),
    ]
    for module in (layer, causal_layer, cls_layer, lm, vision):
        module.set_context_parallel(group)
    for error, message, call in cases:
        began = time.monotonic()
        if bad:
            with pytest.raises(error, match=message):
                call(True)
        else:
            with pytest.raises(ValueError, match=f"rank 1 of the group failed its input checks.*{message}"):
                call(False)
        assert time.monotonic() - began < timeout / 2, message
    for module in (layer, causal_layer, cls_layer, lm, vision):
        module.set_context_parallel(None)


def test_ranks_that_differ(tmp_path):
    mp.spawn(_ranks_that_differ_worker, args=(2, str(tmp_path / "store")), nprocs=2, join=True)


@pytest.mark.parametrize("world", [2, 3])
def test_split_equals_unsplit(world, tmp_path):
    mp.spawn(_worker, args=(world, str(tmp_path / "store")), nprocs=world, join=True)


def test_group_needs_initialised_distributed():
    from whiteformer.ops import tssa

    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    w = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="torch.distributed initialised"):
        tssa(w, torch.ones(2, 1), group=object())
