"""Shared helpers of the reproduction experiments.

Every experiment script:

* reads a YAML config from ``experiments/configs/<name>.yaml`` (``--config`` to override);
* runs single-threaded (``torch.set_num_threads(1)``: the machine is shared) and one run at a time;
* is resumable: a finished run leaves ``result.json`` in its run directory and is skipped next time;
  an interrupted training run continues from its newest checkpoint (the trainer's ``resume``);
* writes its small summary files (JSON / CSV / PNG) to ``experiments/results/<name>/`` and its
  large run directories (checkpoints) to ``runs/experiments/<name>/`` (git-ignored);
* has a ``--smoke`` mode (tiny model, a few steps, built-in data) used by ``tests/test_experiments.py``,
  which writes to a separate output root so it never mixes with the real results.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

import torch

from whiteformer import _files
from whiteformer._files import write_text
from whiteformer._utils import count_params, to_jsonable

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "experiments" / "configs"
RESULTS_DIR = REPO / "experiments" / "results"
RUNS_DIR = REPO / "runs" / "experiments"
# real data sets: $WHITEFORMER_DATA_DIR, else shared/data beside the repository
DATA_DIR = Path(os.environ.get("WHITEFORMER_DATA_DIR", REPO.parent / "shared" / "data")).resolve()
MNIST_DIR = DATA_DIR / "mnist"
SHAKESPEARE = DATA_DIR / "shakespeare" / "complete_works.txt.xz"


def parser(name: str, doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"experiments/{name}.py", description=doc)
    p.add_argument("--config", default=str(CONFIG_DIR / f"{name}.yaml"), help="YAML config (default: %(default)s)")
    p.add_argument("--smoke", action="store_true", help="tiny budget (seconds), built-in data: keeps the script from rotting")
    p.add_argument("--out", default=None, help="results directory (default experiments/results/<name>; "
                                               "smoke: runs/experiments/smoke/<name>)")
    p.add_argument("--runs", default=None, help="run directories root (default runs/experiments/<name>)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop starting new runs after this time")
    return p


class Setup:
    """Resolved paths, config and time budget of one invocation."""

    def __init__(self, name: str, args: argparse.Namespace):
        import yaml

        torch.set_num_threads(1)
        self.name, self.args, self.smoke = name, args, bool(args.smoke)
        with open(args.config, encoding="utf-8") as f:
            cfg = yaml.safe_load(f) or {}
        self.cfg: Dict[str, Any] = dict(cfg.get("smoke", {}) if self.smoke else cfg.get("full", {}))
        root = RUNS_DIR / "smoke" if self.smoke else RUNS_DIR
        self.out = Path(args.out) if args.out else (root / "results" / name if self.smoke else RESULTS_DIR / name)
        self.runs = Path(args.runs) if args.runs else root / name
        self.out.mkdir(parents=True, exist_ok=True)
        self.runs.mkdir(parents=True, exist_ok=True)
        mm = args.max_minutes if args.max_minutes is not None else self.cfg.get("max_minutes", 30)
        self.deadline = time.time() + 60.0 * float(mm)
        self.cfg.setdefault("max_minutes", mm)

    def time_left(self) -> bool:
        return time.time() < self.deadline

    def command(self, script: str) -> str:
        extra = " --smoke" if self.smoke else ""
        return f".venv/bin/python experiments/{script}.py{extra}"


def read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def write_json(path: Path, obj: Any) -> None:
    """Written whole or not at all, a link at ``path`` replaced (never written through)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the package's converter (tensors -> lists, non-finite floats -> "nan"/"inf"); other objects (paths) as text
    write_text(path, json.dumps(to_jsonable(obj, tensors=True), indent=1, default=str))


def write_csv(path: Path, rows: List[dict]) -> None:
    """As :func:`write_json`: whole or not at all, never through a link."""
    if rows:
        _files.write_csv(path, [{k: _fmt(v) for k, v in r.items()} for r in rows])


def _fmt(v):
    return f"{v:.6g}" if isinstance(v, float) else v


num_params = count_params  # the package's count (each parameter once)


def mean_std(xs: Iterable[float]) -> Dict[str, float]:
    xs = [float(x) for x in xs]
    if not xs:
        return {"mean": math.nan, "std": math.nan, "n": 0}
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


def _median_throughput(run_dir: Path) -> Optional[float]:
    """Median ``samples_per_s`` of the logged training intervals (evaluation excluded)."""
    vals = []
    try:
        with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                if "samples_per_s" in rec:
                    vals.append(rec["samples_per_s"])
    except FileNotFoundError:
        return None
    # the first interval includes start-up costs; drop it when there are others
    vals = vals[1:] if len(vals) > 2 else vals
    return statistics.median(vals) if vals else None


def train_run(run_dir: Path, **cfg_kwargs: Any) -> Dict[str, Any]:
    """Train one configuration with :func:`whiteformer.app.train.train` (resumable) and return its
    summary (also written to ``run_dir/result.json``; a run with that file is not trained again)."""
    from whiteformer.app.train import TrainConfig, latest_checkpoint, train
    from whiteformer.models import create_model  # noqa: F401  (registers the models)

    run_dir = Path(run_dir)
    done = read_json(run_dir / "result.json")
    if done is not None:
        return done
    resume = latest_checkpoint(run_dir / "checkpoints") is not None
    kw = dict(progress=False, tensorboard=False, report=False, num_threads=1, device="cpu", keep_last=1)
    kw.update(cfg_kwargs)
    cfg = TrainConfig(out=str(run_dir), resume=resume, **kw)
    res = train(cfg, command="experiments (whiteformer.app.train.train)")
    from whiteformer.models import create_model as _cm

    final = Path(res["final_dir"])
    try:
        model = _cm(cfg.model, checkpoint_path=str(final))
        params = num_params(model)
    except Exception:  # noqa: BLE001 - the parameter count is informative only
        params = None
    summary = {"model": cfg.model, "model_args": cfg.model_args, "dataset": cfg.dataset, "data_args": cfg.data_args,
               "seed": cfg.seed, "steps": res.get("steps"), "batch_size": cfg.batch_size,
               "final_eval": res["final_eval"], "train_time_s": res["train_time_s"], "params": params,
               "train_samples_per_s": _median_throughput(run_dir), "final_dir": str(final),
               "threads": torch.get_num_threads()}
    write_json(run_dir / "result.json", summary)
    return summary


def load_trained(run_dir: Path) -> torch.nn.Module:
    from whiteformer.models import create_model

    res = read_json(Path(run_dir) / "result.json")
    if res is None:
        raise FileNotFoundError(f"{run_dir} has no result.json: train it first")
    return create_model(res["model"], checkpoint_path=res["final_dir"]).eval()


@torch.no_grad()
def accuracy(model: torch.nn.Module, ds, batch_size: int = 500, limit: Optional[int] = None) -> float:
    n = len(ds) if limit is None else min(limit, len(ds))
    correct = 0
    model.eval()
    for i in range(0, n, batch_size):
        x, y = ds.get_batch(torch.arange(i, min(i + batch_size, n)))
        correct += (model(x).argmax(-1) == y).sum().item()
    return correct / n


def image_batch(ds, n: int, offset: int = 0):
    return ds.get_batch(torch.arange(offset, offset + min(n, len(ds) - offset)))


def fmt_pm(ms: Dict[str, float], scale: float = 100.0, nd: int = 2) -> str:
    if ms.get("n", 0) == 0:
        return "not run yet"
    return f"{ms['mean'] * scale:.{nd}f} ± {ms['std'] * scale:.{nd}f} (n={ms['n']})"
