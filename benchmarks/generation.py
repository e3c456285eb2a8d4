"""Causal generation (ToST Fig. 8): per-token latency and memory of causal ToST's recurrent
generation vs the softmax GPT baseline with a key/value cache, at positions P = 1k ... 16k.

Models: ``tost_lm_base`` / ``gpt_base`` (GPT-2 base dims: 12 layers, 12 heads, D 768, vocabulary
50304) and a small config (6 layers, 6 heads, D 384, same vocabulary), built with
``pos_emb=False`` (and ``pos_bias=False`` for ToST) so that no length limit applies.

At each position P the state of P consumed tokens is built, then single-token steps
(``model.step``) are timed. All states (every position, both models) are held at once and the
steps run round-robin over them (ToST at 1k, GPT at 1k, ToST at 2k, ..., then again), so that the
ratios ToST at 16k / at 1k and GPT / ToST see the same machine load. Two ways to reach position P:

* ``real``: one parallel prefill of P random tokens (``prefill``), as a user would;
* ``extend``: a real prefill of ``min(P, 1024)`` tokens, then the state is extended to length P
  without computing it: the GPT key/value cache is tiled along time to P entries, ToST's running
  sums are scaled by P / 1024 and its token count set to P. A step costs exactly what it costs
  after a real prefill (same shapes and operations; the values only matter for denormals, which
  are flushed), but reaching P = 16k with GPT-2-base dims by a real prefill takes minutes on a
  2-core CPU.

Memory: the exact size of the generation state (sum of its tensors: constant for ToST, the KV
cache for GPT) and the peak RSS delta of one step.

Usage::

    python -m benchmarks.generation [--quick] [--out DIR] [--prefill auto|real|extend]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from . import common
from .common import fmt_bytes, fmt_time, fmt_tokens, log

CONFIGS: Dict[str, Dict[str, int]] = {
    "gpt2_base": dict(depth=12, dim=768, num_heads=12, vocab_size=50304),
    "small": dict(depth=6, dim=384, num_heads=6, vocab_size=50304),
}
MODELS = {"tost": "tost_lm_base", "gpt": "gpt_base"}
EXTEND_FROM = 1024

FULL = dict(configs=["small", "gpt2_base"], positions=[1024, 2048, 4096, 8192, 16384], steps=24,
            prefill={"small": "real", "gpt2_base": "extend"})
QUICK = dict(configs=["tiny"], positions=[64, 256], steps=3, prefill={"tiny": "real"},
             extra_configs={"tiny": dict(depth=2, dim=64, num_heads=4, vocab_size=512)})


def build_model(kind: str, cfg: Dict[str, int], device: str):
    from whiteformer import create_model

    extra = dict(pos_bias=False) if kind == "tost" else {}
    model = create_model(MODELS[kind], pos_emb=False, max_len=1024, **cfg, **extra)
    return model.to(device).eval()


def _prefill_state(model, idx: torch.Tensor):
    """State after consuming ``idx`` (B, T), without the (B, T, vocab) logits of ``prefill``."""
    if hasattr(model, "_prefill_hidden"):
        return model._prefill_hidden(idx)[1]
    return model.prefill(idx)[1]


def _timed_prefill(model, idx: torch.Tensor, device: str):
    """(state after ``idx``, seconds)."""
    box = {}
    t = common.time_call(lambda: box.setdefault("state", _prefill_state(model, idx.to(device))), device)
    return box["state"], t


def extend_state(kind: str, state, length: int):
    """The state of ``kind`` extended from ``state.pos`` to ``length`` consumed tokens (see the
    module docstring): GPT tiles its KV cache, ToST scales its running sums."""
    from whiteformer.models.lm import KVCache, LMState

    p0 = state.pos
    if length == p0:
        return state
    layers = []
    for st in state.layers:
        if kind == "gpt":
            reps = -(-length // p0)
            k = st.k.repeat(1, 1, reps, 1)[:, :, :length].contiguous()
            v = st.v.repeat(1, 1, reps, 1)[:, :, :length].contiguous()
            layers.append(KVCache(k, v))
        else:
            f = length / p0
            layers.append(type(st)(st.sum_sq * f, st.sum_pi * f, st.sum_sq_pi * f, length, st.scale))
    return LMState(length, tuple(layers))


def run_config(config: str, cfg: Dict[str, int], positions: Sequence[int], *, steps: int, prefill: str,
               threads: Optional[int], device: str, seed: int = 0) -> List[Dict[str, Any]]:
    """Child-process body: both models of one config at every position. Returns result rows.

    The states at all positions are built first (and the peak memory of one step from each is
    measured alone); then the timed steps run round-robin over every (position, model) pair, so
    that a change of machine load during the run affects all positions and both models alike
    and the ratios (ToST at 16k / at 1k, GPT / ToST) compare like with like."""
    common.setup_torch(threads, seed)
    g = torch.Generator().manual_seed(seed)
    models = {k: build_model(k, cfg, device) for k in MODELS}
    params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    vocab = cfg["vocab_size"]
    tok = torch.randint(0, vocab, (1,), generator=g).to(device)
    keys = [(k, P) for P in positions for k in models]
    states, prefill_s, prefill_len, mem = {}, {}, {}, {}
    with torch.no_grad():
        for k, m in models.items():  # warm-up: short prefill and a few steps
            st = _prefill_state(m, torch.randint(0, vocab, (1, 16), generator=g).to(device))
            for _ in range(2):
                _, st = m.step(tok, st)
        base_states = {}
        for k, P in keys:
            m = models[k]
            common.trim_heap()
            if prefill == "real":
                states[(k, P)], prefill_s[(k, P)] = _timed_prefill(
                    m, torch.randint(0, vocab, (1, P), generator=g), device)
                prefill_len[(k, P)] = P
            else:
                if k not in base_states:
                    idx = torch.randint(0, vocab, (1, min(P, EXTEND_FROM)), generator=g)
                    base_states[k] = _timed_prefill(m, idx, device)
                st0, prefill_s[(k, P)] = base_states[k]
                states[(k, P)] = extend_state(k, st0, P)
                prefill_len[(k, P)] = st0.pos
        state_bytes = {key: common.tensor_bytes(st.layers) for key, st in states.items()}
        for k, P in keys:  # peak memory of one step, each alone
            with common.PeakMemory(device) as pm:
                models[k].step(tok, states[(k, P)])
            mem[(k, P)] = (pm.delta, pm.method)
        samples: Dict[tuple, List[float]] = {key: [] for key in keys}
        for r in range(steps + 2):  # 2 untimed warm-up rounds
            for k, P in keys:
                m = models[k]

                def one(key=(k, P), m=m):
                    states[key] = m.step(tok, states[key])[1]

                t = common.time_call(one, device)
                if r >= 2:
                    samples[(k, P)].append(t)
    rows = []
    for k, P in keys:
        s = common.summarize(samples[(k, P)])
        rows.append(dict(config=config, model=k, model_name=MODELS[k], params=params[k], position=P,
                         prefill=prefill, prefill_tokens=prefill_len[(k, P)], prefill_s=prefill_s[(k, P)],
                         per_token_s=s["time_s"], per_token_min_s=s["time_min_s"], steps=s["runs"],
                         samples_s=s["samples_s"], state_bytes=state_bytes[(k, P)],
                         step_peak_mem_bytes=mem[(k, P)][0], mem_method=mem[(k, P)][1], **cfg))
    return rows


def summarize_rows(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per config: ToST per-token time at the last vs the first position (target <= 1.2), the
    same for GPT, and GPT / ToST per-token time at each position."""
    out = {}
    for config in dict.fromkeys(r["config"] for r in rows):
        sel = {(r["model"], r["position"]): r for r in rows if r["config"] == config}
        pos = sorted({p for _, p in sel})
        lo, hi = pos[0], pos[-1]
        d = {"positions": [lo, hi]}
        for k in MODELS:
            if (k, lo) in sel and (k, hi) in sel:
                d[f"{k}_ratio_last_first"] = sel[(k, hi)]["per_token_s"] / sel[(k, lo)]["per_token_s"]
        d["gpt_over_tost"] = {str(p): sel[("gpt", p)]["per_token_s"] / sel[("tost", p)]["per_token_s"]
                              for p in pos if ("gpt", p) in sel and ("tost", p) in sel}  # str keys, as in JSON
        r = d.get("tost_ratio_last_first")
        d["tost_flat_target"] = 1.2
        d["tost_flat_met"] = None if r is None else r <= 1.2
        out[config] = d
    return out


def tables(rows: List[Dict[str, Any]], summary: Dict[str, Any]) -> str:
    parts = []
    for config in dict.fromkeys(r["config"] for r in rows):
        sel = {(r["model"], r["position"]): r for r in rows if r["config"] == config}
        pos = sorted({p for _, p in sel})
        r0 = next(r for r in rows if r["config"] == config)
        parts.append(f"**{config}: {r0['depth']} layers, {r0['num_heads']} heads, D {r0['dim']}, vocabulary "
                     f"{r0['vocab_size']}; state built by `{r0['prefill']}` prefill**\n")
        header = ["model", "quantity"] + [fmt_tokens(p) for p in pos]
        body = []
        for k, name in (("tost", "causal ToST (recurrent)"), ("gpt", "GPT (KV cache)")):
            body.append([name, "per-token time"] + [fmt_time(sel[(k, p)]["per_token_s"]) for p in pos])
            body.append([name, "state size"] + [fmt_bytes(sel[(k, p)]["state_bytes"]) for p in pos])
            body.append([name, "step peak RSS delta"] + [fmt_bytes(sel[(k, p)]["step_peak_mem_bytes"]) for p in pos])
        body.append(["GPT / ToST", "per-token time"] + [f"{summary[config]['gpt_over_tost'][str(p)]:.2f}x" for p in pos])
        parts.append(common.markdown_table(header, body) + "\n")
        s = summary[config]
        parts.append(f"ToST per-token time at {fmt_tokens(pos[-1])} / at {fmt_tokens(pos[0])}: "
                     f"**{s.get('tost_ratio_last_first', float('nan')):.2f}** (target <= 1.2); GPT: "
                     f"{s.get('gpt_ratio_last_first', float('nan')):.2f}.\n")
    return "\n".join(parts)


def plot(rows: List[Dict[str, Any]], out_dir: Path, suffix: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for c, config in enumerate(dict.fromkeys(r["config"] for r in rows)):
        for k, style in (("tost", "-"), ("gpt", "--")):
            pts = sorted((r["position"], r["per_token_s"], r["state_bytes"]) for r in rows
                         if r["config"] == config and r["model"] == k)
            if not pts:
                continue
            xs, ts, ms = zip(*pts)
            lab = f"{'ToST' if k == 'tost' else 'GPT'} ({config})"
            axes[0].plot(xs, [t * 1e3 for t in ts], style, marker="o", color=f"C{c}", label=lab)
            axes[1].plot(xs, [m / 2 ** 20 for m in ms], style, marker="o", color=f"C{c}", label=lab)
    for ax, yl, title in ((axes[0], "per-token time (ms)", "per-token latency"),
                          (axes[1], "generation state (MiB)", "state memory")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("position P (tokens already consumed)")
        ax.set_ylabel(yl)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    env = rows[0]["env"]
    fig.suptitle(f"causal generation, batch 1 ({env['machine']}, {env['threads']} threads)", fontsize=10)
    fig.tight_layout()
    p = out_dir / f"generation{suffix}.png"
    common.save_figure(fig, p, dpi=110)
    plt.close(fig)
    return p


def run(*, quick: bool = False, out_dir: Optional[Path] = None, configs: Optional[Sequence[str]] = None,
        positions: Optional[Sequence[int]] = None, prefill: str = "auto", threads: Optional[int] = None,
        device: str = "cpu", command: str = "", write: bool = True) -> Dict[str, Any]:
    plan = dict(QUICK if quick else FULL)
    all_configs = dict(CONFIGS, **plan.get("extra_configs", {}))
    configs = list(configs or plan["configs"])
    bad = [c for c in configs if c not in all_configs]
    if bad:
        raise ValueError(f"unknown configs {bad}; expected some of {list(all_configs)}")
    if prefill not in ("auto", "real", "extend"):
        raise ValueError(f"prefill must be 'auto', 'real' or 'extend', got {prefill!r}")
    positions = list(positions or plan["positions"])
    out_dir = Path(out_dir) if out_dir is not None else common.default_out_dir(quick)
    info = common.machine_info(device)
    log(f"generation ({'quick' if quick else 'full'}): {common.machine_string(info)}, load {info['loadavg']}")
    rows: List[Dict[str, Any]] = []
    for config in configs:
        mode = plan["prefill"].get(config, "extend") if prefill == "auto" else prefill
        try:
            res = common.run_isolated(run_config, config, all_configs[config], positions, steps=plan["steps"],
                                      prefill=mode, threads=threads, device=device, timeout=3600)
        except common.ChildFailed as e:
            log(f"  {config}: failed: {str(e).splitlines()[0]}")
            continue
        env = common.row_env(command, device, threads)
        for r in res:
            r["env"] = env
            log(f"  {config:9s} {r['model']:4s} P={r['position']:6d} per-token {fmt_time(r['per_token_s']):>9s}  "
                f"state {fmt_bytes(r['state_bytes']):>10s}  step peak {fmt_bytes(r['step_peak_mem_bytes']):>10s}  "
                f"prefill({r['prefill']}, {r['prefill_tokens']} tok) {fmt_time(r['prefill_s'])}")
        rows += res
    summary = summarize_rows(rows) if rows else {}
    for config, s in summary.items():
        log(f"  {config}: ToST per-token {fmt_tokens(s['positions'][1])}/{fmt_tokens(s['positions'][0])} = "
            f"{s.get('tost_ratio_last_first', float('nan')):.2f} (target <= 1.2), GPT "
            f"{s.get('gpt_ratio_last_first', float('nan')):.2f}")
    result = {"benchmark": "generation", "quick": quick, "plan": plan, "machine": info, "command": command,
              "loadavg_end": common.loadavg(), "summary": summary, "rows": rows}
    if write and rows:
        suffix = common.write_results(out_dir, "generation", quick, result, tables(rows, summary))
        result["plots"] = [str(plot(rows, out_dir, suffix))]
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m benchmarks.generation")
    p.add_argument("--quick", action="store_true", help="tiny model, short positions (seconds)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default benchmarks/results)")
    p.add_argument("--configs", default=None, help=f"comma-separated subset of {','.join(CONFIGS)}")
    p.add_argument("--positions", default=None, help="comma-separated positions, e.g. 1024,16384")
    p.add_argument("--prefill", default="auto", choices=["auto", "real", "extend"])
    p.add_argument("--threads", default="auto", help="torch threads per measuring process, or auto")
    p.add_argument("--device", default="cpu")
    return p


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    return run(quick=a.quick, out_dir=a.out, configs=a.configs.split(",") if a.configs else None,
               positions=[int(p) for p in a.positions.split(",")] if a.positions else None, prefill=a.prefill,
               threads=common.resolve_threads(a.threads)[0], device=a.device,
               command=common.command_string("benchmarks.generation", argv))


if __name__ == "__main__":
    main()
