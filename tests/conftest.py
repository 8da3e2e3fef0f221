"""Shared test fixtures: GPU detection, output poisoning, backends. The helpers shared with the benchmarks
(routing kinds, the argsort dispatch oracle, the comparison helper) live in ``blazecore.testing``."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

import blazecore._array as _array
from blazecore.testing import ROUTINGS, argsort_dispatch, assert_close, make_routing, to_numpy  # noqa: F401


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
