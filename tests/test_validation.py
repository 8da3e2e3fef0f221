"""Input validation of every public function: one test per row of the table in docs/validation.md.

Each row names a public function, a bad input, the exception type and a fragment of its message, and where it
runs ("cpu": NumPy inputs, in CI; "gpu": CuPy inputs, marked ``gpu``). Every call also passes its valid
``out=`` buffers (where the function takes them) filled with a sentinel byte pattern, and the test checks
that the error left them untouched: a rejected call writes nothing.

The markdown table is generated from ``ROWS`` (``python tests/test_validation.py > /tmp/table.md``), and
``test_doc_table_matches`` checks that the doc lists exactly these rows, with the same exceptions and messages.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from conftest import to_backend, to_numpy

import blazecore
from blazecore import BF16, moe
from blazecore import router as rt

DOC = Path(__file__).resolve().parents[1] / "docs" / "validation.md"
BIG = 2**31


@dataclass(frozen=True)
class Row:
    id: str
    function: str
    what: str  # the bad input, in words
    exc: type
    fragment: str  # a literal part of the message
    where: str  # "cpu", "gpu" or "cpu gpu"
    build: Callable[[str], tuple[Callable[[], Any], list]]  # backend -> (the call, the sentinel-filled outs)


class Exact:
    """A value passed to the call as it is (not copied to the backend, which would make it contiguous)."""

    def __init__(self, value):
        self.value = value


def _place(v, backend):
    """A host array goes to the backend as a C-contiguous copy (the same object where it already is one on the
    CPU, so a sentinel buffer stays the object the test checks); anything else is passed as it is."""
    if isinstance(v, Exact):
        return v.value
    if isinstance(v, np.ndarray):
        return v if backend == "cpu" and v.flags.c_contiguous else to_backend(v, backend)
    return v


def _sentinel(shape, dtype, backend):
    """A buffer of 0x5A bytes (a value no op writes by chance), on the backend."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    host = np.frombuffer(b"\x5a" * (n * dtype.itemsize), dtype=dtype).reshape(shape).copy()
    if backend == "cpu":
        return host
    import cupy  # (conftest.to_backend would make a 0-d buffer 1-D)

    return cupy.asarray(host.view(np.uint16) if dtype == BF16 else host)


def _bits(a) -> bytes:
    return np.ascontiguousarray(to_numpy(a)).tobytes()


def _misaligned(a: np.ndarray, backend: str) -> Exact:
    """The same values, C-contiguous, starting one element past the start of a GPU buffer (4 bytes for float32)."""
    import cupy

    buf = cupy.empty(a.size + 1, a.dtype)
    v = buf[1:].reshape(a.shape)
    v[...] = cupy.asarray(a)
    return Exact(v)


def _noncontig(a: np.ndarray, backend: str) -> Exact:
    """The same values as a non-C-contiguous view (every other element of a wider last axis)."""
    return Exact(to_backend(np.repeat(a, 2, axis=-1), backend)[..., ::2])


def _zero_stride(shape, dtype, backend):
    """A zero-stride view of one element: any shape, no memory (size checks run before layout checks)."""
    if backend == "cpu":
        return Exact(np.broadcast_to(np.zeros((), dtype), shape))
    import cupy

    return Exact(cupy.broadcast_to(to_backend(np.zeros((1,) * len(shape), dtype), "gpu"), shape))


def _lazy(shape, dtype):
    """A C-contiguous read-only NumPy array of zeros backed by an anonymous private mapping (no memory)."""
    import mmap

    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ)
    return Exact(np.frombuffer(buf, dtype=dtype).reshape(shape))


def _other_device(a: np.ndarray, backend: str) -> Exact:
    """The array on the other side: NumPy for GPU rows, CuPy for CPU rows."""
    return Exact(a if backend == "gpu" else to_backend(a, "gpu"))


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

L_, d_, h_, E_, K_ = 6, 16, 8, 4, 2  # the layer (d and h multiples of 8 for the GPU kernels)
RL, RE, RK = 4, 8, 2  # the router


def _layer(dtype=np.float32, activation="swiglu") -> dict:
    rng = np.random.default_rng(7)
    R = 2 * h_ if moe.activation_info(activation) else h_
    g = rng.random((L_, K_)) + 0.1
    return {
        "x": rng.standard_normal((L_, d_)).astype(dtype),
        "w13": (rng.standard_normal((E_, R, d_)) / math.sqrt(d_)).astype(dtype),
        "w2": (rng.standard_normal((E_, d_, h_)) / math.sqrt(h_)).astype(dtype),
        "gates": (g / g.sum(axis=1, keepdims=True)).astype(np.float32),
        "expert_ids": np.array([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]], np.int32),
        "b13": (0.1 * rng.standard_normal((E_, R))).astype(dtype),
        "b2": (0.1 * rng.standard_normal((E_, d_))).astype(dtype),
        "dy": rng.standard_normal((L_, d_)).astype(dtype),
    }


def _logits(dtype=np.float32, L=RL, E=RE):
    return np.random.default_rng(0).standard_normal((L, E)).astype(np.float32).astype(dtype)


_IDS = np.array([[0, 1], [2, 3], [4, 5], [6, 7]], np.int32)
_DG = np.ones((RL, RK), np.float32)


def _nan_at(a: np.ndarray, *flat) -> np.ndarray:
    a = a.copy()
    vals = [np.nan, np.inf, -np.inf]
    for i, f in enumerate(flat):
        a.reshape(-1)[f] = vals[i % 3]
    return a


# ---------------------------------------------------------------------------------------------
# Builders: backend -> (call, outs)
# ---------------------------------------------------------------------------------------------

_FWD_ARGS = ("x", "w13", "w2", "gates", "expert_ids")


def fwd(dtype=np.float32, with_out=True, **changes):
    """moe_forward on the base layer with ``changes``: for an input name, a function (host inputs, backend) ->
    the new value; for a keyword, the value (or a function of (host inputs, backend))."""

    def build(backend):
        inp = _layer(dtype)
        kw = {"b13": inp["b13"], "b2": inp["b2"]}
        for k, v in changes.items():
            val = v(inp, backend) if callable(v) else v
            if k in inp:
                inp[k] = val
            kw[k] = val if k not in _FWD_ARGS else None
            if k in _FWD_ARGS:
                del kw[k]
        args = [_place(inp[k], backend) for k in _FWD_ARGS]
        kw = {k: _place(v, backend) for k, v in kw.items()}
        outs = []
        if with_out and "out" not in kw:
            x = inp["x"].value if isinstance(inp["x"], Exact) else inp["x"]
            ok = getattr(x, "ndim", 0) == 2 and np.dtype(getattr(x, "dtype", np.float64)) in (
                np.dtype(np.float32), np.dtype(np.float16), BF16)
            kw["out"] = _sentinel(tuple(x.shape) if ok else (L_, d_), x.dtype if ok else dtype, backend)
        if kw.get("out") is not None:
            outs.append(kw["out"])
        return (lambda: moe.moe_forward(*args, **kw)), outs

    return build


def bwd(dtype=np.float32, dy=None, saved=None, consume=False, **kw_changes):
    """moe_backward after a valid forward: ``dy`` / ``saved`` replace the gradient / the record (functions of
    (host inputs, backend, saved)); ``kw_changes`` replace out buffers or add keywords."""

    def build(backend):
        inp = _layer(dtype)
        dev = {k: to_backend(v, backend) for k, v in inp.items()}
        _, rec = moe.moe_forward(*(dev[k] for k in _FWD_ARGS), b13=dev["b13"], b2=dev["b2"])
        if consume:
            moe.moe_backward(dev["dy"], rec)
        kw = {"out_dx": _sentinel((L_, d_), dtype, backend), "out_dw13": _sentinel(inp["w13"].shape, dtype, backend),
              "out_dw2": _sentinel(inp["w2"].shape, dtype, backend),
              "out_dgates": _sentinel((L_, K_), np.float32, backend)}
        for k, v in kw_changes.items():
            kw[k] = _place(v(inp, backend) if callable(v) else v, backend)
        g = dev["dy"] if dy is None else _place(dy(inp, backend), backend)
        s = rec if saved is None else saved(inp, backend, rec)
        outs = [v for k, v in kw.items() if k.startswith("out_")]
        return (lambda: moe.moe_backward(g, s, **kw)), outs

    return build


def disp(ids=None, E=E_, **kw):
    """build_dispatch(ids, E) with ``ids`` a function of backend (default: the base layer's ids)."""

    def build(backend):
        i = _place(_layer()["expert_ids"], backend) if ids is None else _place(ids(backend), backend)
        return (lambda: blazecore.build_dispatch(i, E, **kw)), []

    return build


def router(fn, outs=(), **values):
    """A router function called as fn(**values); a value is a host array (moved to the backend), an Exact, a
    function of backend, or a plain value. ``outs`` names the keywords holding sentinel out buffers, given as
    (shape, dtype) in ``values`` unless replaced."""

    def build(backend):
        kw = {}
        for k, v in values.items():
            if k in outs and isinstance(v, tuple):
                kw[k] = _sentinel(v[0], v[1], backend)
            else:
                kw[k] = _place(v(backend) if callable(v) else v, backend)
        return (lambda: fn(**kw)), [kw[k] for k in outs if kw.get(k) is not None]

    return build


def _torch_layer(*args, **kw):
    pytest.importorskip("torch")
    import blazecore_torch

    return blazecore_torch.MoELayer(*args, **kw)


def _torch_requires_grad_forward():
    torch = pytest.importorskip("torch")
    inp = {k: torch.from_numpy(v) for k, v in _layer().items()}
    return moe.moe_forward(inp["x"].clone().requires_grad_(), inp["w13"], inp["w2"], inp["gates"], inp["expert_ids"])


def plain(call):
    def build(backend):
        return call, []

    return build


def _topk(**kw):
    base = {"logits": _logits(), "top_k": RK, "out_gates": ((RL, RK), np.float32), "out_ids": ((RL, RK), np.int32)}
    base.update(kw)
    return router(rt.route_topk, outs=("out_gates", "out_ids"), **base)


def _topk_bwd(**kw):
    base = {"dgates": _DG, "logits": _logits(), "expert_ids": _IDS, "out": ((RL, RE), np.float32), "validate": True}
    base.update(kw)
    return router(rt.route_topk_backward, outs=("out",), **base)


def _lb(**kw):
    base = {"logits": _logits(), "expert_ids": _IDS, "out": ((), np.float32), "validate": True}
    base.update(kw)
    return router(rt.load_balancing_loss, outs=("out",), **base)


def _lb_bwd(**kw):
    base = {"dloss": 1.0, "logits": _logits(), "expert_ids": _IDS, "out": ((RL, RE), np.float32), "validate": True}
    base.update(kw)
    return router(rt.load_balancing_loss_backward, outs=("out",), **base)


def _z(**kw):
    base = {"logits": _logits(), "out": ((), np.float32)}
    base.update(kw)
    return router(rt.router_z_loss, outs=("out",), **base)


def _z_bwd(**kw):
    base = {"dloss": 1.0, "logits": _logits(), "out": ((RL, RE), np.float32)}
    base.update(kw)
    return router(rt.router_z_loss_backward, outs=("out",), **base)


def _sum_rows(**kw):
    base = {"rows": np.ones((6, 8), F32), "index": np.zeros((RL, 2), np.int32), "out": ((RL, 8), F32)}
    base.update(kw)
    return router(blazecore.sum_rows, outs=("out",), **base)


def _bad_allocator(backend):
    import cupy

    x = to_backend(_logits(), "gpu")

    def call():
        with blazecore.allocator(lambda shape, dtype: cupy.empty((1,), cupy.float32)):
            rt.route_topk(x, RK)

    return call, []


def _mixed_ids(i, b):
    return np.where(np.arange(L_)[:, None] == 3, [[1, E_]], i["expert_ids"]).astype(np.int32)


BOTH, CPU, GPU = "cpu gpu", "cpu", "gpu"
F32, F16, BF = np.float32, np.float16, BF16

ROWS = [
    # ---- moe_forward
    Row("moe_forward.x_float64", "moe_forward", "x float64 on the GPU", TypeError,
        "x: dtype float64 not supported on the GPU", GPU, fwd(x=lambda i, b: i["x"].astype(np.float64))),
    Row("moe_forward.gates_float32_f64", "moe_forward", "x and weights float64 (CPU), gates float32", TypeError,
        "gates: dtype float32 not supported (expected one of float64)", CPU,
        fwd(x=lambda i, b: i["x"].astype(np.float64), w13=lambda i, b: i["w13"].astype(np.float64),
            w2=lambda i, b: i["w2"].astype(np.float64), b13=lambda i, b: i["b13"].astype(np.float64),
            b2=lambda i, b: i["b2"].astype(np.float64))),
    Row("moe_forward.x_int", "moe_forward", "x int32", TypeError, "x: dtype int32 not supported", BOTH,
        fwd(x=lambda i, b: i["x"].astype(np.int32))),
    Row("moe_forward.w13_dtype", "moe_forward", "w13 float16, x float32", TypeError,
        "w13: dtype float16 differs from x's float32", BOTH, fwd(w13=lambda i, b: i["w13"].astype(F16))),
    Row("moe_forward.w2_dtype", "moe_forward", "w2 bfloat16, x float32", TypeError,
        "w2: dtype bfloat16 differs from x's float32", BOTH, fwd(w2=lambda i, b: i["w2"].astype(BF))),
    Row("moe_forward.b13_dtype", "moe_forward", "b13 float16, x float32", TypeError, "b13: dtype float16 differs",
        BOTH, fwd(b13=lambda i, b: i["b13"].astype(F16))),
    Row("moe_forward.b2_dtype", "moe_forward", "b2 float16, x float32", TypeError, "b2: dtype float16 differs", BOTH,
        fwd(b2=lambda i, b: i["b2"].astype(F16))),
    Row("moe_forward.gates_dtype", "moe_forward", "gates float16", TypeError,
        "gates: dtype float16 not supported (expected one of float32)", BOTH,
        fwd(gates=lambda i, b: i["gates"].astype(F16))),
    Row("moe_forward.ids_float", "moe_forward", "expert_ids float32", TypeError,
        "expert_ids: expected an integer array", BOTH, fwd(expert_ids=lambda i, b: i["expert_ids"].astype(np.float32))),
    Row("moe_forward.ids_int16", "moe_forward", "expert_ids int16", TypeError, "expert_ids: dtype int16 not supported",
        BOTH, fwd(expert_ids=lambda i, b: i["expert_ids"].astype(np.int16))),
    Row("moe_forward.x_1d", "moe_forward", "x 1-D", ValueError, "x: expected 2-D (L, d) tokens", BOTH,
        fwd(x=lambda i, b: i["x"].reshape(-1))),
    Row("moe_forward.w13_2d", "moe_forward", "w13 2-D", ValueError, "w13: expected 3-D", BOTH,
        fwd(w13=lambda i, b: i["w13"][0])),
    Row("moe_forward.w2_2d", "moe_forward", "w2 2-D", ValueError, "w2: expected 3-D", BOTH,
        fwd(w2=lambda i, b: i["w2"][0])),
    Row("moe_forward.gates_1d", "moe_forward", "gates 1-D", ValueError, "gates: expected 2-D", BOTH,
        fwd(gates=lambda i, b: i["gates"][:, 0])),
    Row("moe_forward.ids_1d", "moe_forward", "expert_ids 1-D", ValueError, "expert_ids: expected 2-D", BOTH,
        fwd(expert_ids=lambda i, b: i["expert_ids"][:, 0])),
    Row("moe_forward.w2_experts", "moe_forward", "w2 with E + 1 experts", ValueError, "w2 has 5 experts, w13 has 4",
        BOTH, fwd(w2=lambda i, b: np.concatenate([i["w2"], i["w2"][:1]]))),
    Row("moe_forward.w13_in_features", "moe_forward", "w13 in-features != d", ValueError,
        "w13: in-features 15 (w13.shape[2]) do not match x's d = 16", BOTH, fwd(w13=lambda i, b: i["w13"][:, :, :-1])),
    Row("moe_forward.w2_out_features", "moe_forward", "w2 out-features != d", ValueError,
        "w2: out-features 15 (w2.shape[1]) do not match x's d = 16", BOTH, fwd(w2=lambda i, b: i["w2"][:, :-1])),
    Row("moe_forward.w13_rows_gated", "moe_forward", "w13 with h rows for a gated activation", ValueError,
        "w13 has 8 rows per expert; swiglu (gated) with w2's h = 8 needs 16", BOTH,
        fwd(w13=lambda i, b: i["w13"][:, :h_], b13=lambda i, b: i["b13"][:, :h_])),
    Row("moe_forward.w13_rows_nongated", "moe_forward", "w13 with 2h rows for a non-gated activation", ValueError,
        "w13 has 16 rows per expert; gelu (non-gated) with w2's h = 8 needs 8", BOTH, fwd(activation="gelu")),
    Row("moe_forward.ids_vs_gates", "moe_forward", "expert_ids and gates of different shapes", ValueError,
        "expert_ids shape (5, 2) differs from gates shape (6, 2)", BOTH,
        fwd(expert_ids=lambda i, b: i["expert_ids"][:-1])),
    Row("moe_forward.gates_rows", "moe_forward", "gates rows != L", ValueError, "gates has 5 rows, x has L = 6 tokens",
        BOTH, fwd(gates=lambda i, b: i["gates"][:-1], expert_ids=lambda i, b: i["expert_ids"][:-1])),
    Row("moe_forward.K_gt_E", "moe_forward", "K > E", ValueError,
        "top_k K = 5 exceeds the number of experts E = 4", BOTH,
        fwd(gates=lambda i, b: np.ones((L_, E_ + 1), np.float32),
            expert_ids=lambda i, b: np.tile(np.arange(E_ + 1, dtype=np.int32), (L_, 1)))),
    Row("moe_forward.K_zero", "moe_forward", "K = 0", ValueError, "K (top_k) must be >= 1, got 0", BOTH,
        fwd(gates=lambda i, b: np.ones((L_, 0), np.float32), expert_ids=lambda i, b: np.ones((L_, 0), np.int32))),
    Row("moe_forward.E_zero", "moe_forward", "E = 0 (empty weights)", ValueError, "E (experts) must be >= 1, got 0",
        BOTH, fwd(w13=lambda i, b: i["w13"][:0], w2=lambda i, b: i["w2"][:0], b13=None, b2=None)),
    Row("moe_forward.b13_shape", "moe_forward", "b13 of the wrong shape", ValueError,
        "b13: expected shape (4, 16), got (4, 15)", BOTH, fwd(b13=lambda i, b: i["b13"][:, :-1])),
    Row("moe_forward.b2_shape", "moe_forward", "b2 of the wrong shape", ValueError,
        "b2: expected shape (4, 16), got (3, 16)", BOTH, fwd(b2=lambda i, b: i["b2"][:-1])),
    Row("moe_forward.slots_overflow", "moe_forward", "L * K = 2**31 slots (zero-stride inputs)", ValueError,
        "L * K (268435456 * 8), the number of slots = 2147483648 exceeds the int32 range", BOTH,
        fwd(with_out=False, x=lambda i, b: _zero_stride((2**28, d_), F32, b),
            gates=lambda i, b: _zero_stride((2**28, 8), F32, b),
            expert_ids=lambda i, b: _zero_stride((2**28, 8), np.int32, b),
            w13=lambda i, b: np.zeros((8, 2 * h_, d_), F32), w2=lambda i, b: np.zeros((8, d_, h_), F32),
            b13=None, b2=None)),
    Row("moe_forward.d_overflow", "moe_forward", "d = 2**31 (zero-stride inputs)", ValueError,
        "d = 2147483648 exceeds the int32 range", BOTH,
        fwd(with_out=False, x=lambda i, b: _zero_stride((1, BIG), F32, b), gates=lambda i, b: np.ones((1, 1), F32),
            expert_ids=lambda i, b: np.zeros((1, 1), np.int32),
            w13=lambda i, b: _zero_stride((1, 2 * h_, BIG), F32, b), w2=lambda i, b: _zero_stride((1, BIG, h_), F32, b),
            b13=None, b2=None)),
    Row("moe_forward.x_noncontig", "moe_forward", "x not C-contiguous", ValueError, "x: must be C-contiguous", BOTH,
        fwd(x=lambda i, b: _noncontig(i["x"], b))),
    Row("moe_forward.w13_noncontig", "moe_forward", "w13 not C-contiguous", ValueError, "w13: must be C-contiguous",
        BOTH, fwd(w13=lambda i, b: _noncontig(i["w13"], b))),
    Row("moe_forward.w2_noncontig", "moe_forward", "w2 not C-contiguous", ValueError, "w2: must be C-contiguous",
        BOTH, fwd(w2=lambda i, b: _noncontig(i["w2"], b))),
    Row("moe_forward.gates_noncontig", "moe_forward", "gates not C-contiguous", ValueError,
        "gates: must be C-contiguous", BOTH, fwd(gates=lambda i, b: _noncontig(i["gates"], b))),
    Row("moe_forward.ids_noncontig", "moe_forward", "expert_ids not C-contiguous", ValueError,
        "expert_ids: must be C-contiguous", BOTH, fwd(expert_ids=lambda i, b: _noncontig(i["expert_ids"], b))),
    Row("moe_forward.b13_noncontig", "moe_forward", "b13 not C-contiguous", ValueError, "b13: must be C-contiguous",
        BOTH, fwd(b13=lambda i, b: _noncontig(i["b13"], b))),
    Row("moe_forward.b2_noncontig", "moe_forward", "b2 not C-contiguous", ValueError, "b2: must be C-contiguous",
        BOTH, fwd(b2=lambda i, b: _noncontig(i["b2"], b))),
    Row("moe_forward.ids_out_of_range", "moe_forward", "an id >= E", ValueError,
        "expert_ids[3, 1] = 4 is outside [0, 4)", BOTH, fwd(expert_ids=_mixed_ids)),
    Row("moe_forward.ids_negative", "moe_forward", "a negative id other than -1", ValueError,
        "expert_ids[2, 0] = -2 is outside [0, 4) and is not -1",
        BOTH, fwd(expert_ids=lambda i, b: np.where(np.arange(L_)[:, None] == 2, [[-2, 0]], i["expert_ids"]).astype(
            np.int32))),
    Row("moe_forward.ids_repeat", "moe_forward", "an id twice in a row", ValueError,
        "expert_ids[1, 1] = 2 repeats expert_ids[1, 0]", BOTH,
        fwd(expert_ids=lambda i, b: np.where(np.arange(L_)[:, None] == 1, [[2, 2]], i["expert_ids"]).astype(
            np.int32))),
    Row("moe_forward.not_an_array", "moe_forward", "x a string", TypeError, "x: expected a DLPack array", BOTH,
        fwd(x=lambda i, b: Exact("tokens"))),
    Row("moe_forward.activation", "moe_forward", "unknown activation name", ValueError, "unknown activation 'tanh'",
        BOTH, fwd(activation="tanh")),
    Row("moe_forward.checkpoint", "moe_forward", "unknown checkpoint policy", ValueError,
        "unknown checkpoint policy 'all'", BOTH, fwd(checkpoint="all")),
    Row("moe_forward.interleaved_plain", "moe_forward", "a non-gated activation with the suffix _interleaved",
        ValueError, "unknown activation 'gelu_interleaved'", BOTH, fwd(activation="gelu_interleaved")),
    Row("moe_forward.weight_layout", "moe_forward", "unknown weight layout", ValueError,
        "weight_layout must be one of 'out_in', 'in_out', got 'transposed'", BOTH, fwd(weight_layout="transposed")),
    Row("moe_forward.weight_layout_shapes", "moe_forward", "(out, in) weights with weight_layout \"in_out\"",
        ValueError, "(weight_layout 'in_out': w13 (4, 16, 16) is read as (4, 16, 16), w2 (4, 16, 8) as (4, 8, 16))",
        BOTH,
        fwd(weight_layout="in_out")),
    Row("moe_forward.dispatch_type", "moe_forward", "dispatch not a Dispatch", TypeError,
        "dispatch: expected a blazecore.dispatch.Dispatch", BOTH, fwd(dispatch=(1, 2, 3))),
    Row("moe_forward.dispatch_E", "moe_forward", "dispatch built for E + 1 experts", ValueError,
        "dispatch.num_experts = 5 does not match the inputs (4)", BOTH,
        fwd(dispatch=lambda i, b: Exact(blazecore.build_dispatch(to_backend(i["expert_ids"], b), E_ + 1)))),
    Row("moe_forward.dispatch_L", "moe_forward", "dispatch of L - 1 tokens", ValueError,
        "dispatch.num_tokens = 5 does not match the inputs (6)", BOTH,
        fwd(dispatch=lambda i, b: Exact(blazecore.build_dispatch(to_backend(i["expert_ids"][:-1], b), E_)))),
    Row("moe_forward.dispatch_K", "moe_forward", "dispatch of another K", ValueError,
        "dispatch.top_k = 1 does not match the inputs (2)", BOTH,
        fwd(dispatch=lambda i, b: Exact(blazecore.build_dispatch(to_backend(i["expert_ids"][:, :1], b), E_)))),
    Row("moe_forward.dispatch_other_ids", "moe_forward", "dispatch of other ids (checked on the CPU only)", ValueError,
        "does not match expert_ids", CPU,
        fwd(dispatch=lambda i, b: Exact(blazecore.build_dispatch(np.ascontiguousarray(i["expert_ids"][::-1]), E_)))),
    Row("moe_forward.out_shape", "moe_forward", "out of the wrong shape", ValueError,
        "out: shape (6, 17), expected (6, 16)", BOTH, fwd(out=lambda i, b: _sentinel((L_, d_ + 1), F32, b))),
    Row("moe_forward.out_dtype", "moe_forward", "out float16, x float32", TypeError,
        "out: dtype float16, expected float32", BOTH, fwd(out=lambda i, b: _sentinel((L_, d_), F16, b))),
    Row("moe_forward.out_noncontig", "moe_forward", "out not C-contiguous", ValueError, "out: must be C-contiguous",
        BOTH, fwd(out=lambda i, b: _noncontig(np.zeros((L_, d_), F32), b))),
    Row("moe_forward.stream_cpu", "moe_forward", "a stream with CPU inputs", ValueError,
        "stream given, but the inputs are CPU arrays", CPU, fwd(stream=0)),
    Row("moe_forward.nonfinite_x", "moe_forward", "NaN / inf in x (check_finite=True)", FloatingPointError,
        "x: 3 non-finite values (NaN or inf) of 96", BOTH,
        fwd(x=lambda i, b: _nan_at(i["x"], 0, 7, 95), check_finite=True)),
    Row("moe_forward.nonfinite_w2_bf16", "moe_forward", "inf in bfloat16 w2 (check_finite=True)", FloatingPointError,
        "w2: 1 non-finite value (NaN or inf) of 512", BOTH,
        fwd(dtype=BF, w2=lambda i, b: _nan_at(i["w2"], 300), check_finite=True)),
    Row("moe_forward.nonfinite_gates", "moe_forward", "NaN in gates (check_finite=True)", FloatingPointError,
        "gates: 1 non-finite value", BOTH, fwd(gates=lambda i, b: _nan_at(i["gates"], 5), check_finite=True)),
    Row("moe_forward.chunks_zero", "moe_forward", "chunks = 0", ValueError,
        'chunks must be an int >= 1 or "auto", got 0', BOTH, fwd(chunks=0)),
    Row("moe_forward.chunks_float", "moe_forward", "chunks = 2.5", ValueError,
        'chunks must be an int >= 1 or "auto", got 2.5', BOTH, fwd(chunks=2.5)),
    Row("moe_forward.block_tokens_zero", "moe_forward", "block_tokens = 0", ValueError,
        "block_tokens must be an int >= 1, got 0", BOTH, fwd(chunks=2, block_tokens=0)),
    Row("moe_forward.memory_budget_fraction", "moe_forward", 'chunks="auto" with memory_budget = 1.5 (GPU)',
        ValueError, "memory budget fraction must be in (0, 1], got 1.5", GPU,
        fwd(chunks="auto", memory_budget=1.5)),
    Row("moe_forward.memory_budget_type", "moe_forward", 'chunks="auto" with a string memory_budget (GPU)',
        TypeError, "memory budget: expected bytes (int) or a fraction", GPU, fwd(chunks="auto", memory_budget="lots")),
    Row("moe_forward.memory_budget_negative", "moe_forward", 'chunks="auto" with memory_budget = -5', ValueError,
        "memory budget must be >= 0 bytes, got -5", BOTH, fwd(chunks="auto", memory_budget=-5)),
    Row("moe_forward.d_unaligned", "moe_forward", "d not a multiple of 8 (GPU kernels)", ValueError,
        "the GPU kernels need d and h to be multiples of 8", GPU,
        fwd(x=lambda i, b: i["x"][:, :12], w13=lambda i, b: i["w13"][:, :, :12], w2=lambda i, b: i["w2"][:, :12],
            b2=lambda i, b: i["b2"][:, :12])),
    Row("moe_forward.w13_misaligned", "moe_forward", "w13 starting 4 bytes past a 16-byte boundary (GPU kernels)",
        ValueError, "w13: the GPU kernels need its data to start on a boundary of 16 bytes", GPU,
        fwd(w13=lambda i, b: _misaligned(i["w13"], b))),
    Row("moe_forward.b13_misaligned", "moe_forward", "b13 (float32) starting 4 bytes past an 8-byte boundary",
        ValueError, "b13: the GPU kernels need its data to start on a boundary of 8 bytes", GPU,
        fwd(b13=lambda i, b: _misaligned(i["b13"], b))),
    Row("moe_forward.x_on_cpu", "moe_forward", "x on the CPU, the rest on the GPU", ValueError,
        "inputs must all be on the same device", GPU, fwd(x=lambda i, b: Exact(i["x"]))),
    Row("moe_forward.dispatch_on_cpu", "moe_forward", "a CPU dispatch with GPU inputs", ValueError,
        "dispatch.expert_offsets is on the CPU, the inputs on the GPU", GPU,
        fwd(dispatch=lambda i, b: Exact(blazecore.build_dispatch(i["expert_ids"], E_)))),
    Row("moe_forward.out_on_cpu", "moe_forward", "a CPU out with GPU inputs", ValueError,
        "out: on CPU, inputs are on GPU", GPU, fwd(out=lambda i, b: Exact(_sentinel((L_, d_), F32, "cpu")))),
    Row("moe_forward.out_on_gpu", "moe_forward", "a GPU out with CPU inputs", ValueError,
        "out: on GPU, inputs are on CPU", GPU,
        lambda b: fwd(out=lambda i, b2: Exact(_sentinel((L_, d_), F32, "gpu")))("cpu")),
    # ---- moe_backward
    Row("moe_backward.dy_shape", "moe_backward", "dy of the wrong shape", ValueError,
        "dy: expected shape (6, 16), got (7, 16)", BOTH, bwd(dy=lambda i, b: np.zeros((L_ + 1, d_), F32))),
    Row("moe_backward.dy_dtype", "moe_backward", "dy float16, x float32", TypeError,
        "dy: dtype float16, expected x's float32", BOTH, bwd(dy=lambda i, b: i["dy"].astype(F16))),
    Row("moe_backward.dy_noncontig", "moe_backward", "dy not C-contiguous", ValueError, "dy: must be C-contiguous",
        BOTH, bwd(dy=lambda i, b: _noncontig(i["dy"], b))),
    Row("moe_backward.dy_not_an_array", "moe_backward", "dy an object", TypeError, "dy: expected a DLPack array",
        BOTH, bwd(dy=lambda i, b: Exact(object()))),
    Row("moe_backward.dy_misaligned", "moe_backward", "dy starting 4 bytes past a 16-byte boundary", ValueError,
        "dy: the GPU kernels need its data to start on a boundary of 16 bytes", GPU,
        bwd(dy=lambda i, b: _misaligned(i["dy"], b))),
    Row("moe_backward.out_dx_misaligned", "moe_backward", "out_dx starting 4 bytes past a 16-byte boundary",
        ValueError, "out_dx: the GPU kernels need its data to start on a boundary of 16 bytes", GPU,
        bwd(out_dx=lambda i, b: _misaligned(_sentinel((L_, d_), F32, "cpu"), b))),
    Row("moe_backward.saved_type", "moe_backward", "saved not a MoESaved", TypeError,
        "saved: expected the MoESaved returned by moe_forward", BOTH, bwd(saved=lambda i, b, s: (s.x, s.w13))),
    Row("moe_backward.out_dx_shape", "moe_backward", "out_dx of the wrong shape", ValueError,
        "out_dx: shape (6, 17), expected (6, 16)", BOTH, bwd(out_dx=lambda i, b: _sentinel((L_, d_ + 1), F32, b))),
    Row("moe_backward.out_dw13_dtype", "moe_backward", "out_dw13 float16", TypeError,
        "out_dw13: dtype float16, expected float32", BOTH,
        bwd(out_dw13=lambda i, b: _sentinel(i["w13"].shape, F16, b))),
    Row("moe_backward.out_dw2_shape", "moe_backward", "out_dw2 transposed", ValueError,
        "out_dw2: shape (4, 8, 16), expected (4, 16, 8)", BOTH,
        bwd(out_dw2=lambda i, b: _sentinel((E_, h_, d_), F32, b))),
    Row("moe_backward.out_dgates_dtype", "moe_backward", "out_dgates float16", TypeError,
        "out_dgates: dtype float16, expected float32", BOTH, bwd(out_dgates=lambda i, b: _sentinel((L_, K_), F16, b))),
    Row("moe_backward.out_dx_noncontig", "moe_backward", "out_dx not C-contiguous", ValueError,
        "out_dx: must be C-contiguous", BOTH, bwd(out_dx=lambda i, b: _noncontig(np.zeros((L_, d_), F32), b))),
    Row("moe_backward.stream_cpu", "moe_backward", "a stream with CPU inputs", ValueError,
        "stream given, but the inputs are CPU arrays", CPU, bwd(stream=0)),
    Row("moe_backward.nonfinite_dy", "moe_backward", "NaN in dy (check_finite=True)", FloatingPointError,
        "dy: 1 non-finite value (NaN or inf) of 96", BOTH,
        bwd(dy=lambda i, b: _nan_at(i["dy"], 50), check_finite=True)),
    Row("moe_backward.nonfinite_dy_bf16", "moe_backward", "inf in bfloat16 dy (check_finite=True)",
        FloatingPointError, "dy: 2 non-finite values", BOTH,
        bwd(dtype=BF, dy=lambda i, b: _nan_at(i["dy"], 0, 95), check_finite=True)),
    Row("moe_backward.consumed", "moe_backward", "a second backward on a consumed record (GPU, policy ab)",
        RuntimeError, "was consumed by an earlier moe_backward", GPU, bwd(consume=True)),
    Row("moe_backward.dy_on_cpu", "moe_backward", "dy on the CPU, the forward on the GPU", ValueError,
        "dy is on the CPU, the forward ran on the GPU", GPU, bwd(dy=lambda i, b: Exact(i["dy"]))),
    Row("moe_backward.out_dgates_on_cpu", "moe_backward", "a CPU out_dgates on the GPU", ValueError,
        "out_dgates: on CPU, inputs are on GPU", GPU,
        bwd(out_dgates=lambda i, b: Exact(_sentinel((L_, K_), F32, "cpu")))),
    # ---- build_dispatch
    Row("build_dispatch.ids_float", "build_dispatch", "ids float32", TypeError, "expert_ids: expected an integer array",
        BOTH, disp(ids=lambda b: _layer()["expert_ids"].astype(np.float32))),
    Row("build_dispatch.ids_int16", "build_dispatch", "ids int16", TypeError,
        "expert_ids: dtype int16 not supported (expected int32 or int64)", BOTH,
        disp(ids=lambda b: _layer()["expert_ids"].astype(np.int16))),
    Row("build_dispatch.ids_1d", "build_dispatch", "ids 1-D", ValueError, "expert_ids: expected 2-D", BOTH,
        disp(ids=lambda b: _layer()["expert_ids"][:, 0])),
    Row("build_dispatch.E_not_int", "build_dispatch", "num_experts a float", TypeError,
        "num_experts must be an integer, got float", BOTH, disp(E=4.0)),
    Row("build_dispatch.E_bool", "build_dispatch", "num_experts True", TypeError,
        "num_experts must be an integer, got bool (True)", BOTH, disp(E=True)),
    Row("build_dispatch.E_zero", "build_dispatch", "num_experts = 0", ValueError, "num_experts must be >= 1, got 0",
        BOTH, disp(E=0)),
    Row("build_dispatch.K_gt_E", "build_dispatch", "K > num_experts", ValueError,
        "expert_ids: top_k = 2 exceeds num_experts = 1", BOTH, disp(E=1)),
    Row("build_dispatch.noncontig", "build_dispatch", "ids not C-contiguous", ValueError,
        "expert_ids: must be C-contiguous", BOTH, disp(ids=lambda b: _noncontig(_layer()["expert_ids"], b))),
    Row("build_dispatch.id_out_of_range", "build_dispatch", "an id >= E", ValueError,
        "expert_ids[3, 1] = 4 is outside [0, 4)", BOTH, disp(ids=lambda b: _mixed_ids(_layer(), b))),
    Row("build_dispatch.id_repeat", "build_dispatch", "an id twice in a row", ValueError,
        "expert_ids[0, 1] = 3 repeats expert_ids[0, 0]", BOTH, disp(ids=lambda b: np.array([[3, 3]], np.int32))),
    Row("build_dispatch.slots_overflow", "build_dispatch", "L * K = 2**31 (zero-stride ids)", ValueError,
        "num_tokens * top_k (1073741824 * 2) = 2147483648 exceeds the int32 range", BOTH,
        disp(ids=lambda b: _zero_stride((2**30, 2), np.int32, b), E=8)),
    Row("build_dispatch.not_an_array", "build_dispatch", "ids an object", TypeError,
        "expert_ids: expected a DLPack array", BOTH, disp(ids=lambda b: Exact(object()))),
    Row("build_dispatch.stream_cpu", "build_dispatch", "a stream with CPU ids", ValueError,
        "stream given, but expert_ids is a CPU array", CPU, disp(stream=0)),
    Row("build_dispatch.E_smem", "build_dispatch", "E too large for shared memory (GPU)", ValueError,
        "bytes of shared memory per block", GPU, disp(E=200_000)),
    # ---- route_topk
    Row("route_topk.logits_1d", "route_topk", "logits 1-D", ValueError, "logits: expected 2-D (L, E) router logits",
        BOTH, _topk(logits=_logits()[0])),
    Row("route_topk.logits_int", "route_topk", "logits int32", TypeError, "logits: dtype int32 not supported", BOTH,
        _topk(logits=np.zeros((RL, RE), np.int32))),
    Row("route_topk.logits_float64", "route_topk", "logits float64 on the GPU", TypeError,
        "logits: dtype float64 not supported on the GPU", GPU, _topk(logits=_logits(np.float64))),
    Row("route_topk.logits_noncontig", "route_topk", "logits not C-contiguous", ValueError,
        "logits: must be C-contiguous", BOTH, _topk(logits=lambda b: _noncontig(_logits(), b))),
    Row("route_topk.no_experts", "route_topk", "E = 0", ValueError, "logits: need at least one expert", BOTH,
        _topk(logits=np.zeros((RL, 0), F32), top_k=1, out_gates=((RL, 1), F32), out_ids=((RL, 1), np.int32))),
    Row("route_topk.too_many_experts", "route_topk", "E = 8193", ValueError,
        "logits: E = 8193 experts exceeds the supported maximum 8192", BOTH,
        _topk(logits=np.zeros((1, rt.MAX_EXPERTS + 1), F32), top_k=1, out_gates=((1, 1), F32),
              out_ids=((1, 1), np.int32))),
    Row("route_topk.rows_overflow", "route_topk", "L = 2**31 rows (lazily mapped logits)", ValueError,
        "logits: L = 2147483648 exceeds the int32 range", CPU,
        _topk(logits=lambda b: _lazy((BIG, 1), BF), top_k=1, out_gates=None, out_ids=None)),
    Row("route_topk.K_zero", "route_topk", "top_k = 0", ValueError, "top_k = 0 must be in [1, E] with E = 8 experts",
        BOTH, _topk(top_k=0, out_gates=None, out_ids=None)),
    Row("route_topk.K_gt_E", "route_topk", "top_k > E", ValueError, "top_k = 9 must be in [1, E] with E = 8 experts",
        BOTH, _topk(top_k=9, out_gates=None, out_ids=None)),
    Row("route_topk.K_float", "route_topk", "top_k a float", TypeError, "top_k must be an int, got float", BOTH,
        _topk(top_k=2.0)),
    Row("route_topk.score", "route_topk", "unknown score", ValueError, "score must be one of ['sigmoid', 'softmax']",
        BOTH, _topk(score="relu")),
    Row("route_topk.bias_shape", "route_topk", "expert_bias (E + 1,)", ValueError,
        "expert_bias: expected shape (8,), got (9,)", BOTH, _topk(expert_bias=np.zeros(RE + 1, F32))),
    Row("route_topk.bias_dtype", "route_topk", "expert_bias float64", TypeError, "expert_bias: dtype float64", BOTH,
        _topk(expert_bias=np.zeros(RE, np.float64))),
    Row("route_topk.bias_noncontig", "route_topk", "expert_bias strided", ValueError,
        "expert_bias: must be C-contiguous", BOTH, _topk(expert_bias=lambda b: _noncontig(np.zeros(RE, F32), b))),
    Row("route_topk.out_gates_shape", "route_topk", "out_gates of the wrong shape", ValueError,
        "out_gates: shape (4, 3), expected (4, 2)", BOTH, _topk(out_gates=((RL, 3), F32))),
    Row("route_topk.out_gates_dtype", "route_topk", "out_gates float64", TypeError,
        "out_gates: dtype float64, expected float32", BOTH, _topk(out_gates=((RL, RK), np.float64))),
    Row("route_topk.out_ids_dtype", "route_topk", "out_ids int64", TypeError, "out_ids: dtype int64, expected int32",
        BOTH, _topk(out_ids=((RL, RK), np.int64))),
    Row("route_topk.out_gates_noncontig", "route_topk", "out_gates strided", ValueError,
        "out_gates: must be C-contiguous", BOTH, _topk(out_gates=lambda b: _noncontig(np.zeros((RL, RK), F32), b))),
    Row("route_topk.stream_cpu", "route_topk", "a stream with CPU logits", ValueError,
        "stream given, but the logits are a CPU array", CPU, _topk(stream=0)),
    Row("route_topk.nonfinite", "route_topk", "NaN / inf in the logits (check_finite=True)", FloatingPointError,
        "logits: 2 non-finite values (NaN or inf) of 32", BOTH, _topk(logits=_nan_at(_logits(), 3, 17),
                                                                       check_finite=True)),
    Row("route_topk.nonfinite_bf16", "route_topk", "NaN in bfloat16 logits (check_finite=True)", FloatingPointError,
        "logits: 1 non-finite value", BOTH, _topk(logits=_nan_at(_logits(BF), 31), check_finite=True)),
    Row("route_topk.nonfinite_bias", "route_topk", "inf in expert_bias (check_finite=True)", FloatingPointError,
        "expert_bias: 1 non-finite value", BOTH, _topk(expert_bias=_nan_at(np.zeros(RE, F32), 4), check_finite=True)),
    Row("route_topk.bias_on_cpu", "route_topk", "GPU logits, CPU expert_bias", ValueError,
        "inputs must all be on the same device", GPU, _topk(expert_bias=lambda b: Exact(np.zeros(RE, F32)))),
    Row("route_topk.out_gates_on_cpu", "route_topk", "GPU logits, CPU out_gates", ValueError,
        "out_gates: on CPU, inputs are on GPU", GPU, _topk(out_gates=lambda b: Exact(_sentinel((RL, RK), F32, "cpu")))),
    Row("route_topk.bad_allocator", "set_allocator", "an allocator returning the wrong shape", RuntimeError,
        "allocator returned (1,) float32, expected a C-contiguous (4, 2) float32", GPU, _bad_allocator),
    # ---- route_topk_backward
    Row("route_topk_backward.dgates_shape", "route_topk_backward", "dgates (L, K + 1)", ValueError,
        "dgates: expected shape (4, 2), got (4, 3)", BOTH, _topk_bwd(dgates=np.ones((RL, 3), F32))),
    Row("route_topk_backward.dgates_dtype", "route_topk_backward", "dgates float64", TypeError,
        "dgates: dtype float64 not supported", BOTH, _topk_bwd(dgates=np.ones((RL, RK), np.float64))),
    Row("route_topk_backward.ids_int64", "route_topk_backward", "ids int64", TypeError,
        "expert_ids: expected int32 expert ids (as route_topk returns), got int64", BOTH,
        _topk_bwd(expert_ids=_IDS.astype(np.int64))),
    Row("route_topk_backward.ids_float", "route_topk_backward", "ids float32", TypeError,
        "expert_ids: expected an integer array", BOTH, _topk_bwd(expert_ids=_IDS.astype(F32))),
    Row("route_topk_backward.ids_rows", "route_topk_backward", "ids with L - 1 rows", ValueError,
        "expert_ids: 3 rows, logits have L = 4", BOTH, _topk_bwd(dgates=_DG[:3], expert_ids=_IDS[:3])),
    Row("route_topk_backward.K_gt_E", "route_topk_backward", "K > E", ValueError,
        "expert_ids: K = 9 must be in [1, E] with E = 8 experts", BOTH,
        _topk_bwd(dgates=np.ones((RL, 9), F32), expert_ids=np.zeros((RL, 9), np.int32))),
    Row("route_topk_backward.ids_out_of_range", "route_topk_backward", "an id >= E (validate=True on the GPU)",
        ValueError, "expert_ids: expert ids must be in [0, 8), found values in [1, 8]", BOTH,
        _topk_bwd(expert_ids=_IDS + 1)),
    Row("route_topk_backward.ids_repeat", "route_topk_backward", "an id twice in a row (validate=True on the GPU)",
        ValueError, "expert ids must be distinct within a row; row 0 repeats one", BOTH,
        _topk_bwd(expert_ids=np.zeros((RL, RK), np.int32))),
    Row("route_topk_backward.logits_noncontig", "route_topk_backward", "logits not C-contiguous", ValueError,
        "logits: must be C-contiguous", BOTH, _topk_bwd(logits=lambda b: _noncontig(_logits(), b))),
    Row("route_topk_backward.out_dtype", "route_topk_backward", "out float16, logits float32", TypeError,
        "out: dtype float16, expected float32", BOTH, _topk_bwd(out=((RL, RE), F16))),
    Row("route_topk_backward.score", "route_topk_backward", "unknown score", ValueError, "score must be one of", BOTH,
        _topk_bwd(score="tanh")),
    Row("route_topk_backward.slots_overflow", "route_topk_backward", "L * K = 2**31 (lazily mapped inputs)",
        ValueError, "expert_ids: L*K = 2147483648 exceeds the int32 range", CPU,
        _topk_bwd(dgates=lambda b: _zero_stride((2**30, 2), F32, b), logits=lambda b: _lazy((2**30, 2), BF),
                  expert_ids=lambda b: _lazy((2**30, 2), np.int32), out=None)),
    Row("route_topk_backward.stream_cpu", "route_topk_backward", "a stream with CPU logits", ValueError,
        "stream given, but the logits are a CPU array", CPU, _topk_bwd(stream=0)),
    Row("route_topk_backward.ids_on_cpu", "route_topk_backward", "GPU logits, CPU ids", ValueError,
        "inputs must all be on the same device", GPU, _topk_bwd(expert_ids=lambda b: Exact(_IDS))),
    # ---- load_balancing_loss and its backward
    Row("load_balancing_loss.ids_int64", "load_balancing_loss", "ids int64", TypeError,
        "expert_ids: expected int32 expert ids", BOTH, _lb(expert_ids=_IDS.astype(np.int64))),
    Row("load_balancing_loss.ids_rows", "load_balancing_loss", "ids with L + 1 rows", ValueError,
        "expert_ids: 5 rows, logits have L = 4", BOTH, _lb(expert_ids=np.zeros((RL + 1, RK), np.int32))),
    Row("load_balancing_loss.ids_out_of_range", "load_balancing_loss", "an id >= E (validate=True on the GPU)",
        ValueError, "expert_ids: expert ids must be in [0, 8)", BOTH, _lb(expert_ids=_IDS + 1)),
    Row("load_balancing_loss.logits_1d", "load_balancing_loss", "logits 1-D", ValueError, "logits: expected 2-D", BOTH,
        _lb(logits=_logits()[0])),
    Row("load_balancing_loss.out_shape", "load_balancing_loss", "out (1,) instead of ()", ValueError,
        "out: shape (1,), expected ()", BOTH, _lb(out=((1,), F32))),
    Row("load_balancing_loss.out_dtype", "load_balancing_loss", "out float64", TypeError,
        "out: dtype float64, expected float32", BOTH, _lb(out=((), np.float64))),
    Row("load_balancing_loss.slots_overflow", "load_balancing_loss", "L * K = 2**31 (lazily mapped inputs)",
        ValueError, "expert_ids: L*K = 2147483648 exceeds the int32 range", CPU,
        _lb(logits=lambda b: _lazy((2**30, 2), BF), expert_ids=lambda b: _lazy((2**30, 2), np.int32), out=None)),
    Row("load_balancing_loss.stream_cpu", "load_balancing_loss", "a stream with CPU logits", ValueError,
        "stream given, but the logits are a CPU array", CPU, _lb(stream=0)),
    Row("load_balancing_loss.ids_on_cpu", "load_balancing_loss", "GPU logits, CPU ids", ValueError,
        "inputs must all be on the same device", GPU, _lb(expert_ids=lambda b: Exact(_IDS))),
    Row("load_balancing_loss_backward.dloss_bool", "load_balancing_loss_backward", "dloss True", TypeError,
        "dloss: expected a number or a one-element float32 array, got bool", BOTH, _lb_bwd(dloss=True)),
    Row("load_balancing_loss_backward.dloss_string", "load_balancing_loss_backward", "dloss a string", TypeError,
        "dloss: expected a DLPack array", BOTH, _lb_bwd(dloss=Exact("1"))),
    Row("load_balancing_loss_backward.dloss_shape", "load_balancing_loss_backward", "dloss of two elements",
        ValueError, "dloss: expected a scalar (one element), got shape (2,)", BOTH,
        _lb_bwd(dloss=np.ones(2, F32))),
    Row("load_balancing_loss_backward.ids_out_of_range", "load_balancing_loss_backward",
        "an id >= E (validate=True on the GPU)", ValueError, "expert_ids: expert ids must be in [0, 8)", BOTH,
        _lb_bwd(expert_ids=_IDS + 1)),
    Row("load_balancing_loss_backward.out_shape", "load_balancing_loss_backward", "out (L, E - 1)", ValueError,
        "out: shape (4, 7), expected (4, 8)", BOTH, _lb_bwd(out=((RL, RE - 1), F32))),
    Row("load_balancing_loss_backward.slots_overflow", "load_balancing_loss_backward",
        "L * K = 2**31 (lazily mapped inputs)", ValueError, "expert_ids: L*K = 2147483648 exceeds the int32 range", CPU,
        _lb_bwd(logits=lambda b: _lazy((2**30, 2), BF), expert_ids=lambda b: _lazy((2**30, 2), np.int32), out=None)),
    Row("load_balancing_loss_backward.stream_cpu", "load_balancing_loss_backward", "a stream with CPU logits",
        ValueError, "stream given, but the logits are a CPU array", CPU, _lb_bwd(stream=0)),
    Row("load_balancing_loss_backward.dloss_float64_gpu", "load_balancing_loss_backward",
        "a float64 device dloss", TypeError, "dloss: dtype float64 not supported", GPU,
        _lb_bwd(dloss=np.ones((), np.float64))),
    Row("load_balancing_loss_backward.dloss_gpu_logits_cpu", "load_balancing_loss_backward",
        "a device dloss with CPU logits", ValueError, "dloss: on the GPU, logits are on the CPU", GPU,
        _lb_bwd(dloss=lambda b: Exact(to_backend(np.ones((), F32), "gpu")), logits=lambda b: Exact(_logits()),
                expert_ids=lambda b: Exact(_IDS), out=None)),
    # ---- router_z_loss and its backward
    Row("router_z_loss.logits_1d", "router_z_loss", "logits 1-D", ValueError, "logits: expected 2-D", BOTH,
        _z(logits=_logits()[0])),
    Row("router_z_loss.logits_dtype", "router_z_loss", "logits int64", TypeError, "logits: dtype int64 not supported",
        BOTH, _z(logits=np.zeros((RL, RE), np.int64))),
    Row("router_z_loss.no_experts", "router_z_loss", "E = 0", ValueError, "logits: need at least one expert", BOTH,
        _z(logits=np.zeros((RL, 0), F32))),
    Row("router_z_loss.out_shape", "router_z_loss", "out (1,) instead of ()", ValueError,
        "out: shape (1,), expected ()", BOTH, _z(out=((1,), F32))),
    Row("router_z_loss.stream_cpu", "router_z_loss", "a stream with CPU logits", ValueError,
        "stream given, but the logits are a CPU array", CPU, _z(stream=0)),
    Row("router_z_loss_backward.dloss_bool", "router_z_loss_backward", "dloss True", TypeError, "got bool", BOTH,
        _z_bwd(dloss=True)),
    Row("router_z_loss_backward.dloss_shape", "router_z_loss_backward", "dloss of two elements", ValueError,
        "dloss: expected a scalar (one element)", BOTH, _z_bwd(dloss=np.ones(2, F32))),
    Row("router_z_loss_backward.out_dtype", "router_z_loss_backward", "out float16, logits float32", TypeError,
        "out: dtype float16, expected float32", BOTH, _z_bwd(out=((RL, RE), F16))),
    Row("router_z_loss_backward.logits_noncontig", "router_z_loss_backward", "logits not C-contiguous", ValueError,
        "logits: must be C-contiguous", BOTH, _z_bwd(logits=lambda b: _noncontig(_logits(), b))),
    Row("router_z_loss_backward.stream_cpu", "router_z_loss_backward", "a stream with CPU logits", ValueError,
        "stream given, but the logits are a CPU array", CPU, _z_bwd(stream=0)),
    # ---- memory model and planner
    # ---- sum_rows
    Row("sum_rows.index_int64", "sum_rows", "index int64", TypeError, "index: expected int32, got int64", BOTH,
        _sum_rows(index=np.zeros((RL, 2), np.int64))),
    Row("sum_rows.index_range", "sum_rows", "an entry = n (validate=True)", ValueError,
        "index: entry 6 is out of range for 6 rows", BOTH, _sum_rows(index=np.full((RL, 2), 6, np.int32))),
    Row("sum_rows.rows_1d", "sum_rows", "rows 1-D", ValueError, "rows: expected 2-D", BOTH,
        _sum_rows(rows=np.zeros(8, F32))),
    Row("sum_rows.rows_dtype", "sum_rows", "rows int32", TypeError, "rows: dtype int32 not supported", BOTH,
        _sum_rows(rows=np.zeros((6, 8), np.int32))),
    Row("sum_rows.out_shape", "sum_rows", "out (L + 1, w)", ValueError, "out: shape (5, 8), expected (4, 8)", BOTH,
        _sum_rows(out=((RL + 1, 8), F32))),
    Row("sum_rows.rows_width", "sum_rows", "rows of 12 bytes", ValueError,
        "rows: the GPU kernel reads 16 bytes at a time", GPU, _sum_rows(rows=np.zeros((6, 3), F32),
                                                                         out=((RL, 3), F32))),
    Row("moe_memory.checkpoint", "moe_memory", "unknown checkpoint policy", ValueError,
        "unknown checkpoint policy 'all'", CPU, plain(lambda: blazecore.moe_memory(8, 8, 8, 2, 1, checkpoint="all"))),
    Row("moe_memory.sizes", "moe_memory", "d = 0", ValueError, "sizes must be positive (L >= 0): L=8 d=0", CPU,
        plain(lambda: blazecore.moe_memory(8, 0, 8, 2, 1))),
    Row("moe_memory.activation", "moe_memory", "unknown activation", ValueError, "unknown activation 'tanh'", CPU,
        plain(lambda: blazecore.moe_memory(8, 8, 8, 2, 1, activation="tanh"))),
    Row("moe_memory.K_gt_E", "moe_memory", "K > E", ValueError, "top_k K = 3 exceeds the number of experts E = 2",
        CPU, plain(lambda: blazecore.moe_memory(8, 8, 8, 2, 3))),
    Row("chunk_bounds.L_negative", "chunk_bounds", "L = -5", ValueError, "L (tokens) must be >= 0, got -5", CPU,
        plain(lambda: moe.chunk_bounds(-5, 2))),
    Row("chunk_bounds.chunks_zero", "chunk_bounds", "chunks = 0", ValueError, "chunks must be >= 1, got 0", CPU,
        plain(lambda: moe.chunk_bounds(8, 0))),
    Row("plan_chunks.budget_fraction", "plan_chunks", "budget fraction 1.5", ValueError,
        "memory budget fraction must be in (0, 1], got 1.5", CPU,
        plain(lambda: blazecore.plan_chunks(8, 8, 8, 2, 1, budget=1.5))),
    Row("plan_chunks.budget_negative", "plan_chunks", "budget -1 bytes", ValueError,
        "memory budget must be >= 0 bytes, got -1", CPU,
        plain(lambda: blazecore.plan_chunks(8, 8, 8, 2, 1, budget=-1))),
    Row("plan_chunks.budget_type", "plan_chunks", "budget a string", TypeError,
        "memory budget: expected bytes (int) or a fraction (float in (0, 1]), got 'all'", CPU,
        plain(lambda: blazecore.plan_chunks(8, 8, 8, 2, 1, budget="all"))),
    # ---- helpers
    Row("activation_info.unknown", "activation_info", "an unknown name", ValueError,
        "unknown activation 'SwiGLU' (expected one of swiglu, geglu, gelu, silu, relu2, swiglu_oai, or a gated one "
        "with the suffix '_interleaved' for interleaved gate/up rows)", CPU,
        plain(lambda: moe.activation_info("SwiGLU"))),
    Row("moe_flops.unknown", "moe_flops", "an unknown activation", ValueError, "unknown activation 'tanh'", CPU,
        plain(lambda: moe.moe_flops(1, 8, 8, 1, "tanh"))),
    Row("set_allocator.not_callable", "set_allocator", "42", TypeError,
        "allocator: expected a callable (shape, dtype_name) -> array, or None; got int", CPU,
        plain(lambda: blazecore.set_allocator(42))),
    Row("MoELayer.hidden_size_negative", "blazecore_torch.MoELayer", "hidden_size = -16", ValueError,
        "hidden_size must be an int >= 1, got -16", CPU, plain(lambda: _torch_layer(-16, 32, 4, 2))),
    Row("MoELayer.num_experts_zero", "blazecore_torch.MoELayer", "num_experts = 0", ValueError,
        "num_experts must be an int >= 1, got 0", CPU, plain(lambda: _torch_layer(16, 32, 0, 2))),
    Row("moe_forward.x_requires_grad", "moe_forward", "x a torch CPU tensor that requires grad", TypeError,
        "x: a torch tensor that requires grad (DLPack cannot export it); pass x.detach()", CPU,
        plain(lambda: _torch_requires_grad_forward())),
    Row("asarray.not_an_array", "asarray", "an object without __dlpack__", TypeError,
        "w: expected a DLPack array (numpy, cupy, torch, jax ...), got object", CPU,
        plain(lambda: blazecore.asarray(object(), "w"))),
]


def _params():
    out = []
    for r in ROWS:
        for backend in r.where.split():
            marks = [pytest.mark.gpu] if backend == "gpu" else []
            out.append(pytest.param(r, backend, id=f"{r.id}-{backend}", marks=marks))
    return out


@pytest.mark.parametrize("row, backend", _params())
def test_rejected_and_nothing_written(row, backend):
    call, outs = row.build(backend)
    before = [_bits(o) for o in outs]
    with pytest.raises(row.exc, match=re.escape(row.fragment)):
        call()
    for i, (o, b) in enumerate(zip(outs, before, strict=True)):
        assert _bits(o) == b, f"out buffer {i} was written before the error"


def test_row_ids_are_unique():
    ids = [r.id for r in ROWS]
    assert len(ids) == len(set(ids))


# ---------------------------------------------------------------------------------------------
# The doc's table
# ---------------------------------------------------------------------------------------------

_HEADER = "| id | function | bad input | exception | message contains | runs on |"


def _cells(r: Row) -> tuple:
    return (f"`{r.id}`", f"`{r.function}`", r.what, f"`{r.exc.__name__}`", f"`{r.fragment}`",
            ", ".join(r.where.split()))


def render_table() -> str:
    lines = [_HEADER, "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in ROWS]
    return "\n".join(lines)


def _doc_rows() -> list[tuple]:
    rows, inside = [], False
    for line in DOC.read_text().splitlines():
        if line.strip() == _HEADER:
            inside = True
            continue
        if inside:
            if not line.startswith("|"):
                break
            if line.startswith("|---"):
                continue
            rows.append(tuple(c.strip() for c in line.strip()[1:-1].split(" | ")))
    return rows


def test_doc_table_matches():
    """docs/validation.md lists the same rows as ROWS: ids, functions, inputs, exceptions, messages, backends."""
    doc = _doc_rows()
    want = [_cells(r) for r in ROWS]
    doc_ids, want_ids = [c[0] for c in doc], [c[0] for c in want]
    assert set(doc_ids) == set(want_ids), (f"only in the doc: {sorted(set(doc_ids) - set(want_ids))}; "
                                           f"only in the tests: {sorted(set(want_ids) - set(doc_ids))}")
    assert doc == want, "the doc's rows differ from ROWS: regenerate with `python tests/test_validation.py`"


if __name__ == "__main__":
    print(render_table())
