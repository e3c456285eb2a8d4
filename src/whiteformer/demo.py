"""``make demo`` (``python -m whiteformer.demo``): train a small ToST on the 8x8 digits from scratch,
evaluate it and write the run report.

The configuration is the packaged ``whiteformer/configs/demo_digits.yaml``; extra arguments are
overrides as for ``whiteformer train`` (e.g. ``python -m whiteformer.demo --out /tmp/demo
--epochs 5``). Equivalent to::

    whiteformer train -c src/whiteformer/configs/demo_digits.yaml
    whiteformer eval --checkpoint runs/demo

Exit status 1 when the test accuracy is below the 95 % target.
"""
from __future__ import annotations

import sys
import time
from importlib import resources
from pathlib import Path
from typing import Optional, Sequence

TARGET_ACCURACY = 0.95


def config_path() -> Path:
    return Path(str(resources.files("whiteformer.configs") / "demo_digits.yaml"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .train import ConfigError, EvalConfig, TrainConfig, build_config, train
    from .train.configuration import parse_overrides
    from .train.evaluate import evaluate

    argv = list(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    try:
        cfg = build_config(TrainConfig, config_path(), parse_overrides(argv))
    except ConfigError as err:
        print(f"demo: error: {err}", file=sys.stderr)
        return 2
    print(f"whiteformer demo: a small ToST ({cfg.model} with {cfg.model_args}) on {cfg.dataset}, "
          f"{cfg.epochs} epochs; config {config_path()}")
    res = train(cfg, command=" ".join(["python -m whiteformer.demo", *argv]))
    ev = evaluate(EvalConfig(checkpoint=cfg.out, device=cfg.device))
    wall = time.perf_counter() - t0
    acc = ev["acc"]
    out = Path(cfg.out)
    print()
    print(f"test accuracy {100 * acc:.2f} % on {ev['n']} held-out digits (loss {ev['loss']:.4f}; "
          f"target >= {100 * TARGET_ACCURACY:.0f} %)")
    print(f"wall time {wall:.1f} s (training {res['train_time_s']:.1f} s)")
    print(f"model:    {ev['checkpoint']}")
    print(f"report:   {res.get('report') or '(not written)'}")
    figs = res.get("figures", {})
    if figs:
        print("pictures: " + ", ".join(str(out / f) for f in figs.values()))
    print(f"logs:     {out / 'metrics.jsonl'}, {out / 'metrics.csv'}; config {out / 'config.yaml'}")
    if acc < TARGET_ACCURACY:
        print(f"demo: accuracy below the {100 * TARGET_ACCURACY:.0f} % target", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
