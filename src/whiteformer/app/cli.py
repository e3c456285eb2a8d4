"""The ``whiteformer`` command (also ``python -m whiteformer``): one ``argparse`` parser with a
subcommand per registered command.

    whiteformer train    [-c NAME|FILE] [--key value | key=value ...]   train / fine-tune a model
    whiteformer eval     --checkpoint RUN_OR_DIR [--dataset NAME --split test ...]
    whiteformer generate --checkpoint LM_RUN [--prompt TEXT --max-new-tokens N ...]
    whiteformer analyze  ANALYSIS [--out DIR ...]                         (eca-toy, layerwise, report)
    whiteformer compress --checkpoint CKPT --out DIR [...]                (whiteformer.app.compress_cli)
    whiteformer prepare-text FILE... --out DIR (--tokenizer PATH | --train-tokenizer N)   (.prepare_text)
    whiteformer linearize --teacher PATH --dataset tokens|text --data-dir D --out DIR [...]  (.linearize_cli)
    whiteformer list-models [PATTERN]        whiteformer list-datasets        whiteformer list-configs

``train``, ``eval``, ``generate``, ``analyze`` (each analysis its own subclass of ``AnalyzeConfig``),
``compress`` and ``prepare-text`` take their options from the command's configuration dataclass
(``whiteformer train --help`` lists them): its defaults, a YAML file (``-c FILE``, or ``-c NAME`` of
a shipped config: ``whiteformer list-configs``) and the words the parser does not know, read as
overrides by :func:`whiteformer.app.config.parse_overrides`, the last winning. Data-parallel
training: ``torchrun --nproc_per_node=N -m whiteformer train ...``.

Extension points: ``@register_command(name, help, arguments=add)`` adds a subcommand: ``add(parser)``
adds its options to the subcommand's parser and the function takes the parsed
``argparse.Namespace`` (with ``overrides=True``, the words the parser does not know are kept in
order as ``args.overrides`` instead of being refused); without ``arguments`` the function takes the
words after the command's name. ``register_lazy_command(name, "module:function", help,
arguments="module:function")`` imports both on first use (``arguments=config_arguments("module:Class")``
for a command configured by a dataclass). ``register_analysis(name, help, "module:function",
config="module:Class")`` (or ``@register_analysis(name, help)``) adds an ``analyze`` target. Each
returns an exit code.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from .._registry import Registry

__all__ = ["main", "build_parser", "register_command", "register_lazy_command", "register_analysis",
           "config_arguments", "COMMANDS", "ANALYSES"]

Arguments = Callable[[argparse.ArgumentParser], None]


@dataclass
class Command:
    """A subcommand: ``run(args)`` with ``args`` the parsed namespace when ``arguments`` adds its
    options, else the list of words after the command's name."""

    name: str
    help: str
    run: Callable[[Any], int]
    arguments: Optional[Arguments] = None
    overrides: bool = False


COMMANDS = Registry("command")
ANALYSES = Registry("analysis", choices="available: {names}")


class UsageError(Exception):
    """A command line that cannot be run: ``whiteformer <command>: error: ...``, exit code 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one ``prog: error: ...`` line with exit code 2, not the
    whole usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def register_command(name: str, help: str, arguments: Optional[Arguments] = None,
                     overrides: bool = False) -> Callable:
    """Decorator registering ``fn`` as ``whiteformer <name>``: ``fn(args: argparse.Namespace) -> int``
    when ``arguments(parser)`` adds the options (``overrides``: the words the parser does not know
    are ``args.overrides``), else ``fn(argv: list[str]) -> int`` with the words after the name."""

    def deco(fn: Callable[[Any], int]) -> Callable[[Any], int]:
        COMMANDS.register(name, Command(name, help, fn, arguments, overrides), help=help)
        return fn

    return deco


def _resolve(name: str, target: str) -> Callable:
    """``module:function`` imported, or a :class:`UsageError` saying the command is not available."""
    import importlib

    module, _, func = target.partition(":")
    try:
        return getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as err:
        raise UsageError(f"command {name!r} is not available ({target}): {err}") from err


def register_lazy_command(name: str, target: str, help: str, arguments: Union[str, Arguments, None] = None,
                          overrides: bool = False) -> None:
    """Register ``whiteformer <name>`` as ``module:function``, imported on first use, as are
    ``arguments`` given as ``module:function`` (see :func:`register_command`)."""

    def run(args: Any) -> int:
        rc = _resolve(name, target)(args)
        return rc if isinstance(rc, int) else 0

    def add(parser: argparse.ArgumentParser) -> None:
        (_resolve(name, arguments) if isinstance(arguments, str) else arguments)(parser)

    register_command(name, help, add if arguments is not None else None, overrides)(run)


@dataclass
class Analysis:
    """An ``analyze`` target: ``run(cfg) -> int`` with ``cfg`` its configuration (``config``, a
    dataclass or ``"module:Class"``; default :class:`~whiteformer.app.config.AnalyzeConfig`), each
    given as ``"module:name"`` to be imported on first use."""

    help: str
    run: Union[str, Callable[[Any], int]]
    config: Union[str, type, None] = None

    def resolve(self) -> Tuple[Callable[[Any], int], type]:
        run = _resolve("analyze", self.run) if isinstance(self.run, str) else self.run
        if self.config is None:
            from .config import AnalyzeConfig

            return run, AnalyzeConfig
        return run, (_resolve("analyze", self.config) if isinstance(self.config, str) else self.config)


def register_analysis(name: str, help: str, run: Optional[str] = None, config: Union[str, type, None] = None):
    """Register ``whiteformer analyze <name>``: ``run`` as ``"module:function"`` (imported on first
    use, with ``config`` its configuration class as ``"module:Class"``), or, without ``run``, a
    decorator registering ``fn(cfg) -> int``."""
    if run is not None:
        ANALYSES.register(name, Analysis(help, run, config), help=help)
        return None

    def deco(fn: Callable) -> Callable:
        ANALYSES.register(name, Analysis(help, fn, config), help=help)
        return fn

    return deco


# ---------------------------------------------------------------------------------- the parser
def build_parser(commands: Optional[Iterable[str]] = None) -> ArgumentParser:
    """The ``whiteformer`` parser: a subparser per registered command, with the options of
    ``commands`` (default: every command; the others are listed with their help only, so that
    parsing one command imports only what that command needs)."""
    from .._version import __version__

    parser = ArgumentParser(prog="whiteformer", formatter_class=argparse.RawDescriptionHelpFormatter,
                            description="Efficient, interpretable attention: train, evaluate, analyze and "
                                        "compress models.",
                            epilog="whiteformer COMMAND --help lists the options of a command. --debug (anywhere) "
                                   "or WHITEFORMER_DEBUG=1 shows the traceback of an error.")
    parser.add_argument("--version", action="version", version=f"whiteformer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    parser.subcommands = {}
    wanted = None if commands is None else set(commands)
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help, add_help=cmd.arguments is not None,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if cmd.arguments is not None and (wanted is None or cmd.name in wanted):
            cmd.arguments(p)
        parser.subcommands[cmd.name] = p
    return parser


def _parse(argv: List[str]) -> Tuple[Command, Any]:
    """The command named by ``argv[0]`` and what its function takes (``SystemExit`` for ``--help``,
    ``--version`` and usage errors, the message printed)."""
    name = argv[0]
    parser = build_parser([name])
    if name not in COMMANDS and not name.startswith("-"):
        parser.error(f"unknown command {name!r}{COMMANDS.hint(name)}; commands: {', '.join(COMMANDS)}")
    if name in COMMANDS and COMMANDS[name].arguments is None:
        return COMMANDS[name], argv[1:]
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.error("give a command" + (f" (unrecognized arguments: {' '.join(extra)})" if extra else ""))
    cmd = COMMANDS[args.command]
    if cmd.overrides:
        args.overrides = extra
    elif extra:
        parser.subcommands[cmd.name].error(f"unrecognized arguments: {' '.join(extra)}")
    return cmd, args


def config_arguments(config: str, usage: str = "[--key value | key=value ...]") -> Arguments:
    """The options of a command configured by the dataclass named ``config`` in
    :mod:`whiteformer.app.config` (or ``"module:Class"``, imported when the options are added):
    ``-c NAME|FILE``, and ``--help`` listing the dataclass's fields
    (the overrides themselves are the words the parser does not know: register with ``overrides=True``)."""

    def add(p: argparse.ArgumentParser) -> None:
        from . import config as config_module

        cls = _resolve(config, config) if ":" in config else getattr(config_module, config)
        p.usage = f"{p.prog} [-h] [-c NAME|FILE] {usage}"
        p.description = (cls.__doc__ or "").strip().splitlines()[0]
        p.epilog = ("options, from a YAML file (-c) and the command line (--key value, --key=value or key=value; "
                    "--key / --no-key for booleans; dict options as key.sub=value), the last winning:\n"
                    + config_module.format_fields(cls))
        p.allow_abbrev = False  # --co is an override, not --config
        p.add_argument("-c", "--config", metavar="NAME|FILE",
                       help="a YAML file of options, or the name of a shipped config (whiteformer list-configs)")

    return add


def _config(cls, args: argparse.Namespace, base: Optional[Callable] = None):
    """``cls`` from its defaults, ``base(overrides)`` (a mapping or None), ``-c FILE`` and the overrides."""
    from .config import config_from_args

    return config_from_args(cls, args, base=base)


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
@register_command("train", "train or fine-tune a model (resumable, DDP under torchrun)",
                  config_arguments("TrainConfig"), overrides=True)
def cmd_train(args: argparse.Namespace) -> int:
    from .train import TrainConfig, train
    from .train.outputs import say

    cfg = _config(TrainConfig, args, base=_resumed_run_config)
    res = train(cfg, command=_command_line())
    if res.get("final_dir") is None:  # not the main process
        return 0
    say(f"final {cfg.eval_split} {res['summary']}; training time {res['train_time_s']:.1f} s")
    say(f"model: {res['final_dir']}")
    if res.get("report"):
        figs = ", ".join(str(cfg.out) + "/" + f for f in res.get("figures", {}).values())
        say(f"report: {res['report']}" + (f" (figures: {figs})" if figs else ""))
    return 0


@register_command("eval", "accuracy / loss of a checkpoint on a dataset split",
                  config_arguments("EvalConfig", "--checkpoint RUN_OR_DIR [--dataset NAME] [--split test] [...]"),
                  overrides=True)
def cmd_eval(args: argparse.Namespace) -> int:
    from .evaluate import evaluate
    from .train import EvalConfig

    cfg = _config(EvalConfig, args)
    res = evaluate(cfg)
    if cfg.json:
        print(json.dumps(res))
    else:
        print(f"{res['dataset']}/{res['split']}: {res['summary']} [{res['checkpoint']}]")
    return 0


@register_command("generate", "sample text from a language-model checkpoint",
                  config_arguments("GenerateConfig", "--checkpoint LM_RUN [--prompt TEXT] [...]"), overrides=True)
def cmd_generate(args: argparse.Namespace) -> int:
    from .evaluate import generate
    from .train import GenerateConfig

    cfg = _config(GenerateConfig, args)
    for i, text in enumerate(generate(cfg)):
        if cfg.num_samples > 1:
            print(f"--- sample {i + 1}")
        print(text)
    return 0


def _analyze_arguments(p: argparse.ArgumentParser) -> None:
    from .config import AnalyzeConfig, format_fields

    config_arguments("AnalyzeConfig", "[--out DIR] [--key value | key=value ...]")(p)
    p.usage = p.usage.replace("[-c NAME|FILE]", "ANALYSIS [-c NAME|FILE]")
    p.add_argument("analysis", nargs="?", metavar="ANALYSIS", help="the analysis to run (listed below)")
    own = []
    for n, a in sorted(ANALYSES.items()):
        fields = format_fields(a.resolve()[1], skip=[f.name for f in dataclasses.fields(AnalyzeConfig)])
        own.append(f"options of {n}:\n{fields}" if fields else f"options of {n}: none of its own")
    p.epilog = ("analyses:\n" + "\n".join(f"  {n:12s} {a.help}" for n, a in sorted(ANALYSES.items()))
                + "\n\n" + p.epilog + "\n\n" + "\n\n".join(own))


def _analysis_overrides(overrides: List[str]) -> List[str]:
    """The words of ``analyze``, ``options.KEY=VALUE`` (the earlier spelling) read as ``KEY=VALUE``."""
    return [w.replace("options.", "", 1) if w.lstrip("-").startswith("options.") else w for w in overrides]


@register_command("analyze", "white-box analyses: " + "eca-toy, layerwise, report", _analyze_arguments,
                  overrides=True)
def cmd_analyze(args: argparse.Namespace) -> int:
    if args.analysis is None:
        raise UsageError("analyze needs an analysis name: " + ", ".join(sorted(ANALYSES)))
    if args.analysis not in ANALYSES:
        raise UsageError(ANALYSES.unknown(args.analysis))
    run, cls = ANALYSES[args.analysis].resolve()
    args.overrides = _analysis_overrides(args.overrides)
    return run(_config(cls, args))


register_lazy_command("compress", "whiteformer.app.compress_cli:run",
                      "compress a ViT/DeiT's attention (TruncAtt / CP SlimAtt / IrrAtt), save + report",
                      arguments=config_arguments("whiteformer.app.compress_cli:CompressConfig",
                                                 "--checkpoint CKPT --out DIR [--key value | key=value ...]"),
                      overrides=True)


register_lazy_command("prepare-text", "whiteformer.app.prepare_text:run",
                      "tokenize text files into train.bin / val.bin / meta.json for --dataset tokens",
                      arguments=config_arguments("whiteformer.app.prepare_text:PrepareTextConfig",
                                                 "FILE_OR_DIR [...] --out DIR [--key value | key=value ...]"),
                      overrides=True)


register_lazy_command("linearize", "whiteformer.app.linearize_cli:run",
                      "linearize a pretrained softmax decoder into causal TSSA (attention transfer + fine-tuning)",
                      arguments="whiteformer.app.linearize_cli:add_arguments")


def _pattern_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("pattern", nargs="?", help="fnmatch pattern of the names to list, e.g. 'tost_*'")


@register_command("list-models", "registered model names (optional fnmatch pattern)", _pattern_argument)
def cmd_list_models(args: argparse.Namespace) -> int:
    from ..models import list_models

    for n in list_models(args.pattern):
        print(n)
    return 0


def _no_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("words", nargs="*", help=argparse.SUPPRESS)


def _print_names(name: str, args: argparse.Namespace, names: Callable[[], List[str]],
                 describe: Callable[[str], str]) -> int:
    """``whiteformer list-NAME``: each name with its description."""
    if args.words:
        raise UsageError(f"list-{name} takes no arguments, got {' '.join(args.words)!r}")
    for n in names():
        print(f"{n:17s} {describe(n)}")
    return 0


@register_command("list-configs", "shipped configurations: the names -c takes", _no_arguments)
def cmd_list_configs(args: argparse.Namespace) -> int:
    from .configs import describe_config, list_configs

    return _print_names("configs", args, list_configs, describe_config)


@register_command("list-datasets", "dataset names for --dataset", _no_arguments)
def cmd_list_datasets(args: argparse.Namespace) -> int:
    from .data import dataset_info, list_datasets

    return _print_names("datasets", args, list_datasets, lambda n: dataset_info(n)["help"])


# ---------------------------------------------------------------------------------- analyses
register_analysis("eca-toy", "ECAttention toy experiment (ECA paper Sec. 4.1; whiteformer.app.eca_toy)",
                  "whiteformer.app.analyze:eca_toy", config="whiteformer.app.analyze:EcaToyConfig")
register_analysis("report", "re-create the report of a classification run (--checkpoint RUN --out DIR)",
                  "whiteformer.app.analyze:report", config="whiteformer.app.analyze:ReportConfig")
register_analysis("layerwise", "layer-wise coding rates R, R_c, delta R of a saved model, whiteformer or any "
                               "transformers one (--checkpoint DIR --out DIR; --inputs FILE.pt, --eps, "
                               "--subspaces K, --samples, --seq-len)",
                  "whiteformer.app.analyze:layerwise", config="whiteformer.app.analyze:LayerwiseConfig")


# ---------------------------------------------------------------------------------- entry point
def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the console script; returns the exit code: 2 with one ``error: ...`` line
    for a user-caused failure (``--debug`` or ``WHITEFORMER_DEBUG=1`` show the traceback), 128 +
    the signal number after an interrupted run saved its checkpoint."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    name = next((a for a in argv if a != "--debug"), "")
    who = f"whiteformer {name}".strip()
    try:
        from .train.errors import debug_requested  # (the training package: an interrupt here is one line too)

        debug = debug_requested(argv)
        if not argv:
            build_parser(()).print_help()
            return 2
        try:
            cmd, args = _parse(argv)
        except SystemExit as err:  # --help / --version (0) or a usage error (2, its line printed)
            return err.code if isinstance(err.code, int) else 0
        return cmd.run(args)
    except KeyboardInterrupt as err:
        print(f"{who}: interrupted" + (f": {err}" if str(err) else ""), file=sys.stderr)
        return int(getattr(err, "exit_code", 130))
    except Exception as err:  # noqa: BLE001 - user errors become one line; bugs keep their traceback
        from .train.errors import user_error

        msg = str(err) if isinstance(err, UsageError) else user_error(err)
        if msg is None or debug:
            raise
        print(f"{who}: error: {msg}", file=sys.stderr)
        return 2
    except BaseException as err:  # a native library's panic (pyo3's PanicException, e.g. from tokenizers)
        from .train.errors import is_panic, panic_message

        if not is_panic(err) or debug:
            raise
        print(f"{who}: error: {panic_message(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
