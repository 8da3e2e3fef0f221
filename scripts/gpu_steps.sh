#!/usr/bin/env bash
# Run named steps on a CUDA machine, each under a time limit, logging to OUTDIR/steps.log (one file, so a
# device run returns it whole) and leaving the benchmarks' JSON in OUTDIR. Every step runs even when an
# earlier one failed; the exit status is 1 when any failed.
# Usage: scripts/gpu_steps.sh OUTDIR 'NAME:SECONDS:COMMAND' ...
set -uo pipefail
OUT=$(mkdir -p "$1" && cd "$1" && pwd) || exit 2
shift
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD:$PWD/adapters:$PWD/app${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
LOG="$OUT/steps.log"
failed=0
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  git log -1 --oneline 2>/dev/null || true; } >>"$LOG" 2>&1
for spec in "$@"; do
  name=${spec%%:*}; rest=${spec#*:}; secs=${rest%%:*}; cmd=${rest#*:}
  echo "== $name ($secs s): $cmd" | tee -a "$LOG"
  t0=$SECONDS
  timeout "$secs" bash -o pipefail -c "$cmd" >>"$LOG" 2>&1
  rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  [[ $rc -eq 0 ]] || failed=1
done
exit $failed
