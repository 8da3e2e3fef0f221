#!/usr/bin/env python3
"""Where a kernel's warps stall, by code region: an Nsight Compute SASS page (CSV) summed per region.

Reads the per-instruction page that ``scripts/ncu_gemms.sh`` writes (``ncu -i REP --page source --print-source sass
--csv``, one kernel launch) and prints, as JSON:

- ``regions``: the code cut after each ``EXIT`` (a warp role's code ends in its own EXITs) and after each ``--cut``
  address (e.g. a mainloop's last ``WARPGROUP.DEPBAR``), each with its share of the warp-state samples, the warps
  that left through its EXITs (the EXIT's executed count), its address range and its three largest stall reasons
  (regions without samples are left out);
- ``top``: the instructions with the most samples (share, SASS text, the three largest stall reasons);
- ``stalls``: every stall reason's share of all samples.

Shares are percent of all samples of the launch. Usage (no GPU needed):
    python scripts/ncu_sass_regions.py sass_fine_ours1.csv [--top 12] [--cut 0x7fce32827a10 ...]
"""

from __future__ import annotations

import argparse
import csv
import json
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_page(path: str) -> list[dict]:
    """The instruction rows of a SASS page: dicts keyed by the page's header (the row naming Address and the
    samples column; ncu prints a few lines before it)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    for i, row in enumerate(rows):
        if "Address" in row and SAMPLES in row:
            header = row
            return [dict(zip(header, r, strict=True)) for r in rows[i + 1:] if len(r) == len(header)]
    raise ValueError(f"{path}: no SASS page header (want the columns Address and {SAMPLES!r})")


def _reasons(rows: list[dict], total: float, n: int = 3) -> list[list]:
    """The n largest stall reasons of ``rows`` ('stall_*' columns, the not-issued ones left out), percent of total."""
    keys = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k] if rows else []
    sums = sorted(((sum(_num(r[k]) for r in rows), k[len("stall_"):]) for k in keys), reverse=True)
    return [[name, round(100 * v / total, 1)] for v, name in sums[:n] if round(100 * v / total, 1) > 0]


def summarize(rows: list[dict], top: int = 12, cuts=()) -> dict:
    total = sum(_num(r[SAMPLES]) for r in rows)
    cuts = {int(c, 16) for c in cuts}
    if total <= 0:
        raise ValueError("the page has no warp-state samples (was SourceCounters / WarpStateStats collected?)")
    regions, cur = [], []
    for r in rows:
        cur.append(r)
        if "EXIT" in r["Source"].split() or int(r["Address"], 16) in cuts:
            regions.append(cur)
            cur = []
    if cur:
        regions.append(cur)
    out_regions = []
    for reg in regions:
        if not any(_num(r[SAMPLES]) for r in reg):
            continue
        exits = [r for r in reg if "EXIT" in r["Source"].split()]
        out_regions.append({
            "first": reg[0]["Address"], "last": reg[-1]["Address"], "instructions": len(reg),
            "pct": round(100 * sum(_num(r[SAMPLES]) for r in reg) / total, 1),
            "warps_exiting": int(sum(_num(r.get("Instructions Executed", "0")) for r in exits)),
            "stalls": _reasons(reg, total),
        })
    best = sorted(rows, key=lambda r: -_num(r[SAMPLES]))[:top]
    return {
        "samples": int(total),
        "regions": out_regions,
        "top": [{"address": r["Address"], "pct": round(100 * _num(r[SAMPLES]) / total, 1),
                 "sass": " ".join(r["Source"].split())[:80], "stalls": _reasons([r], total)} for r in best],
        "stalls": _reasons(rows, total, n=64),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="the SASS page of one launch (ncu --page source --print-source sass --csv)")
    ap.add_argument("--top", type=int, default=12, help="instructions to list (default 12)")
    ap.add_argument("--cut", action="append", default=[], help="end a region after this address (hex), repeatable")
    args = ap.parse_args(argv)
    try:
        result = summarize(read_page(args.csv), args.top, args.cut)
    except ValueError as exc:
        print(f"ncu_sass_regions: {exc}", file=sys.stderr)
        return 2
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
