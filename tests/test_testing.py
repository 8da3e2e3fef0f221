"""blazecore.testing (the helpers the tests and benchmarks share) and the router module's old name."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import numpy as np
import pytest

import blazecore
from blazecore import testing


@pytest.mark.parametrize("kind", testing.ROUTINGS)
def test_routing_kinds(kind):
    rng = np.random.default_rng(0)
    L, E = 400, 16
    K = E if kind == "k_eq_e" else 3
    ids = testing.make_routing(rng, L, E, K, kind)
    assert ids.shape == (L, K) and ids.dtype == np.int32 and ids.flags.c_contiguous
    srt = np.sort(ids, axis=1)
    assert ((srt >= 0) & (srt < E)).all() and not (srt[:, 1:] == srt[:, :-1]).any()
    counts = np.bincount(ids.reshape(-1), minlength=E)
    if kind == "all_to_one":
        assert counts.max() == L
    elif kind == "empty_experts":
        assert (counts == 0).sum() == E - max(K, E // 4)
    elif kind == "same":
        assert (counts > 0).sum() == K
    elif kind == "skewed":
        assert counts[0] == counts.max() and counts[0] > 3 * counts[-1]
    elif kind == "late":
        assert ids[: L // 2].max() < K and ids[L // 2 :].max() >= K
    elif kind == "k_eq_e":
        assert (counts == L).all()


def test_routing_edges_and_errors():
    rng = np.random.default_rng(1)
    assert testing.make_routing(rng, 0, 4, 2).shape == (0, 2)
    assert testing.make_routing(rng, 5, 4, 2, dtype=np.int64).dtype == np.int64
    with pytest.raises(ValueError, match="unknown routing kind"):
        testing.make_routing(rng, 5, 4, 2, "zipfian")
    with pytest.raises(ValueError, match="K == E"):
        testing.make_routing(rng, 5, 4, 2, "k_eq_e")
    with pytest.raises(ValueError, match="K = 5"):
        testing.make_routing(rng, 5, 4, 5)


def test_argsort_dispatch_is_build_dispatch():
    ids = testing.make_routing(np.random.default_rng(2), 37, 6, 3, "zipf")
    want = testing.argsort_dispatch(ids, 6)
    d = blazecore.build_dispatch(ids, 6)
    for name, got, w in zip(("expert_offsets", "slot_token", "slot_k", "pair_slot"),
                            (d.expert_offsets, d.slot_token, d.slot_k, d.pair_slot), want, strict=True):
        np.testing.assert_array_equal(got, w, err_msg=name)


def test_assert_close_reports_where():
    e = np.arange(6, dtype=np.float64).reshape(2, 3)
    testing.assert_close(e + 1e-9, e, 1e-6, "ok")
    bad = e.copy()
    bad[1, 2] += 1.0
    with pytest.raises(AssertionError, match=r"y: relative norm error .* max abs error 1.000e\+00 at \(1, 2\)"):
        testing.assert_close(bad, e, 1e-3, "y")
    nan = e.copy()
    nan[0, 1] = np.nan
    with pytest.raises(AssertionError, match=r"non-finite value nan at \(0, 1\)"):
        testing.assert_close(nan, e, 1.0, "y")
    assert testing.rel_norm_error(2 * e, e) == pytest.approx(1.0)


def test_route_topk_is_the_function_and_the_old_module_warns(monkeypatch):
    assert callable(blazecore.route_topk) and blazecore.route_topk is blazecore.router.route_topk
    for old in ("blazecore.route_topk", "blazecore.reference.route_topk"):
        monkeypatch.delitem(sys.modules, old, raising=False)  # an earlier import already warned
    with pytest.warns(DeprecationWarning, match="blazecore.route_topk is deprecated.*import from blazecore.router"):
        from blazecore.route_topk import load_balancing_loss, route_topk_backward
    assert route_topk_backward is blazecore.router.route_topk_backward
    assert load_balancing_loss is blazecore.router.load_balancing_loss
    assert sys.modules["blazecore.route_topk"] is blazecore.router
    assert blazecore.router.__spec__.name == "blazecore.router"
    assert blazecore.route_topk is blazecore.router.route_topk  # still the function after the old import
    with pytest.warns(DeprecationWarning, match="import from blazecore.reference.router"):
        from blazecore.reference.route_topk import route_topk_forward
    assert route_topk_forward is blazecore.reference.router.route_topk_forward
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.import_module("blazecore.router")  # the new names warn about nothing
        importlib.import_module("blazecore.reference.router")
    # nothing about the old names sits in sys.modules before they are imported (module scans see no alias)
    r = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c",
                        "import sys, pickle, blazecore; assert 'blazecore.route_topk' not in sys.modules; "
                        "pickle.dumps(blazecore.route_topk)"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
