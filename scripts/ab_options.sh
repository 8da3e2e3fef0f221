#!/usr/bin/env bash
# In-run A/B of kernel build options on a CUDA machine: bench_gemm once per option set, the sets taken in turn for
# ROUNDS rounds (default 2), then each GEMM's and the layer's milliseconds side by side, one column per set and round.
# An option set is 'LABEL:NVRTC options' (BLAZECORE_NVRTC_OPTIONS for every kernel; empty: the kernels as shipped),
# e.g. timing probes (-DBLZ_PROBE_EPI=1) or a variant kept behind a macro while it is measured. A set may end in a third
# field of environment settings for its run: 'LABEL:NVRTC options:VAR=VALUE ...' (e.g. BLAZECORE_SM90_CLUSTER=1).
#   bash scripts/ab_options.sh OUTDIR 'base:' 'probe:-DBLZ_PROBE_EPI=1' 'one:-:BLAZECORE_SM90_CLUSTER=1' [-- options]
# ('-' stands for no NVRTC options where an environment field follows).
# (default bench_gemm options: --tokens 32k --repeats 5 --warmup 2). Writes OUTDIR/<label>_<round>/gemm_<gpu>.json and
# OUTDIR/ab_options.txt (the table). Each set compiles its kernels on first use (the on-disk cache keys on the
# options), so the first round also warms the cache.
set -uo pipefail
OUT=$(mkdir -p "$1" && cd "$1" && pwd) || exit 2
shift
sets=()
while [[ $# -gt 0 && $1 != "--" ]]; do sets+=("$1"); shift; done
[[ $# -gt 0 ]] && shift
[[ ${#sets[@]} -gt 0 ]] || { echo "no option sets (see the header)"; exit 2; }
opts=("$@")
[[ ${#opts[@]} -gt 0 ]] || opts=(--tokens 32k --repeats 5 --warmup 2)
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD:$PWD/adapters:$PWD/app${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
rc=0
for ((r = 1; r <= ${ROUNDS:-2}; r++)); do
  for spec in "${sets[@]}"; do
    label=${spec%%:*}; nv=${spec#*:}; envs=""
    if [[ $nv == *:* ]]; then envs=${nv#*:}; nv=${nv%%:*}; fi
    [[ $nv == "-" ]] && nv=""
    echo "== $label round $r: ${nv:-(as shipped)} ${envs}"
    # shellcheck disable=SC2086  # envs: VAR=VALUE words
    env $envs BLAZECORE_NVRTC_OPTIONS="$nv" python3 -m bench.bench_gemm "${opts[@]}" --results-dir "$OUT/${label}_$r" \
      >"$OUT/${label}_$r.log" 2>&1 || { echo "   failed: see $OUT/${label}_$r.log"; rc=1; }
  done
done
python3 - "$OUT" "${sets[@]}" <<'EOF' | tee "$OUT/ab_options.txt"
import glob, json, os, sys

out, labels = sys.argv[1], [s.split(":", 1)[0] for s in sys.argv[2:]]
runs = {}  # column name -> {(shape, tokens, gemm): ms}
for label in labels:
    for path in sorted(glob.glob(os.path.join(out, f"{label}_*", "gemm_*.json"))):
        col = os.path.basename(os.path.dirname(path))
        ms = {}
        for row in json.load(open(path))["rows"]:
            if row.get("kind") == "gemm":
                ms[(row["shape"], row["tokens"], row["gemm"])] = row["blazecore_ms"]
            elif row.get("kind") == "layer":
                ms[(row["shape"], row["tokens"], "layer")] = row.get("blazecore_moe_ffn_ms")
        runs[col] = ms
cols = sorted(runs, key=lambda c: (int(c.rsplit("_", 1)[1]), labels.index(c.rsplit("_", 1)[0])))
keys = sorted({k for ms in runs.values() for k in ms}, key=lambda k: (k[0], k[1], k[2]))
print("shape    tokens  gemm    " + "".join(f"{c:>12}" for c in cols))
for k in keys:
    vals = "".join(f"{runs[c][k]:12.3f}" if runs[c].get(k) is not None else f"{'-':>12}" for c in cols)
    print(f"{k[0]:<8} {k[1] // 1024:>5}k  {k[2]:<7} {vals}")
EOF
exit $rc
