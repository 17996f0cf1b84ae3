#!/usr/bin/env bash
# Fault tolerance on one machine: a torchft lighthouse and REPLICA_GROUPS replica groups, each its own run_train.sh launch
# of NGPU processes (on CPU: gloo).
#   REPLICA_GROUPS=2 NGPU=1 CONFIG_FILE=configs/llama3_debug.toml scripts/ft_local.sh [--section.key value ...]
# Logs: <job.dump_folder>/replica_<id>/ (metrics.jsonl) and ft-replica_<id>.log here. To try a failure, kill one
# group's processes (its pid is printed) and start it again with the printed command: it rejoins from a live group.
# MIN_REPLICAS (default 1): fault_tolerance.min_replica_size. LIGHTHOUSE_PORT (default 29510).
# SEMI_SYNC (default none): fault_tolerance.semi_sync_method, local_sgd or diloco, syncing every SYNC_STEPS (20).
set -eo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
source "$ROOT/scripts/env.sh"
REPLICA_GROUPS="${REPLICA_GROUPS:-2}" NGPU="${NGPU:-1}" MIN_REPLICAS="${MIN_REPLICAS:-1}" PORT="${LIGHTHOUSE_PORT:-29510}"
SEMI_SYNC="${SEMI_SYNC:-none}" SYNC_STEPS="${SYNC_STEPS:-20}"
export TORCHFT_LIGHTHOUSE="http://127.0.0.1:$PORT"
# The lighthouse forms a quorum of whoever is live (min_replicas 1); the trainer refuses to commit below
# fault_tolerance.min_replica_size. A dead group is dropped after 5 s without heartbeats.
"$PYTHON" -m tessera.lighthouse --min_replicas 1 --bind "[::]:$PORT" --join_timeout_ms 10000 \
  --quorum_tick_ms 100 > ft-lighthouse.log 2>&1 &
lighthouse=$!
trap 'kill -INT "$lighthouse" 2>/dev/null || true' EXIT
"$PYTHON" - "$TORCHFT_LIGHTHOUSE" <<'PY' || exit 1
import sys, time, urllib.request
for _ in range(300):  # up to 30 s for the lighthouse to answer
    try:
        urllib.request.urlopen(sys.argv[1] + "/status", timeout=1).close()
        sys.exit(0)
    except OSError:
        time.sleep(0.1)
sys.exit(f"tessera: the lighthouse did not start at {sys.argv[1]}; see ft-lighthouse.log")
PY
pids=()
for ((g = 0; g < REPLICA_GROUPS; g++)); do
  cmd=(env NGPU="$NGPU" "$ROOT/run_train.sh" --fault_tolerance.enable true --fault_tolerance.replica_id "$g"
       --fault_tolerance.group_size "$REPLICA_GROUPS" --fault_tolerance.min_replica_size "$MIN_REPLICAS"
       --fault_tolerance.semi_sync_method "$SEMI_SYNC" --fault_tolerance.sync_steps "$SYNC_STEPS" "$@")
  "${cmd[@]}" > "ft-replica_$g.log" 2>&1 &
  pids+=($!)
  echo "tessera: replica group $g: pid $!, log ft-replica_$g.log; relaunch: TORCHFT_LIGHTHOUSE=$TORCHFT_LIGHTHOUSE ${cmd[*]}"
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
