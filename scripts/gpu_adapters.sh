#!/usr/bin/env bash
# On a CUDA machine with torch, jax (CUDA plugin), transformers and cupy: the adapters' GPU tests and the two
# adapter benchmarks (bench/bench_hf.py, bench/bench_jax.py). Every step runs even when an earlier one failed;
# each step's output goes to OUTDIR/<step>.log, the tests' JUnit XML to OUTDIR/gpu-adapters-tests.xml and the
# benchmarks' JSON to OUTDIR. Exit status: 0 when every step passed, 1 otherwise (the summary names them).
# About 4 minutes on an H200 (the first kernel compilations included).
# Usage: scripts/gpu_adapters.sh OUTDIR          (PYTHON=... to choose the interpreter; default python3)
set -uo pipefail
if [[ $# -ne 1 ]]; then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
cd "$(dirname "$0")/.." || exit 2
# JAX shares the GPU with torch's and CuPy's memory pools: no preallocation
export PYTHONPATH="$PWD:$PWD/adapters:$PWD/app${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
failed=()
summary=()

step() {  # step NAME COMMAND...: run it, log to $OUT/NAME.log, remember a failure
  local name=$1
  shift
  echo "== $name: $*" | tee "$OUT/$name.log"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  local line="$name: exit $rc after $((SECONDS - t0)) s"
  echo "== $line" | tee -a "$OUT/$name.log"
  summary+=("$line")
  [[ $rc -eq 0 ]] || failed+=("$name")
}

{ nvidia-smi || true; git log -1 --oneline 2>/dev/null || true; } >"$OUT/machine.txt" 2>&1
step gpu-tests "$PY" -m pytest -m gpu -q -p no:cacheprovider --junitxml="$OUT/gpu-adapters-tests.xml" \
  tests/test_torch_adapter.py tests/test_jax_adapter.py
step bench-hf "$PY" -m bench.bench_hf --results-dir "$OUT"
step bench-jax "$PY" -m bench.bench_jax --results-dir "$OUT"

echo
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
if ((${#failed[@]})); then
  echo "FAILED: ${failed[*]}" | tee -a "$OUT/summary.txt"
  exit 1
fi
echo "all steps passed" | tee -a "$OUT/summary.txt"
