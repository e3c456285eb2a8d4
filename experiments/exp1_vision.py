"""Experiment 1: ToST vs ViT-cab (softmax) vs XCiT vs DMST vs ECA vs CRATE on MNIST, same shell and budget.

Claims checked (see docs/results.md): ToST matches softmax attention (ToST Table 2); DMST beats
ToST by about 1 point (DMSA Table I); ECA is comparable to ToST at small scale (ECA Table 1, Fig. 9).

Writes ``experiments/results/exp1_vision/{runs.csv, summary.csv, summary.json}``; one run directory
per (model, seed) under ``runs/experiments/exp1_vision/`` (finished runs are skipped, interrupted
ones resumed).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

NAME = "exp1_vision"


def run_dirs(setup: C.Setup):
    """(key, seed, run_dir) in seed-major order."""
    for seed in setup.cfg["seeds"]:
        for key in setup.cfg["models"]:
            yield key, seed, setup.runs / f"{key}_s{seed}"


def train_kwargs(setup: C.Setup, key: str, seed: int) -> dict:
    cfg = setup.cfg
    spec = dict(cfg["models"][key])
    model = spec.pop("model")
    margs = {**cfg["model_args"], **spec.get("model_args", {})}
    data_args = {}
    if cfg.get("train_limit"):
        data_args["limit"] = int(cfg["train_limit"])
    data_dir = cfg.get("data_dir")
    if cfg["dataset"] == "mnist" and data_dir is None:
        data_dir = str(C.MNIST_DIR)
    return dict(model=model, model_args=margs, dataset=cfg["dataset"], data_dir=data_dir, data_args=data_args,
                seed=seed, eval_every=10**9, **cfg["train"])


def main(argv=None) -> int:
    args = C.parser(NAME, __doc__.splitlines()[0]).parse_args(argv)
    setup = C.Setup(NAME, args)
    rows = []
    for key, seed, rd in run_dirs(setup):
        if C.read_json(rd / "result.json") is None and not setup.time_left():
            print(f"[{NAME}] time budget reached; not starting {key} seed {seed} (re-run to continue)")
            continue
        print(f"[{NAME}] {key} seed {seed} -> {rd}", flush=True)
        res = C.train_run(rd, **train_kwargs(setup, key, seed))
        rows.append({"name": key, "model": res["model"], "seed": seed, "params": res["params"],
                     "test_acc": res["final_eval"]["acc"], "test_loss": res["final_eval"]["loss"],
                     "train_img_per_s": res["train_samples_per_s"], "train_time_s": res["train_time_s"]})
        print(f"[{NAME}]   acc {rows[-1]['test_acc']:.4f}, {rows[-1]['train_img_per_s']:.1f} img/s", flush=True)
    C.write_csv(setup.out / "runs.csv", rows)
    summary = []
    for key in setup.cfg["models"]:
        mine = [r for r in rows if r["name"] == key]
        if not mine:
            summary.append({"name": key, "n_seeds": 0})
            continue
        acc = C.mean_std(r["test_acc"] for r in mine)
        thr = C.mean_std(r["train_img_per_s"] for r in mine)
        summary.append({"name": key, "model": mine[0]["model"], "params": mine[0]["params"], "n_seeds": acc["n"],
                        "seeds": [r["seed"] for r in mine], "acc_mean": acc["mean"], "acc_std": acc["std"],
                        "train_img_per_s": thr["mean"]})
    C.write_csv(setup.out / "summary.csv", summary)
    C.write_json(setup.out / "summary.json", {"config": setup.cfg, "command": setup.command(NAME),
                                              "summary": summary, "runs": rows})
    for s in summary:
        if s.get("n_seeds"):
            print(f"{s['name']:8s} {s['params']:>9d} params  acc {100 * s['acc_mean']:.2f} ± "
                  f"{100 * s['acc_std']:.2f} (n={s['n_seeds']})  {s['train_img_per_s']:.1f} img/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
