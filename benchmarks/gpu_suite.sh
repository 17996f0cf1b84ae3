#!/usr/bin/env bash
# One GPU, Tessera against its peers (issue 33), in one command that stops starting runs after ~7.5 minutes:
# prints the table and writes benchmarks/results/gpu.json (after every run, so a cut-short suite leaves its rows).
#   benchmarks/gpu_suite.sh [bench_gpu.py options]    # e.g. --resume: keep the ok rows of gpu.json, run the rest
#   benchmarks/gpu_suite.sh --smoke                    # dry run on CPU (tiny model): every peer that runs there
# Wheels the machine lacks (benchmarks/gpu_wheels.sh puts them in .whl/) are installed first into a target folder
# that goes before the machine's own packages on PYTHONPATH; its torch is used whatever its version.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    SITE=${SITE:-/tmp/tessera-gpu-site}
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
"$PY" -c "import torch, sys; print(f'python {sys.version.split()[0]}, torch {torch.__version__}, cuda '
          f'{torch.cuda.is_available()}')"
exec "$PY" "${SUITE:-benchmarks/bench_gpu.py}" --budget_s "${BUDGET_S:-440}" "$@"  # gpu_moe.sh: bench_gpu_moe.py
