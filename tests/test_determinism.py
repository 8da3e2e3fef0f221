"""Run-to-run determinism: the same inputs give the same bits, for every op and every output.

Each case runs the op three times: on the current stream; on a new non-blocking stream with other blocks of
the memory pool held (so outputs and workspaces land at other addresses, over other garbage); and once
more on the current stream. The GPU cases (marked ``gpu``) use sizes where several CTAs share an expert
(and, under all_to_one routing, one expert takes every token), on both expert-GEMM paths of Hopper (the
sm_90a wgmma kernels and ``BLAZECORE_SM90=0``'s mma.sync kernels). The CPU cases check the same on the
reference path.
"""

from __future__ import annotations

import contextlib
import inspect
import math

import numpy as np
import pytest
from conftest import make_routing, to_backend, to_numpy

import blazecore
from blazecore import BF16, moe
from blazecore import router as rt

DTYPES = {"f32": np.dtype(np.float32), "bf16": BF16}
ROUTINGS = ("uniform", "zipf", "all_to_one")
GRAD_KEYS = ("dx", "dw13", "dw2", "dgates", "db13", "db2")
_FWD_PARAMS = inspect.signature(moe.moe_forward).parameters
HAS_CHUNKS = "chunks" in _FWD_PARAMS
# small token blocks so that chunks=3 runs three chunks at these L (chunk boundaries are multiples of it)
BLOCK_TOKENS = {"cpu": 16, "gpu": 256} if "block_tokens" in _FWD_PARAMS else {}
RUNS = 3

# (L, d, h, E, K): odd L, L*K not a tile multiple; on the GPU about 375 slots per expert (3 m-tiles), all 1500
# on one expert under all_to_one
SIZES = {"cpu": (97, 24, 16, 8, 2), "gpu": (1500, 192, 96, 16, 4)}


def _bits(a) -> bytes:
    return b"" if a is None else np.ascontiguousarray(to_numpy(a)).tobytes()


BACKENDS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]
# the layer on the GPU: both Hopper expert-GEMM paths (wgmma kernels by default; BLAZECORE_SM90=0 selects the
# mma.sync kernels, which other GPUs always run)
LAYER_WHERE = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu, id="gpu-sm90"),
               pytest.param("gpu-mma", marks=pytest.mark.gpu, id="gpu-mma")]


@contextlib.contextmanager
def _run_context(backend: str, i: int):
    """Run i: None (the current stream) for runs 0 and 2; run 1 on a new stream with pool blocks held."""
    if backend == "cpu" or i != 1:
        yield None
        return
    import cupy

    cupy.cuda.Device().synchronize()  # inputs were uploaded on the default stream
    held = [cupy.full((n,), 0x7FC0FFFF, dtype=cupy.uint32) for n in (1000, 3 << 15, 5 << 18)]
    s = cupy.cuda.Stream(non_blocking=True)
    try:
        with s:  # also current, so the read-backs (.get()) are ordered after the ops on s
            yield s
        s.synchronize()
    finally:
        del held


def _assert_runs_equal(runs: list[dict], what: str) -> None:
    first = runs[0]
    for i, r in enumerate(runs[1:], 1):
        for key in first:
            assert r[key] == first[key], f"{what}: {key} of run {i} differs from run 0"


def _layer_inputs(backend, routing, dname, seed):
    L, d, h, E, K = SIZES[backend]
    dt = DTYPES[dname]
    rng = np.random.default_rng(seed)
    g = rng.random((L, K)) + 0.05
    inp = {
        "x": rng.standard_normal((L, d)).astype(dt),
        "w13": (rng.standard_normal((E, 2 * h, d)) / math.sqrt(d)).astype(dt),
        "w2": (rng.standard_normal((E, d, h)) / math.sqrt(h)).astype(dt),
        "b13": (0.1 * rng.standard_normal((E, 2 * h))).astype(dt),
        "b2": (0.1 * rng.standard_normal((E, d))).astype(dt),
        "gates": (g / g.sum(axis=1, keepdims=True)).astype(np.float32),
        "ids": make_routing(rng, L, E, K, routing),
        "dy": rng.standard_normal((L, d)).astype(dt),
    }
    return {k: to_backend(v, backend) for k, v in inp.items()}


def _layer_once(dev, checkpoint, chunks, stream, backend):
    kw = {"chunks": chunks} if HAS_CHUNKS else {}
    if backend in BLOCK_TOKENS:
        kw["block_tokens"] = BLOCK_TOKENS[backend]
    y, saved = moe.moe_forward(dev["x"], dev["w13"], dev["w2"], dev["gates"], dev["ids"], checkpoint=checkpoint,
                               b13=dev["b13"], b2=dev["b2"], stream=stream, **kw)
    out = {"y": _bits(y), "ab": _bits(saved.ab)}
    # the dispatch, or (a chunked GPU forward) the dispatch of each chunk
    disps = [saved.dispatch] if saved.dispatch is not None else list(getattr(saved, "chunk_dispatches", ()))
    for i, dp in enumerate(disps):
        for f in ("expert_offsets", "slot_token", "slot_k", "pair_slot"):
            out[f"{f} {i}"] = _bits(getattr(dp, f))
    g = moe.moe_backward(dev["dy"], saved, stream=stream, retain=True)
    g2 = moe.moe_backward(dev["dy"], saved, stream=stream)  # the default backward may reuse ``ab`` as scratch
    for key in GRAD_KEYS:
        out[key] = _bits(getattr(g, key))
        out[key + " (second backward)"] = _bits(getattr(g2, key))
    return out


def _chunk_params():
    return [1, 3] if HAS_CHUNKS else [1]


@pytest.mark.parametrize("chunks", _chunk_params(), ids=lambda c: f"chunks{c}")
@pytest.mark.parametrize("checkpoint", moe.CHECKPOINTS)
@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("where", LAYER_WHERE)
def test_layer_is_deterministic(where, routing, dname, checkpoint, chunks, monkeypatch):
    if where == "gpu-mma":
        monkeypatch.setenv("BLAZECORE_SM90", "0")
    backend = "cpu" if where == "cpu" else "gpu"
    dev = _layer_inputs(backend, routing, dname, seed=len(routing) * 31 + len(dname))
    runs = []
    for i in range(RUNS):
        with _run_context(backend, i) as s:
            runs.append(_layer_once(dev, checkpoint, chunks, s, backend))
    _assert_runs_equal(runs, f"layer {routing} {dname} {checkpoint}")
    for key in GRAD_KEYS:
        assert runs[0][key] == runs[0][key + " (second backward)"], f"{key}: a second backward differs"


@pytest.mark.parametrize("dname", ["f32", "bf16"])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_router_is_deterministic(backend, routing, dname):
    L, E, K = (313, 16, 3) if backend == "cpu" else (5003, 64, 6)
    rng = np.random.default_rng(len(routing))
    x = rng.standard_normal((L, E))
    if routing == "zipf":
        x += -1.5 * np.log1p(rng.permutation(E))[None, :]
    elif routing == "all_to_one":
        x[:, 5] += 6.0
    xb = to_backend(x.astype(np.float32).astype(DTYPES[dname]), backend)
    bias = to_backend((0.05 * rng.standard_normal(E)).astype(np.float32), backend)
    dg = to_backend(rng.standard_normal((L, K)).astype(np.float32), backend)
    runs = []
    for i in range(RUNS):
        with _run_context(backend, i) as s:
            r = {}
            for score in ("softmax", "sigmoid"):
                gates, ids = rt.route_topk(xb, K, score=score, expert_bias=bias, stream=s)
                r[f"{score} gates"], r[f"{score} ids"] = _bits(gates), _bits(ids)
                r[f"{score} dlogits"] = _bits(rt.route_topk_backward(dg, xb, ids, score=score, stream=s))
            r["lb"] = _bits(rt.load_balancing_loss(xb, ids, stream=s))
            r["z"] = _bits(rt.router_z_loss(xb, stream=s))
            r["dlb"] = _bits(rt.load_balancing_loss_backward(float(L), xb, ids, stream=s))
            r["dz"] = _bits(rt.router_z_loss_backward(float(L), xb, stream=s))
            runs.append(r)
    _assert_runs_equal(runs, f"router {routing} {dname}")


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_dispatch_is_deterministic(backend, routing, id_dtype):
    # GPU: 400k pairs, 4096-pair tiles, the three-launch (scanned) build
    L, E, K = (3001, 32, 4) if backend == "cpu" else (50_001, 128, 8)
    ids = to_backend(make_routing(np.random.default_rng(3), L, E, K, routing, dtype=id_dtype), backend)
    runs = []
    for i in range(RUNS):
        with _run_context(backend, i) as s:
            d = blazecore.build_dispatch(ids, E, validate=i != 2, stream=s)
            runs.append({f: _bits(getattr(d, f)) for f in ("expert_offsets", "slot_token", "slot_k", "pair_slot")})
    _assert_runs_equal(runs, f"dispatch {routing}")
