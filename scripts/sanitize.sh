#!/usr/bin/env bash
# compute-sanitizer over every GPU kernel of blazecore: memcheck, racecheck, initcheck and synccheck, each a run
# of scripts/sanitize_driver.py (each kernel family once, small shapes, CuPy's memory pool off).
#
# Usage: scripts/sanitize.sh [OUT_DIR]   (default ${OUT:-/tmp/blazecore-sanitize})
#   TOOLS="memcheck racecheck"  the tools to run (default all four)
#   CASES="dispatch router"     driver cases (default all: see `python3 scripts/sanitize_driver.py --list`)
#   SANITIZER=/path/to/compute-sanitizer
# Writes OUT_DIR/<tool>.log per tool and OUT_DIR/summary.json ({tool: {"errors": N, "rc": rc, "seconds": s}});
# exits non-zero if any tool reports an error, the driver fails, or a log has no error summary.
# About 3-5 minutes on an H200 (racecheck is the slowest); the first, unsanitized run compiles the kernels
# into the on-disk cache so the sanitized runs only load them.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT_DIR="${1:-${OUT:-/tmp/blazecore-sanitize}}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
SAN="${SANITIZER:-$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | sort -V | tail -1)}"
if [[ -z "$SAN" || ! -x "$SAN" ]]; then
  echo "compute-sanitizer not found (set SANITIZER=...)" >&2
  exit 2
fi
TOOLS="${TOOLS:-memcheck racecheck initcheck synccheck}"
case_args=()
for c in ${CASES:-}; do case_args+=(--case "$c"); done

echo "sanitizer: $SAN ($("$SAN" --version | tail -1))"
echo "warm-up (compiles every kernel into the cache, unsanitized):"
if ! "$PY" scripts/sanitize_driver.py --no-pool "${case_args[@]}" 2>&1 | tee "$OUT_DIR/warmup.log"; then
  echo "the driver fails without a sanitizer: see $OUT_DIR/warmup.log" >&2
  exit 1
fi

declare -A extra=(
  [memcheck]="--leak-check no --padding 64"
  [racecheck]="--racecheck-report all"
  [initcheck]=""
  [synccheck]=""
)
# initcheck does not see the bytes a TMA store (cp.async.bulk.tensor) writes, so it reports every later read of them
# (moe_combine reading the per-slot rows that gemm2 and dx stored by TMA) as a read of uninitialized memory: it runs
# with the sm_90a epilogues storing by threads instead. memcheck and racecheck cover the TMA stores.
declare -A tool_env=(
  [initcheck]="BLAZECORE_SM90_OUT_STORE=st_global"
)
status=0
json="{"
for tool in $TOOLS; do
  log="$OUT_DIR/$tool.log"
  t0=$(date +%s)
  # shellcheck disable=SC2086
  env ${tool_env[$tool]:-} "$SAN" --tool "$tool" ${extra[$tool]:-} --print-limit 100 --error-exitcode 0 \
    "$PY" scripts/sanitize_driver.py --no-pool "${case_args[@]}" >"$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - t0 ))
  # memcheck, initcheck, synccheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: H hazards displayed
  # (N errors, W warnings)"
  summary=$(grep -E "ERROR SUMMARY: [0-9]+ error|RACECHECK SUMMARY: .*[0-9]+ error" "$log" | tail -1)
  if [[ -z "$summary" ]]; then
    errors=-1
    echo "$tool: no error summary in $log (rc $rc)"
    status=1
  else
    errors=$(sed -E 's/.*(ERROR SUMMARY: |\()([0-9]+) error.*/\2/' <<<"$summary")
    [[ $errors -ne 0 || $rc -ne 0 ]] && status=1
    echo "$tool: $errors errors, rc $rc, ${secs} s"
  fi
  [[ $rc -ne 0 ]] && tail -20 "$log"
  json+="\"$tool\": {\"errors\": $errors, \"rc\": $rc, \"seconds\": $secs}, "
  echo "${json%, }}" >"$OUT_DIR/summary.json"  # rewritten after each tool: a cut-short run keeps what finished
done
json="${json%, }}"
echo "summary: $json  (logs in $OUT_DIR)"
exit $status
