"""Builds a JobConfig from defaults < TOML file < CLI flags, and renders `--help` and the dumped TOML.

Torch-free on purpose: `run_train.sh` checks a config in well under a second before launching ranks.
"""

import dataclasses
import difflib
import logging
import math
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from typing import Any

import tomli_w

from tessera.config.sections import REMOVED, JobConfig

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


class ConfigError(ValueError):
    """Bad user input: the message is one line naming the key (and file) and how to fix it."""


def _leaves(obj, prefix=""):
    """Yield (dotted key, owner dataclass, field) for every leaf option."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", obj, f


def _field_type(owner, f) -> Any:
    return typing.get_type_hints(type(owner))[f.name]


def _describe(tp) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            type(None): "none", list[str]: "a comma-separated list"}.get(tp, str(tp))


def _convert(value: Any, tp: Any, key: str, where: str, from_cli: bool) -> Any:
    """Convert a TOML value (typed) or CLI string to `tp`, or raise ConfigError naming the key."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if isinstance(value, str) and value.lower() in ("none", "null"):  # TOML has no null
            return None
        inner = next(a for a in typing.get_args(tp) if a is not type(None))
        try:
            return _convert(value, inner, key, where, from_cli)
        except ConfigError:
            raise ConfigError(f"{key}{where}: expected {_describe(tp)}, got {value!r}") from None
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if from_cli and value.lower() in _TRUE + _FALSE:
                return value.lower() in _TRUE
        elif tp is int and not isinstance(value, bool):
            if isinstance(value, int) or from_cli:
                return int(value)
        elif tp is float and not isinstance(value, bool):
            if isinstance(value, (int, float)) or from_cli:
                return float(value)
        elif tp is str:
            if isinstance(value, str):
                return value
        elif tp == list[str]:
            if from_cli:
                return [v.strip() for v in value.split(",") if v.strip()]
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                return value
    except ValueError:
        pass
    raise ConfigError(f"{key}{where}: expected {_describe(tp)}, got {value!r}")


def _options(cfg: JobConfig) -> dict[str, tuple[Any, dataclasses.Field]]:
    return {key: (owner, f) for key, owner, f in _leaves(cfg)}


def _unknown(key: str, known, where: str) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else "; see --help for the options"
    return ConfigError(f"unknown option '{key}'{where}{hint}")


def _current(key: str, moved: Mapping[str, str], where: str) -> str | None:
    """The key an option of an older config is now read as (one warning line when it moved), or None when it is
    gone (one warning line saying why)."""
    if key in moved:
        logging.getLogger("tessera").warning(f"{key}{where} has moved to {moved[key]}; read as that (rename it)")
        return moved[key]
    if key in REMOVED:
        logging.getLogger("tessera").warning(f"{key}{where} is ignored: {REMOVED[key]}")
        return None
    return key


def _set(cfg: JobConfig, options, key: str, value: Any, where: str, from_cli: bool) -> None:
    if key not in options:
        raise _unknown(key, options, where)
    owner, f = options[key]
    if f.metadata.get("table") and isinstance(value, dict):  # a TOML table {NAME = number} -> "NAME:number,..."
        value = ",".join(f"{k}:{v}" for k, v in value.items())
    value = _convert(value, _field_type(owner, f), key, where, from_cli)
    choices, low, high, below = (f.metadata.get(k) for k in ("choices", "min", "max", "below"))
    if choices and value not in choices:
        raise ConfigError(f"{key}{where}: {value!r} is not one of {', '.join(map(str, choices))}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}{where}: {value!r} is {'not a number' if math.isnan(value) else 'infinite'}; "
                          f"give a finite number")
    if low is not None and value is not None and value < low:
        raise ConfigError(f"{key}{where}: {value!r} is below the minimum {low}")
    if high is not None and value is not None and value > high:
        raise ConfigError(f"{key}{where}: {value!r} is above the maximum {high}")
    if below is not None and value is not None and value >= below:
        raise ConfigError(f"{key}{where}: {value!r} must be below {below}")
    setattr(owner, f.name, value)


def _flatten_toml(table: dict, prefix: str = "", options=()):
    for k, v in table.items():
        if isinstance(v, dict) and f"{prefix}{k}" not in options:  # a section, not a table-valued option
            yield from _flatten_toml(v, f"{prefix}{k}.", options)
        else:
            yield f"{prefix}{k}", v


def _split_cli(argv: list[str], options, moved: Mapping[str, str]) -> list[tuple[str, str]]:
    """`--a.b v`, `--a.b=v`, bare `--a.b` (boolean true) -> [(key, raw value)] (keys as now named; a removed
    option's value is dropped)."""
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}': options look like --section.key value")
        key, eq, value = arg[2:].partition("=")
        old, key = key, _current(key, moved, " (on the command line)") if key in {**moved, **REMOVED} else key
        if key is None:  # gone: skip its value too
            i += 1 if eq else 2
            continue
        if key not in options:  # before guessing whether it takes a value: a mistyped bool must not eat the next flag
            raise _unknown(key, options, " (on the command line)")
        if not eq:
            owner_field = options.get(key)
            is_bool = owner_field is not None and _field_type(*owner_field) is bool
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if is_bool and (nxt is None or nxt.lower() not in _TRUE + _FALSE):
                value = "true"
            elif nxt is None:
                raise ConfigError(f"--{key}: missing value")
            else:
                value, i = nxt, i + 1
        if any(k == key for k, _ in pairs):
            raise ConfigError(f"--{old} is given twice on the command line; keep one")
        pairs.append((key, value))
        i += 1
    return pairs


def parse_args(argv: list[str], schema: type = JobConfig, moved: Mapping[str, str] | None = None) -> JobConfig:
    """defaults < --job.config_file TOML < CLI flags, into `schema` (tessera.schema's has the families'
    sections); `moved`: {old key: new key} of options that moved, read where they are now with one warning line."""
    cfg, moved = schema(), moved or {}
    options = _options(cfg)
    cli = _split_cli(argv, options, moved)
    path = next((v for k, v in cli if k == "job.config_file"), "")
    if path:
        if os.path.isdir(path):
            raise ConfigError(f"job.config_file: '{path}' is a folder; name a .toml file (configs/ has examples)")
        if not os.path.isfile(path):
            raise ConfigError(f"job.config_file: no such file '{path}'")
        try:
            with open(path, "rb") as fh:
                table = tomllib.load(fh)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"job.config_file: '{path}' is not valid TOML ({e})") from None
        for key, value in _flatten_toml(table, options=options):
            if (key := _current(key, moved, f" (in {path})")) is not None:
                _set(cfg, options, key, value, f" (in {path})", from_cli=False)
    for key, value in cli:
        _set(cfg, options, key, value, " (on the command line)", from_cli=True)
    return cfg


def to_toml(cfg: JobConfig) -> str:
    def strip_none(d):
        return {k: strip_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}
    return tomli_w.dumps(strip_none(dataclasses.asdict(cfg)))


def _sections(schema: type):
    """[(section, [(dotted key, owner, field), ...])] in schema order; a nested dataclass is its own section."""
    grouped: dict[str, list] = {}
    for key, owner, f in _leaves(schema()):
        grouped.setdefault(key.rsplit(".", 1)[0], []).append((key, owner, f))
    return list(grouped.items())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _type_name(tp) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return {type(None): "none", list[str]: "list of strings"}.get(tp, getattr(tp, "__name__", str(tp)))


def _toml_value(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, str) and not value:
        return '""'
    return tomli_w.dumps({"v": value}).strip()[4:]  # TOML's spelling: true, "x", ["a", "b"]


def _valid_values(f) -> str:
    meta = f.metadata
    parts = [" / ".join(f"`{c}`" for c in meta["choices"])] if meta.get("choices") else []
    if meta.get("min") is not None:
        parts.append(f">= {meta['min']}")
    if meta.get("max") is not None:
        parts.append(f"<= {meta['max']}")
    if meta.get("below") is not None:
        parts.append(f"< {meta['below']}")
    if meta.get("table"):
        parts.append("NAME:number,... or a TOML table {NAME = number}")
    return ", ".join(parts)


def markdown_reference(schema: type = JobConfig) -> str:
    """Every section and option of `schema` (tessera.schema's has the families' sections) with its type, default,
    valid values and doc: docs/config-reference.md."""
    sections = _sections(schema)
    lines = ["# Configuration reference", "",
             "<!-- Generated from tessera/config/sections.py by `python -m tessera.config --markdown > "
             "docs/config-reference.md`; tests/test_docs.py fails when this file is stale. Do not edit. -->", "",
             "Every option of a run, by TOML section. Give it in the config file (`[section]` then `key = value`) or "
             "on the command line (`--section.key value`); the command line wins, then the file, then the default "
             "shown here. How to write them: [configuration.md](configuration.md).", "",
             " ".join(f"[`[{name}]`](#{name.replace('.', '')})" for name, _ in sections), ""]
    for name, leaves in sections:
        lines += [f"## [{name}]", "", "| option | type | default | valid values | what it does |",
                  "| --- | --- | --- | --- | --- |"]
        for key, owner, f in leaves:
            cells = (f"`{key.rsplit('.', 1)[1]}`", _type_name(_field_type(owner, f)),
                     f"`{_toml_value(getattr(owner, f.name))}`", _valid_values(f), f.metadata["doc"])
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def help_text(schema: type = JobConfig) -> str:
    lines = ["usage: torchrun ... -m tessera.train [--job.config_file FILE] [--section.key VALUE ...]",
             "", "Precedence: CLI > TOML file > defaults. Booleans: --key, --key=false. Lists: a,b.", ""]
    for name, leaves in _sections(schema):
        lines.append(f"[{name}]")
        for key, owner, f in leaves:
            default = getattr(owner, f.name)
            choices = f.metadata.get("choices")
            extra = f" {{{'|'.join(map(str, choices))}}}" if choices else ""
            lines.append(f"  --{key:<46} {f.metadata['doc']} (default: {default!r}){extra}")
    return "\n".join(lines)
