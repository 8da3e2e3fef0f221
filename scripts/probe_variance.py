"""Why one process's GEMM times differ from another's: the layer's per-GEMM kernel times (CUPTI, bench_gemm's problem)
in several trials of one process, each on fresh copies of the operands (new addresses), beside a fixed torch matmul's
time and the SM clock and power NVML reports right after.

Usage (repository root, GPU): PYTHONPATH=.:adapters:app python \
    scripts/probe_variance.py [--shape olmoe] [--tokens 32k] [--trials 4]
"""

from __future__ import annotations

import argparse
import subprocess
import sys


def smi() -> str:
    q = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
    r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True)
    return r.stdout.strip()


def _trial(torch, ops, problem):
    from bench.bench_gemm import blazecore_step, launcher_kernel_ms

    step = blazecore_step(torch, ops, *problem)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    x, dy = problem[0], problem[5]
    return launcher_kernel_ms(torch, step, 5), f"x@{x.data_ptr() % 2**21:#x} dy@{dy.data_ptr() % 2**21:#x}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="olmoe")
    ap.add_argument("--tokens", default="32k")
    ap.add_argument("--trials", type=int, default=4)
    a = ap.parse_args(argv)
    import blazecore_torch as ops
    import torch

    from bench.bench_gemm import SHAPES, _problem, call_kernel_timing

    d, h, E, K = SHAPES[a.shape]
    L = int(a.tokens[:-1]) * 1024 if a.tokens.endswith("k") else int(a.tokens)
    base = _problem(torch, d, h, E, K, L)
    ref_a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    pads = []
    for trial in range(a.trials):
        pads.append(torch.empty((trial + 1) * 3 * 2**20 + 4096 * trial, dtype=torch.uint8, device="cuda"))
        per, addrs = _trial(torch, ops, [t.clone() for t in base])
        ref = call_kernel_timing(torch, lambda: ref_a @ ref_a, warmup=2, repeats=10).median_ms
        print(f"trial {trial}: " + " ".join(f"{k} {v:.3f}" for k, v in sorted(per.items())) +
              f" | ref matmul {ref:.3f} | {addrs} | {smi()}", flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
