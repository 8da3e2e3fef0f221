#!/usr/bin/env bash
# On a CUDA machine (one GPU or several): the expert-parallel GPU tests (ep_size 1 over NCCL gives MoELayer's bits;
# JAX's ragged and padded exchanges on a one-device mesh; torchtitan's MoE with blazecore's experts when torchtitan
# is installed), the CPU multi-process tests, and bench/bench_ep.py's weak scaling over 1, 2, 4, .. GPUs (one
# torchrun per world size). NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
# NVSHMEM_DISABLE_NVLS=1). Every step runs even when an earlier one failed; logs and JSON go to OUTDIR, the
# benchmark's JSON also to bench/results/ep_<gpu>.json. Exit status 0 when every step passed.
# Usage: scripts/gpu_ep.sh OUTDIR [bench_ep.py options, e.g. --gpus 1,2,4,8 --shape olmoe --tokens-per-gpu 16k]
set -uo pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: $0 OUTDIR [bench_ep.py options]" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
shift
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD:$PWD/adapters:$PWD/app${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
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
step gpu-tests "$PY" -m pytest -m gpu -q -p no:cacheprovider --junitxml="$OUT/gpu-ep-tests.xml" \
  tests/test_ep_torch.py tests/test_ep_jax.py
step cpu-tests "$PY" -m pytest -q -m "not gpu" -p no:cacheprovider tests/test_ep_torch.py tests/test_ep_jax.py
step bench-ep "$PY" bench/bench_ep.py --results-dir "$OUT" "$@"
cp "$OUT"/ep_*.json bench/results/ 2>/dev/null || true

echo
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
if ((${#failed[@]})); then
  echo "FAILED: ${failed[*]}" | tee -a "$OUT/summary.txt"
  exit 1
fi
echo "all steps passed" | tee -a "$OUT/summary.txt"
