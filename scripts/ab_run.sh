#!/usr/bin/env bash
# In-run A/B on a CUDA machine: an earlier commit's tree against this one, on the same machine in one call.
#   here:   rm -rf .old && mkdir .old && git archive REV | tar -x -C .old   (.old is ignored: name it in the
#           device call's carry)
#   there:  bash scripts/ab_run.sh OUTDIR [bench_gemm options]
# Each tree compiles its kernels (prewarm) and runs bench_gemm (OUTDIR/old, OUTDIR/new); scripts/layer_bits.py
# saves the layer's outputs and gradients under the old tree and compares them bit for bit under the new one.
set -uo pipefail
OUT=$(mkdir -p "$1" && cd "$1" && pwd) || exit 2
shift
cd "$(dirname "$0")/.." || exit 2
[[ -d .old/scripts ]] || { echo "no .old tree (see the header)"; exit 2; }
B="python3 -m bench.bench_gemm --repeats 3 --warmup 1 ${*:---tokens 32k} --results-dir"
(cd .old && bash scripts/gpu_steps.sh "$OUT/old" 'warm:200:python3 scripts/probe_sm90_tma.py --prewarm' \
   'bits:200:python3 ../scripts/layer_bits.py save /tmp/layer_bits.pt' "bench:300:$B $OUT/old")
bash scripts/gpu_steps.sh "$OUT/new" 'warm:200:python3 scripts/probe_sm90_tma.py --prewarm' \
   'bits:200:python3 scripts/layer_bits.py compare /tmp/layer_bits.pt' "bench:300:$B $OUT/new"
rc=$?
grep -h "== \|bit-identical\|differs" "$OUT"/old/steps.log "$OUT"/new/steps.log
exit $rc
