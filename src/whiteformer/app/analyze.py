"""``whiteformer analyze <analysis>``: the analyses and their configurations.

Each analysis has a configuration dataclass: the options every analysis takes
(:class:`~whiteformer.app.config.AnalyzeConfig`: ``--out``, ``--seed``, ``--plots``, ``--overwrite``,
``--progress``) and its own typed options, filled like every command's (defaults, ``-c FILE``,
``--key value`` / ``key=value``; ``whiteformer analyze --help`` lists them):

* ``eca-toy`` (:class:`EcaToyConfig`): the ECAttention toy experiment, ``--small`` and the toy's
  sizes and step sizes (:class:`whiteformer.app.eca_toy.ToyConfig`; unset: the preset's);
* ``layerwise`` (:class:`LayerwiseConfig`): layer-wise coding rates of a saved model;
* ``report`` (:class:`ReportConfig`): the report of a classification run, re-created.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import List, Optional

from .config import AnalyzeConfig, ConfigError, _h

__all__ = ["EcaToyConfig", "LayerwiseConfig", "ReportConfig", "eca_toy", "layerwise", "report",
           "LAYERWISE_MAX_SAMPLES", "LAYERWISE_MAX_SEQ_LEN"]

#: bounds of analyze layerwise's random inputs (samples x seq_len tokens)
LAYERWISE_MAX_SAMPLES = 4096
LAYERWISE_MAX_SEQ_LEN = 65536


# ---------------------------------------------------------------------------------- eca-toy
def _toy_fields():
    """The toy's sizes and step sizes as optional options (None: the preset's value)."""
    from .eca_toy import SMALL, ToyConfig

    out = []
    for f in dataclasses.fields(ToyConfig):
        kind = List[float] if f.name == "eps_sweep" else {"int": int, "float": float}.get(
            f.type if isinstance(f.type, str) else f.type.__name__, float)
        text = f"toy {f.name} (default {f.default!r}, --small {getattr(SMALL, f.name)!r})"
        out.append((f.name, Optional[kind], _h(text, default=None)))
    return out


EcaToyConfig = dataclasses.make_dataclass(
    "EcaToyConfig", [("small", bool, _h("reduced problem size (quick check)", default=False)), *_toy_fields()],
    bases=(AnalyzeConfig,))
EcaToyConfig.__doc__ = "``whiteformer analyze eca-toy``: the ECAttention toy experiment (ECA paper Sec. 4.1)."
EcaToyConfig.__module__ = __name__


def _toy_overrides(cfg) -> dict:
    from .eca_toy import ToyConfig

    out = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ToyConfig) if getattr(cfg, f.name) is not None}
    if "eps_sweep" in out:
        out["eps_sweep"] = tuple(out["eps_sweep"])
    return out


def eca_toy(cfg) -> int:
    """``whiteformer analyze eca-toy``: the toy's results (JSON + figures) in ``cfg.out``."""
    from . import eca_toy as toy
    from .train.outputs import staged_output

    options = _toy_overrides(cfg)
    try:
        toy.check_overrides(options, toy.SMALL if cfg.small else None)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    with staged_output(cfg.out, overwrite=cfg.overwrite) as stage:
        res = toy.run(stage, seed=cfg.seed, small=cfg.small, plots=cfg.plots, progress=cfg.progress, **options)
    print(toy._format_summary(res))
    print(f"results: {cfg.out}/eca_toy.json" + "".join(f", {cfg.out}/{f}" for f in res.get("figures", [])))
    return 0


# ---------------------------------------------------------------------------------- layerwise
@dataclass
class LayerwiseConfig(AnalyzeConfig):
    """``whiteformer analyze layerwise``: layer-wise coding rates R, R_c, delta R of a saved model."""

    checkpoint: Optional[str] = _h("saved model folder, whiteformer's or any transformers model's", path=True,
                                   default=None)
    inputs: Optional[str] = _h("a torch.save'd tensor of inputs (images or token ids); none: random inputs",
                               path=True, default=None)
    eps: float = _h("eps of the coding rates", default=0.5)
    subspaces: Optional[int] = _h("K subspaces of R_c (transformers models)", default=None)
    samples: int = _h(f"random inputs: samples (at most {LAYERWISE_MAX_SAMPLES})", default=8)
    seq_len: int = _h(f"random inputs: tokens per sample (at most {LAYERWISE_MAX_SEQ_LEN})", default=32)
    features: str = _h("the tokens measured: each block's 'output' or 'input'", default="output")

    def validate(self) -> None:
        super().validate()
        for k, cap in (("samples", LAYERWISE_MAX_SAMPLES), ("seq_len", LAYERWISE_MAX_SEQ_LEN)):
            if not 1 <= getattr(self, k) <= cap:
                raise ConfigError(f"{k} must be an integer in [1, {cap}], got {getattr(self, k)!r}")
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise ConfigError(f"eps must be a finite number > 0, got {self.eps!r}")
        if self.subspaces is not None and self.subspaces < 1:
            raise ConfigError(f"subspaces must be an integer >= 1, got {self.subspaces!r}")
        if self.features not in ("output", "input"):
            raise ConfigError(f"features must be 'output' or 'input', got {self.features!r}")


def layerwise(cfg: LayerwiseConfig) -> int:
    """``whiteformer analyze layerwise``: ``layerwise_report.json`` (+ PNG) in ``cfg.out``."""
    from pathlib import Path

    import torch

    from ..analysis import layerwise_report
    from ..analysis.hidden_states import example_inputs, load_for_analysis
    from ..models import resolve_model_dir
    from ..models.read import load_torch_file
    from .train.outputs import check_output_dir, staged_output

    if not cfg.checkpoint:
        raise ConfigError("analyze layerwise needs --checkpoint MODEL_DIR (a saved whiteformer or transformers model)")
    check_output_dir(cfg.out, overwrite=cfg.overwrite)  # before any work
    try:
        model = load_for_analysis(resolve_model_dir(cfg.checkpoint)).eval()
    except (ValueError, TypeError) as err:  # its config.json: not a model's, or sizes refused before building
        raise ConfigError(f"cannot load {str(cfg.checkpoint)!r}: {str(err).splitlines()[0]}") from err
    if cfg.inputs:
        x = load_torch_file(Path(cfg.inputs))  # a file that is no torch file is named as such
        if not isinstance(x, torch.Tensor):
            raise ConfigError(f"inputs {cfg.inputs!r} must hold one tensor (images or token ids)")
    else:
        x = example_inputs(model, cfg.samples, cfg.seq_len, cfg.seed)
        print("note: no --inputs given: the rates are measured on random inputs")
    with staged_output(cfg.out, overwrite=cfg.overwrite) as stage:
        try:
            rep = layerwise_report(model, x, eps=cfg.eps, out_dir=stage, plot=cfg.plots, features=cfg.features,
                                   subspaces=cfg.subspaces, progress=cfg.progress)
        except (ValueError, TypeError) as err:  # its argument checks: options that do not fit this model
            raise ConfigError(str(err)) from None
    print(rep.to_markdown())
    print(f"report: {cfg.out}/layerwise_report.json" + (f", {cfg.out}/layerwise_report.png" if cfg.plots else ""))
    return 0


# ---------------------------------------------------------------------------------- report
@dataclass
class ReportConfig(AnalyzeConfig):
    """``whiteformer analyze report``: the report of a classification run, re-created."""

    checkpoint: Optional[str] = _h("the run directory (written by whiteformer train)", path=True, default=None)


def report(cfg: ReportConfig) -> int:
    """``whiteformer analyze report``: the run's report (markdown + figures) in ``cfg.out``."""
    import shutil
    from pathlib import Path

    from .evaluate import load_model, resolve_checkpoint
    from .train.build import build_task
    from .train.distributed import DistInfo, resolve_device
    from .train.outputs import check_output_dir, staged_output
    from .train.report import write_report

    if not cfg.checkpoint:
        raise ConfigError("analyze report needs --checkpoint RUN_DIR")
    path, run = resolve_checkpoint(cfg.checkpoint)
    if not run:
        raise ConfigError(f"{str(path)!r} has no train_config.json (not a run written by whiteformer train)")
    check_output_dir(cfg.out, overwrite=cfg.overwrite)  # before any work
    device = resolve_device("auto")
    model = load_model(path).to(device).eval()
    task = build_task(run["dataset"], data_dir=run.get("data_dir"), data_args=run.get("data_args", {}),
                      eval_split=run["eval_split"], dist=DistInfo(device=device),
                      **{k: run[k] for k in ("batch_size", "block_size", "eval_batches") if k in run})
    task.eval_progress = cfg.progress
    results = {"final_eval": task.evaluate(model)}
    info = {"model": run["model"], "dataset": run["dataset"], "eval_split": run["eval_split"], "checkpoint": str(path)}
    with staged_output(cfg.out, overwrite=cfg.overwrite) as stage:
        metrics = [d / "metrics.jsonl" for d in (path.parent, path.parent.parent) if (d / "metrics.jsonl").is_file()]
        if metrics:  # the run's training curves (read only; not written to --out)
            shutil.copyfile(metrics[0], stage / "metrics.jsonl")
        name = write_report(stage, model, task, results, info).name
        (stage / "metrics.jsonl").unlink(missing_ok=True)
    print(f"report: {Path(cfg.out) / name}")
    return 0
