"""ToST Table 4 (right): model-level time and memory of the 12-layer base language models.

The paper reports causal ToST-Base relative to GPT2-Base at context 4k: 0.60x time, 0.41x memory;
at 8k: 0.46x time, 0.24x memory. Here, at batch 1 and contexts 1k ... 8k:

* ``train``: one training step (forward with the next-token loss + backward, gradients set to
  None first); ``forward``: the evaluation forward with the loss under ``torch.no_grad``;
* models: ``tost`` (``tost_lm_base``, causal TSSA), ``gpt_sdpa`` (``gpt_base`` with
  ``F.scaled_dot_product_attention``) and ``gpt_softmax`` (``gpt_base`` with the (T, T) scores
  and softmax formed explicitly, ``fused_attn = False``), all without a length limit
  (``pos_emb=False``; ToST also ``pos_bias=False``);
* loss: ``plain`` (the (T, 50304) logits formed whole, as nanoGPT) or ``chunked``
  (:func:`whiteformer.ops.linear_cross_entropy` through ``model(idx, targets, loss_chunk=...)``:
  the logits never exist whole), the same for both models;
* time: all models in **one** process, measured side by side (round-robin, after a short
  warm-up), so a change of machine load hits them alike; peak memory: one **separate** process
  per (model, context, mode, loss), the RSS high-water mark of one step minus the RSS before it
  (model weights excluded; gradients, activations, logits included);
* profile: where a training step's time goes (one block's attention and MLP, times the depth,
  and the LM head with its loss), measured component by component at one context.

Configurations whose explicit-softmax scores would exceed ``--mem-budget`` GiB are skipped (and
recorded as skipped). Usage::

    python -m benchmarks.lm_model [--quick] [--contexts 1024,2048] [--modes train,forward]
        [--losses plain,chunked] [--models tost,gpt_sdpa,gpt_softmax] [--profile-context 1024]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from . import common
from .common import fmt_bytes, fmt_time, fmt_tokens, log

CONFIGS: Dict[str, Dict[str, int]] = {
    "base": dict(depth=12, dim=768, num_heads=12, vocab_size=50304),
    "tiny": dict(depth=2, dim=64, num_heads=4, vocab_size=512),
}
MODELS = {"tost": ("tost_lm_base", dict(pos_bias=False), None),
          "gpt_sdpa": ("gpt_base", {}, True),
          "gpt_softmax": ("gpt_base", {}, False)}
PAPER = {4096: {"time": 0.60, "memory": 0.41}, 8192: {"time": 0.46, "memory": 0.24}}  # ToST / GPT2, Table 4
FULL = dict(config="base", contexts=[1024, 2048, 4096, 8192], modes=["train", "forward"], losses=["plain", "chunked"],
            models=list(MODELS), rounds=1, loss_chunk=1024, profile_context=4096, mem_budget_gib=6.0)
QUICK = dict(config="tiny", contexts=[64, 128], modes=["train", "forward"], losses=["plain", "chunked"],
             models=list(MODELS), rounds=1, loss_chunk=32, profile_context=64, mem_budget_gib=1.0)


def build_model(kind: str, cfg: Dict[str, int], device: str = "cpu"):
    from whiteformer import create_model

    name, extra, fused = MODELS[kind]
    model = create_model(name, pos_emb=False, **cfg, **extra).to(device)
    if fused is not None:
        for blk in model.transformer.h:
            blk.attn.fused_attn = fused
    return model


def softmax_scores_bytes(kind: str, cfg: Dict[str, int], T: int, mode: str) -> int:
    """Bytes of the explicit (H, T, T) float32 scores: three copies at once in a forward, plus the
    softmax of every layer kept for the backward of a training step; 0 for the other models."""
    if kind != "gpt_softmax":
        return 0
    one = cfg["num_heads"] * T * T * 4
    return 3 * one + (cfg["depth"] * one if mode == "train" else 0)


def _step(model, idx: torch.Tensor, mode: str, loss_chunk: Optional[int]) -> None:
    if mode == "train":
        model.zero_grad(set_to_none=True)
        _, loss = model(idx, idx, loss_chunk=loss_chunk)
        loss.backward()
    else:
        with torch.no_grad():
            model(idx, idx, loss_chunk=loss_chunk)


def _chunk(loss: str, plan) -> Optional[int]:
    return plan["loss_chunk"] if loss == "chunked" else None


def time_child(plan: Dict[str, Any], threads: Optional[int], device: str) -> List[Dict[str, Any]]:
    """All models in this process; per (context, mode, loss) the models run round-robin."""
    common.setup_torch(threads)
    cfg = CONFIGS[plan["config"]]
    models = {k: build_model(k, cfg, device) for k in plan["models"]}
    g = torch.Generator().manual_seed(0)
    warm = torch.randint(0, cfg["vocab_size"], (1, 16), generator=g).to(device)
    for m in models.values():
        for mode in plan["modes"]:
            _step(m, warm, mode, None)
    budget = plan["mem_budget_gib"] * common.GiB
    rows = []
    for T in plan["contexts"]:
        idx = torch.randint(0, cfg["vocab_size"], (1, T), generator=g).to(device)
        for mode in plan["modes"]:
            for loss in plan["losses"]:
                fns, skipped = {}, []
                for k, m in models.items():
                    if softmax_scores_bytes(k, cfg, T, mode) > budget:
                        skipped.append(k)
                        continue
                    fns[k] = (lambda m=m: _step(m, idx, mode, _chunk(loss, plan)))
                samples = common.interleaved_runs(fns, device=device, rounds=plan["rounds"], warmup=False)
                for k, s in samples.items():
                    rows.append(dict(kind="time", model=k, context=T, mode=mode, loss=loss, **common.summarize(s)))
                for k in skipped:
                    rows.append(dict(kind="time", model=k, context=T, mode=mode, loss=loss, skipped=True,
                                     est_scores_bytes=softmax_scores_bytes(k, cfg, T, mode)))
                log(f"  time T={fmt_tokens(T)} {mode:7s} {loss:7s} "
                    + "  ".join(f"{k} {fmt_time(statistics.median(s))}" for k, s in samples.items()))
    return rows


def memory_child(kind: str, plan: Dict[str, Any], T: int, mode: str, loss: str, threads: Optional[int],
                 device: str) -> Dict[str, Any]:
    """Peak memory of one step of one model, alone in this process."""
    common.setup_torch(threads)
    cfg = CONFIGS[plan["config"]]
    model = build_model(kind, cfg, device)
    g = torch.Generator().manual_seed(0)
    _step(model, torch.randint(0, cfg["vocab_size"], (1, 16), generator=g).to(device), mode, _chunk(loss, plan))
    model.zero_grad(set_to_none=True)
    idx = torch.randint(0, cfg["vocab_size"], (1, T), generator=g).to(device)
    with common.PeakMemory(device) as pm:
        t = common.time_call(lambda: _step(model, idx, mode, _chunk(loss, plan)), device)
    return dict(kind="memory", model=kind, context=T, mode=mode, loss=loss, peak_bytes=pm.delta,
                mem_method=pm.method, time_s=t,
                param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()))


def profile_child(plan: Dict[str, Any], T: int, threads: Optional[int], device: str) -> List[Dict[str, Any]]:
    """Training-step time by component at context T: one block's attention and MLP (forward +
    backward on a (1, T, D) input), scaled by the depth, and the LM head with its loss."""
    common.setup_torch(threads)
    cfg = CONFIGS[plan["config"]]
    g = torch.Generator().manual_seed(0)
    rows = []
    head_done = False
    for kind in ("tost", "gpt_sdpa"):
        model = build_model(kind, cfg, device)
        blk = model.transformer.h[0]
        x = torch.randn(1, T, cfg["dim"], generator=g).to(device).requires_grad_(True)
        tgt = torch.randint(0, cfg["vocab_size"], (T,), generator=g).to(device)
        parts = {"attention": lambda: blk.attn(blk.ln_1(x)).sum().backward(),
                 "mlp": lambda: blk.mlp(blk.ln_2(x)).sum().backward()}
        if not head_done:
            from whiteformer.ops import linear_cross_entropy

            w = model.lm_head.weight
            parts["lm_head+loss (plain)"] = lambda: torch.nn.functional.cross_entropy(
                (x[0] @ w.T).float(), tgt).backward()
            parts["lm_head+loss (chunked)"] = lambda: linear_cross_entropy(
                x[0], w, tgt, chunk_size=plan["loss_chunk"]).backward()
            head_done = True
        small = torch.randn(1, 16, cfg["dim"]).to(device)
        blk.attn(blk.ln_1(small)).sum().backward()  # warm-up
        for part, fn in parts.items():
            t = common.time_call(fn, device)
            scale = cfg["depth"] if part in ("attention", "mlp") else 1
            rows.append(dict(kind="profile", model=kind if scale > 1 else "shared", part=part, context=T,
                             time_s=t, per_model_s=t * scale, times=scale))
        del model
    return rows


def summarize(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """ToST / GPT ratios per (context, mode, loss), for time and memory, with the paper's."""
    out: Dict[str, Any] = {}
    t = {(r["model"], r["context"], r["mode"], r["loss"]): r for r in rows if r["kind"] == "time" and "time_s" in r}
    m = {(r["model"], r["context"], r["mode"], r["loss"]): r for r in rows if r["kind"] == "memory"}
    for (k, T, mode, loss) in sorted(t, key=lambda x: (x[1], x[2], x[3], x[0])):
        if k == "tost":
            continue
        key = f"{mode}/{loss}/{T}/tost_over_{k}"
        d: Dict[str, Any] = {"context": T, "mode": mode, "loss": loss, "vs": k}
        if ("tost", T, mode, loss) in t:
            d["time_ratio"] = t[("tost", T, mode, loss)]["time_s"] / t[(k, T, mode, loss)]["time_s"]
        if ("tost", T, mode, loss) in m and (k, T, mode, loss) in m and m[(k, T, mode, loss)]["peak_bytes"]:
            d["memory_ratio"] = m[("tost", T, mode, loss)]["peak_bytes"] / m[(k, T, mode, loss)]["peak_bytes"]
        if T in PAPER:
            d["paper"] = PAPER[T]
        out[key] = d
    return out


def tables(result: Dict[str, Any]) -> str:
    rows, summary = result["rows"], result["summary"]
    plan = result["plan"]
    cfg = CONFIGS[plan["config"]]
    parts = [f"**{plan['config']}: {cfg['depth']} layers, {cfg['num_heads']} heads, D {cfg['dim']}, vocabulary "
             f"{cfg['vocab_size']}, batch 1; chunked loss: {plan['loss_chunk']} positions per chunk**\n"]
    t = {(r["model"], r["context"], r["mode"], r["loss"]): r for r in rows if r["kind"] == "time"}
    m = {(r["model"], r["context"], r["mode"], r["loss"]): r for r in rows if r["kind"] == "memory"}
    header = ["mode", "loss", "context", *[f"{k} time" for k in plan["models"]],
              *[f"{k} peak mem." for k in plan["models"]], "ToST / GPT-SDPA time, mem.",
              "ToST / GPT-softmax time, mem.", "paper (ToST / GPT2) time, mem."]
    body = []
    for mode in plan["modes"]:
        for loss in plan["losses"]:
            for T in plan["contexts"]:
                def cell_t(k):
                    r = t.get((k, T, mode, loss))
                    return "-" if r is None else ("skipped" if r.get("skipped") else fmt_time(r["time_s"]))

                def cell_m(k):
                    r = m.get((k, T, mode, loss))
                    return "-" if r is None else fmt_bytes(r["peak_bytes"])

                def ratio(k):
                    d = summary.get(f"{mode}/{loss}/{T}/tost_over_{k}", {})
                    a, b = d.get("time_ratio"), d.get("memory_ratio")
                    return f"{'-' if a is None else f'{a:.2f}x'}, {'-' if b is None else f'{b:.2f}x'}"

                paper = PAPER.get(T)
                body.append([mode, loss, fmt_tokens(T), *[cell_t(k) for k in plan["models"]],
                             *[cell_m(k) for k in plan["models"]], ratio("gpt_sdpa"), ratio("gpt_softmax"),
                             "-" if paper is None else f"{paper['time']:.2f}x, {paper['memory']:.2f}x"])
    parts.append(common.markdown_table(header, body) + "\n")
    prof = [r for r in rows if r["kind"] == "profile"]
    if prof:
        T = prof[0]["context"]
        parts.append(f"Where a training step's time goes at context {fmt_tokens(T)} (each component's forward + "
                     "backward measured alone; attention and MLP of one block times the depth):\n")
        body = [[r["model"], r["part"], fmt_time(r["time_s"]), str(r["times"]), fmt_time(r["per_model_s"])]
                for r in prof]
        parts.append(common.markdown_table(["model", "component", "time", "x", "per model step"], body) + "\n")
    return "\n".join(parts)


def run(*, quick: bool = False, out_dir: Optional[Path] = None, overrides: Optional[Dict[str, Any]] = None,
        threads: Optional[int] = None, device: str = "cpu", command: str = "", write: bool = True,
        timeout: float = 3600) -> Dict[str, Any]:
    plan = dict(QUICK if quick else FULL, **(overrides or {}))
    bad = [k for k in plan["models"] if k not in MODELS]
    if bad or plan["config"] not in CONFIGS:
        raise ValueError(f"unknown models {bad} or config {plan['config']!r}; expected models from {list(MODELS)}")
    out_dir = Path(out_dir) if out_dir is not None else common.default_out_dir(quick)
    info = common.machine_info(device)
    log(f"lm_model ({'quick' if quick else 'full'}): {common.machine_string(info)}, load {info['loadavg']}")
    env = common.row_env(command, device, threads)
    rows: List[Dict[str, Any]] = []
    try:
        rows += common.run_isolated(time_child, plan, threads, device, timeout=timeout)
    except common.ChildFailed as e:
        log(f"  time: failed: {str(e).splitlines()[0]}")
    cfg = CONFIGS[plan["config"]]
    for T in plan["contexts"]:
        for mode in plan["modes"]:
            for loss in plan["losses"]:
                for k in plan["models"]:
                    if softmax_scores_bytes(k, cfg, T, mode) > plan["mem_budget_gib"] * common.GiB:
                        continue
                    try:
                        r = common.run_isolated(memory_child, k, plan, T, mode, loss, threads, device, timeout=timeout)
                    except common.ChildFailed as e:
                        log(f"  memory {k} T={T} {mode} {loss}: failed: {str(e).splitlines()[0]}")
                        continue
                    rows.append(r)
                    log(f"  memory {k:11s} T={fmt_tokens(T)} {mode:7s} {loss:7s} peak {fmt_bytes(r['peak_bytes'])}")
    if plan.get("profile_context"):
        try:
            rows += common.run_isolated(profile_child, plan, plan["profile_context"], threads, device,
                                        timeout=timeout)
        except common.ChildFailed as e:
            log(f"  profile: failed: {str(e).splitlines()[0]}")
    for r in rows:
        r["env"] = env
    result = {"benchmark": "lm_model", "quick": quick, "plan": plan, "machine": info, "command": command,
              "loadavg_end": common.loadavg(), "paper": {str(k): v for k, v in PAPER.items()},
              "summary": summarize(rows), "rows": rows}
    if write and rows:
        common.write_results(out_dir, "lm_model", quick, result, tables(result))
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m benchmarks.lm_model")
    p.add_argument("--quick", action="store_true", help="tiny model, short contexts (seconds)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default benchmarks/results)")
    p.add_argument("--contexts", default=None, help="comma-separated contexts, e.g. 1024,2048")
    p.add_argument("--modes", default=None, help="train,forward")
    p.add_argument("--losses", default=None, help="plain,chunked")
    p.add_argument("--models", default=None, help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per configuration (default 1)")
    p.add_argument("--profile-context", type=int, default=None, help="context of the component profile (0: none)")
    p.add_argument("--mem-budget", type=float, default=None, help="GiB of explicit-softmax scores above which "
                   "gpt_softmax is skipped")
    p.add_argument("--threads", default="auto", help="torch threads per measuring process, or auto")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per child process")
    p.add_argument("--device", default="cpu")
    return p


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    ov: Dict[str, Any] = {}
    if a.contexts:
        ov["contexts"] = [int(c) for c in a.contexts.split(",")]
    for name in ("modes", "losses", "models"):
        if getattr(a, name):
            ov[name] = getattr(a, name).split(",")
    if a.rounds is not None:
        ov["rounds"] = a.rounds
    if a.profile_context is not None:
        ov["profile_context"] = a.profile_context
    if a.mem_budget is not None:
        ov["mem_budget_gib"] = a.mem_budget
    return run(quick=a.quick, out_dir=a.out, overrides=ov, threads=common.resolve_threads(a.threads)[0],
               device=a.device, command=common.command_string("benchmarks.lm_model", argv), timeout=a.timeout)


if __name__ == "__main__":
    main()
