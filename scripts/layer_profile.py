"""Where one forward+backward of the layer spends its GPU time: every kernel of ``blazecore_torch.moe_ffn``
("ab", bf16, bench_gemm's problem) under the PyTorch profiler (CUPTI sees the CuPy launches too), summed by kernel
name per step, beside the step's wall time from CUDA events (the difference is launch gaps and idle time).

Usage (repository root, GPU): PYTHONPATH=.:adapters:app python \
    scripts/layer_profile.py [--shapes olmoe,fine] [--tokens 32k] [--steps 5]
[--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path


def _short(name: str) -> str:
    """A kernel name without its template arguments' clutter: blz::moe_gemm_sm90<..., EPI_DHCUR, ...> keeps the
    family and its epilogue / role."""
    m = re.match(r"(?:void )?([\w:]+)", name)
    base = m.group(1) if m else name[:60]
    if any(k in base for k in ("moe_gemm_sm90", "moe_wgrad_sm90", "moe_dhcur_sm90")):
        return name[:140]
    return base


def profile(torch, ops, shape, L, steps):
    from bench.bench_gemm import cuda_kernels, shape_step

    step = shape_step(torch, ops, shape, L)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(steps):
        step()
    e1.record()
    torch.cuda.synchronize()
    wall = e0.elapsed_time(e1) / steps

    def run():
        for _ in range(steps):
            step()

    per = defaultdict(lambda: [0, 0.0])
    spans = []
    for start, ms, name in cuda_kernels(torch, run):  # one record per kernel launch, CuPy's included
        k = _short(name)
        per[k][0] += 1
        per[k][1] += ms
        spans.append((start, start + int(ms * 1e6), k))
    spans.sort()
    gaps = []  # idle stretches of the GPU between consecutive records (any stream)
    short = []  # the idle time between records up to 20 us: launch latency, a kernel's start after the last's end
    end = spans[0][1] if spans else 0
    for (s0, s1, k), prev in zip(spans[1:], spans[:-1], strict=True):
        if s0 - end > 20_000:
            gaps.append({"us": (s0 - end) / 1e3, "after": prev[2][:70], "before": k[:70]})
        elif s0 > end:
            short.append((s0 - end) / 1e3)
        end = max(end, s1)
    rows = sorted(({"kernel": k, "calls_per_step": c / steps, "ms_per_step": t / steps} for k, (c, t) in per.items()),
                  key=lambda r: -r["ms_per_step"])
    busy = sum(r["ms_per_step"] for r in rows)
    return {"shape": shape, "tokens": L, "wall_ms": wall, "kernel_ms": busy, "kernels": rows,
            "gaps_over_20us": gaps, "gap_ms": sum(g["us"] for g in gaps) / 1e3 / steps,
            "short_gaps_per_step": len(short) / steps, "short_gap_ms": sum(short) / 1e3 / steps,
            "short_gap_median_us": sorted(short)[len(short) // 2] if short else 0.0}


def compare_timers(torch, ops, shape, L, steps):
    """bench_gemm's per-launch CUDA events against the kernels' own durations (CUPTI), same process and problem."""
    from bench.bench_gemm import GemmTimer, launcher_kernel_ms, shape_step

    step = shape_step(torch, ops, shape, L)
    with GemmTimer() as timer:
        step()
        timer.on = True
        for i in range(steps):
            timer.call = i
            step()
        ev = timer.per_call()
    cu = launcher_kernel_ms(torch, step, steps)
    with GemmTimer() as timer:
        timer.on = True  # the events recorded, the kernels' own durations read
        cu_ev = launcher_kernel_ms(torch, step, steps)
        ev2 = timer.per_call()
    print(f"\n{shape} {L}: per-GEMM ms, events (bench_gemm) / CUPTI / CUPTI with the events on / those events")
    for k in ev:
        print(f"  {k:6s} {ev[k]:8.3f} {cu.get(k, float('nan')):8.3f} {cu_ev.get(k, float('nan')):8.3f} "
              f"{ev2.get(k, float('nan')):8.3f}")
    return {"shape": shape, "tokens": L, "events": ev, "cupti": cu, "cupti_with_events": cu_ev, "events2": ev2}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="olmoe,fine")
    ap.add_argument("--tokens", default="32k")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--compare-timers", action="store_true",
                    help="bench_gemm's per-launch events against the kernels' CUPTI durations")
    a = ap.parse_args(argv)
    import blazecore_torch as ops
    import torch

    out = []
    for shape in a.shapes.split(","):
        for tok in a.tokens.split(","):
            L = int(tok[:-1]) * 1024 if tok.endswith("k") else int(tok)
            if a.compare_timers:
                out.append(compare_timers(torch, ops, shape, L, a.steps))
                torch.cuda.empty_cache()
                continue
            r = profile(torch, ops, shape, L, a.steps)
            out.append(r)
            print(f"\n{shape} {tok}: step {r['wall_ms']:.3f} ms (events), kernels {r['kernel_ms']:.3f} ms")
            for k in r["kernels"]:
                print(f"  {k['ms_per_step']:8.3f} ms  x{k['calls_per_step']:<5g} {k['kernel']}")
            print(f"  idle stretches over 20 us: {r['gap_ms']:.3f} ms a step; up to 20 us: "
                  f"{r['short_gap_ms']:.3f} ms a step in {r['short_gaps_per_step']:g} (median "
                  f"{r['short_gap_median_us']:.1f} us)")
            for g in r["gaps_over_20us"][: 3 * 12]:
                print(f"    {g['us']:8.1f} us  after {g['after']}  before {g['before']}")
            torch.cuda.empty_cache()
    if a.json:
        from bench import _common as common

        Path(a.json).write_text(json.dumps({"header": {**common.gpu_header(), "bench": "layer_profile",
                                                       "steps": a.steps},
                                            "gpu": torch.cuda.get_device_name(), "rows": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
