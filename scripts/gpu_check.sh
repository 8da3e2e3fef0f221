#!/usr/bin/env bash
# On a CUDA machine: GPU tests, compute-sanitizer over every kernel (scripts/sanitize.sh), and the benchmarks.
# Usage: scripts/gpu_check.sh [tests|sanitize|bench|all] ; logs and JSON go to ${OUT:-/tmp/blazecore-gpu}.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/adapters:$PWD/app${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT="${OUT:-/tmp/blazecore-gpu}"; mkdir -p "$OUT"
what="${1:-all}"
rc=0
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log" || rc=1
fi
if [[ $what == sanitize || $what == all ]]; then
  # memcheck, racecheck, initcheck, synccheck over every kernel family (scripts/sanitize_driver.py)
  scripts/sanitize.sh "$OUT/sanitize" || rc=1
fi
if [[ $what == bench || $what == all ]]; then
  python3 bench/bench_dispatch.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench-dispatch.log" || rc=1
fi
exit $rc
