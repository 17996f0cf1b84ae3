#!/usr/bin/env bash
# One GPU, experts and attention kernels in training (issue 43), in one command that stops starting runs after
# ~7 minutes: prints each measurement and writes benchmarks/results/gpu_moe.json after every one.
#   benchmarks/gpu_moe.sh [bench_gpu_moe.py options]   # e.g. --resume: keep the finished runs, run the rest
#   benchmarks/gpu_moe.sh --smoke                       # dry run on CPU (tiny layer and debug models)
# gpu_suite.sh's set-up (the carried wheels of benchmarks/gpu_wheels.sh: TorchTitan 0.2.2, torchao, ...), then
# benchmarks/bench_gpu_moe.py.
set -euo pipefail
exec env SUITE=benchmarks/bench_gpu_moe.py BUDGET_S="${BUDGET_S:-420}" "$(dirname "$0")/gpu_suite.sh" "$@"
