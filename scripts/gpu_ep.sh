#!/usr/bin/env bash
# On a CUDA machine (one GPU or several): the expert-parallel GPU tests (ep_size 1 over NCCL gives MoELayer's bits;
# JAX's ragged and padded exchanges on a one-device mesh; torchtitan's MoE with blazecore's experts when torchtitan
# is installed), the CPU multi-process tests, and bench/bench_ep.py's weak scaling over 1, 2, 4, .. GPUs (one
# torchrun per world size). NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
# NVSHMEM_DISABLE_NVLS=1). The steps run through scripts/gpu_steps.sh (every step runs even when an earlier one
# failed; one log, OUTDIR/steps.log); the benchmark's JSON goes to OUTDIR and to bench/results/ep_<gpu>.json.
# Exit status 0 when every step passed.
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
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
bench_args=$(printf ' %q' "$@")
scripts/gpu_steps.sh "$OUT" \
  "gpu-tests:1200:$PY -m pytest -m gpu -q -p no:cacheprovider --junitxml=$OUT/gpu-ep-tests.xml tests/test_ep_torch.py tests/test_ep_jax.py" \
  "cpu-tests:1200:$PY -m pytest -q -m 'not gpu' -p no:cacheprovider tests/test_ep_torch.py tests/test_ep_jax.py" \
  "bench-ep:3600:$PY bench/bench_ep.py --results-dir $OUT${bench_args}"
rc=$?
cp "$OUT"/ep_*.json bench/results/ 2>/dev/null || true
exit $rc
