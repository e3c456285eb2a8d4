"""Layer-wise coding rates of a model's token features (ToST Fig. 4a, DMSA Fig. 5).

:func:`layerwise_report` runs the model once on a batch (eval mode, no grad) under
:func:`~whiteformer.analysis.capture.capture` and measures, for each block l, on the tokens
Z^l of each sample (one image / sequence = one Z, tokens as rows, (N, d)), averaged over the
batch (:mod:`whiteformer.analysis.rates`):

========== ==================================================================================
R          coding rate R(Z^l) (ToST Eq. 1)
R_c        compression term R_c(Z^l, Pi^l) with the layer's memberships (ToST Eq. 1)
delta_R    rate reduction R - R_c (ToST Eq. 1)
R_c_var    variational compression term R^var_c,f(Z^l, Pi^l | U^l) (ToST Eq. 4, DMSA Eq. 15),
           f(x) = log(1 + d/eps² x): the curve of ToST Fig. 4a / DMSA Fig. 5
delta_R_var R - R_c_var (DMSA Eq. 16)
R_c_U      subspace compression term R_c(Z^l | U^l_[K]) (ECA Eq. 2, CRATE)
========== ==================================================================================

Rows: ``layer`` numbers the blocks from 1 (as ``transformers``' ``hidden_states``), ``name`` is the
block's module name; a transformers model that reports its last state after the final norm
(GPT-2, Llama) gets one more row, "final norm", with ``layer`` None
(:mod:`whiteformer.analysis.hidden_states`). The figure (:meth:`LayerwiseReport.figure`) is titled
with the model's name and draws only the panels whose columns the model gives.

Choices (the papers do not pin them down beyond "the outputs of each layer"):

* Z^l: ``features="output"`` (default) is the block's output tokens, as ToST Fig. 4a ("the TSSA
  outputs Z^l") and DMSA Sec. IV-D ("the output Z after the DMSA block") measure it;
  ``features="input"`` is the attention layer's input (the normalised tokens Pi^l was computed
  from). Vision shells: the patch tokens (the class token joins only in the head); CRATE/DeiT
  blocks also carry their class token.
* Pi^l: the memberships the attention layer computed in that forward pass, (B, N, K).
  R_c and delta_R need rows on the simplex: memberships that are not (DMSA's sigmoid Pi) are
  normalised over the heads for these two columns (a token with all-zero Pi counts uniformly);
  R_c_var uses the raw Pi (DMSA Eq. 15's decoupled form).
* U^l: the layer's projection (:func:`layer_bases`): U_k = (qkv rows of head k)^T (d, p) for
  TSSA / causal TSSA / MSSA, ECA's ``U``; for DMSA the gated bases U_k^S = gate_k * S_k (DMSA
  Eq. 13-15, gate (B, K) from that sample), per sample. Biases are ignored.
* Columns a layer cannot give are None (no Pi: MHSA/XCA/MSSA have no R_c, delta_R, R_c_var;
  no U: MHSA/XCA have no R_c_var, R_c_U).

All rates are computed in float64 (``dtype``).
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch
import torch.nn as nn

from .._checks import check_choice, check_instance, check_positive_real, check_tensor
from .._files import check_path, save_figure, write_text
from .._progress import progress_bar
from . import hidden_states, rates
from ._viz import new_figure, require_matplotlib
from .capture import BlockRecord, attention_basis, capture, eval_mode

__all__ = ["LayerwiseReport", "layerwise_report", "layer_bases", "simplex_memberships", "coding_rate_figure", "COLUMNS",
           "RATE_READING", "model_title"]

COLUMNS = ("layer", "name", "attn", "tokens", "dim", "heads", "R", "R_c", "delta_R", "R_c_var", "delta_R_var",
           "R_c_U", "delta_R_U")
_RATES = ("R", "R_c", "delta_R", "R_c_var", "delta_R_var", "R_c_U", "delta_R_U")
_FEATURES = ("output", "input")
JSON_NAME, PNG_NAME = "layerwise_report.json", "layerwise_report.png"
#: how to read a curve of R(Z) over the blocks (the run report prints it under its plot)
RATE_READING = ("rising: the block spreads the tokens over more directions (expansion); falling: it "
                "compresses them onto fewer (the white-box aim: lower R_c per subspace)")


# ----------------------------------------------------------------------------- per-layer pieces
def layer_bases(record: BlockRecord, dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
    """The bases U^l used for R_c_var and R_c_U: (d, K*p), or per sample (B, K, d, p) for DMSA
    (U_k^S = gate_k * S_k, DMSA Eq. 13-15, with the recorded head gate); None if the layer has
    none. Returned in ``dtype`` (default: the weight's), on the gate's device when gated."""
    U = attention_basis(record.attn)
    if U is None:
        return None
    U = U.to(dtype or U.dtype)
    if record.gate is None:
        return U
    K = record.gate.shape[-1]
    d = U.shape[0]
    Uk = U.to(record.gate.device).reshape(d, K, -1).transpose(0, 1)  # (K, d, p)
    return record.gate.to(U.dtype)[:, :, None, None] * Uk  # (B, K, d, p)


def simplex_memberships(Pi: torch.Tensor) -> torch.Tensor:
    """Pi (..., N, K) with each row normalised to sum to 1 (all-zero rows become uniform)."""
    Pi = Pi.clamp_min(0)
    s = Pi.sum(-1, keepdim=True)
    uniform = torch.full_like(Pi, 1.0 / Pi.shape[-1])
    return torch.where(s > 0, Pi / torch.where(s > 0, s, torch.ones_like(s)), uniform)


def _on_simplex(Pi: torch.Tensor) -> bool:
    return bool((Pi >= -1e-6).all()) and bool(((Pi.sum(-1) - 1).abs() <= 1e-4 * max(1, Pi.shape[-1])).all())


def _layer_row(r: BlockRecord, features: str, eps: float, dtype: torch.dtype) -> Dict[str, Any]:
    Z = r.output if features == "output" else r.attn_input
    Z = Z.to(dtype)
    if Z.dim() == 2:
        Z = Z[None]
    U = layer_bases(r, dtype)
    U = None if U is None else U.to(device=Z.device, dtype=dtype)
    Pi = r.memberships
    K = r.num_heads if U is None or U.dim() == 2 else U.shape[-3]
    row: Dict[str, Any] = {"layer": r.index + 1, "name": r.name, "attn": type(r.attn).__name__,
                           "tokens": Z.shape[-2], "dim": Z.shape[-1], "heads": r.num_heads}
    row.update({k: None for k in _RATES})
    mean = lambda t: float(t.mean().item())  # noqa: E731 (average over the samples of the batch)
    R = rates.coding_rate(Z, eps, dtype=dtype)
    row["R"] = mean(R)
    if Pi is not None:
        Pi = Pi.to(device=Z.device, dtype=dtype)
        Ps = Pi if _on_simplex(Pi) else simplex_memberships(Pi)
        row["R_c"] = mean(rates.compression_rate(Z, Ps, eps, dtype=dtype))
        row["delta_R"] = mean(rates.rate_reduction(Z, Ps, eps, dtype=dtype))
        if U is not None:
            Rv = rates.variational_compression_rate(Z, Pi, U, eps, num_heads=K if U.dim() == 2 else None,
                                                    decoupled=not _on_simplex(Pi), dtype=dtype)
            row["R_c_var"] = mean(Rv)
            row["delta_R_var"] = mean(R - Rv)
    if U is not None:
        Rc_U = rates.subspace_compression_rate(Z, U, eps, num_heads=K if U.dim() == 2 else None, dtype=dtype)
        row["R_c_U"] = mean(Rc_U)
        row["delta_R_U"] = mean(R - Rc_U)
    return row


# ----------------------------------------------------------------------------- report
def _check_out_dir(out_dir) -> Path:
    """``out_dir`` as a Path: a directory or a path to create, not an existing file."""
    check_instance(out_dir, "out_dir", (str, Path), "a str or Path")
    out = Path(check_path(out_dir, "out_dir"))
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir {str(out)!r} exists and is not a directory")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"out_dir {str(out)!r} cannot be created: {str(parent)!r} is a file")
            break
    return out


@dataclasses.dataclass
class LayerwiseReport:
    """Rows (one dict per block, keys :data:`COLUMNS`) and the settings they were measured with."""

    rows: List[Dict[str, Any]]
    eps: float
    features: str
    num_samples: int
    model: str = ""
    files: List[str] = dataclasses.field(default_factory=list)

    columns = COLUMNS

    def column(self, key: str) -> List[Optional[float]]:
        """One column over the layers."""
        if key not in COLUMNS:
            raise KeyError(f"unknown column {key!r}; columns: {COLUMNS}")
        return [row[key] for row in self.rows]

    def to_dict(self) -> Dict[str, Any]:
        return {"model": self.model, "eps": self.eps, "features": self.features, "num_samples": self.num_samples,
                "columns": list(COLUMNS), "rows": self.rows}

    def to_markdown(self, digits: int = 4) -> str:
        """A GitHub-markdown table (None shown as "-")."""
        def fmt(v):
            if v is None:
                return "-"
            if isinstance(v, float):
                return f"{v:.{digits}g}"
            return str(v)

        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(fmt(row[c]) for c in COLUMNS) + " |" for row in self.rows]
        return "\n".join(lines)

    def save(self, out_dir: Union[str, Path], plot: bool = True) -> List[str]:
        """Write ``layerwise_report.json`` (and ``layerwise_report.png`` when ``plot``) to
        ``out_dir`` (created); returns the written paths."""
        if plot:
            require_matplotlib("layerwise_report's plot (plot=False writes the JSON only)")
        out = _check_out_dir(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        files = [str(out / JSON_NAME)]
        write_text(files[0], json.dumps(self.to_dict(), indent=1))
        if plot:
            files.append(str(out / PNG_NAME))
            self.plot(files[1])
        self.files = files
        return files

    def plot(self, path: Union[str, Path], dpi: int = 100) -> None:
        """Save :meth:`figure` to ``path`` (PNG)."""
        save_figure(self.figure(dpi), path, dpi=dpi)

    def figure(self, dpi: int = 100):
        """The figure (not saved): up to three panels over the layers, each drawn only when the model
        gives its columns: R_c^var (ToST Fig. 4a / DMSA Fig. 5); R, R_c, delta_R, delta_R_U;
        R_c(Z|U). Titled with the model's name; a final-norm row (transformers models that report
        one) is a point of its own after the blocks, labelled "final norm" on the x axis. Each panel's
        y scale is the blocks' values; a final-norm point far off it (the norm rescales the tokens)
        is drawn at the edge and annotated with its value instead of squeezing the blocks' curves."""
        panels = []
        for title, ylabel, curves in _PANELS:
            curves = [(key, style) for key, style in curves if any(v is not None for v in self.column(key))]
            if curves:
                panels.append((title, ylabel, curves))
        fig = new_figure((5 * max(len(panels), 1), 4), dpi, "layerwise_report's plot")
        axes = fig.subplots(1, max(len(panels), 1), squeeze=False)[0]
        xs, labels = _layer_positions(self.rows)
        for ax, (title, ylabel, curves) in zip(axes, panels):
            layer_values, named = [], []
            for key, style in curves:
                pts = [(xi, v, row["layer"] is None) for xi, v, row in zip(xs, self.column(key), self.rows)
                       if v is not None]
                line, = ax.plot([p[0] for p in pts if not p[2]], [p[1] for p in pts if not p[2]], style, label=key)
                layer_values += [p[1] for p in pts if not p[2]]
                # the final norm: a point of its own, not joined to the blocks
                named += [(p[0], p[1], style[0], line.get_color(), key) for p in pts if p[2]]
            _draw_named_points(ax, named, _value_range(layer_values))
            ax.legend()
            ax.set_title(title)
            ax.set_xlabel("layer")
            ax.set_ylabel(ylabel)
            ax.set_xticks(xs, labels, rotation=30 if len(xs) > 12 else 0)
        fig.suptitle(self.model or "model")
        fig.text(0.5, 0.01, f"{self.features} tokens, eps {self.eps:g}, {self.num_samples} samples", ha="center",
                 va="bottom", fontsize=8)
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        return fig


#: the figure's panels: (title, y-axis label, [(column, line style)])
_PANELS = (
    ("variational compression", "R_c^var(Z, Pi | U) (nats)", [("R_c_var", "o-")]),
    ("rates", "coding rate (nats)", [("R", "o-"), ("R_c", "s--"), ("delta_R", "^:"), ("delta_R_U", "v-.")]),
    ("subspace compression", "R_c(Z | U) (nats)", [("R_c_U", "o-")]),
)


def _value_range(values: List[float]):
    """(low, high) y limits of the layers' values with a margin (None without values): the scale of
    a panel, which a final-norm point far off it must not crush."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None
    lo, hi = min(finite), max(finite)
    pad = 0.08 * (hi - lo) if hi > lo else 0.1 * max(abs(hi), 1.0)
    return lo - pad, hi + pad


def _draw_named_points(ax, points, limits) -> None:
    """The final-norm points ``(x, y, marker, colour, column)``: on the layers' scale ``limits`` when they
    fall inside it; else clipped to its edge (a triangle pointing off the scale) and annotated with the
    column and its value (annotations at one edge stacked, not overlaid)."""
    stacked = {True: 0, False: 0}
    for x, y, marker, color, key in points:
        if limits is None or limits[0] <= y <= limits[1]:
            ax.plot([x], [y], marker, color=color)
            continue
        above = y > limits[1]
        edge = limits[1] if above else limits[0]
        stacked[above] += 1
        offset = 10 * stacked[above] * (-1 if above else 1)
        ax.plot([x], [edge], "^" if above else "v", color=color, clip_on=False)
        ax.annotate(f"{key} {y:.4g} (off scale)", xy=(x, edge), xytext=(-6, offset), textcoords="offset points",
                    ha="right", va="center", fontsize=7, color=color)
    if limits is not None:
        ax.set_ylim(*limits)


def _layer_positions(rows: List[Dict[str, Any]]):
    """x positions and tick labels of the rows: the layer numbers, then one more position for a row
    without a layer number (the final norm), labelled with its name."""
    xs, labels = [], []
    for row in rows:
        x = row["layer"] if row["layer"] is not None else (xs[-1] + 1 if xs else 0)
        xs.append(x)
        labels.append(str(row["layer"]) if row["layer"] is not None else str(row["name"]))
    if len(xs) > 24:  # thin the integer labels of deep models, keep the named ones
        step = math.ceil(len(xs) / 12)
        labels = [lab if not lab.isdigit() or i % step == 0 else "" for i, lab in enumerate(labels)]
    return xs, labels


def model_title(model: nn.Module) -> str:
    """The name a report shows for ``model``: whiteformer's registry name; a transformers model's
    ``name_or_path`` (a local folder: its last component, never the path), else its class name."""
    name = getattr(model, "model_name", None)
    if isinstance(name, str) and name:
        return name
    config = getattr(model, "config", None)
    name = str(getattr(config, "name_or_path", "") or "")
    if name and (Path(name).is_absolute() or Path(name).exists() or name.startswith(".")):
        name = Path(name).resolve().name
    return name or type(model).__name__


def layerwise_report(
    model: Union[nn.Module, str, Path],
    images_or_tokens: torch.Tensor,
    eps: float = 0.5,
    out_dir: Optional[Union[str, Path]] = None,
    *,
    features: str = "output",
    plot: bool = True,
    dtype: torch.dtype = torch.float64,
    subspaces: Any = None,
    attention_mask: Optional[torch.Tensor] = None,
    progress: bool = False,
) -> LayerwiseReport:
    """Per-layer R, R_c, delta_R, R_c^var, R_c(Z|U) of ``model`` on a batch (see module docstring).

    Args:
        model: an ``nn.Module`` with attention blocks (vision shell, LM, CRATE, DeiT, ...); it is
            called as ``model(images_or_tokens)`` in eval mode under ``torch.no_grad`` (each
            submodule's training flag is restored afterwards). Or any ``transformers`` model (ViT,
            GPT-2, BERT, ...; whiteformer's wrappers are measured as whiteformer models), measured
            from its ``hidden_states`` (:mod:`whiteformer.analysis.hidden_states`), or a saved
            model folder (either kind).
        images_or_tokens: the model input, e.g. images (B, C, H, W) or token ids (B, T); each
            sample's tokens are one Z, the rates are averaged over the B samples.
        eps: quantisation error of the coding rates (> 0).
        out_dir: if given, write ``layerwise_report.json`` and (``plot``) ``layerwise_report.png``.
        features: "output" (block outputs, default) or "input" (attention inputs).
        dtype: accumulation dtype of the rates (float64 or float32).
        subspaces: transformers models only: the split U_[K] of R_c_U (None: the attention heads'
            split of the width; an int K; or bases (K, d, p)).
        attention_mask: transformers models only: (B, T) keep-mask, passed to the model; padded
            tokens are left out of Z.
        progress: a tqdm bar over the layers' rates on stderr when it is a terminal.
    Returns:
        a :class:`LayerwiseReport` (``.rows``, ``.to_markdown()``, ``.files``).
    Raises:
        ValueError: bad ``features``/``eps``, or no block ran; ImportError (naming the ``viz``
        extra) when a plot is requested without matplotlib (checked before running the model).
    """
    check_choice(features, "features", _FEATURES)
    check_positive_real(eps, "eps")
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    if out_dir is not None:
        _check_out_dir(out_dir)
        if plot:
            require_matplotlib("layerwise_report's plot (plot=False writes the JSON only)")
    check_tensor(images_or_tokens, "images_or_tokens", floating=False)
    if isinstance(model, (str, Path)):
        model = hidden_states.load_for_analysis(model)
    if isinstance(getattr(model, "whiteformer", None), nn.Module):  # a whiteformer.hf wrapper
        model = model.whiteformer
    if hidden_states.is_transformers_model(model):
        with torch.no_grad(), eval_mode(model):
            rows = hidden_states.hidden_state_rows(model, images_or_tokens, float(eps), features, dtype, subspaces,
                                                   attention_mask, progress=progress)
        report = LayerwiseReport(rows, float(eps), features, int(images_or_tokens.shape[0]), model_title(model))
        if out_dir is not None:
            report.save(out_dir, plot=plot)
        return report
    if subspaces is not None or attention_mask is not None:
        raise ValueError("subspaces and attention_mask apply to transformers models; a whiteformer model is measured "
                         "with each layer's own bases and memberships")

    with torch.no_grad(), eval_mode(model), capture(model) as rec:
        model(images_or_tokens)
    ran = [r for r in rec.blocks if r.calls > 0 and r.output is not None]
    if not ran:
        raise ValueError("no attention block ran during model(images_or_tokens)")
    rows = []
    with progress_bar(len(ran), "layerwise", "layer", enabled=progress) as bar:
        for r in ran:
            rows.append(_layer_row(r, features, float(eps), dtype))
            bar.update(1)
    report = LayerwiseReport(rows, float(eps), features, int(images_or_tokens.shape[0]), model_title(model))
    if out_dir is not None:
        report.save(out_dir, plot=plot)
    return report


def coding_rate_figure(rates: List[float], eps: float = 0.5, dpi: int = 110):
    """The figure (not saved) of one R(Z) per block (blocks numbered from 1), titled with ``eps``
    and with :data:`RATE_READING` under it; e.g. ``layerwise_report(...).column("R")``."""
    fig = new_figure((5.6, 3.8), dpi, "the coding-rate plot")
    ax = fig.subplots()
    ax.plot(range(1, len(rates) + 1), rates, "o-")
    ax.set_xlabel("block")
    ax.set_ylabel("coding rate R(Z)")
    ax.set_title(f"layer-wise coding rate of the tokens (eps {eps:g})", fontsize=10)
    ax.set_xticks(range(1, len(rates) + 1))
    fig.text(0.5, 0.01, RATE_READING.replace("; ", ";\n", 1), ha="center", va="bottom", fontsize=7)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    return fig
