# Sourced by run_train.sh and run_tests.sh: make .venv once, then set PYTHON and PYTHONPATH.
# A torch already importable by the active python is reused (made visible to .venv), never replaced;
# otherwise torch 2.13.0 is installed.
TESSERA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TESSERA_VENV="${TESSERA_VENV:-$TESSERA_ROOT/.venv}"
_stamp="$TESSERA_VENV/.tessera-deps"
_want="$(cat "$TESSERA_ROOT/requirements-dev.txt" "$TESSERA_ROOT/constraints.txt" | cksum)"
if [ ! -x "$TESSERA_VENV/bin/python" ] || [ "$(cat "$_stamp" 2>/dev/null)" != "$_want" ]; then
  echo "tessera: setting up $TESSERA_VENV (first run only)" >&2
  _base="$(command -v python3 || command -v python)"
  "$_base" -m venv "$TESSERA_VENV" || return 1
  _pins="$TESSERA_VENV/.constraints.txt"
  cp "$TESSERA_ROOT/constraints.txt" "$_pins"
  _torch_site="$("$_base" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null || true)"
  case "$_torch_site" in "" | "$TESSERA_VENV"/*) _reuse="" ;; *) _reuse=1 ;; esac
  if [ -n "$_reuse" ]; then
    _ver="$("$_base" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
    echo "tessera: reusing torch $_ver from $_torch_site" >&2
    _site="$("$TESSERA_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$_torch_site" > "$_site/zz-active-env-torch.pth"
    echo "torch==$_ver" >> "$_pins"
  else
    "$TESSERA_VENV/bin/python" -m pip install -q "torch==2.13.0" || return 1
    echo "torch==2.13.0" >> "$_pins"
  fi
  "$TESSERA_VENV/bin/python" -m pip install -q -r "$TESSERA_ROOT/requirements-dev.txt" -c "$_pins" || return 1
  echo "$_want" > "$_stamp"
fi
PYTHON="$TESSERA_VENV/bin/python"
export PYTHONPATH="$TESSERA_ROOT${PYTHONPATH:+:$PYTHONPATH}"

# run_train.sh and the SLURM script name their CONFIG_FILE unless the flags give --job.config_file (the user's
# wins: torchrun users type it; given twice, the config check refuses it). Usage: config_flag DEFAULT "$@";
# sets CONFIG_FLAG to the flags to pass.
config_flag() {
  local default="$1" arg after="" given=()
  shift
  for arg in "$@"; do
    if [ -n "$after" ]; then given+=("$arg"); after=""; fi
    case "$arg" in
      --job.config_file) after=1 ;;
      --job.config_file=*) given+=("${arg#*=}") ;;
    esac
  done
  CONFIG_FLAG=(--job.config_file "$default")
  [ "${#given[@]}" -eq 0 ] && return 0
  CONFIG_FLAG=()
  if [ "${#given[@]}" -eq 1 ] && [ -n "${CONFIG_FILE:-}" ] && [ "${given[0]}" != "$CONFIG_FILE" ]; then
    echo "tessera: --job.config_file ${given[0]} is read, not CONFIG_FILE=$CONFIG_FILE" >&2
  fi
}
