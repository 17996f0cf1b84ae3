"""`python -m tessera.config [--world-size N] [flags]`: check only, for launch scripts (no torch import);
`python -m tessera.config --markdown` prints the config reference (docs/config-reference.md) instead. The entry
point of the package, not part of it: the whole schema and the checks live above it, in tessera.preflight."""

import sys

from tessera.preflight import main

sys.exit(main(sys.argv[1:]))
