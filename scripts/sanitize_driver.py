#!/usr/bin/env python3
"""Every GPU kernel family of blazecore, once each, on small shapes: the program scripts/sanitize.sh runs under
compute-sanitizer (memcheck, racecheck, initcheck, synccheck).

Cases (``--case NAME``, repeatable; default all; ``--list`` names them):
  dispatch  the build in every tile shape and launch mode (one tile / direct sum / scanned), int32 and int64
            ids, K > 32 (the check kernel's shared-memory path), validate on and off, out-of-range and
            repeated ids without validation (the kernels must stay in bounds)
  router    route_topk forward and backward, the auxiliary-loss partials, finalize and backward, for every
            row configuration (E = 7 .. 2048: one warp with 4..32 values per thread, 8 warps), fp32 / fp16 /
            bf16, softmax and sigmoid, with and without a bias, vector and scalar row paths
  moe_sm90  the expert FFN forward + backward with the sm_90a wgmma kernels (bf16, fp16 on Hopper)
  moe_sm90_dh the same (bf16) with dh's epilogue on the producer warpgroup (BLAZECORE_SM90_DHCUR=overlap)
  moe_mma   the same with BLAZECORE_SM90=0 (the mma.sync kernels; fp32 always takes them)
  moe_chunk the layer in 3 token chunks (small block_tokens), both paths
  moe_layouts the layer on "in_out" weights and interleaved gate/up rows (mma.sync kernels)
  moe_layouts_sm90 the same on the sm_90a kernels (bf16), dh' in both epilogue forms
  moe_zsliced checkpoint "none" with h > d (the backward per column slice of h), unchunked and in chunks
  finite    the check_finite reductions (fp32 and the bf16 bit-pattern kernel)

Every case compares its results with the NumPy reference (loosely: the point is the sanitizer's report, but a
wrong result means the run is not representative). Inputs are fully written host copies; outputs and workspaces
are NOT poisoned, so initcheck sees any read of memory a kernel did not write. ``--no-pool`` (sanitize.sh passes
it) turns CuPy's memory pool off: every buffer is its own cudaMalloc, so memcheck catches an access just past a
buffer (inside a pool it would land in a neighbour) and initcheck tracks each buffer from its allocation.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import sys
import time

import numpy as np

import blazecore
from blazecore import BF16, moe
from blazecore import dispatch as D
from blazecore import router as rt
from blazecore.reference import moe as ref_moe
from blazecore.reference import router as ref_rt
from blazecore.testing import make_routing

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def dev(a):
    import cupy

    a = np.ascontiguousarray(a)
    return cupy.asarray(a.view(np.uint16) if a.dtype == BF16 else a)


def host(a, dtype=None):
    h = a.get()
    if dtype is not None and np.dtype(dtype) == BF16:
        h = h.view(BF16)
    return h.astype(np.float64)


def rel_err(got, want) -> float:
    want = np.asarray(want, np.float64)
    n = np.linalg.norm(want)
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / (n if n > 0 else 1.0))


def expect(got, want, tol, what):
    e = rel_err(got, want)
    if not e <= tol:
        raise AssertionError(f"{what}: relative error {e:.3e} > {tol:.0e}")


def routing(rng, L, E, K, skew=0.0, empty=0):
    """(L, K) int32 ids (blazecore.testing.make_routing): some experts empty, skewed, or uniform."""
    return make_routing(rng, L, E, K, "empty_experts" if empty else ("skewed" if skew else "uniform"))


@case
def dispatch():
    import cupy

    rng = np.random.default_rng(0)
    stream = cupy.cuda.get_current_stream()
    shapes = [(1, 1, 1), (37, 3, 5), (2500, 8, 8), (9000, 8, 256), (100, 40, 64), (300, 2, 1024)]
    for L, K, E in shapes:
        for idt in (np.int32, np.int64):
            ids = routing(rng, L, E, K, skew=1.0).astype(idt)
            for validate in (True, False):
                d = blazecore.build_dispatch(dev(ids), E, validate=validate)
                off = d.expert_offsets.get()
                assert np.array_equal(np.diff(off), np.bincount(ids.reshape(-1), minlength=E)), (L, K, E)
            dropped = np.where(rng.random(ids.shape) < 0.25, -1, ids)  # pairs of no expert, listed last
            d = blazecore.build_dispatch(dev(dropped), E)
            off = d.expert_offsets.get()
            assert np.array_equal(np.diff(off), np.bincount(dropped[dropped >= 0], minlength=E)), (L, K, E)
            assert np.array_equal(d.pair_slot.get() < 0, dropped < 0), (L, K, E)
    ids = routing(rng, 1500, 64, 2)
    for tile in D._TILES:
        for mode in (D.MODE_SINGLE_TILE, D.MODE_DIRECT_SUM, D.MODE_SCANNED):
            if mode == D.MODE_SINGLE_TILE and ids.size > tile[0] * tile[1]:
                continue
            d = D._build_gpu(dev(ids), 64, 1500, 2, stream, True, tile, mode)
            assert np.array_equal(d.pair_slot.get().reshape(-1)[np.argsort(ids.reshape(-1), kind="stable")],
                                  np.arange(ids.size)), (tile, mode)
    bad = routing(rng, 200, 16, 3)
    bad[5, 1], bad[9, 0], bad[11] = -7, 1000, [4, 4, 4]
    blazecore.build_dispatch(dev(bad), 16, validate=False)  # meaningless but in bounds
    try:
        blazecore.build_dispatch(dev(bad), 16)
        raise AssertionError("bad ids were not reported")
    except ValueError:
        pass
    blazecore.build_dispatch(dev(np.zeros((0, 2), np.int32)), 4)


@case
def router():
    rng = np.random.default_rng(1)
    for E, K in ((7, 3), (64, 8), (256, 8), (1000, 2), (2048, 4), (32, 32)):
        for dt in (np.float32, np.float16, BF16):
            L = 67
            x = (rng.standard_normal((L, E)) * 2).astype(np.float32).astype(dt)
            xd = dev(x)
            for score in ("softmax", "sigmoid"):
                bias = (0.05 * rng.standard_normal(E)).astype(np.float32) if score == "sigmoid" else None
                gates, ids = rt.route_topk(xd, K, score=score, expert_bias=None if bias is None else dev(bias))
                ids_h = ids.get()
                expect(gates.get(), ref_rt.gates_for_ids(x, ids_h, score, True), 1e-5, f"gates E={E}")
                dg = rng.standard_normal((L, K)).astype(np.float32)
                dx = rt.route_topk_backward(dev(dg), xd, ids, score=score)
                expect(host(dx, dt), ref_rt.route_topk_backward(dg, x, ids_h, score=score), 1e-2, f"dlogits E={E}")
            lb, z = rt.load_balancing_loss(xd, ids), rt.router_z_loss(xd)
            expect(lb.get(), ref_rt.load_balancing_loss(x, ids_h), 1e-5, "lb")
            expect(z.get(), ref_rt.router_z_loss(x), 1e-5, "z")
            dlb = host(rt.load_balancing_loss_backward(float(L), xd, ids), dt)
            if K < E:
                expect(dlb, ref_rt.load_balancing_loss_backward(float(L), x, ids_h), 2e-2, "dlb")
            else:  # every expert equally loaded: the gradient vanishes (up to rounding)
                assert np.abs(dlb).max() < 1e-4, "dlb with K == E"
            expect(host(rt.router_z_loss_backward(dev(np.float32(L)), xd), dt),
                   ref_rt.router_z_loss_backward(float(L), x), 1e-2, "dz")
    rt.route_topk(dev(np.zeros((0, 8), np.float32)), 2)


# (L, d, h, E, K, empty experts, skew); the last two: d > 4h, so dx runs in 3 column slices (the last partial),
# and h > d, so dh' and dw2 run in 2 column slices of h
SHAPES = [(77, 64, 48, 5, 2, 1, 1.0), (130, 200, 136, 9, 3, 2, 0.5), (1, 16, 8, 4, 4, 0, 0.0),
          (45, 536, 24, 4, 2, 0, 0.3), (40, 24, 304, 3, 2, 0, 0.3)]


def _stored(w13, w2, b13, interleaved: bool, layout: str):
    """The weights as another layout stores them: interleaved gate/up rows, (E, in, out)."""
    if interleaved:
        h = w13.shape[1] // 2
        p = np.empty(2 * h, np.int64)
        p[0::2], p[1::2] = np.arange(h), np.arange(h, 2 * h)
        w13, b13 = w13[:, p], b13[:, p]
    if layout == "in_out":
        w13, w2 = w13.transpose(0, 2, 1), w2.transpose(0, 2, 1)
    return (np.ascontiguousarray(a) for a in (w13, w2, b13))


def _layer(sm90: bool, dtypes, chunks: int = 1, shapes=SHAPES, activations=("swiglu", "gelu"), layout="out_in",
           interleaved=False, act_in_operand=False, drop: float = 0.0):
    """The layer forward and backward against the float64 reference; ``drop``: the share of pairs given the id -1
    (dropped), the last token's pairs all of them."""
    os.environ["BLAZECORE_SM90"] = "1" if sm90 else "0"
    rng = np.random.default_rng(2)
    kw = {"chunks": chunks, "block_tokens": 32} if chunks > 1 else {}
    if act_in_operand:
        kw["act_in_operand"] = True
    for L, d, h, E, K, empty, skew in shapes:
        for dt in dtypes:
            for activation in activations:
                for checkpoint in moe.CHECKPOINTS:
                    R = 2 * h if moe.activation_info(activation) else h
                    x = rng.standard_normal((L, d)).astype(dt)
                    w13 = (rng.standard_normal((E, R, d)) / math.sqrt(d)).astype(dt)
                    w2 = (rng.standard_normal((E, d, h)) / math.sqrt(h)).astype(dt)
                    b13 = (0.1 * rng.standard_normal((E, R))).astype(dt)
                    b2 = (0.1 * rng.standard_normal((E, d))).astype(dt)
                    ids = routing(rng, L, E, K, skew=skew, empty=empty)
                    if drop:
                        ids[rng.random(ids.shape) < drop] = -1
                        ids[-1] = -1
                    g = rng.random((L, K)) + 0.1
                    gates = (g / g.sum(axis=1, keepdims=True)).astype(np.float32)
                    dy = rng.standard_normal((L, d)).astype(dt)
                    il = interleaved and moe.activation_info(activation)
                    sw13, sw2, sb13 = _stored(w13, w2, b13, il, layout)
                    y, saved = moe.moe_forward(dev(x), dev(sw13), dev(sw2), dev(gates), dev(ids),
                                               activation=activation + ("_interleaved" if il else ""),
                                               checkpoint=checkpoint, b13=dev(sb13), b2=dev(b2),
                                               weight_layout=layout, **kw)
                    grads = moe.moe_backward(dev(dy), saved, retain=True)
                    moe.moe_backward(dev(dy), saved)  # the default backward (may reuse the saved buffer)
                    tol = 1e-2 if dt != np.float32 else 1e-4
                    expect(host(y, dt), ref_moe.moe_forward_ref(x, w13, w2, gates, ids, activation, b13, b2), tol, "y")
                    # z rounded to x's dtype as the kernels store it (it decides swiglu_oai's clamps)
                    want = ref_moe.moe_backward_ref(dy, x, w13, w2, gates, ids, activation, b13, b2,
                                                    preact_dtype=None if dt == np.float32 else np.dtype(dt))
                    want["dw13"], want["dw2"], want["db13"] = _stored(want["dw13"], want["dw2"], want["db13"], il,
                                                                      layout)
                    for key in ("dx", "dw13", "dw2", "db13", "db2"):
                        expect(host(getattr(grads, key), dt), want[key], tol, key)
                    expect(grads.dgates.get(), want["dgates"], tol, "dgates")
    x = np.zeros((0, 16), dtypes[0])
    y, saved = moe.moe_forward(dev(x), dev(np.zeros((2, 16, 16), dtypes[0])), dev(np.zeros((2, 16, 8), dtypes[0])),
                               dev(np.zeros((0, 1), np.float32)), dev(np.zeros((0, 1), np.int32)))
    moe.moe_backward(dev(x), saved)


@case
def moe_sm90():
    _layer(True, (BF16, np.float16))


def _layer_dh(form):
    """The sm_90a layer (_layer's shapes and activations) with dh' on the producer-epilogue kernel's ``form``."""
    os.environ["BLAZECORE_SM90_DHCUR"] = form
    try:
        _layer(True, (BF16,))
    finally:
        os.environ.pop("BLAZECORE_SM90_DHCUR")


@case
def moe_sm90_dh():
    # dh' with its epilogue on the producer warpgroup (moe_dhcur_sm90, DHCUR "overlap")
    _layer_dh("overlap")


@case
def moe_sm90_dh_wide():
    # the same on its wide form (DHCUR "wide": 512 threads, the consumers' A from registers)
    _layer_dh("wide")


@case
def moe_mma():
    _layer(False, (np.float32, BF16, np.float16))


@case
def moe_chunk():
    if "chunks" not in inspect.signature(moe.moe_forward).parameters:
        print("moe_chunk: moe_forward takes no chunks; skipped")
        return
    # the chunk loop only (the kernels are moe_sm90's and moe_mma's): L = 77 and 130 in 3 chunks of 32 tokens
    _layer(True, (BF16,), chunks=3, shapes=SHAPES[:2], activations=("swiglu",))
    _layer(False, (np.float32,), chunks=3, shapes=SHAPES[:2], activations=("swiglu",))


@case
def moe_layouts():
    # "in_out" weights and interleaved gate/up rows (gpt-oss): the mma.sync kernels' other B loads and epilogues
    # (small: racecheck runs each launch slowly) a ragged shape and h in 2 column slices
    for layout, interleaved in (("in_out", True), ("out_in", True), ("in_out", False)):
        _layer(False, (BF16, np.float32), shapes=[SHAPES[0], SHAPES[4]],
               activations=("swiglu_oai",) if interleaved else ("gelu",), layout=layout, interleaved=interleaved)


@case
def moe_layouts_sm90():
    # the same on the sm_90a kernels: interleaved gate/up rows' gemm1 and dh' epilogues, "in_out" B loads; dh' on the
    # producer-epilogue kernel in both forms ("wide" the default) and fused into the GEMM
    for dh in ("overlap", "fused", "wide"):
        os.environ["BLAZECORE_SM90_DHCUR"] = dh
        try:
            for layout, interleaved in (("in_out", True), ("out_in", True), ("in_out", False)):
                _layer(True, (BF16,), shapes=[SHAPES[0], SHAPES[4]],
                       activations=("swiglu_oai",) if interleaved else ("gelu",), layout=layout,
                       interleaved=interleaved)
        finally:
            os.environ.pop("BLAZECORE_SM90_DHCUR")


@case
def moe_act_operand():
    # sm_90a, "ab": the second GEMM reads z and activates its A fragments in registers (gated: two A tiles a stage)
    _layer(True, (BF16, np.float16), activations=("swiglu", "gelu"), act_in_operand=True)


@case
def moe_zsliced():
    # h = 304 > d = 24: "none" recomputes z and runs the backward per column slice of h (two slices), with the
    # chunk carry of each slice's weight-gradient launches when chunked (L = 40: 2 chunks of 32 tokens)
    for chunks in (1, 3):
        _layer(True, (BF16,), chunks=chunks, shapes=[SHAPES[4]], activations=("swiglu",))
        _layer(False, (np.float32,), chunks=chunks, shapes=[SHAPES[4]], activations=("swiglu", "gelu"))
    _layer(False, (BF16,), chunks=3, shapes=[SHAPES[4]], activations=("swiglu_oai",), layout="in_out",
           interleaved=True)


@case
def moe_dropped():
    # pairs with the id -1 (no expert): the dispatch lists them after the experts' slots, whose rows the GEMMs never
    # write; both paths, chunked and not
    _layer(True, (BF16,), shapes=SHAPES[:2], activations=("swiglu",), drop=0.3)
    _layer(True, (BF16,), chunks=3, shapes=SHAPES[:2], activations=("swiglu",), drop=0.3)
    _layer(False, (np.float32,), shapes=SHAPES[:2], activations=("gelu",), drop=0.3)


@case
def finite():
    from blazecore._validate import count_nonfinite

    a = np.linspace(-1, 1, 4099).astype(np.float32)
    a[[3, 4000]] = [np.nan, np.inf]
    assert count_nonfinite(dev(a)) == 2
    assert count_nonfinite(dev(a.astype(BF16))) == 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="run only these cases")
    ap.add_argument("--list", action="store_true", help="print the case names and exit")
    ap.add_argument("--no-pool", action="store_true", help="CuPy allocates every buffer with cudaMalloc")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(CASES))
        return 0
    import cupy

    if args.no_pool:
        cupy.cuda.set_allocator(None)
        cupy.cuda.set_pinned_memory_allocator(None)
    for name in args.case or list(CASES):
        t0 = time.perf_counter()
        CASES[name]()
        cupy.cuda.Device().synchronize()
        print(f"{name}: ok ({time.perf_counter() - t0:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
