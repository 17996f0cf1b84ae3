"""The config command, `python -m tessera.config` (tessera/config/__main__.py runs it): a run's config checked before
launch, its --help, and the config reference (docs/config-reference.md) with --markdown."""

import contextlib
import logging
import sys

from tessera.config import ConfigError
from tessera.preflight import validate
from tessera.schema import help_text, markdown_reference, parse_run


def main(argv: list[str]) -> int:
    """`python -m tessera.config [--world-size N] [--errors-only] [flags]`: check only, for launch scripts (no torch
    import): exit status 0 when the config is valid, 2 with one line on stderr when not. --errors-only: no warnings
    (a launch script's pre-check: rank 0 says them once the run starts)."""
    world_size = 1
    if argv[:1] == ["--world-size"]:
        if len(argv) < 2 or not argv[1].isdigit() or int(argv[1]) < 1:
            print(f"tessera: --world-size: expected a positive integer (NGPU x nodes), got {argv[1:2]}",
                  file=sys.stderr)
            return 2
        world_size, argv = int(argv[1]), argv[2:]
    errors_only = argv[:1] == ["--errors-only"]
    with _logging_at(logging.ERROR) if errors_only else contextlib.nullcontext():
        return _check(argv[errors_only:], world_size)


@contextlib.contextmanager
def _logging_at(level: int):
    """The tessera logger at `level` for the command, as it was after (a caller in the same process keeps its own)."""
    logger = logging.getLogger("tessera")
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


def _check(argv: list[str], world_size: int) -> int:
    if argv == ["--markdown"]:
        print(markdown_reference())
        return 0
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    try:
        validate(parse_run(argv), world_size, launch=True, training=True)
    except ConfigError as e:
        print(f"tessera: {e}", file=sys.stderr)
        return 2
    return 0
