#!/usr/bin/env bash
# CONFIG_FILE=path.toml NGPU=N ./run_train.sh [--section.key value ...]   (or --job.config_file path.toml)
# NGPU = processes on this node (default: the GPU count, or 2 on CPU).
set -eo pipefail
source "$(dirname "$0")/scripts/env.sh"
if [ -z "${NGPU:-}" ]; then
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [ "${NGPU:-0}" -gt 0 ] || NGPU=2
fi
if ! [[ "$NGPU" =~ ^[1-9][0-9]*$ ]]; then
  echo "tessera: NGPU: expected a positive integer (processes on this node), got '$NGPU'" >&2
  exit 2
fi
for arg in "$@"; do
  if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then exec "$PYTHON" -m tessera.config --help; fi
done
config_flag "${CONFIG_FILE:-$TESSERA_ROOT/configs/llama3_debug.toml}" "$@"
# Check the config in a second, before any rank starts: one clear line and exit 2 when it is wrong.
"$PYTHON" -m tessera.config --world-size "$NGPU" --errors-only "${CONFIG_FLAG[@]}" "$@" || exit $?
if ! command -v nvidia-smi >/dev/null 2>&1; then
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))}"
fi
exec "$PYTHON" -m tessera.launch --standalone --nproc_per_node="$NGPU" \
  --local-ranks-filter "${LOG_RANK:-0}" \
  -m tessera.train "${CONFIG_FLAG[@]}" "$@"
