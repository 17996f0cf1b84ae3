"""The whole config: tessera.config's schema with each registered family's options mounted as its own section
(`[flux]`, `[deepseek_v3]`), and what reads it without checking it: parsing, `--help`, the config reference. The
commands that only parse flags (generate, convert, cache, the config CLI's `--help`) import this, not the checks
(tessera.preflight)."""

from __future__ import annotations

import functools
import logging
import tomllib

from tessera import config, models
from tessera.config import ConfigError
from tessera.config.sections import mount
from tessera.models import family

log = logging.getLogger("tessera")


def schema() -> type:
    """The whole config class: tessera.config's JobConfig with a section per registered family, built on first use
    (for the registry as it is then: a test that registers a family gets a schema with it)."""
    return _schema(models.FAMILIES)


# One class per set of families (pickle finds it by name). Memoized safely: a pure function of the family names.
@functools.cache
def _schema(names: tuple[str, ...]) -> type:
    return mount({name: family(name).options for name in names if family(name).options is not None}, names,
                 __name__)


def __getattr__(name: str) -> type:
    """`JobConfig` (the whole schema) and `Model` (its section in which model.name chooses among the families):
    pickle finds the classes the schema made by these names."""
    if name == "JobConfig":
        return schema()
    if name == "Model":
        return schema().__dataclass_fields__["model"].type
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def moved() -> dict[str, str]:
    """Options a family took over from the shared sections: {old key: new key}, read where they are now, with a
    warning."""
    return {old: f"{name}.{new}" for name in models.FAMILIES for old, new in family(name).moved_options.items()}


def parse_args(argv: list[str]) -> config.JobConfig:
    """defaults < --job.config_file TOML < CLI flags, the families' sections included."""
    return config.parse_args(argv, schema(), moved())


def parse_run(argv: list[str]) -> config.JobConfig:
    """The config of a training run (tessera.train, its launch check): parse_args, and the section of a family other
    than model.name's, which the run reads nothing of, refused when set on the command line; set in the TOML (one
    shared across families), one warning line names what is ignored. (generate takes the family of the checkpoint
    it loads, so it parses with parse_args.)"""
    renamed, cfg = moved(), parse_args(argv)
    other = [name for name in models.FAMILIES if name != cfg.model.name and family(name).options is not None]
    flags = {renamed.get(key, key) for key in (arg[2:].partition("=")[0] for arg in argv if arg.startswith("--"))}
    for key in sorted(k for k in flags if k.partition(".")[0] in other):
        raise ConfigError(f"{key} (on the command line): model.name is {cfg.model.name!r}, whose runs read no "
                          f"[{key.partition('.')[0]}] section; drop the flag, or set model.name")
    in_toml = _toml_keys(cfg.job.config_file, renamed)
    if ignored := sorted(k for k in in_toml if k.partition(".")[0] in other):
        log.warning(f"{', '.join(ignored)} (in {cfg.job.config_file}): ignored, model.name is {cfg.model.name!r}")
    return cfg


def _toml_keys(path: str, renamed: dict[str, str]) -> set[str]:
    """The dotted keys the TOML at `path` sets (none without one), as they are named now."""
    if not path:
        return set()
    with open(path, "rb") as fh:
        table = tomllib.load(fh)

    def keys(node: dict, prefix: str = ""):
        for k, v in node.items():
            yield from keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]

    return {renamed.get(k, k) for k in keys(table)}


def help_text() -> str:
    return config.help_text(schema())


def markdown_reference() -> str:
    """docs/config-reference.md: every section, the families' included."""
    return config.markdown_reference(schema())
