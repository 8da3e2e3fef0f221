"""A markdown table of an ``ab_inprocess.py`` result: the ms of each round by shape, GEMM and option set, and the
median of each set over the first set's (or, with ``--control``, that ratio divided by the same ratio of the control
GEMMs' summed time a round, so that a clock drift between rounds drops out; the "layer" row keeps the plain ratio).

Usage: python scripts/ab_table.py RESULT.json [--gemms dw13,dw2,layer] [--sets base,new] [--control gemm1,dx]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def table(result: dict, gemms=None, sets=None, control=None) -> str:
    """The markdown table (see the module's docstring); ValueError for a set or GEMM name the result does not hold."""
    ms = result["ms"]
    for shape, by_gemm in ms.items():
        have_sets = set(next(iter(by_gemm.values())))
        bad = [g for g in (control or []) if g not in by_gemm] + [s for s in (sets or []) if s not in have_sets]
        if bad:
            raise ValueError(f"{shape}: no set or GEMM {', '.join(bad)} in the result (sets {sorted(have_sets)}, "
                             f"GEMMs {sorted(by_gemm)})")
    lines = []
    for shape, by_gemm in ms.items():
        names = list(by_gemm) if not gemms else [g for g in gemms if g in by_gemm]
        labels = sets or list(next(iter(by_gemm.values())))
        if not lines:
            head = ["shape", "GEMM", *labels, *(f"{s} / {labels[0]}" for s in labels[1:])]
            lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for g in names:
            runs = by_gemm[g]
            cells = [", ".join(f"{v:.3f}" if v < 100 else f"{v:.2f}" for v in runs[s]) for s in labels]
            ratios = []
            for s in labels[1:]:
                r = statistics.median(runs[s]) / statistics.median(runs[labels[0]])
                if control and g != "layer":  # the step contains the control GEMMs: its ratio stays plain
                    n = min(len(runs[s]), len(runs[labels[0]]))
                    per = []
                    for i in range(n):
                        c = (sum(by_gemm[k][s][i] for k in control) / sum(by_gemm[k][labels[0]][i] for k in control))
                        per.append(runs[s][i] / runs[labels[0]][i] / c)
                    r = statistics.median(per)
                ratios.append(f"{r:.3f}")
            lines.append("| " + " | ".join([shape, g, *cells, *ratios]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result")
    ap.add_argument("--gemms", default="")
    ap.add_argument("--sets", default="")
    ap.add_argument("--control", default="")
    args = ap.parse_args(argv)
    with open(args.result) as f:
        result = json.load(f)
    split = lambda s: [w for w in s.split(",") if w] or None  # noqa: E731
    try:
        print(table(result, split(args.gemms), split(args.sets), split(args.control)))
    except ValueError as exc:
        ap.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
