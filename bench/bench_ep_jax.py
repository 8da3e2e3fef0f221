"""Benchmark of JAX expert parallelism: ``blazecore_jax.parallel.ep_moe_layer`` over every local GPU against the
single-device ``blazecore_jax.moe_layer``.

For a shape (d, h, E, K) and a token count per GPU L, in bf16 with the router's own top-k routing of random tokens,
one jitted function returns the loss sum(y * dy) and its gradients with respect to x and every parameter:

* ep: ``ep_moe_layer`` on a 1-D ("ep",) mesh of the N local GPUs, N * L tokens split over them, the experts split
  E / N a GPU, the router replicated, with each exchange of --exchanges ("padded": ``all_to_all`` of L * K rows
  per destination; "ragged": ``ragged_all_to_all`` of the rows routed; "gather", the layer's default: every
  device's tokens all-gathered, the local experts' partial sums returned by ``all_to_all``);
* one: ``moe_layer`` on GPU 0 with L tokens, the rate every GPU of the ep run would have without an exchange.

Each call is timed on the wall clock up to ``block_until_ready``, the two alternating after warm-up calls; a
figure is the median of the repeats. per_gpu_rate = (one's ms) / (ep's ms): the share of the one-GPU rate that
each GPU keeps with the exchange (tokens per GPU are the same on both sides).

A device's exchange buffer is static (buffer_rows_per_gpu: N * L * K pairs for "padded" and "ragged", the worst
case; the N * L all-gathered tokens for "gather"); the JSON records the pairs the routing actually sends
(routed_rows_per_gpu: the largest GPU's received pairs, from the routing's counts) beside it.

    python bench/bench_ep_jax.py [--shape olmoe] [--tokens 8k,32k] [--exchanges padded,gather] [--repeats 10]

Writes ep_jax_x<N>_<gpu>.json to bench/results/ (or --results-dir); without a GPU it prints that and exits 0.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

try:
    from . import _common as common
except ImportError:  # run as a script: bench/ is the script's directory, first on sys.path
    import _common as common

SHAPES = {  # name: (d, h, E, K)
    "olmoe": (2048, 1024, 64, 8),
    "qwen3": (2048, 768, 128, 8),
}


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="olmoe", help=f"one of {', '.join(SHAPES)} or several, comma-separated")
    ap.add_argument("--tokens", default="8k,32k", help="tokens per GPU, comma-separated (k = 1024)")
    ap.add_argument("--exchanges", default="padded,gather", help="ep_moe_layer's exchange values, comma-separated")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--results-dir", type=pathlib.Path, default=None)
    return ap.parse_args(argv)


def _time(fn, *args) -> float:
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) * 1e3


def run_row(shape: str, L: int, exchange: str, warmup: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from blazecore_jax import moe_layer
    from blazecore_jax.parallel import ep_moe_layer, ep_param_specs
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    d, h, E, K = SHAPES[shape]
    devs = jax.devices()
    n = len(devs)
    rng = np.random.default_rng(0)
    bf = jnp.bfloat16
    params = {"router": rng.standard_normal((E, d)) * d ** -0.5,
              "gate_up_proj": rng.standard_normal((E, 2 * h, d)) * d ** -0.5,
              "down_proj": rng.standard_normal((E, d, h)) * h ** -0.5}
    x = rng.standard_normal((n * L, d))
    dy = rng.standard_normal((n * L, d))
    mesh = Mesh(np.array(devs), ("ep",))
    specs = ep_param_specs("ep")
    p_ep = {k: jax.device_put(jnp.asarray(v, bf), NamedSharding(mesh, specs[k])) for k, v in params.items()}
    x_ep = jax.device_put(jnp.asarray(x, bf), NamedSharding(mesh, P("ep")))
    dy_ep = jax.device_put(jnp.asarray(dy, bf), NamedSharding(mesh, P("ep")))
    p_one = {k: jax.device_put(jnp.asarray(v, bf), devs[0]) for k, v in params.items()}
    x_one = jax.device_put(jnp.asarray(x[:L], bf), devs[0])
    dy_one = jax.device_put(jnp.asarray(dy[:L], bf), devs[0])

    def loss_ep(p, t, g):
        y, _ = ep_moe_layer(p, t, mesh=mesh, top_k=K, exchange=exchange)
        return jnp.sum(y.astype(jnp.float32) * g.astype(jnp.float32))

    def loss_one(p, t, g):
        y, _ = moe_layer(p, t, top_k=K)
        return jnp.sum(y.astype(jnp.float32) * g.astype(jnp.float32))

    f_ep = jax.jit(jax.value_and_grad(loss_ep, argnums=(0, 1)))
    f_one = jax.jit(jax.value_and_grad(loss_one, argnums=(0, 1)))
    for _ in range(warmup):
        _time(f_ep, p_ep, x_ep, dy_ep)
        _time(f_one, p_one, x_one, dy_one)
    t_ep, t_one = [], []
    for _ in range(repeats):
        t_ep.append(_time(f_ep, p_ep, x_ep, dy_ep))
        t_one.append(_time(f_one, p_one, x_one, dy_one))
    # the pairs each GPU's experts receive under this routing (the router's top-k of the same logits, on the host)
    xb, rb = (np.asarray(jnp.asarray(a, bf).astype(jnp.float32)) for a in (x, params["router"]))
    logits = xb @ rb.T
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :K]
    received = np.bincount(ids.reshape(-1) // (E // n), minlength=n)
    ep_ms, one_ms = statistics.median(t_ep), statistics.median(t_one)
    return {"shape": shape, "d": d, "h": h, "E": E, "K": K, "gpus": n, "tokens_per_gpu": L, "exchange": exchange,
            "ep_ms": ep_ms,
            "one_ms": one_ms, "per_gpu_rate": one_ms / ep_ms, "buffer_rows_per_gpu": buffer_rows(exchange, n, L, K),
            "routed_rows_per_gpu": int(received.max()), "ep_ms_all": t_ep, "one_ms_all": t_one}


def buffer_rows(exchange: str, gpus: int, tokens_per_gpu: int, K: int) -> int:
    """The rows of a GPU's static exchange buffer: N * L * K pairs received for "padded" and "ragged", the N * L
    all-gathered tokens (and the (N, L, d) partial sums sent back) for "gather"."""
    return gpus * tokens_per_gpu * (1 if exchange == "gather" else K)


def main(argv=None) -> int:
    args = _args(argv)
    ok, why = common.cuda_gpu_available()
    if not ok:
        print(f"bench_ep_jax: {why}; nothing to time")
        return 0
    import jax

    header = common.gpu_header(0)
    header.update(bench="ep_jax", jax=jax.__version__, gpus=len(jax.devices()),
                  method="wall clock to block_until_ready of one jitted value_and_grad (x and every parameter), "
                         "ep and one-GPU calls alternating after warm-up; medians")
    common.print_header(header)
    rows, n_gpus = [], len(jax.devices())
    for shape in args.shape.split(","):
        for tok in args.tokens.split(","):
            for exchange in args.exchanges.split(","):
                row = run_row(shape, common.parse_count(tok), exchange, args.warmup, args.repeats)
                rows.append(row)
                print(f"{shape} L={row['tokens_per_gpu']} gpus={row['gpus']} {exchange}: ep {row['ep_ms']:.2f} ms, "
                      f"one GPU {row['one_ms']:.2f} ms, per-GPU rate {row['per_gpu_rate']:.2f}; rows computed at "
                      f"most {row['routed_rows_per_gpu']} of a {row['buffer_rows_per_gpu']}-row buffer", flush=True)
                path = common.write_json(f"ep_jax_x{n_gpus}", header, rows, args.results_dir)  # after every row
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
