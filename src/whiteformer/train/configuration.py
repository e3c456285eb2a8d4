"""Configuration plumbing: a dataclass per command, filled from defaults, a YAML file and
command-line overrides (in that order of precedence, the last winning).

Override syntax (``parse_overrides``): ``--lr 1e-3``, ``--lr=1e-3``, ``lr=1e-3``; booleans
``--ema`` / ``--no-ema`` / ``ema=false``; dashes in names are underscores; dict fields take
dotted keys, ``model_args.embed_dim=64`` (or a whole YAML mapping, ``model_args={embed_dim: 64}``).
Values are converted to the field's type; unknown names and unconvertible values raise
:class:`ConfigError` saying what to fix.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type, TypeVar, Union

__all__ = ["ConfigError", "parse_overrides", "parse_value", "build_config", "config_to_dict", "save_config",
           "load_yaml", "format_fields"]

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem, reported before any work starts."""


def parse_value(text: str) -> Any:
    """A command-line string as a Python value: int, float (``1e-3`` too), bool, None, or YAML
    (lists / mappings), else the string itself."""
    s = text.strip()
    for conv in (int, float):
        try:
            return conv(s)
        except ValueError:
            pass
    low = s.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null", "~"):
        return None
    if s[:1] in ("[", "{"):
        import yaml

        try:
            return yaml.safe_load(s)
        except yaml.YAMLError as err:
            raise ConfigError(f"cannot parse {text!r} as a YAML list/mapping: {err}") from err
    return text


class Raw(str):
    """A command-line value not yet converted: string options keep the text as typed (``--prompt
    true`` is the text "true"), other options parse it with :func:`parse_value`."""


def parse_overrides(tokens: Sequence[str]) -> List[Tuple[str, Any]]:
    """``["--lr", "1e-3", "epochs=3", "--ema", "--no-progress"]`` -> [("lr", "1e-3"), ("epochs", "3"),
    ("ema", True), ("progress", False)] (names with dashes turned into underscores; the values are
    :class:`Raw` strings, converted to the option's type by :func:`build_config`)."""
    out: List[Tuple[str, Any]] = []
    i = 0
    toks = list(tokens)
    while i < len(toks):
        tok = toks[i]
        if tok.startswith("--"):
            body = tok[2:]
            if not body:
                raise ConfigError("empty option '--'")
            if "=" in body:
                key, val = body.split("=", 1)
                out.append((key.replace("-", "_"), Raw(val)))
            elif i + 1 < len(toks) and not (toks[i + 1].startswith("--") or _is_assignment(toks[i + 1])):
                out.append((body.replace("-", "_"), Raw(toks[i + 1])))
                i += 1
            elif body.startswith("no-") or body.startswith("no_"):
                out.append((body[3:].replace("-", "_"), False))
            else:
                out.append((body.replace("-", "_"), True))
        elif _is_assignment(tok):
            key, val = tok.split("=", 1)
            out.append((key.replace("-", "_"), Raw(val)))
        else:
            raise ConfigError(f"unexpected argument {tok!r}: use --key value or key=value")
        i += 1
    return out


def _is_assignment(tok: str) -> bool:
    if tok.startswith("-") or "=" not in tok:
        return False
    key = tok.split("=", 1)[0]
    return key.replace("_", "").replace("-", "").replace(".", "").isalnum()


def _strip_optional(tp) -> Tuple[Any, bool]:
    if typing.get_origin(tp) is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else Any), True
    return tp, False


def _coerce(name: str, value: Any, tp) -> Any:
    base, optional = _strip_optional(tp)
    if isinstance(value, Raw):
        if base is str and not (optional and value.strip().lower() in ("none", "null", "~")):
            return str(value)
        value = parse_value(value)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{name} cannot be null")
    origin = typing.get_origin(base) or base
    if base is Any:
        return value
    if origin is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if origin is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if origin is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if origin is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{name} must be a string, got {value!r}")
    if origin in (dict, Dict):
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{name} must be a mapping (e.g. {name}.key=value), got {value!r}")
    if origin in (list, List, tuple):
        if isinstance(value, (list, tuple)):
            return list(value)
        return [value]
    return value


def _fields(cls) -> Dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _unknown(cls, key: str) -> ConfigError:
    names = list(_fields(cls))
    close = difflib.get_close_matches(key, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown option {key!r} for {cls.__name__}{hint}; valid options: {', '.join(names)}")


def load_yaml(path) -> Dict[str, Any]:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    with open(p, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {err}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of option: value")
    return data


def build_config(cls: Type[T], yaml_path=None, overrides: Union[Sequence[Tuple[str, Any]], Dict[str, Any], None] = None,
                 base: Optional[Dict[str, Any]] = None) -> T:
    """``cls`` from its defaults, then ``base`` (a mapping), the YAML file, then ``overrides``."""
    hints = typing.get_type_hints(cls)
    fields = _fields(cls)
    values: Dict[str, Any] = {}
    for f in fields.values():
        if f.default is not dataclasses.MISSING:
            values[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            values[f.name] = f.default_factory()  # type: ignore[misc]

    def assign(key: str, value: Any, where: str) -> None:
        key = key.replace("-", "_")
        if "." in key:
            top, sub = key.split(".", 1)
            if top not in fields:
                raise _unknown(cls, top)
            base_t, _ = _strip_optional(hints[top])
            if (typing.get_origin(base_t) or base_t) not in (dict, Dict):
                raise ConfigError(f"{top} is not a mapping option; {key!r} ({where}) is invalid")
            d = dict(values.get(top) or {})
            d[sub] = parse_value(value) if isinstance(value, Raw) else value
            values[top] = d
            return
        if key not in fields:
            raise _unknown(cls, key)
        values[key] = _coerce(key, value, hints[key])

    for src, where in ((base or {}, "base"), (load_yaml(yaml_path) if yaml_path else {}, str(yaml_path))):
        for k, v in src.items():
            assign(str(k), v, where)
    items = overrides.items() if isinstance(overrides, dict) else (overrides or [])
    for k, v in items:
        assign(k, v, "command line")
    missing = [n for n in fields if n not in values]
    if missing:
        raise ConfigError(f"{cls.__name__}: required option(s) {missing} not given")
    cfg = cls(**values)
    validate = getattr(cfg, "validate", None)
    if callable(validate):
        validate()
    return cfg


def config_to_dict(cfg) -> Dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg, path) -> None:
    """Write the resolved configuration as YAML (atomically)."""
    import os
    import tempfile

    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".config.", suffix=".tmp", dir=str(path.parent))
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False)
    os.replace(tmp, path)


def format_fields(cls) -> str:
    """Help text: one line per option with its default and description (``metadata["help"]``)."""
    lines = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = "(required)"
        lines.append(f"  --{f.name.replace('_', '-'):22s} {f.metadata.get('help', '')} [default: {default!r}]")
    return "\n".join(lines)
