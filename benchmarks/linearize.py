"""Linearizing a softmax decoder into causal TSSA, measured in miniature on Shakespeare.

A softmax ``decoder_base``-style teacher (RMSNorm, SwiGLU, rotary grouped-query attention, 4
layers) is trained here with ``whiteformer train`` on the Shakespeare text, tokenized by a
byte-level BPE of a few thousand tokens (``whiteformer prepare-text``'s ``--train-tokenizer``).
:func:`whiteformer.convert.linearize` then turns it into causal TSSA (ToST, Wu et al., ICLR 2025)
by LoLCATs' two stages (Zhang et al., arXiv:2410.10254): attention transfer, then fine-tuning with
the LM loss plus KL to the teacher. Every row is measured on the same held-out windows of the
validation split (validation loss and perplexity):

- ``teacher``; ``swap``: the plain swap (no training), one per ``init``;
- ``transfer``: after attention transfer, one per ``init`` ("vo", "qk", "random"); the init with
  the lowest validation loss after transfer ("the winner") is used for the rows below;
- ``transfer+finetune``: both stages, pure TSSA;
- ``hybrid 1/4``, ``hybrid 1/2``: the same with 1 of 4 (2 of 4) layers kept softmax: the layers
  whose transfer loss, relative to the size of their softmax output, stays highest after transfer;
- ``tost scratch (same tokens)``: the TSSA shell trained from scratch with ``whiteformer train`` on
  as many tokens as the linearization used; ``tost scratch (teacher tokens)``: on the teacher's.

Each row also has its tokens (training windows x their length), wall time (1 thread), and the
generation cost of its architecture at 1k, 4k and 16k tokens of context: the size of the
generation state (the bytes of its tensors: a key/value cache per softmax layer, which grows with
the context, a constant-size state per TSSA layer) and the median time of a few ``step`` calls
after a real ``prefill`` of that many tokens. The goals of the study (pure TSSA within 3 % of the
teacher's validation loss with at most 5 % of its training tokens; the 1-in-4 hybrid within 1 %)
are written next to what was measured.

Presets: ``smoke`` (seconds, for the tests), ``tiny`` (the default: about 1M parameters, a few
hundred teacher steps, fits about half an hour at 1 thread) and ``full`` (the 10-30M-parameter
teacher of the study's plan, hours on a CPU)::

    python -m benchmarks.linearize [--preset tiny|full|smoke] [--text FILE] [--out FILE] [--work DIR]
                                   [--no-vision] [--mnist DIR]

Then, unless ``--no-vision``, it runs the ViT study (:mod:`benchmarks.linearize_vision` at its
default settings, MNIST from ``--mnist``), so that one command writes both result files.

``--text`` defaults to ``../shared/data/shakespeare/complete_works.txt.xz`` relative to the
repository root. Intermediate files (token files, the teacher's run) go to ``--work`` (default
``runs/benchmarks/linearize-<preset>``); a rerun reuses the prepared tokens and a finished teacher.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from . import common
from .common import fmt_bytes, fmt_time, fmt_tokens, log

DEFAULT_TEXT = Path("..") / "shared" / "data" / "shakespeare" / "complete_works.txt.xz"
DEFAULT_OUT = common.RESULTS_DIR / "linearize.json"
INITS = ("vo", "qk", "random")
#: the study's goals: (pure TSSA) loss within 3 % of the teacher's with <= 5 % of its tokens; 1-in-4 hybrid within 1 %
GOALS = {"tssa_loss_rel": 0.03, "tssa_token_share": 0.05, "hybrid_1of4_loss_rel": 0.01, "vit_acc_points": 0.5}

# model: the teacher's shape (decoder_base's layout, built small); train: the teacher's (and the
# from-scratch ToST's) whiteformer train options; lin: the linearization's steps (batch and block as
# the teacher's); eval_windows: held-out windows every row is measured on; contexts / gen_steps: the
# generation cost; max_chars: only the text's first characters (None: all of it)
PRESETS: Dict[str, Dict[str, Any]] = {
    "smoke": dict(vocab=300, max_chars=30_000,
                  model=dict(dim=32, depth=4, num_heads=4, num_kv_heads=2, intermediate_size=64),
                  train=dict(steps=8, batch_size=4, block_size=32, lr=3e-3, warmup_steps=2),
                  lin=dict(transfer_steps=2, finetune_steps=2, lr=3e-3), eval_windows=4,
                  contexts=[32, 64, 128], gen_steps=2),
    "tiny": dict(vocab=4096, max_chars=None,
                 model=dict(dim=128, depth=4, num_heads=4, num_kv_heads=2, intermediate_size=352),
                 train=dict(steps=700, batch_size=16, block_size=128, lr=3e-3, warmup_steps=40),
                 lin=dict(transfer_steps=15, finetune_steps=20, lr=2e-3), eval_windows=96,
                 contexts=[1024, 4096, 16384], gen_steps=5),
    "full": dict(vocab=8192, max_chars=None,
                 model=dict(dim=512, depth=4, num_heads=8, num_kv_heads=4, intermediate_size=1408),
                 train=dict(steps=6000, batch_size=32, block_size=256, lr=1e-3, warmup_steps=200),
                 lin=dict(transfer_steps=150, finetune_steps=150, lr=1e-3), eval_windows=256,
                 contexts=[1024, 4096, 16384], gen_steps=8),
}
#: the train options every run shares (besides the preset's)
TRAIN_COMMON = dict(min_lr=1e-4, weight_decay=0.1, beta2=0.99, eval_batches=4, log_every=50, num_threads=1,
                    device="cpu", progress=False, tensorboard=False, report=False, keep_last=1, overwrite=True)


# ------------------------------------------------------------------------------------------ stages
def prepare_tokens(text: Path, work: Path, preset: Dict[str, Any]) -> Path:
    """The text -> ``work/data`` (train.bin / val.bin / meta.json / tokenizer.json) through
    ``whiteformer prepare-text``'s :func:`~whiteformer.app.prepare_text.prepare_text` with a BPE of
    ``preset["vocab"]`` tokens (reused when already made with the same settings)."""
    from whiteformer.app.prepare_text import prepare_text

    data = work / "data"
    key = {"text": str(text), "vocab": preset["vocab"], "max_chars": preset["max_chars"]}
    stamp = work / "data.json"
    if (data / "meta.json").is_file() and stamp.is_file() and json.loads(stamp.read_text()) == key:
        return data
    source = text
    if preset["max_chars"] is not None:  # only the first characters: a small copy of them
        from whiteformer.app.prepare_text import iter_pieces

        chunks, size = [], 0
        for piece, _ in iter_pieces([text]):
            chunks.append(piece)
            size += len(piece)
            if size >= preset["max_chars"]:
                break
        source = work / "text.txt"
        common.write_text(source, "".join(chunks)[:preset["max_chars"]])
    prepare_text([str(source)], data, train_tokenizer=preset["vocab"], overwrite=True, progress=False,
                 say=lambda m: log(f"  prepare-text: {m}"))
    common.write_text(stamp, json.dumps(key) + "\n")
    return data


def train_lm(model: str, run_dir: Path, data: Path, preset: Dict[str, Any], steps: int, seed: int) -> Dict[str, Any]:
    """``whiteformer train`` (its Python entry point) of ``model`` in the preset's shape on the token
    files; reused when ``run_dir/result.json`` exists. -> {"final_dir", "train_time_s", "tokens", ...}."""
    from whiteformer.app.train import TrainConfig, train

    done = run_dir / "result.json"
    if done.is_file():
        return json.loads(done.read_text())
    tr = dict(preset["train"], steps=steps, warmup_steps=min(preset["train"]["warmup_steps"], max(steps // 10, 1)))
    cfg = TrainConfig(model=model, model_args=dict(preset["model"], max_len=None), dataset="tokens",
                      data_dir=str(data), eval_split="val", seed=seed, out=str(run_dir), **tr, **TRAIN_COMMON)
    t0 = time.perf_counter()
    res = train(cfg, command="benchmarks.linearize (whiteformer.app.train.train)")
    out = {"final_dir": res["final_dir"], "train_time_s": res.get("train_time_s", time.perf_counter() - t0),
           "steps": steps, "tokens": steps * tr["batch_size"] * tr["block_size"],
           "train_eval": res.get("final_eval")}
    common.write_text(done, json.dumps(out, indent=1) + "\n")
    return out


def eval_windows(data: Path, preset: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """The held-out windows every row is measured on: ``eval_windows`` windows of ``block_size``
    tokens evenly spread over the validation split -> {"idx", "targets"} (W, block_size)."""
    from whiteformer.app.data.registry import dataset_builder

    ds = dataset_builder("tokens")(split="val", data_dir=str(data))
    T, W = preset["train"]["block_size"], preset["eval_windows"]
    starts = torch.linspace(0, len(ds) - T - 2, W).long()
    x, y = ds.get_windows(starts, T)
    return {"idx": x, "targets": y}


@torch.no_grad()
def val_loss(model, windows: Dict[str, torch.Tensor], chunk: int = 8) -> float:
    """Mean next-token cross-entropy of ``model`` over the held-out windows (nats per token)."""
    model.eval()
    total, n = 0.0, 0
    for i in range(0, windows["idx"].shape[0], chunk):
        x, y = windows["idx"][i:i + chunk], windows["targets"][i:i + chunk]
        _, loss = model(x, y)
        total += float(loss) * y.numel()
        n += y.numel()
    return total / n


def train_batches(data: Path, preset: Dict[str, Any], seed: int):
    """Random training windows for :func:`~whiteformer.convert.linearize` (as ``whiteformer linearize`` draws
    them) and one held-out validation batch for its KL."""
    from whiteformer.app.data.registry import dataset_builder
    from whiteformer.app.linearize_cli import _windows

    tr = preset["train"]
    train_ds = dataset_builder("tokens")(split="train", data_dir=str(data))
    val_ds = dataset_builder("tokens")(split="val", data_dir=str(data))
    held = next(_windows(val_ds, tr["batch_size"], tr["block_size"], seed + 1))
    return _windows(train_ds, tr["batch_size"], tr["block_size"], seed), held


def relative_transfer(res, teacher, held) -> List[float]:
    """Each TSSA layer's transfer loss after stage 1 over the mean square of its softmax layer's
    output on the held-out batch (1: no better than outputting zeros)."""
    from whiteformer.convert.linearize import _capture
    from whiteformer.convert.students import family_of

    fam = family_of(teacher)
    _, seen = _capture(fam, res.tssa_layers, fam.split(held, torch.device("cpu")))
    return [a / float(seen[i][3].float().pow(2).mean()) for i, a in zip(res.tssa_layers, res.transfer_after)]


def run_linearize(teacher, data: Path, preset: Dict[str, Any], *, init: str, transfer: int, finetune: int,
                  keep: Sequence[int] = (), seed: int = 0):
    """One :func:`~whiteformer.convert.linearize` run -> (student, result, seconds, tokens)."""
    from whiteformer.convert import linearize

    batches, held = train_batches(data, preset, seed)
    t0 = time.perf_counter()
    student, res = linearize(teacher, batches, keep_softmax=list(keep), transfer_steps=transfer,
                             finetune_steps=finetune, lr=preset["lin"]["lr"], init=init, eval_batch=held,
                             seed=seed, progress=False)
    tr = preset["train"]
    return student, res, time.perf_counter() - t0, (transfer + finetune) * tr["batch_size"] * tr["block_size"], held


@torch.no_grad()
def generation_cost(model, contexts: Sequence[int], steps: int, seed: int = 0) -> List[Dict[str, Any]]:
    """Per context P: a real prefill of P random tokens (timed), then ``steps`` single-token steps;
    the state's bytes (its tensors) and the median step time."""
    from .generation import _prefill_state

    model.eval()
    g = torch.Generator().manual_seed(seed)
    out = []
    for P in contexts:
        common.trim_heap()
        idx = torch.randint(0, model.vocab_size, (1, P), generator=g)
        t0 = time.perf_counter()
        state = _prefill_state(model, idx)
        prefill_s = time.perf_counter() - t0
        tok = idx[:, -1]
        samples = []
        for r in range(steps + 1):  # the first step is a warm-up
            t0 = time.perf_counter()
            logits, state = model.step(tok, state)
            if r:
                samples.append(time.perf_counter() - t0)
            tok = logits.argmax(-1)
        out.append({"context": P, "prefill_s": prefill_s, "per_token_s": statistics.median(samples),
                    "per_token_samples_s": samples, "state_bytes": common.tensor_bytes(state.layers),
                    "state_kinds": [type(s).__name__ for s in state.layers]})
        del state
    return out


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------ study
def run(preset_name: str = "tiny", text: Optional[Path] = None, out: Optional[Path] = DEFAULT_OUT,
        work: Optional[Path] = None, seed: int = 0, command: str = "") -> Dict[str, Any]:
    """The whole study (see the module docstring) -> the result dictionary (written to ``out``)."""
    from whiteformer.models import from_pretrained

    if preset_name not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {preset_name!r}")
    preset = PRESETS[preset_name]
    text = Path(text) if text is not None else common.REPO_ROOT / DEFAULT_TEXT
    if not text.is_file():
        raise FileNotFoundError(f"--text {str(text)!r} is not a file (the Shakespeare text; see --help)")
    work = Path(work) if work is not None else common.REPO_ROOT / "runs" / "benchmarks" / f"linearize-{preset_name}"
    work.mkdir(parents=True, exist_ok=True)
    common.setup_torch(1, seed)
    t_start = time.perf_counter()
    info = common.machine_info()
    log(f"linearize ({preset_name}): {common.machine_string(info)}, load {info['loadavg']}")

    data = prepare_tokens(text, work, preset)
    meta = json.loads((data / "meta.json").read_text())
    windows = eval_windows(data, preset)
    tr = preset["train"]
    window_tokens = tr["batch_size"] * tr["block_size"]
    lin_steps = preset["lin"]["transfer_steps"] + preset["lin"]["finetune_steps"]

    log("  teacher: whiteformer train decoder_base")
    t_run = train_lm("decoder_base", work / "teacher", data, preset, tr["steps"], seed)
    teacher = from_pretrained(t_run["final_dir"]).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    teacher_loss = val_loss(teacher, windows)
    rows: List[Dict[str, Any]] = []
    archs: Dict[str, Any] = {"softmax": teacher}

    def add(name: str, stage: str, model, tokens: int, wall_s: float, arch: str, **extra) -> Dict[str, Any]:
        loss = val_loss(model, windows)
        row = {"name": name, "stage": stage, "val_loss": loss, "val_ppl": math.exp(loss),
               "loss_rel_to_teacher": loss / teacher_loss - 1.0, "tokens": tokens,
               "token_share_of_teacher": tokens / t_run["tokens"], "wall_s": wall_s, "arch": arch,
               "params": n_params(model), **extra}
        rows.append(row)
        log(f"  {name:34s} val loss {loss:.4f} (ppl {row['val_ppl']:.1f}, {100 * row['loss_rel_to_teacher']:+.1f} %), "
            f"{fmt_tokens(tokens)} tokens, {fmt_time(wall_s)}")
        return row

    add("teacher (softmax)", "teacher", teacher, t_run["tokens"], t_run["train_time_s"], "softmax",
        train_eval=t_run.get("train_eval"))

    def lin_extra(res, rel=None) -> Dict[str, Any]:
        return {"tssa_layers": res.tssa_layers, "transfer_before": res.transfer_before,
                "transfer_after": res.transfer_after, "transfer_after_relative": rel, "kl_swap": res.kl_swap,
                "kl_transfer": res.kl_transfer, "kl_finetune": res.kl_finetune}

    T, F = preset["lin"]["transfer_steps"], preset["lin"]["finetune_steps"]
    transfer_rows = {}
    for init in INITS:
        student, res, wall, _, _ = run_linearize(teacher, data, preset, init=init, transfer=0, finetune=0, seed=seed)
        add(f"plain swap, init {init}", "swap", student, 0, wall, "tssa", init=init, **lin_extra(res))
        student, res, wall, tokens, held = run_linearize(teacher, data, preset, init=init, transfer=T, finetune=0,
                                                         seed=seed)
        rel = relative_transfer(res, teacher, held)
        transfer_rows[init] = add(f"after transfer, init {init}", "transfer", student, T * window_tokens, wall,
                                  "tssa", init=init, **lin_extra(res, rel))
    best = min(INITS, key=lambda i: transfer_rows[i]["val_loss"])
    rel = transfer_rows[best]["transfer_after_relative"]
    order = sorted(range(len(rel)), key=lambda i: -rel[i])  # the layers matched worst first
    depth = teacher.depth
    log(f"  best init after transfer: {best}; relative transfer loss per layer {[round(r, 3) for r in rel]}")

    student, res, wall, tokens, held = run_linearize(teacher, data, preset, init=best, transfer=T, finetune=F,
                                                     seed=seed)
    add("after transfer + fine-tuning", "finetune", student, tokens, wall, "tssa", init=best,
        **lin_extra(res, relative_transfer(res, teacher, held)))
    archs["tssa"] = student
    for k, label in ((max(1, depth // 4), "1 of 4"), (max(1, depth // 2), "1 of 2")):
        keep = sorted(order[:k])
        student, res, wall, tokens, held = run_linearize(teacher, data, preset, init=best, transfer=T, finetune=F,
                                                         keep=keep, seed=seed)
        arch = "hybrid " + ",".join(map(str, keep))
        add(f"hybrid, {label} softmax (layers {', '.join(map(str, keep))})", f"hybrid {label}", student, tokens,
            wall, arch, init=best, keep_softmax=keep, **lin_extra(res, relative_transfer(res, teacher, held)))
        archs[arch] = student

    for steps, label in ((lin_steps, "same tokens as the linearization"), (tr["steps"], "the teacher's tokens")):
        log(f"  ToST from scratch: {steps} steps")
        s_run = train_lm("tost_decoder_base", work / f"tost_scratch_{steps}", data, preset, steps, seed)
        model = from_pretrained(s_run["final_dir"]).eval()
        add(f"ToST from scratch, {label}", "scratch", model, s_run["tokens"], s_run["train_time_s"], "tssa",
            train_eval=s_run.get("train_eval"))

    log("  generation cost per architecture")
    generation = {}
    for arch, model in archs.items():
        generation[arch] = generation_cost(model, preset["contexts"], preset["gen_steps"], seed)
        log(f"    {arch:14s} " + ", ".join(f"{fmt_tokens(g['context'])}: {fmt_time(g['per_token_s'])}/token, state "
                                         f"{fmt_bytes(g['state_bytes'])}" for g in generation[arch]))

    result = {"benchmark": "linearize", "preset": preset_name, "settings": preset,
              "train_common": {k: v for k, v in TRAIN_COMMON.items() if k != "overwrite"},
              "issue_size_run": preset_name == "full", "planned_teacher_params": "10M-30M (preset full)",
              "teacher_params": n_params(teacher),
              "data": {"text": text.name, "vocab_size": meta["vocab_size"], "train_tokens": meta["train_tokens"],
                       "val_tokens": meta["val_tokens"], "eval_windows": preset["eval_windows"],
                       "eval_tokens": int(windows["targets"].numel())},
              "best_init": best, "layers_by_relative_transfer_loss": order, "goals": GOALS,
              "goal_results": goal_results(rows), "rows": rows, "generation": generation,
              "machine": info, "threads": torch.get_num_threads(), "command": command,
              "loadavg_end": common.loadavg(), "wall_s": time.perf_counter() - t_start}
    if out is not None:
        common.write_json(Path(out), result)
        log(f"wrote {out}")
    return result


def goal_results(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The goals against the measured rows: the best pure-TSSA linearized row within the token
    budget, and the 1-in-4 hybrid."""
    budget = GOALS["tssa_token_share"]
    lin = [r for r in rows if r["stage"] in ("transfer", "finetune")]
    within = [r for r in lin if r["token_share_of_teacher"] <= budget]
    out: Dict[str, Any] = {}
    if lin:
        b = min(within or lin, key=lambda r: r["val_loss"])
        ok = b["token_share_of_teacher"] <= budget
        out["tssa"] = {"row": b["name"], "loss_rel": b["loss_rel_to_teacher"], "token_share": b["token_share_of_teacher"],
                       "within_token_budget": ok, "met": ok and b["loss_rel_to_teacher"] <= GOALS["tssa_loss_rel"]}
    h = next((r for r in rows if r["stage"] == "hybrid 1 of 4"), None)
    if h is not None:
        out["hybrid_1of4"] = {"row": h["name"], "loss_rel": h["loss_rel_to_teacher"],
                              "token_share": h["token_share_of_teacher"],
                              "met": h["loss_rel_to_teacher"] <= GOALS["hybrid_1of4_loss_rel"]}
    return out


# ------------------------------------------------------------------------------------------ report
def _pct(x: float) -> str:
    return f"{100 * x:+.1f} %"


def table(data: Dict[str, Any]) -> str:
    """The one table: every row with its loss, tokens, time and its architecture's generation cost."""
    ctx = data["settings"]["contexts"]
    gen = data["generation"]
    header = (["row", "val loss", "val ppl", "vs teacher", "tokens (share of teacher's)", "wall time"]
              + [f"state / per-token time at {fmt_tokens(P)}" for P in ctx])
    body = []
    for r in data["rows"]:
        g = {x["context"]: x for x in gen.get(r["arch"], [])}
        cells = [f"{fmt_bytes(g[P]['state_bytes'])} / {fmt_time(g[P]['per_token_s'])}" if P in g else "-" for P in ctx]
        body.append([r["name"], f"{r['val_loss']:.4f}", f"{r['val_ppl']:.1f}",
                     "-" if r["stage"] == "teacher" else _pct(r["loss_rel_to_teacher"]),
                     f"{r['tokens']:,} ({100 * r['token_share_of_teacher']:.1f} %)", fmt_time(r["wall_s"])] + cells)
    return common.markdown_table(header, body)


def transfer_lines(data: Dict[str, Any]) -> List[str]:
    """Per init: the layers' transfer loss (absolute and relative to their softmax output's mean square)."""
    out = []
    for r in data["rows"]:
        if r["stage"] in ("transfer", "finetune") or r["stage"].startswith("hybrid"):
            rel = r.get("transfer_after_relative") or []
            parts = [f"layer {i}: {a:.3g} -> {b:.3g}" + (f" ({100 * q:.0f} %)" if q is not None else "")
                     for i, a, b, q in zip(r["tssa_layers"], r["transfer_before"], r["transfer_after"],
                                           rel or [None] * len(r["tssa_layers"]))]
            out.append(f"- {r['name']}: KL to the teacher {r['kl_swap']:.3f} (swap) -> {r['kl_transfer']:.3f} "
                       f"(transfer)" + (f" -> {r['kl_finetune']:.3f} (fine-tuned)" if r["stage"] != "transfer" else "")
                       + "; transfer loss " + "; ".join(parts) + ".")
    return out


def goal_lines(data: Dict[str, Any]) -> List[str]:
    g, res = data["goals"], goal_results(data["rows"])  # as stored in the file, from its rows
    rows = {r["name"]: r for r in data["rows"]}
    order = data["layers_by_relative_transfer_loss"]
    best = next(r for r in data["rows"] if r["stage"] == "transfer" and r["init"] == data["best_init"])
    rel = best["transfer_after_relative"]
    worst = (f"the transfer loss stays high in every layer: {100 * min(rel):.0f}-{100 * max(rel):.0f} % of the mean "
             f"square of its softmax output after transfer (init {data['best_init']}), highest in layer {order[0]}")
    out = []
    t = res.get("tssa")
    if t:
        gap = t["loss_rel"] - g["tssa_loss_rel"]
        budget = "" if t["within_token_budget"] else " (over the token budget: no linearized row is within it)"
        miss = [f"the loss by {100 * gap:.1f} points" if gap > 0 else "",
                "" if t["within_token_budget"] else "the token budget"]
        out.append(f"- Pure TSSA within {100 * g['tssa_loss_rel']:.0f} % of the teacher's validation loss with at most "
                   f"{100 * g['tssa_token_share']:.0f} % of its tokens: best row *{t['row']}*, "
                   f"{_pct(t['loss_rel'])} with {100 * t['token_share']:.1f} % of the tokens{budget}: "
                   + ("**met**." if t["met"] else f"**missed**: {' and '.join(m for m in miss if m)}; {worst}."))
    h = res.get("hybrid_1of4")
    if h:
        gap = h["loss_rel"] - g["hybrid_1of4_loss_rel"]
        kept = rows[h["row"]].get("keep_softmax")
        out.append(f"- 1-in-4 hybrid within {100 * g['hybrid_1of4_loss_rel']:.0f} %: *{h['row']}*, {_pct(h['loss_rel'])}: "
                   + ("**met**." if h["met"] else f"**missed** by {100 * gap:.1f} points (layers kept softmax: "
                      f"{kept}, the ones matched worst after transfer)."))
    return out


HEADING = "Linearizing a softmax decoder into TSSA (Shakespeare, BPE)"


def section(data: Optional[Dict[str, Any]], vision: Optional[Dict[str, Any]] = None,
            heading: str = f"## {HEADING}") -> List[str]:
    """The markdown lines of the linearization section (under ``heading``), from ``linearize.json``
    (``data``) and, when given, the vision study's ``linearize_vision.json`` (``vision``)."""
    out = [heading, ""]
    if data is None:
        return out + ["**Not run yet.** Command: `.venv/bin/python -m benchmarks.linearize` (writes "
                      "`benchmarks/results/linearize.json`).", ""]
    s, d = data["settings"], data["data"]
    m, tr, lin = s["model"], s["train"], s["lin"]
    out += [
        f"Command: `{data['command'] or 'python -m benchmarks.linearize'}` (file "
        f"`benchmarks/results/linearize.json`), preset **{data['preset']}**, {data['threads']} thread, "
        f"{fmt_time(data['wall_s'])} in all, load {data['machine']['loadavg']} -> {data['loadavg_end']}.",
        "",
        f"Teacher: `decoder_base`'s layout built small, **{data['teacher_params']:,} parameters**: {m['depth']} layers, "
        f"D {m['dim']}, {m['num_heads']} query / {m['num_kv_heads']} key-value heads, SwiGLU {m['intermediate_size']}, "
        f"trained with `whiteformer train` for {tr['steps']} steps of {tr['batch_size']} windows of {tr['block_size']} "
        f"tokens on {d['text']} (a byte-level BPE of {d['vocab_size']} tokens, {d['train_tokens']:,} train / "
        f"{d['val_tokens']:,} validation tokens)."
        + ("" if data["issue_size_run"] else
           f" The planned teacher of {data['planned_teacher_params']} parameters was **not run here**: it does not fit "
           "the shared 2-core CPU; `--preset full` runs it."),
        "",
        f"Linearization (`whiteformer.convert.linearize`): {lin['transfer_steps']} attention-transfer steps, then "
        f"{lin['finetune_steps']} fine-tuning steps (LM loss + KL to the teacher, full TSSA weights), the teacher's "
        f"batch and window, AdamW lr {lin['lr']}. Every row's loss is measured on the same {d['eval_windows']} held-out "
        f"windows ({d['eval_tokens']:,} tokens); 'vs teacher' is its relative difference. The init with the lowest "
        f"loss after transfer, **{data['best_init']}**, starts the rows after it; the hybrids keep softmax the layers "
        "whose transfer loss stays highest relative to their output. Generation: the architecture's state "
        "(its tensors' bytes; the softmax layers' key/value cache grows with the context) and the median time of "
        f"{s['gen_steps']} `step` calls after a real `prefill` of that many random tokens (the same for every row of "
        "one architecture: it does not depend on the weights).",
        "",
        table(data),
        "",
        "Goals:",
        "",
        *goal_lines(data),
        "- ViT within 0.5 points of accuracy: " + (
            "see below." if vision else "not part of this study (`benchmarks/linearize_vision.py`, "
            "`benchmarks/results/linearize_vision.json`; not run yet)."),
        "",
        "Transfer loss per TSSA layer (mean squared difference to its softmax layer's output on the held-out batch, "
        "before -> after transfer; in brackets after transfer relative to the mean square of that output, 100 % being "
        "no better than zeros) and the mean per-token KL(teacher || student) on that batch:",
        "",
        *transfer_lines(data),
        "",
    ]
    if vision:
        try:
            from .linearize_vision import section as vision_section

            out += ["### A DeiT-style teacher on MNIST (`python -m benchmarks.linearize_vision`)", "",
                    *vision_section(vision).rstrip("\n").split("\n"), ""]
        except (ImportError, KeyError, TypeError) as e:  # the vision study's format is its own
            out += [f"(vision rows not rendered: {type(e).__name__}: {e}; see linearize_vision.json)", ""]
    return out


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.linearize", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=list(PRESETS), default="tiny", help="model and training size (default tiny)")
    p.add_argument("--text", type=Path, default=None,
                   help=f"the Shakespeare text (default: {DEFAULT_TEXT} relative to the repository root)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="result file (default benchmarks/results/linearize.json)")
    p.add_argument("--work", type=Path, default=None, help="intermediate files (default runs/benchmarks/linearize-PRESET)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vision", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the ViT study (benchmarks.linearize_vision, its default settings) after this one")
    p.add_argument("--mnist", type=Path, default=None, help="the vision study's MNIST folder (its --data-dir)")
    a = p.parse_args(argv)
    try:
        data = run(a.preset, a.text, a.out, a.work, a.seed, common.command_string("benchmarks.linearize", argv))
    except FileNotFoundError as e:
        p.error(str(e))
    if a.vision:
        from .linearize_vision import main as vision_main

        vision_main([] if a.mnist is None else ["--data-dir", str(a.mnist)])
    return data


if __name__ == "__main__":
    main()
