"""`python -m tessera.config [--world-size N] [flags]`: validate only, for launch scripts (no torch import).

`python -m tessera.config --markdown` prints the config reference (docs/config-reference.md) instead."""

import sys

from tessera.config.manager import ConfigError, help_text, markdown_reference, parse_args
from tessera.config.validate import validate


def main(argv: list[str]) -> int:
    """Exit status 0 when the config is valid, 2 with one line on stderr when not."""
    world_size = 1
    if argv[:1] == ["--world-size"]:
        if len(argv) < 2 or not argv[1].isdigit() or int(argv[1]) < 1:
            print(f"tessera: --world-size: expected a positive integer (NGPU x nodes), got {argv[1:2]}",
                  file=sys.stderr)
            return 2
        world_size, argv = int(argv[1]), argv[2:]
    if argv == ["--markdown"]:
        print(markdown_reference())
        return 0
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    try:
        validate(parse_args(argv), world_size)
    except ConfigError as e:
        print(f"tessera: {e}", file=sys.stderr)
        return 2
    return 0


sys.exit(main(sys.argv[1:]))
