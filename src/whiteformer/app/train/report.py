"""Run report: ``report.md`` + ``report.json`` + PNG figures in the run directory.

Every white-box measurement and picture comes from :mod:`whiteformer.analysis` (the one pipeline);
this module only runs it on the first evaluation inputs and writes the markdown:

- final metrics (test accuracy / loss, or validation loss / perplexity for language models), wall
  time, steps, parameters, device, the command;
- ``curves.png``: training loss and evaluation loss / accuracy against the step;
- ``coding_rate.png``: the layer-wise coding rate R(Z) = 1/2 logdet(I + d/(N eps^2) Z^T Z) (ToST
  Eq. (1), tokens as rows) of each block's output tokens, averaged over a batch of test inputs
  (the ``R`` column of :func:`whiteformer.analysis.report.layerwise_report`,
  :func:`~whiteformer.analysis.report.coding_rate_figure`);
- the task's sections (:meth:`~whiteformer.app.train.tasks.base.Task.report_sections`), e.g. for
  images ``cls_attention.png`` (:func:`whiteformer.analysis.maps.cls_attention_maps`) and
  ``membership.png`` (:func:`whiteformer.analysis.maps.membership_maps` of the first and last
  blocks), and for language models a sample of generated text.

Each piece is optional: an analysis that fails, an attention without memberships or a
missing matplotlib (``pip install whiteformer[viz]``) leaves a note instead of failing the run.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

from ..._files import save_figure, write_text
from ...analysis._viz import new_figure, require_matplotlib
from ...analysis.report import RATE_READING, coding_rate_figure, layerwise_report
from .metrics import read_metrics

__all__ = ["write_report", "RATE_READING", "RATE_EPS"]

#: quantisation error of the report's coding rates
RATE_EPS = 0.5


def _matplotlib():
    """matplotlib (figures are drawn on ``Figure`` objects: the user's backend is never touched), or None."""
    try:
        return require_matplotlib("the run report's figures")
    except ImportError:
        return None


def _curves_figure(records, curve):
    """Training / evaluation loss, and the evaluation metric ``curve = (log key, axis label)``; None without records."""
    train = [r for r in records if "train_loss" in r]
    ev = [r for r in records if "eval_loss" in r]
    if not train and not ev:
        return None
    metric, label = curve
    fig = new_figure((10, 3.6), 110, "the training curves")
    ax = fig.subplots(1, 2)
    if train:
        ax[0].plot([r["step"] for r in train], [r["train_loss"] for r in train], label="train loss", lw=1)
    if ev:
        ax[0].plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="eval loss", ms=3)
        ax[1].plot([r["step"] for r in ev], [r.get(metric, float("nan")) for r in ev], "o-", color="C2", ms=3,
                   label=metric.replace("_", " "))
    if metric == "eval_acc" and train and "train_acc" in train[0]:
        ax[1].plot([r["step"] for r in train], [r["train_acc"] for r in train], lw=1, color="C1", label="train acc")
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("cross-entropy")
    ax[0].legend()
    ax[1].set_xlabel("step")
    ax[1].set_ylabel(label)
    ax[1].legend()
    fig.tight_layout()
    return fig


def write_report(run_dir, model: nn.Module, task, results: Dict[str, Any], info: Dict[str, Any],
                 num_images: int = 4) -> Path:
    """Write the report files into ``run_dir``; returns the path of ``report.md``."""
    run_dir = Path(run_dir)
    mpl = _matplotlib()
    notes: List[str] = []
    figures: Dict[str, str] = {}
    model.eval()
    device = next(model.parameters()).device
    records = read_metrics(run_dir / "metrics.jsonl")

    if mpl is None:
        notes.append("matplotlib is not installed: no figures (pip install whiteformer[viz]).")
    else:
        fig = _curves_figure(records, task.curve)
        if fig is not None:
            save_figure(fig, run_dir / "curves.png")
            figures["curves"] = "curves.png"

    # Inputs for the analyses: the first evaluation samples.
    x = labels = None
    try:
        x, labels = task.report_inputs()
        x = x.to(device)
    except Exception as err:  # noqa: BLE001
        notes.append(f"could not read analysis inputs: {err}")

    rates: Optional[List[float]] = None
    if x is not None:
        try:
            rates = layerwise_report(model, x, eps=RATE_EPS, plot=False, dtype=torch.float32).column("R")
            results["coding_rate_per_block"] = rates
            if mpl is not None:
                save_figure(coding_rate_figure(rates, RATE_EPS), run_dir / "coding_rate.png")
                figures["coding_rate"] = "coding_rate.png"
        except Exception as err:  # noqa: BLE001 - analysis must not fail the run
            rates = None
            notes.append(f"layer-wise coding rate skipped: {type(err).__name__}: {err}")

    from .tasks.base import ReportContext

    task_lines = task.report_sections(model, ReportContext(run_dir, mpl, x, labels, results, figures, notes,
                                                           num_images))

    results["figures"] = figures
    results["notes"] = notes
    write_text(run_dir / "report.json", json.dumps({**info, **results}, indent=1, default=str))

    lines = [f"# Run report: `{info.get('model')}` on `{info.get('dataset')}`", ""]
    if info.get("command"):
        lines += ["Command:", "", "```", info["command"], "```", ""]
    lines += ["| | |", "|---|---|"]
    lines += task.report_rows(results, info.get("eval_split", "test"))
    for key, label in (("train_time_s", "training wall time"), ("total_time_s", "total wall time")):
        if key in results:
            lines.append(f"| {label} | {results[key]:.1f} s |")
    for key in ("steps", "epochs", "params", "device", "threads", "world_size"):
        if key in info:
            lines.append(f"| {key} | {info[key]} |")
    lines.append("")
    if "curves" in figures:
        lines += ["## Training curves", "", "![curves](curves.png)", ""]
    if rates is not None:
        lines += ["## Layer-wise coding rate", "",
                  "R(Z) = 1/2 logdet(I + d/(N eps^2) Z^T Z) of each block's output tokens (ToST Eq. (1), "
                  f"eps = {RATE_EPS:g}), "
                  f"mean over the first test inputs. Reading: {RATE_READING}.", "", "| block | R(Z) |", "|---|---|"]
        lines += [f"| {i + 1} | {r:.3f} |" for i, r in enumerate(rates)]
        lines.append("")
        if "coding_rate" in figures:
            lines += ["![coding rate](coding_rate.png)", ""]
    lines += task_lines
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    path = run_dir / "report.md"
    write_text(path, "\n".join(lines))
    return path
