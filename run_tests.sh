#!/usr/bin/env bash
# ./run_tests.sh [pytest args]: set up the environment (first run only), then run the whole suite.
set -eo pipefail
source "$(dirname "$0")/scripts/env.sh"
cd "$TESSERA_ROOT"
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" exec "$PYTHON" -m pytest "$@"
