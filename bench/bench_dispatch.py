"""Benchmark of the dispatch build: blazecore's sort-free, atomic-free build against the conventional one.

For each (L tokens, E experts, K) and one random top-k routing (K distinct experts per token), both
builds get the same ids (int32 by default) on the GPU:

* blazecore: ``build_dispatch(ids, E, validate=False)`` (2-3 kernel launches, no host sync). The timed
  calls skip the value check, which reads back from the device; one ``validate=True`` call runs
  untimed per shape (and must pass). Outputs come from CuPy's memory pool (the default allocator).
* conventional (PyTorch): ``torch.sort(flat_ids, stable=True)``, ``bincount`` + ``cumsum`` for the
  offsets, ``order // K`` and ``order % K`` for slot_token / slot_k, and the inverse permutation
  ``pair_slot[order] = arange`` (a scatter). All four outputs are produced in int32.

Each is timed two ways, in milliseconds per build (CUDA events on torch's current stream, warm-up,
median of the repeats, back-to-back calls):

* eager: the Python call, so launch and host overhead count (the conventional build's bincount
  synchronises with the host to size its output);
* graph: the build captured once in a CUDA graph and replayed (cupy ``Stream.begin_capture`` /
  ``end_capture`` for blazecore, ``torch.cuda.CUDAGraph`` for torch). bincount cannot be captured
  (host sync), so the captured conventional build takes the offsets from
  ``searchsorted(sorted_ids, arange(E + 1))`` instead: same result, no sync.

Before timing, the two builds' outputs are compared element for element; a row whose outputs differ
reports no speedup. Also reported: blazecore's plan (pairs per tile, launches) and its effective
bandwidth over the minimum traffic (read L*K ids, write 3 L*K + E + 1 int32).

Results: bench/results/dispatch_<gpu-slug>.json (header + one row per shape), and a table.

Usage (from the repository root):
    python bench/bench_dispatch.py                  # L in 8k..2M, E in {8,64,128,256}, K in {1,2,8}
    python bench/bench_dispatch.py --quick          # L in {32k, 512k}, E in {8, 256}, K in {1, 8}
    python bench/bench_dispatch.py --tokens 128k --experts 64 --topk 8 --dtype int64
"""

from __future__ import annotations

import argparse
import sys

try:
    from . import _common as common
except ImportError:  # run as a script: python bench/bench_dispatch.py
    import _common as common

DEFAULT_TOKENS = ("8k", "32k", "128k", "512k", "2m")
DEFAULT_EXPERTS = (8, 64, 128, 256)
DEFAULT_TOPK = (1, 2, 8)
QUICK = (("32k", "512k"), (8, 256), (1, 8))


def random_routing(torch, L: int, E: int, K: int, dtype, seed: int):
    """(L, K) ids, K distinct experts per token, uniform: top-k of random scores, in chunks of rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = torch.empty((L, K), dtype=dtype, device="cuda")
    step = max(1, (1 << 27) // E)  # at most 512 MiB of float32 scores at a time
    for r0 in range(0, L, step):
        r1 = min(L, r0 + step)
        scores = torch.rand((r1 - r0, E), generator=g, device="cuda")
        out[r0:r1] = scores.topk(K, dim=1).indices.to(dtype)
    return out


def conventional_build(torch, ids, E: int, capturable: bool = False):
    """Sort-based dispatch: (expert_offsets (E+1,), slot_token (N,), slot_k (N,), pair_slot (L, K)), int32."""
    L, K = ids.shape
    n = L * K
    flat = ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    if capturable:
        bounds = torch.arange(E + 1, dtype=flat.dtype, device=flat.device)
        offsets = torch.searchsorted(sorted_ids, bounds, out_int32=True)
    else:
        counts = torch.bincount(flat, minlength=E)
        offsets = torch.zeros(E + 1, dtype=torch.int32, device=flat.device)
        offsets[1:] = torch.cumsum(counts, 0)
    slot_token = torch.div(order, K, rounding_mode="floor").to(torch.int32)
    slot_k = (order % K).to(torch.int32)
    pair_slot = torch.empty(n, dtype=torch.int32, device=flat.device)
    pair_slot[order] = torch.arange(n, dtype=torch.int32, device=flat.device)
    return offsets, slot_token, slot_k, pair_slot.view(L, K)


def _same(cupy, blaze, conv) -> bool:
    fields = (blaze.expert_offsets, blaze.slot_token, blaze.slot_k, blaze.pair_slot)
    return all(bool(cupy.array_equal(b, cupy.from_dlpack(c))) for b, c in zip(fields, conv, strict=True))


def _graph_blazecore(cupy, build_dispatch, ids_cp, E: int, launch_stream):
    """Capture blazecore's build once; returns (replay, outputs kept alive with the graph)."""
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        for _ in range(2):  # compile and fill this stream's memory-pool arena outside the capture
            build_dispatch(ids_cp, E, validate=False)
        s.synchronize()
        s.begin_capture()
        out = build_dispatch(ids_cp, E, validate=False)
        graph = s.end_capture()
    s.synchronize()
    return (lambda: graph.launch(stream=launch_stream)), (graph, out, s)


def _graph_torch(torch, ids, E: int):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            conventional_build(torch, ids, E, capturable=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = conventional_build(torch, ids, E, capturable=True)
    return graph.replay, (graph, out)


def _ratio(a, b):
    return None if a is None or b is None or not a > 0 else b / a


def bench_shape(torch, cupy, L: int, E: int, K: int, dtype_name: str, args) -> dict:
    import blazecore.dispatch as D
    from blazecore.dispatch import build_dispatch

    row = {"L": L, "E": E, "K": K, "dtype": dtype_name}
    n = L * K
    p = D.plan(n, E)
    launches = {D.MODE_SINGLE_TILE: 1, D.MODE_DIRECT_SUM: 2, D.MODE_SCANNED: 3}[p.mode]
    row["plan"] = f"{p.tile}/{launches}"
    tdtype = getattr(torch, dtype_name)
    ids = random_routing(torch, L, E, K, tdtype, seed=L * 1009 + E * 31 + K)
    ids_cp = cupy.from_dlpack(ids)
    timing = dict(warmup=args.warmup, repeats=args.repeats)

    checked = build_dispatch(ids_cp, E, validate=True)  # untimed: the value check must pass
    conv = conventional_build(torch, ids, E)
    row["match"] = _same(cupy, checked, conv) and _same(cupy, checked, conventional_build(torch, ids, E, True))
    del checked, conv

    row["blazecore_ms"] = common.cuda_time(lambda: build_dispatch(ids_cp, E, validate=False), **timing).median_ms
    row["conventional_ms"] = common.cuda_time(lambda: conventional_build(torch, ids, E), **timing).median_ms
    if not args.no_graph:
        launch_stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        replay, keep = _graph_blazecore(cupy, build_dispatch, ids_cp, E, launch_stream)
        row["blazecore_graph_ms"] = common.cuda_time(replay, **timing).median_ms
        del replay, keep
        replay, keep = _graph_torch(torch, ids, E)
        row["conventional_graph_ms"] = common.cuda_time(replay, **timing).median_ms
        del replay, keep
    ok = row["match"]
    row["speedup"] = _ratio(row["blazecore_ms"], row["conventional_ms"]) if ok else None
    row["graph_speedup"] = _ratio(row.get("blazecore_graph_ms"), row.get("conventional_graph_ms")) if ok else None
    min_bytes = n * ids.element_size() + 4 * (3 * n + E + 1)
    best = row.get("blazecore_graph_ms") or row["blazecore_ms"]
    row["blazecore_GBps"] = min_bytes / (best * 1e-3) / 1e9
    return row


COLUMNS = [
    ("L", lambda r: common.format_count(r["L"]), None),
    ("E", "E", "d"),
    ("K", "K", "d"),
    ("tile/launches", "plan", None),
    ("blaze ms", "blazecore_ms", ".4f"),
    ("conv ms", "conventional_ms", ".4f"),
    ("speedup", "speedup", ".2f"),
    ("blaze graph ms", "blazecore_graph_ms", ".4f"),
    ("conv graph ms", "conventional_graph_ms", ".4f"),
    ("graph speedup", "graph_speedup", ".2f"),
    ("blaze GB/s", "blazecore_GBps", ".0f"),
    ("match", "match", None),
    ("status", "status", None),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small subset: L 32k/512k, E 8/256, K 1/8")
    ap.add_argument("--tokens", default=",".join(DEFAULT_TOKENS), help="comma list, k/m suffixes (8k,2m)")
    ap.add_argument("--experts", default=",".join(map(str, DEFAULT_EXPERTS)))
    ap.add_argument("--topk", default=",".join(map(str, DEFAULT_TOPK)))
    ap.add_argument("--dtype", choices=("int32", "int64"), default="int32", help="dtype of the expert ids")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timings")
    ap.add_argument("--results-dir", default=None)
    args = ap.parse_args(argv)

    ok, why = common.cuda_gpu_available()
    if not ok:
        print(f"bench_dispatch: needs a CUDA GPU and torch; {why}. Nothing to measure.")
        return 0
    import cupy
    import torch

    tokens, experts, topks = args.tokens.split(","), args.experts.split(","), args.topk.split(",")
    if args.quick:
        tokens, experts, topks = QUICK
    tokens = [common.parse_count(t) for t in tokens]
    experts, topks = [int(e) for e in experts], [int(k) for k in topks]

    header = common.gpu_header()
    header["bench"] = "dispatch"
    header["ids_dtype"] = args.dtype
    header["method"] = (
        "CUDA events on torch's current stream, median of back-to-back repeats after warm-up; "
        "blazecore timed with validate=False; graph rows replay a captured build; the captured "
        "conventional build uses searchsorted offsets (bincount syncs)"
    )
    common.print_header(header)
    # blazecore launches on cupy's current stream: make it torch's, so one set of events times both.
    cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream).use()

    rows, path = [], None
    for L in tokens:
        for E in experts:
            for K in topks:
                if K > E:
                    continue
                try:
                    row = bench_shape(torch, cupy, L, E, K, args.dtype, args)
                    row["status"] = "ok" if row["match"] else "MISMATCH"
                except torch.cuda.OutOfMemoryError:
                    row = {"L": L, "E": E, "K": K, "dtype": args.dtype, "status": "oom"}
                except Exception as exc:  # record and keep measuring the other shapes
                    row = {"L": L, "E": E, "K": K, "dtype": args.dtype, "status": f"error: {type(exc).__name__}: {exc}"}
                rows.append(row)
                print(_progress(row), flush=True)
                torch.cuda.empty_cache()
                cupy.get_default_memory_pool().free_all_blocks()
                path = common.write_json("dispatch", header, rows, results_dir=args.results_dir)
    print()
    common.print_table(rows, COLUMNS)
    for key, what in (("speedup", "eager"), ("graph_speedup", "graph")):
        slow = [r for r in rows if r["L"] >= 32768 and r.get(key) is not None and r[key] < 2.0]
        if slow:
            print(
                f"\n{len(slow)} shape(s) with L >= 32k below 2x ({what}):",
                ", ".join(f"L={r['L']} E={r['E']} K={r['K']} ({r[key]:.2f}x)" for r in slow),
            )
    bad = [r for r in rows if r.get("status") != "ok"]
    if bad:
        print(
            f"\n{len(bad)} shape(s) not ok:", "; ".join(f"L={r['L']} E={r['E']} K={r['K']}: {r['status']}" for r in bad)
        )
    if path is not None:
        print(f"\nwrote {path}")
    return 1 if bad else 0


def _progress(r: dict) -> str:
    head = f"L={common.format_count(r['L'])} E={r['E']} K={r['K']}"
    if r.get("status") != "ok":
        return f"{head}: {r.get('status')}"

    def ms(key):
        return "-" if r.get(key) is None else f"{r[key]:.4f}"

    def x(key):
        return "-" if r.get(key) is None else f"{r[key]:.2f}x"

    return (
        f"{head} plan {r['plan']}: eager {ms('blazecore_ms')} vs {ms('conventional_ms')} ms ({x('speedup')}), "
        f"graph {ms('blazecore_graph_ms')} vs {ms('conventional_graph_ms')} ms ({x('graph_speedup')})"
    )


if __name__ == "__main__":
    sys.exit(main())
