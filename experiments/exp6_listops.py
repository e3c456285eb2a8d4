"""Experiment 6: ListOps (built-in generator) at a length this machine can train: ToST vs softmax.

ToST Table 3 in miniature: test accuracy, parameters and training throughput of causal ToST and the
causal softmax GPT baseline (same shell, equal parameters), the answer read at the last token.
Chance level is about 10 % (10 classes; the label distribution is written next to the results).

Writes ``experiments/results/exp6_listops/{runs.csv, results.json}``.
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

NAME = "exp6_listops"


def main(argv=None) -> int:
    from whiteformer.app.data import build_dataset

    args = C.parser(NAME, __doc__.splitlines()[0]).parse_args(argv)
    setup = C.Setup(NAME, args)
    cfg = setup.cfg
    test = build_dataset("listops", "test", **cfg["data"])
    counts = Counter(int(y) for y in test.labels.tolist())
    majority = max(counts.values()) / len(test)
    rows = []
    for seed in cfg["seeds"]:
        for key, spec in cfg["models"].items():
            rd = setup.runs / f"{key}_s{seed}"
            if C.read_json(rd / "result.json") is None and not setup.time_left():
                print(f"[{NAME}] time budget reached; not starting {key} seed {seed} (re-run to continue)")
                continue
            print(f"[{NAME}] {key} seed {seed} -> {rd}", flush=True)
            res = C.train_run(rd, model=spec["model"], model_args=spec["model_args"], dataset="listops",
                              data_args=cfg["data"], seed=seed, eval_every=10**9, **cfg["train"])
            rows.append({"name": key, "seed": seed, "params": res["params"], "test_acc": res["final_eval"]["acc"],
                         "train_seq_per_s": res["train_samples_per_s"], "train_time_s": res["train_time_s"]})
            print(f"[{NAME}]   acc {rows[-1]['test_acc']:.4f}", flush=True)
    C.write_csv(setup.out / "runs.csv", rows)
    C.write_json(setup.out / "results.json", {"config": cfg, "command": setup.command(NAME), "runs": rows,
                                              "test_label_counts": dict(sorted(counts.items())),
                                              "majority_class_acc": majority})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
