"""Hypothesis fuzz of every op, forward and backward, over shapes, dtypes, activations, policies and routings.

Two profiles, one per backend:

- CPU (unmarked, runs in CI): the CPU path of every op runs the float64 NumPy reference of
  ``blazecore/reference`` itself, so here it is compared with independent float64 code written in this
  file (a dense per-token loop for the layer, activation derivatives by complex step, an argsort dispatch,
  the router's Jacobians by complex step). Arbitrary d and h; few examples.
- GPU (marked ``gpu``): CuPy inputs run the CUDA kernels and are compared with ``blazecore/reference``;
  d and h multiples of 8 (the kernels' 16-byte rows), more and larger examples.

Both are reproducible: ``derandomize=True`` (the examples come from the test's name) and no example database.
``BLAZECORE_FUZZ_SCALE`` multiplies every example count (e.g. 4 for a long GPU run) and
``BLAZECORE_FUZZ_SEED=n`` replaces the derived seed (still reproducible).

Tolerances are DESIGN.md's: relative norm error under 1e-2 for bfloat16 / float16 and 1e-5 for float32.
Outputs that are sums of terms which can cancel are measured against the norm of their uncancelled terms as
well (the larger of the two), so rounding noise on a near-zero result is not read as a large relative error:
the load-balancing gradient (exactly zero for uniform loads), the router's dlogits against the complex-step
Jacobian on the CPU (exactly zero for K = 1 with renormalisation) and dgates (dgates[t, k] = dy[t] . o[t, k], a dot
product over d: with one token, d = 240 and fp32 its relative error alone reached 1.4e-5).

Chunking: where ``moe_forward`` takes ``chunks=``, every layer example also draws a chunk count in {1, 2, 3}
and the chunked forward and backward must give the same bits as ``chunks=1`` (y and every gradient; the saved
pre-activations are laid out per chunk). Chunk boundaries are multiples of ``block_tokens``, so the examples
also draw a small ``block_tokens`` (or the default), the same for both runs, to chunk small L.
"""

from __future__ import annotations

import inspect
import math
import os

import numpy as np
import pytest
from conftest import ROUTINGS, argsort_dispatch, assert_close, make_routing, to_backend, to_numpy
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import blazecore
from blazecore import BF16, moe
from blazecore import router as rt
from blazecore._array import logical_dtype
from blazecore.reference import moe as ref_moe
from blazecore.reference import router as ref_rt

DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": BF16}
TOL = {"f32": 1e-5, "f16": 1e-2, "bf16": 1e-2}
GATE_TOL = 1e-5  # fp32 gates and losses computed from exactly representable logits
SEL_TOL = 1e-6  # fp32 rounding of score + bias when the selection is biased
GRAD_KEYS = ("dx", "dw13", "dw2", "dgates", "db13", "db2")
_FWD_PARAMS = inspect.signature(moe.moe_forward).parameters
HAS_CHUNKS = "chunks" in _FWD_PARAMS
HAS_BLOCK_TOKENS = "block_tokens" in _FWD_PARAMS

_SCALE = float(os.environ.get("BLAZECORE_FUZZ_SCALE", "1"))
_SEED = os.environ.get("BLAZECORE_FUZZ_SEED")


def profile(backend: str, n_cpu: int, n_gpu: int):
    """The hypothesis settings of one fuzz test on one backend (see the module docstring)."""
    n = n_cpu if backend == "cpu" else n_gpu
    s = settings(max_examples=max(1, round(n * _SCALE)), deadline=None, derandomize=_SEED is None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.filter_too_much])

    def wrap(f):
        f = s(f)
        return seed(int(_SEED))(f) if _SEED is not None else f

    return wrap


BACKENDS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


# ---------------------------------------------------------------------------------------------
# Independent float64 references (the CPU backend's expected values)
# ---------------------------------------------------------------------------------------------

_GATED = {"swiglu": True, "geglu": True, "gelu": False, "silu": False, "relu2": False, "swiglu_oai": True}


def _act(name: str, z):
    """Elementwise activation; also takes complex z (for the complex-step derivative)."""
    if name in ("swiglu", "silu"):
        return z / (1.0 + np.exp(-z))
    if name in ("geglu", "gelu"):
        return 0.5 * z * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))
    if name == "relu2":
        return np.where(z.real > 0, z, 0.0) ** 2
    if name == "swiglu_oai":  # gate clamped above at 7, then c sigmoid(1.702 c)
        c = np.where(z.real <= 7.0, z, 7.0)
        return c / (1.0 + np.exp(-1.702 * c))
    raise ValueError(name)


def _up(name: str, b):
    """The up half's factor of a gated activation (b itself but for swiglu_oai: clip(b, -7, 7) + 1)."""
    if name == "swiglu_oai":
        return np.where(np.abs(b.real) <= 7.0, b, np.sign(b.real) * 7.0) + 1.0
    return b


def _dup(name: str, b):
    eps = 1e-30
    return np.imag(_up(name, np.asarray(b, dtype=np.complex128) + 1j * eps)) / eps


def _dact(name: str, z):
    """act'(z) by complex step: Im(act(z + i eps)) / eps, exact to rounding (no subtraction)."""
    eps = 1e-30
    return np.imag(_act(name, np.asarray(z, dtype=np.complex128) + 1j * eps)) / eps


def local_moe(x, w13, w2, gates, ids, activation, b13, b2, dy):
    """The layer and its gradients, token by token (a dense loop, no dispatch, no per-expert grouping)."""
    f = lambda a: None if a is None else np.asarray(a, dtype=np.float64)  # noqa: E731
    x, w13, w2, gates, b13, b2, dy = (f(a) for a in (x, w13, w2, gates, b13, b2, dy))
    ids = np.asarray(ids, dtype=np.int64)
    L, K = ids.shape
    E, R, d = w13.shape
    h = w2.shape[2]
    gated = _GATED[activation]
    y = np.zeros((L, d))
    g = {"dx": np.zeros((L, d)), "dw13": np.zeros_like(w13), "dw2": np.zeros_like(w2), "dgates": np.zeros((L, K)),
         "db13": None if b13 is None else np.zeros_like(b13), "db2": None if b2 is None else np.zeros_like(b2)}
    z_all = np.zeros((L, K, R))
    for t in range(L):
        e = ids[t]  # K distinct experts: fancy-indexed += below never collides
        W1 = w13[e]  # (K, R, d)
        z = W1 @ x[t] + (0.0 if b13 is None else b13[e])  # (K, R)
        z_all[t] = z
        hc = _act(activation, z[:, :h]) * _up(activation, z[:, h:]) if gated else _act(activation, z)  # (K, h)
        o = np.einsum("kdh,kh->kd", w2[e], hc) + (0.0 if b2 is None else b2[e])  # (K, d)
        y[t] = gates[t] @ o
        g["dgates"][t] = o @ dy[t]
        do = gates[t][:, None] * dy[t][None, :]  # (K, d)
        g["dw2"][e] += do[:, :, None] * hc[:, None, :]
        if b2 is not None:
            g["db2"][e] += do
        dh = np.einsum("kd,kdh->kh", do, w2[e])
        if gated:
            a, b = z[:, :h], z[:, h:]
            dz = np.concatenate([dh * _up(activation, b) * _dact(activation, a),
                                 dh * _act(activation, a) * _dup(activation, b)], axis=1)
        else:
            dz = dh * _dact(activation, z)
        g["dw13"][e] += dz[:, :, None] * x[t][None, None, :]
        if b13 is not None:
            g["db13"][e] += dz
        g["dx"][t] = np.einsum("kr,krd->d", dz, W1)
    return y, g, z_all


def _softmax(x):
    """Row softmax (complex-step safe: the shift uses the real part)."""
    m = np.max(x.real, axis=-1, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=-1, keepdims=True)


def _scores(x, score):
    return _softmax(x) if score == "softmax" else 1.0 / (1.0 + np.exp(-x))


def _gates_of(x, ids, score, renormalize):
    s = np.take_along_axis(_scores(x, score), ids, axis=1)
    return s / s.sum(axis=1, keepdims=True) if renormalize else s


def _row_jvp_by_columns(fn, x):
    """For a row-separable fn: (L, E) -> (L, M), the Jacobians d fn[t] / d x[t, j], as (L, M, E), by complex step."""
    eps = 1e-30
    L, E = x.shape
    cols = []
    for j in range(E):
        xc = x.astype(np.complex128)
        xc[:, j] += 1j * eps
        cols.append(np.imag(fn(xc)) / eps)
    return np.stack(cols, axis=-1) if E else np.zeros((L, 0, 0))


def local_route_backward(dg, x, ids, score, renormalize):
    """dlogits = J^T dgates per row, with J the Jacobian of the gates (ids fixed) by complex step."""
    J = _row_jvp_by_columns(lambda v: _gates_of(v, ids, score, renormalize), x)  # (L, K, E)
    return np.einsum("lk,lke->le", dg, J)


def route_grad_scale(dg, x, ids, score, renormalize):
    """Norm of dlogits' terms before they cancel, following the chain gates -> selected scores -> scores ->
    logits with absolute values. dlogits vanishes exactly for K = 1 with renormalisation (the gate is 1),
    where the complex step leaves ~1e-19: this is the scale such noise is measured against."""
    dg, ids = np.abs(np.asarray(dg, np.float64)), np.asarray(ids, np.int64)
    s = _scores(np.asarray(x, np.float64), score)
    q = np.take_along_axis(s, ids, axis=1)
    if renormalize:
        S = q.sum(axis=1, keepdims=True)
        dq = (dg + np.sum(dg * q / S, axis=1, keepdims=True)) / S
    else:
        dq = dg
    ds = np.zeros_like(s)
    np.put_along_axis(ds, ids, dq, axis=1)  # ids distinct within a row
    terms = s * (ds + np.sum(s * ds, axis=1, keepdims=True)) if score == "softmax" else ds * s * (1.0 - s)
    return float(np.linalg.norm(terms))


def _lb_f(ids, L, E):
    return np.bincount(ids.reshape(-1), minlength=E) / (L * ids.shape[1])


def local_lb_loss(x, ids):
    """The load-balancing loss and its gradient (by complex step, row by row: row t's share of the loss)."""
    L, E = x.shape
    if L == 0:
        return 0.0, np.zeros((0, E))
    f = _lb_f(ids, L, E)
    rows = lambda v: (E / L) * (_softmax(v) @ f)[:, None]  # noqa: E731
    return float(rows(x).sum()), _row_jvp_by_columns(rows, x)[:, 0, :]


def lb_grad_scale(x, ids):
    """Norm of the load-balancing gradient's terms before they cancel: (E / L) p (f + <p, f>). Its gradient
    (E / L) p (f - <p, f>) is exactly zero for a uniform load (K == E) and small near one."""
    L, E = x.shape
    if L == 0:
        return 0.0
    f = _lb_f(ids, L, E)
    p = _softmax(np.asarray(x, np.float64))
    return float(np.linalg.norm((E / L) * p * (f[None, :] + (p @ f)[:, None])))


def local_z_loss(x):
    L, E = x.shape
    if L == 0:
        return 0.0, np.zeros((0, E))

    def rows(v):
        m = np.max(v.real, axis=1, keepdims=True)
        lse = m + np.log(np.exp(v - m).sum(axis=1, keepdims=True))
        return lse**2 / L

    return float(rows(x).sum()), _row_jvp_by_columns(rows, x)[:, 0, :]


def dgates_scale(dy, z, w2, b2, ids, activation):
    """Norm over (t, k) of sum_i |dy[t, i]| |o[t, k, i]|: dgates before cancellation. z (L, K, R) float64
    pre-activations; o = w2[e] @ hcur(z) (+ b2[e]), computed expert by expert."""
    dy, w2 = np.asarray(dy, np.float64), np.asarray(w2, np.float64)
    ids = np.asarray(ids, np.int64)
    h = w2.shape[2]
    hc = _act(activation, z[..., :h]) * _up(activation, z[..., h:]) if _GATED[activation] else _act(activation, z)
    terms = np.zeros(ids.shape)
    for e in np.unique(ids):
        t, k = np.nonzero(ids == e)
        o = hc[t, k] @ w2[e].T + (0.0 if b2 is None else np.asarray(b2, np.float64)[e])
        terms[t, k] = np.sum(np.abs(o) * np.abs(dy[t]), axis=1)
    return float(np.linalg.norm(terms))


def assert_close_scaled(actual, expected, rtol, scale, name):
    """assert_close with the error measured against max(||expected||, scale): for outputs whose terms cancel."""
    e = np.asarray(expected, np.float64)
    a = np.asarray(to_numpy(actual), np.float64)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != {e.shape}"
    if not np.isfinite(a).all():
        idx = tuple(int(i) for i in np.argwhere(~np.isfinite(a))[0])
        raise AssertionError(f"{name}: non-finite value {a[idx]} at {idx}")
    denom = max(float(np.linalg.norm(e)), float(scale)) or 1.0  # both zero: an absolute error, as assert_close
    rel = float(np.linalg.norm(a - e)) / denom
    assert rel <= rtol, f"{name}: error {rel:.3e} (of max(||expected||, uncancelled scale)) > {rtol:.1e}"


def _bits(a) -> bytes:
    return b"" if a is None else np.ascontiguousarray(to_numpy(a)).tobytes()


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------

_L_SPECIAL = [0, 1, 2, 3, 5, 7, 31, 63, 65, 127]
_E_SPECIAL = [1, 2, 3, 4, 5, 7, 8, 16, 31, 64, 128, 256]


@st.composite
def routed_sizes(draw, max_L: int, max_pairs: int, max_E: int = 256, max_cells: int | None = None):
    """(L, E, K, routing) with K <= E, L * K <= max_pairs (and L * E <= max_cells); routing one of
    conftest.ROUTINGS."""
    E = draw(st.one_of(st.sampled_from([e for e in _E_SPECIAL if e <= max_E]), st.integers(1, max_E)), "E")
    routing = draw(st.sampled_from(ROUTINGS), "routing")
    if routing == "k_eq_e":
        K = E
    else:
        K = draw(st.one_of(st.integers(1, min(E, 8)), st.integers(1, E)), "K")
    cap = max(0, min(max_L, max_pairs // K, (max_cells or max_L * E) // E))
    L = draw(st.one_of(st.sampled_from([v for v in _L_SPECIAL if v <= cap] or [0]), st.integers(0, cap)), "L")
    return L, E, K, routing


# ---------------------------------------------------------------------------------------------
# build_dispatch
# ---------------------------------------------------------------------------------------------


def _check_dispatch(disp, ids, E):
    L, K = ids.shape
    n = L * K
    names = ("expert_offsets", "slot_token", "slot_k", "pair_slot")
    got = {k: np.asarray(to_numpy(getattr(disp, k))) for k in names}
    for k, shape in zip(names, ((E + 1,), (n,), (n,), (L, K)), strict=True):
        assert got[k].shape == shape and got[k].dtype == np.int32, f"{k}: {got[k].shape} {got[k].dtype}"
    assert (disp.num_tokens, disp.top_k, disp.num_experts) == (L, K, E)
    want = argsort_dispatch(ids, E)
    for k, w in zip(names, want, strict=True):
        bad = np.argwhere(got[k] != w)
        assert not bad.size, f"{k}: {len(bad)} entries differ, first at {tuple(bad[0])}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_fuzz_build_dispatch(backend):
    big = backend == "gpu"

    @profile(backend, n_cpu=200, n_gpu=200)
    @given(sizes=routed_sizes(max_L=20000 if big else 3000, max_pairs=160_000 if big else 12_000),
           id_dtype=st.sampled_from([np.int32, np.int64]), validate=st.booleans(), rng_seed=st.integers(0, 2**32 - 1))
    def check(sizes, id_dtype, validate, rng_seed):
        L, E, K, routing = sizes
        ids = make_routing(np.random.default_rng(rng_seed), L, E, K, routing, dtype=id_dtype)
        disp = blazecore.build_dispatch(to_backend(ids, backend), E, validate=validate)
        _check_dispatch(disp, ids, E)

    check()


# ---------------------------------------------------------------------------------------------
# route_topk, its backward, the auxiliary losses and their backward
# ---------------------------------------------------------------------------------------------


def _router_logits(rng, L, E, K, routing, dtype):
    """Logits whose top-k follows the routing kind: uniform N(0, 1); zipf: -1.5 log(rank) added per expert;
    all_to_one: one expert 6 above the rest; empty_experts: most experts 8 below the rest."""
    x = rng.standard_normal((L, E))
    if routing == "zipf":
        x += -1.5 * np.log1p(rng.permutation(E))[None, :]
    elif routing == "all_to_one" and E:
        x[:, rng.integers(E)] += 6.0
    elif routing == "empty_experts":
        used = rng.permutation(E)[: max(K, E // 4)]
        x -= 8.0
        x[:, used] += 8.0
    return x.astype(np.float32).astype(dtype)


def _assert_valid_topk(ids, sel, K, tol):
    L, E = sel.shape
    assert ids.shape == (L, K) and ids.dtype == np.int32, f"ids: {ids.shape} {ids.dtype}"
    if L == 0:
        return
    assert ((ids >= 0) & (ids < E)).all(), "ids out of range"
    srt = np.sort(ids, axis=1)
    assert not (srt[:, 1:] == srt[:, :-1]).any(), "ids repeat within a row"
    chosen = np.take_along_axis(sel, ids.astype(np.int64), axis=1)
    assert (np.diff(chosen, axis=1) <= tol).all(), "ids not in descending order of the selection value"
    if K < E:
        rest = sel.copy()
        np.put_along_axis(rest, ids.astype(np.int64), -np.inf, axis=1)
        worst_chosen, best_rest = chosen.min(axis=1), rest.max(axis=1)
        bad = np.flatnonzero(worst_chosen < best_rest - tol)
        assert not bad.size, f"row {bad[0]}: an unselected expert beats a selected one"


@pytest.mark.parametrize("backend", BACKENDS)
def test_fuzz_route_topk(backend):
    big = backend == "gpu"

    @profile(backend, n_cpu=150, n_gpu=150)
    @given(sizes=routed_sizes(max_L=3000 if big else 300, max_pairs=60_000 if big else 4000,
                              max_cells=None if big else 16_384),
           dname=st.sampled_from(list(DTYPES)), score=st.sampled_from(["softmax", "sigmoid"]),
           renormalize=st.booleans(), bias=st.booleans(), rng_seed=st.integers(0, 2**32 - 1))
    def check(sizes, dname, score, renormalize, bias, rng_seed):
        L, E, K, routing = sizes
        rng = np.random.default_rng(rng_seed)
        x = _router_logits(rng, L, E, K, routing, DTYPES[dname])
        b = (0.05 * rng.standard_normal(E)).astype(np.float32) if bias else None
        dg = rng.standard_normal((L, K)).astype(np.float32)
        xb = to_backend(x, backend)
        gates, ids = rt.route_topk(xb, K, score=score, renormalize=renormalize,
                                   expert_bias=None if b is None else to_backend(b, backend))
        ids_h = np.asarray(to_numpy(ids))
        x64 = x.astype(np.float64)

        # selection: independent scores; gates of the returned ids
        sel = _scores(x64, score) + (0.0 if b is None else b.astype(np.float64))
        _assert_valid_topk(ids_h, sel, K, 0.0 if b is None else SEL_TOL)
        assert np.asarray(to_numpy(gates)).dtype == np.float32
        if backend == "cpu":
            want_g = _gates_of(x64, ids_h.astype(np.int64), score, renormalize)
        else:
            want_g = ref_rt.gates_for_ids(x, ids_h, score, renormalize)
        assert_close(gates, want_g, GATE_TOL, "gates")

        # backward with the ids held fixed
        dx = rt.route_topk_backward(to_backend(dg, backend), xb, ids, score=score, renormalize=renormalize)
        assert logical_dtype(blazecore.asarray(dx)) == DTYPES[dname]
        if backend == "cpu":
            want_dx = local_route_backward(dg.astype(np.float64), x64, ids_h.astype(np.int64), score, renormalize)
        else:
            want_dx = ref_rt.route_topk_backward(dg, x, ids_h, score=score, renormalize=renormalize)
        scale = route_grad_scale(dg, x64, ids_h, score, renormalize)
        assert_close_scaled(dx, want_dx, TOL[dname], scale, "dlogits")

        # auxiliary losses (softmax of the full logits whatever the score) and their gradients
        lb = rt.load_balancing_loss(xb, ids)
        z = rt.router_z_loss(xb)
        if backend == "cpu":
            (want_lb, want_dlb), (want_z, want_dz) = local_lb_loss(x64, ids_h), local_z_loss(x64)
        else:
            want_lb, want_z = ref_rt.load_balancing_loss(x, ids_h), ref_rt.router_z_loss(x)
            want_dlb = ref_rt.load_balancing_loss_backward(1.0, x, ids_h)
            want_dz = ref_rt.router_z_loss_backward(1.0, x)
        assert_close(lb, np.asarray(want_lb), GATE_TOL, "load-balancing loss")
        assert_close(z, np.asarray(want_z), GATE_TOL, "z-loss")
        d_up = 0.7 * max(L, 1)  # a loss scale of L keeps fp16 gradients (of order 1/L) out of the subnormals
        dlb = rt.load_balancing_loss_backward(d_up, xb, ids)
        dzl = rt.router_z_loss_backward(d_up, xb)
        assert_close_scaled(dlb, d_up * want_dlb, TOL[dname], d_up * lb_grad_scale(x64, ids_h),
                            "d load-balancing loss")
        assert_close(dzl, d_up * want_dz, TOL[dname], "d z-loss")

    check()


# ---------------------------------------------------------------------------------------------
# moe_forward / moe_backward
# ---------------------------------------------------------------------------------------------


def _layer_inputs(rng, L, d, h, E, K, routing, dtype, activation, bias):
    R = 2 * h if _GATED[activation] else h
    g = rng.random((L, K)) + 0.05
    return {
        "x": rng.standard_normal((L, d)).astype(dtype),
        "w13": (rng.standard_normal((E, R, d)) / math.sqrt(d)).astype(dtype),
        "w2": (rng.standard_normal((E, d, h)) / math.sqrt(h)).astype(dtype),
        "b13": (0.1 * rng.standard_normal((E, R))).astype(dtype) if bias else None,
        "b2": (0.1 * rng.standard_normal((E, d))).astype(dtype) if bias else None,
        "gates": (g / g.sum(axis=1, keepdims=True)).astype(np.float32),
        "ids": make_routing(rng, L, E, K, routing),
        "dy": rng.standard_normal((L, d)).astype(dtype),
    }


def _run_layer(dev, activation, checkpoint, chunks, block_tokens):
    kw = {"chunks": chunks} if HAS_CHUNKS else {}
    if HAS_BLOCK_TOKENS and block_tokens is not None:
        kw["block_tokens"] = block_tokens
    y, saved = moe.moe_forward(dev["x"], dev["w13"], dev["w2"], dev["gates"], dev["ids"], activation=activation,
                               checkpoint=checkpoint, b13=dev["b13"], b2=dev["b2"], **kw)
    ab = None if saved.ab is None else np.array(to_numpy(saved.ab))  # before a backward may reuse it
    disp = saved.dispatch
    return y, ab, disp, moe.moe_backward(dev["dy"], saved)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fuzz_moe(backend):
    gpu = backend == "gpu"
    dim = st.integers(1, 32).map(lambda v: 8 * v) if gpu else st.one_of(st.integers(1, 24), st.integers(25, 72))

    @profile(backend, n_cpu=300, n_gpu=300)
    @given(sizes=routed_sizes(max_L=400 if gpu else 300, max_pairs=6144 if gpu else 640),
           d=dim, h=dim if gpu else st.integers(1, 24), dname=st.sampled_from(list(DTYPES)),
           activation=st.sampled_from(moe.ACTIVATIONS), checkpoint=st.sampled_from(moe.CHECKPOINTS),
           bias=st.booleans(), chunks=st.sampled_from([1, 2, 3]), block_tokens=st.sampled_from([None, 8, 32, 64]),
           rng_seed=st.integers(0, 2**32 - 1))
    def check(sizes, d, h, dname, activation, checkpoint, bias, chunks, block_tokens, rng_seed):
        L, E, K, routing = sizes
        dt = DTYPES[dname]
        inp = _layer_inputs(np.random.default_rng(rng_seed), L, d, h, E, K, routing, dt, activation, bias)
        dev = {k: None if v is None else to_backend(v, backend) for k, v in inp.items()}
        y, ab, disp, grads = _run_layer(dev, activation, checkpoint, 1, block_tokens)

        args = (inp["x"], inp["w13"], inp["w2"], inp["gates"], inp["ids"], activation, inp["b13"], inp["b2"])
        if gpu:
            want_y = ref_moe.moe_forward_ref(*args)
            want_g = ref_moe.moe_backward_ref(inp["dy"], *args, preact_dtype=dt)
            want_z = ref_moe.moe_preact_ref(inp["x"], inp["w13"], inp["ids"], inp["b13"])
        else:
            want_y, want_g, want_z = local_moe(*args, inp["dy"])

        tol = TOL[dname]
        assert logical_dtype(blazecore.asarray(y)) == dt
        assert_close(y, want_y, tol, "y")
        for key in GRAD_KEYS:
            got, want = getattr(grads, key), want_g[key]
            if want is None:
                assert got is None, f"{key}: expected None without a bias"
                continue
            assert logical_dtype(blazecore.asarray(got)) == (np.dtype(np.float32) if key == "dgates" else dt), key
            if key == "dgates":
                scale = dgates_scale(inp["dy"], want_z, inp["w2"], inp["b2"], inp["ids"], activation)
                assert_close_scaled(got, want, tol, scale, key)
            else:
                assert_close(got, want, tol, key)
        # experts without a token: exact zeros
        empty = np.bincount(inp["ids"].reshape(-1), minlength=E) == 0
        for key in ("dw13", "dw2", "db13", "db2"):
            g = getattr(grads, key)
            if g is not None and empty.any():
                assert not np.any(np.asarray(to_numpy(g), np.float64)[empty]), f"{key}: nonzero for an empty expert"
        # policy "ab": the saved pre-activations in slot order
        if ab is not None and disp is not None:
            st_, sk = (np.asarray(to_numpy(a), np.int64) for a in (disp.slot_token, disp.slot_k))
            assert_close(ab, want_z[st_, sk], tol, "saved pre-activations")

        if HAS_CHUNKS and chunks > 1:
            y_c, _, _, grads_c = _run_layer(dev, activation, checkpoint, chunks, block_tokens)
            assert _bits(y_c) == _bits(y), f"y: chunks={chunks} differs from chunks=1"
            for key in GRAD_KEYS:
                assert _bits(getattr(grads_c, key)) == _bits(getattr(grads, key)), f"{key}: chunks={chunks} differs"

    check()


# ---------------------------------------------------------------------------------------------
# The independent references themselves
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", moe.ACTIVATIONS)
def test_local_reference_agrees_with_blazecore_reference(activation):
    """The two float64 references (written independently) agree to rounding, gradients included."""
    rng = np.random.default_rng(5)
    inp = _layer_inputs(rng, 23, 7, 5, 6, 3, "zipf", np.dtype(np.float64), activation, True)
    args = (inp["x"], inp["w13"], inp["w2"], inp["gates"], inp["ids"], activation, inp["b13"], inp["b2"])
    y, g, z = local_moe(*args, inp["dy"])
    assert_close(y, ref_moe.moe_forward_ref(*args), 1e-12, "y")
    want = ref_moe.moe_backward_ref(inp["dy"], *args)
    for key in GRAD_KEYS:
        assert_close(g[key], want[key], 1e-12, key)
    assert_close(z, ref_moe.moe_preact_ref(inp["x"], inp["w13"], inp["ids"], inp["b13"]), 1e-12, "z")

    x = rng.standard_normal((9, 11))
    ids = make_routing(rng, 9, 11, 3, "uniform")
    dg = rng.standard_normal((9, 3))
    for score in ("softmax", "sigmoid"):
        for renorm in (True, False):
            got = local_route_backward(dg, x, ids.astype(np.int64), score, renorm)
            assert_close(got, ref_rt.route_topk_backward(dg, x, ids, score=score, renormalize=renorm), 1e-12,
                         f"dlogits {score} {renorm}")
    lb, dlb = local_lb_loss(x, ids.astype(np.int64))
    zl, dz = local_z_loss(x)
    assert_close(np.asarray(lb), np.asarray(ref_rt.load_balancing_loss(x, ids)), 1e-12, "lb")
    assert_close(dlb, ref_rt.load_balancing_loss_backward(1.0, x, ids), 1e-12, "dlb")
    assert_close(np.asarray(zl), np.asarray(ref_rt.router_z_loss(x)), 1e-12, "z")
    assert_close(dz, ref_rt.router_z_loss_backward(1.0, x), 1e-12, "dz")


def test_routings_have_their_shape():
    rng = np.random.default_rng(0)
    L, E, K = 400, 16, 2
    for kind in ROUTINGS:
        k = E if kind == "k_eq_e" else K
        ids = make_routing(rng, L, E, k, kind)
        assert ids.shape == (L, k) and ids.dtype == np.int32
        srt = np.sort(ids, axis=1)
        assert ((srt >= 0) & (srt < E)).all() and not (srt[:, 1:] == srt[:, :-1]).any(), kind
        counts = np.bincount(ids.reshape(-1), minlength=E)
        if kind == "all_to_one":
            assert counts.max() == L
        elif kind == "empty_experts":
            assert (counts == 0).sum() >= E // 2
        elif kind == "zipf":
            assert counts.max() > 4 * np.median(counts)
        elif kind == "k_eq_e":
            assert (counts == L).all()
