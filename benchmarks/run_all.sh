#!/usr/bin/env bash
# The CPU benchmark suite in one command (~10 minutes on 2 cores), then a summary of every ratio with its target.
# JSON lands in benchmarks/results/ (or $OUT): trainer.json, features.json, cp.json, data.json, prepared.json,
# moe.json, summary.json.
# The sizes below trade time for noise; each script's --help lists its options.
#   benchmarks/run_all.sh --smoke   (or SMOKE=1): every script with --smoke (tiny sizes, a few steps), JSON in a
#   temporary folder unless $OUT is set: checks that the suite runs (about a minute), measures nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
if [[ "${1:-}" == "--smoke" ]]; then SMOKE=1; fi
if [[ "${SMOKE:-0}" == 1 ]]; then
    OUT=${OUT:-$(mktemp -d -t tessera-smoke-XXXXXX)}
    for script in trainer features cp data prepared moe; do
        echo "== bench_$script.py --smoke"
        $PY benchmarks/bench_$script.py --smoke --out "$OUT/$script.json"
    done
    echo; echo "== Muon vs AdamW: loss after the same tokens (each at its best lr of a grid), optimizer step at FSDP 2 and 4"
$PY benchmarks/bench_optim.py --out "$OUT/optim.json"
$PY benchmarks/summary.py --results "$OUT"
    exit
fi
OUT=${OUT:-benchmarks/results}
rm -f "$OUT"/trainer.json "$OUT"/features.json "$OUT"/cp.json "$OUT"/data.json "$OUT"/moe.json "$OUT"/summary.json \
    "$OUT"/prepared.json

echo "== 1-3: trainer vs plain eager loop, + compile, MFU, FSDP 2 ranks"
$PY benchmarks/bench_trainer.py --compile --fsdp --steps 15 --warmup 2 --rounds 5 --out "$OUT/trainer.json"
echo; echo "== 4: AC memory and time, Float8 (compile's speed-up is measured in the rounds above)"
$PY benchmarks/bench_features.py --only ac,float8 --steps 6 --warmup 1 --rounds 3 --float8_steps 10 \
    --out "$OUT/features.json"
echo; echo "== context parallel"
$PY benchmarks/bench_cp.py --seq_len 2048 --steps 2 --degrees 1,2,4 --out "$OUT/cp.json"
echo; echo "== data loading at DP 1-8"
$PY benchmarks/bench_data.py --out "$OUT/data.json"
echo; echo "== prepared (pre-tokenized) data vs the streaming loader at DP 1, 8, 64; prepare's tokens/s"
$PY benchmarks/bench_prepared.py --out "$OUT/prepared.json"
echo; echo "== mixture of experts: grouped GEMMs vs loop, EP dispatch share at EP 2 and 4"
$PY benchmarks/bench_moe.py --out "$OUT/moe.json"
echo; echo "== Muon vs AdamW: loss after the same tokens (each at its best lr of a grid), optimizer step at FSDP 2 and 4"
$PY benchmarks/bench_optim.py --out "$OUT/optim.json"
$PY benchmarks/summary.py --results "$OUT"
