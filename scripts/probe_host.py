"""Host time of the layer: how long the CPU takes to issue one forward+backward of ``blazecore_torch.moe_ffn`` ("ab")
against how long the GPU takes to run it (back to back, and as CUDA-graph replays of the captured step), over token
counts (bench_gemm's problem), and the functions the host spends it in (cProfile) at one of them.

Usage (repository root, GPU): PYTHONPATH=.:adapters:app python \
    scripts/probe_host.py [--shape olmoe] [--tokens 2k,8k,32k] [--profile 8k] [--json host]

With ``--json NAME`` the figures go to bench/results/NAME_<gpu>.json (``--results-dir`` elsewhere), a row per shape
and token count: the host time a step (median over ``--repeats`` timings of ``--steps`` steps, each timing's figure
kept), the steps back to back and as graph replays; the header names the host's CPU, whose speed the host time is.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pathlib
import platform
import pstats
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="olmoe", help="one shape of bench_gemm, or several, comma-separated")
    ap.add_argument("--tokens", default="2k,8k,32k")
    ap.add_argument("--profile", default="8k", help="token count to run cProfile at ('' for none)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5, help="host timings of --steps steps each (median reported)")
    ap.add_argument("--json", default=None, help="write bench/results/NAME_<gpu>.json")
    ap.add_argument("--results-dir", default=None)
    a = ap.parse_args(argv)
    import blazecore_torch as ops
    import torch

    from bench.bench_gemm import shape_step

    rows = []
    for shape in a.shape.split(","):
        for tok in a.tokens.split(","):
            rows.append(_measure(torch, ops, shape_step, shape, tok, a))
    if a.json:
        from bench._common import gpu_header, write_json

        header = {**gpu_header(), "cpu": _cpu_model(), "steps": a.steps, "repeats": a.repeats}
        path = write_json(a.json, header, rows, pathlib.Path(a.results_dir) if a.results_dir else None)
        print(f"wrote {path}")
    return 0


def _cpu_model() -> str | None:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _host_ms(torch, step, steps: int) -> float:
    """ms of host time a step: the GPU kept busy first (a sleep kernel), so the host never waits for it while
    issuing."""
    torch.cuda._sleep(int(2e9))
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    host = (time.perf_counter() - t0) * 1e3 / steps
    torch.cuda.synchronize()
    return host


def _measure(torch, ops, shape_step, shape: str, tok: str, a) -> dict:
    from bench._common import parse_count

    L = parse_count(tok)
    step = shape_step(torch, ops, shape, L)
    host_rounds = [_host_ms(torch, step, a.steps) for _ in range(a.repeats)]
    host = statistics.median(host_rounds)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(a.steps):
        step()
    e1.record()
    torch.cuda.synchronize()
    eager = e0.elapsed_time(e1) / a.steps
    # the same step captured in a CUDA graph and replayed back to back (no host work but the replay)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    e0.record()
    for _ in range(a.steps):
        graph.replay()
    e1.record()
    torch.cuda.synchronize()
    replay = e0.elapsed_time(e1) / a.steps
    print(f"{shape} {tok}: host {host:.3f} ms a step, back-to-back steps {eager:.3f} ms, "
          f"CUDA-graph replays {replay:.3f} ms", flush=True)
    del graph
    if tok == a.profile:
        torch.cuda._sleep(int(2e9))
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.steps):
            step()
        pr.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(30)
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(35)
        print(buf.getvalue())
    del step
    torch.cuda.empty_cache()
    return {"shape": shape, "tokens": L, "host_ms": host, "host_rounds_ms": host_rounds, "eager_ms": eager,
            "graph_ms": replay}


if __name__ == "__main__":
    sys.exit(main())
