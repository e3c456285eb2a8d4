"""Linearizing a DeiT-style softmax classifier into TSSA on MNIST: accuracy, teacher vs linearized.

    python -m benchmarks.linearize_vision [--data-dir DIR] [--quick] [--out FILE]

A small ToST vision shell with softmax attention (``vit_cab_s12_p16`` resized: conv stem, softmax
blocks, a class-attention head; the DeiT-style teacher) is trained here on a subset of MNIST, then
linearized by :func:`whiteformer.convert.linearize` into the same shell with TSSA in every block
(ToST, Wu et al., ICLR 2025, Eq. (11)), in LoLCATs' two stages (Zhang et al., arXiv:2410.10254).
It reports the test accuracy of the teacher, the plain swap (TSSA initialised from the teacher's
value / output projections, no training), after attention transfer, and after transfer plus
fine-tuning (cross-entropy plus KL to the teacher's logits), with the images each used and its wall
time, and the goal: the linearized model within ``GOAL_POINTS`` points of the teacher's accuracy.

The default run fits about 15 minutes of one CPU thread (a subset of MNIST, a small model); every
setting is recorded in the JSON. MNIST is read from its four IDX files in ``--data-dir`` (default
``../shared/data/mnist`` beside the repository). :func:`section` renders the JSON as the markdown of
docs/results.md.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

from benchmarks import common

__all__ = ["DEFAULTS", "QUICK", "GOAL_POINTS", "run", "section", "main"]

#: the default run's settings (about 15 minutes at one thread)
DEFAULTS: Dict[str, Any] = dict(train_images=12000, test_images=2000, img_size=28, patch_size=4, embed_dim=64,
                                depth=4, num_heads=4, cls_attn_layers=1, batch_size=64, teacher_steps=900,
                                teacher_lr=2e-3, transfer_steps=150, finetune_steps=400, lr=3e-3, lora_rank=None,
                                kl_weight=1.0, init="vo", eval_images=256, seed=0)
#: a tiny run for the smoke test (seconds)
QUICK: Dict[str, Any] = {**DEFAULTS, **dict(train_images=256, test_images=64, embed_dim=32, depth=2, batch_size=16,
                                            teacher_steps=6, transfer_steps=3, finetune_steps=3, eval_images=32)}
#: the goal: the linearized model's test accuracy within this many points of the teacher's
GOAL_POINTS = 0.5
DEFAULT_DATA = common.REPO_ROOT.parent / "shared" / "data" / "mnist"


def _model_kwargs(cfg: Dict[str, Any]) -> Dict[str, Any]:
    return dict(img_size=cfg["img_size"], patch_size=cfg["patch_size"], in_chans=1, num_classes=10,
                embed_dim=cfg["embed_dim"], depth=cfg["depth"], num_heads=cfg["num_heads"],
                cls_attn_layers=cfg["cls_attn_layers"])


def _batches(ds, batch_size: int, seed: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Random ``(images, labels)`` batches of ``ds``, forever."""
    g = torch.Generator().manual_seed(seed)
    while True:
        yield ds.get_batch(torch.randint(0, len(ds), (batch_size,), generator=g))


@torch.no_grad()
def accuracy(model: torch.nn.Module, ds, chunk: int = 500) -> float:
    """Top-1 accuracy (%) of ``model`` on all of ``ds``."""
    model.eval()
    right = 0
    for start in range(0, len(ds), chunk):
        x, y = ds.get_batch(torch.arange(start, min(start + chunk, len(ds))))
        right += int((model(x).argmax(-1) == y).sum())
    return 100.0 * right / len(ds)


def train_teacher(cfg: Dict[str, Any], train) -> Tuple[torch.nn.Module, float]:
    """The softmax teacher trained for ``teacher_steps`` (AdamW, linear warm-up then cosine) -> (model, wall s)."""
    import whiteformer

    t0 = time.perf_counter()
    torch.manual_seed(cfg["seed"])
    model = whiteformer.create_model("vit_cab_s12_p16", **_model_kwargs(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["teacher_lr"], weight_decay=0.05)
    steps, warm = cfg["teacher_steps"], max(1, cfg["teacher_steps"] // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm))))
    model.train()
    data = _batches(train, cfg["batch_size"], cfg["seed"])
    for _ in range(steps):
        x, y = next(data)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return model.eval(), time.perf_counter() - t0


def run(cfg: Dict[str, Any], data_dir: Path, command: str = "") -> Dict[str, Any]:
    """The study with settings ``cfg`` (see :data:`DEFAULTS`) on MNIST in ``data_dir`` -> the results."""
    from whiteformer.app.data.mnist import mnist
    from whiteformer.convert import linearize

    t_all = time.perf_counter()
    train = mnist("train", data_dir=str(data_dir), limit=cfg["train_images"])
    test = mnist("test", data_dir=str(data_dir), limit=cfg["test_images"])
    teacher, teacher_s = train_teacher(cfg, train)
    teacher_acc = accuracy(teacher, test)
    common.log(f"teacher: {teacher_acc:.2f} % ({teacher_s:.0f} s)")
    held = test.get_batch(torch.arange(min(cfg["eval_images"], len(test))))[0]  # the KL's held-out images
    rows: List[Dict[str, Any]] = [dict(name="teacher (softmax)", accuracy=teacher_acc,
                                       images=cfg["teacher_steps"] * cfg["batch_size"], wall_s=teacher_s)]
    stages = (("plain swap", 0, 0), ("after transfer", cfg["transfer_steps"], 0),
              ("after transfer + fine-tuning", cfg["transfer_steps"], cfg["finetune_steps"]))
    result = None
    for name, transfer, finetune in stages:
        t0 = time.perf_counter()
        student, result = linearize(teacher, _batches(train, cfg["batch_size"], cfg["seed"] + 1), eval_batch=held,
                                    transfer_steps=transfer, finetune_steps=finetune, lr=cfg["lr"], init=cfg["init"],
                                    lora_rank=cfg["lora_rank"], kl_weight=cfg["kl_weight"], seed=cfg["seed"],
                                    progress=False)
        wall = time.perf_counter() - t0
        acc = accuracy(student, test)
        kl = {"plain swap": result.kl_swap, "after transfer": result.kl_transfer}.get(name, result.kl_finetune)
        rows.append(dict(name=name, accuracy=acc, images=(transfer + finetune) * cfg["batch_size"], wall_s=wall,
                         kl_to_teacher=kl, transfer_steps=transfer, finetune_steps=finetune))
        common.log(f"{name}: {acc:.2f} % (KL {kl:.4g}, {wall:.0f} s)")
    gap = teacher_acc - rows[-1]["accuracy"]
    return {
        **common.row_env(command, threads=torch.get_num_threads()),
        "config": {**cfg, "data": "MNIST (first train_images of the train split, first test_images of the test split)",
                   "teacher_model": "vit_cab_s12_p16", "teacher_kwargs": _model_kwargs(cfg),
                   "student": "the same shell, attn='tssa' in every block (class-attention head kept)"},
        "rows": rows,
        "transfer_loss": {"layers": result.tssa_layers, "before": result.transfer_before,
                          "after": result.transfer_after},
        "goal": {"target": f"linearized accuracy within {GOAL_POINTS} points of the teacher's",
                 "points": GOAL_POINTS, "gap_points": gap, "met": gap <= GOAL_POINTS,
                 "missed_by_points": max(0.0, gap - GOAL_POINTS)},
        "wall_s": time.perf_counter() - t_all,
    }


def section(results: Dict[str, Any]) -> str:
    """The markdown of docs/results.md for ``results`` (the JSON :func:`run` writes); every number from it."""
    cfg, goal = results["config"], results["goal"]
    lines = [common.markdown_table(
        ["model", "test accuracy", "vs teacher", "KL to teacher", "images used", "wall time"],
        [[r["name"], f"{r['accuracy']:.2f} %", f"{r['accuracy'] - results['rows'][0]['accuracy']:+.2f}",
          f"{r['kl_to_teacher']:.4f}" if "kl_to_teacher" in r else "-", f"{r['images']:,}", common.fmt_time(r["wall_s"])]
         for r in results["rows"]])]
    verdict = (f"met: {goal['gap_points']:.2f} points below the teacher" if goal["met"]
               else f"missed by {goal['missed_by_points']:.2f} points ({goal['gap_points']:.2f} below the teacher)")
    tl = results["transfer_loss"]
    per_layer = ", ".join(f"block {i}: {a:.3g} -> {b:.3g}" for i, a, b in zip(tl["layers"], tl["before"], tl["after"]))
    worst = max(range(len(tl["layers"])), key=lambda k: tl["after"][k]) if tl["layers"] else None
    limit = "" if worst is None else (
        f" The transfer loss stays highest in block {tl['layers'][worst]} ({tl['after'][worst]:.3g}, "
        f"{tl['after'][worst] / tl['before'][worst]:.0%} of its plain-swap value).")
    lines += ["", f"Goal ({goal['target']}): **{verdict}**.", "",
              f"Transfer loss per TSSA block (mean squared difference to the softmax block's output on held-out "
              f"images, plain swap -> after transfer): {per_layer}.{limit}", "",
              f"Settings: teacher `{cfg['teacher_model']}` with D {cfg['embed_dim']}, {cfg['depth']} blocks, "
              f"{cfg['num_heads']} heads, patch {cfg['patch_size']}, {cfg['cls_attn_layers']} class-attention "
              f"block(s); {cfg['train_images']:,} training and {cfg['test_images']:,} test images of MNIST; batch "
              f"{cfg['batch_size']}; teacher {cfg['teacher_steps']} steps at lr {cfg['teacher_lr']:g}; transfer "
              f"{cfg['transfer_steps']} and fine-tuning {cfg['finetune_steps']} steps at lr {cfg['lr']:g} "
              f"(init `{cfg['init']}`, {'LoRA rank ' + str(cfg['lora_rank']) if cfg['lora_rank'] else 'full'}, "
              f"KL weight {cfg['kl_weight']:g}); {results.get('threads')} thread(s), "
              f"{common.fmt_time(results['wall_s'])} in all (`{results.get('command', '')}`)."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Run the study (command-line ``argv``), write the JSON and print its section; returns the JSON content."""
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m benchmarks.linearize_vision", description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", type=Path, default=DEFAULT_DATA, help="the folder of MNIST's IDX files")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (seconds), into linearize_vision_quick.json")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error("--threads must be >= 1")
    if not args.data_dir.is_dir():
        ap.error(f"--data-dir {str(args.data_dir)!r} is not a folder (MNIST's four IDX files expected)")
    cfg = dict(QUICK if args.quick else DEFAULTS)
    common.setup_torch(args.threads, seed=cfg["seed"])
    out = run(cfg, args.data_dir, common.command_string("benchmarks.linearize_vision", argv))
    path = common.write_json(args.out or common.RESULTS_DIR / (
        "linearize_vision_quick.json" if args.quick else "linearize_vision.json"), out)
    print(section(out))
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
