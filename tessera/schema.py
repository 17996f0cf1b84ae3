"""The whole config: tessera.config's schema with each registered family's options mounted as its own section
(`[flux]`, `[deepseek_v3]`), and what reads it without checking it: parsing, `--help`, the config reference. The
commands that only parse flags (generate, convert, cache, the config CLI's `--help`) import this, not the checks
(tessera.preflight)."""

from __future__ import annotations

import functools

from tessera import config, models
from tessera.config.sections import mount
from tessera.models import family


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


def help_text() -> str:
    return config.help_text(schema())


def markdown_reference() -> str:
    """docs/config-reference.md: every section, the families' included."""
    return config.markdown_reference(schema())
