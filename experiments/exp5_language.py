"""Experiment 5: causal ToST vs the softmax GPT baseline on character-level Shakespeare.

Equal parameters and steps: validation loss, training tokens/s; then generation speed (ms per
token) and state memory (bytes of the recurrent state / key-value cache) at long positions.
Claim checked (ToST Table 4, Fig. 8): comparable loss, less time and memory.

Writes ``experiments/results/exp5_language/{train.csv, generation.csv, results.json}``.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

NAME = "exp5_language"


def state_bytes(obj) -> int:
    """Bytes of every tensor inside a (nested) generation state."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(state_bytes(o) for o in obj)
    return 0


@torch.no_grad()
def generation_cost(model, position: int, new_tokens: int, batch: int, vocab: int, seed: int = 0) -> dict:
    """Prefill ``position`` random tokens, then time ``new_tokens`` single-token steps."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (batch, position), generator=g)
    t0 = time.perf_counter()
    logits, state = model.prefill(idx)
    t_prefill = time.perf_counter() - t0
    tok = logits[:, -1].argmax(-1)
    times = []
    for _ in range(new_tokens):
        t0 = time.perf_counter()
        logits, state = model.step(tok, state)
        times.append(time.perf_counter() - t0)
        tok = logits.argmax(-1)
    times.sort()
    return {"position": position, "prefill_s": t_prefill, "ms_per_token_median": 1e3 * times[len(times) // 2],
            "state_bytes": state_bytes(state.layers)}


def main(argv=None) -> int:
    from whiteformer.models import create_model

    args = C.parser(NAME, __doc__.splitlines()[0]).parse_args(argv)
    setup = C.Setup(NAME, args)
    cfg = setup.cfg
    corpus = None if cfg.get("corpus") == "builtin" else (cfg.get("corpus") or str(C.SHAKESPEARE))
    rows = []
    for seed in cfg["seeds"]:
        for key, spec in cfg["models"].items():
            rd = setup.runs / f"{key}_s{seed}"
            if C.read_json(rd / "result.json") is None and not setup.time_left():
                print(f"[{NAME}] time budget reached; not starting {key} seed {seed} (re-run to continue)")
                continue
            print(f"[{NAME}] {key} seed {seed} -> {rd}", flush=True)
            res = C.train_run(rd, model=spec["model"], model_args=spec["model_args"], dataset="text",
                              data_dir=corpus, seed=seed, **cfg["train"])
            tr = cfg["train"]
            rows.append({"name": key, "seed": seed, "params": res["params"], "val_loss": res["final_eval"]["loss"],
                         "val_ppl": res["final_eval"]["ppl"], "steps": tr["steps"],
                         "train_tokens_per_s": (res["train_samples_per_s"] or 0.0) * tr["block_size"],
                         "train_time_s": res["train_time_s"]})
            print(f"[{NAME}]   val loss {rows[-1]['val_loss']:.4f}, {rows[-1]['train_tokens_per_s']:.0f} tok/s",
                  flush=True)
    C.write_csv(setup.out / "train.csv", rows)
    gen_rows = []
    gcfg = cfg["generation"]
    vocab = 100
    for key, spec in cfg["models"].items():
        margs = dict(spec["model_args"], vocab_size=vocab, pos_emb=False, max_len=max(gcfg["positions"]) + 1)
        if spec["model"].startswith("tost"):
            margs["pos_bias"] = False
        torch.manual_seed(0)
        model = create_model(spec["model"], **margs).eval()
        for pos in gcfg["positions"]:
            r = generation_cost(model, pos, gcfg["new_tokens"], gcfg["batch"], vocab)
            gen_rows.append({"name": key, **r})
            print(f"[{NAME}] generation {key} @ {pos}: {r['ms_per_token_median']:.2f} ms/token, "
                  f"state {r['state_bytes'] / 1024:.1f} KiB", flush=True)
    C.write_csv(setup.out / "generation.csv", gen_rows)
    C.write_json(setup.out / "results.json", {"config": cfg, "command": setup.command(NAME), "train": rows,
                                              "generation": gen_rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
