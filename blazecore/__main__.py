"""``python -m blazecore [command]``: the command-line entry point (also the ``blazecore`` script).

Commands:
    demo (the default)  build the dispatch of a random top-k routing with blazecore and with a
                        sort-based build, check that they agree, print what was built and the times.
                        GPU: blazecore's kernels against torch (or CuPy) sort; CPU: the NumPy reference
                        against a NumPy argsort.

A command is a subparser plus a ``_cmd_<name>(args) -> int`` function registered in ``_COMMANDS``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

# ---------------------------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------------------------


def _random_routing(num_tokens: int, num_experts: int, top_k: int, seed: int) -> np.ndarray:
    """(L, K) int32: K distinct experts per token, uniform (top-k of random scores, in row chunks)."""
    rng = np.random.default_rng(seed)
    out = np.empty((num_tokens, top_k), dtype=np.int32)
    step = max(1, (1 << 22) // num_experts)
    for r0 in range(0, num_tokens, step):
        scores = rng.random((min(step, num_tokens - r0), num_experts), dtype=np.float32)
        out[r0 : r0 + step] = np.argpartition(-scores, top_k - 1, axis=1)[:, :top_k]
    return out


def _sort_build(xp, ids, num_experts: int):
    """The conventional build in NumPy or CuPy: stable argsort, bincount, cumsum, inverse permutation."""
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = xp.argsort(flat, kind="stable")
    offsets = xp.zeros(num_experts + 1, dtype=xp.int32)
    offsets[1:] = xp.cumsum(xp.bincount(flat, minlength=num_experts))
    pair_slot = xp.empty(flat.size, dtype=xp.int32)
    pair_slot[order] = xp.arange(flat.size, dtype=xp.int32)
    return (offsets, (order // top_k).astype(xp.int32), (order % top_k).astype(xp.int32),
            pair_slot.reshape(num_tokens, top_k))


def _torch_sort_build(torch, ids, num_experts: int):
    """The conventional build in PyTorch: torch.sort(stable), bincount, cumsum, scatter."""
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    _, order = torch.sort(flat, stable=True)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    offsets[1:] = torch.cumsum(torch.bincount(flat, minlength=num_experts), 0)
    pair_slot = torch.empty(flat.numel(), dtype=torch.int32, device=flat.device)
    pair_slot[order] = torch.arange(flat.numel(), dtype=torch.int32, device=flat.device)
    return (offsets, torch.div(order, top_k, rounding_mode="floor").to(torch.int32),
            (order % top_k).to(torch.int32), pair_slot.view(num_tokens, top_k))


def _gpu_name() -> str | None:
    """The current CUDA device's name, or None where CuPy or a GPU is missing."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return None


def _median_ms_cpu(fn, repeats: int) -> float:
    fn()
    ms = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ms)


def _median_ms_gpu(fn, repeats: int) -> float:
    """CUDA events on the current stream around each call (host overhead included), after a warm-up."""
    import cupy

    fn()
    cupy.cuda.Device().synchronize()
    ms = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        ms.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(ms)


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _print_dispatch(d, ids: np.ndarray, host: tuple) -> None:
    offsets, slot_token, slot_k, pair_slot = host
    counts = np.diff(offsets)
    print(f"built {slot_token.size} slots; pairs per expert: min {counts.min()}, mean {counts.mean():.1f}, "
          f"max {counts.max()}; {int((counts == 0).sum())} empty expert(s)")
    print(f"{d!r}")
    for e in sorted({0, d.num_experts - 1}):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        first = " ".join(f"({int(t)},{int(k)})" for t, k in zip(slot_token[lo : lo + 6], slot_k[lo : lo + 6],
                                                               strict=True))
        print(f"expert {e}: slots [{lo}, {hi}); first (token, k): {first}{' ...' if hi - lo > 6 else ''}")
    print(f"token 0 picks experts {ids[0].tolist()} -> slots {pair_slot[0].tolist()}")


def _cmd_demo(args) -> int:
    from . import dispatch as D

    L, E, K = args.tokens, args.experts, args.top_k
    D.check_sizes(L, K, E)
    if L < 1 or K < 1:
        raise SystemExit("demo: --tokens and --top-k must be >= 1")
    gpu = _gpu_name() if args.device in ("auto", "gpu") else None
    if args.device == "gpu" and gpu is None:
        raise SystemExit("demo: --device gpu, but no CUDA GPU is usable (cupy with a GPU is needed)")
    print(f"blazecore dispatch demo: L={L} tokens, E={E} experts, top-{K} (uniform random routing, seed {args.seed})")
    ids = _random_routing(L, E, K, args.seed)

    if gpu is None:
        args.repeats = args.repeats or 3
        print("device: CPU (no CUDA GPU found): blazecore runs its NumPy reference (three phases, token "
              "tiles; written to be read, not to be fast); the conventional build is a NumPy stable argsort")
        d = D.build_dispatch(ids, E)
        conv = _sort_build(np, ids, E)
        ours = (d.expert_offsets, d.slot_token, d.slot_k, d.pair_slot)
        t_ours = _median_ms_cpu(lambda: D.build_dispatch(ids, E, validate=False), args.repeats)
        t_check = _median_ms_cpu(lambda: D.build_dispatch(ids, E), args.repeats)
        t_conv = _median_ms_cpu(lambda: _sort_build(np, ids, E), args.repeats)
        conv_name = "NumPy argsort"
        timer = "wall clock"
    else:
        import cupy

        args.repeats = args.repeats or 20
        torch = _torch_cuda()
        ids_gpu = cupy.asarray(ids)
        d = D.build_dispatch(ids_gpu, E)
        if torch is not None:
            ids_t = torch.from_dlpack(ids_gpu)
            conv_name = "torch.sort"

            def conv_fn():
                return _torch_sort_build(torch, ids_t, E)
        else:
            conv_name = "cupy.argsort"

            def conv_fn():
                return _sort_build(cupy, ids_gpu, E)

        print(f"device: {gpu} (CUDA kernels); the conventional build uses {conv_name}")
        conv = tuple(cupy.asnumpy(cupy.from_dlpack(a)) for a in conv_fn())
        ours = tuple(cupy.asnumpy(a) for a in (d.expert_offsets, d.slot_token, d.slot_k, d.pair_slot))
        t_ours = _median_ms_gpu(lambda: D.build_dispatch(ids_gpu, E, validate=False), args.repeats)
        t_check = _median_ms_gpu(lambda: D.build_dispatch(ids_gpu, E), args.repeats)
        t_conv = _median_ms_gpu(conv_fn, args.repeats)
        timer = "CUDA events"

    names = ("expert_offsets", "slot_token", "slot_k", "pair_slot")
    differ = [n for n, a, b in zip(names, ours, conv, strict=True) if not np.array_equal(np.asarray(a), np.asarray(b))]
    _print_dispatch(d, ids, tuple(np.asarray(a) for a in ours))
    if differ:
        print(f"DISAGREES with the {conv_name} build in: {', '.join(differ)}")
    else:
        print(f"agrees with the {conv_name} build: all four arrays identical")
    print(f"time per build ({timer}, median of {args.repeats}): blazecore {t_ours:.3f} ms "
          f"({t_check:.3f} ms with the value check), {conv_name} build {t_conv:.3f} ms "
          f"-> {t_conv / t_ours:.1f}x")
    return 1 if differ else 0


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------

_COMMANDS = {"demo": _cmd_demo}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blazecore", description="blazecore: memory-efficient MoE training kernels")
    sub = parser.add_subparsers(dest="command", metavar="command")
    demo = sub.add_parser("demo", help="dispatch demo: blazecore vs a sort-based build on a random routing (default)")
    demo.add_argument("--tokens", type=int, default=65536, help="L, tokens (default 65536)")
    demo.add_argument("--experts", type=int, default=64, help="E, experts (default 64)")
    demo.add_argument("--top-k", type=int, default=8, help="K, experts per token (default 8)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--repeats", type=int, default=None, help="timed builds per method (median; 3 on CPU, 20 on GPU)")
    demo.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv.insert(0, "demo")  # no command: the demo, with any options given
    args = _parser().parse_args(argv)
    return _COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
