"""blazecore.sum_rows (the row sums of the expert-parallel exchanges) and its torch op: out[i] = sum_j
rows[index[i, j]] over the entries >= 0, in j order, float32 sums rounded once. The reference here is a plain loop
over the entries; on the GPU the result must equal it bit for bit (float32 adds in the same order), run after run."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import backends, to_backend, to_numpy

import blazecore
from blazecore._array import BF16


def _loop(rows: np.ndarray, index: np.ndarray) -> np.ndarray:
    acc_t = np.float64 if rows.dtype == np.float64 else np.float32
    out = np.zeros((index.shape[0], rows.shape[1]), dtype=acc_t)
    for i in range(index.shape[0]):
        for j in range(index.shape[1]):
            if index[i, j] >= 0:
                out[i] = out[i] + rows[index[i, j]].astype(acc_t)
    return out.astype(rows.dtype)


def _case(n=37, w=24, m=11, J=5, dtype=np.float32, seed=0):
    g = np.random.default_rng(seed)
    rows = g.standard_normal((n, w)).astype(dtype)
    index = g.integers(0, n, (m, J)).astype(np.int32)
    index[g.random((m, J)) < 0.35] = -1  # padding anywhere in a row
    index[2] = -1  # a row with nothing: 0
    index[3, :] = 7  # one row read J times
    return rows, index


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16, np.float64])
def test_sum_rows_equals_the_loop(backend, dtype):
    if backend == "gpu" and dtype == np.float64:
        pytest.skip("float64 is the CPU reference's precision only")
    rows, index = _case(dtype=dtype)
    got = to_numpy(blazecore.sum_rows(to_backend(rows, backend), to_backend(index, backend)))
    want = _loop(rows, index)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint16) if dtype == BF16 else got,
                                  want.view(np.uint16) if dtype == BF16 else want)
    assert not np.any(to_numpy(got)[2].astype(np.float32))


@pytest.mark.parametrize("backend", backends())
def test_sum_rows_out_and_empty(backend):
    rows, index = _case()
    out = to_backend(np.full((index.shape[0], rows.shape[1]), np.nan, np.float32), backend)
    res = blazecore.sum_rows(to_backend(rows, backend), to_backend(index, backend), out=out)
    assert res is out
    np.testing.assert_array_equal(to_numpy(out), _loop(rows, index))
    empty = blazecore.sum_rows(to_backend(rows, backend), to_backend(np.zeros((0, 3), np.int32), backend))
    assert tuple(empty.shape) == (0, rows.shape[1])


@pytest.mark.parametrize("backend", backends())
def test_sum_rows_refuses_bad_input_before_writing(backend):
    rows, index = _case()
    R, I = to_backend(rows, backend), to_backend(index, backend)  # noqa: E741
    out = to_backend(np.full((index.shape[0], rows.shape[1]), 5.0, np.float32), backend)
    bad = [
        (TypeError, "int32", lambda: blazecore.sum_rows(R, to_backend(index.astype(np.int64), backend), out=out)),
        (ValueError, "out of range", lambda: blazecore.sum_rows(R, to_backend(index + rows.shape[0], backend),
                                                                 out=out)),
        (ValueError, "2-D", lambda: blazecore.sum_rows(R, to_backend(index[0], backend), out=out)),
        (ValueError, "2-D", lambda: blazecore.sum_rows(to_backend(rows[0], backend), I, out=out)),
        (ValueError, "contiguous", lambda: blazecore.sum_rows(to_backend(rows, backend)[:, ::2], I)),
        (ValueError, "shape", lambda: blazecore.sum_rows(R, I, out=to_backend(np.zeros((3, 24), np.float32),
                                                                                backend))),
        (TypeError, "dtype", lambda: blazecore.sum_rows(to_backend(rows.astype(np.int32), backend), I, out=out)),
    ]
    if backend == "gpu":
        bad.append((ValueError, "16 bytes", lambda: blazecore.sum_rows(to_backend(rows[:, :3], backend), I)))
    for exc, text, call in bad:
        with pytest.raises(exc, match=text):
            call()
    np.testing.assert_array_equal(to_numpy(out), 5.0)  # nothing written


@pytest.mark.gpu
def test_sum_rows_gpu_unvalidated_past_the_rows():
    import cupy

    rows, index = _case()
    bad = index.copy()
    bad[0, 0] = rows.shape[0] + 1000  # unvalidated: skipped, not read
    bad[1, 1] = rows.shape[0]  # the first row past the end
    bad[2, 0] = 2**31 - 1
    got = to_numpy(blazecore.sum_rows(cupy.asarray(rows), cupy.asarray(bad), validate=False))
    fixed = bad.copy()
    fixed[0, 0] = fixed[1, 1] = fixed[2, 0] = -1
    np.testing.assert_array_equal(got, _loop(rows, fixed))


@pytest.mark.gpu
def test_sum_rows_gpu_large_and_repeatable():
    """Many rows of a wide row type (the exchange's shapes: 2048 columns, up to 8 entries a row): equal to the loop's
    float32 sums, and the same bits on a second run."""
    import cupy

    g = np.random.default_rng(1)
    n, w, m, J = 4096, 2048, 1500, 8
    rows = g.standard_normal((n, w)).astype(np.float32)
    index = g.integers(-1, n, (m, J)).astype(np.int32)
    want = _loop(rows, index)
    for dtype in (np.float32, BF16):
        r = to_backend(rows.astype(dtype), "gpu")
        ix = cupy.asarray(index)
        a = to_numpy(blazecore.sum_rows(r, ix, validate=False))
        b = to_numpy(blazecore.sum_rows(r, ix))
        np.testing.assert_array_equal(a.view(np.uint16) if dtype == BF16 else a,
                                      b.view(np.uint16) if dtype == BF16 else b)
        ref = _loop(rows.astype(dtype), index)
        np.testing.assert_array_equal(a.astype(np.float32), ref.astype(np.float32))
        if dtype == np.float32:
            np.testing.assert_array_equal(a, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torch_sum_rows(device):
    torch = pytest.importorskip("torch")
    from blazecore_torch import ops

    rows, index = _case(w=32)
    for dtype in (torch.float32, torch.bfloat16):
        r = torch.from_numpy(rows).to(device, dtype)
        got = ops.sum_rows(r, torch.from_numpy(index).to(device))
        want = _loop(r.float().cpu().numpy(), index)
        if dtype == torch.bfloat16:  # the loop in float32 on the bf16 values, rounded once
            want = torch.from_numpy(want).to(torch.bfloat16)
            assert torch.equal(got.cpu(), want)
        else:
            assert torch.equal(got.cpu(), torch.from_numpy(want))
    with pytest.raises(TypeError, match="int32"):
        ops.sum_rows(r, torch.from_numpy(index).long().to(device))
