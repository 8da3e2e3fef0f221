"""Host time of the layer: how long the CPU takes to issue one forward+backward of ``blazecore_torch.moe_ffn`` ("ab")
against how long the GPU takes to run it (back to back, and as CUDA-graph replays of the captured step), over token
counts (bench_gemm's problem), and the functions the host spends it in (cProfile) at one of them.

Usage (repository root, GPU): PYTHONPATH=.:adapters:app python \
    scripts/probe_host.py [--shape olmoe] [--tokens 2k,8k,32k] [--profile 8k]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time


def _parse(tok: str) -> int:
    return int(tok[:-1]) * 1024 if tok.endswith("k") else int(tok)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="olmoe")
    ap.add_argument("--tokens", default="2k,8k,32k")
    ap.add_argument("--profile", default="8k")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args(argv)
    import blazecore_torch as ops
    import torch

    from bench.bench_gemm import shape_step

    for tok in a.tokens.split(","):
        L = _parse(tok)
        step = shape_step(torch, ops, a.shape, L)
        # host time: the GPU kept busy first (a sleep kernel), so the host never waits for it while issuing
        torch.cuda._sleep(int(2e9))
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        host = (time.perf_counter() - t0) * 1e3 / a.steps
        torch.cuda.synchronize()
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
        print(f"{a.shape} {tok}: host {host:.3f} ms a step, back-to-back steps {eager:.3f} ms, "
              f"CUDA-graph replays {e0.elapsed_time(e1) / a.steps:.3f} ms", flush=True)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
