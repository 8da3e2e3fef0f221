#!/usr/bin/env python3
"""The sm_90a M-grouped GEMMs with the weights loaded by TMA against cp.async (``_moe_gpu.B_LOADS``), in one run.

1. A tensor map passed by value reaches a kernel intact (CuPy structured-scalar argument).
2. Every M-grouped GEMM of both paths on a small ragged problem (gemm1 gated and plain, gemm2, dh', dx, each with
   its layer arguments): the outputs of the two paths must have the same bits.
3. Per-GEMM time (CUDA events around each launch, warm-up, median) of gemm1 / gemm2 / dh' / dx on three paths
   interleaved (cp_async: A and B by cp.async; tma_b: B by TMA; tma, the default: B and a slot-ordered A by TMA),
   for olmoe (d=2048, h=1024, E=64, K=8), qwen3, fine and mixtral (4096, 14336, 8, 2) at 32k tokens, uniform random
   routing, bf16 SwiGLU, checkpoint "ab"; the layer's column slices as the layer runs them.

Usage: PYTHONPATH=. python3 scripts/probe_sm90_tma.py [--out DIR] [--tokens 32768] [--reps 10]
Writes DIR/probe_sm90_tma.json and prints a table. Needs a Hopper GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

SHAPES = {"olmoe": (2048, 1024, 64, 8), "qwen3": (2048, 768, 128, 8), "fine": (1536, 256, 128, 8),
          "mixtral": (4096, 14336, 8, 2)}
GEMMS = ("gemm1", "gemm2", "dhcur", "dx")


def _cp():
    import cupy

    return cupy


def _compile_module(job):
    from blazecore import _compile

    fname, names = job
    t = time.time()
    _compile._load_or_compile(fname, tuple(sorted(set(names))), "sm_90a", ())
    return fname, len(names), time.time() - t


def prewarm(workers=16):
    """Compile the expert-FFN modules the tests and the probe load (every dtype and activation) into the disk cache,
    in parallel processes (NVRTC compiles one program on one core)."""
    from concurrent.futures import ProcessPoolExecutor

    from blazecore import _moe_gpu as G

    jobs = [(G._FILE90, G._module_names90(ct, a)) for ct in ("__nv_bfloat16", "__half") for a in G._ACT_IDS.values()]
    jobs += [(G._FILE_WGRAD90, G._wgrad_names90(ct)) for ct in ("__nv_bfloat16", "__half")]
    jobs += [(G._FILE_DH90, G._dh_names90(ct)) for ct in ("__nv_bfloat16", "__half")]
    jobs += [(G._FILE, G._module_names(ct, a)) for ct in G._CTYPES.values() for a in G._ACT_IDS.values()]
    jobs += [(G._FILE_HELPERS, G._helper_names(ct)) for ct in G._CTYPES.values()]
    t = time.time()
    with ProcessPoolExecutor(workers) as ex:
        done = list(ex.map(_compile_module, jobs))
    print(f"prewarm: {len(done)} modules in {time.time() - t:.0f} s (slowest {max(d[2] for d in done):.0f} s)",
          flush=True)


def check_map_argument():
    """A 128-byte structured scalar passed to a __grid_constant__ parameter arrives byte for byte."""
    cp = _cp()
    from blazecore import _tma

    src = r'''
    struct alignas(64) M { unsigned long long v[16]; };
    extern "C" __global__ void echo(int a, const __grid_constant__ M m, unsigned long long* out, int b) {
      const int i = threadIdx.x;
      if (i < 16) out[i] = m.v[i] + (unsigned long long)(a + b);
    }'''
    k = cp.RawKernel(src, "echo", options=("--std=c++17",))
    words = np.arange(1, 17, dtype=np.uint64) * np.uint64(0x0101010101)
    m = np.frombuffer(words.tobytes(), dtype=_tma.MAP_DTYPE)[0]
    out = cp.zeros(16, dtype=cp.uint64)
    k((1,), (32,), (np.int32(3), m, out, np.int32(4)))
    got = out.get()
    ok = bool(np.array_equal(got, words + np.uint64(7)))
    print(f"map argument by value: {'ok' if ok else 'MISMATCH'}", flush=True)
    if not ok:
        print(got, words + np.uint64(7))
    return ok


class Problem:
    """Random bf16 operands, uniform routing, the dispatch and the buffers of the four M-grouped GEMMs."""

    def __init__(self, L, d, h, E, K, seed=0, activation="swiglu", bias=False):
        cp = _cp()
        from blazecore import _array, _moe_gpu
        from blazecore.dispatch import build_dispatch

        rng = np.random.default_rng(seed)
        self.L, self.d, self.h, self.E, self.K = L, d, h, E, K
        self.activation = activation
        self.gated = activation in _moe_gpu._GATED
        self.H2 = 2 * h if self.gated else h
        self.LK = L * K
        ids = np.argsort(rng.random((L, E)), axis=1)[:, :K].astype(np.int32) if L else np.zeros((0, K), np.int32)
        crng = cp.random.default_rng(seed)

        def rnd(*shape, scale=1.0):
            return (crng.standard_normal(shape, dtype=cp.float32) * scale).astype(cp.float32)

        def bf16(a):  # round to bf16, keep the uint16 storage the kernels take
            u = a.view(cp.uint32)
            u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            return u.astype(cp.uint16)

        self.x = bf16(rnd(L, d))
        self.w13 = bf16(rnd(E, self.H2, d, scale=d ** -0.5))
        self.w2 = bf16(rnd(E, d, h, scale=h ** -0.5))
        self.dy = bf16(rnd(L, d))
        self.gates = cp.asarray(rng.random((L, K)).astype(np.float32))
        self.b13 = bf16(rnd(E, self.H2, scale=0.1)) if bias else None
        self.b2 = bf16(rnd(E, d, scale=0.1)) if bias else None
        self.disp = build_dispatch(cp.asarray(ids), E, validate=False)
        self.z = bf16(rnd(self.LK, self.H2))  # pre-activations (gemm1 writes them; dh' reads them)
        self.hbuf = bf16(rnd(self.LK, h))
        self.dz = bf16(rnd(self.LK, self.H2))
        self._array = _array

    def alloc(self, shape, dtype=np.uint16):
        """Poisoned: bf16 NaN (0x7FC0) or fp32 NaN, so an unwritten element differs from any result."""
        cp = _cp()
        return cp.full(shape, 0x7FC0 if dtype == np.uint16 else np.nan, dtype=dtype)


def gemm_launches(kern, p, which, outs):
    """[callable] launching one M-grouped GEMM of the layer (its column slices, without the combine), writing into
    the buffers of ``outs`` (a dict the caller keeps per path)."""
    from blazecore import _moe_gpu as G

    stream = None
    E, LK, d, h, H2 = p.E, p.LK, p.d, p.h, p.H2
    to = outs.setdefault("tile_offsets", G._tile_offsets(kern, p.disp, E, _cp().cuda.get_current_stream()))
    calls = []
    if which == "gemm1":
        hb = outs.setdefault("h", p.alloc((LK, h)))
        zb = outs.setdefault("z", p.alloc((LK, H2)))
        calls.append(lambda: G._gemm1(kern, p.x, p.w13, p.b13, p.disp, to, E, LK, h, hb, zb,
                                      _cp().cuda.get_current_stream()))
    elif which == "gemm2":
        sl = G.o_slices(d)
        ob = outs.setdefault("o", p.alloc((LK * max(c1 - c0 for c0, c1 in sl),)))
        for c0, c1 in sl:
            w = c1 - c0
            calls.append(lambda c0=c0, w=w: G._launch_m(
                kern, "gemm2", G._m_grid(LK, E, kern.tiles_n("gemm2", w)), _cp().cuda.get_current_stream(),
                A=p.hbuf, lda=h, B=p.w2[:, c0:], ldb=h, b_estride=d * h, disp=p.disp, tile_offsets=to, E=E,
                N=w, Kd=h, out=ob[:LK * w].reshape(LK, w), ldo=w,
                bias=None if p.b2 is None else p.b2[:, c0:], bias_estride=d, gates=p.gates, topk=p.K))
    elif which == "dhcur":
        tiles_nh = kern.tiles_n("dhcur", h)
        bn_h = kern.variant("dhcur").bn
        sl = G.h_slices(h, d)
        dzb = outs.setdefault("dz", p.alloc((LK, H2)))
        part = outs.setdefault("part", p.alloc((LK, tiles_nh), np.float32))
        hg = outs.setdefault("hg", p.alloc((LK * max(c1 - c0 for c0, c1 in sl),)))
        gated = H2 != h
        for c0, c1 in sl:
            w = c1 - c0
            # z is read (aux) and dz written to a separate buffer, so repeated launches see the same inputs
            calls.append(lambda c0=c0, w=w: G._launch_m(
                kern, "dhcur", G._m_grid(LK, E, kern.tiles_n("dhcur", w)), _cp().cuda.get_current_stream(),
                A=p.dy, lda=d, B=p.w2[:, :, c0:], ldb=h, b_estride=d * h, disp=p.disp, tile_offsets=to, E=E,
                N=w, Kd=d, out=dzb[:, c0:], ldo=H2, up=h if gated else 0, out2=hg[:LK * w].reshape(LK, w),
                ldo2=w, aux=p.z[:, c0:], ldaux=H2, gates=p.gates, topk=p.K, part=part[:, c0 // bn_h:],
                part_ld=tiles_nh))
    else:
        sl = G.dx_slices(d, H2)
        rows = outs.setdefault("dxs", p.alloc((LK * max(c1 - c0 for c0, c1 in sl),)))
        for c0, c1 in sl:
            w = c1 - c0
            calls.append(lambda c0=c0, w=w: G._launch_m(
                kern, "dx", G._m_grid(LK, E, kern.tiles_n("dx", w)), _cp().cuda.get_current_stream(),
                A=p.dz, lda=H2, B=p.w13[:, :, c0:], ldb=d, b_estride=H2 * d, disp=p.disp, tile_offsets=to, E=E,
                N=w, Kd=H2, out=rows[:LK * w].reshape(LK, w), ldo=w))
    del stream
    return calls


def flops(p, which):
    return 2 * p.LK * {"gemm1": p.d * p.H2, "gemm2": p.h * p.d, "dhcur": p.d * p.h, "dx": p.H2 * p.d}[which]


def check_paths(activations=("swiglu", "gelu")):
    """Both B paths on small ragged problems: every output buffer with the same bits."""
    cp = _cp()
    from blazecore import _moe_gpu as G

    ok = True
    # (L, d, h, E, K): ragged rows, empty experts (E > L*K), N and Kd not multiples of the tiles, column slices
    for L, d, h, E, K in ((37, 200, 136, 5, 3), (300, 1064, 40, 8, 2), (120, 40, 600, 6, 2), (2, 64, 64, 16, 2),
                          (515, 96, 80, 8, 2)):
        for act in activations:
            p = Problem(L, d, h, E, K, seed=L + d, activation=act, bias=True)
            res = {}
            for b_load in G.B_LOADS:
                kern = G._Kernels(G.BF16, act, b_load=b_load)
                outs = {}
                for which in GEMMS:
                    for f in gemm_launches(kern, p, which, outs):
                        f()
                cp.cuda.get_current_stream().synchronize()
                res[b_load] = {k: v for k, v in outs.items() if k != "tile_offsets"}
            bad = [k for k in res["tma"] if not bool(cp.array_equal(res["tma"][k], res["cp_async"][k]))]
            nan = [k for k, v in res["tma"].items()
                   if (bool(cp.isnan(v).any()) if v.dtype == cp.float32 else bool((v == 0x7FC0).any()))]
            print(f"paths L={L} d={d} h={h} E={E} K={K} {act}: {'ok' if not bad else 'DIFFER ' + str(bad)}"
                  f"{' NaN ' + str(nan) if nan else ''}", flush=True)
            ok = ok and not bad
    return ok


def time_shape(name, L, reps, warmup=3):
    cp = _cp()
    from blazecore import _moe_gpu as G

    d, h, E, K = SHAPES[name]
    p = Problem(L, d, h, E, K, seed=1)
    # "tma_b": the weights by TMA, a slot-ordered A (gemm2's hcur, dx's dz) by cp.async, as before A_TMA
    paths = ("cp_async", "tma_b", "tma")
    kerns = {b: G._Kernels(G.BF16, "swiglu", b_load="cp_async" if b == "cp_async" else "tma") for b in paths}
    rows = []

    def run(b, calls):
        saved = G._A_TMA
        G._A_TMA = frozenset() if b == "tma_b" else saved
        try:
            for f in calls[b]:
                f()
        finally:
            G._A_TMA = saved

    for which in GEMMS:
        calls = {b: gemm_launches(kerns[b], p, which, {}) for b in paths}
        times = {b: [] for b in paths}
        ev = [cp.cuda.Event() for _ in range(2)]
        for r in range(warmup + reps):
            for b in paths:  # interleaved: the paths see the same clocks and L2 history
                ev[0].record()
                run(b, calls)
                ev[1].record()
                ev[1].synchronize()
                if r >= warmup:
                    times[b].append(cp.cuda.get_elapsed_time(ev[0], ev[1]))
        fl = flops(p, which)
        row = {"shape": name, "tokens": L, "gemm": which, "flops": fl}
        for b in paths:
            ms = float(np.median(times[b]))
            row[f"{b}_ms"] = ms
            row[f"{b}_tflops"] = fl / ms / 1e9
            row[f"{b}_spread"] = float((np.max(times[b]) - np.min(times[b])) / ms)
        rows.append(row)
        print(f"{name:8s} {L:6d} {which:6s} cp_async {row['cp_async_ms']:8.3f} ms {row['cp_async_tflops']:6.1f} TF/s"
              f" | tma_b {row['tma_b_tflops']:6.1f} TF/s | tma {row['tma_ms']:8.3f} ms {row['tma_tflops']:6.1f} TF/s",
              flush=True)
        del calls
        cp.get_default_memory_pool().free_all_blocks()
    del p
    cp.get_default_memory_pool().free_all_blocks()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--shapes", default="olmoe,mixtral")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--prewarm", action="store_true", help="only compile the kernels into the disk cache")
    args = ap.parse_args(argv)
    if args.prewarm:
        prewarm()
        return 0
    cp = _cp()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"GPU {gpu}, CuPy {cp.__version__}, CUDA runtime {cp.cuda.runtime.runtimeGetVersion()}", flush=True)
    result = {"gpu": gpu, "cupy": cp.__version__, "tokens": args.tokens, "reps": args.reps}
    t0 = time.time()
    result["map_argument_ok"] = check_map_argument()
    if not result["map_argument_ok"]:
        return 1
    if not args.skip_check:
        result["paths_bit_identical"] = check_paths()
        print(f"path check {time.time() - t0:.0f} s", flush=True)
    rows = []
    for name in args.shapes.split(","):
        rows += time_shape(name, args.tokens, args.reps)
        result["rows"] = rows
        with open(os.path.join(args.out, "probe_sm90_tma.json"), "w") as f:
            json.dump(result, f, indent=1)
    print(f"\n{'shape':8s} {'gemm':6s} {'cp_async TF/s':>14s} {'tma_b TF/s':>11s} {'tma TF/s':>10s}   ({gpu})")
    for r in rows:
        print(f"{r['shape']:8s} {r['gemm']:6s} {r['cp_async_tflops']:14.1f} {r['tma_b_tflops']:11.1f} "
              f"{r['tma_tflops']:10.1f}")
    return 0 if result.get("paths_bit_identical", True) else 1


if __name__ == "__main__":
    sys.exit(main())
