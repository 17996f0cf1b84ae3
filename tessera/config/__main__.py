"""`python -m tessera.config [--world-size N] [flags]`: check only, for launch scripts (no torch import);
`python -m tessera.config --markdown` prints the config reference (docs/config-reference.md) instead. The entry
point of the package, not part of it: the command is tessera.config_cli, on the top floor of the imports."""

import sys

from tessera.config_cli import main

sys.exit(main(sys.argv[1:]))
