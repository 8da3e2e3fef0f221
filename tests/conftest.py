"""Shared test fixtures: GPU detection, output poisoning, the comparison helper."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

import blazecore._array as _array


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def large_selected(config) -> bool:
    """Tests marked ``large`` (tens of GB, 2**31-element tensors) run only when asked for: BLAZECORE_LARGE=1,
    or a ``-m`` expression that names them."""
    return os.environ.get("BLAZECORE_LARGE") == "1" or "large" in (config.getoption("markexpr", "") or "")


def pytest_collection_modifyitems(config, items):
    if not large_selected(config):
        skip_large = pytest.mark.skip(reason="large: set BLAZECORE_LARGE=1 or select with -m large")
        for item in items:
            if "large" in item.keywords:
                item.add_marker(skip_large)
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def poison_outputs():
    """Every output the library allocates starts as NaN / -1, so an unwritten element fails."""
    prev = _array.POISON
    _array.POISON = True
    yield
    _array.POISON = prev


def backends():
    """'cpu' always; 'gpu' as a param that skips without a GPU."""
    return ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


def to_backend(a, backend):
    a = np.ascontiguousarray(a)
    if backend == "cpu":
        return a
    import cupy

    if a.dtype == _array.BF16:
        return cupy.asarray(a.view(np.uint16))
    return cupy.asarray(a)


def to_numpy(a):
    if isinstance(a, np.ndarray):
        return a
    v = _array.asarray(a)
    if isinstance(v, np.ndarray):
        return v
    h = v.get()
    return h.view(_array.BF16) if _array.logical_dtype(v) == _array.BF16 else h


def assert_close(actual, expected, rtol_norm, name="output"):
    """Relative norm error ||a - e|| / ||e|| under ``rtol_norm``; reports max-abs error and first bad index."""
    a = np.asarray(to_numpy(actual), dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != expected {e.shape}"
    if a.size == 0:
        return
    nonfinite = ~np.isfinite(a) & np.isfinite(e)
    if nonfinite.any():
        idx = tuple(int(i) for i in np.argwhere(nonfinite)[0])
        raise AssertionError(f"{name}: non-finite value {a[idx]} at {idx} (expected {e[idx]})")
    diff = np.abs(a - e)
    denom = np.linalg.norm(e)
    rel = np.linalg.norm(a - e) / (denom if denom > 0 else 1.0)
    if not rel <= rtol_norm:
        idx = tuple(int(i) for i in np.unravel_index(np.argmax(diff), diff.shape))
        raise AssertionError(
            f"{name}: relative norm error {rel:.3e} > {rtol_norm:.1e}; max abs error {diff.max():.3e} at {idx} "
            f"(got {a[idx]}, expected {e[idx]})"
        )


ROUTINGS = ("uniform", "zipf", "all_to_one", "empty_experts", "k_eq_e")


def make_routing(rng, L: int, E: int, K: int, kind: str, dtype=np.int32) -> np.ndarray:
    """(L, K) expert ids, K distinct experts per row in random column order, for a routing ``kind``:

    uniform: every expert equally likely. zipf: expert weights (rank + 1)**-1.5 over a random ranking of the
    experts (a few hot ones, a long cold tail). all_to_one: one expert (random) in every row, the other K - 1
    uniform (K = 1: every token on that expert). empty_experts: only max(K, E // 4) experts (random) are used.
    k_eq_e: every row a permutation of all experts (needs K == E).
    """
    if kind == "k_eq_e" and K != E:
        raise ValueError(f"k_eq_e needs K == E, got K={K}, E={E}")
    if L == 0:
        return np.zeros((0, K), dtype=dtype)
    with np.errstate(divide="ignore"):
        logw = np.zeros(E)
        if kind == "zipf":
            logw = -1.5 * np.log1p(rng.permutation(E).astype(np.float64))
        elif kind == "empty_experts":
            logw = np.full(E, -np.inf)
            logw[rng.permutation(E)[: max(K, E // 4)]] = 0.0
        elif kind not in ROUTINGS:
            raise ValueError(kind)
    keys = logw[None, :] + rng.gumbel(size=(L, E))  # Gumbel top-k: K distinct draws without replacement
    if kind == "all_to_one":
        keys[:, rng.integers(E)] = np.inf
    ids = np.argpartition(-keys, K - 1, axis=1)[:, :K]
    return np.ascontiguousarray(rng.permuted(ids, axis=1).astype(dtype))
