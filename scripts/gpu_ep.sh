#!/usr/bin/env bash
# On a CUDA machine (one GPU or several): the expert-parallel GPU tests (ep_size 1 over NCCL gives MoELayer's bits;
# with 2 or more GPUs one NCCL process per GPU against the full layer and FSDP2 in bf16 mixed precision; JAX's
# padded, ragged and gather exchanges; torchtitan's MoE with blazecore's experts when torchtitan is installed), the CPU
# multi-process tests, bench/bench_ep.py's weak scaling over 1, 2, 4, .. GPUs for olmoe and qwen3 (one torchrun per
# world size, the local experts on moe_ffn and on the grouped_mm MoE), bench/bench_ep_jax.py over all the GPUs (the
# JAX layer's padded and gather exchanges against its one-GPU layer), and `train` on 1 GPU and under torchrun with
# --ep on every power of two up to the GPU count, the global batch fixed, plus the largest count with the batch a
# rank fixed. NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
# NVSHMEM_DISABLE_NVLS=1). The steps run through scripts/gpu_steps.sh (every step runs even when an earlier one
# failed; one log, OUTDIR/steps.log). The JSON goes to OUTDIR and to bench/results/ (ep_<shape>_<gpu>.json and
# train_ep_<gpu>/, which bench/report.py --readme turns into the README's tables). Exit status 0 when every step
# passed.
# Usage: scripts/gpu_ep.sh OUTDIR [bench_ep.py options, e.g. --gpus 1,2,4,8 --tokens-per-gpu 16k]
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
n=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
steps=(
  "gpu-tests:1200:$PY -m pytest -m gpu -q -p no:cacheprovider -rs --junitxml=$OUT/gpu-ep-tests.xml tests/test_ep_torch.py tests/test_ep_jax.py"
  "cpu-tests:1200:$PY -m pytest -q -m 'not gpu' -p no:cacheprovider tests/test_ep_torch.py tests/test_ep_jax.py"
)
for shape in olmoe qwen3; do
  steps+=("bench-ep-$shape:3600:$PY bench/bench_ep.py --shape $shape --tokens-per-gpu 32k --name ep_$shape --results-dir $OUT${bench_args}")
done
if (( n >= 2 )); then
  steps+=("bench-ep-jax:1200:env XLA_PYTHON_CLIENT_PREALLOCATE=false $PY bench/bench_ep_jax.py --shape olmoe,qwen3 --tokens 8k,32k --exchanges padded,gather --results-dir $OUT")
fi
# train: 128 sequences a step on one GPU; under torchrun the same global batch over r ranks (--ep r), and at the
# largest r also 128 sequences a rank. --log-file, not --log: torchrun's own parser takes --log for its --log-dir.
mkdir -p "$OUT/train_ep"
common="--steps 150 --seed 0 --eval-batches 2 --sample-tokens 0"
steps+=("train-1:900:$PY -m blazecore train $common --batch 128 --log $OUT/train_ep/r1_ep1_b128.json")
r=2
while (( r <= n )); do
  steps+=("train-$r:900:$PY -m torch.distributed.run --standalone --nproc_per_node $r -m blazecore train --ep $r $common --batch $((128 / r)) --log-file $OUT/train_ep/r${r}_ep${r}_b$((128 / r)).json")
  last=$r
  r=$((r * 2))
done
if [[ -n ${last:-} ]]; then
  steps+=("train-$last-weak:900:$PY -m torch.distributed.run --standalone --nproc_per_node $last -m blazecore train --ep $last $common --batch 128 --log-file $OUT/train_ep/r${last}_ep${last}_b128.json")
fi
scripts/gpu_steps.sh "$OUT" "${steps[@]}"
rc=$?
cp "$OUT"/ep_*.json bench/results/ 2>/dev/null || true
slug=$($PY -c "from bench._common import gpu_header; print(gpu_header()['gpu_slug'])" 2>/dev/null || echo gpu)
if compgen -G "$OUT/train_ep/*.json" > /dev/null; then
  mkdir -p "bench/results/train_ep_$slug" && cp "$OUT"/train_ep/*.json "bench/results/train_ep_$slug/"
fi
exit $rc
