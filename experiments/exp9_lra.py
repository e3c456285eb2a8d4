"""Experiment 9: Long-Range-Arena-style tasks, ToST vs the softmax Transformer (ToST Sec. 4.3, Table 3).

Non-causal encoders (:mod:`whiteformer.models.lra`: ``tost_lra_<task>`` vs ``transformer_lra_<task>``,
the same shell with TSSA or softmax attention) on offline stand-ins of the five LRA tasks:

=========== ====================================== =============================================
LRA task    here                                   dataset
=========== ====================================== =============================================
ListOps     generated ListOps (shorter)            ``listops``
Text        which Shakespeare play (bytes; IMDB)   ``shakespeare-plays`` (shipped corpus)
Retrieval   same play or not (two documents; AAN)  ``shakespeare-pairs`` (dual encoder)
Image       sequential MNIST pixels (sCIFAR grey)  ``mnist-pixels`` (784 tokens)
Pathfinder  generated Pathfinder, 32x32            ``pathfinder`` (1024 tokens)
=========== ====================================== =============================================

Each run trains for at most ``steps`` optimizer steps **and** ``minutes`` of wall time (one thread),
with AdamW and Table 7's schedule shape (linear warm-up, then inverse-sqrt or linear decay; the
warm-up is Table 7's fraction of the run), then evaluates test accuracy. A finished run leaves
``result.json`` in its run directory and is not trained again (re-run to continue).

Writes ``experiments/results/exp9_lra/{runs.csv, results.json}``.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

NAME = "exp9_lra"


def build_data(task_cfg: dict, mnist_dir: str):
    from whiteformer.app.data import build_dataset

    name, kw = task_cfg["dataset"], dict(task_cfg.get("data", {}))
    if name == "mnist-pixels":  # the first train_limit / test_limit images of each split
        limits = {"train": kw.pop("train_limit", None), "test": kw.pop("test_limit", None)}
        return tuple(build_dataset(name, s, data_dir=mnist_dir, limit=limits[s], **kw) for s in ("train", "test"))
    return build_dataset(name, "train", **kw), build_dataset(name, "test", **kw)


@torch.no_grad()
def evaluate(model, ds, batch_size: int = 64) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(ds), batch_size):
        x, y = ds.get_batch(torch.arange(i, min(i + batch_size, len(ds))))
        correct += (model(x).argmax(-1) == y).sum().item()
    model.train()
    return correct / len(ds)


def train_run(run_dir: Path, model_name: str, model_args: dict, train_ds, test_ds, tr: dict, seed: int) -> dict:
    """Train one model (steps and wall-time capped), evaluate, write ``result.json``."""
    from whiteformer.app.schedule import lr_multiplier
    from whiteformer.app.train.optim import param_groups
    from whiteformer.models import create_model
    from whiteformer.models.lra import TABLE7_OPTIM

    done = C.read_json(run_dir / "result.json")
    if done is not None:
        return done
    run_dir.mkdir(parents=True, exist_ok=True)
    task = model_name.split("_lra_")[1]
    paper = TABLE7_OPTIM[task]
    steps, budget = int(tr["steps"]), 60.0 * float(tr["minutes"])
    warmup = max(1, round(steps * paper["warmup_steps"] / paper["steps"]))
    schedule, lr, min_ratio = paper["schedule"], float(tr["lr"]), float(tr.get("min_lr_ratio", 0.0))
    torch.manual_seed(seed)
    model = create_model(model_name, vocab_size=train_ds.vocab_size, max_len=train_ds.max_len,
                         num_classes=train_ds.num_classes, **model_args)
    opt = torch.optim.AdamW(param_groups(model, paper["weight_decay"]), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    bs = int(tr["batch_size"])
    order, pos, step, losses, log = torch.randperm(len(train_ds), generator=gen), 0, 0, [], []
    t0 = time.perf_counter()
    model.train()
    while step < steps and time.perf_counter() - t0 < budget:
        if pos + bs > len(order):
            order, pos = torch.randperm(len(train_ds), generator=gen), 0
        x, y = train_ds.get_batch(order[pos:pos + bs])
        pos += bs
        for g in opt.param_groups:
            g["lr"] = lr * lr_multiplier(schedule, step, steps, warmup, min_ratio)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % int(tr.get("log_every", 50)) == 0:
            log.append({"step": step, "loss": sum(losses[-50:]) / len(losses[-50:]),
                        "time_s": time.perf_counter() - t0})
            print(f"[{NAME}]   step {step} loss {log[-1]['loss']:.4f} ({log[-1]['time_s']:.0f} s)", flush=True)
    train_time = time.perf_counter() - t0
    acc = evaluate(model, test_ds, int(tr.get("eval_batch_size", 64)))
    res = {"model": model_name, "model_args": model_args, "params": C.num_params(model), "seed": seed,
           "steps_planned": steps, "steps_done": step, "stopped_by_time": step < steps, "batch_size": bs,
           "lr": lr, "warmup_steps": warmup, "schedule": schedule, "weight_decay": paper["weight_decay"],
           "train_time_s": train_time, "seq_per_s": step * bs / max(train_time, 1e-9),
           "final_train_loss": (sum(losses[-50:]) / len(losses[-50:])) if losses else math.nan,
           "test_acc": acc, "log": log, "threads": torch.get_num_threads()}
    C.write_json(run_dir / "result.json", res)
    return res


def main(argv=None) -> int:
    p = C.parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--mnist-dir", default=str(C.MNIST_DIR), help="MNIST IDX directory (default: %(default)s)")
    p.add_argument("--tasks", default=None, help="comma-separated subset of the configured tasks")
    args = p.parse_args(argv)
    setup = C.Setup(NAME, args)
    cfg = setup.cfg
    wanted = args.tasks.split(",") if args.tasks else list(cfg["tasks"])
    prev = C.read_json(setup.out / "results.json") or {}
    rows = [r for r in prev.get("runs", []) if r["task"] not in wanted]
    data_info = {k: v for k, v in prev.get("data", {}).items() if k not in wanted}
    for task in wanted:
        tcfg = cfg["tasks"][task]
        train_ds, test_ds = build_data(tcfg, args.mnist_dir)
        counts = torch.bincount(test_ds.labels, minlength=test_ds.num_classes)
        data_info[task] = {"dataset": tcfg["dataset"], "data_args": tcfg.get("data", {}), "num_train": len(train_ds),
                           "num_test": len(test_ds), "num_classes": test_ds.num_classes, "seq_len": train_ds.max_len,
                           "pair": bool(getattr(train_ds, "pair", False)),
                           "majority_acc": counts.max().item() / len(test_ds)}
        for seed in cfg["seeds"]:
            for family in ("tost", "transformer"):
                rd = setup.runs / f"{task}_{family}_s{seed}"
                if C.read_json(rd / "result.json") is None and not setup.time_left():
                    print(f"[{NAME}] time budget reached; not starting {task} {family} seed {seed} (re-run to continue)")
                    continue
                print(f"[{NAME}] {task} {family} seed {seed} -> {rd}", flush=True)
                res = train_run(rd, f"{family}_lra_{task}", tcfg.get("model_args", {}), train_ds, test_ds,
                                {**cfg["train"], **tcfg.get("train", {})}, seed)
                rows.append({"task": task, "family": family, "seed": seed, "params": res["params"],
                             "test_acc": res["test_acc"], "steps_done": res["steps_done"],
                             "steps_planned": res["steps_planned"], "train_time_s": res["train_time_s"],
                             "seq_per_s": res["seq_per_s"], "final_train_loss": res["final_train_loss"],
                             "schedule": res["schedule"], "lr": res["lr"], "warmup_steps": res["warmup_steps"],
                             "batch_size": res["batch_size"]})
                print(f"[{NAME}]   acc {res['test_acc']:.4f} after {res['steps_done']} steps", flush=True)
        C.write_csv(setup.out / "runs.csv", rows)
        C.write_json(setup.out / "results.json", {"config": cfg, "command": setup.command(NAME), "runs": rows,
                                                  "data": data_info})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
