"""How far the token count goes on one GPU: blazecore with the chunk planner against the PyTorch baselines.

For one shape (default olmoe: d=2048, h=1024, E=64, K=8), bf16, L doubles from --start until an out-of-memory
for each implementation (or --max). blazecore runs with the planner on: ``plan_chunks`` picks the checkpoint
policy ("ab" if it fits, else "none") and the smallest chunk count whose predicted peak fits 0.9 of the
memory free at that point (the inputs are already allocated). Every row reports

* predicted peak / held bytes (blazecore.memory.moe_memory) next to the measured ones (torch's allocator
  counts every blazecore buffer: blazecore allocates through torch here), and their ratio;
* forward+backward time (CUDA events, median) and effective TFLOP/s (18 L K d h / time).

A second table compares chunked with unchunked throughput at --compare-tokens (default 128k) for each policy.
Checks (exit status 1 if any fails): predicted peak within 10% of measured on every blazecore row; blazecore's
largest L at least 8x grouped_mm's; 2M tokens ran; chunked throughput at most 10% below unchunked.

Usage (repository root): python -m bench.bench_scale [--shape olmoe] [--start 8k] [--max 8M] [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import sys

try:
    from . import _common as common
    from . import bench_moe as bm
except ImportError:  # run as a script from bench/
    import _common as common
    import bench_moe as bm

SHAPES = {"olmoe": (2048, 1024, 64, 8), "qwen3": (2048, 768, 128, 8), "mixtral": (4096, 14336, 8, 2),
          "fine": (1536, 256, 128, 8)}
FRACTION = 0.9


class PlannedBlaze(bm.BlazeImpl):
    """blazecore with the planner's chunk count and policy for each problem (or forced ones)."""

    def __init__(self, bc, chunks=None, checkpoint=None):
        super().__init__(bc, checkpoint or "auto")
        self.key = "blazecore[planned]" if chunks is None else f"blazecore[{checkpoint},c={chunks}]"
        self.forced = (chunks, checkpoint)
        self.plan = None

    def prepare(self, p, budget):
        L, d = p.x.shape
        E, _, h = p.w2.shape
        K = p.expert_ids.shape[1]
        chunks, policy = self.forced
        if chunks is None:
            self.plan = self._bc.plan_chunks(L, d, h, E, K, checkpoint=None, budget=int(budget))
            chunks, policy = self.plan.chunks, self.plan.checkpoint
        self.chunks, self.checkpoint = chunks, policy
        self.estimate = self._bc.moe_memory(L, d, h, E, K, checkpoint=policy, chunks=chunks, sm90=self._sm90())

    def _sm90(self):
        from blazecore import _compile

        return _compile.device_arch() == "sm_90a"

    def forward(self, p):
        x, w13, w2, gates = p.detached
        y, saved = self._call(self._bc.moe.moe_forward, x, w13, w2, gates, p.expert_ids, activation=bm.ACTIVATION,
                              checkpoint=self.checkpoint, chunks=self.chunks)
        return bm._to_torch(y), saved


def _free_budget():
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    return FRACTION * free


def _measure(impl, p, flops, args, baselines):
    """(row fields, ok) for one implementation on one problem."""
    try:
        if isinstance(impl, PlannedBlaze):
            impl.prepare(p, _free_budget())
        mem = bm.measure_memory(impl, p)
        t = bm._time(lambda: impl.backward(p, *impl.forward(p)), args)
        row = {**mem, "status": "ok", "fwd_bwd_ms": t.median_ms, "fwd_bwd_tflops": common.tflops(flops, t.median_ms),
               "fwd_bwd_samples_ms": t.samples_ms}
        if isinstance(impl, PlannedBlaze):
            est = impl.estimate
            row.update(chunks=est.chunks, chunk_tokens=est.chunk_tokens, checkpoint=impl.checkpoint,
                       predicted_peak_bytes=est.peak_bytes, predicted_held_bytes=est.held_bytes,
                       peak_ratio=est.peak_bytes / mem["peak_bytes"] if mem["peak_bytes"] else None,
                       budget_bytes=impl.plan.budget if impl.plan else None)
        return row, True
    except Exception as exc:  # noqa: BLE001  (rows record what went wrong)
        status, message = bm._classify(exc, baselines)
        return {"status": status, "message": message}, False
    finally:
        bm._cleanup()


def layer_rows(args, shape_name):
    """``blazecore_torch.MoELayer(chunks="auto")`` as users call it: bf16 forward + backward of x (L, d) with
    requires_grad through the router, top-k and experts, for each token count and policy in --layer-tokens and
    --layer-policies ("auto" lets the planner choose the checkpoint policy). The measured peak is beyond the
    parameters and x (dy, allocated before the call, counts: the prediction includes it); the predicted one is
    ``blazecore.layer.layer_memory`` for the chunks and policy the layer's planner picks (the same plan the
    layer makes, from the same free memory). The measured call is a training step's steady state: one untimed
    forward + backward runs first (kernels compiled, allocator warm), its gradients set to None as an optimizer's
    ``zero_grad()`` does. A process's very first call can peak lower than the model (seen on an H100 at 512k
    tokens: by two (L, d) buffers); the steady state is what the planner must fit."""
    import torch
    from blazecore_torch import MoELayer

    from blazecore import _compile
    from blazecore.layer import layer_memory, resolve_plan

    d, h, E, K = SHAPES[shape_name]
    out = []
    for policy in [p for p in args.layer_policies.split(",") if p]:
        for L in [common.parse_count(t) for t in args.layer_tokens.split(",") if t]:
            row = {"shape": shape_name, "d": d, "h": h, "E": E, "K": K, "tokens": L, "impl": f"MoELayer[{policy}]",
                   "layer_checkpoint": policy}
            torch.manual_seed(args.seed)
            layer = x = dy = y = None
            try:
                layer = MoELayer(d, h, E, K, checkpoint=policy, chunks="auto", device="cuda", dtype=torch.bfloat16)
                x = torch.randn(L, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
                y, _ = layer(x)  # the untimed step: compile, warm the allocator
                y.backward(torch.randn_like(y))
                y = None
                x.grad = None
                layer.zero_grad(set_to_none=True)
                bm._cleanup()
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                dy = torch.randn(L, d, device="cuda", dtype=torch.bfloat16)
                chunks, ckpt = resolve_plan("auto", policy, L, d, h, E, K, dtype="bfloat16", activation="swiglu",
                                            free_bytes=layer._free_bytes(x))
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                y, _ = layer(x)
                y.backward(dy)
                end.record()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
                pred = layer_memory(L, d, h, E, K, dtype="bfloat16", activation="swiglu", checkpoint=ckpt,
                                    chunks=chunks, sm90=_compile.device_arch() == "sm_90a")
                ms = start.elapsed_time(end)
                row.update(status="ok", chunks=chunks, checkpoint=ckpt, peak_bytes=peak, predicted_peak_bytes=pred,
                           peak_ratio=pred / peak, fwd_bwd_ms=ms,
                           fwd_bwd_tflops=common.tflops(18 * L * K * d * h, ms))
            except Exception as exc:  # rows record what went wrong
                status, message = bm._classify(exc, bm._import_baselines())
                row.update(status=status, message=message)
            del layer, x, dy, y
            bm._cleanup()
            out.append(row)
            common.print_table([row], TABLE)
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="olmoe", choices=sorted(SHAPES))
    ap.add_argument("--start", type=common.parse_count, default=common.parse_count("8k"))
    ap.add_argument("--max", type=common.parse_count, default=common.parse_count("8M"))
    ap.add_argument("--compare-tokens", type=common.parse_count, default=common.parse_count("128k"))
    ap.add_argument("--compare-chunks", default="4,8")
    ap.add_argument("--impls", default="blazecore,grouped_mm,conventional")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results-dir", type=pathlib.Path, default=None)
    ap.add_argument("--name", default="scale")
    ap.add_argument("--layer-tokens", default="", help="token counts for MoELayer(chunks=\"auto\") rows, e.g. 2m,4m")
    ap.add_argument("--layer-policies", default="ab,auto", help="MoELayer checkpoint policies of those rows")
    ap.add_argument("--skip-core", action="store_true", help="only the MoELayer rows")
    return ap.parse_args(argv)


TABLE = [
    ("impl", "impl", None), ("L", "tokens", None), ("status", "status", None), ("policy", "checkpoint", None),
    ("chunks", "chunks", None), ("ms", "fwd_bwd_ms", ".1f"), ("TFLOP/s", "fwd_bwd_tflops", ".0f"),
    ("peak GiB", lambda r: r.get("peak_bytes") and r["peak_bytes"] / 2**30, ".2f"),
    ("pred GiB", lambda r: r.get("predicted_peak_bytes") and r["predicted_peak_bytes"] / 2**30, ".2f"),
    ("pred/meas", "peak_ratio", ".3f"),
]


def main(argv=None) -> int:
    args = parse_args(argv)
    ok, why = common.cuda_gpu_available()
    if not ok:
        print(f"bench_scale: needs a CUDA GPU: {why}. Nothing measured.")
        return 2
    bm.DEVICE = "cuda"
    import blazecore as bc

    baselines = bm._import_baselines()
    header = common.gpu_header()
    header["bench"] = "scale"
    common.print_header(header)
    d, h, E, K = SHAPES[args.shape]
    weights = bm.make_weights(d, h, E, args.seed)
    impls = []
    for name in args.impls.split(","):
        if name == "blazecore":
            impls.append(PlannedBlaze(bc))
        elif name == "conventional":
            impls.append(bm.TorchImpl("conventional", baselines.conventional_moe))
        elif name == "grouped_mm":
            impls.append(bm.TorchImpl("grouped_mm", baselines.grouped_mm_moe, baselines.grouped_mm_unsupported))
    rows, compare, layer = [], [], []

    def save():
        return common.write_json(args.name, header, rows, args.results_dir, compare=compare, layer_rows=layer,
                                 summary=summary())

    def largest(key):
        ok_rows = [r["tokens"] for r in rows if r["impl"] == key and r["status"] == "ok"]
        return max(ok_rows) if ok_rows else None

    def summary():
        blz = [r for r in rows if r["impl"] == "blazecore[planned]" and r["status"] == "ok"]
        lb, lg = largest("blazecore[planned]"), largest("grouped_mm")
        ratios = [r["peak_ratio"] for r in blz if r.get("peak_ratio")]
        thr = [c for c in compare if c.get("throughput_vs_unchunked") is not None]
        return {
            "largest_tokens": {i.key: largest(i.key) for i in impls},
            "largest_ratio_vs_grouped_mm": (lb / lg) if lb and lg else None,
            "worst_peak_prediction_error": max((abs(x - 1) for x in ratios), default=None),
            "ran_2M": any(r["tokens"] >= 2 * 1024 * 1024 for r in blz),
            "worst_chunked_throughput_vs_unchunked": min((c["throughput_vs_unchunked"] for c in thr), default=None),
            "layer_largest_tokens": {pol: max((r["tokens"] for r in layer if r["layer_checkpoint"] == pol
                                               and r["status"] == "ok"), default=None)
                                     for pol in {r["layer_checkpoint"] for r in layer}},
            "layer_worst_peak_prediction_error": max((abs(r["peak_ratio"] - 1) for r in layer
                                                      if r.get("peak_ratio")), default=None),
        }

    if args.layer_tokens:
        layer += layer_rows(args, args.shape)
        save()
    if args.skip_core:
        s = summary()
        print(f"\n## summary\n  layer_largest_tokens: {s['layer_largest_tokens']}\n"
              f"  layer_worst_peak_prediction_error: {s['layer_worst_peak_prediction_error']}")
        print(f"wrote {save()}")
        bad = s["layer_worst_peak_prediction_error"]
        return 0 if bad is not None and bad <= 0.10 and all(r["status"] == "ok" for r in layer) else 1
    active = {i.key for i in impls}
    L = args.start
    while active and L <= args.max:
        p = bm.make_problem(weights, L, E, K, args.seed + L)
        flops = bc.moe_flops(L, d, h, K)
        for impl in impls:
            if impl.key not in active:
                continue
            fields, ok_ = _measure(impl, p, flops, args, baselines)
            row = {"shape": args.shape, "d": d, "h": h, "E": E, "K": K, "tokens": L, "impl": impl.key,
                   "flops": flops, **fields}
            rows.append(row)
            common.print_table([row], TABLE)
            if not ok_:
                active.discard(impl.key)
        del p
        bm._cleanup()
        save()
        L *= 2

    # chunked vs unchunked at compare-tokens
    Lc = args.compare_tokens
    p = bm.make_problem(weights, Lc, E, K, args.seed + 7)
    flops = bc.moe_flops(Lc, d, h, K)
    for policy in ("ab", "none"):
        base = None
        for c in [1] + [int(v) for v in args.compare_chunks.split(",") if v]:
            impl = PlannedBlaze(bc, chunks=c, checkpoint=policy)
            fields, ok_ = _measure(impl, p, flops, args, baselines)
            row = {"shape": args.shape, "tokens": Lc, "impl": impl.key, "checkpoint": policy, "chunks": c, **fields}
            if ok_ and c == 1:
                base = row["fwd_bwd_ms"]
            row["throughput_vs_unchunked"] = (base / row["fwd_bwd_ms"]) if ok_ and base else None
            compare.append(row)
            common.print_table([row], TABLE + [("vs c=1", "throughput_vs_unchunked", ".3f")])
    del p
    gc.collect()
    path = save()
    s = summary()
    print("\n## summary")
    for k, v in s.items():
        print(f"  {k}: {v}")
    print(f"wrote {path}")
    fails = []
    if s["worst_peak_prediction_error"] is None or s["worst_peak_prediction_error"] > 0.10:
        fails.append("predicted peak not within 10% of measured on every row")
    if not s["largest_ratio_vs_grouped_mm"] or s["largest_ratio_vs_grouped_mm"] < 8:
        fails.append("largest L < 8x grouped_mm's")
    if not s["ran_2M"]:
        fails.append("2M tokens did not run")
    if s["worst_chunked_throughput_vs_unchunked"] is None or s["worst_chunked_throughput_vs_unchunked"] < 0.90:
        fails.append("chunked throughput more than 10% below unchunked")
    for f in fails:
        print(f"FAIL: {f}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
