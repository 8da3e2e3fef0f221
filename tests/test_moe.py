"""The MoE layer (moe_forward / moe_backward) against the float64 NumPy reference.

The reference itself is checked against closed forms (one token, one expert, d = h = 1) and central
finite differences. Every layer case runs on the CPU backend (the reference path) and, where a GPU
exists, on CuPy inputs (the kernels), with poisoned outputs and a per-dtype tolerance table.
"""

from __future__ import annotations

import functools
import math
import types
import zlib
from dataclasses import dataclass

import numpy as np
import pytest
from conftest import assert_close, backends, make_routing, to_backend, to_numpy
from hypothesis import given, settings
from hypothesis import strategies as st

import blazecore
from blazecore import BF16, moe
from blazecore._array import logical_dtype
from blazecore.dispatch import build_dispatch
from blazecore.reference import moe as ref

# Relative norm error against the float64 reference. The GPU path uses tensor cores with fp32
# accumulation; 1e-5 for float32 holds only for a true fp32 path (not tf32).
TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 1e-2, BF16: 1e-2}
DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": BF16}
GRAD_KEYS = ("dx", "dw13", "dw2", "dgates", "db13", "db2")


@dataclass(frozen=True)
class Case:
    name: str
    L: int
    d: int
    h: int
    E: int
    K: int
    routing: str  # random | skewed | few (empty experts) | same (every token on the same K experts)


CASES = [
    Case("L1", 1, 40, 24, 4, 2, "random"),
    Case("L63", 63, 40, 24, 8, 2, "random"),
    Case("odd", 37, 24, 40, 5, 3, "skewed"),
    Case("skewed", 96, 32, 16, 8, 2, "skewed"),
    Case("empty_experts", 48, 32, 16, 16, 2, "few"),
    Case("one_expert", 48, 32, 16, 4, 1, "same"),
    Case("same_two_experts", 40, 32, 16, 6, 2, "same"),
    Case("K_eq_E", 20, 16, 8, 4, 4, "random"),
    Case("L0", 0, 32, 16, 4, 2, "random"),
    Case("E256", 64, 16, 8, 256, 8, "random"),
    Case("tiles", 515, 96, 80, 8, 2, "skewed"),  # L*K = 1030: not a tile multiple; d, 2h not powers of two
    # d far wider than dz's rows: the GPU backward computes dx in column slices (the last one partial)
    Case("wide_d", 150, 1064, 40, 8, 2, "skewed"),
    # h far wider than d: the GPU backward runs dh' and dw2 in column slices of h (the last one partial)
    Case("wide_h", 120, 40, 600, 6, 2, "skewed"),
]
CASE_PARAMS = [pytest.param(c, id=c.name) for c in CASES]
DTYPE_PARAMS = [pytest.param(k, id=k) for k in DTYPES]
ACT_PARAMS = [pytest.param(a, id=a) for a in moe.ACTIVATIONS]
BIAS_PARAMS = [pytest.param(False, id="nobias"), pytest.param(True, id="bias")]


# ---------------------------------------------------------------------------------------------
# Inputs and expected results (cached: the GPU and CPU runs of a case share them)
# ---------------------------------------------------------------------------------------------


# the cases' routing names -> blazecore.testing's kinds
_KINDS = {"random": "uniform", "skewed": "skewed", "few": "empty_experts", "same": "same"}


def _routing(rng, L: int, E: int, K: int, kind: str) -> np.ndarray:
    """(L, K) int32 ids, K distinct experts per row (blazecore.testing.make_routing)."""
    return make_routing(rng, L, E, K, _KINDS[kind])


def _readonly(a):
    if a is not None:
        a.flags.writeable = False
    return a


def _make(rng, case: Case, dtype: np.dtype, activation: str, bias: bool, routing: str | None = None) -> dict:
    L, d, h, E, K = case.L, case.d, case.h, case.E, case.K
    R = 2 * h if moe.activation_info(activation) else h
    # swiglu_oai: pre-activations of std 4, so that some 8% of them lie beyond its clamps at +-7
    scale = 4.0 if activation == "swiglu_oai" else 1.0
    inp = {
        "x": rng.standard_normal((L, d)).astype(dtype),
        "w13": (scale * rng.standard_normal((E, R, d)) / math.sqrt(d)).astype(dtype),
        "w2": (rng.standard_normal((E, d, h)) / math.sqrt(h)).astype(dtype),
        "b13": (0.1 * rng.standard_normal((E, R))).astype(dtype) if bias else None,
        "b2": (0.1 * rng.standard_normal((E, d))).astype(dtype) if bias else None,
        "ids": _routing(rng, L, E, K, routing or case.routing),
        "dy": rng.standard_normal((L, d)).astype(dtype),
    }
    g = rng.random((L, K)) + 0.1
    inp["gates"] = (g / g.sum(axis=1, keepdims=True)).astype(np.float32)
    return inp


@functools.lru_cache(maxsize=None)
def _inputs(case: Case, dname: str, activation: str, bias: bool) -> dict:
    rng = np.random.default_rng(zlib.crc32(f"{case}-{dname}-{activation}-{bias}".encode()))
    return {k: _readonly(v) for k, v in _make(rng, case, DTYPES[dname], activation, bias).items()}


def _reference(inp: dict, activation: str, backend: str):
    y = ref.moe_forward_ref(inp["x"], inp["w13"], inp["w2"], inp["gates"], inp["ids"], activation,
                            inp["b13"], inp["b2"])
    # The GPU backward reads z in x's dtype (saved or recomputed); the reference rounds it the same way, which
    # decides the gradient at swiglu_oai's clamps for a z within one bf16 step of them. The CPU path is the
    # float64 reference itself.
    dt = np.dtype(inp["x"].dtype)
    g = ref.moe_backward_ref(inp["dy"], inp["x"], inp["w13"], inp["w2"], inp["gates"], inp["ids"], activation,
                             inp["b13"], inp["b2"], preact_dtype=dt if backend == "gpu" else None)
    return y, g


@functools.lru_cache(maxsize=None)
def _expected(case: Case, dname: str, activation: str, bias: bool, backend: str):
    return _reference(_inputs(case, dname, activation, bias), activation, backend)


def _on(inp: dict, backend: str) -> dict:
    return {k: (None if v is None else to_backend(v, backend)) for k, v in inp.items()}


def _run(dev: dict, activation: str, checkpoint: str = "ab", **kw):
    y, saved = moe.moe_forward(dev["x"], dev["w13"], dev["w2"], dev["gates"], dev["ids"], activation=activation,
                               checkpoint=checkpoint, b13=dev["b13"], b2=dev["b2"], **kw)
    grads = moe.moe_backward(dev["dy"], saved)
    return y, saved, grads


def _check_against(y, grads, inp: dict, exp, rtol: float, what: str = "") -> None:
    y_ref, g_ref = exp
    dtype = np.dtype(inp["x"].dtype)
    assert logical_dtype(blazecore.asarray(y)) == dtype
    assert_close(y, y_ref, rtol, f"{what}y")
    for key in GRAD_KEYS:
        got, want = getattr(grads, key), g_ref[key]
        if want is None:
            assert got is None, f"{key}: expected None without a bias"
            continue
        want_dtype = np.dtype(np.float32) if key == "dgates" else dtype
        assert logical_dtype(blazecore.asarray(got)) == want_dtype, f"{key}: dtype"
        assert_close(got, want, rtol, f"{what}{key}")


def _bytes(a) -> bytes:
    return b"" if a is None else np.ascontiguousarray(to_numpy(a)).tobytes()


def _paths_agree(select, paths, dev, inp, exp, activation, checkpoint, **kw) -> None:
    """The layer once per kernel path (``select(path)`` picks it): each run matches the reference (bf16) and every
    run has the first one's bits in y and in every gradient."""
    runs = {}
    for path in paths:
        select(path)
        y, _, grads = _run(dev, activation, checkpoint, **kw)
        _check_against(y, grads, inp, exp, TOL[BF16], f"{path} {checkpoint} {kw} ")
        runs[path] = (y, grads)
    y0, g0 = runs[paths[0]]
    for path, (y1, g1) in runs.items():
        assert _bytes(y0) == _bytes(y1), f"{path} {checkpoint} {kw} y"
        for key in GRAD_KEYS:
            assert _bytes(getattr(g0, key)) == _bytes(getattr(g1, key)), f"{path} {checkpoint} {kw} {key}"


# ---------------------------------------------------------------------------------------------
# The reference itself
# ---------------------------------------------------------------------------------------------


def _scalar_act(name: str, v: float) -> float:
    if name in ("swiglu", "silu"):
        return v / (1.0 + math.exp(-v))
    if name == "swiglu_oai":
        c = min(v, 7.0)
        return c / (1.0 + math.exp(-1.702 * c))
    if name in ("geglu", "gelu"):
        return 0.5 * v * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))
    return max(v, 0.0) ** 2


@pytest.mark.parametrize("activation", ACT_PARAMS)
def test_reference_closed_form(activation):
    """One token, one expert, d = h = 1: y = g * (w2 * hcur + b2) written out by hand."""
    gated = moe.activation_info(activation)
    xv, wa, wb, w2v, ba, bb, b2v, gv = 0.7, -1.3, 0.9, 1.1, 0.2, -0.4, 0.05, 0.6
    x = np.array([[xv]])
    w13 = np.array([[[wa], [wb]]]) if gated else np.array([[[wa]]])
    b13 = np.array([[ba, bb]]) if gated else np.array([[ba]])
    w2 = np.array([[[w2v]]])
    b2 = np.array([[b2v]])
    gates = np.array([[gv]], dtype=np.float32)
    ids = np.zeros((1, 1), np.int32)
    a, b = wa * xv + ba, wb * xv + bb
    if activation == "swiglu_oai":
        b = min(max(b, -7.0), 7.0) + 1.0
    hcur = _scalar_act(activation, a) * b if gated else _scalar_act(activation, a)
    o = w2v * hcur + b2v
    y = ref.moe_forward_ref(x, w13, w2, gates, ids, activation, b13, b2)
    np.testing.assert_allclose(y, [[float(np.float32(gv)) * o]], rtol=1e-14)
    g = ref.moe_backward_ref(np.ones((1, 1)), x, w13, w2, gates, ids, activation, b13, b2)
    np.testing.assert_allclose(g["dgates"], [[o]], rtol=1e-14)
    np.testing.assert_allclose(g["db2"], [[float(np.float32(gv))]], rtol=1e-14)
    np.testing.assert_allclose(g["dw2"], [[[float(np.float32(gv)) * hcur]]], rtol=1e-14)


def _fd_grads(inp: dict, activation: str, eps: float = 1e-6) -> dict:
    """Central differences of loss = sum(dy * y) for every element of every differentiable input."""
    p = {k: (None if v is None else np.array(v, dtype=np.float64)) for k, v in inp.items()}

    def loss():
        y = ref.moe_forward_ref(p["x"], p["w13"], p["w2"], p["gates"], p["ids"], activation, p["b13"], p["b2"])
        return float(np.sum(y * p["dy"]))

    out = {}
    for key, name in (("dx", "x"), ("dw13", "w13"), ("dw2", "w2"), ("dgates", "gates"), ("db13", "b13"),
                      ("db2", "b2")):
        a = p[name]
        if a is None:
            out[key] = None
            continue
        fd = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            v = a[idx]
            a[idx] = v + eps
            lp = loss()
            a[idx] = v - eps
            lm = loss()
            a[idx] = v
            fd[idx] = (lp - lm) / (2 * eps)
        out[key] = fd
    return out


@pytest.mark.parametrize("bias", BIAS_PARAMS)
@pytest.mark.parametrize("activation", ACT_PARAMS)
def test_reference_backward_vs_finite_differences(activation, bias):
    case = Case("fd", 4, 5, 3, 3, 2, "random")
    rng = np.random.default_rng(zlib.crc32(f"fd-{activation}-{bias}".encode()))
    inp = _make(rng, case, np.dtype(np.float64), activation, bias)
    inp["gates"] = inp["gates"].astype(np.float64)
    g = ref.moe_backward_ref(inp["dy"], inp["x"], inp["w13"], inp["w2"], inp["gates"], inp["ids"], activation,
                             inp["b13"], inp["b2"])
    fd = _fd_grads(inp, activation)
    for key in GRAD_KEYS:
        if fd[key] is None:
            assert g[key] is None
            continue
        assert_close(g[key], fd[key], 1e-7, f"{key} vs finite differences")


@pytest.mark.parametrize("bias", BIAS_PARAMS)
def test_reference_swiglu_oai_clamps_vs_finite_differences(bias):
    """swiglu_oai with pre-activations far beyond its clamps (gate above 7, up outside [-7, 7]): the gradients
    are zero through a clamped value, and the finite differences agree (no value lies within eps of a bound)."""
    case = Case("fd_clamp", 5, 4, 3, 3, 2, "random")
    rng = np.random.default_rng(7 + bias)
    inp = _make(rng, case, np.dtype(np.float64), "swiglu_oai", bias)
    inp["w13"] = inp["w13"] * 4.0  # std ~ 16
    inp["gates"] = inp["gates"].astype(np.float64)
    z = ref.moe_preact_ref(inp["x"], inp["w13"], inp["ids"], inp["b13"])
    h = case.h
    assert (z[..., :h] > 7).any() and (np.abs(z[..., h:]) > 7).any() and (np.abs(z) < 7).any()
    assert np.min(np.abs(np.abs(z) - 7.0)) > 1e-4
    g = ref.moe_backward_ref(inp["dy"], inp["x"], inp["w13"], inp["w2"], inp["gates"], inp["ids"], "swiglu_oai",
                             inp["b13"], inp["b2"])
    fd = _fd_grads(inp, "swiglu_oai")
    for key in GRAD_KEYS:
        if fd[key] is not None:
            assert_close(g[key], fd[key], 1e-7, f"{key} vs finite differences")


def test_reference_preact_dtype_rounds_z_before_the_clamps():
    """preact_dtype: a gate pre-activation of 7.01 lies beyond swiglu_oai's clamp in float64 (no gradient through
    the gate) but reads 7.0 in bf16 (inside, bounds included: the gradient passes); float64 changes nothing."""
    x = np.array([[1.0]])
    w13 = np.array([[[7.01], [0.5]]])  # gate 7.01, up 0.5
    w2 = np.array([[[1.0]]])
    gates = np.ones((1, 1))
    ids = np.zeros((1, 1), np.int32)
    args = (np.ones((1, 1)), x, w13, w2, gates, ids, "swiglu_oai")
    exact = ref.moe_backward_ref(*args)
    assert exact["dw13"][0, 0, 0] == 0.0
    same = ref.moe_backward_ref(*args, preact_dtype=np.float64)
    for key in ("dx", "dw13", "dw2", "dgates"):
        np.testing.assert_array_equal(same[key], exact[key])
    bf16 = ref.moe_backward_ref(*args, preact_dtype=DTYPES["bf16"])
    c = 7.0
    sig = 1.0 / (1.0 + math.exp(-1.702 * c))
    # d/da [a sigmoid(1.702 a)] (b + 1) at a = 7, b = 0.5
    want = (sig + c * 1.702 * sig * (1.0 - sig)) * 1.5
    np.testing.assert_allclose(bf16["dw13"][0, 0, 0], want, rtol=1e-12)


@pytest.mark.parametrize("activation", [pytest.param(a, id=a) for a in ("swiglu", "swiglu_oai")])
def test_reference_interleaved(activation):
    """"<name>_interleaved" reads w13 / b13 rows as [g0, u0, g1, u1, ...]: the same layer as the [gate; up]
    order, with z's columns and dw13 / db13's rows in the interleaved order."""
    case = Case("il", 7, 6, 4, 3, 2, "random")
    inp = _make(np.random.default_rng(3), case, np.dtype(np.float64), activation, True)
    h = case.h
    perm = np.empty(2 * h, np.int64)  # interleaved row r holds concatenated row perm[r]
    perm[0::2], perm[1::2] = np.arange(h), np.arange(h, 2 * h)
    w13_il, b13_il = inp["w13"][:, perm], inp["b13"][:, perm]
    il = activation + "_interleaved"
    args = (inp["w2"], inp["gates"], inp["ids"])
    y = ref.moe_forward_ref(inp["x"], inp["w13"], *args, activation, inp["b13"], inp["b2"])
    y_il = ref.moe_forward_ref(inp["x"], w13_il, *args, il, b13_il, inp["b2"])
    np.testing.assert_allclose(y_il, y, rtol=1e-13, atol=1e-13)
    z, z_il = (ref.moe_preact_ref(inp["x"], w, inp["ids"], b) for w, b in ((inp["w13"], inp["b13"]), (w13_il, b13_il)))
    np.testing.assert_allclose(z_il, z[..., perm], rtol=1e-13, atol=1e-13)
    g = ref.moe_backward_ref(inp["dy"], inp["x"], inp["w13"], *args, activation, inp["b13"], inp["b2"])
    g_il = ref.moe_backward_ref(inp["dy"], inp["x"], w13_il, *args, il, b13_il, inp["b2"])
    for key in GRAD_KEYS:
        want = g[key][:, perm] if key in ("dw13", "db13") else g[key]
        np.testing.assert_allclose(g_il[key], want, rtol=1e-12, atol=1e-12, err_msg=key)
    with pytest.raises(ValueError, match="unknown activation"):
        ref.moe_forward_ref(inp["x"], inp["w13"][:, :h], *args, "silu_interleaved")  # not gated


def test_reference_unknown_activation():
    with pytest.raises(ValueError, match="unknown activation"):
        ref.moe_forward_ref(np.zeros((1, 2)), np.zeros((1, 2, 2)), np.zeros((1, 2, 2)), np.ones((1, 1)),
                            np.zeros((1, 1), np.int32), "tanh")


# ---------------------------------------------------------------------------------------------
# Small API pieces
# ---------------------------------------------------------------------------------------------


def test_activation_info():
    assert moe.ACTIVATIONS == ("swiglu", "geglu", "gelu", "silu", "relu2", "swiglu_oai")
    assert [moe.activation_info(a) for a in moe.ACTIVATIONS] == [True, True, False, False, False, True]
    assert set(moe.ACTIVATIONS) == set(ref.ACTIVATIONS_REF)
    for name in ("tanh", "SwiGLU", None):
        with pytest.raises(ValueError, match="unknown activation"):
            moe.activation_info(name)


@pytest.mark.parametrize("activation", ACT_PARAMS)
def test_moe_flops(activation):
    L, d, h, K = 1000, 64, 48, 4
    R = 2 * h if moe.activation_info(activation) else h
    fwd = 2 * L * K * d * R + 2 * L * K * h * d  # z = x w13^T, o = hcur w2^T
    bwd = 2 * fwd  # dx and dw13 per first GEMM; dhcur and dw2 per second
    assert moe.moe_flops(L, d, h, K, activation) == fwd + bwd
    assert moe.moe_flops(L, d, h, K, activation) == (18 if R == 2 * h else 12) * L * K * d * h
    with pytest.raises(ValueError):
        moe.moe_flops(L, d, h, K, "tanh")


# ---------------------------------------------------------------------------------------------
# The layer against the reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", BIAS_PARAMS)
@pytest.mark.parametrize("activation", ACT_PARAMS)
@pytest.mark.parametrize("dname", DTYPE_PARAMS)
@pytest.mark.parametrize("case", CASE_PARAMS)
@pytest.mark.parametrize("backend", backends())
def test_layer_vs_reference(backend, case, dname, activation, bias):
    inp = _inputs(case, dname, activation, bias)
    y, saved, grads = _run(_on(inp, backend), activation)
    _check_against(y, grads, inp, _expected(case, dname, activation, bias, backend), TOL[DTYPES[dname]])
    assert to_numpy(y).shape == (case.L, case.d)
    # experts without a token get exact zeros (not just small values)
    counts = np.bincount(inp["ids"].reshape(-1), minlength=case.E)
    for key in ("dw13", "dw2", "db13", "db2"):
        g = getattr(grads, key)
        if g is not None:
            got = np.asarray(to_numpy(g), dtype=np.float64)[counts == 0]
            assert not np.any(got), f"{key}: nonzero gradient for an expert with no token"


def test_dx_slices():
    from blazecore._moe_gpu import dx_slices

    assert dx_slices(2048, 2048) == [(0, 2048)]
    assert dx_slices(1536, 512) == [(0, 768), (768, 1536)]
    assert dx_slices(1064, 80) == [(0, 256), (256, 512), (512, 768), (768, 1024), (1024, 1064)]
    for d, kd in [(8, 8), (1064, 40), (4096, 28672), (5000, 16), (2056, 1024)]:
        sl = dx_slices(d, kd)
        assert sl[0][0] == 0 and sl[-1][1] == d and all(a[1] == b[0] for a, b in zip(sl[:-1], sl[1:], strict=True))
        assert all((c1 - c0) % 256 == 0 for c0, c1 in sl[:-1]) and all(c1 > c0 for c0, c1 in sl)
        assert len(sl) == 1 or max(c1 - c0 for c0, c1 in sl) <= max(2 * kd, 256)
        lean = dx_slices(d, kd, lean=True)  # checkpoint "none": about a quarter of d (whole 256-column tiles)
        assert lean[0][0] == 0 and lean[-1][1] == d and all(a[1] == b[0] for a, b in zip(lean[:-1], lean[1:],
                                                                                         strict=True))
        quarter = -(-d // 4)
        assert max(c1 - c0 for c0, c1 in lean) <= 256 * -(-quarter // 256) and len(lean) >= len(sl)
    assert dx_slices(2048, 2048, lean=True) == [(0, 512), (512, 1024), (1024, 1536), (1536, 2048)]
    assert dx_slices(1536, 512, lean=True) == [(0, 512), (512, 1024), (1024, 1536)]


def test_dx_slices_factor(monkeypatch):
    # DX_SLICE_FACTOR bounds a slice in reduction widths: wide enough, one slice; the lean slices stay a quarter of d
    from blazecore import _moe_gpu

    monkeypatch.setattr(_moe_gpu, "DX_SLICE_FACTOR", 64)
    assert _moe_gpu.dx_slices(1536, 512) == [(0, 1536)]
    assert _moe_gpu.dx_slices(1536, 512, lean=True) == [(0, 512), (512, 1024), (1024, 1536)]
    monkeypatch.setattr(_moe_gpu, "DX_SLICE_FACTOR", 1)
    assert _moe_gpu.dx_slices(1536, 512) == [(0, 512), (512, 1024), (1024, 1536)]
    assert _moe_gpu.dx_slices(2048, 2048) == [(0, 2048)]


def test_o_slices():
    from blazecore._moe_gpu import O_SLICE_COLS, o_slices

    assert o_slices(1024) == [(0, 1024)]
    assert o_slices(4096) == [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4096)]
    assert o_slices(1064) == [(0, 768), (768, 1064)]
    for d in (8, 1000, 1536, 2048, 5000, 7168):
        sl = o_slices(d)
        assert sl[0][0] == 0 and sl[-1][1] == d and all(a[1] == b[0] for a, b in zip(sl[:-1], sl[1:], strict=True))
        assert all((c1 - c0) % 256 == 0 for c0, c1 in sl[:-1]) and max(c1 - c0 for c0, c1 in sl) <= O_SLICE_COLS


def test_h_slices():
    from blazecore._moe_gpu import h_slices

    assert h_slices(1024, 2048) == [(0, 1024)]
    assert h_slices(14336, 4096) == [(0, 3584), (3584, 7168), (7168, 10752), (10752, 14336)]
    assert h_slices(600, 40) == [(0, 256), (256, 512), (512, 600)]
    # lean (checkpoint "none", or h > d): at most half of h and of d (whole 256-column tiles)
    assert h_slices(1024, 2048, lean=True) == [(0, 512), (512, 1024)]
    assert h_slices(768, 2048, lean=True) == [(0, 512), (512, 768)]
    assert h_slices(256, 1536, lean=True) == [(0, 256)]
    assert h_slices(14336, 4096, lean=True) == [(c, c + 2048) for c in range(0, 14336, 2048)]


@pytest.mark.gpu
@pytest.mark.parametrize("dname", [pytest.param(k, id=k) for k in ("bf16", "f32")])
@pytest.mark.parametrize("activation", [pytest.param(a, id=a) for a in ("swiglu", "gelu")])
@pytest.mark.parametrize("which", ["o", "dx", "h"])
def test_column_slices_bit_identical_gpu(which, activation, dname, monkeypatch):
    """y and its per-slot rows (column slices of d in the forward), dx (column slices of d) and dh' / dw2 (column
    slices of h) computed in slices have the bits of the one-slice computation: each element's sum is the same."""
    from blazecore import _moe_gpu

    case = next(c for c in CASES if c.name == ("wide_h" if which == "h" else "wide_d"))
    dev = _on(_inputs(case, dname, activation, True), "gpu")
    R = (2 if activation == "swiglu" else 1) * case.h
    if which == "dx":
        assert len(_moe_gpu.dx_slices(case.d, R)) > 1
    elif which == "o":
        assert len(_moe_gpu.o_slices(case.d)) > 1
    else:
        assert len(_moe_gpu.h_slices(case.h, case.d)) > 1
    for checkpoint in ("ab", "none"):
        y_sliced, _, sliced = _run(dev, activation, checkpoint)
        with monkeypatch.context() as m:
            m.setattr(_moe_gpu, f"{which}_slices", lambda n, *_a, **_k: [(0, n)])
            y_whole, _, whole = _run(dev, activation, checkpoint)
        if not (which == "h" and checkpoint == "none"):  # (h > d) sums y over the slices: test_z_sliced_backward
            assert _bytes(y_sliced) == _bytes(y_whole), f"{checkpoint} y"
        for key in GRAD_KEYS:
            if key == "dx" and which == "h" and checkpoint == "none":
                continue  # the z-sliced backward (h > d) sums dx over the slices: test_z_sliced_backward
            assert _bytes(getattr(sliced, key)) == _bytes(getattr(whole, key)), f"{checkpoint} {key}"


@pytest.mark.gpu
@pytest.mark.parametrize("dname", [pytest.param(k, id=k) for k in ("bf16", "f32")])
@pytest.mark.parametrize("activation", [pytest.param(a, id=a) for a in ("swiglu", "gelu")])
def test_lean_slices_bit_identical_gpu(activation, dname, monkeypatch):
    """Checkpoint "none" runs dx and dh' / dw2 in narrower column slices (lean=True); the gradients have the bits
    of the default slicing."""
    from blazecore import _moe_gpu

    case = Case("lean", 300, 528, 520, 4, 2, "skewed")
    R = (2 if activation == "swiglu" else 1) * case.h
    assert len(_moe_gpu.dx_slices(case.d, R, lean=True)) > len(_moe_gpu.dx_slices(case.d, R))
    assert len(_moe_gpu.h_slices(case.h, case.d, lean=True)) > len(_moe_gpu.h_slices(case.h, case.d))
    dev = _on(_inputs(case, dname, activation, True), "gpu")
    y_lean, _, lean = _run(dev, activation, "none")
    with monkeypatch.context() as m:
        for which in ("dx", "h"):
            f = getattr(_moe_gpu, f"{which}_slices")
            m.setattr(_moe_gpu, f"{which}_slices", lambda *a, _f=f, **_k: _f(*a))
        y, _, plain = _run(dev, activation, "none")
    assert _bytes(y_lean) == _bytes(y)
    for key in GRAD_KEYS:
        assert _bytes(getattr(lean, key)) == _bytes(getattr(plain, key)), key


@pytest.mark.gpu
@pytest.mark.parametrize("activation", [pytest.param(a, id=a) for a in ("swiglu", "gelu")])
@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES
                                  if c.name in ("L63", "odd", "empty_experts", "one_expert", "tiles", "wide_d",
                                                "wide_h")])
def test_sm90_b_load_paths_bit_identical_gpu(case, activation, monkeypatch):
    """The sm_90a M-grouped kernels load the weights by TMA or by cp.async (_moe_gpu.B_LOADS): the shared-memory
    tiles are the same, so y and every gradient have the same bits, and match the reference (bf16, both policies,
    bias on). dh' runs its epilogue in the consumers both ways (DHCUR "fused"; the "overlap" form takes the weights
    by TMA only, see test_sm90_dhcur_forms_gpu). On other GPUs both names run the same kernels."""
    from blazecore import _moe_gpu

    monkeypatch.delenv("BLAZECORE_SM90_B_LOAD", raising=False)
    monkeypatch.setenv("BLAZECORE_SM90_DHCUR", "fused")
    inp = _inputs(case, "bf16", activation, True)
    dev = _on(inp, "gpu")
    exp = _reference(inp, activation, "gpu")
    for checkpoint in ("ab", "none"):
        _paths_agree(lambda b_load: monkeypatch.setattr(_moe_gpu, "B_LOAD", b_load), _moe_gpu.B_LOADS, dev, inp, exp,
                     activation, checkpoint)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACT_PARAMS)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES
                                  if c.name in ("L63", "odd", "empty_experts", "one_expert", "tiles", "wide_d",
                                                "wide_h")])
def test_sm90_dhcur_forms_gpu(case, activation, monkeypatch):
    """dh' with its epilogue on the producer warpgroup (DHCUR "overlap", moe_dhcur_sm90; "wide", its 512-thread form)
    and in the consumers ("fused"): each matches the float64 reference (bf16, both policies, bias on) and gives the
    same bits run to run; "wide" gives the bits of "overlap" (the same arithmetic a row, the same dh'). (The overlap
    forms round dh' to bf16 before the activation backward and sum the dgates partials in another order, so their
    bits and the fused form's may differ.)"""
    from blazecore import _compile, _moe_gpu

    monkeypatch.delenv("BLAZECORE_SM90_B_LOAD", raising=False)
    inp = _inputs(case, "bf16", activation, True)
    dev = _on(inp, "gpu")
    exp = _reference(inp, activation, "gpu")
    for checkpoint in ("ab", "none"):
        bits = {}
        for form in _moe_gpu.DHCUR_FORMS:
            monkeypatch.setenv("BLAZECORE_SM90_DHCUR", form)
            if _compile.device_arch() == "sm_90a":
                want = _moe_gpu._FILE_DH90 if form in _moe_gpu.DH_EPI_WARPS else _moe_gpu._FILE90
                assert _moe_gpu._Kernels(BF16, activation).variant("dhcur").file == want
            y, _, grads = _run(dev, activation, checkpoint)
            _check_against(y, grads, inp, exp, TOL[BF16], f"{form} {checkpoint} ")
            y2, _, grads2 = _run(dev, activation, checkpoint)
            for key in GRAD_KEYS:
                assert _bytes(getattr(grads, key)) == _bytes(getattr(grads2, key)), f"{form} {checkpoint} {key} rerun"
            bits[form] = [_bytes(getattr(grads, key)) for key in GRAD_KEYS]
        for key, a, b in zip(GRAD_KEYS, bits["overlap"], bits["wide"], strict=True):
            assert a == b, f"wide against overlap, {checkpoint} {key}"


@pytest.mark.gpu
@pytest.mark.parametrize("activation", [pytest.param(a, id=a) for a in ("swiglu", "gelu")])
@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES
                                  if c.name in ("L63", "odd", "empty_experts", "tiles", "wide_d", "wide_h")])
def test_sm90_staged_rows_bit_identical_gpu(case, activation, monkeypatch):
    """gemm1, dw13 and dw2 read their gathered rows (x, dy) either gathered by the kernel or staged in slot order
    first and read by TMA (_moe_gpu._stage_rows: BLAZECORE_STAGE_ROWS "never" / "always"): y and every gradient have
    the same bits, and match the reference (bf16, bias on), for both policies, in one chunk and in three (the weight
    gradients' fp32 sums carried between chunks) and with token blocks of 8 (the reduction restarting inside an
    expert). On other GPUs nothing is staged and the runs agree trivially."""
    monkeypatch.delenv("BLAZECORE_SM90_B_LOAD", raising=False)
    inp = _inputs(case, "bf16", activation, True)
    dev = _on(inp, "gpu")
    exp = _reference(inp, activation, "gpu")
    for checkpoint, kw in (("ab", {}), ("none", {}), ("ab", {"chunks": 3}), ("ab", {"block_tokens": 8})):
        _paths_agree(lambda mode: monkeypatch.setenv("BLAZECORE_STAGE_ROWS", mode), ("never", "always"), dev, inp,
                     exp, activation, checkpoint, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("nparts", range(1, 9))
def test_dgates_thread_and_warp_forms_agree_gpu(nparts):
    """moe_dgates_small (a thread a pair, no bias) sums a slot's partials in the order of moe_dgates' butterfly (a warp
    a pair): the two give the same bits (signed zeros, magnitudes far apart, a permuted pair_slot), and both match the
    float64 sum. _dgates takes the thread form where it may."""
    import cupy as cp

    from blazecore import _moe_gpu

    rng = np.random.default_rng(nparts)
    LK, K = 4099, 7
    part = (rng.standard_normal((LK, nparts)) * 10.0 ** rng.integers(-6, 6, (LK, nparts))).astype(np.float32)
    part[rng.random((LK, nparts)) < 0.05] = -0.0
    slot = rng.permutation(LK).astype(np.int32)
    dpart, dslot = cp.asarray(part), cp.asarray(slot)
    offsets = cp.asarray(np.array([0, LK], np.int32))
    kern = _moe_gpu._kernels(BF16, "swiglu")
    small, warp = cp.full(LK, np.nan, np.float32), cp.full(LK, np.nan, np.float32)
    kern.fn("blz::moe_dgates_small")((-(-LK // 256),), (256,), (dpart, np.int32(nparts), dslot, np.int64(LK), small))
    null = _moe_gpu._NULL
    kern.fn(f"blz::moe_dgates<{kern.ct}>")((-(-LK // 8),), (256,), (dpart, np.int32(nparts), dslot, offsets,
                                                                    np.int32(1), np.int64(LK), null, null, np.int32(K),
                                                                    np.int32(0), warp))
    assert small.get().tobytes() == warp.get().tobytes()
    err = np.abs(small.get() - part.astype(np.float64).sum(1)[slot])
    assert np.all(err <= 1e-6 * np.abs(part).sum(1)[slot]), err.max()
    via = cp.full(LK, np.nan, np.float32)
    disp = types.SimpleNamespace(pair_slot=dslot, expert_offsets=offsets)
    _moe_gpu._dgates(kern, dpart, nparts, disp, 1, LK, None, None, K, 0, via, None)
    assert via.get().tobytes() == warp.get().tobytes()


@pytest.mark.parametrize("var", ["BLAZECORE_SM90_B_LOAD", "BLAZECORE_SM90_OUT_STORE", "BLAZECORE_STAGE_ROWS",
                                 "BLAZECORE_SM90_CLUSTER"])
def test_kernel_settings_are_checked_at_entry(var, monkeypatch):
    """Each sm_90a kernel setting of the environment outside its list is a ValueError naming the variable, raised by
    the layer's entry before anything is allocated or launched: shown on the layer's GPU path run dry (the memory
    model), which enters the same way."""
    from blazecore import _moe_gpu, memory

    L = 61 + len(var)  # a shape of this test's own (the model caches its dry runs)
    monkeypatch.setenv(var, "sometimes")
    with pytest.raises(ValueError, match=f"{var} must be one of"):
        _moe_gpu.settings()
    with pytest.raises(ValueError, match=f"{var} must be one of"):
        memory.moe_memory(L, 32, 16, 4, 2)
    monkeypatch.delenv(var)
    assert memory.moe_memory(L, 32, 16, 4, 2).peak_bytes > 0


def test_stage_rows_policy():
    """_stage_rows: "auto" stages the rows that STAGE_MIN_TILES or more n-tiles read, "always" any, "never" none; only
    on the sm_90a path with the weights by TMA (stand-ins for the kernels)."""
    from blazecore import _moe_gpu

    def kern(mode, sm90=True, b_load="tma"):
        return types.SimpleNamespace(sm90=sm90, b_load=b_load, stage_rows=mode)

    assert _moe_gpu._stage_rows(kern("auto"), _moe_gpu.STAGE_MIN_TILES)
    assert not _moe_gpu._stage_rows(kern("auto"), _moe_gpu.STAGE_MIN_TILES - 1)
    assert not _moe_gpu._stage_rows(kern("auto", b_load="cp_async"), 1000)
    assert _moe_gpu._stage_rows(kern("always"), 1)
    assert not _moe_gpu._stage_rows(kern("always", sm90=False), 1000)
    assert not _moe_gpu._stage_rows(kern("never"), 1000)


@pytest.mark.parametrize("backend", backends())
def test_random_shapes(backend):
    """Hypothesis draws shapes and routings (d and h multiples of 8: 16-byte rows in every dtype)."""

    @settings(max_examples=25, deadline=None, derandomize=True)
    @given(
        L=st.integers(0, 130),
        d8=st.integers(1, 12),
        h8=st.integers(1, 8),
        E=st.integers(1, 20),
        k_frac=st.floats(0.0, 1.0),
        routing=st.sampled_from(["random", "skewed", "few", "same"]),
        dname=st.sampled_from(list(DTYPES)),
        activation=st.sampled_from(moe.ACTIVATIONS),
        bias=st.booleans(),
        checkpoint=st.sampled_from(moe.CHECKPOINTS),
        seed=st.integers(0, 2**31 - 1),
    )
    def check(L, d8, h8, E, k_frac, routing, dname, activation, bias, checkpoint, seed):
        K = 1 + int(k_frac * (min(E, 8) - 1))
        case = Case("hyp", L, 8 * d8, 8 * h8, E, K, routing)
        inp = _make(np.random.default_rng(seed), case, DTYPES[dname], activation, bias)
        y, _, grads = _run(_on(inp, backend), activation, checkpoint)
        _check_against(y, grads, inp, _reference(inp, activation, backend), TOL[DTYPES[dname]])

    check()


@pytest.mark.parametrize("backend", backends())
def test_zero_tokens(backend):
    case = next(c for c in CASES if c.L == 0)
    inp = _inputs(case, "bf16", "swiglu", True)
    y, saved, grads = _run(_on(inp, backend), "swiglu")
    assert to_numpy(y).shape == (0, case.d)
    assert to_numpy(grads.dx).shape == (0, case.d)
    assert to_numpy(grads.dgates).shape == (0, case.K)
    for key in ("dw13", "dw2", "db13", "db2"):
        g = np.asarray(to_numpy(getattr(grads, key)), dtype=np.float64)
        assert g.size and not np.any(g), f"{key} must be all zeros for L = 0"


@pytest.mark.parametrize("activation", ACT_PARAMS)
@pytest.mark.parametrize("dname", DTYPE_PARAMS)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES if c.name in ("L63", "E256", "tiles")])
@pytest.mark.parametrize("backend", backends())
def test_checkpoint_policies_agree(backend, case, dname, activation):
    """"ab" and "none" compute the same layer: same y bits; CPU gradients bit-identical too."""
    inp = _inputs(case, dname, activation, True)
    dev = _on(inp, backend)
    y_ab, s_ab, g_ab = _run(dev, activation, "ab")
    y_no, s_no, g_no = _run(dev, activation, "none")
    assert _bytes(y_ab) == _bytes(y_no), "y differs between checkpoint policies"
    R = s_ab.w13.shape[1]
    assert s_no.ab is None
    assert s_ab.ab is None or tuple(to_numpy(s_ab.ab).shape) == (case.L * case.K, R)
    if backend == "cpu":
        for key in GRAD_KEYS:
            assert _bytes(getattr(g_ab, key)) == _bytes(getattr(g_no, key)), f"{key} differs between policies"
        assert s_ab.held_bytes() - s_no.held_bytes() == case.L * case.K * R * DTYPES[dname].itemsize
    else:
        # the recompute may round differently from the saved pre-activations; both must be accurate
        exp = _expected(case, dname, activation, True, backend)
        _check_against(y_no, g_no, inp, exp, TOL[DTYPES[dname]], "none: ")
        _check_against(y_ab, g_ab, inp, exp, TOL[DTYPES[dname]], "ab: ")
        for key in GRAD_KEYS:
            if getattr(g_ab, key) is not None:
                assert_close(getattr(g_no, key), np.asarray(to_numpy(getattr(g_ab, key)), np.float64),
                             TOL[DTYPES[dname]], f"{key}: none vs ab")


@pytest.mark.parametrize("dname", DTYPE_PARAMS)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES if c.name in ("odd", "empty_experts")])
@pytest.mark.parametrize("backend", backends())
def test_saved_preactivations(backend, case, dname):
    """Policy "ab" keeps z of every slot, (L*K, R) in x's dtype, columns [a | b], in the dispatch's slot order."""
    activation = "swiglu"
    inp = _inputs(case, dname, activation, True)
    dev = _on(inp, backend)
    _, saved = moe.moe_forward(dev["x"], dev["w13"], dev["w2"], dev["gates"], dev["ids"], activation=activation,
                               checkpoint="ab", b13=dev["b13"], b2=dev["b2"])
    assert saved.checkpoint == "ab" and saved.activation == activation
    if saved.ab is None:  # the GPU path may keep them in saved.extra instead
        assert backend == "gpu"
        return
    ab = to_numpy(saved.ab)
    R = 2 * case.h
    assert ab.shape == (case.L * case.K, R) and ab.dtype == DTYPES[dname]
    z = ref.moe_preact_ref(inp["x"], inp["w13"], inp["ids"], inp["b13"])
    slot_token, slot_k = (to_numpy(a).astype(np.int64) for a in (saved.dispatch.slot_token, saved.dispatch.slot_k))
    assert_close(ab, z[slot_token, slot_k], TOL[DTYPES[dname]], "ab")
    # slot order: by expert, then token, then k
    experts = np.repeat(np.arange(case.E), np.diff(to_numpy(saved.dispatch.expert_offsets)))
    assert np.array_equal(inp["ids"][slot_token, slot_k], experts)


@pytest.mark.parametrize("backend", backends())
def test_backward_consumes_saved_unless_retained(backend):
    """A default backward may reuse the saved pre-activations as scratch (GPU, policy "ab"): a second backward
    on the same record raises; with retain=True two backwards give the same bytes."""
    case = next(c for c in CASES if c.name == "odd")
    inp = _inputs(case, "bf16", "swiglu", True)
    dev = _on(inp, backend)

    y, saved = moe.moe_forward(dev["x"], dev["w13"], dev["w2"], dev["gates"], dev["ids"], checkpoint="ab",
                               b13=dev["b13"], b2=dev["b2"])
    g1 = moe.moe_backward(dev["dy"], saved, retain=True)
    assert not saved.consumed
    g2 = moe.moe_backward(dev["dy"], saved, retain=True)
    g3 = moe.moe_backward(dev["dy"], saved)  # may consume
    for key in GRAD_KEYS:
        assert _bytes(getattr(g1, key)) == _bytes(getattr(g2, key)) == _bytes(getattr(g3, key)), key
    _check_against(y, g3, inp, _expected(case, "bf16", "swiglu", True, backend), TOL[DTYPES["bf16"]])
    if backend == "gpu":
        assert saved.consumed
        with pytest.raises(RuntimeError, match="consumed"):
            moe.moe_backward(dev["dy"], saved)
    else:
        assert not saved.consumed  # the CPU reference never writes into the record


@pytest.mark.parametrize("dname", DTYPE_PARAMS)
@pytest.mark.parametrize("activation", [pytest.param(a, id=a) for a in ("swiglu", "relu2")])
@pytest.mark.parametrize("checkpoint", ["ab", "none"])
@pytest.mark.parametrize("backend", backends())
def test_deterministic(backend, checkpoint, activation, dname):
    """Forward and backward twice on the same inputs: the same bytes (no atomics in the combine)."""
    case = next(c for c in CASES if c.name == "tiles")
    inp = _inputs(case, dname, activation, True)
    dev = _on(inp, backend)
    y1, s1, g1 = _run(dev, activation, checkpoint)
    y2, s2, g2 = _run(dev, activation, checkpoint)
    assert _bytes(y1) == _bytes(y2), "y not bit-identical run to run"
    assert _bytes(s1.ab) == _bytes(s2.ab), "saved pre-activations not bit-identical run to run"
    for key in GRAD_KEYS:
        assert _bytes(getattr(g1, key)) == _bytes(getattr(g2, key)), f"{key} not bit-identical run to run"


@pytest.mark.parametrize("backend", backends())
def test_out_buffers(backend):
    case = next(c for c in CASES if c.name == "L63")
    dname, activation = "bf16", "geglu"
    inp = _inputs(case, dname, activation, True)
    dev = _on(inp, backend)
    dt = DTYPES[dname]
    L, d, E, K = case.L, case.d, case.E, case.K
    R, h = inp["w13"].shape[1], case.h

    def buf(shape, dtype):
        return to_backend(np.full(shape, np.nan, dtype=dtype), backend)

    out = buf((L, d), dt)
    y, saved = moe.moe_forward(dev["x"], dev["w13"], dev["w2"], dev["gates"], dev["ids"], activation=activation,
                               b13=dev["b13"], b2=dev["b2"], out=out)
    assert y is out
    outs = {"out_dx": buf((L, d), dt), "out_dw13": buf((E, R, d), dt), "out_dw2": buf((E, d, h), dt),
            "out_dgates": buf((L, K), np.float32)}
    grads = moe.moe_backward(dev["dy"], saved, **outs)
    assert grads.dx is outs["out_dx"] and grads.dw13 is outs["out_dw13"]
    assert grads.dw2 is outs["out_dw2"] and grads.dgates is outs["out_dgates"]
    _check_against(y, grads, inp, _expected(case, dname, activation, True, backend), TOL[dt])


def test_dispatch_passed_in_cpu():
    case = next(c for c in CASES if c.name == "skewed")
    inp = _inputs(case, "f32", "swiglu", False)
    disp = build_dispatch(inp["ids"], case.E)
    y, saved, grads = _run(inp, "swiglu", dispatch=disp)
    assert saved.dispatch is disp
    _check_against(y, grads, inp, _expected(case, "f32", "swiglu", False, "cpu"), TOL[np.dtype(np.float32)])


# ---------------------------------------------------------------------------------------------
# Bad inputs: every check raises a clear error before anything is launched
# ---------------------------------------------------------------------------------------------

_BAD_CASE = Case("bad", 6, 16, 8, 4, 2, "random")


def _bad_inputs(activation: str = "swiglu") -> dict:
    rng = np.random.default_rng(7)
    return _make(rng, _BAD_CASE, np.dtype(np.float32), activation, True)


class _Final:
    """A bad value passed exactly as is (not moved to the backend, which would make it contiguous)."""

    def __init__(self, value):
        self.value = value


def _place(v, backend: str):
    if isinstance(v, _Final):
        return v.value
    return to_backend(v, backend) if isinstance(v, np.ndarray) else v


def _fwd_kwargs(inp: dict, backend: str) -> dict:
    """Forward call kwargs from host arrays (moved to the backend unless marked _Final)."""
    dev = {k: _place(v, backend) for k, v in inp.items()}
    return {"x": dev["x"], "w13": dev["w13"], "w2": dev["w2"], "gates": dev["gates"], "expert_ids": dev["ids"],
            "b13": dev["b13"], "b2": dev["b2"]}


def _noncontig(a: np.ndarray, backend: str):
    """The same values as a non-C-contiguous view on the backend (every other element of a wider last axis)."""
    wide = np.repeat(a, 2, axis=-1)
    return _Final(to_backend(wide, backend)[..., ::2])


def _huge(shape, dtype, backend):
    """A zero-stride view of the given shape (no memory): size checks run before layout checks."""
    base = to_backend(np.zeros((1,) * len(shape), dtype=dtype), backend)
    if backend == "cpu":
        return _Final(np.broadcast_to(base, shape))
    import cupy

    return _Final(cupy.broadcast_to(base, shape))


def _mod(**changes):
    def f(inp, backend):
        for k, v in changes.items():
            inp[k] = v(inp, backend) if callable(v) else v
        return {}

    return f


def _kw(**kwargs):
    def f(inp, backend):
        return {k: _place(v(inp, backend) if callable(v) else v, backend) for k, v in kwargs.items()}

    return f


E_, K_, L_, d_, h_ = _BAD_CASE.E, _BAD_CASE.K, _BAD_CASE.L, _BAD_CASE.d, _BAD_CASE.h
BIG_L = 2**28  # BIG_L * 8 = 2**31 slots: one past int32

FORWARD_BAD = [
    # float64 runs on the CPU only: there x's float64 differs from the weights' float32
    ("x_float64", _mod(x=lambda i, b: i["x"].astype(np.float64)), TypeError, "float64"),
    ("x_int", _mod(x=lambda i, b: i["x"].astype(np.int32)), TypeError, "x: dtype int32"),
    ("w13_dtype", _mod(w13=lambda i, b: i["w13"].astype(np.float16)), TypeError, "w13: dtype float16"),
    ("w2_dtype", _mod(w2=lambda i, b: i["w2"].astype(BF16)), TypeError, "w2: dtype bfloat16"),
    ("b13_dtype", _mod(b13=lambda i, b: i["b13"].astype(np.float16)), TypeError, "b13: dtype"),
    ("b2_dtype", _mod(b2=lambda i, b: i["b2"].astype(np.float16)), TypeError, "b2: dtype"),
    ("gates_f16", _mod(gates=lambda i, b: i["gates"].astype(np.float16)), TypeError, "gates: dtype"),
    ("gates_f64", _mod(gates=lambda i, b: i["gates"].astype(np.float64)), TypeError, "gates: dtype"),
    ("ids_float", _mod(ids=lambda i, b: i["ids"].astype(np.float32)), TypeError, "expert_ids"),
    ("ids_int16", _mod(ids=lambda i, b: i["ids"].astype(np.int16)), TypeError, "expert_ids: dtype int16"),
    ("x_1d", _mod(x=lambda i, b: i["x"].reshape(-1)), ValueError, "x: expected 2-D"),
    ("w13_2d", _mod(w13=lambda i, b: i["w13"][0]), ValueError, "w13: expected 3-D"),
    ("w2_2d", _mod(w2=lambda i, b: i["w2"][0]), ValueError, "w2: expected 3-D"),
    ("gates_1d", _mod(gates=lambda i, b: i["gates"][:, 0]), ValueError, "gates: expected 2-D"),
    ("ids_1d", _mod(ids=lambda i, b: i["ids"][:, 0]), ValueError, "expert_ids: expected 2-D"),
    ("w2_experts", _mod(w2=lambda i, b: np.concatenate([i["w2"], i["w2"][:1]])), ValueError, "w2 has 5 experts"),
    ("w13_rows_h_gated", _mod(w13=lambda i, b: i["w13"][:, :h_], b13=lambda i, b: i["b13"][:, :h_]), ValueError,
     "w13 has 8 rows per expert; swiglu"),
    ("w13_d", _mod(w13=lambda i, b: i["w13"][:, :, :-1]), ValueError, "w13: in-features 15"),
    ("w2_d", _mod(w2=lambda i, b: i["w2"][:, :-1]), ValueError, "w2: out-features 15"),
    ("ids_vs_gates", _mod(ids=lambda i, b: i["ids"][:-1]), ValueError, "differs from gates"),
    ("gates_rows_vs_x", _mod(gates=lambda i, b: i["gates"][:-1], ids=lambda i, b: i["ids"][:-1]), ValueError,
     "gates has 5 rows"),
    ("K_gt_E", _mod(gates=lambda i, b: np.ones((L_, E_ + 1), np.float32),
                    ids=lambda i, b: np.tile(np.arange(E_ + 1, dtype=np.int32), (L_, 1))), ValueError, "exceeds"),
    ("K_zero", _mod(gates=lambda i, b: np.ones((L_, 0), np.float32), ids=lambda i, b: np.ones((L_, 0), np.int32)),
     ValueError, "K \\(top_k\\) must be >= 1"),
    ("E_zero", _mod(w13=lambda i, b: i["w13"][:0], w2=lambda i, b: i["w2"][:0], b13=None, b2=None), ValueError,
     "must be >= 1"),
    ("b13_shape", _mod(b13=lambda i, b: i["b13"][:, :-1]), ValueError, "b13: expected shape"),
    ("b2_shape", _mod(b2=lambda i, b: i["b2"][:-1]), ValueError, "b2: expected shape"),
    ("slots_overflow_int32", _mod(x=lambda i, b: _huge((BIG_L, d_), np.float32, b),
                                  gates=lambda i, b: _huge((BIG_L, 8), np.float32, b),
                                  ids=lambda i, b: _huge((BIG_L, 8), np.int32, b),
                                  w13=lambda i, b: np.zeros((8, 2 * h_, d_), np.float32),
                                  w2=lambda i, b: np.zeros((8, d_, h_), np.float32), b13=None, b2=None),
     ValueError, "int32"),
    ("x_noncontig", _mod(x=lambda i, b: _noncontig(i["x"], b)), ValueError, "x: must be C-contiguous"),
    ("w13_noncontig", _mod(w13=lambda i, b: _noncontig(i["w13"], b)), ValueError, "w13: must be C-contiguous"),
    ("w2_noncontig", _mod(w2=lambda i, b: _noncontig(i["w2"], b)), ValueError, "w2: must be C-contiguous"),
    ("gates_noncontig", _mod(gates=lambda i, b: _noncontig(i["gates"], b)), ValueError,
     "gates: must be C-contiguous"),
    ("ids_noncontig", _mod(ids=lambda i, b: _noncontig(i["ids"], b)), ValueError, "expert_ids: must be C-contig"),
    ("b2_noncontig", _mod(b2=lambda i, b: _noncontig(i["b2"], b)), ValueError, "b2: must be C-contiguous"),
    ("ids_too_big", _mod(ids=lambda i, b: np.where(np.arange(L_)[:, None] == 3, [[1, E_]], i["ids"]).astype(
        np.int32)), ValueError, "outside"),
    ("ids_negative", _mod(ids=lambda i, b: np.where(np.arange(L_)[:, None] == 2, [[-2, 0]], i["ids"]).astype(
        np.int32)), ValueError, "outside"),
    ("ids_repeat", _mod(ids=lambda i, b: np.where(np.arange(L_)[:, None] == 1, [[2, 2]], i["ids"]).astype(
        np.int32)), ValueError, "repeats"),
    ("not_an_array", _mod(x="tokens"), TypeError, "x: expected a DLPack array"),
    ("activation", _kw(activation="tanh"), ValueError, "unknown activation"),
    ("checkpoint", _kw(checkpoint="all"), ValueError, "unknown checkpoint"),
    ("nongated_with_2h", _kw(activation="gelu"), ValueError, "w13 has 16 rows per expert; gelu"),
    ("dispatch_type", _kw(dispatch=lambda i, b: (1, 2, 3)), TypeError, "dispatch: expected"),
    ("dispatch_E", _kw(dispatch=lambda i, b: build_dispatch(to_backend(i["ids"], b), E_ + 1)), ValueError,
     "dispatch.num_experts"),
    ("dispatch_L", _kw(dispatch=lambda i, b: build_dispatch(to_backend(i["ids"][:-1], b), E_)), ValueError,
     "dispatch.num_tokens"),
    ("dispatch_K", _kw(dispatch=lambda i, b: build_dispatch(to_backend(i["ids"][:, :1], b), E_)), ValueError,
     "dispatch.top_k"),
    ("out_shape", _kw(out=lambda i, b: to_backend(np.zeros((L_, d_ + 1), np.float32), b)), ValueError,
     "out: shape"),
    ("out_dtype", _kw(out=lambda i, b: to_backend(np.zeros((L_, d_), np.float16), b)), TypeError, "out: dtype"),
    ("out_noncontig", _kw(out=lambda i, b: _noncontig(np.zeros((L_, d_), np.float32), b)), ValueError,
     "out: must be C-contiguous"),
]

FORWARD_BAD_CPU = [
    ("dispatch_other_ids", _kw(dispatch=lambda i, b: build_dispatch(np.ascontiguousarray(i["ids"][::-1]), E_)),
     ValueError, "does not match expert_ids"),
    ("stream_for_cpu", _kw(stream=0), ValueError, "stream given"),
]

FORWARD_BAD_GPU = [
    ("d_unaligned", _mod(x=lambda i, b: i["x"][:, :12], w13=lambda i, b: i["w13"][:, :, :12],
                         w2=lambda i, b: i["w2"][:, :12], b2=lambda i, b: i["b2"][:, :12]), ValueError,
     "multiples of 8"),
    ("x_on_cpu", _mod(x=lambda i, b: _Final(i["x"])), ValueError, "same device"),
    ("dispatch_on_cpu", _kw(dispatch=lambda i, b: build_dispatch(i["ids"], E_)), ValueError,
     "dispatch.expert_offsets is on the CPU"),
    ("out_on_cpu", _kw(out=lambda i, b: _Final(np.zeros((L_, d_), np.float32))), ValueError, "out: on CPU"),
]


def _params(table, marks=()):
    return [pytest.param(f, exc, match, id=name, marks=marks) for name, f, exc, match in table]


@pytest.fixture
def no_launch(monkeypatch):
    """The GPU layer module replaced by one that fails if called: a check came too late."""

    import blazecore._moe_gpu as real

    def launched(*args, **kwargs):
        raise AssertionError("the MoE kernels were launched despite a bad input")

    fake = types.SimpleNamespace(forward=launched, backward=launched, check_shapes=real.check_shapes)
    monkeypatch.setattr(blazecore, "_moe_gpu", fake)


@pytest.mark.parametrize("mutate, exc, match", _params(FORWARD_BAD) + _params(FORWARD_BAD_CPU))
def test_forward_bad_inputs_cpu(mutate, exc, match):
    inp = _bad_inputs()
    extra = mutate(inp, "cpu")
    with pytest.raises(exc, match=match):
        moe.moe_forward(**_fwd_kwargs(inp, "cpu"), **extra)


@pytest.mark.gpu
@pytest.mark.parametrize("mutate, exc, match", _params(FORWARD_BAD) + _params(FORWARD_BAD_GPU))
def test_forward_bad_inputs_gpu(mutate, exc, match, no_launch):
    inp = _bad_inputs()
    extra = mutate(inp, "gpu")
    with pytest.raises(exc, match=match):
        moe.moe_forward(**_fwd_kwargs(inp, "gpu"), **extra)


BACKWARD_BAD = [
    ("dy_shape", lambda i, s, b: {"dy": to_backend(np.zeros((L_ + 1, d_), np.float32), b)}, ValueError,
     "dy: expected shape"),
    ("dy_dtype", lambda i, s, b: {"dy": to_backend(i["dy"].astype(np.float16), b)}, TypeError, "dy: dtype float16"),
    ("dy_noncontig", lambda i, s, b: {"dy": _noncontig(i["dy"], b)}, ValueError, "dy: must be C-contiguous"),
    ("saved_type", lambda i, s, b: {"saved": (s.x, s.w13)}, TypeError, "saved: expected the MoESaved"),
    ("out_dx_shape", lambda i, s, b: {"out_dx": to_backend(np.zeros((L_, d_ + 1), np.float32), b)}, ValueError,
     "out_dx: shape"),
    ("out_dw13_dtype", lambda i, s, b: {"out_dw13": to_backend(np.zeros((E_, 2 * h_, d_), np.float16), b)},
     TypeError, "out_dw13: dtype"),
    ("out_dw2_shape", lambda i, s, b: {"out_dw2": to_backend(np.zeros((E_, h_, d_), np.float32), b)}, ValueError,
     "out_dw2: shape"),
    ("out_dgates_dtype", lambda i, s, b: {"out_dgates": to_backend(np.zeros((L_, K_), np.float16), b)}, TypeError,
     "out_dgates: dtype"),
    ("out_dx_noncontig", lambda i, s, b: {"out_dx": _noncontig(np.zeros((L_, d_), np.float32), b)}, ValueError,
     "out_dx: must be C-contiguous"),
]
BACKWARD_BAD_CPU = [("stream_for_cpu", lambda i, s, b: {"stream": 0}, ValueError, "stream given")]
BACKWARD_BAD_GPU = [
    ("dy_on_cpu", lambda i, s, b: {"dy": _Final(i["dy"])}, ValueError, "dy is on the CPU"),
    ("out_dgates_on_cpu", lambda i, s, b: {"out_dgates": _Final(np.zeros((L_, K_), np.float32))}, ValueError,
     "out_dgates: on CPU"),
]


def _backward_bad(backend: str, f) -> dict:
    inp = _bad_inputs()
    _, saved = moe.moe_forward(**_fwd_kwargs(inp, backend))
    args = {"dy": to_backend(inp["dy"], backend), "saved": saved}
    args.update({k: (v.value if isinstance(v, _Final) else v) for k, v in f(inp, saved, backend).items()})
    return args


@pytest.mark.parametrize("f, exc, match", _params(BACKWARD_BAD) + _params(BACKWARD_BAD_CPU))
def test_backward_bad_inputs_cpu(f, exc, match):
    args = _backward_bad("cpu", f)
    with pytest.raises(exc, match=match):
        moe.moe_backward(args.pop("dy"), args.pop("saved"), **args)


@pytest.mark.gpu
@pytest.mark.parametrize("f, exc, match", _params(BACKWARD_BAD) + _params(BACKWARD_BAD_GPU))
def test_backward_bad_inputs_gpu(f, exc, match, monkeypatch):
    args = _backward_bad("gpu", f)  # a real forward first

    def launched(*a, **k):
        raise AssertionError("the MoE backward kernels were launched despite a bad input")

    import blazecore._moe_gpu as gpu_mod

    monkeypatch.setattr(gpu_mod, "backward", launched)
    with pytest.raises(exc, match=match):
        moe.moe_backward(args.pop("dy"), args.pop("saved"), **args)


# ---------------------------------------------------------------------------------------------
# GPU only: CUDA-graph capture with a routing that changes between replays
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("activation", [pytest.param(a, id=a) for a in ("swiglu", "gelu")])
@pytest.mark.parametrize("checkpoint", ["ab", "none"])
@pytest.mark.parametrize("dname", [pytest.param(k, id=k) for k in ("f32", "bf16")])
def test_cuda_graph_replay_with_new_routing(dname, checkpoint, activation):
    """Capture dispatch build + forward + backward once; replays follow ids/gates changed in place.

    Nothing in the captured work may read the routing on the host: the graph fixes shapes and
    pointers only, so the replay after the in-place update must match the reference of the new ids.
    """
    import cupy

    case = Case("graph", 300, 64, 32, 8, 2, "skewed")
    dt = DTYPES[dname]
    rng = np.random.default_rng(11)
    inp = _make(rng, case, dt, activation, True)
    new = _make(rng, case, dt, activation, True, routing="random")
    for k in ("x", "w13", "w2", "b13", "b2", "dy"):
        new[k] = inp[k]  # only the routing (ids, gates) changes
    dev = _on(inp, "gpu")
    cupy.cuda.Device().synchronize()  # the uploads ran on the default stream; s does not wait for it
    s = cupy.cuda.Stream(non_blocking=True)

    def step():
        disp = build_dispatch(dev["ids"], case.E, validate=False, stream=s)
        y, saved = moe.moe_forward(dev["x"], dev["w13"], dev["w2"], dev["gates"], dev["ids"], activation=activation,
                                   checkpoint=checkpoint, b13=dev["b13"], b2=dev["b2"], dispatch=disp, stream=s)
        grads = moe.moe_backward(dev["dy"], saved, stream=s)
        return y, saved, grads

    # warm-up outside the capture: compiles and loads every kernel (module loading is not captured)
    with s:
        step()
    s.synchronize()

    # a private pool: blocks the graph uses are never handed to anyone else while it lives
    pool = cupy.cuda.MemoryPool()
    with cupy.cuda.using_allocator(pool.malloc), s:
        s.begin_capture()
        try:
            y, saved, grads = step()
        finally:
            graph = s.end_capture()

    for label, routing in (("captured routing", inp), ("new routing", new)):
        dev["ids"].set(routing["ids"], stream=s)
        dev["gates"].set(routing["gates"], stream=s)
        graph.launch(stream=s)
        s.synchronize()
        _check_against(y, grads, routing, _reference(routing, activation, "gpu"), TOL[dt], f"{label}: ")
    del graph, y, saved, grads
    pool.free_all_blocks()


@pytest.mark.gpu
def test_gpu_stream_argument():
    """An explicit non-default stream gives the same bytes as the current stream."""
    import cupy

    case = next(c for c in CASES if c.name == "skewed")
    inp = _inputs(case, "bf16", "swiglu", True)
    dev = _on(inp, "gpu")
    y1, _, g1 = _run(dev, "swiglu")
    cupy.cuda.Device().synchronize()  # s is non-blocking: it does not wait for the default stream
    s = cupy.cuda.Stream(non_blocking=True)
    y2, saved = moe.moe_forward(dev["x"], dev["w13"], dev["w2"], dev["gates"], dev["ids"], b13=dev["b13"],
                                b2=dev["b2"], stream=s)
    g2 = moe.moe_backward(dev["dy"], saved, stream=s)
    s.synchronize()
    assert _bytes(y1) == _bytes(y2)
    for key in GRAD_KEYS:
        assert _bytes(getattr(g1, key)) == _bytes(getattr(g2, key)), key


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACT_PARAMS)
@pytest.mark.parametrize("dname", [pytest.param(k, id=k) for k in ("bf16", "f16")])
@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES
                                  if c.name in ("L63", "empty_experts", "tiles", "wide_d")])
def test_fused_activation_operand_gpu(case, dname, activation):
    """sm_90a, checkpoint "ab", act_in_operand: the second GEMM reads z and activates its A fragments in registers
    (hcur is never stored). y and the gradients have the bits of the default forward (hcur stored by the first
    GEMM's epilogue from z as stored, then read by the plain second GEMM), and the forward holds no (L*K, h) buffer
    but z itself (non-gated: z is (L*K, h))."""
    from blazecore import _moe_gpu, memory

    inp = _inputs(case, dname, activation, True)
    dev = _on(inp, "gpu")
    kern = _moe_gpu._Kernels(DTYPES[dname], activation)
    if not kern.sm90:
        pytest.skip("the fused operand is an sm_90a kernel")
    y_fused, _, g_fused = _run(dev, activation, "ab", act_in_operand=True)
    y_plain, _, g_plain = _run(dev, activation, "ab")
    assert _bytes(y_fused) == _bytes(y_plain), "y"
    for key in GRAD_KEYS:
        assert _bytes(getattr(g_fused, key)) == _bytes(getattr(g_plain, key)), key
    exp = _expected(case, dname, activation, True, "gpu")
    _check_against(y_fused, g_fused, inp, exp, TOL[DTYPES[dname]], "fused: ")
    L, K, h = case.L, case.K, case.h
    trace = memory.moe_memory_trace(L, case.d, h, case.E, K, dtype=DTYPES[dname], activation=activation,
                                    act_in_operand=True)
    fwd = [ev[2] for ev in trace.events[:trace.forward_events] if ev[0] == "alloc"]
    assert fwd.count((L * K, h)) == (0 if moe.activation_info(activation) else 1)


def test_act_in_operand_must_be_bool():
    case = next(c for c in CASES if c.name == "L63")
    inp = _inputs(case, "f32", "swiglu", False)
    with pytest.raises(TypeError, match="act_in_operand must be a bool"):
        moe.moe_forward(inp["x"], inp["w13"], inp["w2"], inp["gates"], inp["ids"], act_in_operand="yes")


def _sm90_wgrad(kern, which, S, X, disp, E, K, blk, nb, stream, fill):
    """One sm_90a weight gradient by the layer's launcher, as float64 (E, M, d): dw13_e (M, d) = S_e^T X_g (S = dz,
    M = 2h) or dw2_e (d, M) = X_g^T S_e (X = dy, S = g * hcur, M = h), returned transposed; the output starts as
    ``fill`` (bf16 bits) everywhere."""
    import cupy

    from blazecore import _moe_gpu

    M, d = S.shape[1], X.shape[1]
    s_dev, x_dev = to_backend(S, "gpu"), to_backend(X, "gpu")
    if which == "dw13":
        out = cupy.full((E, M, d), fill, np.uint16)
        _moe_gpu._dw13_part(kern, s_dev, x_dev, out, None, disp, 0, 0, M, E, d, K, blk, nb, stream, None, 0, 0)
        return cupy.asnumpy(out).view(BF16).astype(np.float64)
    out = cupy.full((E, d, M), fill, np.uint16)
    _moe_gpu._dw2_slice(kern, s_dev, x_dev, out, disp, 0, E, d, M, blk, nb, stream)
    return cupy.asnumpy(out).view(BF16).astype(np.float64).transpose(0, 2, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("block_tokens", [pytest.param(None, id="one_block"), pytest.param(8, id="blocks_of_8")])
@pytest.mark.parametrize("which", ["dw13", "dw2"])
def test_sm90_wgrad_tma_partial_tiles_gpu(which, block_tokens, monkeypatch):
    """The sm_90a weight-gradient kernels load their slot-indexed operand (dw13: dz, dw2: g * hcur) by TMA or by
    cp.async. A TMA box always holds 64 slots, so a reduction tile shorter than that (an expert's last, or a token
    block's last when the reduction restarts at block boundaries) brings in the next expert's rows: the kernel zeroes
    them. With +Inf in every slot-indexed row of expert 1, experts 0 and 2 must stay finite, match a float64
    reference, and have the same bits on both load paths, and with B multicast in 2-CTA clusters (moe_wgrad_sm90_x2,
    BLAZECORE_SM90_CLUSTER=2: the m-tile counts here are even) as with one CTA a tile."""
    import cupy

    from blazecore import _moe_gpu

    if not _moe_gpu._Kernels(BF16, "swiglu").sm90:
        pytest.skip("an sm_90a kernel")
    rng = np.random.default_rng(7)
    E, L, K, d, M = 3, 53, 2, 136, 200  # d and M off the 64-column atoms and the 128 / 256 tiles
    ids = np.stack([rng.permutation(E)[:K] for _ in range(L)]).astype(np.int32)
    disp = build_dispatch(cupy.asarray(ids), E)
    offsets, slot_token = cupy.asnumpy(disp.expert_offsets), cupy.asnumpy(disp.slot_token)
    S = rng.standard_normal((L * K, M)).astype(BF16)  # slot-indexed: dz (M = 2h) or g * hcur (M = h)
    S[offsets[1]:offsets[2]] = np.inf
    X = rng.standard_normal((L, d)).astype(BF16)  # gathered: x or dy
    stream = cupy.cuda.get_current_stream()
    outs = {}
    for b_load, cluster in (("tma", "2"), ("tma", "1"), ("cp_async", "1")):
        monkeypatch.setenv("BLAZECORE_SM90_CLUSTER", cluster)
        kern = _moe_gpu._Kernels(BF16, "swiglu", b_load=b_load)
        blk, nb = (None, 0) if block_tokens is None else _moe_gpu._block_starts(kern, disp, E, L, block_tokens,
                                                                                stream)
        outs[b_load, cluster] = _sm90_wgrad(kern, which, S, X, disp, E, K, blk, nb, stream, 0)
    s64, x64 = S.astype(np.float64), X.astype(np.float64)
    for e in (0, 2):
        s0, s1 = offsets[e], offsets[e + 1]
        want = s64[s0:s1].T @ x64[slot_token[s0:s1]]
        for path, got in outs.items():
            assert np.isfinite(got[e]).all(), f"{path}: expert {e} took the next expert's rows"
            assert_close(got[e], want, TOL[BF16], f"{path} expert {e}")
            assert got[e].tobytes() == outs["cp_async", "1"][e].tobytes(), f"expert {e}: bits differ on {path}"


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["dw13", "dw2"])
def test_sm90_wgrad_out_store_slices_gpu(which, monkeypatch):
    """The sm_90a weight gradients store their tiles by TMA (a box of the warp's 16 rows x 64 columns; dw13's
    transposed tiles 64 x 16) or by the warps' 16-byte stores (BLAZECORE_SM90_OUT_STORE=st_global). A launch over a
    column slice of h (dw2: columns [c0, c0 + w) of h; dw13: rows [row0, row0 + pw) of 2h) with d and the slice off
    the 64-column boxes and the 128 / 256 tiles must write its slice only (the rest keeps its sentinel), match a
    float64 reference there, and give the same bits both ways."""
    import cupy

    from blazecore import _moe_gpu

    if not _moe_gpu._Kernels(BF16, "swiglu").sm90:
        pytest.skip("an sm_90a kernel")
    rng = np.random.default_rng(5)
    E, L, K, d, H, c0, w = 3, 97, 2, 200, 160, 48, 72  # H: 2h (dw13) or h (dw2); the slice [c0, c0 + w) of it
    ids = np.stack([rng.permutation(E)[:K] for _ in range(L)]).astype(np.int32)
    disp = build_dispatch(cupy.asarray(ids), E)
    offsets, slot_token = cupy.asnumpy(disp.expert_offsets), cupy.asnumpy(disp.slot_token)
    S = rng.standard_normal((L * K, H)).astype(BF16)  # slot-indexed: dz (dw13) or g * hcur (dw2)
    X = rng.standard_normal((L, d)).astype(BF16)  # gathered: x or dy
    sentinel = np.uint16(0x7FC1)  # a NaN no kernel writes
    stream = cupy.cuda.get_current_stream()
    outs = {}
    for store in ("tma", "st_global"):
        monkeypatch.setenv("BLAZECORE_SM90_OUT_STORE", store)
        kern = _moe_gpu._Kernels(BF16, "swiglu", b_load="tma")
        assert kern.out_store == store
        s_dev, x_dev = to_backend(S, "gpu"), to_backend(X, "gpu")
        if which == "dw13":  # dw13 (E, 2h, d), its rows [c0, c0 + w) from dz's columns [c0, c0 + w)
            out = cupy.full((E, H, d), sentinel, np.uint16)
            _moe_gpu._dw13_part(kern, s_dev, x_dev, out, None, disp, c0, c0, w, E, d, K, None, 0, stream, None, 0, 0)
        else:  # dw2 (E, d, h), its columns [c0, c0 + w) from the slice's g * hcur (L*K, w)
            out = cupy.full((E, d, H), sentinel, np.uint16)
            hg = to_backend(np.ascontiguousarray(S[:, c0:c0 + w]), "gpu")
            _moe_gpu._dw2_slice(kern, hg, x_dev, out, disp, c0, E, d, H, None, 0, stream)
        outs[store] = cupy.asnumpy(out)
    s64, x64 = S.astype(np.float64), X.astype(np.float64)
    for store, got in outs.items():
        inside = np.zeros(got.shape, bool)
        if which == "dw13":
            inside[:, c0:c0 + w, :] = True
        else:
            inside[:, :, c0:c0 + w] = True
        assert (got[~inside] == sentinel).all(), f"{store}: wrote outside the slice"
        for e in range(E):
            s0, s1 = offsets[e], offsets[e + 1]
            want = s64[s0:s1, c0:c0 + w].T @ x64[slot_token[s0:s1]]  # (w, d)
            g = got[e].view(BF16).astype(np.float64)
            g = g[c0:c0 + w, :] if which == "dw13" else g[:, c0:c0 + w].T
            assert_close(g, want, TOL[BF16], f"{store} expert {e}")
    assert outs["tma"].tobytes() == outs["st_global"].tobytes(), "the two store paths give different bits"


@pytest.mark.gpu
@pytest.mark.parametrize("cluster", ["1", "2"])
@pytest.mark.parametrize("which", ["dw13", "dw2"])
def test_sm90_wgrad_persistent_grids_gpu(which, cluster, monkeypatch):
    """The sm_90a weight-gradient kernels are persistent: each CTA (or 2-CTA cluster) walks the tiles with a stride of
    the grid, its stage ring running on from tile to tile while each tile's epilogue goes out through the warps' own
    staging. Any grid must give the bits of one tile a CTA: 1, 3 and 7 CTAs (clusters) walk 5 experts' 12 tiles each
    (one expert without slots, reductions off the 64-slot tiles), and every expert matches a float64 reference. The
    producer's 64-bit addressing (operands past 2^32 bytes; forced here) gives the same bits as its 32-bit one."""
    import cupy

    from blazecore import _moe_gpu

    if not _moe_gpu._Kernels(BF16, "swiglu").sm90:
        pytest.skip("an sm_90a kernel")
    monkeypatch.setenv("BLAZECORE_SM90_CLUSTER", cluster)
    c = int(cluster)
    rng = np.random.default_rng(11)
    E, L, K, d, M = 5, 300, 2, 392, 600  # 4 m-tiles (even: clusters), 3 n-tiles a tile row
    ids = np.stack([rng.choice([0, 1, 2, 4], K, replace=False) for _ in range(L)]).astype(np.int32)  # 3: no slots
    disp = build_dispatch(cupy.asarray(ids), E)
    offsets, slot_token = cupy.asnumpy(disp.expert_offsets), cupy.asnumpy(disp.slot_token)
    S = rng.standard_normal((L * K, M)).astype(BF16)  # slot-indexed: dz (M = 2h) or g * hcur (M = h)
    X = rng.standard_normal((L, d)).astype(BF16)  # gathered: x or dy
    stream = cupy.cuda.get_current_stream()
    kern = _moe_gpu._Kernels(BF16, "swiglu", b_load="tma")
    outs = {}
    for ctas in (None, 1, 3, 7, "wide"):  # None: the full grid, one tile a CTA; "wide": 64-bit addressing, 3 CTAs
        if ctas == "wide":
            monkeypatch.setattr(_moe_gpu, "_off32", lambda a, ld: False)
        n_ctas = 3 if ctas == "wide" else ctas
        monkeypatch.setattr(_moe_gpu, "_persistent_grid", lambda g, n=n_ctas: g if n is None else min(g, n))
        monkeypatch.setattr(_moe_gpu, "_persistent_cluster_grid",
                            lambda fn, kv, g, cl, n=n_ctas: g if n is None else min(g, cl * n))
        # NaN fill: a tile never written shows
        outs[ctas] = _sm90_wgrad(kern, which, S, X, disp, E, K, None, 0, stream, 0x7FC0)
    s64, x64 = S.astype(np.float64), X.astype(np.float64)
    for e in range(E):
        s0, s1 = offsets[e], offsets[e + 1]
        want = s64[s0:s1].T @ x64[slot_token[s0:s1]]
        assert_close(outs[None][e], want, TOL[BF16], f"expert {e}")
    for ctas, got in outs.items():
        assert got.tobytes() == outs[None].tobytes(), f"{ctas} CTAs (clusters of {c}): bits differ from one tile a CTA"


def test_gemm_path_argument_is_checked():
    """gemm_path is one of blazecore.GEMM_PATHS or None; anything else is a ValueError before any work (the CPU
    accepts and ignores a valid one)."""
    inp = _inputs(CASES[0], "f32", "swiglu", False)
    for bad in ("cutlass", "", 1):
        with pytest.raises(ValueError, match="gemm_path"):
            moe.moe_forward(inp["x"], inp["w13"], inp["w2"], inp["gates"], inp["ids"], gemm_path=bad)
    y0, _ = moe.moe_forward(inp["x"], inp["w13"], inp["w2"], inp["gates"], inp["ids"])
    for path in blazecore.GEMM_PATHS:
        y, saved = moe.moe_forward(inp["x"], inp["w13"], inp["w2"], inp["gates"], inp["ids"], gemm_path=path)
        assert np.array_equal(y, y0)


@pytest.mark.gpu
@pytest.mark.parametrize("checkpoint", ["ab", "none"])
@pytest.mark.parametrize("activation", ACT_PARAMS)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES
                                  if c.name in ("L63", "empty_experts", "tiles", "wide_h")])
@pytest.mark.parametrize("gemm_path", [pytest.param(p, id=p) for p in blazecore.GEMM_PATHS])
def test_layer_vs_reference_on_each_gemm_path_gpu(gemm_path, case, activation, checkpoint, monkeypatch):
    """The layer on each expert-GEMM path named by the argument (bf16, bias on), against the float64 reference. The
    environment asks for the other path: the argument decides, and the backward keeps the forward's path."""
    from blazecore import _compile, _moe_gpu

    monkeypatch.setenv("BLAZECORE_SM90", "0" if gemm_path == "wgmma" else "1")
    kern = _moe_gpu._Kernels(BF16, activation, path=gemm_path)
    assert kern.sm90 == (gemm_path == "wgmma" and _compile.device_arch() == "sm_90a")
    inp = _inputs(case, "bf16", activation, True)
    dev = _on(inp, "gpu")
    y, saved, grads = _run(dev, activation, checkpoint, gemm_path=gemm_path)
    assert saved.gemm_path == gemm_path
    _check_against(y, grads, inp, _expected(case, "bf16", activation, True, "gpu"), TOL[BF16], f"{gemm_path} ")


def test_wgmma_asked(monkeypatch):
    """What a gemm_path asks for: the argument when given, else the environment's default (BLAZECORE_SM90)."""
    from blazecore import _moe_gpu

    monkeypatch.delenv("BLAZECORE_SM90", raising=False)
    assert _moe_gpu.wgmma_asked() and _moe_gpu.wgmma_asked("wgmma") and not _moe_gpu.wgmma_asked("mma_sync")
    monkeypatch.setenv("BLAZECORE_SM90", "0")
    assert not _moe_gpu.wgmma_asked() and _moe_gpu.wgmma_asked("wgmma")
    with pytest.raises(ValueError, match="gemm_path"):
        _moe_gpu.wgmma_asked("sm90")
