"""The dgates reduction's two kernels on one problem: moe_dgates (a warp a (token, k) pair) and moe_dgates_small (a
thread a pair, no bias, at most DGATES_SMALL_PARTS partials a slot), on the partials dh' leaves for bench_gemm's
shapes (ceil(h / 256) a slot) and a random pair -> slot map; kernel time by CUDA events, both timed in alternation,
and whether their bits agree.

Usage (repository root, GPU): PYTHONPATH=.:adapters:app python scripts/probe_dgates.py \
    [--shape fine,olmoe,qwen3] [--tokens 32k,128k] [--json probe_dgates] [--results-dir DIR]
"""

from __future__ import annotations


def main(argv=None) -> int:
    from bench._common import probe_args, time_calls, write_probe_json

    a = probe_args(__doc__, argv, shape="fine,olmoe,qwen3", tokens="32k,128k", repeats=20)
    import cupy as cp
    import numpy as np

    from bench.bench_gemm import SHAPES
    from blazecore import BF16, _moe_gpu

    rows = []
    for shape in a.shape.split(","):
        d, h, E, K = SHAPES[shape]
        nparts = -(-h // _moe_gpu.BN90)
        for L in a.token_counts:
            fns, outs = _launches(cp, np, _moe_gpu, _moe_gpu._kernels(BF16, "swiglu"), L * K, K, nparts)
            t = time_calls(fns, warmup=3, repeats=a.repeats, clock="cupy")
            same = outs["warp"].get().tobytes() == outs["thread"].get().tobytes()
            row = {"shape": shape, "tokens": L, "pairs": L * K, "partials": nparts, "warp_ms": t["warp"].median_ms,
                   "thread_ms": t["thread"].median_ms, "same_bits": same}
            rows.append(row)
            print(f"{shape} {L // 1024}k: {nparts} partials a slot, warp {row['warp_ms']:.4f} ms, thread "
                  f"{row['thread_ms']:.4f} ms, same bits {same}", flush=True)
    write_probe_json(a, rows)
    return 0 if all(r["same_bits"] for r in rows) else 1


def _launches(cp, np, G, kern, LK, K, nparts):
    """({"warp": fn, "thread": fn}, their outputs) on random partials and a random pair -> slot map."""
    rng = np.random.default_rng(0)
    part = cp.asarray(rng.standard_normal((LK, nparts), dtype=np.float32))
    slot = cp.asarray(rng.permutation(LK).astype(np.int32))
    offsets = cp.asarray(np.array([0, LK], np.int32))
    outs = {"warp": cp.empty(LK, np.float32), "thread": cp.empty(LK, np.float32)}
    warp_fn, small_fn = kern.fn(f"blz::moe_dgates<{kern.ct}>"), kern.fn("blz::moe_dgates_small")
    warp_args = (part, np.int32(nparts), slot, offsets, np.int32(1), np.int64(LK), G._NULL, G._NULL, np.int32(K),
                 np.int32(0), outs["warp"])
    small_args = (part, np.int32(nparts), slot, np.int64(LK), outs["thread"])
    return {"warp": lambda: warp_fn((-(-LK // 8),), (256,), warp_args),
            "thread": lambda: small_fn((-(-LK // 256),), (256,), small_args)}, outs


if __name__ == "__main__":
    raise SystemExit(main())
