#!/usr/bin/env python3
"""Operand roles of the sm_90a weight-gradient kernel (``moe_wgrad_sm90``), timed against each other in one run.

For dw13_e = dz_e^T x_g and dw2_e = dy_g^T (g hcur)_e, three ways to run one launch over the whole width:

- ``wide_gather``: the slot-indexed operand on the 128-column side by TMA, the gathered rows on the 256-column side
  by cp.async (dw2 stores transposed tiles);
- ``narrow_gather``: the gathered rows on the 128-column side by cp.async, the slot-indexed operand on the 256-column
  side by TMA (dw13 stores transposed tiles);
- ``no_gather``: both operands slot-indexed (the gathered rows copied into slot order beforehand) and both by TMA:
  what the kernel does when no row is gathered;
- ``narrow_contig``: as ``narrow_gather`` with the rows copied into slot order beforehand (cp.async, no gather).

Each variant's output is compared with the first one's (bits) and with an fp32 product of one expert; time is CUDA
events around each launch, the variants interleaved, median of the repeats.

Usage: PYTHONPATH=. python3 scripts/probe_wgrad.py [--out DIR] [--tokens 32768] [--reps 10] [--shapes olmoe,...]
Writes DIR/probe_wgrad_<gpu>.json (bench/_common's header) and prints a table. Needs a Hopper GPU.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

SHAPES = {"olmoe": (2048, 1024, 64, 8), "qwen3": (2048, 768, 128, 8), "fine": (1536, 256, 128, 8),
          "mixtral": (4096, 14336, 8, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--scale", type=float, default=0.5,
                    help="standard deviation of the random operands (0: all zeros; the tensor cores' power, and so "
                         "the clock, depends on the data)")
    ap.add_argument("--block-tokens", type=int, default=0,
                    help="restart the reductions at every multiple of this many tokens, as the layer does "
                         "(0: one block)")
    args = ap.parse_args(argv)

    import cupy as cp
    import torch

    import blazecore
    from blazecore import _compile, _moe_args, _tma
    from blazecore import _moe_gpu as G

    ct = "__nv_bfloat16"
    BN = G.BN90
    smem = G._smem90(BN)
    names = {
        ("dw13", "wide_gather"): G._wgrad90_name(ct, False, True, a_tma=True),
        ("dw13", "narrow_gather"): G._wgrad90_name(ct, True, False, out_t=True, b_tma=True),
        ("dw13", "no_gather"): G._wgrad90_name(ct, False, False, a_tma=True, b_tma=True),
        ("dw2", "wide_gather"): G._wgrad90_name(ct, False, True, out_t=True, a_tma=True),
        ("dw2", "narrow_gather"): G._wgrad90_name(ct, True, False, b_tma=True),
        ("dw2", "no_gather"): G._wgrad90_name(ct, False, False, a_tma=True, b_tma=True),
        ("dw13", "narrow_contig"): G._wgrad90_name(ct, False, False, out_t=True, b_tma=True),
        ("dw2", "narrow_contig"): G._wgrad90_name(ct, False, False, b_tma=True),
    }
    module = tuple(sorted(set(names.values())))
    fns = {k: _compile.get_function(G._FILE_WGRAD90, n, module_names=module, max_dynamic_smem=smem)
           for k, n in names.items()}
    null = _tma.null_map()

    tma_kern = G._Kernels(G.BF16, "swiglu", b_load="tma")

    def amap(t, cols):  # the launcher's map of a slot-indexed operand: 2-D (cols, rows), box (64, 64)
        return G._rows_map(tma_kern, t, t.shape[1], cols, 64)

    def launch(fn, grid, A, lda, B, ldb, disp, E, M, N, out, ldo, oes, ma, mb, stream, blk):
        args_ = _moe_args.pack(_moe_args.K_GROUPED, A=A, B=B, slot_token=disp.slot_token, offsets=disp.expert_offsets,
                               kblocks=blk[0], out=out, carry=None, carry_seen=None, lda=lda, ldb=ldb, ldo=ldo,
                               o_estride=oes, num_experts=E, M=M, N=N, num_kblocks=blk[1], carry_in=0, carry_out=0,
                               a_off32=0, b_off32=0)
        fn((int(grid),), (G.NTHREADS90,), (args_, ma, mb, null), shared_mem=smem, stream=stream)  # out by threads

    rows = []
    for shape in args.shapes.split(","):
        d, h, E, K = SHAPES[shape]
        L = args.tokens
        LK, H2 = L * K, 2 * h
        torch.manual_seed(0)
        tdev = "cuda"
        ids = torch.topk(torch.randn(L, E, device=tdev), K, dim=1).indices.to(torch.int32)
        disp = blazecore.build_dispatch(cp.asarray(ids), E)
        g = torch.Generator(device=tdev).manual_seed(1)

        def rnd(*s, g=g):
            return cp.asarray((torch.randn(*s, device="cuda", generator=g) * args.scale).to(torch.bfloat16)
                              .view(torch.int16)).view(cp.uint16)

        x, dy, dz, hg = rnd(L, d), rnd(L, d), rnd(LK, H2), rnd(LK, h)
        tok = disp.slot_token
        xs, dys = x[tok], dy[tok]  # slot order (no_gather only)
        stream = cp.cuda.get_current_stream()
        blk = ((None, 0) if args.block_tokens <= 0 else
               G._block_starts(G._Kernels(G.BF16, "swiglu"), disp, E, L, args.block_tokens, stream))
        grid13w, grid13n = E * -(-H2 // 128) * -(-d // BN), E * -(-d // 128) * -(-H2 // BN)
        grid2w, grid2n = E * -(-h // 128) * -(-d // BN), E * -(-d // 128) * -(-h // BN)
        variants = ("wide_gather", "narrow_gather", "no_gather", "narrow_contig")
        o13 = {v: cp.empty((E, H2, d), cp.uint16) for v in variants}
        o2 = {v: cp.empty((E, d, h), cp.uint16) for v in variants}
        # (grid, A, lda, B, ldb, M, N, out, ldo, o_estride, tmap_a, tmap_b) of each launch
        runs = {
            ("dw13", "wide_gather"): (grid13w, dz, H2, x, d, H2, d, o13["wide_gather"], d, H2 * d, amap(dz, H2),
                                      null),
            ("dw13", "narrow_gather"): (grid13n, x, d, dz, H2, d, H2, o13["narrow_gather"], d, H2 * d, null,
                                        amap(dz, H2)),
            ("dw13", "no_gather"): (grid13w, dz, H2, xs, d, H2, d, o13["no_gather"], d, H2 * d, amap(dz, H2),
                                    amap(xs, d)),
            ("dw2", "wide_gather"): (grid2w, hg, h, dy, d, h, d, o2["wide_gather"], h, d * h, amap(hg, h), null),
            ("dw2", "narrow_gather"): (grid2n, dy, d, hg, h, d, h, o2["narrow_gather"], h, d * h, null, amap(hg, h)),
            ("dw2", "no_gather"): (grid2n, dys, d, hg, h, d, h, o2["no_gather"], h, d * h, amap(dys, d),
                                   amap(hg, h)),
            ("dw13", "narrow_contig"): (grid13n, xs, d, dz, H2, d, H2, o13["narrow_contig"], d, H2 * d, null,
                                        amap(dz, H2)),
            ("dw2", "narrow_contig"): (grid2n, dys, d, hg, h, d, h, o2["narrow_contig"], h, d * h, null,
                                       amap(hg, h)),
        }
        outs = {"dw13": o13, "dw2": o2}

        def go(k, runs=runs, disp=disp, E=E, stream=stream, blk=blk):
            grid, A, lda, B, ldb, M, N, out, ldo, oes, ma, mb = runs[k]
            launch(fns[k], grid, A, lda, B, ldb, disp, E, M, N, out, ldo, oes, ma, mb, stream, blk)

        for k in runs:  # warm-up (and compile)
            go(k)
        stream.synchronize()
        times = {k: [] for k in runs}
        for _ in range(args.reps):
            for k in runs:
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record(stream)
                go(k)
                e1.record(stream)
                e1.synchronize()
                times[k].append(cp.cuda.get_elapsed_time(e0, e1))
        # checks: bits against the first variant; one expert against an fp32 product
        off = cp.asnumpy(disp.expert_offsets)
        e = int(np.argmax(np.diff(off)))
        sl = slice(int(off[e]), int(off[e + 1]))

        def f32(a):
            return torch.as_tensor(a.view(cp.int16), device="cuda").view(torch.bfloat16).float()

        tk = torch.as_tensor(tok[sl], device=tdev).long()
        ref = {"dw13": f32(dz[sl]).T @ f32(x)[tk], "dw2": f32(dy)[tk].T @ f32(hg[sl])}
        for (gname, v), ts in times.items():
            o = outs[gname][v]
            base = outs[gname]["wide_gather"]
            M, N = (H2, d) if gname == "dw13" else (d, h)
            ms = float(np.median(ts))
            err = float((f32(o[e]) - ref[gname]).abs().max() / ref[gname].abs().max().clamp_min(1e-30))
            row = {"shape": shape, "tokens": L, "block_tokens": args.block_tokens, "gemm": gname, "variant": v,
                   "ms": ms,
                   "tflops": 2.0 * LK * M * N / ms / 1e9, "bits_equal_wide_gather": bool(cp.array_equal(o, base)),
                   "rel_err_vs_fp32": err}
            rows.append(row)
            print(f"{shape:8s} {gname:5s} {v:14s} {ms:8.3f} ms {row['tflops']:6.0f} TF/s  "
                  f"bits={row['bits_equal_wide_gather']} err={err:.2e}", flush=True)
        del x, dy, dz, hg, xs, dys, o13, o2, outs, runs
        cp.get_default_memory_pool().free_all_blocks()
    from bench import _common as common

    header = common.gpu_header()
    header.update(bench="probe_wgrad", tokens=args.tokens, reps=args.reps, block_tokens=args.block_tokens,
                  scale=args.scale)
    path = common.write_json("probe_wgrad", header, rows, results_dir=pathlib.Path(args.out))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
