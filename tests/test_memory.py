"""Token chunking, the memory model and the chunk planner (blazecore.memory, moe_forward(chunks=...)).

GPU tests check that chunked forward + backward gives the same bytes as the unchunked run (every output and
gradient, both policies, with and without biases, on routings where some experts only appear in later chunks),
that both match the float64 reference, and that the memory model predicts the peak a counting allocator sees.
CPU tests cover chunk_bounds, the model's structure and the planner's choice against a brute-force search.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
from conftest import assert_close, make_routing, to_backend, to_numpy

import blazecore
from blazecore import BF16, memory, moe
from blazecore.reference import moe as ref

GRAD_KEYS = ("dx", "dw13", "dw2", "dgates", "db13", "db2")
DTYPES = {"f32": np.dtype(np.float32), "bf16": BF16}
TOL = {"f32": 1e-5, "bf16": 1e-2}


# the cases' routing names -> blazecore.testing's kinds
_KINDS = {"random": "uniform", "late": "late", "skewed": "skewed", "same": "same"}


def _routing(rng, L, E, K, kind):
    return make_routing(rng, L, E, K, _KINDS[kind])


def _make(seed, L, d, h, E, K, dname, activation, bias, routing):
    rng = np.random.default_rng(seed)
    dt = DTYPES[dname]
    R = 2 * h if moe.activation_info(activation) else h
    g = rng.random((L, K)) + 0.1
    return {
        "x": rng.standard_normal((L, d)).astype(dt),
        "w13": (rng.standard_normal((E, R, d)) / math.sqrt(d)).astype(dt),
        "w2": (rng.standard_normal((E, d, h)) / math.sqrt(h)).astype(dt),
        "b13": (0.1 * rng.standard_normal((E, R))).astype(dt) if bias else None,
        "b2": (0.1 * rng.standard_normal((E, d))).astype(dt) if bias else None,
        "gates": (g / g.sum(axis=1, keepdims=True)).astype(np.float32),
        "ids": _routing(rng, L, E, K, routing),
        "dy": rng.standard_normal((L, d)).astype(dt),
    }


def _run(dev, activation, checkpoint, retain=False, **kw):
    y, saved = moe.moe_forward(dev["x"], dev["w13"], dev["w2"], dev["gates"], dev["ids"], activation=activation,
                               checkpoint=checkpoint, b13=dev["b13"], b2=dev["b2"], **kw)
    grads = moe.moe_backward(dev["dy"], saved, retain=retain)
    return y, saved, grads


def _bytes(a):
    return b"" if a is None else np.ascontiguousarray(to_numpy(a)).tobytes()


# ---------------------------------------------------------------------------------------------
# chunk_bounds
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("L", [0, 1, 7, 16, 17, 100, 1000, 4096])
@pytest.mark.parametrize("chunks", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("block", [1, 16, 100])
def test_chunk_bounds(L, chunks, block):
    b = moe.chunk_bounds(L, chunks, block)
    assert b[0][0] == 0 and b[-1][1] == L
    assert all(t1 == n0 for (_, t1), (n0, _) in zip(b, b[1:], strict=False)), "chunks must tile [0, L)"
    assert len(b) <= max(1, chunks)
    assert all(t0 % block == 0 for t0, _ in b), "chunks start on block boundaries"
    assert all(t1 > t0 for t0, t1 in b) or L == 0
    if len(b) > 1:
        sizes = [t1 - t0 for t0, t1 in b]
        assert len(set(sizes[:-1])) == 1 and sizes[-1] <= sizes[0]


@pytest.mark.parametrize("bad", [0, -1, 1.5, "two", True, None])
def test_bad_chunks(bad):
    inp = _make(0, 8, 16, 8, 4, 2, "f32", "swiglu", False, "random")
    with pytest.raises(ValueError, match="chunks"):
        moe.moe_forward(inp["x"], inp["w13"], inp["w2"], inp["gates"], inp["ids"], chunks=bad)


@pytest.mark.parametrize("bad", [0, -4, 2.0])
def test_bad_block_tokens(bad):
    inp = _make(0, 8, 16, 8, 4, 2, "f32", "swiglu", False, "random")
    with pytest.raises(ValueError, match="block_tokens"):
        moe.moe_forward(inp["x"], inp["w13"], inp["w2"], inp["gates"], inp["ids"], chunks=2, block_tokens=bad)


def test_cpu_chunked_matches_unchunked_and_ab_layout():
    """The CPU path accepts chunking (same results) and lays ``ab`` out chunk by chunk like the GPU path."""
    inp = _make(1, 50, 16, 8, 6, 2, "f32", "swiglu", True, "late")
    y1, s1, g1 = _run(inp, "swiglu", "ab")
    y2, s2, g2 = _run(inp, "swiglu", "ab", chunks=3, block_tokens=8)
    assert _bytes(y1) == _bytes(y2)
    for k in GRAD_KEYS:
        assert _bytes(getattr(g1, k)) == _bytes(getattr(g2, k)), k
    z = ref.moe_preact_ref(inp["x"], inp["w13"], inp["ids"], inp["b13"])  # (L, K, R)
    for i, (t0, t1) in enumerate(moe.chunk_bounds(50, 3, 8)):
        dc = blazecore.build_dispatch(inp["ids"][t0:t1], 6)
        want = z[t0 + dc.slot_token, dc.slot_k].astype(np.float32)
        np.testing.assert_array_equal(s2.ab[t0 * 2:t1 * 2], want, err_msg=f"chunk {i}")


# ---------------------------------------------------------------------------------------------
# Memory model and planner (CPU: pure arithmetic)
# ---------------------------------------------------------------------------------------------

OLMOE = dict(d=2048, h=1024, E=64, K=8)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_gradient_bytes(bias):
    """The estimate's gradient_bytes: dx, dw13, dw2, dgates and the bias gradients, in the pools' 512-byte blocks."""
    L, d, h, E, K, b = 1000, 96, 80, 6, 2, 2
    R = 2 * h
    est = memory.moe_memory(L, d, h, E, K, bias=(bias, bias))
    grads = [L * d * b, E * R * d * b, E * d * h * b, 4 * L * K] + ([E * R * b, E * d * b] if bias else [])
    assert est.gradient_bytes == sum(-(-g // 512) * 512 for g in grads)


@pytest.mark.parametrize("sm90", [True, False], ids=["sm90", "sm80"])
def test_model_follows_the_weight_layout(sm90):
    """The model runs the call's own path for "in_out" weights: the same transients as "out_in" (the gathered rows
    staged alike for the weight gradients, where mixtral's wide h has them staged on sm_90a under "ab"), so the same
    bytes; act_in_operand lowers "out_in"'s forward peak on sm_90a but not "in_out"'s (which keeps hcur). An unknown
    layout is refused before anything runs."""
    for shape in ((8192, 2048, 1024, 64, 8), (8192, 4096, 14336, 8, 2)):
        for checkpoint in ("ab", "none"):
            a = memory.moe_memory(*shape, checkpoint=checkpoint, sm90=sm90)
            b = memory.moe_memory(*shape, checkpoint=checkpoint, sm90=sm90, weight_layout="in_out")
            assert b == a, (shape, checkpoint)
        fa = memory.moe_memory(*shape, sm90=sm90, act_in_operand=True).forward_peak_bytes
        fb = memory.moe_memory(*shape, sm90=sm90, act_in_operand=True, weight_layout="in_out").forward_peak_bytes
        assert fb == memory.moe_memory(*shape, sm90=sm90).forward_peak_bytes
        assert (fa < fb) if sm90 else (fa == fb)
    with pytest.raises(ValueError, match="weight_layout must be one of"):
        memory.moe_memory(8192, 2048, 1024, 64, 8, weight_layout="transposed")


@pytest.mark.parametrize("shape,lowers", [((32768, 2048, 1024, 64, 8), False), ((32768, 4096, 14336, 8, 2), True)],
                         ids=["h<=d", "h>>d"])
def test_act_in_operand_lowers_peak(shape, lowers):
    """With the gradients allocated before the forward (XLA), a call holds max(forward peak + gradients, backward
    peak). With h <= d and many experts (olmoe) the backward's peak is the larger either way; with h >> d (mixtral)
    the forward's (L*K, h) activations set the peak, and act_in_operand removes them."""
    L, d, h, E, K = shape
    grads = (L * d + E * 2 * h * d + E * d * h) * 2 + L * K * 4  # closed form, independent of the dry run
    held = {}
    for aio in (False, True):
        est = memory.moe_memory(L, d, h, E, K, act_in_operand=aio)
        held[aio] = max(est.forward_peak_bytes + grads, est.backward_peak_bytes)
    assert (held[True] < held[False]) is lowers
    assert memory.act_in_operand_lowers_peak(L, d, h, E, K) is lowers
    assert memory.act_in_operand_lowers_peak(L, d, h, E, K, checkpoint="none") is False
    assert memory.act_in_operand_lowers_peak(L, d, h, E, K, dtype="float32") is False  # fp32: mma.sync, no A_ACT


@pytest.mark.parametrize("act_in_operand", [False, True], ids=["hcur", "act_in_operand"])
@pytest.mark.parametrize("sm90", [True, False], ids=["sm90", "sm80"])
@pytest.mark.parametrize("checkpoint", ["ab", "none"])
def test_model_terms(checkpoint, sm90, act_in_operand):
    """Closed-form check of the unchunked model for a shape whose buffers are all 512-byte multiples. On sm_90a
    with act_in_operand, "ab"'s second GEMM activates z in registers: no hcur (L*K, h) in the forward."""
    L, (d, h, E, K) = 4096, OLMOE.values()
    est = memory.moe_memory(L, d, h, E, K, checkpoint=checkpoint, sm90=sm90, act_in_operand=act_in_operand)
    b, LK = 2, L * K
    z = LK * 2 * h * b if checkpoint == "ab" else 0
    disp = 512 + 3 * 4 * LK
    hcur = 0 if checkpoint == "ab" and sm90 and act_in_operand else LK * h * b
    fwd = L * d * b + disp + z + 512 + hcur + LK * (d // 2) * b  # o: two column slices of 1024 (d = 2048)
    grads = L * d * b + E * 2 * h * d * b + E * d * h * b + 4 * L * K
    zc = LK * 2 * h * b if checkpoint == "none" else 0
    # "none" runs dh' / dw2 in two column slices of h and dx in four of d (_moe_gpu.h_slices / dx_slices, lean)
    hw, dw = (h // 2, d // 4) if checkpoint == "none" else (h, d)
    tiles_nh = -(-h // (256 if sm90 else 128))  # dh' n-tiles: the fp32 dgates partials per slot
    bwd = L * d * b + disp + z + grads + 512 + zc + max(LK * hw * b + 4 * LK * tiles_nh, LK * dw * b)
    assert est.held_bytes == disp + z
    assert est.forward_peak_bytes >= fwd  # + the dispatch build's transient workspace
    assert est.forward_peak_bytes - fwd <= 4 * (64 * E + E) + 512
    assert est.peak_bytes == max(fwd, bwd) or abs(est.peak_bytes - max(fwd, bwd)) <= 4 * (64 * E + E) + 512


MIXTRAL = dict(d=4096, h=14336, E=8, K=2)


@pytest.mark.parametrize("checkpoint", ["ab", "none"])
def test_model_terms_wide_h(checkpoint):
    """Closed form of the unchunked backward where h > d (mixtral's widths). "none" never holds z or dz whole: it
    recomputes and consumes them per column slice of h (2048 wide: half of d), with dx summed over the slices in
    an fp32 (L, d) buffer. "ab" keeps z and slices its transients as narrowly (dh' / dw2: 2048, dx: 1024), and stages
    the gathered rows of dy and x in slot order for dw2 and dw13 (112 and 56 n-tiles read them)."""
    L, (d, h, E, K) = 4096, MIXTRAL.values()
    b, LK, w, wd, tiles_nh = 2, L * K, 2048, 1024, h // 256
    trace = memory.moe_memory_trace(L, d, h, E, K, checkpoint=checkpoint)
    est = trace.estimate
    y, disp = L * d * b, 512 + 3 * 4 * LK
    grads = L * d * b + E * 2 * h * d * b + E * d * h * b + 4 * L * K
    z = LK * 2 * h * b if checkpoint == "ab" else 0
    if checkpoint == "none":  # part, the slice's z and g * hcur rows, dx's fp32 sum, the per-slot dx rows
        transient = 4 * LK * tiles_nh + LK * 2 * w * b + LK * w * b + 4 * L * d + LK * wd * b
    else:  # + the rows of dy (dw2) and x (dw13) staged in slot order, (L*K, d) each (_moe_gpu._stage_rows)
        transient = max(LK * d * b + LK * w * b + 4 * LK * tiles_nh, LK * d * b, LK * wd * b)
    assert est.held_bytes == disp + z
    assert est.peak_bytes == y + disp + z + grads + 512 + transient
    # forward: "none" runs per column slice of h (hcur's slice, the per-slot rows of a 1024-wide slice of y, y's
    # fp32 sum); "ab" keeps z beside hcur, or (act_in_operand) its second GEMM reads z and there is no hcur
    # (the first GEMM of "ab" reads x's rows staged in slot order, (L*K, d), freed before the per-slot rows of y)
    fwd_transient = LK * w * b + LK * wd * b + 4 * L * d if checkpoint == "none" else LK * h * b + LK * d * b
    assert est.forward_peak_bytes - (y + disp + z + 512 + fwd_transient) in range(0, 4 * (64 * E + E) + 513)
    if checkpoint == "ab":
        lean = memory.moe_memory(L, d, h, E, K, checkpoint=checkpoint, act_in_operand=True)
        assert est.forward_peak_bytes - lean.forward_peak_bytes == LK * h * b
    grad_shapes = {(L, d), (E, 2 * h, d), (E, d, h), (L, K)}
    backward = [ev for ev in trace.events[trace.forward_events:] if ev[0] == "alloc" and ev[2] not in grad_shapes]
    assert max(ev[1] for ev in backward) == (4 * L * d if checkpoint == "none" else LK * d * b)


@pytest.mark.parametrize("checkpoint", ["ab", "none"])
def test_model_chunking_shrinks_transients(checkpoint):
    L = 1 << 20
    peaks = [memory.moe_memory(L, **OLMOE, checkpoint=checkpoint, chunks=c).peak_bytes for c in (1, 2, 4, 8, 16)]
    assert all(a > b for a, b in zip(peaks, peaks[1:], strict=False)), peaks
    held = {memory.moe_memory(L, **OLMOE, checkpoint=checkpoint, chunks=c).held_bytes for c in (1, 4, 16)}
    assert max(held) - min(held) <= 16 * 4096, "held bytes do not depend on chunking (up to dispatch rounding)"


def test_model_held_matches_cpu_saved():
    inp = _make(2, 300, 32, 16, 8, 2, "f32", "swiglu", False, "random")
    for ck in ("ab", "none"):
        _, saved = moe.moe_forward(inp["x"], inp["w13"], inp["w2"], inp["gates"], inp["ids"], checkpoint=ck)
        est = memory.moe_memory(300, 32, 16, 8, 2, dtype="float32", checkpoint=ck, sm90=False)
        assert abs(est.held_bytes - saved.held_bytes()) <= 4 * 512, (ck, est.held_bytes, saved.held_bytes())


@pytest.mark.parametrize("checkpoint", ["ab", "none", None])
@pytest.mark.parametrize("budget_gib", [4, 12, 30, 80, 1000])
def test_planner_smallest_fitting(checkpoint, budget_gib):
    L, budget = 1 << 20, budget_gib << 30
    plan = memory.plan_chunks(L, **OLMOE, checkpoint=checkpoint, budget=budget)
    pols = ("ab", "none") if checkpoint is None else (checkpoint,)
    # brute force: the first (policy, chunk count) in preference order whose peak fits
    want = None
    for pol in pols:
        for c in range(1, L // moe.BLOCK_TOKENS + 1):
            if memory.moe_memory(L, **OLMOE, checkpoint=pol, chunks=c).peak_bytes <= budget:
                want = (pol, len(moe.chunk_bounds(L, c)))
                break
        if want:
            break
    if want is None:
        assert not plan.fits
    else:
        assert plan.fits and plan.estimate.peak_bytes <= budget
        assert (plan.checkpoint, plan.estimate.chunks) == want


def test_planner_budget_errors():
    with pytest.raises(ValueError, match="fraction"):
        memory.plan_chunks(1024, 64, 32, 4, 2, budget=1.5)
    with pytest.raises(TypeError, match="budget"):
        memory.plan_chunks(1024, 64, 32, 4, 2, budget="lots")
    with pytest.raises(ValueError, match=">= 0"):
        memory.plan_chunks(1024, 64, 32, 4, 2, budget=-1)
    with pytest.raises(ValueError, match="checkpoint"):
        memory.moe_memory(1024, 64, 32, 4, 2, checkpoint="all")


# ---------------------------------------------------------------------------------------------
# The dry run behind the model (CPU: no device, no CuPy)
# ---------------------------------------------------------------------------------------------

DRY_GRID = [  # (L, d, h, E, K): odd sizes, L = 0 and 1, more tokens than one reduction block
    (0, 64, 48, 8, 2), (1, 33, 17, 7, 7), (1000, 2048, 1024, 64, 8), (65536, 40, 24, 5, 3), (16385, 64, 3000, 16, 1),
]


def _r512(n):
    return -(-n // 512) * 512


@pytest.mark.parametrize("retain", [False, True], ids=["consume", "retain"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("sm90", [True, False], ids=["sm90", "mmasync"])
@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("checkpoint", ["ab", "none"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("shape", DRY_GRID, ids=[f"L{s[0]}-d{s[1]}-h{s[2]}-E{s[3]}-K{s[4]}" for s in DRY_GRID])
def test_dry_run_consistent(shape, dtype, checkpoint, chunks, sm90, bias, retain):
    """The events of the dry run add up: frees match earlier allocations, the peaks and held bytes are what the
    events say, what stays alive is y, the saved record and the gradients, and the estimate is the trace's."""
    L, d, h, E, K = shape
    kw = dict(dtype=dtype, checkpoint=checkpoint, chunks=chunks, sm90=sm90, bias=(bias, bias), retain=retain)
    tr = memory.moe_memory_trace(L, d, h, E, K, **kw)
    est = tr.estimate
    assert est == memory.moe_memory(L, d, h, E, K, **kw)
    b = 2 if dtype == "bfloat16" else 4
    R = 2 * h
    live, peak, fwd_peak, open_allocs = 0, 0, 0, []
    for i, (kind, n, shape_, dt) in enumerate(tr.events):
        assert n % 512 == 0 and (n > 0 or math.prod(shape_) == 0), (kind, n, shape_, dt)
        if kind == "alloc":
            open_allocs.append((n, shape_, dt))
            live += n
        else:
            open_allocs.remove((n, shape_, dt))  # a free releases an earlier allocation of the same buffer
            live -= n
        assert live >= 0
        peak = max(peak, live)
        if i + 1 == tr.forward_events:
            fwd_peak = peak
            assert live - _r512(L * d * b) == est.held_bytes
    assert (est.forward_peak_bytes, est.backward_peak_bytes, est.peak_bytes) == (fwd_peak, peak, peak)
    # alive at the end: y, the dispatch(es) and z (the saved record), the gradients
    bounds = moe.chunk_bounds(L, chunks)
    assert (est.chunks, est.chunk_tokens) == (len(bounds), max(t1 - t0 for t0, t1 in bounds))
    disp = sum(_r512(4 * (E + 1)) + 3 * _r512(4 * (t1 - t0) * K) for t0, t1 in bounds)
    z = _r512(L * K * R * b) if checkpoint == "ab" else 0
    assert est.held_bytes == disp + z
    grads = [L * d * b, E * R * d * b, E * d * h * b, 4 * L * K] + ([E * R * b, E * d * b] if bias else [])
    assert live == _r512(L * d * b) + disp + z + sum(_r512(g) for g in grads)
    assert sum(n for n, _, _ in open_allocs) == live
    # the bytes asked for (round_bytes=1): the same buffers, unrounded
    exact = memory.moe_memory_trace(L, d, h, E, K, **kw, round_bytes=1)
    assert [(k, s, t) for k, _, s, t in exact.events] == [(k, s, t) for k, _, s, t in tr.events]
    assert all(n1 <= n512 < n1 + 512 or n1 == n512 == 0 for (_, n1, _, _), (_, n512, _, _) in
               zip(exact.events, tr.events, strict=True))


def test_dry_run_needs_no_device():
    """The model runs where CuPy cannot even be imported (CI has no GPU) and predicts the same bytes."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.modules['cupy'] = None\n"
        "sys.modules['cupy_backends'] = None\n"
        "from blazecore import memory\n"
        "e = memory.moe_memory(70000, 2048, 1024, 64, 8, chunks=3, checkpoint='none', bias=(True, True))\n"
        "p = memory.plan_chunks(1 << 20, 2048, 1024, 64, 8, checkpoint=None, budget=20 << 30)\n"
        "print(e.peak_bytes, e.held_bytes, p.chunks, p.checkpoint)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    e = memory.moe_memory(70000, 2048, 1024, 64, 8, chunks=3, checkpoint="none", bias=(True, True))
    p = memory.plan_chunks(1 << 20, 2048, 1024, 64, 8, checkpoint=None, budget=20 << 30)
    assert out == [str(e.peak_bytes), str(e.held_bytes), str(p.chunks), p.checkpoint]


def test_model_follows_the_launchers(monkeypatch):
    """The model is the launchers' own allocation sequence: narrower column slices of the forward's per-slot
    output rows (a launcher constant) shrink the predicted forward peak by exactly the bytes they save."""
    from blazecore import _moe_gpu

    L, (d, h, E, K) = 4096, OLMOE.values()
    memory._dry_run.cache_clear()
    before = memory.moe_memory(L, d, h, E, K, checkpoint="none")
    monkeypatch.setattr(_moe_gpu, "O_SLICE_COLS", 256)
    memory._dry_run.cache_clear()
    try:
        after = memory.moe_memory(L, d, h, E, K, checkpoint="none")
    finally:
        monkeypatch.undo()
        memory._dry_run.cache_clear()
    assert before.forward_peak_bytes - after.forward_peak_bytes == L * K * (1024 - 256) * 2
    assert before.held_bytes == after.held_bytes


def test_model_counts_block_table_beside_partials():
    """With more tokens than one reduction block, the KTileWalk block table (E * blocks int32) is alive together
    with the dgates partials, as in the launcher (the hand model freed the partials first)."""
    L, d, h, E, K = 65536, 64, 48, 8, 2
    tr = memory.moe_memory_trace(L, d, h, E, K, checkpoint="none")
    table = ((E * -(-L // moe.BLOCK_TOKENS),), "int32")
    partials = ((L * K, -(-h // 256)), "float32")
    live, both = [], False
    for kind, _, shape, dt in tr.events[tr.forward_events:]:
        if kind == "alloc":
            live.append((shape, dt))
        else:
            live.remove((shape, dt))
        both = both or (table in live and partials in live)
    assert both


# ---------------------------------------------------------------------------------------------
# GPU: bit-identical chunking, and the model against a counting allocator
# ---------------------------------------------------------------------------------------------

GPU_CASES = [
    # (L, d, h, E, K, routing, block, chunks)
    (300, 64, 48, 8, 2, "late", 32, 3),
    (300, 64, 48, 8, 2, "skewed", 64, 2),
    (257, 40, 24, 5, 3, "random", 16, 7),
    (200, 32, 16, 4, 1, "same", 32, 4),
    (130, 32, 16, 16, 16, "random", 16, 5),
]


@pytest.mark.gpu
@pytest.mark.parametrize("sm90", [pytest.param(True, id="sm90"), pytest.param(False, id="mmasync")])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("checkpoint", ["ab", "none"])
@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"{c[5]}-L{c[0]}-c{c[7]}" for c in GPU_CASES])
def test_chunked_bit_identical_gpu(case, dname, activation, checkpoint, bias, sm90, monkeypatch):
    L, d, h, E, K, routing, block, chunks = case
    if not sm90 and dname == "f32":
        pytest.skip("fp32 always runs the mma.sync kernels")
    monkeypatch.setenv("BLAZECORE_SM90", "1" if sm90 else "0")
    inp = _make(hash(case) & 0xFFFF, L, d, h, E, K, dname, activation, bias, routing)
    dev = {k: None if v is None else to_backend(v, "gpu") for k, v in inp.items()}
    assert len(moe.chunk_bounds(L, chunks, block)) > 1
    y1, _, g1 = _run(dev, activation, checkpoint, block_tokens=block)
    y2, s2, g2 = _run(dev, activation, checkpoint, block_tokens=block, chunks=chunks)
    assert len(s2.chunk_dispatches) == len(moe.chunk_bounds(L, chunks, block))
    assert _bytes(y1) == _bytes(y2), "y differs between chunked and unchunked runs"
    for k in GRAD_KEYS:
        assert _bytes(getattr(g1, k)) == _bytes(getattr(g2, k)), f"{k} differs between chunked and unchunked runs"
    # and both are right (blocked reductions included: L > block)
    y_ref = ref.moe_forward_ref(inp["x"], inp["w13"], inp["w2"], inp["gates"], inp["ids"], activation,
                                inp["b13"], inp["b2"])
    g_ref = ref.moe_backward_ref(inp["dy"], inp["x"], inp["w13"], inp["w2"], inp["gates"], inp["ids"], activation,
                                 inp["b13"], inp["b2"], preact_dtype=np.dtype(inp["x"].dtype))
    assert_close(y2, y_ref, TOL[dname], "y")
    for k in GRAD_KEYS:
        if g_ref[k] is not None:
            assert_close(getattr(g2, k), g_ref[k], TOL[dname], k)


@pytest.mark.gpu
@pytest.mark.parametrize("checkpoint", ["ab", "none"])
def test_chunked_retain_and_rebuilt_saved_gpu(checkpoint):
    """retain=True (dz beside the saved z) twice, and a MoESaved rebuilt without its chunk dispatches (as the
    adapters do): same bytes as the unchunked run."""
    inp = _make(5, 333, 64, 32, 8, 2, "bf16", "swiglu", True, "late")
    dev = {k: None if v is None else to_backend(v, "gpu") for k, v in inp.items()}
    _, _, g1 = _run(dev, "swiglu", checkpoint, block_tokens=32)
    y2, s2 = moe.moe_forward(dev["x"], dev["w13"], dev["w2"], dev["gates"], dev["ids"], checkpoint=checkpoint,
                             b13=dev["b13"], b2=dev["b2"], chunks=4, block_tokens=32)
    ga = moe.moe_backward(dev["dy"], s2, retain=True)
    gb = moe.moe_backward(dev["dy"], s2, retain=True)
    rebuilt = moe.MoESaved(s2.x, s2.w13, s2.w2, s2.gates, s2.expert_ids, None, "swiglu", checkpoint, s2.b13, s2.b2,
                           s2.ab, chunks=4, block_tokens=32)
    gc = moe.moe_backward(dev["dy"], rebuilt, retain=True)
    for k in GRAD_KEYS:
        want = _bytes(getattr(g1, k))
        for name, g in (("retain 1", ga), ("retain 2", gb), ("rebuilt", gc)):
            assert _bytes(getattr(g, k)) == want, f"{name}: {k}"


class _CountingAllocator:
    """A cupy-backed allocator that counts live and peak bytes, rounded to 512 like the caching allocators."""

    def __init__(self):
        self.cur = self.peak = 0

    def __call__(self, shape, dtype_name):
        import weakref

        import cupy

        dt = np.uint16 if dtype_name == "bfloat16" else np.dtype(dtype_name)
        a = cupy.empty(shape, dtype=dt)
        n = -(-a.nbytes // 512) * 512
        self.cur += n
        self.peak = max(self.peak, self.cur)
        weakref.finalize(a, self._release, n)
        return a

    def _release(self, n):
        self.cur -= n


MEMORY_CASES = [
    # (L, d, h, E, K, block_tokens): L = 0 and 1, odd L, chunks that start at several block boundaries, the
    # default reduction block with more tokens than one block (the block table beside the partials)
    (0, 64, 48, 8, 2, 64),
    (1, 64, 48, 8, 2, 64),
    (1000, 40, 24, 5, 3, 64),
    (8192, 256, 128, 16, 4, 1024),
    (65536, 64, 48, 8, 2, moe.BLOCK_TOKENS),
]


@contextlib.contextmanager
def _measured(how, L, d, dtype):
    """Yields a dict that gets 'held' (after the forward, less y) and 'peak' (forward + backward) bytes as the
    memory owner counts them: a counting blazecore allocator (512-rounded), CuPy's pool (a fresh one whose
    used_bytes, 512-rounded, is read after every malloc) or torch's caching allocator (requested bytes, exact)."""
    import cupy

    y_bytes = L * d * np.dtype(dtype).itemsize
    res = {}
    if how == "counting":
        counter = _CountingAllocator()
        with blazecore.allocator(counter):
            res["mark"] = lambda: counter.cur - _r512(y_bytes)
            yield res
        res["peak"] = counter.peak
    elif how == "cupy_pool":
        pool, top = cupy.cuda.MemoryPool(), [0]

        def malloc(n):
            p = pool.malloc(n)
            top[0] = max(top[0], pool.used_bytes())
            return p

        cupy.cuda.set_allocator(malloc)
        try:
            base = top[0] = pool.used_bytes()
            res["mark"] = lambda: pool.used_bytes() - base - _r512(y_bytes)
            yield res
            res["peak"] = top[0] - base
        finally:
            cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
    else:
        torch = pytest.importorskip("torch")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_stats()["requested_bytes.all.current"]

        def alloc(shape, dtype_name):
            return torch.empty(shape, dtype=getattr(torch, dtype_name), device="cuda")

        with blazecore.allocator(alloc):
            res["mark"] = lambda: torch.cuda.memory_stats()["requested_bytes.all.current"] - base - y_bytes
            yield res
        res["peak"] = torch.cuda.memory_stats()["requested_bytes.all.peak"] - base


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["counting", "cupy_pool", "torch"])
@pytest.mark.parametrize("retain", [False, True], ids=["consume", "retain"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("sm90", [pytest.param(True, id="sm90"), pytest.param(False, id="mmasync")])
@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("checkpoint", ["ab", "none"])
@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("case", MEMORY_CASES, ids=[f"L{c[0]}-d{c[1]}-blk{c[5]}" for c in MEMORY_CASES])
def test_memory_model_matches_allocations_gpu(case, dname, checkpoint, chunks, sm90, bias, retain, how, monkeypatch):
    """The model's peak and held bytes equal, to the byte, what the memory owner measured for one forward and
    backward: a counting allocator and CuPy's pool (512-rounded blocks, as moe_memory) and torch's caching
    allocator (its requested bytes, against the trace with round_bytes=1)."""
    import gc

    import cupy

    from blazecore import _compile

    L, d, h, E, K, block = case
    if sm90 and (dname == "f32" or _compile.device_arch() != "sm_90a"):
        pytest.skip("the sm_90a kernels run 16-bit types on Hopper only")
    monkeypatch.setenv("BLAZECORE_SM90", "1" if sm90 else "0")
    inp = _make(hash(case) & 0xFFFF, L, d, h, E, K, dname, "swiglu", bias, "random")
    dev = {k: None if v is None else to_backend(v, "gpu") for k, v in inp.items()}
    _run(dev, "swiglu", checkpoint, block_tokens=block, chunks=chunks)  # compile outside the measurement
    cupy.cuda.Device().synchronize()
    gc.collect()
    with _measured(how, L, d, DTYPES[dname]) as m:
        y, saved = moe.moe_forward(dev["x"], dev["w13"], dev["w2"], dev["gates"], dev["ids"], checkpoint=checkpoint,
                                   b13=dev["b13"], b2=dev["b2"], chunks=chunks, block_tokens=block)
        held = m["mark"]()
        grads = moe.moe_backward(dev["dy"], saved, retain=retain)
        del grads, y, saved
    tr = memory.moe_memory_trace(L, d, h, E, K, dtype=dname.replace("bf16", "bfloat16").replace("f32", "float32"),
                                 checkpoint=checkpoint, chunks=chunks, block_tokens=block, bias=(bias, bias),
                                 sm90=sm90, retain=retain, round_bytes=1 if how == "torch" else 512)
    assert (m["peak"], held) == (tr.estimate.peak_bytes, tr.estimate.held_bytes), (how, tr.estimate)


# ---------------------------------------------------------------------------------------------
# The planner in the layers (blazecore.layer.resolve_chunks, PyTorch and JAX)
# ---------------------------------------------------------------------------------------------


def test_resolve_chunks():
    from blazecore.layer import layer_call_bytes, resolve_chunks

    kw = dict(dtype="bfloat16", activation="swiglu", checkpoint="none")
    L = 1 << 20
    assert resolve_chunks(3, L, **OLMOE, **kw) == 3
    assert resolve_chunks("auto", L, **OLMOE, **kw, free_bytes=None) == 1  # no device: the reference path
    budget = memory.moe_memory(L, **OLMOE, **kw, chunks=8).peak_bytes
    # the layer keeps what it holds beside the core (router logits, gates, ids, dy) out of the budget
    beside, _ = layer_call_bytes(L, OLMOE["d"], OLMOE["E"], OLMOE["K"], dtype="bfloat16")
    want = memory.plan_chunks(L, **OLMOE, **kw, budget=budget, reserved=beside).chunks
    assert want > 1
    assert resolve_chunks("auto", L, **OLMOE, **kw, budget=budget, free_bytes=lambda: 1) == want
    assert resolve_chunks("auto", L, **OLMOE, **kw, budget=0.5, free_bytes=lambda: 2 * budget) == want
    with pytest.raises(ValueError, match="fraction"):
        resolve_chunks("auto", L, **OLMOE, **kw, budget=1.5, free_bytes=lambda: budget)


def _layer_inputs(L, d, h, E, K, seed=3):
    rng = np.random.default_rng(seed)
    g = rng.random((L, K)) + 0.1
    return {
        "x": rng.standard_normal((L, d)).astype(np.float32),
        "w13": (rng.standard_normal((E, 2 * h, d)) / math.sqrt(d)).astype(np.float32),
        "w2": (rng.standard_normal((E, d, h)) / math.sqrt(h)).astype(np.float32),
        "gates": (g / g.sum(axis=1, keepdims=True)).astype(np.float32),
        "ids": _routing(rng, L, E, K, "late"),
        "dy": rng.standard_normal((L, d)).astype(np.float32),
    }


L_ADAPTER = moe.BLOCK_TOKENS * 2 + 777  # chunking needs more tokens than one reduction block


@pytest.mark.gpu
def test_torch_ffn_chunks_gpu():
    torch = pytest.importorskip("torch")
    import blazecore_torch

    inp = _layer_inputs(L_ADAPTER, 32, 16, 8, 2)
    t = {k: torch.from_numpy(v).cuda() for k, v in inp.items()}
    t["x"] = t["x"].to(torch.bfloat16)
    t["w13"] = t["w13"].to(torch.bfloat16)
    t["w2"] = t["w2"].to(torch.bfloat16)
    outs = []
    for chunks in (1, 3):
        leaves = [t[k].clone().requires_grad_() for k in ("x", "w13", "w2", "gates")]
        y = blazecore_torch.ops.moe_ffn(*leaves, t["ids"], chunks=chunks)
        grads = torch.autograd.grad(y, leaves, t["dy"].to(y.dtype))
        outs.append([y, *grads])
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_jax_ffn_chunks_gpu():
    import os

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax")
    import blazecore_jax
    import jax.numpy as jnp

    inp = _layer_inputs(L_ADAPTER, 32, 16, 8, 2)
    x, w13, w2 = (jnp.asarray(inp[k], jnp.bfloat16) for k in ("x", "w13", "w2"))
    gates, ids, dy = jnp.asarray(inp["gates"]), jnp.asarray(inp["ids"]), jnp.asarray(inp["dy"], jnp.bfloat16)

    def run(chunks):
        f = lambda x, w13, w2, g: blazecore_jax.ops.moe_ffn(x, w13, w2, g, ids, chunks=chunks)  # noqa: E731
        y, vjp = jax.vjp(jax.jit(f), x, w13, w2, gates)
        return [y, *vjp(dy)]

    for a, b in zip(run(1), run(3), strict=True):
        assert np.array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def test_model_follows_the_stage_rows_setting(monkeypatch):
    """The model runs the layer as the environment's settings say (and caches the runs apart): on mixtral's widths
    under "ab", staging dy's rows for dw2 (BLAZECORE_STAGE_ROWS auto) adds their (L*K, d) buffer to the backward's
    peak; "never" stages nothing."""
    L, (d, h, E, K) = 4096, MIXTRAL.values()
    monkeypatch.setenv("BLAZECORE_STAGE_ROWS", "never")
    never = memory.moe_memory(L, d, h, E, K, checkpoint="ab")
    monkeypatch.setenv("BLAZECORE_STAGE_ROWS", "auto")
    auto = memory.moe_memory(L, d, h, E, K, checkpoint="ab")
    assert auto.peak_bytes - never.peak_bytes == L * K * d * 2
