"""Backward with dw2's g * hcur recomputed inside its operand load against dw2 from a stored g * hcur (GPU).

For each shape (bf16, 32k tokens, uniform routing): forward, then the backward with ``fused_dw2`` True (new) and
False (old: dh' stores g * hcur for dw2), interleaved; CUDA events around the whole backward and around each of its
dw2 and dh' launches; medians over the repeats. Also checks that both paths give the same bytes for every gradient
(the peak bytes of both come from the memory model, which replays the launcher's allocations). Writes JSON lines
to $OUT/probe_dw2_fused.jsonl (or --out) and to stdout.

    PYTHONPATH=.:adapters python scripts/probe_dw2_fused.py [--prewarm] [--shapes olmoe,mixtral] [--tokens 32768]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import numpy as np

SHAPES = {"olmoe": (2048, 1024, 64, 8), "mixtral": (4096, 14336, 8, 2), "qwen3": (2048, 768, 128, 8),
          "fine": (1536, 256, 128, 8)}


def _compile_one(fname, names, arch):
    from blazecore import _compile

    t = time.time()
    _compile._load_or_compile(fname, tuple(sorted(set(names))), arch, ())
    return fname, len(names), time.time() - t


def prewarm(workers=16):
    """Compile every expert-FFN module the tests and the timings load, in parallel, into the disk cache."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from blazecore import _compile, _moe_gpu

    arch = _compile.device_arch()
    jobs = []
    for ct in _moe_gpu._CTYPES.values():
        for act in _moe_gpu._ACT_IDS.values():
            jobs.append((_moe_gpu._FILE, _moe_gpu._module_names(ct, act)))
            if ct != "float" and arch == "sm_90a":
                jobs.append((_moe_gpu._FILE90, _moe_gpu._module_names90(ct, act)))
    t = time.time()
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        done = list(ex.map(_compile_one, *zip(*[(f, n, arch) for f, n in jobs], strict=True)))
    print(f"prewarm: {len(done)} modules in {time.time() - t:.0f} s "
          f"(slowest {max(d[2] for d in done):.0f} s)", flush=True)


def _timed_launches(store):
    """Wrap _moe_gpu._launch_gemm: CUDA events around each dw2 / dw2_hg / dhcur launch, appended to store."""
    import cupy

    from blazecore import _moe_gpu

    orig = _moe_gpu._launch_gemm

    def wrapped(kern, which, grid, stream, **kw):
        if which not in ("dw2", "dw2_hg", "dhcur"):
            return orig(kern, which, grid, stream, **kw)
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(stream)
        orig(kern, which, grid, stream, **kw)
        b.record(stream)
        store.append((which, a, b))

    return orig, wrapped


def _same_bytes(a, b) -> bool:
    import cupy

    from blazecore import _array

    a, b = _array.asarray(a), _array.asarray(b)
    return bool(cupy.array_equal(a.view(cupy.uint8), b.view(cupy.uint8)))


def run_shape(name, L, checkpoint, reps, log, activation="swiglu"):
    import cupy
    import torch

    import blazecore
    from blazecore import _moe_gpu
    from blazecore.testing import make_routing

    d, h, E, K = SHAPES[name]
    rng = np.random.default_rng(0)
    torch.manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)

    x = rnd(L, d)
    w13 = rnd(E, (2 if blazecore.activation_info(activation) else 1) * h, d, scale=d ** -0.5)
    w2 = rnd(E, d, h, scale=h ** -0.5)
    dy = rnd(L, d, scale=0.1)
    ids = torch.from_numpy(make_routing(rng, L, E, K, "uniform")).cuda()
    gates = torch.rand(L, K, device="cuda")
    torch.cuda.synchronize()
    store = []
    orig_launch, wrapped = _timed_launches(store)
    orig_backward = _moe_gpu.backward
    res = {"new": [], "old": []}
    per = {"new": {}, "old": {}}
    # the same bytes both ways (retain: z stays for the second backward)
    y, saved = blazecore.moe_forward(x, w13, w2, gates, ids, activation=activation, checkpoint=checkpoint)
    g_new = blazecore.moe_backward(dy, saved, retain=True)
    _moe_gpu.backward = functools.partial(orig_backward, fused_dw2=False)
    try:
        g_old = blazecore.moe_backward(dy, saved, retain=True)
    finally:
        _moe_gpu.backward = orig_backward
    same = {k: _same_bytes(getattr(g_new, k), getattr(g_old, k)) for k in ("dx", "dw13", "dw2", "dgates")}
    del y, saved, g_new, g_old
    for i in range(reps + 2):
        for mode in ("new", "old") if i % 2 == 0 else ("old", "new"):
            y, saved = blazecore.moe_forward(x, w13, w2, gates, ids, activation=activation, checkpoint=checkpoint)
            cupy.cuda.Device().synchronize()
            if mode == "old":
                _moe_gpu.backward = functools.partial(orig_backward, fused_dw2=False)
            _moe_gpu._launch_gemm = wrapped
            store.clear()
            s = cupy.cuda.get_current_stream()
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            try:
                a.record(s)
                grads = blazecore.moe_backward(dy, saved)
                b.record(s)
                b.synchronize()
            finally:
                _moe_gpu.backward = orig_backward
                _moe_gpu._launch_gemm = orig_launch
            if i >= 2:
                res[mode].append(cupy.cuda.get_elapsed_time(a, b))
                sums = {}
                for which, e0, e1 in store:
                    sums[which] = sums.get(which, 0.0) + cupy.cuda.get_elapsed_time(e0, e1)
                for k, v in sums.items():
                    per[mode].setdefault(k, []).append(v)
            del y, saved, grads
    flops_dw2 = 2 * L * K * d * h
    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    row = {"shape": name, "L": L, "checkpoint": checkpoint, "activation": activation, "gpu": gpu,
           "same_bytes_old_new": same}
    for mode in ("new", "old"):
        row[f"{mode}_bwd_ms"] = statistics.median(res[mode])
        for k, v in per[mode].items():
            row[f"{mode}_{k}_ms"] = statistics.median(v)
        dw2 = row.get(f"{mode}_dw2_ms", row.get(f"{mode}_dw2_hg_ms"))
        row[f"{mode}_dw2_tflops"] = flops_dw2 / dw2 / 1e9 if dw2 else None
        row[f"{mode}_dw2_plus_dh_ms"] = dw2 + row[f"{mode}_dhcur_ms"]
    print(json.dumps(row), flush=True)
    log.write(json.dumps(row) + "\n")
    log.flush()


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--prewarm", action="store_true")
    p.add_argument("--shapes", default="olmoe,mixtral")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--checkpoints", default="ab,none")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--activations", default="swiglu")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "probe_dw2_fused.jsonl"))
    args = p.parse_args(argv)
    if args.prewarm:
        prewarm()
    with open(args.out, "a") as log:
        for name in args.shapes.split(","):
            for ck in args.checkpoints.split(","):
                for act in args.activations.split(","):
                    run_shape(name, args.tokens, ck, args.reps, log, act)
    return 0


if __name__ == "__main__":
    sys.exit(main())
