"""route_topk (forward, backward) and the router's auxiliary losses against the float64 NumPy reference,
and the reference's gradients against central finite differences."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import assert_close, backends, to_backend, to_numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blazecore import _compile
from blazecore import router as rt
from blazecore._array import BF16
from blazecore.reference import router as ref

DTYPES = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": BF16}
# dlogits are rounded to the logits' dtype once; gates are fp32 from exactly representable inputs.
DX_TOL = {"fp32": 1e-5, "fp16": 1e-3, "bf16": 1e-2}
GATE_TOL = 1e-5
LOSS_TOL = 1e-5
SEL_TOL = 1e-6  # fp32 rounding of score + bias is ~1e-7 for values of order 1
MODES = [(s, r) for s in ("softmax", "sigmoid") for r in (True, False)]
MODE_IDS = [f"{s}-{'renorm' if r else 'raw'}" for s, r in MODES]


def _shapes_ek():
    out = []
    for E in (1, 7, 64, 256, 1024):
        for K in sorted({1, 2, 8, E}):
            if K <= E:
                out.append((E, K))
    return out


SHAPES_EK = _shapes_ek()
LS = (0, 1, 63, 1000)


def _logits(rng, L, E, dtype, scale=1.0):
    return (rng.standard_normal((L, E)) * scale).astype(np.float32).astype(dtype)


def _bias(rng, E):
    return (rng.standard_normal(E) * 0.05).astype(np.float32)


def _assert_valid_topk(ids, sel, K, tol, name="ids"):
    """ids (L, K) are distinct, in range, non-increasing in sel, and no unselected value beats them (up to tol)."""
    L, E = sel.shape
    assert ids.shape == (L, K), f"{name}: shape {ids.shape}"
    assert ids.dtype == np.int32, f"{name}: dtype {ids.dtype}"
    if L == 0:
        return
    bad = (ids < 0) | (ids >= E)
    assert not bad.any(), f"{name}: out-of-range id {ids[bad][0]} at {np.argwhere(bad)[0]}"
    srt = np.sort(ids, axis=1)
    dup = (srt[:, 1:] == srt[:, :-1]).any(axis=1)
    assert not dup.any(), f"{name}: row {np.argmax(dup)} repeats an id: {ids[np.argmax(dup)]}"
    v = np.take_along_axis(sel, ids.astype(np.int64), axis=1)
    rise = np.diff(v, axis=1) > tol
    r = np.argwhere(rise)[0][0] if rise.any() else 0
    assert not rise.any(), f"{name}: row {r} not in descending order: {v[r]}"
    if K < E:
        rest = sel.copy()
        np.put_along_axis(rest, ids.astype(np.int64), -np.inf, axis=1)
        beaten = rest.max(axis=1) > v[:, -1] + tol
        assert not beaten.any(), f"{name}: row {np.argmax(beaten)} misses a larger value"


def _ambiguous_rows(sel, K, tol):
    """Rows whose top min(K+1, E) values hold two within (0, tol] of each other (fp32 may order them either way)."""
    if sel.shape[0] == 0:
        return np.zeros(0, dtype=bool)
    n = min(K + 1, sel.shape[1])
    top = -np.sort(-sel, axis=1)[:, :n]
    gaps = -np.diff(top, axis=1)
    return ((gaps > 0) & (gaps <= tol)).any(axis=1)


def _run_forward(backend, x, K, score, renorm, bias):
    g, ids = rt.route_topk(to_backend(x, backend), K, score=score, renormalize=renorm,
                           expert_bias=None if bias is None else to_backend(bias, backend))
    return to_numpy(g), to_numpy(ids)


def _check_forward(backend, L, E, K, dtype, score, renorm, use_bias, seed=0):
    rng = np.random.default_rng(seed)
    x = _logits(rng, L, E, DTYPES[dtype])
    bias = _bias(rng, E) if use_bias else None
    g, ids = _run_forward(backend, x, K, score, renorm, bias)
    assert g.dtype == np.float32 and g.shape == (L, K)
    sel = ref.selection_values(x, score, bias)
    _assert_valid_topk(ids, sel, K, SEL_TOL)
    # gates of the ids the op chose (so a near-tie decided the other way is not counted twice)
    assert_close(g, ref.gates_for_ids(x, ids, score, renorm), GATE_TOL, "gates")
    _, ref_ids = ref.route_topk_forward(x, K, score=score, renormalize=renorm, expert_bias=bias)
    # Without a bias the GPU ranks the logits exactly, the reference the float64 scores: same order.
    must = ~_ambiguous_rows(sel, K, SEL_TOL) if use_bias else np.ones(L, dtype=bool)
    mism = (ids != ref_ids).any(axis=1) & must
    assert not mism.any(), f"ids differ from the reference in row {np.argmax(mism)}: {ids[np.argmax(mism)]} vs " \
                           f"{ref_ids[np.argmax(mism)]}"
    if renorm and L:
        assert_close(g.sum(axis=1), np.ones(L), 1e-6, "gate sums")


# ---------------------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("config", [("softmax", True, False), ("sigmoid", True, True)],
                         ids=["softmax-renorm", "sigmoid-renorm-bias"])
@pytest.mark.parametrize("L", LS, ids=[f"L{v}" for v in LS])
@pytest.mark.parametrize("ek", SHAPES_EK, ids=[f"E{e}-K{k}" for e, k in SHAPES_EK])
def test_forward_shapes(backend, dtype, config, L, ek):
    E, K = ek
    score, renorm, use_bias = config
    _check_forward(backend, L, E, K, dtype, score, renorm, use_bias, seed=L * 7 + E * 3 + K)


FULL_SHAPES = [(63, 7, 2), (1000, 64, 8), (63, 256, 256), (1, 1024, 8), (63, 1024, 2)]


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("use_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", FULL_SHAPES, ids=[f"L{a}-E{b}-K{c}" for a, b, c in FULL_SHAPES])
def test_forward_modes(backend, dtype, mode, use_bias, shape):
    L, E, K = shape
    _check_forward(backend, L, E, K, dtype, mode[0], mode[1], use_bias, seed=11)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("bias_kind", ["nobias", "zero-bias", "lattice-bias"])
@pytest.mark.parametrize("E,K", [(7, 3), (64, 8), (300, 300), (1024, 8)], ids=["E7", "E64", "E300-K300", "E1024"])
def test_ties_are_broken_by_lower_index(backend, dtype, score, bias_kind, E, K):
    """Integer logits repeat a lot: ids must match the reference exactly, and two runs bit for bit."""
    rng = np.random.default_rng(E + K)
    L = 200
    x = rng.integers(-2, 2, size=(L, E)).astype(np.float32).astype(DTYPES[dtype])
    bias = {"nobias": None, "zero-bias": np.zeros(E, np.float32),
            "lattice-bias": (rng.integers(0, 2, size=E) * 4.0).astype(np.float32)}[bias_kind]
    g1, ids1 = _run_forward(backend, x, K, score, True, bias)
    g2, ids2 = _run_forward(backend, x, K, score, True, bias)
    _, ref_ids = ref.route_topk_forward(x, K, score=score, renormalize=True, expert_bias=bias)
    np.testing.assert_array_equal(ids1, ref_ids)
    np.testing.assert_array_equal(ids1, ids2)
    np.testing.assert_array_equal(g1.view(np.uint32), g2.view(np.uint32))
    assert_close(g1, ref.gates_for_ids(x, ids1, score, True), GATE_TOL, "gates")


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("E", [5, 64, 1024])
def test_all_equal_rows(backend, mode, E):
    """Rows of equal logits (signed zeros included: -0 == +0) select experts 0..K-1 with equal gates."""
    score, renorm = mode
    K = min(4, E)
    x = np.zeros((3, E), np.float32)
    x[1, ::2] = -0.0
    x[2] = 1.5
    g, ids = _run_forward(backend, x, K, score, renorm, None)
    np.testing.assert_array_equal(ids, np.tile(np.arange(K, dtype=np.int32), (3, 1)))
    assert_close(g, ref.gates_for_ids(x, ids, score, renorm), GATE_TOL, "gates")


@pytest.mark.parametrize("backend", backends())
def test_out_buffers_are_written_and_returned(backend):
    rng = np.random.default_rng(3)
    x = _logits(rng, 37, 24, np.float32)
    og = to_backend(np.full((37, 5), np.nan, np.float32), backend)
    oi = to_backend(np.full((37, 5), -1, np.int32), backend)
    g, ids = rt.route_topk(to_backend(x, backend), 5, out_gates=og, out_ids=oi)
    assert g is og and ids is oi
    rg, rids = ref.route_topk_forward(x, 5)
    np.testing.assert_array_equal(to_numpy(ids), rids)
    assert_close(g, rg, GATE_TOL, "gates")
    dx_out = to_backend(np.full((37, 24), np.nan, np.float32), backend)
    dg = rng.standard_normal((37, 5)).astype(np.float32)
    dx = rt.route_topk_backward(to_backend(dg, backend), to_backend(x, backend), ids, out=dx_out)
    assert dx is dx_out
    assert_close(dx, ref.route_topk_backward(dg, x, rids), DX_TOL["fp32"], "dlogits")


@pytest.mark.parametrize("backend", backends())
@given(data=st.data())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_routing_invariants(backend, data):
    """Hypothesis: random sizes and tie-heavy logits; ids valid and descending, renormalised gates sum to 1."""
    L = data.draw(st.integers(0, 40), "L")
    E = data.draw(st.integers(1, 80), "E")
    K = data.draw(st.integers(1, E), "K")
    score = data.draw(st.sampled_from(["softmax", "sigmoid"]), "score")
    levels = data.draw(st.integers(1, 6), "levels")
    seed = data.draw(st.integers(0, 2**31 - 1), "seed")
    rng = np.random.default_rng(seed)
    x = (rng.integers(0, levels, size=(L, E)) * 0.5).astype(np.float32)
    g, ids = _run_forward(backend, x, K, score, True, None)
    _, ref_ids = ref.route_topk_forward(x, K, score=score)
    np.testing.assert_array_equal(ids, ref_ids)
    _assert_valid_topk(ids, ref.selection_values(x, score), K, 0.0)
    if L:
        assert_close(g.sum(axis=1), np.ones(L), 1e-6, "gate sums")
        assert (np.diff(g, axis=1) <= 1e-7).all(), "gates not descending"


# ---------------------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------------------

BWD_SHAPES = [(0, 64, 8), (1, 1, 1), (1, 7, 2), (63, 7, 7), (63, 64, 8), (1000, 64, 8), (1000, 256, 8),
              (63, 256, 256), (63, 1024, 8), (1000, 1024, 2), (7, 1024, 1024)]


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("shape", BWD_SHAPES, ids=[f"L{a}-E{b}-K{c}" for a, b, c in BWD_SHAPES])
def test_backward_matches_reference(backend, dtype, mode, shape):
    score, renorm = mode
    L, E, K = shape
    rng = np.random.default_rng(L + E + K)
    x = _logits(rng, L, E, DTYPES[dtype])
    bias = _bias(rng, E)  # selection only: the backward never sees it
    xb = to_backend(x, backend)
    _, ids = rt.route_topk(xb, K, score=score, renormalize=renorm, expert_bias=to_backend(bias, backend))
    dg = rng.standard_normal((L, K)).astype(np.float32)
    dx = rt.route_topk_backward(to_backend(dg, backend), xb, ids, score=score, renormalize=renorm)
    dxn = to_numpy(dx)
    assert dxn.dtype == DTYPES[dtype] and dxn.shape == (L, E)
    expected = ref.route_topk_backward(dg, x, to_numpy(ids), score=score, renormalize=renorm)
    assert_close(dxn, expected, DX_TOL[dtype], "dlogits")
    if renorm or score == "sigmoid":  # sparse: zeros off the selection (exact from the kernel; the float64
        off = np.ones((L, E), dtype=bool)  # reference goes through the full softmax and leaves rounding)
        np.put_along_axis(off, to_numpy(ids).astype(np.int64), False, axis=1)
        d = np.abs(np.asarray(dxn, dtype=np.float64))
        limit = 0.0 if backend == "gpu" else 1e-12 * (d.max(initial=0.0) + 1e-300)
        assert (d[off] <= limit).all(), f"gradient off the selection: {d[off].max()}"


def _fd_route_grad(x, K, score, renorm, bias, w, eps=1e-6):
    """Central differences of sum(w * gates(x)) through the float64 reference forward (selection included;
    the logits are separated enough that no perturbation changes it, which is asserted)."""
    _, ids0 = ref.route_topk_forward(x, K, score=score, renormalize=renorm, expert_bias=bias)
    grad = np.zeros_like(x)
    for idx in np.ndindex(*x.shape):
        vals = []
        for sgn in (1.0, -1.0):
            xp = x.copy()
            xp[idx] += sgn * eps
            g, ids = ref.route_topk_forward(xp, K, score=score, renormalize=renorm, expert_bias=bias)
            assert np.array_equal(ids, ids0), "the selection moved under a finite-difference step"
            vals.append(float((w * g).sum()))
        grad[idx] = (vals[0] - vals[1]) / (2 * eps)
    return grad, ids0


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("use_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("E,K", [(9, 3), (33, 33), (40, 1)], ids=["E9-K3", "E33-K33", "E40-K1"])
def test_backward_finite_differences(backend, mode, use_bias, E, K):
    score, renorm = mode
    rng = np.random.default_rng(E * 10 + K)
    L = 4
    x = _logits(rng, L, E, np.float32).astype(np.float64)  # fp32-representable, so the op sees the same values
    bias = _bias(rng, E) if use_bias else None
    w = rng.standard_normal((L, K))
    fd, ids0 = _fd_route_grad(x, K, score, renorm, bias, w)
    analytic = ref.route_topk_backward(w, x, ids0, score=score, renormalize=renorm)
    assert_close(analytic, fd, 1e-6, "reference backward vs finite differences")
    x32 = x.astype(np.float32)
    _, ids = rt.route_topk(to_backend(x32, backend), K, score=score, renormalize=renorm,
                           expert_bias=None if bias is None else to_backend(bias, backend))
    np.testing.assert_array_equal(to_numpy(ids), ids0)
    dx = rt.route_topk_backward(to_backend(w.astype(np.float32), backend), to_backend(x32, backend), ids,
                                score=score, renormalize=renorm)
    assert_close(dx, fd, 1e-5, "op backward vs finite differences")


# ---------------------------------------------------------------------------------------------------------
# Auxiliary losses
# ---------------------------------------------------------------------------------------------------------

AUX_SHAPES = [(0, 7, 2), (1, 1, 1), (63, 7, 2), (1000, 64, 8), (300, 256, 8), (63, 1024, 8), (20, 64, 64),
              (5000, 128, 8)]


def _routing_ids(x, K, kind, rng):
    L, E = x.shape
    if kind == "topk":
        ids = ref.route_topk_forward(x, K)[1]
    elif kind == "one-expert":  # every token's first choice is expert 0; the rest are distinct others
        ids = np.array([[0] + list(rng.choice(np.arange(1, E), K - 1, replace=False)) for _ in range(L)]).reshape(L, K)
    else:
        raise ValueError(kind)
    return np.ascontiguousarray(ids.astype(np.int32))


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", ["topk", "one-expert"])
@pytest.mark.parametrize("shape", AUX_SHAPES, ids=[f"L{a}-E{b}-K{c}" for a, b, c in AUX_SHAPES])
def test_aux_losses_match_reference(backend, dtype, kind, shape):
    L, E, K = shape
    rng = np.random.default_rng(L + E)
    x = _logits(rng, L, E, DTYPES[dtype], scale=2.0)
    ids = _routing_ids(x, K, kind, rng)
    xb, ib = to_backend(x, backend), to_backend(ids, backend)
    lb = rt.load_balancing_loss(xb, ib)
    z = rt.router_z_loss(xb)
    assert to_numpy(lb).shape == () and to_numpy(lb).dtype == np.float32
    assert_close(lb, np.asarray(ref.load_balancing_loss(x, ids)), LOSS_TOL, "load-balancing loss")
    assert_close(z, np.asarray(ref.router_z_loss(x)), LOSS_TOL, "z-loss")
    # the same bits on a second run (fixed-order reductions)
    assert to_numpy(rt.load_balancing_loss(xb, ib)).tobytes() == to_numpy(lb).tobytes()
    assert to_numpy(rt.router_z_loss(xb)).tobytes() == to_numpy(z).tobytes()

    # upstream gradients scaled by L (as a loss scale would) keep the fp16 gradients out of the subnormals
    d_lb, d_z = 0.7 * max(L, 1), -1.3 * max(L, 1)
    dlb = rt.load_balancing_loss_backward(d_lb, xb, ib)
    dz = rt.router_z_loss_backward(to_backend(np.asarray(d_z, np.float32), backend), xb)  # device scalar
    assert to_numpy(dlb).dtype == DTYPES[dtype] and to_numpy(dlb).shape == (L, E)
    if K == E:  # every expert gets exactly L assignments: f is uniform and the gradient vanishes
        assert np.abs(np.asarray(to_numpy(dlb), np.float64)).max(initial=0.0) <= 1e-6 * abs(d_lb) * E / max(L, 1)
    else:
        assert_close(dlb, ref.load_balancing_loss_backward(d_lb, x, ids), DX_TOL[dtype], "d load-balancing")
    assert_close(dz, ref.router_z_loss_backward(d_z, x), DX_TOL[dtype], "d z-loss")


def _fd_scalar_grad(f, x, eps=1e-6):
    grad = np.zeros_like(x)
    for idx in np.ndindex(*x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        grad[idx] = (f(xp) - f(xm)) / (2 * eps)
    return grad


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("E,K", [(6, 2), (17, 5), (17, 17), (32, 1)])
def test_aux_losses_finite_differences(backend, E, K):
    rng = np.random.default_rng(E + K)
    L = 5
    x = _logits(rng, L, E, np.float32, scale=1.5).astype(np.float64)
    ids = _routing_ids(x, K, "topk", rng)
    fd_lb = _fd_scalar_grad(lambda v: ref.load_balancing_loss(v, ids), x)  # ids held fixed: f is a count
    fd_z = _fd_scalar_grad(ref.router_z_loss, x)
    if K == E:  # uniform f: the load-balancing gradient vanishes
        assert np.abs(fd_lb).max() < 1e-8
        assert np.abs(ref.load_balancing_loss_backward(1.0, x, ids)).max() < 1e-12
        assert np.abs(to_numpy(rt.load_balancing_loss_backward(1.0, to_backend(x.astype(np.float32), backend),
                                                              to_backend(ids, backend)))).max() < 1e-6
        fd_lb = None
    else:
        assert_close(ref.load_balancing_loss_backward(1.0, x, ids), fd_lb, 1e-6, "reference d lb vs FD")
    assert_close(ref.router_z_loss_backward(1.0, x), fd_z, 1e-6, "reference d z vs FD")
    x32 = to_backend(x.astype(np.float32), backend)
    ib = to_backend(ids, backend)
    if fd_lb is not None:
        assert_close(rt.load_balancing_loss_backward(1.0, x32, ib), fd_lb, 1e-5, "op d lb vs FD")
    assert_close(rt.router_z_loss_backward(1.0, x32), fd_z, 1e-5, "op d z vs FD")


def test_aux_loss_formulas_by_hand():
    """Uniform logits, perfectly balanced routing: aux = 1, z = log(E)^2; all tokens on one expert: aux = E f P."""
    E, L = 4, 8
    x = np.zeros((L, E), np.float32)
    ids = np.array([[t % E, (t + 1) % E] for t in range(L)], np.int32)
    assert_close(rt.load_balancing_loss(x, ids), np.asarray(1.0), 1e-7, "aux")
    assert_close(rt.router_z_loss(x), np.asarray(np.log(E) ** 2), 1e-7, "z")
    ids1 = np.zeros((L, 1), np.int32)
    assert_close(rt.load_balancing_loss(x, ids1), np.asarray(E * 1.0 * 0.25), 1e-7, "aux one expert")


# ---------------------------------------------------------------------------------------------------------
# Bad inputs: every case raises a clear error before anything runs
# ---------------------------------------------------------------------------------------------------------

def _x(L=4, E=8, dtype=np.float32):
    return np.random.default_rng(0).standard_normal((L, E)).astype(dtype)


BAD_FORWARD = {
    "1-D logits": (lambda: rt.route_topk(_x()[0], 2), ValueError, "2-D"),
    "3-D logits": (lambda: rt.route_topk(_x()[None], 2), ValueError, "2-D"),
    "int logits": (lambda: rt.route_topk(np.zeros((4, 8), np.int32), 2), TypeError, "dtype int32"),
    "float64 logits, float32 out_gates": (lambda: rt.route_topk(_x(dtype=np.float64), 2,
                                                                out_gates=np.zeros((4, 2), np.float32)), TypeError,
                                          "out_gates: dtype float32, expected float64"),
    "strided logits": (lambda: rt.route_topk(_x(4, 16)[:, ::2], 2), ValueError, "contiguous"),
    "not an array": (lambda: rt.route_topk(object(), 2), TypeError, "DLPack"),
    "no experts": (lambda: rt.route_topk(np.zeros((4, 0), np.float32), 1), ValueError, "at least one expert"),
    "too many experts": (lambda: rt.route_topk(np.zeros((1, rt.MAX_EXPERTS + 1), np.float32), 1), ValueError,
                         "exceeds"),
    "K = 0": (lambda: rt.route_topk(_x(), 0), ValueError, r"top_k = 0 must be in \[1, E\]"),
    "K > E": (lambda: rt.route_topk(_x(), 9), ValueError, r"top_k = 9 must be in \[1, E\] with E = 8"),
    "float K": (lambda: rt.route_topk(_x(), 2.0), TypeError, "top_k must be an int"),
    "bool K": (lambda: rt.route_topk(_x(), True), TypeError, "top_k must be an int"),
    "bad score": (lambda: rt.route_topk(_x(), 2, score="relu"), ValueError, "score must be one of"),
    "bias shape": (lambda: rt.route_topk(_x(), 2, expert_bias=np.zeros(9, np.float32)), ValueError,
                   r"expert_bias: expected shape \(8,\)"),
    "bias 2-D": (lambda: rt.route_topk(_x(), 2, expert_bias=np.zeros((1, 8), np.float32)), ValueError,
                 "expert_bias"),
    "bias dtype": (lambda: rt.route_topk(_x(), 2, expert_bias=np.zeros(8, np.float64)), TypeError,
                   "expert_bias: dtype float64"),
    "bias strided": (lambda: rt.route_topk(_x(), 2, expert_bias=np.zeros(16, np.float32)[::2]), ValueError,
                     "contiguous"),
    "out_gates shape": (lambda: rt.route_topk(_x(), 2, out_gates=np.zeros((4, 3), np.float32)), ValueError,
                        "out_gates: shape"),
    "out_gates dtype": (lambda: rt.route_topk(_x(), 2, out_gates=np.zeros((4, 2), np.float64)), TypeError,
                        "out_gates: dtype"),
    "out_gates strided": (lambda: rt.route_topk(_x(), 2, out_gates=np.zeros((4, 4), np.float32)[:, ::2]),
                          ValueError, "contiguous"),
    "out_ids dtype": (lambda: rt.route_topk(_x(), 2, out_ids=np.zeros((4, 2), np.int64)), TypeError,
                      "out_ids: dtype"),
}


@pytest.mark.parametrize("case", list(BAD_FORWARD))
def test_bad_forward_inputs(case):
    fn, exc, match = BAD_FORWARD[case]
    with pytest.raises(exc, match=match):
        fn()


_IDS = np.array([[0, 1], [2, 3], [4, 5], [6, 7]], np.int32)
_DG = np.ones((4, 2), np.float32)

BAD_BACKWARD = {
    "dgates shape": (lambda: rt.route_topk_backward(np.ones((4, 3), np.float32), _x(), _IDS), ValueError,
                     r"dgates: expected shape \(4, 2\)"),
    "dgates dtype": (lambda: rt.route_topk_backward(np.ones((4, 2), np.float64), _x(), _IDS), TypeError,
                     "dgates: dtype float64"),
    "ids dtype": (lambda: rt.route_topk_backward(_DG, _x(), _IDS.astype(np.int64)), TypeError, "int32"),
    "ids float": (lambda: rt.route_topk_backward(_DG, _x(), _IDS.astype(np.float32)), TypeError, "integer"),
    "ids rows": (lambda: rt.route_topk_backward(_DG[:3], _x(), _IDS[:3]), ValueError, "3 rows, logits have L = 4"),
    "ids K > E": (lambda: rt.route_topk_backward(np.ones((4, 9), np.float32), _x(), np.zeros((4, 9), np.int32)),
                  ValueError, r"K = 9 must be in \[1, E\]"),
    "ids out of range": (lambda: rt.route_topk_backward(_DG, _x(), _IDS + 1), ValueError, r"in \[0, 8\)"),
    "negative ids": (lambda: rt.route_topk_backward(_DG, _x(), _IDS - 1), ValueError, r"in \[0, 8\)"),
    "repeated ids": (lambda: rt.route_topk_backward(_DG, _x(), np.zeros((4, 2), np.int32)), ValueError, "distinct"),
    "out dtype": (lambda: rt.route_topk_backward(_DG, _x(), _IDS, out=np.zeros((4, 8), np.float16)), TypeError,
                  "out: dtype float16"),
    "bad score": (lambda: rt.route_topk_backward(_DG, _x(), _IDS, score="tanh"), ValueError, "score"),
}


@pytest.mark.parametrize("case", list(BAD_BACKWARD))
def test_bad_backward_inputs(case):
    fn, exc, match = BAD_BACKWARD[case]
    with pytest.raises(exc, match=match):
        fn()


BAD_AUX = {
    "lb ids out of range": (lambda: rt.load_balancing_loss(_x(), _IDS + 1), ValueError, r"in \[0, 8\)"),
    "lb ids dtype": (lambda: rt.load_balancing_loss(_x(), _IDS.astype(np.int64)), TypeError, "int32"),
    "lb ids 1-D": (lambda: rt.load_balancing_loss(_x(), _IDS[:, 0]), ValueError, "2-D"),
    "lb logits dtype": (lambda: rt.load_balancing_loss(_x(dtype=np.int64), _IDS), TypeError, "int64"),
    "lb float64 out": (lambda: rt.load_balancing_loss(_x(), _IDS, out=np.zeros((), np.float64)), TypeError,
                       "out: dtype float64, expected float32"),
    "z logits 1-D": (lambda: rt.router_z_loss(_x()[0]), ValueError, "2-D"),
    "dloss shape": (lambda: rt.router_z_loss_backward(np.ones(2, np.float32), _x()), ValueError, "one element"),
    "dloss bool": (lambda: rt.router_z_loss_backward(True, _x()), TypeError, "bool"),
    "dloss string": (lambda: rt.load_balancing_loss_backward("1", _x(), _IDS), TypeError, "dloss"),
    "lb out shape": (lambda: rt.load_balancing_loss(_x(), _IDS, out=np.zeros(1, np.float32)), ValueError,
                     "out: shape"),
    "lb grad out shape": (lambda: rt.load_balancing_loss_backward(1.0, _x(), _IDS, out=np.zeros((4, 7), np.float32)),
                          ValueError, "out: shape"),
}


@pytest.mark.parametrize("case", list(BAD_AUX))
def test_bad_aux_inputs(case):
    fn, exc, match = BAD_AUX[case]
    with pytest.raises(exc, match=match):
        fn()


# ---------------------------------------------------------------------------------------------------------
# GPU only: device checks, empty inputs launch nothing, unaligned rows, large E, streams
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_device_mismatch_and_validate():
    import cupy as cp

    x = cp.asarray(_x())
    with pytest.raises(ValueError, match="same device"):
        rt.route_topk(x, 2, expert_bias=np.zeros(8, np.float32))
    with pytest.raises(ValueError, match="out_gates: on CPU"):
        rt.route_topk(x, 2, out_gates=np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError, match="same device"):
        rt.route_topk_backward(_DG, x, cp.asarray(_IDS))
    with pytest.raises(ValueError, match=r"in \[0, 8\)"):
        rt.route_topk_backward(cp.asarray(_DG), x, cp.asarray(_IDS + 1), validate=True)
    with pytest.raises(ValueError, match="distinct"):
        rt.route_topk_backward(cp.asarray(_DG), x, cp.zeros((4, 2), cp.int32), validate=True)
    with pytest.raises(ValueError, match=r"in \[0, 8\)"):
        rt.load_balancing_loss(x, cp.asarray(_IDS - 1), validate=True)
    with pytest.raises(TypeError, match="dloss: dtype float64"):
        rt.router_z_loss_backward(cp.ones((), cp.float64), x)


@pytest.mark.gpu
def test_gpu_bad_ids_never_fault():
    """Without validate, out-of-range ids are skipped (no fault, in-range entries still right)."""
    import cupy as cp

    x = _x(4, 8)
    ids = _IDS.copy()
    ids[1, 1] = 1000
    ids[2, 0] = -5
    dx = rt.route_topk_backward(cp.asarray(_DG), cp.asarray(x), cp.asarray(ids), score="sigmoid", renormalize=False)
    lb = rt.load_balancing_loss(cp.asarray(x), cp.asarray(ids))
    cp.cuda.get_current_stream().synchronize()
    dxn = to_numpy(dx)
    assert np.isfinite(dxn).all()
    s = 1 / (1 + np.exp(-x.astype(np.float64)))
    assert_close(dxn[0, :2], (s * (1 - s))[0, :2], 1e-6, "valid row")
    assert np.isfinite(to_numpy(lb))


@pytest.mark.gpu
def test_gpu_empty_launches_nothing(monkeypatch):
    import cupy as cp

    def no_kernels(*a, **k):
        raise AssertionError("a kernel was requested for L = 0")

    monkeypatch.setattr(_compile, "get_function", no_kernels)
    x = cp.zeros((0, 64), cp.float32)
    g, ids = rt.route_topk(x, 8)
    assert to_numpy(g).shape == (0, 8) and to_numpy(ids).shape == (0, 8)
    dx = rt.route_topk_backward(cp.zeros((0, 8), cp.float32), x, ids)
    assert to_numpy(dx).shape == (0, 64)
    assert to_numpy(rt.router_z_loss_backward(1.0, x)).shape == (0, 64)
    assert to_numpy(rt.load_balancing_loss_backward(1.0, x, ids)).shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_gpu_unaligned_rows_take_the_scalar_path(dtype, mode):
    """A view starting one element into its allocation cannot use vector loads; results stay right."""
    import cupy as cp

    score, renorm = mode
    L, E, K = 63, 64, 8
    rng = np.random.default_rng(5)
    x = _logits(rng, L, E, DTYPES[dtype])
    flat = np.concatenate([np.zeros(1, DTYPES[dtype]), x.reshape(-1)])
    base = to_backend(flat, "gpu")
    xv = base[1:].reshape(L, E)
    assert xv.data.ptr % 16 != 0
    g, ids = rt.route_topk(xv, K, score=score, renormalize=renorm)
    _, rids = ref.route_topk_forward(x, K, score=score, renormalize=renorm)
    np.testing.assert_array_equal(to_numpy(ids), rids)
    assert_close(g, ref.gates_for_ids(x, rids, score, renorm), GATE_TOL, "gates")
    dg = rng.standard_normal((L, K)).astype(np.float32)
    out = cp.zeros(L * E + 1, dtype=xv.dtype)[1:].reshape(L, E)
    dx = rt.route_topk_backward(cp.asarray(dg), xv, ids, score=score, renormalize=renorm, out=out)
    assert_close(dx, ref.route_topk_backward(dg, x, rids, score=score, renormalize=renorm), DX_TOL[dtype], "dlogits")
    assert_close(rt.router_z_loss(xv), np.asarray(ref.router_z_loss(x)), LOSS_TOL, "z")
    assert_close(rt.router_z_loss_backward(1.0, xv), ref.router_z_loss_backward(1.0, x), DX_TOL[dtype], "dz")


LARGE_E = [(63, 1025, 8), (40, 2048, 2048), (300, 4096, 8), (17, 8192, 8), (5, 8192, 8192)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("shape", LARGE_E, ids=[f"L{a}-E{b}-K{c}" for a, b, c in LARGE_E])
def test_gpu_large_expert_counts(dtype, mode, shape):
    """E > 1024 runs a 256-thread block per row (shared-memory reductions)."""
    L, E, K = shape
    score, renorm = mode
    for use_bias in (False, True):
        _check_forward("gpu", L, E, K, dtype, score, renorm, use_bias, seed=E)
    rng = np.random.default_rng(E + 1)
    x = _logits(rng, L, E, DTYPES[dtype])
    xb = to_backend(x, "gpu")
    _, ids = rt.route_topk(xb, K, score=score, renormalize=renorm)
    dg = rng.standard_normal((L, K)).astype(np.float32)
    dx = rt.route_topk_backward(to_backend(dg, "gpu"), xb, ids, score=score, renormalize=renorm)
    assert_close(dx, ref.route_topk_backward(dg, x, to_numpy(ids), score=score, renormalize=renorm),
                 DX_TOL[dtype], "dlogits")
    idn = to_numpy(ids)
    assert_close(rt.load_balancing_loss(xb, ids), np.asarray(ref.load_balancing_loss(x, idn)), LOSS_TOL, "lb")
    d_lb = rt.load_balancing_loss_backward(0.5, xb, ids)
    if K == E:
        # every expert takes every token: f_e = 1/E, the loss is sum_e P_e = 1 and its gradient is exactly 0;
        # a relative error against the float64 rounding noise is meaningless, so check the absolute size
        # against the gradient scale of one softmax entry (0.5 * E / L)
        assert np.abs(to_numpy(d_lb).astype(np.float64)).max() < 1e-6 * 0.5 * E / L, "d lb: expected 0 for K == E"
    else:
        assert_close(d_lb, ref.load_balancing_loss_backward(0.5, x, idn), DX_TOL[dtype], "d lb")
    assert_close(rt.router_z_loss(xb), np.asarray(ref.router_z_loss(x)), LOSS_TOL, "z")


@pytest.mark.gpu
def test_gpu_non_default_stream_and_allocator():
    import cupy as cp

    from blazecore import _array

    rng = np.random.default_rng(9)
    x = _logits(rng, 500, 128, BF16)
    made = []

    def alloc(shape, dtype_name):
        a = cp.empty(shape, dtype=cp.uint16 if dtype_name == "bfloat16" else dtype_name)
        made.append(a)
        return a

    # the inputs are copied to the device on the current stream, which a non-blocking stream does not wait for: they
    # must be complete before the work on s reads them
    xd, dg = to_backend(x, "gpu"), cp.ones((500, 8), cp.float32)
    cp.cuda.Device().synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    with _array.allocator(alloc):
        g, ids = rt.route_topk(xd, 8, stream=s)
        dx = rt.route_topk_backward(dg, xd, ids, stream=s.ptr)
    s.synchronize()
    assert any(g is a for a in made) and any(ids is a for a in made) and any(dx is a for a in made)
    _, rids = ref.route_topk_forward(x, 8)
    np.testing.assert_array_equal(to_numpy(ids), rids)


@pytest.mark.gpu
def test_gpu_outputs_on_the_callers_stream_while_the_current_one_is_busy():
    """Each call allocates (and, in tests, poisons) its outputs on the stream it was given: with CuPy's current
    stream kept busy, a fill left there would land after the kernels on ``stream`` and overwrite their results."""
    import cupy as cp

    rng = np.random.default_rng(11)
    L, E, K = 4096, 64, 8
    x = _logits(rng, L, E, BF16)
    dgh = rng.standard_normal((L, K)).astype(np.float32)
    xd, dg = to_backend(x, "gpu"), cp.asarray(dgh)
    s = cp.cuda.Stream(non_blocking=True)
    busy = cp.cuda.Stream(non_blocking=True)

    def calls():
        g, ids = rt.route_topk(xd, K, stream=s)
        return (g, ids, rt.route_topk_backward(dg, xd, ids, stream=s), rt.load_balancing_loss(xd, ids, stream=s),
                rt.router_z_loss(xd, stream=s), rt.load_balancing_loss_backward(1.0, xd, ids, stream=s),
                rt.router_z_loss_backward(1.0, xd, stream=s))

    calls()  # every kernel loaded first: loading a module waits for the whole device, which would hide the race
    cp.cuda.Device().synchronize()
    a = cp.ones((4096, 4096), cp.float32)
    with busy:
        for _ in range(20):  # tens of ms of work ahead of anything else queued on this stream
            a = a @ a * np.float32(1e-4)
        g, ids, dx, lb, z, dlb, dz = calls()
    s.synchronize()
    busy.synchronize()  # anything left on the busy stream has landed too
    _, rids = ref.route_topk_forward(x, K)
    np.testing.assert_array_equal(to_numpy(ids), rids)
    assert_close(g, ref.gates_for_ids(x, rids, "softmax", True), GATE_TOL, "gates")
    assert_close(dx, ref.route_topk_backward(dgh, x, rids), DX_TOL["bf16"], "dlogits")
    assert_close(lb, np.asarray(ref.load_balancing_loss(x, rids)), LOSS_TOL, "load-balancing loss")
    assert_close(z, np.asarray(ref.router_z_loss(x)), LOSS_TOL, "z-loss")
    assert_close(dlb, ref.load_balancing_loss_backward(1.0, x, rids), DX_TOL["bf16"], "d load-balancing")
    assert_close(dz, ref.router_z_loss_backward(1.0, x), DX_TOL["bf16"], "d z-loss")


def test_kernel_table_is_registered():
    names = _compile.KERNELS["router.cu"]
    for kernel, ct, (w, v) in itertools.product(rt._ROW_KERNELS, rt._CTYPES.values(), rt._ROW_CONFIGS):
        assert rt._name(kernel, ct, w, v) in names
    assert rt._FINALIZE in names
    assert rt.MAX_EXPERTS == 8192
