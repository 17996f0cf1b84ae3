import sys

from tessera.config.manager import main

sys.exit(main(sys.argv[1:]))
