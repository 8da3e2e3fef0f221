#!/usr/bin/env python3
"""Each expert GEMM's time inside the layer against the same launch replayed on its own, in one run.

bench/bench_gemm.py (``--clock events``) can time every GEMM launch of ``blazecore_torch.moe_ffn``'s forward+backward
("ab") with CUDA events around it, in the layer's sequence; so does this probe. It then records those launches (their
arguments, as the layer made them) and replays each one ``--reps`` times back to back with events around each replay.
A replay reads and writes the layer's own buffers (dh' rewrites dz over z: the values change, the work does not), so
the two times differ only by what ran before the launch (L2 contents, clocks) and by host gaps inside the timed window.

Usage: PYTHONPATH=.:adapters python3 scripts/probe_layer_gemms.py [--shapes olmoe,mixtral] [--tokens 32768]
Prints a table and writes DIR/probe_layer_gemms_<gpu>.json. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics


def layer_step(torch, ops, shape, L):
    """One forward+backward of ``blazecore_torch.moe_ffn`` ("ab") on bench_gemm's problem of ``shape`` and L tokens,
    as a function (returns the gradients): bench_gemm's ``blazecore_step``."""
    from bench.bench_gemm import SHAPES, _problem, blazecore_step

    d, h, E, K = SHAPES[shape]
    return blazecore_step(torch, ops, *_problem(torch, d, h, E, K, L))


def record_launches(step):
    """Runs ``step`` once with every GEMM launcher of the core recording its calls: (the launches as (launcher, kern,
    which, grid, stream, args, kwargs), what step returned, which keeps the tensors the launches use alive)."""
    from blazecore import _moe_gpu

    origs = {name: getattr(_moe_gpu, name) for name in _moe_gpu.GEMM_LAUNCHERS}
    launches = []

    def recorder(orig):
        def record(kern, which, grid, stream, *a, **kw):
            launches.append((orig, kern, which, grid, stream, a, kw))
            return orig(kern, which, grid, stream, *a, **kw)
        return record

    for name, orig in origs.items():
        setattr(_moe_gpu, name, recorder(orig))
    try:
        kept = step()
    finally:
        for name, orig in origs.items():
            setattr(_moe_gpu, name, orig)
    return launches, kept


def measure(torch, ops, cupy, shape, L, reps) -> list:
    from bench.bench_gemm import GemmTimer
    from blazecore import _moe_gpu

    step = layer_step(torch, ops, shape, L)
    step()
    torch.cuda.synchronize()
    with GemmTimer() as timer:  # in the layer: median over the calls of each GEMM's summed launches
        timer.on = True
        for i in range(reps):
            timer.call = i
            step()
        layer = timer.per_call()
    # the launches of one more call, kept with their arguments (the tensors stay alive in `kept`)
    launches, kept = record_launches(step)
    torch.cuda.synchronize()
    stream = cupy.cuda.get_current_stream()
    replay: dict = {}
    for i in range(reps + 1):
        sums: dict = {}
        for orig, kern, which, grid, st, a, kw in launches:
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            e0.record(stream)
            orig(kern, which, grid, st, *a, **kw)
            e1.record(stream)
            e1.synchronize()
            key = "dhcur" if which == "dh" else _moe_gpu._STAGED.get(which, which)  # as GemmTimer keys it
            sums[key] = sums.get(key, 0.0) + cupy.cuda.get_elapsed_time(e0, e1)
        if i:  # the first pass warms
            for k, v in sums.items():
                replay.setdefault(k, []).append(v)
    del kept
    for _orig, kern, which, grid, _st, _a, kw in launches:  # what each weight-gradient launch ran
        if _moe_gpu._STAGED.get(which, which) in ("dw13", "dw2"):
            amap = _moe_gpu._rows_map(kern, kw["B"], kw["ldb"], kw["N"], 64)
            print(f"{shape} {which}: {kern.variant(which, b_load='tma' if amap is not None else 'cp_async').name} "
                  f"grid {grid} M {kw['M']} N {kw['N']} lda {kw['lda']} ldb {kw['ldb']} ldo {kw['ldo']} "
                  f"o_estride {kw['o_estride']} blocks {kw.get('num_kblocks')} A {tuple(kw['A'].shape)} "
                  f"B {tuple(kw['B'].shape)} out {tuple(kw['out'].shape)} {kw['out'].strides}", flush=True)
    rows = []
    for k in layer:
        rep = statistics.median(replay[k])
        rows.append({"shape": shape, "tokens": L, "gemm": k, "in_layer_ms": layer[k], "replayed_ms": rep,
                     "in_layer_over_replayed": layer[k] / rep})
        print(f"{shape:8s} {L:7d} {k:6s} in layer {layer[k]:9.3f} ms  replayed {rep:9.3f} ms  "
              f"ratio {layer[k] / rep:5.3f}", flush=True)
    return rows


def probe_main(name: str, doc: str, measure_fn, default_shapes: str, argv=None) -> int:
    """The command line the layer probes share: --out, --shapes, --tokens, --reps; rows of ``measure_fn(torch, ops,
    cupy, shape, L, reps)`` for every shape, written to DIR/<name>_<gpu>.json under bench/_common's header."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--shapes", default=default_shapes)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)

    import blazecore_torch as ops
    import cupy
    import torch

    from bench import _common as common

    rows = []
    for shape in args.shapes.split(","):
        rows += measure_fn(torch, ops, cupy, shape, args.tokens, args.reps)
        torch.cuda.empty_cache()
    header = common.gpu_header()
    header.update(bench=name, tokens=args.tokens, reps=args.reps)
    print(f"wrote {common.write_json(name, header, rows, results_dir=pathlib.Path(args.out))}")
    return 0


def main(argv=None) -> int:
    return probe_main("probe_layer_gemms", __doc__, measure, "olmoe,mixtral", argv)


if __name__ == "__main__":
    raise SystemExit(main())
