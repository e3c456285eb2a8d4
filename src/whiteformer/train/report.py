"""Run report: ``report.md`` + ``report.json`` + PNG figures in the run directory.

- final metrics (test accuracy / loss, or validation loss / perplexity for language models), wall
  time, steps, parameters, device, the command;
- ``curves.png``: training loss and evaluation loss / accuracy against the step;
- ``coding_rate.png``: the layer-wise coding rate R(Z) = 1/2 logdet(I + d/(N eps^2) Z^T Z) (ToST
  Eq. (1), tokens as rows) of each block's output tokens, averaged over a batch of test inputs
  (:func:`whiteformer.analysis.rates.coding_rate`);
- ``cls_attention.png`` (classification with class attention): the [CLS] token's attention over
  the patches per head (ToST Fig. 5), :func:`whiteformer.analysis.maps.cls_attention_maps`;
- ``membership.png``: for a few test images, the image and the membership maps pi (one per
  head, over the patch grid, blocks and heads numbered from 1, a colour bar) of the first and last
  blocks, when the attention returns them
  (``forward_intermediates(x, return_pi=True)``: TSSA, DMSA, ECA);
- language models: a sample of generated text.

Each piece is optional: a missing analysis function, an attention without memberships or a
missing matplotlib (``pip install whiteformer[viz]``) leaves a note instead of failing the run.
"""
from __future__ import annotations

import inspect
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

from .metrics import read_metrics

__all__ = ["write_report", "block_features", "layer_coding_rates", "membership_maps", "plot_membership", "token_grid"]


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        return None


def block_features(model: nn.Module, x: torch.Tensor) -> List[torch.Tensor]:
    """Per-block output tokens (B, N, D) from ``model.forward_intermediates`` (any of the zoo's
    conventions: list, ``(final, list)``, NCHW maps)."""
    fi = model.forward_intermediates
    params = inspect.signature(fi).parameters
    kw: Dict[str, Any] = {}
    if "intermediates_only" in params:
        kw["intermediates_only"] = True
    if "output_fmt" in params:
        kw["output_fmt"] = "NLC"
    out = fi(x, **kw)
    if isinstance(out, tuple):
        out = out[1]
    feats = []
    for z in out:
        if z.dim() == 4:  # (B, D, H, W)
            z = z.flatten(2).transpose(1, 2)
        feats.append(z)
    return feats


@torch.no_grad()
def layer_coding_rates(model: nn.Module, x: torch.Tensor, eps: float = 0.5) -> List[float]:
    """Mean over the inputs of R(Z_l) for the output tokens Z_l (N x D) of each block l."""
    from ..analysis.rates import coding_rate

    feats = block_features(model, x)
    return [float(coding_rate(z.float(), eps=eps).mean()) for z in feats]


@torch.no_grad()
def membership_maps(model: nn.Module, x: torch.Tensor) -> Optional[Dict[int, torch.Tensor]]:
    """``{block: pi (B, H, N)}`` for the first and last blocks, or None if not supported."""
    fi = getattr(model, "forward_intermediates", None)
    if fi is None or "return_pi" not in inspect.signature(fi).parameters:
        return None
    depth = len(getattr(model, "blocks", []))
    if depth == 0:
        return None
    wanted = sorted({0, depth - 1})
    try:
        _, stats = fi(x, indices=wanted, return_pi=True, intermediates_only=True)
    except ValueError:
        return None
    out = {}
    for i, st in zip(wanted, stats):
        if isinstance(st, dict) and isinstance(st.get("pi"), torch.Tensor):
            out[i] = st["pi"].float().cpu()
    return out or None


def token_grid(model: nn.Module, n: int):
    g = getattr(getattr(model, "patch_embed", None), "grid_size", None)
    if g is not None and g[0] * g[1] == n:
        return tuple(g)
    s = int(round(math.sqrt(n)))
    return (s, s) if s * s == n else (1, n)


def _plot_curves(plt, records, path: Path, curve) -> bool:
    """Training / evaluation loss, and the evaluation metric ``curve = (log key, axis label)``."""
    train = [r for r in records if "train_loss" in r]
    ev = [r for r in records if "eval_loss" in r]
    if not train and not ev:
        return False
    metric, label = curve
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


RATE_READING = ("rising: the block spreads the tokens over more directions (expansion); falling: it "
                "compresses them onto fewer (the white-box aim: lower R_c per subspace)")


def _plot_rates(plt, rates: List[float], path: Path) -> None:
    fig = _rates_figure(plt, rates)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rates_figure(plt, rates: List[float]):
    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    ax.plot(range(1, len(rates) + 1), rates, "o-")
    ax.set_xlabel("block")
    ax.set_ylabel("coding rate R(Z)")
    ax.set_title("layer-wise coding rate of the tokens (eps 0.5)", fontsize=10)
    ax.set_xticks(range(1, len(rates) + 1))
    fig.text(0.5, 0.01, RATE_READING.replace("; ", ";\n", 1), ha="center", va="bottom", fontsize=7)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    return fig


def plot_membership(plt, images: torch.Tensor, pis: Dict[int, torch.Tensor], grid, path: Path,
                    labels=None, preds=None) -> None:
    fig = _membership_figure(plt, images, pis, grid, labels, preds)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _membership_figure(plt, images: torch.Tensor, pis: Dict[int, torch.Tensor], grid, labels=None, preds=None):
    """Row r: image r, then pi of every head of every block in ``pis`` (titles "block b head h", from 1)."""
    blocks = sorted(pis)
    heads = pis[blocks[0]].shape[1]
    n = images.shape[0]
    cols = 1 + heads * len(blocks)
    fig, axes = plt.subplots(n, cols, figsize=(1.5 * cols + 0.6, 1.6 * n + 0.3), squeeze=False)
    im = None
    for r in range(n):
        img = images[r]
        img = img[0] if img.shape[0] == 1 else img.permute(1, 2, 0)
        img = (img - img.min()) / (img.max() - img.min() + 1e-8)
        axes[r, 0].imshow(img.numpy(), cmap="gray" if img.dim() == 2 else None)
        title = "input"
        if labels is not None and preds is not None:
            title = f"y={int(labels[r])} pred={int(preds[r])}"
        axes[r, 0].set_title(title, fontsize=7)
        c = 1
        for b in blocks:
            for h in range(heads):
                im = axes[r, c].imshow(pis[b][r, h].reshape(grid).numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
                if r == 0:
                    axes[r, c].set_title(f"block {b + 1} head {h + 1}", fontsize=7)
                c += 1
    for a in axes.flat:
        a.set_xticks([])
        a.set_yticks([])
    fig.suptitle("memberships pi of each token to each head (subspace)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1 - 0.5 / fig.get_figwidth(), 1))
    bar = fig.colorbar(im, ax=list(axes.flat), fraction=0.02, pad=0.01)
    bar.set_label("membership pi", fontsize=7)
    return fig


def has_class_attention(model: nn.Module) -> bool:
    from ..attention import ClassAttention

    return any(isinstance(m, ClassAttention) for m in model.modules())


def write_report(run_dir, model: nn.Module, task, results: Dict[str, Any], info: Dict[str, Any],
                 num_images: int = 4) -> Path:
    """Write the report files into ``run_dir``; returns the path of ``report.md``."""
    run_dir = Path(run_dir)
    plt = _pyplot()
    notes: List[str] = []
    figures: Dict[str, str] = {}
    model.eval()
    device = next(model.parameters()).device
    records = read_metrics(run_dir / "metrics.jsonl")

    if plt is None:
        notes.append("matplotlib is not installed: no figures (pip install whiteformer[viz]).")
    elif _plot_curves(plt, records, run_dir / "curves.png", task.curve):
        figures["curves"] = "curves.png"

    # Inputs for the analyses: the first evaluation samples.
    x = labels = None
    try:
        x, labels = task.report_inputs()
        x = x.to(device)
    except Exception as err:  # noqa: BLE001
        notes.append(f"could not read analysis inputs: {err}")

    rates: Optional[List[float]] = None
    if x is not None and hasattr(model, "forward_intermediates"):
        try:
            rates = layer_coding_rates(model, x)
            results["coding_rate_per_block"] = rates
            if plt is not None:
                _plot_rates(plt, rates, run_dir / "coding_rate.png")
                figures["coding_rate"] = "coding_rate.png"
        except Exception as err:  # noqa: BLE001 - analysis must not fail the run
            notes.append(f"layer-wise coding rate skipped: {type(err).__name__}: {err}")
    elif x is not None:
        notes.append("the model has no forward_intermediates: no layer-wise coding rate.")

    from .tasks.base import ReportContext

    task_lines = task.report_sections(model, ReportContext(run_dir, plt, x, labels, results, figures, notes,
                                                           num_images))

    results["figures"] = figures
    results["notes"] = notes
    with open(run_dir / "report.json", "w", encoding="utf-8") as f:
        json.dump({**info, **results}, f, indent=1, default=str)

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
                  "R(Z) = 1/2 logdet(I + d/(N eps^2) Z^T Z) of each block's output tokens (ToST Eq. (1), eps = 0.5), "
                  f"mean over the first test inputs. Reading: {RATE_READING}.", "", "| block | R(Z) |", "|---|---|"]
        lines += [f"| {i + 1} | {r:.3f} |" for i, r in enumerate(rates)]
        lines.append("")
        if "coding_rate" in figures:
            lines += ["![coding rate](coding_rate.png)", ""]
    lines += task_lines
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
