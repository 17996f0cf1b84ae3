#!/usr/bin/env bash
# ./run_tests.sh [pytest args]: set up the environment (first run only), then run the whole suite on two pytest-xdist
# workers (tests/conftest.py: the multi-rank tests one at a time on one of them; the paced ones, then the
# single-process modules, on the other), ending with the 15 slowest tests and the total. TESSERA_TEST_WORKERS=0 runs
# everything in this one process.
set -eo pipefail
source "$(dirname "$0")/scripts/env.sh"
cd "$TESSERA_ROOT"
# Compiled tests check what Tessera composes around torch.compile (blocks, loss, FSDP/TP/PP/AC hooks) against eager;
# on CPU most of a cold compile is g++ building inductor's kernels, a third less without SIMD intrinsics. The graphs,
# their fusions and the Triton kernels of a GPU run are the same either way.
export TORCHINDUCTOR_VEC_ISA_OK="${TORCHINDUCTOR_VEC_ISA_OK:-0}"
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" exec "$PYTHON" -m pytest -n "${TESSERA_TEST_WORKERS:-2}" \
  --dist loadgroup --no-loadscope-reorder --durations=15 "$@"
