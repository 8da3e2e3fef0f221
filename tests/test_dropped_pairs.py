"""Dropped pairs: an expert id of -1 sends its (token, k) pair to no expert.

Spec under test:

- ``build_dispatch``: -1 may stand anywhere, any number of times in a row (several -1 are not a repeat); other
  negative ids and ids >= E are still rejected (validate=True). ``expert_offsets`` counts routed pairs only
  (``expert_offsets[E]`` = pairs with id >= 0); slots [0, offsets[E]) hold the routed pairs by expert, then by flat
  pair index t*K + k; slots [offsets[E], L*K) hold the dropped pairs in flat pair order; ``pair_slot`` is -1 at a
  dropped pair. ``counts()`` counts routed pairs.
- ``moe_forward`` / ``moe_backward``: a dropped pair adds nothing to y; dx, dw13, dw2, db13, db2 are those of the
  layer without the pair; dgates is exactly 0 at a dropped pair whatever its gate; a token whose pairs are all
  dropped gets y = 0 and dx = 0 exactly; experts left with no routed pair get exactly zero weight gradients.
- The torch and JAX adapters pass -1 through with the same meaning.

The expected results come from independent constructions, not from the library's handling of -1:

- dispatch: ``blazecore.testing.argsort_dispatch`` over E + 1 experts with every dropped pair moved to the extra
  expert E (a stable sort puts them after all routed pairs, in flat order), plus the invariants checked directly,
  plus one example written out by hand;
- layer: the same layer with each dropped pair replaced by a valid placeholder expert (one its row does not use)
  and a gate of exactly 0 (its contribution to y and to every gradient but dgates is then exactly 0); on the CPU
  through the library, on the GPU through the float64 reference (``blazecore.reference.moe``) on those ids;
- a per-(token, k) float64 loop written here (forward and backward by hand) for a tiny case;
- torch: ``torch.autograd.gradcheck`` of moe_ffn with dropped pairs; JAX: a jax.numpy layer that masks the
  dropped pairs' gates with ``jnp.where``.
"""

from __future__ import annotations

import math
import os
import zlib

import numpy as np
import pytest
from conftest import assert_close, backends, to_backend, to_numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_dispatch import ALL_PLANS, DISPATCH_FIELDS, PLAN_SHAPES, assert_int_equal, dispatch_fields
from test_moe import DTYPES, GRAD_KEYS, TOL, _bytes

import blazecore
from blazecore import _array, chunk_bounds
from blazecore import dispatch as D
from blazecore.dispatch import build_dispatch
from blazecore.reference import moe as ref
from blazecore.testing import argsort_dispatch, make_routing

# JAX shares a GPU with CuPy's pool in this process (as in test_jax_adapter.py); set before JAX starts a backend
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

DROP = -1
F64 = np.dtype(np.float64)
# float64 inputs run the float64 reference on the CPU: the dropped-pair run and the gate-0 run differ by rounding
# at most (TOL's float32 / bf16 entries are the existing tables of test_moe.py)
TOL_F64 = 1e-12
CPU_DTYPES = {"f64": F64, "f32": np.dtype(np.float32)}
ID_DTYPES = [pytest.param(np.int32, id="i32"), pytest.param(np.int64, id="i64")]
WEIGHT_GRADS = ("dw13", "dw2", "db13", "db2")


def _tol(dtype) -> float:
    return TOL_F64 if np.dtype(dtype) == F64 else TOL[np.dtype(dtype)]


# ---------------------------------------------------------------------------------------------
# Routings with dropped pairs
# ---------------------------------------------------------------------------------------------


def _drop(rng, ids: np.ndarray, kind: str, num_experts: int) -> np.ndarray:
    """A copy of ``ids`` with -1 at the dropped pairs of ``kind``:

    none: nothing dropped (the behaviour before -1 existed);
    all: every pair dropped;
    mixed: about 30% of the pairs at random, plus the first and the last pair in flat order, a token with all its
        pairs dropped (row 1), two non-adjacent -1 in row 2 (k = 0 and 2) and two adjacent ones in row 3 (k >= 1);
    capacity: in flat pair order each expert keeps its first ``cap`` pairs and drops the rest (capacity-factor
        dropping), and expert E-1 drops all of its pairs (it is left with none).
    """
    ids = np.array(ids, copy=True)
    L, K = ids.shape
    if kind == "none" or ids.size == 0:
        return ids
    if kind == "all":
        ids[...] = DROP
        return ids
    if kind == "mixed":
        drop = rng.random((L, K)) < 0.3
        drop[0, 0] = drop[-1, -1] = True
        if L > 1:
            drop[1, :] = True
        if L > 2 and K > 2:
            drop[2, :] = False
            drop[2, ::2] = True
        if L > 3 and K > 2:
            drop[3, :] = False
            drop[3, 1:] = True
        ids[drop] = DROP
        return ids
    if kind == "capacity":
        cap = max(1, (L * K) // (2 * num_experts))
        seen = np.zeros(num_experts, np.int64)
        flat = ids.reshape(-1)
        for f in range(flat.size):
            e = int(flat[f])
            if e == num_experts - 1 or seen[e] >= cap:
                flat[f] = DROP
            else:
                seen[e] += 1
        return ids
    raise ValueError(kind)


DROP_KINDS = ["mixed", "capacity", "all", "none"]


def _gate0(ids: np.ndarray, gates: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """The same routing without -1: each dropped pair gets an expert its row does not use (the smallest free one,
    distinct within the row) and a gate of exactly 0. Every contribution of such a pair but its dgates is 0."""
    ids0, g0 = np.array(ids, copy=True), np.array(gates, copy=True)
    for t in range(ids.shape[0]):
        row = ids[t]
        used = set(int(e) for e in row[row >= 0])
        free = [e for e in range(num_experts) if e not in used]
        for k in np.flatnonzero(row < 0):
            ids0[t, k] = free.pop(0)
            g0[t, k] = 0.0
    assert (ids0 >= 0).all()
    return ids0, g0


# ---------------------------------------------------------------------------------------------
# build_dispatch
# ---------------------------------------------------------------------------------------------


def _oracle(ids: np.ndarray, num_experts: int):
    """(expert_offsets, slot_token, slot_k, pair_slot) expected for ``ids`` with -1: the argsort oracle over E + 1
    experts with the dropped pairs on expert E (a stable sort: after every routed pair, in flat order)."""
    ids = np.asarray(ids)
    moved = np.where(ids < 0, num_experts, ids.astype(np.int64))
    off, st_, sk, ps = argsort_dispatch(moved, num_experts + 1)
    return off[: num_experts + 1], st_, sk, np.where(ids < 0, -1, ps)


def check_dropped_dispatch(d, ids: np.ndarray, num_experts: int, backend: str) -> None:
    """Every invariant of a dispatch of ids holding -1, then equality with the oracle."""
    ids = np.asarray(ids)
    L, K = ids.shape
    n, E = L * K, num_experts
    routed = ids >= 0
    n_routed = int(routed.sum())
    off, st_, sk, ps = dispatch_fields(d, L, K, E, backend)

    # offsets: an exclusive scan of the routed counts; offsets[E] is the number of routed pairs
    counts = np.bincount(ids[routed].astype(np.int64), minlength=E)
    assert off[0] == 0 and off[-1] == n_routed, f"expert_offsets[0], [E] = {off[0]}, {off[-1]}; {n_routed} routed"
    assert_int_equal(np.diff(off), counts, "routed pairs per expert")
    assert_int_equal(d.counts(), counts, "counts()")
    # (slot_token, slot_k) is a permutation of all L*K pairs, dropped ones included
    assert ((0 <= st_) & (st_ < L)).all() and ((0 <= sk) & (sk < K)).all(), "slot_token/slot_k out of range"
    flat = st_ * K + sk
    assert_int_equal(np.sort(flat), np.arange(n), "pairs covered by slots")
    # routed slots: each in its expert's range, in flat pair order within an expert
    head = flat[:n_routed]
    slot_expert = np.repeat(np.arange(E), counts)
    assert_int_equal(ids.reshape(-1)[head] if n_routed else head, slot_expert, "expert of each routed slot")
    if n_routed > 1:
        same_expert = slot_expert[1:] == slot_expert[:-1]
        assert (np.diff(head) > 0)[same_expert].all(), "an expert's slots are not in flat pair order"
    # dropped slots: the dropped pairs in flat pair order
    assert_int_equal(flat[n_routed:], np.flatnonzero(~routed.reshape(-1)), "dropped pairs in slots [offsets[E], L*K)")
    # pair_slot: -1 at a dropped pair, the inverse of (slot_token, slot_k) at a routed one
    assert_int_equal(ps[~routed], np.full(n - n_routed, -1), "pair_slot of dropped pairs")
    assert_int_equal(ps.reshape(-1)[head] if n_routed else head, np.arange(n_routed), "pair_slot of routed pairs")
    # the independent oracle
    for name, want in zip(DISPATCH_FIELDS, _oracle(ids, E), strict=True):
        assert_int_equal(getattr(d, name), want, f"{name} vs the argsort oracle")


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", ID_DTYPES)
def test_dispatch_worked_example(backend, dtype):
    """A small routing with every expected array written out by hand."""
    ids = np.array([[2, -1], [-1, -1], [0, 2], [-1, 1]], dtype=dtype)
    d = build_dispatch(to_backend(ids, backend), 3)
    # routed pairs by expert then flat index: e0 {f4}, e1 {f7}, e2 {f0, f5}; dropped f1, f2, f3, f6
    assert_int_equal(d.expert_offsets, [0, 1, 2, 4], "expert_offsets")
    assert_int_equal(d.slot_token, [2, 3, 0, 2, 0, 1, 1, 3], "slot_token")
    assert_int_equal(d.slot_k, [0, 1, 0, 1, 1, 0, 1, 0], "slot_k")
    assert_int_equal(d.pair_slot, [[2, -1], [-1, -1], [0, 3], [-1, 1]], "pair_slot")
    assert_int_equal(d.counts(), [1, 1, 2], "counts()")
    check_dropped_dispatch(d, ids, 3, backend)


DISPATCH_SHAPES = [
    pytest.param(1, 1, 1, id="L1-K1-E1"),
    pytest.param(7, 3, 4, id="L7-K3-E4"),
    pytest.param(63, 2, 8, id="L63"),
    pytest.param(100, 8, 8, id="K_eq_E"),
    pytest.param(300, 40, 64, id="K40"),  # K > 32: a warp per row on the GPU
    pytest.param(3000, 4, 16, id="multi_tile"),  # several CPU reference tiles (1024 tokens) and GPU tiles
]


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", ID_DTYPES)
@pytest.mark.parametrize("kind", DROP_KINDS)
@pytest.mark.parametrize("L,K,E", DISPATCH_SHAPES)
def test_dispatch_dropped_invariants(backend, dtype, kind, L, K, E):
    rng = np.random.default_rng(zlib.crc32(f"disp-{L}-{K}-{E}-{kind}".encode()))
    ids = _drop(rng, make_routing(rng, L, E, K, "uniform", dtype), kind, E)
    if kind == "mixed" and L > 3 and K > 2:
        assert (ids[1] == -1).all() and (ids[2] == -1).sum() >= 2 and (ids[3] == -1).sum() >= 2
    d = build_dispatch(to_backend(ids, backend), E)
    check_dropped_dispatch(d, ids, E, backend)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", ID_DTYPES)
def test_dispatch_nothing_dropped_is_unchanged(backend, dtype):
    """Without -1 the dispatch is the argsort oracle's, as before: offsets[E] == L*K, no pair_slot of -1."""
    for kind in ("uniform", "skewed", "all_to_one", "empty_experts"):
        ids = make_routing(np.random.default_rng(3), 500, 16, 4, kind, dtype)
        d = build_dispatch(to_backend(ids, backend), 16)
        for name, want in zip(("expert_offsets", "slot_token", "slot_k", "pair_slot"), argsort_dispatch(ids, 16),
                              strict=True):
            assert_int_equal(getattr(d, name), want, f"{kind}: {name}")
        check_dropped_dispatch(d, ids, 16, backend)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", ID_DTYPES)
def test_dispatch_all_dropped(backend, dtype):
    """Every pair dropped: all offsets 0, every pair_slot -1, the slots hold the pairs in flat order."""
    L, K, E = 37, 3, 5
    ids = np.full((L, K), -1, dtype=dtype)
    d = build_dispatch(to_backend(ids, backend), E)
    assert_int_equal(d.expert_offsets, np.zeros(E + 1), "expert_offsets")
    assert_int_equal(d.counts(), np.zeros(E), "counts()")
    assert_int_equal(d.pair_slot, np.full((L, K), -1), "pair_slot")
    assert_int_equal(d.slot_token, np.arange(L * K) // K, "slot_token")
    assert_int_equal(d.slot_k, np.arange(L * K) % K, "slot_k")
    check_dropped_dispatch(d, ids, E, backend)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", ID_DTYPES)
def test_dispatch_validation_accepts_minus_one(backend, dtype):
    """validate=True accepts -1 anywhere: several in one row (not a repeat), a whole row, the first and last pair."""
    ids = np.array([[-1, 0, -1], [-1, -1, -1], [3, -1, 1], [2, 1, 0], [-1, 3, -1]], dtype=dtype)
    check_dropped_dispatch(build_dispatch(to_backend(ids, backend), 4, validate=True), ids, 4, backend)


def _valid(L=8, K=3, E=4, dtype=np.int32):
    return make_routing(np.random.default_rng(1), L, E, K, "uniform", dtype)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", ID_DTYPES)
@pytest.mark.parametrize("value", [pytest.param(-2, id="minus2"), pytest.param(-5, id="minus5"),
                                   pytest.param(4, id="eq_E"), pytest.param(1000, id="large")])
def test_dispatch_validation_rejects_other_ids(backend, dtype, value):
    """Negative ids other than -1 and ids >= E are still rejected, also in a row that holds -1."""
    ids = _valid(dtype=dtype)
    ids[2, 0] = value
    with pytest.raises(ValueError, match=r"is outside \[0, 4\)"):
        build_dispatch(to_backend(ids, backend), 4)
    ids[2, 1] = -1
    with pytest.raises(ValueError, match=r"is outside \[0, 4\)"):
        build_dispatch(to_backend(ids, backend), 4)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("value", [pytest.param(2**32 - 1, id="2^32-1"), pytest.param(-(2**32) - 1, id="-2^32-1")])
def test_dispatch_validation_int64_that_wraps_to_minus_one(backend, value):
    """An int64 id whose low 32 bits read -1 (0xFFFFFFFF) is out of range, not a dropped pair."""
    ids = _valid(dtype=np.int64)
    assert np.int64(value).astype(np.int32) == -1
    ids[5, 2] = value
    with pytest.raises(ValueError, match=r"is outside \[0, 4\)"):
        build_dispatch(to_backend(ids, backend), 4)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", ID_DTYPES)
def test_dispatch_validation_repeat_beside_minus_one(backend, dtype):
    """A real expert twice in a row is still a repeat when the row also holds -1."""
    ids = _valid(dtype=dtype)
    ids[4] = [1, -1, 1]
    with pytest.raises(ValueError, match="repeats"):
        build_dispatch(to_backend(ids, backend), 4)


@pytest.mark.parametrize("backend", backends())
def test_dispatch_validation_names_the_bad_pair_not_a_minus_one(backend):
    """-1 before the first bad id is not what is reported: the error names the -2."""
    ids = _valid(L=40)
    ids[0, 0] = ids[1, 1] = ids[3, 0] = -1
    ids[3, 1] = -2
    ids[30, 2] = 4
    with pytest.raises(ValueError, match=r"is outside \[0, 4\)") as err:
        build_dispatch(to_backend(ids, backend), 4)
    assert "expert_ids[3, 1]" in str(err.value), str(err.value)


def test_dispatch_validate_false_cpu_keeps_minus_one():
    """validate=False on the CPU: -1 is a dropped pair (not clamped to expert 0), the same dispatch as validated."""
    rng = np.random.default_rng(12)
    ids = _drop(rng, make_routing(rng, 200, 8, 3, "uniform"), "mixed", 8)
    d = build_dispatch(ids, 8, validate=False)
    check_dropped_dispatch(d, ids, 8, "cpu")


@st.composite
def dropped_routings(draw):
    E = draw(st.integers(1, 48))
    K = draw(st.integers(1, min(E, 9)))
    L = draw(st.one_of(st.sampled_from([0, 1, 2]), st.integers(0, 400)))
    p = draw(st.sampled_from([0.0, 0.05, 0.5, 0.9, 1.0]))
    kind = draw(st.sampled_from(("uniform", "skewed", "all_to_one", "empty_experts")))
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ids = make_routing(rng, L, E, K, kind, dtype)
    ids[rng.random((L, K)) < p] = -1
    return ids, E


@pytest.mark.parametrize("backend", backends())
@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(case=dropped_routings())
def test_dispatch_fuzz(backend, case):
    ids, E = case
    check_dropped_dispatch(build_dispatch(to_backend(ids, backend), E), ids, E, backend)


# ---------------------------------------------------------------------------------------------
# The layer: inputs, runs, checks
# ---------------------------------------------------------------------------------------------


def _make(rng, L, d, h, E, K, dtype, activation, bias, kind, id_dtype=np.int32) -> dict:
    """Layer inputs whose routing has dropped pairs of ``kind``; the gates of dropped pairs are large values of
    either sign (never 0), so a pair that was not really dropped shows in y and in the gradients."""
    dtype = np.dtype(dtype)
    R = 2 * h if blazecore.activation_info(activation) else h
    inp = {
        "x": rng.standard_normal((L, d)).astype(dtype),
        "w13": (rng.standard_normal((E, R, d)) / math.sqrt(d)).astype(dtype),
        "w2": (rng.standard_normal((E, d, h)) / math.sqrt(h)).astype(dtype),
        "b13": (0.1 * rng.standard_normal((E, R))).astype(dtype) if bias else None,
        "b2": (0.1 * rng.standard_normal((E, d))).astype(dtype) if bias else None,
        "dy": rng.standard_normal((L, d)).astype(dtype),
        "ids": _drop(rng, make_routing(rng, L, E, K, "uniform", id_dtype), kind, E),
    }
    g = rng.random((L, K)) + 0.1
    g /= g.sum(axis=1, keepdims=True)
    drop = inp["ids"] < 0
    g[drop] = rng.choice([-3.0, 2.5, 7.0], size=int(drop.sum()))
    inp["gates"] = g.astype(F64 if dtype == F64 else np.float32)
    inp["E"] = E
    return inp


def _run(inp: dict, ids, gates, backend: str, activation: str, checkpoint: str = "ab", **kw):
    """moe_forward + moe_backward of ``inp`` with the given routing on ``backend``: (y, saved, grads)."""

    def dev(a):
        return None if a is None else to_backend(a, backend)

    y, saved = blazecore.moe_forward(dev(inp["x"]), dev(inp["w13"]), dev(inp["w2"]), dev(gates), dev(ids),
                                     activation=activation, checkpoint=checkpoint, b13=dev(inp["b13"]),
                                     b2=dev(inp["b2"]), **kw)
    grads = blazecore.moe_backward(dev(inp["dy"]), saved)
    return y, saved, grads


def _gate0_run(inp: dict, activation: str, checkpoint: str = "ab"):
    """The library (CPU) on the gate-0 construction: y and the gradients as a dict."""
    ids0, g0 = _gate0(inp["ids"], inp["gates"], inp["E"])
    y, _, g = _run(inp, ids0.astype(inp["ids"].dtype), g0, "cpu", activation, checkpoint)
    return np.asarray(y, np.float64), {k: getattr(g, k) for k in GRAD_KEYS}


def _gate0_reference(inp: dict, activation: str, preact_dtype=None):
    """The float64 reference on the gate-0 construction (no -1 reaches it): y and the gradients as a dict."""
    ids0, g0 = _gate0(inp["ids"], inp["gates"], inp["E"])
    args = (inp["x"], inp["w13"], inp["w2"], g0, ids0, activation, inp["b13"], inp["b2"])
    y = ref.moe_forward_ref(*args)
    return y, ref.moe_backward_ref(inp["dy"], *args, preact_dtype=preact_dtype)


def _f64(a) -> np.ndarray:
    return np.asarray(to_numpy(a), dtype=np.float64)


def _grad(grads, key):
    """A gradient of MoEGrads, or of a dict of them (the adapters' results)."""
    return grads[key] if isinstance(grads, dict) else getattr(grads, key)


def _check_exact_zeros(y, grads, ids: np.ndarray, num_experts: int, what: str = "") -> None:
    """dgates is exactly 0 at every dropped pair; a token with all pairs dropped has y = dx = 0 exactly; an expert
    with no routed pair has exactly zero weight and bias gradients."""
    drop = ids < 0
    dg = _f64(_grad(grads, "dgates"))
    bad = np.argwhere(drop & (dg != 0))
    assert not bad.size, f"{what}dgates of dropped pair {tuple(bad[0])} is {dg[tuple(bad[0])]}, not 0"
    empty = drop.all(axis=1)
    if empty.any():
        for name, a in (("y", y), ("dx", _grad(grads, "dx"))):
            rows = _f64(a)[empty]
            assert not np.any(rows), f"{what}{name}: nonzero row for a token whose pairs are all dropped"
    unused = np.bincount(ids[~drop].astype(np.int64), minlength=num_experts) == 0
    for key in WEIGHT_GRADS:
        g = _grad(grads, key)
        if g is not None and unused.any():
            assert not np.any(_f64(g)[unused]), f"{what}{key}: nonzero gradient for an expert with no routed pair"


def _check(y, grads, exp, inp: dict, tol: float, what: str = "", dtypes: bool = True) -> None:
    """y and every gradient against ``exp`` (y, grads dict) of the layer without the dropped pairs; dgates at the
    routed pairs only (the gate-0 construction's dgates at a dropped pair is that pair's dy . o, not 0); then the
    exact zeros. ``dtypes``: also check the results' dtypes (core results; the adapters' come as float64 NumPy)."""
    exp_y, exp_g = exp
    ids = inp["ids"]
    dtype = np.dtype(inp["x"].dtype)

    def dtype_is(a, want, name):
        if dtypes:
            assert blazecore.logical_dtype(blazecore.asarray(a)) == want, f"{what}{name} dtype"

    dtype_is(y, dtype, "y")
    assert_close(y, exp_y, tol, f"{what}y")
    for key in ("dx", "dw13", "dw2", "db13", "db2"):
        got, want = _grad(grads, key), exp_g[key]
        if want is None:
            assert got is None, f"{what}{key}: expected None without a bias"
            continue
        dtype_is(got, dtype, key)
        assert_close(got, _f64(want), tol, f"{what}{key}")
    dtype_is(_grad(grads, "dgates"), F64 if dtype == F64 else np.dtype(np.float32), "dgates")
    routed = ids >= 0
    assert_close(_f64(_grad(grads, "dgates"))[routed], _f64(exp_g["dgates"])[routed], tol,
                 f"{what}dgates (routed pairs)")
    _check_exact_zeros(y, grads, ids, inp["E"], what)


# ---------------------------------------------------------------------------------------------
# The layer on the CPU
# ---------------------------------------------------------------------------------------------

ACT_BIAS = [pytest.param("swiglu", True, id="swiglu-bias"), pytest.param("gelu", False, id="gelu"),
            pytest.param("relu2", True, id="relu2-bias")]


@pytest.mark.parametrize("id_dtype", ID_DTYPES)
@pytest.mark.parametrize("kind", DROP_KINDS)
@pytest.mark.parametrize("activation,bias", ACT_BIAS)
@pytest.mark.parametrize("dname", list(CPU_DTYPES))
def test_cpu_layer_vs_gate0(dname, activation, bias, kind, id_dtype):
    """Forward and backward with dropped pairs against the gate-0 construction, under both checkpoint policies
    (whose results are bit-identical on the CPU)."""
    rng = np.random.default_rng(zlib.crc32(f"cpu-{dname}-{activation}-{bias}-{kind}".encode()))
    inp = _make(rng, 24, 16, 8, 6, 3, CPU_DTYPES[dname], activation, bias, kind, id_dtype)
    if kind == "none":
        assert (inp["ids"] >= 0).all()
    exp = _gate0_run(inp, activation)
    runs = {}
    for checkpoint in blazecore.CHECKPOINTS:
        y, saved, grads = _run(inp, inp["ids"], inp["gates"], "cpu", activation, checkpoint)
        _check(y, grads, exp, inp, _tol(CPU_DTYPES[dname]), f"{checkpoint}: ")
        runs[checkpoint] = (y, grads)
    (y_ab, g_ab), (y_no, g_no) = runs["ab"], runs["none"]
    assert _bytes(y_ab) == _bytes(y_no), "y differs between checkpoint policies"
    for key in GRAD_KEYS:
        assert _bytes(getattr(g_ab, key)) == _bytes(getattr(g_no, key)), f"{key} differs between checkpoint policies"


def test_cpu_layer_all_dropped_is_zero():
    """Every pair dropped: y, dx, dgates and every weight gradient are exactly 0."""
    inp = _make(np.random.default_rng(5), 10, 16, 8, 4, 2, np.float32, "swiglu", True, "all")
    for checkpoint in blazecore.CHECKPOINTS:
        y, _, grads = _run(inp, inp["ids"], inp["gates"], "cpu", "swiglu", checkpoint)
        for name, a in (("y", y), *((k, getattr(grads, k)) for k in GRAD_KEYS)):
            v = _f64(a)
            assert v.size and not np.any(v), f"{checkpoint}: {name} not all zero"


def test_cpu_layer_top1():
    """K = 1: a dropped pair is a dropped token."""
    inp = _make(np.random.default_rng(6), 20, 16, 8, 4, 1, np.float32, "swiglu", False, "mixed")
    assert (inp["ids"] < 0).any() and (inp["ids"] >= 0).any()
    y, _, grads = _run(inp, inp["ids"], inp["gates"], "cpu", "swiglu")
    _check(y, grads, _gate0_run(inp, "swiglu"), inp, TOL[np.dtype(np.float32)])


@pytest.mark.parametrize("checkpoint", list(blazecore.CHECKPOINTS))
def test_cpu_chunks_with_an_all_dropped_chunk(checkpoint):
    """chunks=3 (the middle chunk's tokens all dropped) gives the bits of one chunk, and the gate-0 results."""
    L, block = 40, 8
    assert chunk_bounds(L, 3, block) == [(0, 16), (16, 32), (32, 40)]
    rng = np.random.default_rng(8)
    inp = _make(rng, L, 16, 8, 4, 2, np.float32, "swiglu", True, "mixed")
    inp["ids"][16:32] = -1
    inp["gates"][16:32] = 3.0
    one = _run(inp, inp["ids"], inp["gates"], "cpu", "swiglu", checkpoint, chunks=1, block_tokens=block)
    three = _run(inp, inp["ids"], inp["gates"], "cpu", "swiglu", checkpoint, chunks=3, block_tokens=block)
    assert three[1].chunks == 3
    assert _bytes(one[0]) == _bytes(three[0]), "y: chunked != unchunked"
    for key in GRAD_KEYS:
        assert _bytes(getattr(one[2], key)) == _bytes(getattr(three[2], key)), f"{key}: chunked != unchunked"
    _check(three[0], three[2], _gate0_run(inp, "swiglu", checkpoint), inp, TOL[np.dtype(np.float32)])


@pytest.mark.parametrize("backend", backends())
def test_dispatch_passed_in(backend):
    """A dispatch built beforehand (on the GPU without validation) gives the bits of the one built inside."""
    rng = np.random.default_rng(9)
    dtype = np.float32
    inp = _make(rng, 63, 40, 24, 8, 3, dtype, "swiglu", True, "mixed")
    ids = to_backend(inp["ids"], backend)
    disp = build_dispatch(ids, 8, validate=backend == "cpu")
    y0, _, g0 = _run(inp, inp["ids"], inp["gates"], backend, "swiglu")
    y1, saved, g1 = _run(inp, inp["ids"], inp["gates"], backend, "swiglu", dispatch=disp)
    assert saved.dispatch is disp
    assert _bytes(y0) == _bytes(y1)
    for key in GRAD_KEYS:
        assert _bytes(getattr(g0, key)) == _bytes(getattr(g1, key)), key
    _check(y1, g1, _gate0_reference(inp, "swiglu", None if backend == "cpu" else np.dtype(dtype)), inp,
           TOL[np.dtype(dtype)])


@pytest.mark.parametrize("backend", backends())
def test_saved_preactivations_of_routed_slots(backend):
    """Policy "ab": rows [0, offsets[E]) of the saved pre-activations are z of the routed pairs in slot order."""
    rng = np.random.default_rng(10)
    inp = _make(rng, 37, 24, 16, 5, 3, np.float32, "swiglu", True, "mixed")
    dev = {k: (to_backend(v, backend) if isinstance(v, np.ndarray) else v) for k, v in inp.items()}
    _, saved = blazecore.moe_forward(dev["x"], dev["w13"], dev["w2"], dev["gates"], dev["ids"], checkpoint="ab",
                                     b13=dev["b13"], b2=dev["b2"])
    if saved.ab is None:  # the GPU path may keep them in saved.extra instead
        assert backend == "gpu"
        return
    ids = inp["ids"]
    L, K = ids.shape
    n = int((ids >= 0).sum())
    ab = _f64(saved.ab)
    assert ab.shape == (L * K, inp["w13"].shape[1])
    off = np.asarray(to_numpy(saved.dispatch.expert_offsets), np.int64)
    assert off[-1] == n
    st_ = np.asarray(to_numpy(saved.dispatch.slot_token), np.int64)[:n]
    sk = np.asarray(to_numpy(saved.dispatch.slot_k), np.int64)[:n]
    e = ids[st_, sk].astype(np.int64)
    assert (e >= 0).all()
    x, w13, b13 = (inp[k].astype(np.float64) for k in ("x", "w13", "b13"))
    z = np.einsum("nrd,nd->nr", w13[e], x[st_]) + b13[e]
    assert_close(ab[:n], z, TOL[np.dtype(np.float32)], "ab (routed slots)")


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("value,match", [pytest.param(-2, r"is outside \[0, 6\)", id="minus2"),
                                         pytest.param(6, r"is outside \[0, 6\)", id="eq_E")])
def test_layer_rejects_other_ids(backend, value, match):
    rng = np.random.default_rng(11)
    inp = _make(rng, 12, 16, 8, 6, 2, np.float32, "swiglu", False, "mixed")
    ids = inp["ids"].copy()
    ids[4, 1] = value
    with pytest.raises(ValueError, match=match):
        _run(inp, ids, inp["gates"], backend, "swiglu")


# ---------------------------------------------------------------------------------------------
# A tiny case by hand (float64 loop over (token, k), forward and backward written out)
# ---------------------------------------------------------------------------------------------


def _sig(v):
    return 1.0 / (1.0 + np.exp(-v))


_GELU_C = math.sqrt(2.0 / math.pi)


def _act_and_grad(name: str, v):
    if name == "swiglu":  # silu on the gate half
        s = _sig(v)
        return v * s, s + v * s * (1.0 - s)
    if name == "gelu":
        u = _GELU_C * (v + 0.044715 * v**3)
        t = np.tanh(u)
        return 0.5 * v * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * v * v)
    raise ValueError(name)


def _by_hand(x, w13, w2, gates, ids, activation, b13, b2, dy):
    """y and the gradients of sum(dy * y), one (token, k) at a time; a pair with id -1 is skipped."""
    x, w13, w2, gates, b13, b2, dy = (np.asarray(a, np.float64) for a in (x, w13, w2, gates, b13, b2, dy))
    L, K = ids.shape
    h = w2.shape[2]
    gated = activation == "swiglu"
    y, dx = np.zeros_like(x), np.zeros_like(x)
    dw13, dw2, db13, db2 = np.zeros_like(w13), np.zeros_like(w2), np.zeros_like(b13), np.zeros_like(b2)
    dgates = np.zeros((L, K))
    for t in range(L):
        for k in range(K):
            e = int(ids[t, k])
            if e == -1:
                continue
            z = w13[e] @ x[t] + b13[e]
            if gated:
                a, b = z[:h], z[h:]
                fa, dfa = _act_and_grad(activation, a)
                hc = fa * b
            else:
                hc, dfz = _act_and_grad(activation, z)
            o = w2[e] @ hc + b2[e]
            y[t] += gates[t, k] * o
            dgates[t, k] = dy[t] @ o
            do = gates[t, k] * dy[t]
            dw2[e] += np.outer(do, hc)
            db2[e] += do
            dh = w2[e].T @ do
            dz = np.concatenate([dh * b * dfa, dh * fa]) if gated else dh * dfz
            dw13[e] += np.outer(dz, x[t])
            db13[e] += dz
            dx[t] += w13[e].T @ dz
    return y, {"dx": dx, "dw13": dw13, "dw2": dw2, "dgates": dgates, "db13": db13, "db2": db2}


def _tiny(dtype, activation):
    """E = 4, K = 2, d = 16, h = 8; a token with no expert (row 1), drops at k = 0 and at k = 1, expert 1 unused."""
    rng = np.random.default_rng(zlib.crc32(f"tiny-{activation}".encode()))
    E, d, h = 4, 16, 8
    R = 2 * h if activation == "swiglu" else h
    ids = np.array([[3, 2], [-1, -1], [2, -1], [-1, 0], [0, 2], [3, -1]], np.int32)
    L, K = ids.shape
    gates = rng.random((L, K)) + 0.2
    gates[ids < 0] = [4.0, -2.0, 9.0, 0.5, -6.0]
    return {
        "x": rng.standard_normal((L, d)).astype(dtype),
        "w13": (rng.standard_normal((E, R, d)) / 4.0).astype(dtype),
        "w2": (rng.standard_normal((E, d, h)) / math.sqrt(h)).astype(dtype),
        "b13": (0.1 * rng.standard_normal((E, R))).astype(dtype),
        "b2": (0.1 * rng.standard_normal((E, d))).astype(dtype),
        "dy": rng.standard_normal((L, d)).astype(dtype),
        "gates": gates.astype(F64 if np.dtype(dtype) == F64 else np.float32),
        "ids": ids,
        "E": E,
    }


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_by_hand_matches_reference_without_drops(activation):
    """The hand-written loop itself, on a routing without -1, against the float64 reference."""
    inp = _tiny(F64, activation)
    ids0, _ = _gate0(inp["ids"], inp["gates"], inp["E"])
    args = (inp["x"], inp["w13"], inp["w2"], inp["gates"], ids0, activation, inp["b13"], inp["b2"])
    y, g = _by_hand(*args, inp["dy"])
    assert_close(y, ref.moe_forward_ref(*args), TOL_F64, "y")
    want = ref.moe_backward_ref(inp["dy"], *args)
    for key in GRAD_KEYS:
        assert_close(g[key], want[key], TOL_F64, key)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("backend,dname", [pytest.param("cpu", "f64", id="cpu-f64"),
                                           pytest.param("gpu", "f32", id="gpu-f32", marks=pytest.mark.gpu),
                                           pytest.param("gpu", "bf16", id="gpu-bf16", marks=pytest.mark.gpu)])
def test_tiny_layer_by_hand(backend, dname, activation):
    dtype = F64 if dname == "f64" else DTYPES[dname]
    inp = _tiny(dtype, activation)
    exp = _by_hand(inp["x"], inp["w13"], inp["w2"], inp["gates"], inp["ids"], activation, inp["b13"], inp["b2"],
                   inp["dy"])
    for checkpoint in blazecore.CHECKPOINTS:
        y, _, grads = _run(inp, inp["ids"], inp["gates"], backend, activation, checkpoint)
        _check(y, grads, exp, inp, _tol(dtype), f"{checkpoint}: ")
        # here the hand-written dgates is 0 at the dropped pairs: compare all of it
        assert_close(grads.dgates, exp[1]["dgates"], _tol(dtype), f"{checkpoint}: dgates")


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

GPU_SHAPES = [pytest.param((63, 40, 24, 8, 3), id="L63"), pytest.param((515, 96, 80, 8, 2), id="tiles")]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("kind", ["mixed", "capacity", "all"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("dname", ["bf16", "f32"])
@pytest.mark.parametrize("gemm_path", list(blazecore.GEMM_PATHS))
def test_gpu_layer_vs_reference(gemm_path, dname, activation, kind, shape):
    """The kernels on each GEMM path, both policies, biases on: against the float64 reference of the gate-0
    construction (pre-activations rounded to x's dtype, as test_moe.py's GPU comparisons), at test_moe.py's
    tolerances; the exact zeros of dropped pairs."""
    L, d, h, E, K = shape
    dt = DTYPES[dname]
    rng = np.random.default_rng(zlib.crc32(f"gpu-{dname}-{activation}-{kind}-{shape}".encode()))
    inp = _make(rng, L, d, h, E, K, dt, activation, True, kind)
    exp = _gate0_reference(inp, activation, preact_dtype=dt)
    for checkpoint in blazecore.CHECKPOINTS:
        y, saved, grads = _run(inp, inp["ids"], inp["gates"], "gpu", activation, checkpoint, gemm_path=gemm_path)
        assert saved.gemm_path == gemm_path
        _check(y, grads, exp, inp, TOL[dt], f"{gemm_path} {checkpoint}: ")


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("dname", ["bf16", "f32"])
def test_gpu_bit_identical(dname, activation):
    """Two runs, three chunks (the middle one with every pair dropped), a dispatch built beforehand without
    validation: the same bits in y and every gradient; y has the same bits under both policies."""
    L, d, h, E, K, block = 515, 96, 80, 8, 2, 64
    assert chunk_bounds(L, 3, block) == [(0, 192), (192, 384), (384, 515)]
    dt = DTYPES[dname]
    rng = np.random.default_rng(zlib.crc32(f"bits-{dname}-{activation}".encode()))
    inp = _make(rng, L, d, h, E, K, dt, activation, True, "mixed")
    inp["ids"][192:384] = -1
    inp["gates"][192:384] = 2.0
    exp = _gate0_reference(inp, activation, preact_dtype=dt)
    ys = {}
    for checkpoint in blazecore.CHECKPOINTS:
        y, _, g = _run(inp, inp["ids"], inp["gates"], "gpu", activation, checkpoint, block_tokens=block)
        _check(y, g, exp, inp, TOL[dt], f"{checkpoint}: ")
        ys[checkpoint] = y
        disp = build_dispatch(to_backend(inp["ids"], "gpu"), E, validate=False)
        others = {
            "rerun": _run(inp, inp["ids"], inp["gates"], "gpu", activation, checkpoint, block_tokens=block),
            "chunks=3": _run(inp, inp["ids"], inp["gates"], "gpu", activation, checkpoint, block_tokens=block,
                             chunks=3),
            "dispatch": _run(inp, inp["ids"], inp["gates"], "gpu", activation, checkpoint, block_tokens=block,
                             dispatch=disp),
        }
        for name, (y2, _, g2) in others.items():
            assert _bytes(y) == _bytes(y2), f"{checkpoint} {name}: y"
            for key in GRAD_KEYS:
                assert _bytes(getattr(g, key)) == _bytes(getattr(g2, key)), f"{checkpoint} {name}: {key}"
    assert _bytes(ys["ab"]) == _bytes(ys["none"]), "y differs between checkpoint policies"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ID_DTYPES)
def test_gpu_dispatch_validate_false_matches_cpu(dtype):
    """The unvalidated GPU build treats -1 as a dropped pair: the CPU's (validated) dispatch, array for array."""
    import cupy

    for L, K, E in ((1, 1, 1), (63, 3, 8), (3000, 4, 16), (20_000, 2, 64), (40_000, 8, 256), (300, 40, 64)):
        for kind in ("mixed", "capacity", "all"):
            rng = np.random.default_rng(zlib.crc32(f"vf-{L}-{K}-{E}-{kind}".encode()))
            ids = _drop(rng, make_routing(rng, L, E, K, "uniform", dtype), kind, E)
            want = build_dispatch(ids, E)
            got = build_dispatch(cupy.asarray(ids), E, validate=False)
            for name in ("expert_offsets", "slot_token", "slot_k", "pair_slot"):
                assert_int_equal(getattr(got, name), getattr(want, name), f"{L}x{K} E={E} {kind}: {name}")
            check_dropped_dispatch(got, ids, E, "gpu")


@pytest.mark.gpu
@pytest.mark.parametrize("tile,mode", ALL_PLANS)
@pytest.mark.parametrize("dtype", ID_DTYPES)
def test_gpu_dispatch_every_plan(tile, mode, dtype):
    """Each (tile, mode) of the GPU build, forced, on routings with dropped pairs."""
    import cupy

    rng = np.random.default_rng(13)
    for L, K, E in PLAN_SHAPES:
        if mode == D.MODE_SINGLE_TILE and L * K > tile[0] * tile[1]:
            continue
        for kind in ("mixed", "capacity", "all"):
            ids = _drop(rng, make_routing(rng, L, E, K, "uniform", dtype), kind, E)
            d = D._build_gpu(cupy.asarray(ids), E, L, K, cupy.cuda.get_current_stream(), True, tile, mode)
            check_dropped_dispatch(d, ids, E, "gpu")


@pytest.mark.gpu
def test_gpu_dispatch_writes_every_entry(monkeypatch):
    """Outputs that start as 12345 (not the -1 of the test poison): every entry, pair_slot's -1 at dropped pairs
    included, is written by the kernels."""
    import cupy

    monkeypatch.setattr(_array, "POISON", False)

    def alloc(shape, dtype_name):
        return cupy.full(shape, 12345, dtype=dtype_name)

    rng = np.random.default_rng(14)
    for L, K, E in ((50, 3, 8), (3000, 4, 16), (100_000, 4, 128)):  # one tile, direct sums, scanned tiles
        for validate in (True, False):
            ids = _drop(rng, make_routing(rng, L, E, K, "uniform"), "mixed", E)
            with _array.allocator(alloc):
                d = build_dispatch(cupy.asarray(ids), E, validate=validate)
            check_dropped_dispatch(d, ids, E, "gpu")


# ---------------------------------------------------------------------------------------------
# PyTorch adapter
# ---------------------------------------------------------------------------------------------


def _torch_run(torch, tops, inp, ids, gates, activation, checkpoint, device="cpu", dispatch=None):
    """moe_ffn forward + autograd backward: y and the gradients (dx, dw13, dw2, dgates, db13, db2) as NumPy."""

    def t(a):
        if a is None:
            return None
        a = np.ascontiguousarray(a)
        if a.dtype == blazecore.BF16:
            return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16).to(device)
        return torch.from_numpy(a).to(device)

    leaves = {k: t(inp[k]).requires_grad_() for k in ("x", "w13", "w2")}
    leaves["gates"] = t(gates).requires_grad_()
    for k in ("b13", "b2"):
        if inp[k] is not None:
            leaves[k] = t(inp[k]).requires_grad_()
    y = tops.moe_ffn(leaves["x"], leaves["w13"], leaves["w2"], leaves["gates"], t(ids), activation=activation,
                     checkpoint=checkpoint, b13=leaves.get("b13"), b2=leaves.get("b2"), dispatch=dispatch)
    grads = torch.autograd.grad(y, list(leaves.values()), t(inp["dy"]))
    got = dict(zip(("d" + k for k in leaves), grads, strict=True))

    def n(a):
        return None if a is None else a.detach().to("cpu", torch.float64).numpy()

    return n(y), {k: n(got.get(k)) for k in GRAD_KEYS}


@pytest.mark.parametrize("checkpoint", list(blazecore.CHECKPOINTS))
@pytest.mark.parametrize("activation,bias", [pytest.param("swiglu", True, id="swiglu-bias"),
                                             pytest.param("gelu", False, id="gelu")])
@pytest.mark.parametrize("dname", list(CPU_DTYPES))
def test_torch_moe_ffn_dropped_pairs(dname, activation, bias, checkpoint):
    """blazecore_torch.moe_ffn (CPU, int64 ids) with dropped pairs, autograd through it, against moe_ffn on the
    gate-0 construction; with the dispatch built inside and passed in."""
    torch = pytest.importorskip("torch")
    from blazecore_torch import ops as tops

    dtype = CPU_DTYPES[dname]
    rng = np.random.default_rng(zlib.crc32(f"torch-{dname}-{activation}-{bias}".encode()))
    inp = _make(rng, 21, 16, 8, 5, 3, dtype, activation, bias, "mixed", np.int64)
    ids0, g0 = _gate0(inp["ids"], inp["gates"], inp["E"])
    exp = _torch_run(torch, tops, inp, ids0, g0, activation, checkpoint)
    disp = tops.build_dispatch(torch.from_numpy(inp["ids"]), inp["E"])
    assert int(disp.counts().sum()) == int((inp["ids"] >= 0).sum())
    assert bool((disp.pair_slot[torch.from_numpy(inp["ids"] < 0)] == -1).all())
    for dispatch in (None, disp):
        y, g = _torch_run(torch, tops, inp, inp["ids"], inp["gates"], activation, checkpoint, dispatch=dispatch)
        _check(y, g, exp, inp, _tol(dtype), f"dispatch {'built' if dispatch is None else 'given'}: ", dtypes=False)


def test_torch_gradcheck_dropped_pairs():
    """torch.autograd.gradcheck (float64, central differences) of moe_ffn with dropped pairs: the analytical
    gradients, dgates = 0 at the dropped pairs included, match the numerical ones."""
    torch = pytest.importorskip("torch")
    from blazecore_torch import ops as tops

    L, d, h, E, K = 7, 5, 3, 4, 2
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).requires_grad_()

    x, w13, w2 = rnd(L, d), rnd(E, 2 * h, d, scale=d ** -0.5), rnd(E, d, h, scale=h ** -0.5)
    b13, b2 = rnd(E, 2 * h, scale=0.1), rnd(E, d, scale=0.1)
    gates = rnd(L, K)
    ids = torch.tensor([[0, -1], [-1, -1], [2, 3], [-1, 1], [3, 0], [1, -1], [2, 1]], dtype=torch.int64)
    disp = tops.build_dispatch(ids, E)

    def f(x, w13, w2, gates, b13, b2):
        return tops.moe_ffn(x, w13, w2, gates, ids, b13=b13, b2=b2, dispatch=disp, retain_saved=True)

    assert torch.autograd.gradcheck(f, (x, w13, w2, gates, b13, b2), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("checkpoint", list(blazecore.CHECKPOINTS))
def test_torch_gpu_moe_ffn_dropped_pairs(checkpoint):
    """moe_ffn on CUDA in bf16 with dropped pairs (the dispatch built inside the forward's call, and an unvalidated
    one passed in): against the float64 reference of the gate-0 construction at test_moe.py's bf16 tolerance."""
    torch = pytest.importorskip("torch")
    from blazecore_torch import ops as tops

    dt = DTYPES["bf16"]
    inp = _make(np.random.default_rng(15), 200, 64, 32, 8, 2, dt, "swiglu", True, "mixed", np.int64)
    exp = _gate0_reference(inp, "swiglu", preact_dtype=dt)
    ids_cuda = torch.from_numpy(inp["ids"]).cuda()
    for dispatch in (None, tops.build_dispatch(ids_cuda, inp["E"], validate=False)):
        y, g = _torch_run(torch, tops, inp, inp["ids"], inp["gates"], "swiglu", checkpoint, device="cuda",
                          dispatch=dispatch)
        _check(y, g, exp, inp, TOL[dt], f"dispatch {'built' if dispatch is None else 'given'}: ", dtypes=False)


# ---------------------------------------------------------------------------------------------
# JAX adapter
# ---------------------------------------------------------------------------------------------


def _jax():
    jax = pytest.importorskip("jax")
    pytest.importorskip("jax.experimental.buffer_callback")
    from blazecore_jax import ops as jops

    return jax, jax.numpy, jops


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("checkpoint", list(blazecore.CHECKPOINTS))
@pytest.mark.parametrize("activation,bias", [pytest.param("swiglu", True, id="swiglu-bias"),
                                             pytest.param("gelu", False, id="gelu")])
def test_jax_moe_ffn_dropped_pairs(activation, bias, checkpoint, jit):
    """blazecore_jax.moe_ffn (CPU, float32) with dropped pairs: y and every gradient against a jax.numpy layer
    that masks the dropped pairs (gate 0 through jnp.where, whose gradient to the masked gate is 0)."""
    jax, jnp, jops = _jax()
    inp = _make(np.random.default_rng(16), 18, 16, 8, 6, 3, np.float32, activation, bias, "mixed")
    ids = jnp.asarray(inp["ids"])
    h = inp["w2"].shape[2]
    names = ("x", "w13", "w2", "gates") + (("b13", "b2") if bias else ())
    args = tuple(jnp.asarray(inp[n]) for n in names)
    dy = jnp.asarray(inp["dy"])

    def ours(x, w13, w2, gates, b13=None, b2=None):
        return jops.moe_ffn(x, w13, w2, gates, ids, activation=activation, checkpoint=checkpoint, b13=b13, b2=b2)

    def masked(x, w13, w2, gates, b13=None, b2=None):
        hp = jax.lax.Precision.HIGHEST
        drop = ids < 0
        safe = jnp.where(drop, 0, ids)
        g = jnp.where(drop, 0.0, gates)
        z = jnp.einsum("lkrd,ld->lkr", w13[safe], x, precision=hp)
        if b13 is not None:
            z = z + b13[safe]
        if activation == "swiglu":
            hcur = jax.nn.silu(z[..., :h]) * z[..., h:]
        else:
            hcur = jax.nn.gelu(z, approximate=True)
        o = jnp.einsum("lkdh,lkh->lkd", w2[safe], hcur, precision=hp)
        if b2 is not None:
            o = o + b2[safe]
        return jnp.einsum("lk,lkd->ld", g, o, precision=hp)

    def fwd_bwd(f):
        def run(*a):
            y, vjp = jax.vjp(f, *a)
            return y, vjp(dy)

        return run

    y, grads = (jax.jit(fwd_bwd(ours)) if jit else fwd_bwd(ours))(*args)
    ry, rgrads = fwd_bwd(masked)(*args)
    tol = TOL[np.dtype(np.float32)]
    assert_close(np.asarray(y, np.float64), np.asarray(ry, np.float64), tol, "y")
    for name, a, b in zip(("d" + n for n in names), grads, rgrads, strict=True):
        assert_close(np.asarray(a, np.float64), np.asarray(b, np.float64), tol, name)
    drop = inp["ids"] < 0
    dg = np.asarray(grads[3])
    assert not np.any(dg[drop]), "dgates of a dropped pair is not 0"
    empty = drop.all(axis=1)
    assert not np.any(np.asarray(y)[empty]) and not np.any(np.asarray(grads[0])[empty])


def test_jax_build_dispatch_dropped_pairs():
    jax, jnp, jops = _jax()
    rng = np.random.default_rng(17)
    ids = _drop(rng, make_routing(rng, 30, 6, 3, "uniform"), "mixed", 6)
    d = jops.build_dispatch(jnp.asarray(ids), 6)
    want = _oracle(ids, 6)
    for name, w in zip(("expert_offsets", "slot_token", "slot_k", "pair_slot"), want, strict=True):
        assert_int_equal(np.asarray(getattr(d, name)), w, name)
    assert int(np.asarray(d.counts()).sum()) == int((ids >= 0).sum())
    bad = ids.copy()
    bad[4, 1] = -2
    with pytest.raises(ValueError, match=r"is outside \[0, 6\)"):
        jops.build_dispatch(jnp.asarray(bad), 6)
