#!/usr/bin/env python3
"""The layer's M-grouped GEMM launches and torch._grouped_mm's on the same pre-gathered problems, for Nsight Compute.

Runs one warm forward+backward of ``blazecore_torch.moe_ffn`` ("ab") and each grouped_mm GEMM once outside the
profiled range, then the same again inside ``cudaProfilerStart`` / ``cudaProfilerStop``, so that

    ncu --profile-from-start off --clock-control none -k regex:'moe_gemm_sm90|moe_dhcur_sm90|moe_wgrad|device_kernel' \\
        -o rep python3 scripts/ncu_gemms.py --shape olmoe

captures blazecore's launches in the layer's order (gemm1, gemm2, dh', dx, then the weight gradients) followed by
grouped_mm's (gemm1, gemm2, dh', dx, dw13, dw2). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="olmoe")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--gemms", default="gemm1,gemm2,dhcur,dx,dw13,dw2",
                    help="grouped_mm GEMMs to run after the layer, in this order")
    args = ap.parse_args(argv)

    import blazecore_torch as ops
    import torch
    from probe_layer_gemms import layer_step

    from bench.bench_gemm import SHAPES, _problem, pregathered

    d, h, E, K = SHAPES[args.shape]
    L = args.tokens
    step = layer_step(torch, ops, args.shape, L)
    x, w13, w2, gates, ids, dy = _problem(torch, d, h, E, K, L)
    offs, xg, dyg = pregathered(torch, x, dy, ids, E)
    g = torch.Generator(device="cuda").manual_seed(1)

    def rnd(*shape):
        return (torch.randn(*shape, device="cuda", generator=g) * 0.5).to(torch.bfloat16)

    act, dz = rnd(L * K, h), rnd(L * K, 2 * h)
    gmm = torch._grouped_mm
    calls = {  # the operand layouts bench_gemm picks
        "gemm1": lambda: gmm(xg, w13.transpose(-2, -1), offs=offs),
        "gemm2": lambda: gmm(act, w2.transpose(-2, -1), offs=offs),
        "dhcur": lambda: gmm(dyg, w2, offs=offs),
        "dx": lambda: gmm(dz, w13, offs=offs),
        "dw13": lambda: gmm(dz.t(), xg, offs=offs),
        "dw2": lambda: gmm(dyg.t(), act, offs=offs),
    }
    names = [n for n in args.gemms.split(",") if n]

    def run_all():
        step()
        for n in names:
            calls[n]()

    run_all()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run_all()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled: blazecore layer step, then grouped_mm", ", ".join(names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
