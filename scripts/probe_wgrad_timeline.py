"""Where a weight-gradient or dh' k-tile's time goes (GPU; timing probe, results unchanged): CTA 0's clocks a k-tile.

Builds the kernels with ``-DBLZ_PROBE_TIMELINE=N`` (moe_wgrad_sm90.cu; ``--kernel dh``: moe_dhcur_sm90.cu), runs the
layer's forward+backward through ``blazecore_torch.moe_ffn`` ("ab", bench_gemm's problem of a shape and token count)
a few times, and reads back, for the last dw13 and dw2 launches (``--kernel dh``: the last dh' launch), CTA 0's
clock64 at three points of each of its first N k-tiles: the producer past the stage's empty wait (it starts the
stage's copies), the producer done issuing them, and the consumers past the stage's full wait. From these, per
k-tile: the consumers' cycle (full wait to full wait), how long after the producer started a stage the consumers had it
("fill"), and the producer's issue time; for dh' also, by tile, the consumers' wait for the epilogue warps to have
read the previous tile's dh', epilogue warp 0's time on the tile's rows, and the tile's span. Each option set
(``LABEL:NVRTC options``, e.g. ``noA:-DBLZ_PROBE_A_SKIP=1``: no gathered copies in the weight gradients, wrong
results) runs in the same process after the others.

Usage (repository root): PYTHONPATH=.:adapters:app python scripts/probe_wgrad_timeline.py OUT.json \\
    --set base: [--set noA:-DBLZ_PROBE_A_SKIP=1] [--kernel wgrad|dh] [--shapes qwen3,fine] [--tokens 128k] \\
    [--ktiles 512]
       python scripts/probe_wgrad_timeline.py OUT.json --resummarize IN.json   (no GPU: the summaries again)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

# kernel: (source, its timeline's symbol, the timeline's leading dimensions before the k-tile index)
KERNELS = {"wgrad": ("moe_wgrad_sm90.cu", "blz_wgrad_timeline", (2, 3)),
           "dh": ("moe_dhcur_sm90.cu", "blz_dh_timeline", (7,))}


def _percentiles(v: list) -> dict:
    if not v:
        return {}
    s = sorted(v)
    pick = lambda q: s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]  # noqa: E731
    return {"p10": pick(0.1), "p50": pick(0.5), "p90": pick(0.9), "mean": statistics.fmean(s)}


def summarize(prod_start: list, prod_issued: list, cons_full: list, skip: int = 8) -> dict:
    """Per-k-tile figures (SM cycles) from the three clock series of one launch; the first ``skip`` k-tiles (the
    ring's first fill) are left out, and so are the k-tiles past the last the consumers recorded (a CTA with fewer
    k-tiles than the probe's length leaves the rest of its series 0)."""
    n = min(len(prod_start), len(prod_issued), len(cons_full))
    while n > 0 and not (cons_full[n - 1] and prod_start[n - 1] and prod_issued[n - 1]):
        n -= 1
    ks = range(skip, n)
    cycle = [cons_full[k] - cons_full[k - 1] for k in ks if k > 0]
    fill = [cons_full[k] - prod_start[k] for k in ks]
    issue = [prod_issued[k] - prod_start[k] for k in ks]
    # the long cycles (over 1.3x the median): their count and the share of the consumers' time above the median
    med = statistics.median(cycle) if cycle else 0
    long = [c for c in cycle if c > 1.3 * med]
    return {"ktiles": n - skip, "consumer_cycle": _percentiles(cycle), "fill": _percentiles(fill),
            "producer_issue": _percentiles(issue), "long_cycles": len(long),
            "long_share": sum(c - med for c in long) / sum(cycle) if cycle else 0.0}


def summarize_dh(rows: list) -> dict:
    """:func:`summarize` of dh''s k-tiles plus its tiles' figures (SM cycles) from its seven clock series: the
    consumers' wait for the epilogue warps to have read the previous tile's dh' (their mainloop done to past that
    wait), epilogue warp 0's time on a tile's rows, and a tile's span from one mainloop end to the next."""
    p0, p1, c0, main_end, dh_free, epi_start, epi_end = rows
    n_t = sum(1 for v in main_end if v)
    tiles = range(1, n_t)
    out = summarize(p0, p1, c0)
    out.update({"tiles": n_t - 1, "consumer_wait_dh": _percentiles([dh_free[i] - main_end[i] for i in tiles]),
                "epilogue_rows": _percentiles([epi_end[i] - epi_start[i] for i in tiles if epi_end[i]]),
                "tile_span": _percentiles([main_end[i] - main_end[i - 1] for i in tiles])})
    return out


def read_timelines(n: int, tag: str, kernel: str = "wgrad") -> dict:
    """{kernel name expression (and form): clock series} of every loaded module of ``kernel`` built with option
    ``tag`` that recorded something; the device copies are zeroed after the read."""
    import cupy

    from blazecore import _compile

    fname, symbol, shape = KERNELS[kernel]
    out = {}
    for key, mod in list(_compile._modules.items()):
        if key[0] != fname or tag not in key[3]:
            continue
        ptr = mod.get_global_var(symbol)  # the device address
        count = 8 * n
        for dim in shape:
            count *= dim
        mem = cupy.cuda.UnownedMemory(int(ptr), count, mod)
        dev = cupy.ndarray((*shape, n), dtype=cupy.uint64, memptr=cupy.cuda.MemoryPointer(mem, 0))
        arr = dev.get()
        if kernel == "wgrad":
            for form in range(2):
                if arr[form, 2, :].any():
                    out[f"{key[1]} [form {form}]"] = arr[form].astype(int).tolist()
        elif arr[2, :].any():
            out[key[1]] = arr.astype(int).tolist()
        dev.fill(0)
    return out


def resummarize(src: str, out: str) -> int:
    """Recompute every summary of the result ``src`` from its stored clocks (its header's kernel) into ``out``."""
    with open(src) as f:
        res = json.load(f)
    dh = res["header"].get("kernel") == "dh"
    for by_label in res["timelines"].values():
        for by_name in by_label.values():
            for entry in by_name.values():
                entry["summary"] = summarize_dh(entry["clocks"]) if dh else summarize(*entry["clocks"])
    res["header"]["resummarized_from"] = os.path.basename(src)
    with open(out, "w") as f:
        json.dump(res, f)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="LABEL:NVRTC options (one at least)")
    ap.add_argument("--shapes", default="qwen3,fine")
    ap.add_argument("--tokens", default="128k")
    ap.add_argument("--ktiles", type=int, default=512)
    ap.add_argument("--kernel", choices=sorted(KERNELS), default="wgrad")
    ap.add_argument("--resummarize", metavar="IN.json",
                    help="no GPU run: recompute the summaries of an earlier result's clocks into OUT")
    args = ap.parse_args(argv)
    if args.resummarize:
        return resummarize(args.resummarize, args.out)
    if not args.sets:
        ap.error("--set: at least one option set (or --resummarize IN.json)")
    sets = []
    for spec in args.sets:
        label, sep, opts = spec.partition(":")
        if not label or not sep:
            ap.error(f"--set {spec!r}: want LABEL:NVRTC options")
        sets.append((label, opts.strip()))
    if args.ktiles < 16:
        ap.error("--ktiles: at least 16")

    import torch
    from blazecore_torch import ops

    import bench.bench_gemm as bg
    from bench import _common as common

    shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in shapes if s not in bg.SHAPES]
    if bad or not shapes:
        ap.error(f"--shapes: unknown {', '.join(bad) or '(none given)'}; known {', '.join(bg.SHAPES)}")
    L = common.parse_count(args.tokens)
    tag = f"-DBLZ_PROBE_TIMELINE={args.ktiles}"
    result: dict = {}
    for shape in shapes:
        d, h, E, K = bg.SHAPES[shape]
        step = bg.blazecore_step(torch, ops, *bg._problem(torch, d, h, E, K, L))
        for label, opts in sets:
            os.environ["BLAZECORE_NVRTC_OPTIONS"] = f"{tag} {opts}".strip()
            try:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                lines = read_timelines(args.ktiles, tag, args.kernel)
                step()
                torch.cuda.synchronize()
                lines = read_timelines(args.ktiles, tag, args.kernel)
            finally:
                del os.environ["BLAZECORE_NVRTC_OPTIONS"]
            for name, rows in lines.items():
                s = summarize(*rows) if args.kernel == "wgrad" else summarize_dh(rows)
                result.setdefault(shape, {}).setdefault(label, {})[name] = {"summary": s, "clocks": rows}
                print(shape, label, name, json.dumps(s), flush=True)
    header = {**common.gpu_header(), "bench": "probe_wgrad_timeline", "kernel": args.kernel, "tokens": L,
              "ktiles": args.ktiles,
              "sets": dict(sets)}
    with open(args.out, "w") as f:
        json.dump({"header": header, "timelines": result}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
