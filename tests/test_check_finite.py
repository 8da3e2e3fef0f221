"""``check_finite=True``: NaN / inf in the inputs are reported (FloatingPointError with the array's name and the
count) instead of propagating silently; off by default (a device reduction and a host read on the GPU)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import backends, make_routing, to_backend, to_numpy

from blazecore import BF16, moe
from blazecore import router as rt
from blazecore._validate import check_finite, count_nonfinite

DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": BF16}

# bf16 bit patterns: +inf, -inf, quiet NaN, negative NaN with payload, signalling-style NaN; then finite ones:
# the largest finite, the smallest subnormal, -0, 1.0
BF16_NONFINITE = [0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81]
BF16_FINITE = [0x7F7F, 0x0001, 0x8000, 0x3F80]


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("backend", backends())
def test_count_nonfinite(backend, dname):
    dt = DTYPES[dname]
    a = np.linspace(-3, 3, 1000).astype(dt)
    a.reshape(-1)[[0, 17, 999]] = [np.nan, np.inf, -np.inf]
    big = np.finfo(np.float16).max if dt == np.float16 else 3e38
    a.reshape(-1)[5] = big  # finite at the top of the range
    dev = to_backend(a, backend)
    assert count_nonfinite(dev) == 3
    assert count_nonfinite(to_backend(np.ones((0, 4), dt), backend)) == 0
    view = dev.reshape(10, 100)[:, ::3]  # a strided view holding element 0 but not 17 or 999
    assert count_nonfinite(view) == int((~np.isfinite(np.asarray(a, np.float64).reshape(10, 100)[:, ::3])).sum())
    with pytest.raises(FloatingPointError, match=r"^w: 3 non-finite values \(NaN or inf\) of 1000$"):
        check_finite(dev, "w")
    check_finite(to_backend(np.ones(7, dt), backend), "ok")


@pytest.mark.parametrize("backend", backends())
def test_count_nonfinite_bf16_bit_patterns(backend):
    bits = np.array(BF16_NONFINITE + BF16_FINITE * 3, dtype=np.uint16)
    a = bits.view(BF16)
    assert count_nonfinite(to_backend(a, backend)) == len(BF16_NONFINITE)


def _layer(rng, dt, L=37, d=16, h=8, E=5, K=2):
    R = 2 * h
    g = rng.random((L, K)) + 0.1
    return {
        "x": rng.standard_normal((L, d)).astype(dt),
        "w13": (rng.standard_normal((E, R, d)) / math.sqrt(d)).astype(dt),
        "w2": (rng.standard_normal((E, d, h)) / math.sqrt(h)).astype(dt),
        "gates": (g / g.sum(axis=1, keepdims=True)).astype(np.float32),
        "ids": make_routing(rng, L, E, K, "uniform"),
        "b13": (0.1 * rng.standard_normal((E, R))).astype(dt),
        "b2": (0.1 * rng.standard_normal((E, d))).astype(dt),
        "dy": rng.standard_normal((L, d)).astype(dt),
    }


def _bits(a) -> bytes:
    return b"" if a is None else np.ascontiguousarray(to_numpy(a)).tobytes()


def _fwd(dev, **kw):
    return moe.moe_forward(dev["x"], dev["w13"], dev["w2"], dev["gates"], dev["ids"], b13=dev["b13"], b2=dev["b2"],
                           **kw)


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("backend", backends())
def test_finite_inputs_pass_and_change_nothing(backend, dname):
    """On finite inputs the checks raise nothing and the results are the same bits as without them."""
    inp = _layer(np.random.default_rng(1), DTYPES[dname])
    dev = {k: to_backend(v, backend) for k, v in inp.items()}
    y1, s1 = _fwd(dev)
    g1 = moe.moe_backward(dev["dy"], s1)
    y2, s2 = _fwd(dev, check_finite=True)
    g2 = moe.moe_backward(dev["dy"], s2, check_finite=True)
    assert _bits(y1) == _bits(y2)
    for key in ("dx", "dw13", "dw2", "dgates", "db13", "db2"):
        assert _bits(getattr(g1, key)) == _bits(getattr(g2, key)), key
    x = to_backend(np.random.default_rng(2).standard_normal((33, 9)).astype(np.float32).astype(DTYPES[dname]),
                   backend)
    a, b = rt.route_topk(x, 3), rt.route_topk(x, 3, check_finite=True)
    assert _bits(a[0]) == _bits(b[0]) and _bits(a[1]) == _bits(b[1])


@pytest.mark.parametrize("where", ["x", "w13", "w2", "gates", "b13", "b2"])
@pytest.mark.parametrize("backend", backends())
def test_forward_names_the_array(backend, where):
    inp = _layer(np.random.default_rng(3), BF16)
    inp[where] = inp[where].copy()
    inp[where].reshape(-1)[-1] = np.nan
    dev = {k: to_backend(v, backend) for k, v in inp.items()}
    with pytest.raises(FloatingPointError, match=rf"^{where}: 1 non-finite value \(NaN or inf\) of {inp[where].size}$"):
        _fwd(dev, check_finite=True)
    y, _ = _fwd(dev)  # off by default: no check, the NaN propagates (or not) as the arithmetic says
    assert to_numpy(y).shape == inp["x"].shape


@pytest.mark.parametrize("backend", backends())
def test_backward_checks_dy(backend):
    inp = _layer(np.random.default_rng(4), np.float16)
    dev = {k: to_backend(v, backend) for k, v in inp.items()}
    _, saved = _fwd(dev)
    dy = inp["dy"].copy()
    dy[3, :4] = [np.inf, -np.inf, np.nan, 65504]  # 65504: the largest finite float16
    with pytest.raises(FloatingPointError, match=r"^dy: 3 non-finite values"):
        moe.moe_backward(to_backend(dy, backend), saved, check_finite=True)
    assert not saved.consumed  # the check ran before the backward could use the record
    moe.moe_backward(dev["dy"], saved, check_finite=True)


@pytest.mark.gpu
def test_gpu_check_runs_on_the_given_stream():
    """The reduction runs on the op's stream: a NaN written on that stream just before is seen."""
    import cupy

    x = to_backend(np.zeros((64, 16), np.float32), "gpu")
    cupy.cuda.Device().synchronize()
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        x[5, 5] = cupy.nan  # queued on s
    with pytest.raises(FloatingPointError, match="logits: 1 non-finite value"):
        rt.route_topk(x, 2, stream=s, check_finite=True)
