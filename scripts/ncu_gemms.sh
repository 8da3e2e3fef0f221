#!/usr/bin/env bash
# Nsight Compute on the layer's GEMM launches and grouped_mm's (scripts/ncu_gemms.py), one shape.
# Writes OUTDIR/details_<shape>.txt (every kernel's sections) and the per-instruction SASS pages (warp-state samples)
# of the kernels named in SASS ('ours:N' = the N-th moe_gemm_sm90 launch, 'wg:N' = the N-th moe_wgrad_sm90 launch
# (0: dw2, 1: dw13), 'gmm:N' = the N-th grouped_mm kernel (0..5: gemm1, gemm2, dh', dx, dw13, dw2)).
# Usage: scripts/ncu_gemms.sh OUTDIR SHAPE [SASS ...]   e.g. scripts/ncu_gemms.sh out olmoe ours:1 gmm:1 wg:1 gmm:4
set -uo pipefail
OUT=$(mkdir -p "$1" && cd "$1" && pwd) || exit 2
SHAPE=$2
shift 2
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD:$PWD/adapters:$PWD/app:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
REP=/tmp/ncu_$SHAPE
sections=(SpeedOfLight MemoryWorkloadAnalysis MemoryWorkloadAnalysis_Tables WarpStateStats SourceCounters
          SchedulerStats ComputeWorkloadAnalysis LaunchStats Occupancy)
args=()
for s in "${sections[@]}"; do args+=(--section "$s"); done
ncu --profile-from-start off --clock-control none -f -o "$REP" "${args[@]}" \
    --metrics lts__t_sector_hit_rate.pct,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum \
    -k 'regex:moe_gemm_sm90|moe_dhcur_sm90|moe_wgrad|device_kernel' \
    python3 scripts/ncu_gemms.py --shape "$SHAPE" || exit 1
ncu -i "$REP.ncu-rep" --page details --print-units base >"$OUT/details_$SHAPE.txt" 2>&1
for spec in "$@"; do
  who=${spec%%:*}; n=${spec#*:}
  case $who in
    ours) re='regex:moe_gemm_sm90|moe_dhcur_sm90' ;;
    wg) re='regex:moe_wgrad' ;;
    *) re='regex:device_kernel' ;;
  esac
  ncu -i "$REP.ncu-rep" --page source --print-source sass --csv -k "$re" --launch-skip "$n" --launch-count 1 \
      >"$OUT/sass_${SHAPE}_${who}${n}.csv" 2>&1
done
