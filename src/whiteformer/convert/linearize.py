"""Linearizing a softmax transformer into TSSA: attention transfer, then fine-tuning.

:func:`linearize` takes a softmax teacher (e.g. from :func:`~whiteformer.convert.from_transformers`):
a language model (:class:`~whiteformer.models.decoder.DecoderLM`, the GPT shell
:class:`~whiteformer.models.lm.GPTLM`) or an image classifier (the timm-layout ViT / DeiT, the ToST
vision shell with softmax attention); :mod:`whiteformer.convert.students` says how each becomes its
student. It returns the same shell with (causal, for language models) TSSA (ToST, Wu et al., ICLR
2025, Eq. (11); Appendix B Eq. (28)) in every layer but ``keep_softmax``, trained in the two stages
of LoLCATs (Zhang et al., "LoLCATs: On Low-Rank Linearizing of Large Language Models",
arXiv:2410.10254):

1. attention transfer (their Eq. (5)): with every other weight frozen, each TSSA layer ``l`` is
   trained to reproduce its softmax layer's output on the teacher's own hidden states,
   ``L_l = mean ||TSSA_l(x_l) - Softmax_l(x_l)||^2`` with ``x_l`` the input of the teacher's layer
   ``l``, summed over the layers, all at once;
2. fine-tuning: the task's cross-entropy (next token, or the class when the batches have labels)
   plus ``kl_weight * KL(p_teacher || p_student)`` on the logits, training the TSSA layers (fully,
   or LoRA adapters through ``peft`` when ``lora_rank`` is given, merged back into the weights at
   the end).

A TSSA layer has one projection ``qkv`` (its queries, keys and values are the same ``x W``) and
an output ``proj``; it starts from the teacher's layer by ``init``: ``"vo"`` copies the value
projection (of a grouped-query decoder: each key/value head repeated for the query heads it
serves) and the output projection, ``"qk"`` the query projection, ``"random"`` nothing.

Batches (:mod:`whiteformer.convert.students`): for a language model a (B, T) integer tensor of
token ids (targets: the ids shifted, the last ignored), or a dict with ``idx`` (B, T), optional
``targets`` (B, T) (``-1`` ignored) and optional ``cu_seqlens`` (S + 1,) for packed documents in idx
(1, T); for an image classifier images (B, C, H, W), an ``(images, labels)`` pair, or a dict with
``images`` and optional ``labels`` (B,).
"""
from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._checks import check_choice, check_instance, check_int, check_positive_real, is_int, is_real
from .students import Family, family_of

__all__ = ["linearize", "LinearizeResult", "INITS"]

#: the values of :func:`linearize`'s ``init``
INITS = ("vo", "qk", "random")


@dataclass
class LinearizeResult:
    """What :func:`linearize` measured.

    ``tssa_layers``: the indices of the layers made TSSA. ``transfer_before`` / ``transfer_after``:
    each TSSA layer's transfer loss (mean squared difference to its softmax layer's output) on the
    held-out batch before and after stage 1. ``kl_swap``, ``kl_transfer``, ``kl_finetune``: the mean
    KL(teacher || student) of the output distributions (per token of a language model, per image of
    a classifier) on the held-out batch for the plain swap, after stage 1 and after stage 2.
    ``transfer_history`` / ``finetune_history``: the training losses per step.
    """

    tssa_layers: List[int]
    transfer_before: List[float]
    transfer_after: List[float] = field(default_factory=list)
    kl_swap: float = float("nan")
    kl_transfer: float = float("nan")
    kl_finetune: float = float("nan")
    transfer_history: List[List[float]] = field(default_factory=list)
    finetune_history: List[float] = field(default_factory=list)


def _capture(fam: Family, layers: List[int], batch: Dict[str, Any]):
    """The teacher run on ``batch`` -> (logits, {layer: (attention input, its mask, cu_seqlens, attention output)})."""
    seen: Dict[int, Any] = {}
    hooks = []
    for i in layers:
        def hook(mod, args, kwargs, out, i=i):
            seen[i] = (args[0].detach(), args[1] if len(args) > 1 else kwargs.get("attn_mask"),
                       kwargs.get("cu_seqlens"), out.detach())
        hooks.append(fam.attn(fam.teacher, i).register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            logits = fam.logits(fam.teacher, batch)
    finally:
        for h in hooks:
            h.remove()
    return logits, seen


def _transfer_losses(fam: Family, student: nn.Module, seen: Dict[int, Any], layers: List[int]) -> List[torch.Tensor]:
    out = []
    for i in layers:
        x, mask, cu, y = seen[i]
        packed = {} if cu is None else {"cu_seqlens": cu}
        out.append(F.mse_loss(fam.attn(student, i)(x, mask, **packed).float(), y.float()))
    return out


def _kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(softmax(teacher) || softmax(student)), in float32."""
    lt = F.log_softmax(teacher_logits.float().flatten(0, -2), dim=-1)
    ls = F.log_softmax(student_logits.float().flatten(0, -2), dim=-1)
    return F.kl_div(ls, lt, log_target=True, reduction="batchmean")


def _eval_kl(fam: Family, teacher_logits: torch.Tensor, student: nn.Module, batch: Dict[str, Any]) -> float:
    with torch.no_grad():
        logits = fam.logits(student, batch)
    return float(_kl(teacher_logits, logits))


def _bar(progress: bool, total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not progress or total == 0, leave=False)


def _lora(fam: Family, student: nn.Module, layers: List[int], rank: int):
    """LoRA adapters (rank ``rank``) on the TSSA layers' ``qkv`` and ``proj`` through peft."""
    from peft import LoraConfig, inject_adapter_in_model

    targets = [f"{fam.prefix(i)}{n}" for i in layers for n in ("qkv", "proj")]
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=targets), student)
    return [p for n, p in student.named_parameters() if "lora_" in n]


def _merge_lora(fam: Family, student: nn.Module, layers: List[int]) -> None:
    """Fold the LoRA adapters into the weights and put the plain Linear layers back."""
    from peft.tuners.lora import LoraLayer

    for i in layers:
        attn = fam.attn(student, i)
        for n in ("qkv", "proj"):
            mod = getattr(attn, n)
            if isinstance(mod, LoraLayer):
                mod.merge()
                setattr(attn, n, mod.get_base_layer())


def _check(teacher, keep_softmax, transfer_steps, finetune_steps, lr, init, lora_rank, kl_weight, seed) -> Family:
    fam = family_of(teacher)
    if not isinstance(keep_softmax, (list, tuple)) or not all(is_int(i) for i in keep_softmax):
        raise ValueError(f"keep_softmax must be a list of layer indices, got {keep_softmax!r}")
    if any(not 0 <= i < fam.depth for i in keep_softmax) or len(set(keep_softmax)) != len(keep_softmax):
        raise ValueError(f"keep_softmax must hold distinct layer indices in [0, {fam.depth}), "
                         f"got {list(keep_softmax)}")
    check_int(transfer_steps, "transfer_steps", 0)
    check_int(finetune_steps, "finetune_steps", 0)
    check_positive_real(lr, "lr")
    check_choice(init, "init", INITS)
    fam.check_init(init)
    if lora_rank is not None:
        check_int(lora_rank, "lora_rank", 1)
    if not is_real(kl_weight) or not kl_weight >= 0 or kl_weight == float("inf"):
        raise ValueError(f"kl_weight must be a finite number >= 0, got {kl_weight!r}")
    check_int(seed, "seed")
    return fam


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode inside the block, in its former mode after it (an exception included)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _save_state(path, state: Dict[str, Any]) -> None:
    from .._files import atomic_write

    atomic_write(path, lambda tmp: torch.save(state, tmp))


def _load_state(path, settings: Dict[str, Any]) -> Dict[str, Any]:
    """The training state of an interrupted run at ``path``, which must have been made with ``settings``."""
    if not os.path.isfile(path):
        raise ValueError(f"resume: there is no training state {str(path)!r} to resume from")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("settings") != settings:
        theirs = state.get("settings") if isinstance(state, dict) else None
        raise ValueError(f"resume: the training state {str(path)!r} was made with other settings ({theirs}), "
                         f"not {settings}")
    return state


def linearize(teacher: nn.Module, batches: Iterable[Any], *, keep_softmax: Sequence[int] = (),
              transfer_steps: int = 100, finetune_steps: int = 100, lr: float = 1e-3, init: str = "vo",
              lora_rank: Optional[int] = None, kl_weight: float = 1.0, eval_batch: Any = None, seed: int = 0,
              progress: bool = True, checkpoint: Optional[Union[str, os.PathLike]] = None,
              checkpoint_every: int = 50, resume: bool = False) -> "tuple[nn.Module, LinearizeResult]":
    """Teacher -> ``(student, result)``: the teacher's shell with TSSA outside ``keep_softmax``,
    after ``transfer_steps`` of attention transfer and ``finetune_steps`` of fine-tuning (see the
    module docstring), in eval mode; the teacher is left as it was. ``teacher``: a softmax language
    model or image classifier (:data:`~whiteformer.convert.students.TEACHERS`; another is a ValueError).

    ``batches``: a sequence of batches (cycled) or an iterator of them (one per step). ``eval_batch``:
    the held-out batch the result is measured on (None: the first of ``batches``, drawn before
    training when they are an iterator). ``lr``: AdamW's learning rate of both stages. ``lora_rank``
    None: stage 2 trains the TSSA layers' weights; R: LoRA adapters of rank R on their ``qkv`` and
    ``proj`` (through peft), merged in at the end. ``progress``: tqdm bars, the per-layer transfer
    losses on the postfix. ``transfer_steps=0, finetune_steps=0`` gives the plain swap.

    ``checkpoint``: a file the training state (student, optimizer, step, losses so far) is written
    to, whole or not at all, every ``checkpoint_every`` steps and at the end of each stage.
    ``resume=True`` continues from it: the batches already used are drawn again and skipped (give
    the same ``batches``), so the run ends as the uninterrupted one would; the settings must match.
    """
    fam = _check(teacher, keep_softmax, transfer_steps, finetune_steps, lr, init, lora_rank, kl_weight, seed)
    check_instance(batches, "batches", Iterable, "an iterable of batches")
    check_int(checkpoint_every, "checkpoint_every", 1)
    check_instance(resume, "resume", bool, "a bool")
    if resume and checkpoint is None:
        raise ValueError("resume=True needs the checkpoint file to resume from")
    keep = sorted(int(i) for i in keep_softmax)
    layers = [i for i in range(fam.depth) if i not in keep]
    settings = dict(keep_softmax=keep, transfer_steps=transfer_steps, finetune_steps=finetune_steps, lr=float(lr),
                    init=init, lora_rank=lora_rank, kl_weight=float(kl_weight), seed=seed)
    state = _load_state(checkpoint, settings) if resume else None
    if isinstance(batches, Sequence):
        if not len(batches):
            raise ValueError("batches is empty")
        stream = itertools.cycle(batches)
        held = batches[0] if eval_batch is None else eval_batch
    else:
        stream = iter(batches)
        held = next(stream) if eval_batch is None else eval_batch
    drawn = [0]

    def draw() -> Dict[str, Any]:
        try:
            batch = next(stream)
        except StopIteration:
            raise ValueError(f"batches ran out after {drawn[0]} batches; the run needs transfer_steps + "
                             f"finetune_steps = {transfer_steps + finetune_steps} (give a sequence, which is cycled)"
                             ) from None
        drawn[0] += 1
        return batch

    device = next(teacher.parameters()).device
    held = fam.split(held, device)
    for _ in range(state["drawn"] if state else 0):  # the batches the interrupted run used
        draw()

    with _eval_mode(teacher), torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
        student = fam.student(keep, init, seed)
        student.eval()
        for p in student.parameters():
            p.requires_grad_(False)
        held_logits, held_seen = _capture(fam, layers, held)
        with torch.no_grad():
            before = [float(v) for v in _transfer_losses(fam, student, held_seen, layers)]
        result = LinearizeResult(layers, before, kl_swap=_eval_kl(fam, held_logits, student, held))
        start = 0
        if state is not None:
            for k in ("transfer_history", "finetune_history", "transfer_after", "kl_transfer"):
                setattr(result, k, state["result"][k])
            start = state["step"]

        def save(stage: int, step: int, opt, every: int = checkpoint_every) -> None:
            """The state after ``step`` steps of ``stage`` (every ``every`` steps)."""
            if checkpoint is not None and step % every == 0:
                _save_state(checkpoint, {"settings": settings, "stage": stage, "step": step,
                                         "drawn": (step if stage == 1 else transfer_steps + step),
                                         "model": student.state_dict(), "opt": opt.state_dict(),
                                         "result": asdict(result)})

        # stage 1: attention transfer, every TSSA layer at once, everything else frozen
        params = [p for i in layers for p in fam.attn(student, i).parameters()]
        stage1_done = state is not None and state["stage"] == 2
        if transfer_steps and params and not stage1_done:
            torch.manual_seed(seed)
            for p in params:
                p.requires_grad_(True)
            opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
            if state is not None:
                student.load_state_dict(state["model"])
                opt.load_state_dict(state["opt"])
            with _bar(progress, transfer_steps, "attention transfer") as bar:
                bar.update(start)
                for step in range(start, transfer_steps):
                    _, seen = _capture(fam, layers, fam.split(draw(), device))
                    losses = _transfer_losses(fam, student, seen, layers)
                    opt.zero_grad(set_to_none=True)
                    torch.stack(losses).sum().backward()
                    opt.step()
                    result.transfer_history.append([float(v.detach()) for v in losses])
                    bar.set_postfix({f"L{i}": f"{v:.3g}" for i, v in zip(layers, result.transfer_history[-1])})
                    bar.update()
                    if step + 1 < transfer_steps:
                        save(1, step + 1, opt)
            for p in params:
                p.requires_grad_(False)
        if not stage1_done:
            with torch.no_grad():
                result.transfer_after = [float(v) for v in _transfer_losses(fam, student, held_seen, layers)]
            result.kl_transfer = _eval_kl(fam, held_logits, student, held)
        start = state["step"] if stage1_done else 0

        # stage 2: task loss + kl_weight * KL(teacher || student), the TSSA layers (or their LoRA adapters)
        if finetune_steps and layers:
            torch.manual_seed(seed)
            if lora_rank is not None:
                params = _lora(fam, student, layers, lora_rank)
            for p in params:
                p.requires_grad_(True)
            opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
            if stage1_done:
                student.load_state_dict(state["model"])
                opt.load_state_dict(state["opt"])
            else:
                save(2, 0, opt, every=1)  # stage 1 done: a resume starts from here
            with _bar(progress, finetune_steps, "fine-tuning") as bar:
                bar.update(start)
                for step in range(start, finetune_steps):
                    b = fam.split(draw(), device)
                    with torch.no_grad():
                        t_logits = fam.logits(teacher, b)
                    logits, task = fam.loss(student, b)
                    loss = task + kl_weight * _kl(t_logits, logits) if kl_weight else task
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    result.finetune_history.append(float(loss.detach()))
                    bar.set_postfix(loss=f"{result.finetune_history[-1]:.4g}")
                    bar.update()
                    if step + 1 < finetune_steps:
                        save(2, step + 1, opt)
            if lora_rank is not None:
                _merge_lora(fam, student, layers)
            for p in student.parameters():
                p.requires_grad_(False)
        result.kl_finetune = _eval_kl(fam, held_logits, student, held)
        for p in student.parameters():
            p.requires_grad_(True)
    return student.eval(), result
