"""``make demo`` (``python -m whiteformer.app.demo``): train a small ToST on the 8x8 digits from scratch,
evaluate it and write the run report.

The configuration is the packaged ``whiteformer/app/configs/demo_digits.yaml``; extra arguments are
overrides as for ``whiteformer train`` (e.g. ``python -m whiteformer.app.demo --out runs/my-demo
--epochs 5``). Equivalent to::

    whiteformer train -c demo_digits --overwrite
    whiteformer eval --checkpoint runs/demo

``--overwrite`` only for the demo's own ``runs/demo`` (so that ``make demo`` can be run again; the
previous demo run is deleted once the new one has its model); an ``--out`` given on the command
line is treated as by ``whiteformer train``: a finished run there is not replaced without
``--overwrite``. The packaged configuration itself never says ``overwrite``.

Exit status 1 when the test accuracy is below the 95 % target.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

from .configs import shipped_config

TARGET_ACCURACY = 0.95


def config_path() -> Path:
    return shipped_config("demo_digits")


def demo_overrides(argv: Sequence[str]) -> List[Tuple[str, Any]]:
    """The command line's overrides, plus ``overwrite`` when the run goes to the demo's own
    directory (no ``--out``, ``--resume`` or ``--overwrite`` given)."""
    from .config import parse_overrides

    overrides = parse_overrides(list(argv))
    if not {k for k, _ in overrides} & {"out", "resume", "overwrite"}:
        overrides.append(("overwrite", True))
    return overrides


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .evaluate import evaluate
    from .train import ConfigError, EvalConfig, TrainConfig, build_config, train
    from .train.outputs import say

    argv = list(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    try:
        cfg = build_config(TrainConfig, config_path(), demo_overrides(argv))
        say(f"whiteformer demo: a small ToST ({cfg.model} with {cfg.model_args}) on {cfg.dataset}, "
            f"{cfg.epochs} epochs; config {config_path()}")
        res = train(cfg, command=" ".join(["python -m whiteformer.app.demo", *argv]))
    except ConfigError as err:
        print(f"demo: error: {err}", file=sys.stderr)
        return 2
    ev = evaluate(EvalConfig(checkpoint=cfg.out, device=cfg.device))
    wall = time.perf_counter() - t0
    acc = ev["acc"]
    out = Path(cfg.out)
    say("")
    say(f"test accuracy {100 * acc:.2f} % on {ev['n']} held-out digits (loss {ev['loss']:.4f}; "
        f"target >= {100 * TARGET_ACCURACY:.0f} %)")
    say(f"wall time {wall:.1f} s (training {res['train_time_s']:.1f} s)")
    say(f"model:    {ev['checkpoint']}")
    say(f"report:   {res.get('report') or '(not written)'}")
    figs = res.get("figures", {})
    if figs:
        say("pictures: " + ", ".join(str(out / f) for f in figs.values()))
    say(f"logs:     {out / 'metrics.jsonl'}, {out / 'metrics.csv'}; config {out / 'config.yaml'}")
    if acc < TARGET_ACCURACY:
        print(f"demo: accuracy below the {100 * TARGET_ACCURACY:.0f} % target", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
