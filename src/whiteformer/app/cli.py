"""The ``whiteformer`` command (also ``python -m whiteformer``).

    whiteformer train    [-c FILE.yaml] [--key value | key=value ...]   train / fine-tune a model
    whiteformer eval     --checkpoint RUN_OR_DIR [--dataset NAME --split test ...]
    whiteformer generate --checkpoint LM_RUN [--prompt TEXT --max-new-tokens N ...]
    whiteformer analyze  ANALYSIS [--out DIR ...]                         (eca-toy, layerwise, report)
    whiteformer compress ...                                              (whiteformer.app.compress_cli)
    whiteformer prepare-text FILE... --out DIR (--tokenizer PATH | --train-tokenizer N)   (.prepare_text)
    whiteformer list-models [PATTERN]        whiteformer list-datasets        whiteformer list-configs

Options come from the command's configuration dataclass (``whiteformer train --help`` lists
them), a YAML file (``-c FILE``, or ``-c NAME`` of a shipped config: ``whiteformer list-configs``)
and overrides, the last winning. Data-parallel training:
``torchrun --nproc_per_node=N -m whiteformer train ...``.

Extension points: ``@register_command(name, help)`` adds a subcommand (a function taking the
remaining arguments and returning an exit code), ``register_lazy_command(name, "module:function",
help)`` one imported on first use; ``@register_analysis(name, help)`` adds an ``analyze`` target.
"""
from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .._registry import Registry

__all__ = ["main", "register_command", "register_lazy_command", "register_analysis", "COMMANDS", "ANALYSES"]


@dataclass
class Command:
    name: str
    help: str
    run: Callable[[List[str]], int]


COMMANDS = Registry("command")
ANALYSES = Registry("analysis", choices="available: {names}")


def register_command(name: str, help: str) -> Callable:
    """Decorator registering ``fn(argv: list[str]) -> int`` as ``whiteformer <name>``."""

    def deco(fn: Callable[[List[str]], int]) -> Callable[[List[str]], int]:
        COMMANDS.register(name, Command(name, help, fn), help=help)
        return fn

    return deco


def register_lazy_command(name: str, target: str, help: str) -> None:
    """Register ``whiteformer <name>`` as ``module:function`` (imported on first use; the function
    takes the remaining arguments and returns an exit code)."""
    module, _, func = target.partition(":")

    def run(argv: List[str]) -> int:
        import importlib

        try:
            fn = getattr(importlib.import_module(module), func)
        except (ImportError, AttributeError) as err:
            raise UsageError(f"command {name!r} is not available ({target}): {err}") from err
        rc = fn(argv)
        return rc if isinstance(rc, int) else 0

    register_command(name, help)(run)


def register_analysis(name: str, help: str) -> Callable:
    """Decorator registering ``fn(cfg: AnalyzeConfig) -> int`` as ``whiteformer analyze <name>``."""

    def deco(fn: Callable) -> Callable:
        ANALYSES.register(name, (help, fn), help=help)
        return fn

    return deco


class UsageError(Exception):
    pass


def _split_config(argv: Sequence[str]) -> Tuple[Optional[str], List[str], bool]:
    """Extract ``-c/--config FILE`` and ``-h/--help``; return (yaml, rest, help)."""
    yaml_path, rest, want_help = None, [], False
    i = 0
    argv = list(argv)
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            want_help = True
        elif a in ("-c", "--config"):
            if i + 1 >= len(argv):
                raise UsageError(f"{a} needs a YAML file")
            yaml_path = argv[i + 1]
            i += 1
        elif a.startswith("--config="):
            yaml_path = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return yaml_path, rest, want_help


def _config(cls, argv: Sequence[str], name: str, usage: str = "", base: Optional[Callable] = None):
    """``cls`` from its defaults, ``base(overrides)`` (a mapping or None), ``-c FILE`` and the overrides."""
    from .config import build_config, format_fields, parse_overrides

    yaml_path, rest, want_help = _split_config(argv)
    if want_help:
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        print(f"usage: whiteformer {name} {usage or '[-c FILE.yaml] [--key value | key=value ...]'}\n\n{doc}\n\n"
              f"options:\n{format_fields(cls)}")
        return None
    overrides = parse_overrides(rest)
    start = base(overrides) if base is not None else None
    return build_config(cls, yaml_path, overrides, base=start)


def _resumed_run_config(overrides) -> Optional[Dict]:
    """The base of ``train``'s configuration without ``-c``: ``unlimited_length`` on, or for
    ``train --out RUN --resume`` the run's own ``RUN/config.yaml`` (the command line still overrides
    it, e.g. a larger ``--epochs``)."""
    from pathlib import Path

    from .config import load_yaml, parse_value

    given = {k: v for k, v in overrides}
    resume = given.get("resume", False)
    if not (resume is True or (isinstance(resume, str) and parse_value(resume) is True)) or "out" not in given:
        return {"unlimited_length": True}  # the command's default language model generates without a limit
    saved = Path(str(given["out"])).expanduser() / "config.yaml"
    if not saved.is_file():
        return {"unlimited_length": True}
    base = load_yaml(saved)
    for key in ("resume", "overwrite"):
        base.pop(key, None)
    return base


def _command_line() -> str:
    return " ".join(shlex.quote(a) for a in (["whiteformer"] + sys.argv[1:])) if sys.argv else "whiteformer"


# ---------------------------------------------------------------------------------- commands
@register_command("train", "train or fine-tune a model (resumable, DDP under torchrun)")
def cmd_train(argv: List[str]) -> int:
    from .train import TrainConfig, train
    from .train.outputs import say

    cfg = _config(TrainConfig, argv, "train", base=_resumed_run_config)
    if cfg is None:
        return 0
    res = train(cfg, command=_command_line())
    if res.get("final_dir") is None:  # not the main process
        return 0
    say(f"final {cfg.eval_split} {res['summary']}; training time {res['train_time_s']:.1f} s")
    say(f"model: {res['final_dir']}")
    if res.get("report"):
        figs = ", ".join(str(cfg.out) + "/" + f for f in res.get("figures", {}).values())
        say(f"report: {res['report']}" + (f" (figures: {figs})" if figs else ""))
    return 0


@register_command("eval", "accuracy / loss of a checkpoint on a dataset split")
def cmd_eval(argv: List[str]) -> int:
    from .evaluate import evaluate
    from .train import EvalConfig

    cfg = _config(EvalConfig, argv, "eval", "--checkpoint RUN_OR_DIR [--dataset NAME] [--split test] [...]")
    if cfg is None:
        return 0
    res = evaluate(cfg)
    if cfg.json:
        print(json.dumps(res))
    else:
        print(f"{res['dataset']}/{res['split']}: {res['summary']} [{res['checkpoint']}]")
    return 0


@register_command("generate", "sample text from a language-model checkpoint")
def cmd_generate(argv: List[str]) -> int:
    from .evaluate import generate
    from .train import GenerateConfig

    cfg = _config(GenerateConfig, argv, "generate", "--checkpoint LM_RUN [--prompt TEXT] [...]")
    if cfg is None:
        return 0
    for i, text in enumerate(generate(cfg)):
        if cfg.num_samples > 1:
            print(f"--- sample {i + 1}")
        print(text)
    return 0


@register_command("analyze", "white-box analyses: " + "eca-toy, layerwise, report")
def cmd_analyze(argv: List[str]) -> int:
    from .train import AnalyzeConfig

    if not argv or argv[0].startswith("-"):
        if argv and argv[0] in ("-h", "--help"):
            _analyze_usage()
            return 0
        raise UsageError("analyze needs an analysis name: " + ", ".join(sorted(ANALYSES)))
    name, rest = argv[0], argv[1:]
    if name not in ANALYSES:
        raise UsageError(ANALYSES.unknown(name))
    cfg = _config(AnalyzeConfig, rest, f"analyze {name}")
    if cfg is None:
        return 0
    return ANALYSES[name][1](cfg)


def _analyze_usage() -> None:
    from .config import format_fields
    from .train import AnalyzeConfig

    print("usage: whiteformer analyze ANALYSIS [--out DIR] [...]\n\nanalyses:")
    for n, (h, _) in sorted(ANALYSES.items()):
        print(f"  {n:12s} {h}")
    print(f"\noptions:\n{format_fields(AnalyzeConfig)}")


@register_command("compress", "compress a ViT/DeiT's attention (TruncAtt / CP SlimAtt / IrrAtt), save + report")
def cmd_compress(argv: List[str]) -> int:
    from .compress_cli import main as compress_main

    return compress_main(argv)


register_lazy_command("prepare-text", "whiteformer.app.prepare_text:main",
                      "tokenize text files into train.bin / val.bin / meta.json for --dataset tokens")


@register_command("list-models", "registered model names (optional fnmatch pattern)")
def cmd_list_models(argv: List[str]) -> int:
    from ..models import list_models

    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        if argv and argv[0] in ("-h", "--help"):
            print("usage: whiteformer list-models [PATTERN]   (e.g. 'tost_*')")
            return 0
        raise UsageError("list-models takes at most one pattern, e.g. 'tost_*'")
    for n in list_models(argv[0] if argv else None):
        print(n)
    return 0


def _print_names(name: str, argv: List[str], what: str, names: Callable[[], List[str]],
                 describe: Callable[[str], str]) -> int:
    """``whiteformer list-NAME``: each name with its description; no arguments but ``--help``."""
    if argv:
        if argv[0] in ("-h", "--help"):
            print(f"usage: whiteformer list-{name}   ({what})")
            return 0
        raise UsageError(f"list-{name} takes no arguments, got {' '.join(argv)!r}")
    for n in names():
        print(f"{n:17s} {describe(n)}")
    return 0


@register_command("list-configs", "shipped configurations for -c NAME")
def cmd_list_configs(argv: List[str]) -> int:
    from .configs import describe_config, list_configs

    return _print_names("configs", argv, "the names -c takes, e.g. whiteformer train -c demo_digits",
                        list_configs, describe_config)


@register_command("list-datasets", "dataset names for --dataset")
def cmd_list_datasets(argv: List[str]) -> int:
    from .data import dataset_info, list_datasets

    return _print_names("datasets", argv, "the names --dataset takes", list_datasets,
                        lambda n: dataset_info(n)["help"])


# ---------------------------------------------------------------------------------- analyses
@register_analysis("eca-toy", "ECAttention toy experiment (ECA paper Sec. 4.1; whiteformer.app.eca_toy)")
def analysis_eca_toy(cfg) -> int:
    try:
        from . import eca_toy
    except ImportError as err:
        raise UsageError(f"the eca-toy analysis is not available: {err}") from err
    try:
        eca_toy.check_overrides(cfg.options, eca_toy.SMALL if cfg.small else None)
    except ValueError as err:
        raise UsageError(str(err)) from None
    from .train.outputs import staged_output

    with staged_output(cfg.out, overwrite=cfg.overwrite) as stage:
        res = eca_toy.run(stage, seed=cfg.seed, small=cfg.small, plots=cfg.plots, **cfg.options)
    fmt = getattr(eca_toy, "_format_summary", None)
    if callable(fmt):
        print(fmt(res))
    print(f"results: {cfg.out}/eca_toy.json" + "".join(f", {cfg.out}/{f}" for f in res.get("figures", [])))
    return 0


@register_analysis("report", "re-create the report of a classification run (--checkpoint RUN --out DIR)")
def analysis_report(cfg) -> int:
    import shutil
    from pathlib import Path

    from .config import ConfigError
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


@register_analysis("layerwise", "layer-wise coding rates R, R_c, delta R of a saved model, whiteformer or any "
                                "transformers one (--checkpoint DIR --out DIR; options.inputs=FILE.pt, options.eps, "
                                "options.subspaces=K, options.samples, options.seq_len)")
def analysis_layerwise(cfg) -> int:
    from pathlib import Path

    import torch

    from ..analysis import layerwise_report
    from ..analysis.hidden_states import example_inputs, load_for_analysis
    from ..models import resolve_model_dir
    from ..models.read import load_torch_file
    from .config import ConfigError
    from .train.outputs import check_output_dir, staged_output

    known = {"inputs", "eps", "subspaces", "samples", "seq_len", "features"}
    unknown = sorted(set(cfg.options) - known)
    if unknown:
        raise UsageError(f"unknown option(s) {unknown} for analyze layerwise; known: {sorted(known)}")
    if not cfg.checkpoint:
        raise ConfigError("analyze layerwise needs --checkpoint MODEL_DIR (a saved whiteformer or transformers model)")
    opts = _layerwise_options(cfg.options)
    check_output_dir(cfg.out, overwrite=cfg.overwrite)  # before any work
    try:
        model = load_for_analysis(resolve_model_dir(cfg.checkpoint)).eval()
    except (ValueError, TypeError) as err:  # its config.json: not a model's, or sizes refused before building
        raise ConfigError(f"cannot load {str(cfg.checkpoint)!r}: {str(err).splitlines()[0]}") from err
    if opts.get("inputs"):
        x = load_torch_file(Path(opts["inputs"]))  # a file that is no torch file is named as such
        if not isinstance(x, torch.Tensor):
            raise ConfigError(f"options.inputs {opts['inputs']!r} must hold one tensor (images or token ids)")
    else:
        x = example_inputs(model, opts["samples"], opts["seq_len"], cfg.seed)
        print("note: no options.inputs given: the rates are measured on random inputs")
    with staged_output(cfg.out, overwrite=cfg.overwrite) as stage:
        try:
            report = layerwise_report(model, x, eps=opts["eps"], out_dir=stage, plot=cfg.plots,
                                      features=opts["features"], subspaces=opts.get("subspaces"))
        except (ValueError, TypeError) as err:  # its argument checks: options that do not fit this model
            raise UsageError(str(err)) from None
    print(report.to_markdown())
    print(f"report: {cfg.out}/layerwise_report.json" + (f", {cfg.out}/layerwise_report.png" if cfg.plots else ""))
    return 0


#: bounds of analyze layerwise's random inputs (options.samples x options.seq_len tokens)
LAYERWISE_MAX_SAMPLES = 4096
LAYERWISE_MAX_SEQ_LEN = 65536


def _layerwise_options(opts: Dict) -> Dict:
    """``analyze layerwise``'s options with their defaults, checked (a :class:`UsageError` naming the
    option): samples / seq_len integers in [1, bound], eps a finite number > 0, subspaces an integer
    >= 1, features 'output' or 'input'."""
    import math

    from .._checks import is_int, is_real

    out = {"samples": 8, "seq_len": 32, "eps": 0.5, "features": "output", **opts}
    for k, cap in (("samples", LAYERWISE_MAX_SAMPLES), ("seq_len", LAYERWISE_MAX_SEQ_LEN)):
        if not (is_int(out[k]) and 1 <= out[k] <= cap):
            raise UsageError(f"options.{k} must be an integer in [1, {cap}], got {out[k]!r}")
    if not (is_real(out["eps"]) and math.isfinite(out["eps"]) and out["eps"] > 0):
        raise UsageError(f"options.eps must be a finite number > 0, got {out['eps']!r}")
    if out.get("subspaces") is not None and not (is_int(out["subspaces"]) and out["subspaces"] >= 1):
        raise UsageError(f"options.subspaces must be an integer >= 1, got {out['subspaces']!r}")
    if out["features"] not in ("output", "input"):
        raise UsageError(f"options.features must be 'output' or 'input', got {out['features']!r}")
    if out.get("inputs") is not None and not isinstance(out["inputs"], str):
        raise UsageError(f"options.inputs must be the path of a .pt file holding one tensor, got {out['inputs']!r}")
    return out


# ---------------------------------------------------------------------------------- entry point
def _usage() -> str:
    lines = ["usage: whiteformer COMMAND [options]   (whiteformer COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {c.name:14s} {c.help}" for c in COMMANDS.values()]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the console script; returns the exit code: 2 with one ``error: ...`` line
    for a user-caused failure (``--debug`` or ``WHITEFORMER_DEBUG=1`` show the traceback), 128 +
    the signal number after an interrupted run saved its checkpoint."""
    from .train.errors import debug_requested

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from .._version import __version__

        print(f"whiteformer {__version__}")
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"whiteformer: error: unknown command {name!r}{COMMANDS.hint(name)}; commands: {', '.join(COMMANDS)} "
              f"(whiteformer --help)", file=sys.stderr)
        return 2
    try:
        return COMMANDS[name].run(argv[1:])
    except KeyboardInterrupt as err:
        print(f"whiteformer {name}: interrupted" + (f": {err}" if str(err) else ""), file=sys.stderr)
        return int(getattr(err, "exit_code", 130))
    except Exception as err:  # noqa: BLE001 - user errors become one line; bugs keep their traceback
        from .train.errors import user_error

        msg = str(err) if isinstance(err, UsageError) else user_error(err)
        if msg is None or debug:
            raise
        print(f"whiteformer {name}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
