"""Expert parallelism, weak scaling: tokens/s and peak memory per GPU of ExpertParallelMoELayer on 1..N GPUs.

Every GPU holds the same number of tokens (--tokens-per-gpu) and E / N experts; one step is the layer's forward
and backward (router, count exchange, all-to-all of rows and gates, local experts on blazecore's kernels,
return, combine; the input's gradient included), bf16. Each world size reports the median step time (CUDA
events, the slowest rank's median), the global tokens/s (N * tokens per GPU / step time), the per-GPU rate,
and every rank's peak allocated bytes (torch's allocator counts blazecore's buffers). With one GPU there is no
exchange; more rows run the all-to-all path against the group of one (``always_exchange``) to show what the
exchange machinery costs.
``--exchanges`` (default ``tokens,pairs``): a row per exchange of the layer, each token sent once to every rank that
holds one of its experts, or one row per (token, expert) pair; each row records the rows sent a token.

``--impls`` (default ``blazecore,grouped_mm``): the same layer, router and exchange with the local experts run by
blazecore's ``moe_ffn`` or by the ``torch._grouped_mm`` MoE of the baselines (``blazecore_app.baselines.
grouped_mm_moe``: sort, gathered copy, two grouped GEMMs, index_add_ combine; skipped where torch._grouped_mm cannot
run). On CUDA each row also has the time a step spends in NCCL's kernels (the count and row exchanges, forward and
backward, waits for the other ranks included), from the PyTorch profiler over ``--profile-steps`` steps, per rank and
as a share of the step.

Launch: the driver starts ``torchrun`` once per world size and merges the rows into
bench/results/ep_<gpu>.json:

    python bench/bench_ep.py --gpus 1,2,4,8 [--shape olmoe] [--tokens-per-gpu 16k] [--name ep_olmoe]

or run one world size under torchrun yourself (rank 0 writes bench/results/ep_w<N>_<gpu>.json):

    torchrun --nproc_per_node 8 bench/bench_ep.py --shape olmoe --tokens-per-gpu 16k

The driver sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 in the
launcher's environment (NVLink multicast stays off); a direct torchrun launch should set them too.
--device cpu runs a CPU smoke test over gloo (float32, the reference path, no timing worth reading).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

try:
    from . import _common as common
except ImportError:  # run as a script (torchrun bench/bench_ep.py): Python puts bench/ on the path
    import _common as common

SHAPES = {"olmoe": (2048, 1024, 64, 8), "qwen3": (2048, 768, 128, 8), "mixtral": (4096, 14336, 8, 2),
          "fine": (1536, 256, 128, 8), "tiny": (64, 32, 8, 2)}
IMPLS = ("blazecore", "grouped_mm")
EXCHANGES = ("tokens", "pairs")  # blazecore_torch.parallel.EXCHANGES (not imported: the driver needs no torch)
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="olmoe", choices=sorted(SHAPES))
    ap.add_argument("--tokens-per-gpu", default="16k", help="tokens on every GPU (weak scaling), e.g. 8k, 16k")
    ap.add_argument("--gpus", default=None,
                    help="driver: comma-separated world sizes to launch with torchrun (default 1,2,4,.. up to the "
                         "GPU count); ignored under torchrun")
    ap.add_argument("--checkpoint", default="ab", choices=("ab", "none"))
    ap.add_argument("--impls", default="blazecore,grouped_mm",
                    help="the local experts: blazecore (moe_ffn), grouped_mm (the torch._grouped_mm MoE)")
    ap.add_argument("--exchanges", default="tokens,pairs",
                    help="the layer's exchanges to run: tokens (each token once to every rank that holds one of its "
                         "experts), pairs (one row per (token, expert) pair)")
    ap.add_argument("--profile-steps", type=int, default=3, help="steps profiled for the NCCL share (CUDA; 0: none)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--results-dir", default=None, help="default bench/results")
    ap.add_argument("--name", default="ep", help="driver: the JSON's name, NAME_<gpu>.json")
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)  # the driver's per-world-size row file
    return ap


# ---------------------------------------------------------------------------------------------
# One world size (a torchrun worker)
# ---------------------------------------------------------------------------------------------


def _measure(layer, x, dy, args, torch, dist, cuda: bool) -> dict:
    """Median fwd+bwd step time (ms) of this rank, its peak allocated bytes during the steps and (CUDA, with
    --profile-steps) the ms a step its NCCL kernels take."""

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y, _ = layer(x)
        y.backward(dy)

    def setup():
        if cuda:
            torch.cuda.reset_peak_memory_stats()

    t = common.time_call(step, warmup=args.warmup, repeats=args.repeats, clock="torch" if cuda else "wall",
                         setup=setup)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return {"median_ms": t.median_ms, "spread_ms": t.spread_ms, "peak_bytes": peak,
            "nccl_ms": _nccl_ms(step, args.profile_steps, torch) if cuda and args.profile_steps > 0 else None}


def _nccl_ms(step, steps: int, torch) -> float:
    """ms a step of the NCCL kernels (names starting with "nccl") over ``steps`` steps under the PyTorch profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    us = sum(e.device_time_total for e in prof.key_averages() if e.key.lower().startswith("nccl"))
    return us * 1e-3 / steps


def _grouped_mm_experts(experts, baselines):
    """A replacement for ``LocalExperts.forward``: the same call on the torch._grouped_mm MoE of the baselines."""

    def forward(x, gates, expert_ids, dispatch, *, activation, checkpoint, chunks=1, retain_saved=False):
        return baselines.grouped_mm_moe(x, experts.gate_up_proj, experts.down_proj, gates, expert_ids,
                                        activation=activation)

    return forward


def _rows(layer, x, dy, args, torch, dist, cuda, device, impl, modes, world, L, dims, dtype) -> list[dict]:
    """One row per mode of ``impl`` (None: no exchange, one GPU; else the layer's ``exchange``): every rank's
    figures gathered to each rank."""
    d, h, E, K = dims
    rows = []
    for mode in modes:
        exchange = mode is not None
        layer.always_exchange = exchange and world == 1
        if exchange:
            layer.exchange = mode
        m = _measure(layer, x, dy, args, torch, dist, cuda)
        nccl = -1.0 if m["nccl_ms"] is None else m["nccl_ms"]
        mine = torch.tensor([m["median_ms"], m["spread_ms"], float(m["peak_bytes"] or 0), nccl,
                             float(layer.last_rows_sent)], dtype=torch.float64, device=device)
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        every = [t.tolist() for t in every]
        slowest = max(e[0] for e in every)
        nccl_by_rank = [e[3] for e in every] if every[0][3] >= 0 else None
        rows.append({
            "shape": args.shape, "impl": impl, "d": d, "h": h, "E": E, "K": K, "gpus": world,
            "experts_per_gpu": E // world, "tokens_per_gpu": L, "global_tokens": L * world, "exchange": exchange,
            "exchange_mode": mode, "input_grad": True,
            "rows_sent_per_token": sum(e[4] for e in every) / (L * world) if exchange else None,
            "dtype": str(dtype)[6:], "checkpoint": args.checkpoint if impl == "blazecore" else None,
            "step_ms": slowest, "step_ms_by_rank": [e[0] for e in every],
            "spread_ms_by_rank": [e[1] for e in every],
            "tokens_per_s": L * world / (slowest * 1e-3), "tokens_per_s_per_gpu": L / (slowest * 1e-3),
            "peak_bytes_per_gpu": max(e[2] for e in every) if cuda else None,
            "peak_bytes_by_rank": [int(e[2]) for e in every] if cuda else None,
            "nccl_ms_by_rank": nccl_by_rank,
            "nccl_share": None if nccl_by_rank is None else max(n / e[0] for n, e in zip(nccl_by_rank, every,
                                                                                          strict=True)),
        })
    return rows


def worker(args) -> int:
    import torch
    import torch.distributed as dist
    from blazecore_torch.parallel import ExpertParallelMoELayer

    cuda = args.device == "cuda"
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if "MASTER_ADDR" not in os.environ:  # a plain single-process run
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"})
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)
    if cuda:
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", local))
        device, dtype = torch.device("cuda", local), torch.bfloat16
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        device, dtype = torch.device("cpu"), torch.float32
    try:
        d, h, E, K = SHAPES[args.shape]
        L = common.parse_count(args.tokens_per_gpu)
        if E % world:
            raise SystemExit(f"{args.shape}: E = {E} experts do not split over {world} GPUs")
        torch.manual_seed(0)  # the router alike on every rank
        layer = ExpertParallelMoELayer(d, h, E, K, checkpoint=args.checkpoint, device=device, dtype=dtype)
        g = torch.Generator(device=device).manual_seed(1 + rank)  # each rank its own tokens and experts
        with torch.no_grad():
            for p in layer.experts.parameters():
                p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32).to(dtype)
                        * p.shape[-1] ** -0.5)
        # x requires its gradient, as a layer's input in a model does (the exchange's backward runs in full)
        x = torch.randn(L, d, generator=g, device=device, dtype=torch.float32).to(dtype).requires_grad_(True)
        dy = torch.randn(L, d, generator=g, device=device, dtype=torch.float32).to(dtype)
        exchanges = [v for v in args.exchanges.split(",") if v]
        modes = ([None] if world == 1 else []) + exchanges
        rows = []
        for impl in [v for v in args.impls.split(",") if v]:
            if impl == "grouped_mm":
                from blazecore_app import baselines

                why = baselines.grouped_mm_unsupported(x, layer.experts.gate_up_proj, layer.experts.down_proj)
                if why is not None:
                    if rank == 0:
                        print(f"# grouped_mm skipped: {why}", flush=True)
                    continue
                layer.experts.forward = _grouped_mm_experts(layer.experts, baselines)
            try:
                rows += _rows(layer, x, dy, args, torch, dist, cuda, device, impl, modes, world, L, (d, h, E, K),
                              dtype)
            finally:
                layer.experts.__dict__.pop("forward", None)  # the class's forward again
        if rank == 0:
            header = common.gpu_header(local) if cuda else common.cpu_header()
            header["world_size"] = world
            header.update({k: os.environ.get(k) for k in NCCL_ENV})
            if args.out:
                pathlib.Path(args.out).write_text(json.dumps({"header": header, "rows": rows}))
            else:
                results = pathlib.Path(args.results_dir) if args.results_dir else None
                print(f"wrote {common.write_json(f'ep_w{world}', header, rows, results)}")
            _print(rows)
    finally:
        try:  # every rank done with its collectives before the group goes (gloo aborts a rank torn down mid-flight)
            dist.barrier()
        finally:
            dist.destroy_process_group()
    return 0


def _print(rows) -> None:
    def peak(r):
        return None if r["peak_bytes_per_gpu"] is None else r["peak_bytes_per_gpu"] / 2**30

    common.print_table(rows, [("impl", "impl", None), ("gpus", "gpus", "d"),
                              ("tokens/gpu", lambda r: common.format_count(r["tokens_per_gpu"]), None),
                              ("exchange", lambda r: r.get("exchange_mode") or "no", None),
                              ("rows/token", "rows_sent_per_token", ".2f"),
                              ("step ms", "step_ms", ".2f"), ("tokens/s", "tokens_per_s", ",.0f"),
                              ("tokens/s/gpu", "tokens_per_s_per_gpu", ",.0f"), ("peak GiB/gpu", peak, ".2f"),
                              ("NCCL share", "nccl_share", ".3f")])


# ---------------------------------------------------------------------------------------------
# The driver: one torchrun per world size, rows merged
# ---------------------------------------------------------------------------------------------


def _world_sizes(args) -> list[int]:
    if args.gpus:
        return [int(v) for v in args.gpus.split(",") if v.strip()]
    if args.device == "cpu":
        return [1, 2]
    import torch

    n, sizes = torch.cuda.device_count(), []
    w = 1
    while w <= n:
        sizes.append(w)
        w *= 2
    return sizes or [1]


def driver(args, argv) -> int:
    env = {**os.environ, **NCCL_ENV}
    rows, header = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for world in _world_sizes(args):
            out = pathlib.Path(tmp) / f"w{world}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                   str(pathlib.Path(__file__).resolve()), *argv, "--out", str(out)]
            print(f"# {' '.join(cmd[2:])}", flush=True)
            proc = subprocess.run(cmd, env=env)
            if proc.returncode != 0:
                print(f"# {world} GPU(s) failed (exit {proc.returncode}); continuing", file=sys.stderr)
                continue
            doc = json.loads(out.read_text())
            header = header or doc["header"]
            rows.extend(doc["rows"])
    if header is None:
        print("no world size ran", file=sys.stderr)
        return 1
    header["world_sizes"] = sorted({r["gpus"] for r in rows})
    header["bench"] = "ep"
    header.pop("world_size", None)
    results = pathlib.Path(args.results_dir) if args.results_dir else None
    path = common.write_json(args.name, header, rows, results)
    print(f"wrote {path}")
    _print(rows)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = _parser()
    args = ap.parse_args(argv)
    bad = [v for v in args.impls.split(",") if v and v not in IMPLS]
    if bad or not any(args.impls.split(",")):
        ap.error(f"--impls: expected some of {', '.join(IMPLS)}, got {args.impls!r}")
    bad = [v for v in args.exchanges.split(",") if v and v not in EXCHANGES]
    if bad or not any(args.exchanges.split(",")):
        ap.error(f"--exchanges: expected some of {', '.join(EXCHANGES)}, got {args.exchanges!r}")
    if args.profile_steps < 0:
        ap.error(f"--profile-steps must be >= 0, got {args.profile_steps}")
    if "LOCAL_RANK" in os.environ or args.out:
        return worker(args)
    if args.gpus is None and args.device == "cuda":
        ok, why = common.cuda_gpu_available()
        if not ok:
            print(f"bench_ep: {why}", file=sys.stderr)
            return 1
    return driver(args, argv)


if __name__ == "__main__":
    sys.exit(main())
