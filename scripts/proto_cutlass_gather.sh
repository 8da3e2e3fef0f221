#!/usr/bin/env bash
# Build CUTLASS's gathered GEMM (example 52 of the nvidia-cutlass wheel) and time it beside blazecore's gemm1 on the
# same sizes (scripts/proto_cutlass_gather.py). Needs nvcc (CUDA 12.4+), the nvidia-cutlass wheel's sources and the
# curand headers (the nvidia-curand wheel's include/ where the toolkit has none):
#   CUTLASS_SRC=.../cutlass_library/source CURAND_INC=.../include bash scripts/proto_cutlass_gather.sh OUTDIR
# (pip download --no-deps nvidia-cutlass nvidia-curand, then unzip). The binary may be built on a machine without a
# GPU (BUILD_ONLY=1) and carried: EX52=path skips the build. Writes OUTDIR/ex52.log and OUTDIR/proto_cutlass_gather.json.
set -uo pipefail
OUT=$(mkdir -p "$1" && cd "$1" && pwd) || exit 2
cd "$(dirname "$0")/.." || exit 2
EX52=${EX52:-$OUT/ex52}
if [[ ! -x $EX52 ]]; then
  ex=${CUTLASS_SRC:?set CUTLASS_SRC}/examples/52_hopper_gather_scatter_fusion
  nvcc -std=c++17 -arch=sm_90a -O3 -DNDEBUG --expt-relaxed-constexpr ${CURAND_INC:+-I "$CURAND_INC"} \
    -I "$CUTLASS_SRC/include" -I "$CUTLASS_SRC/tools/util/include" -I "$CUTLASS_SRC/examples/common" -I "$ex" \
    "$ex/52_hopper_gather_scatter_fusion.cu" -o "$EX52" || exit 1
fi
[[ ${BUILD_ONLY:-0} == 1 ]] && exit 0
"$EX52" --m=262144 --n=1536 --k=2048 --mode=m --index_size=262144 --iterations=20 >"$OUT/ex52.log" 2>&1 || exit 1
export PYTHONPATH="$PWD:$PWD/adapters:$PWD/app${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 scripts/proto_cutlass_gather.py "$OUT/proto_cutlass_gather.json" "$OUT/ex52.log"
