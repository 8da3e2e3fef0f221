"""scripts/ab_inprocess.py's option-set parsing and environment handling (CPU)."""

import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import pytest

_SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load(name):
    """scripts/<name>.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, _SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ab = _load("ab_inprocess")


def test_parse_set_forms():
    assert ab.parse_set("base:") == ("base", "", {})
    assert ab.parse_set("p:-DBLZ_PROBE_HALF_B=1 -DX=2") == ("p", "-DBLZ_PROBE_HALF_B=1 -DX=2", {})
    assert ab.parse_set("one:-:BLAZECORE_SM90_CLUSTER=1 A=b") == ("one", "", {"BLAZECORE_SM90_CLUSTER": "1", "A": "b"})


@pytest.mark.parametrize("spec", ["base", ":x", "p:-:NOTPAIR"])
def test_parse_set_refuses_bad_specs(spec):
    with pytest.raises(ValueError, match="option set"):
        ab.parse_set(spec)


def test_applied_sets_and_restores_the_environment(monkeypatch):
    monkeypatch.setenv("BLAZECORE_NVRTC_OPTIONS", "-DKEEP=1")
    monkeypatch.delenv("AB_TEST_VAR", raising=False)
    with ab._Applied("-DPROBE=1", {"AB_TEST_VAR": "7"}):
        assert os.environ["BLAZECORE_NVRTC_OPTIONS"] == "-DPROBE=1"
        assert os.environ["AB_TEST_VAR"] == "7"
    assert os.environ["BLAZECORE_NVRTC_OPTIONS"] == "-DKEEP=1"
    assert "AB_TEST_VAR" not in os.environ


def test_main_refuses_duplicate_labels_before_any_gpu_work(capsys):
    with pytest.raises(SystemExit):
        ab.main(["out.json", "--set", "a:", "--set", "a:-DX=1"])
    assert "labels must differ" in capsys.readouterr().err


def test_applied_sets_and_restores_module_attributes(monkeypatch):
    monkeypatch.delenv("AB_TEST_VAR", raising=False)
    label, opts, env = ab.parse_set("s:-:AB_TEST_VAR=1 tests_ab_attr_mod.VALUE=2048")
    mod = types.ModuleType("tests_ab_attr_mod")
    mod.VALUE = 1024
    monkeypatch.setitem(sys.modules, "tests_ab_attr_mod", mod)
    with ab._Applied(opts, env):
        assert mod.VALUE == 2048 and os.environ["AB_TEST_VAR"] == "1"
        assert "tests_ab_attr_mod.VALUE" not in os.environ
    assert mod.VALUE == 1024 and "AB_TEST_VAR" not in os.environ


def test_applied_refuses_an_unknown_attribute(monkeypatch):
    mod = types.ModuleType("tests_ab_attr_mod2")
    monkeypatch.setitem(sys.modules, "tests_ab_attr_mod2", mod)
    with pytest.raises(AttributeError, match="no attribute 'MISSING'"):
        with ab._Applied("", {"tests_ab_attr_mod2.MISSING": "1"}):
            pass


def test_attribute_fields_are_checked_before_any_gpu_work(capsys, monkeypatch):
    with pytest.raises(ValueError, match="takes an integer"):
        ab.parse_set("s:-:blazecore._moe_gpu.O_SLICE_COLS=wide")
    with pytest.raises(SystemExit):
        ab.main(["out.json", "--set", "a:", "--set", "b:-:blazecore._moe_gpu.NO_SUCH_CONSTANT=1"])
    assert "no attribute 'NO_SUCH_CONSTANT'" in capsys.readouterr().err


def test_applied_sets_and_restores_a_keyword_default(monkeypatch):
    monkeypatch.delenv("AB_TEST_VAR2", raising=False)
    before = os.environ.get("BLAZECORE_NVRTC_OPTIONS")

    def fn(x, *, block=16):
        return x * block

    mod = types.ModuleType("tests_ab_kw_mod")
    mod.fn = fn
    monkeypatch.setitem(sys.modules, "tests_ab_kw_mod", mod)
    label, opts, env = ab.parse_set("s:-:tests_ab_kw_mod.fn(block)=64")
    with ab._Applied(opts, env):
        assert mod.fn(2) == 128
    assert mod.fn(2) == 32
    for field, why in (("tests_ab_kw_mod.fn(nope)", "no keyword-only parameter 'nope'"),
                       ("tests_ab_kw_mod.gone(block)", "no attribute 'gone'")):
        with pytest.raises(AttributeError, match=why):  # the good field before it is restored too
            with ab._Applied("-DX=1", {"AB_TEST_VAR2": "1", "tests_ab_kw_mod.fn(block)": "64", field: "1"}):
                pass
        assert mod.fn(2) == 32 and "AB_TEST_VAR2" not in os.environ
        assert os.environ.get("BLAZECORE_NVRTC_OPTIONS") == before


def test_time_in_rounds_alternates_the_runs_under_their_contexts():
    """Each run's step twice under its context (build), the first run's during the warm-up, then every round takes
    the runs in order, each measured under its own context; figures collected per name and label, round by round."""
    import contextlib

    log, active = [], []

    def context(label):
        @contextlib.contextmanager
        def cm():
            active.append(label)
            try:
                yield
            finally:
                active.pop()
        return cm

    def step_of(label):
        def step():
            assert active == [label], "a step runs only under its own run's context"
            log.append(("step", label))
        return step

    calls_seen = []

    def measure(step, calls):
        calls_seen.append(calls)
        step()
        n = sum(1 for e in log if e == ("measure", active[0]))
        log.append(("measure", active[0]))
        return {"gemm": float(len(active[0]) + n), "layer": 10.0 + n}

    syncs = []
    runs = {"a": (step_of("a"), context("a")), "bb": (step_of("bb"), context("bb"))}
    out = ab.time_in_rounds(runs, rounds=3, calls=4, warm_seconds=0.0, measure=measure, sync=lambda: syncs.append(1))
    assert log[:4] == [("step", "a"), ("step", "a"), ("step", "bb"), ("step", "bb")]
    order = [lab for kind, lab in log if kind == "measure"]
    assert order == ["a", "bb"] * 3
    assert calls_seen == [4] * 6 and len(syncs) == 2
    assert out == {"gemm": {"a": [1.0, 2.0, 3.0], "bb": [2.0, 3.0, 4.0]},
                   "layer": {"a": [10.0, 11.0, 12.0], "bb": [10.0, 11.0, 12.0]}}
    assert active == []


def test_ab_table_ratios_and_control():
    # set b is 10% slower than a on every GEMM in round 2 (a clock drift) and 2% faster on dw13 besides
    t = _load("ab_table")
    res = {"ms": {"s": {"dw13": {"a": [1.0, 1.0, 1.0], "b": [0.98, 0.98 * 1.1, 0.98]},
                        "gemm1": {"a": [2.0, 2.0, 2.0], "b": [2.0, 2.2, 2.0]},
                        "layer": {"a": [10.0, 10.0, 10.0], "b": [10.0, 11.0, 10.0]}}}}
    plain = t.table(res, ["dw13", "layer"]).splitlines()
    assert plain[0] == "| shape | GEMM | a | b | b / a |"
    assert plain[2] == "| s | dw13 | 1.000, 1.000, 1.000 | 0.980, 1.078, 0.980 | 0.980 |"
    ctl = t.table(res, ["dw13", "layer"], control=["gemm1"]).splitlines()
    assert ctl[2].endswith("| 0.980 |") and ctl[3].endswith("| 1.000 |")  # every round 0.98 once the drift is out
    res["ms"]["s"]["dw13"]["b"][0] = 0.5
    assert t.table(res, ["dw13"], control=["gemm1"]).splitlines()[2].endswith("| 0.980 |")  # the median round


def test_wgrad_timeline_summary():
    # a consumer cycle of 1000 clocks with one stall of 3000 at k-tile 12; stages started 2000 before they are taken
    t = _load("probe_wgrad_timeline")
    c0 = [1000 * k + (2000 if k >= 12 else 0) for k in range(20)]
    p0 = [c - 2000 for c in c0]
    p1 = [p + 300 for p in p0]
    s = t.summarize(p0, p1, c0, skip=8)
    assert s["ktiles"] == 12
    assert s["consumer_cycle"]["p50"] == 1000 and s["consumer_cycle"]["p90"] == 1000
    assert max(c0[k] - c0[k - 1] for k in range(9, 20)) == 3000
    assert s["fill"] == {"p10": 2000, "p50": 2000, "p90": 2000, "mean": 2000.0}
    assert s["producer_issue"]["mean"] == 300.0
    assert s["long_cycles"] == 1 and abs(s["long_share"] - 2000 / 14000) < 1e-12  # 12 cycles, one of 3000


def test_wgrad_timeline_summary_stops_at_unrecorded_ktiles(tmp_path):
    # a CTA with 14 k-tiles under a 20-entry probe: its series end in zeros, which are not k-tiles
    t = _load("probe_wgrad_timeline")
    c0 = [1000 * k + 5000 for k in range(14)] + [0] * 6
    p0 = [c - 2000 if c else 0 for c in c0]
    p1 = [p + 300 if p else 0 for p in p0]
    s = t.summarize(p0, p1, c0, skip=8)
    assert s["ktiles"] == 6 and s["consumer_cycle"]["mean"] == 1000.0 and s["fill"]["p90"] == 2000
    src, out = tmp_path / "in.json", tmp_path / "out.json"
    entry = {"summary": {"ktiles": 12}, "clocks": [p0, p1, c0]}
    src.write_text(json.dumps({"header": {"kernel": "wgrad"}, "timelines": {"qwen3": {"base": {"k": entry}}}}))
    assert t.main([str(out), "--resummarize", str(src)]) == 0
    got = json.loads(out.read_text())
    assert got["timelines"]["qwen3"]["base"]["k"]["summary"]["ktiles"] == 6
    assert got["header"]["resummarized_from"] == "in.json"


def test_wgrad_timeline_wants_a_set(capsys):
    t = _load("probe_wgrad_timeline")
    with pytest.raises(SystemExit):
        t.main(["out.json"])
    assert "at least one option set" in capsys.readouterr().err


def test_dh_timeline_summary():
    # 3 tiles of 20 k-tiles at 1000 clocks; the consumers wait 500 for the epilogue warps at each tile's end, whose
    # rows take 4000
    t = _load("probe_wgrad_timeline")
    c0 = [1000 * k for k in range(60)]
    p0, p1 = [c - 2000 for c in c0], [c - 1500 for c in c0]
    main_end = [20000 * (i + 1) + 500 * i for i in range(3)] + [0] * 57
    dh_free = [m + 500 if m else 0 for m in main_end]
    epi_start = [f + 100 if f else 0 for f in dh_free]
    epi_end = [s + 4000 if s else 0 for s in epi_start]
    s = t.summarize_dh([p0, p1, c0, main_end, dh_free, epi_start, epi_end])
    assert s["tiles"] == 2 and s["consumer_wait_dh"]["p50"] == 500 and s["epilogue_rows"]["mean"] == 4000.0
    assert s["tile_span"]["p50"] == 20500 and s["fill"]["p50"] == 2000 and s["producer_issue"]["p50"] == 500


def test_ab_table_refuses_unknown_names():
    t = _load("ab_table")
    res = {"ms": {"s": {"dw13": {"a": [1.0], "b": [1.0]}}}}
    with pytest.raises(ValueError, match="no set or GEMM c"):
        t.table(res, sets=["a", "c"])
    with pytest.raises(ValueError, match="no set or GEMM gemm9"):
        t.table(res, control=["gemm9"])
