#!/usr/bin/env bash
# On a CUDA machine: GPU tests, compute-sanitizer on a small test subset, and the benchmarks.
# Usage: scripts/gpu_check.sh [tests|sanitize|bench|all] ; logs and JSON go to ${OUT:-/tmp/blazecore-gpu}.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT="${OUT:-/tmp/blazecore-gpu}"; mkdir -p "$OUT"
what="${1:-all}"
rc=0
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log" || rc=1
fi
if [[ $what == sanitize || $what == all ]]; then
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 3 python3 -m pytest -q -x -m gpu -p no:cacheprovider \
      -k "${SANITIZE_FILTER:-small or L1 or L63}" 2>&1 | tee "$OUT/sanitize-$tool.log" | tail -5 || rc=1
  done
fi
if [[ $what == bench || $what == all ]]; then
  python3 bench/bench_dispatch.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench-dispatch.log" || rc=1
fi
exit $rc
