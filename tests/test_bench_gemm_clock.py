"""bench_gemm's kernel-time attribution (CPU): device records matched with the launcher calls in order."""

import pytest

from bench.bench_gemm import attribute_kernels


def _recs(names_ms):
    return [(i * 1000, ms, name) for i, (name, ms) in enumerate(names_ms)]


def test_attribute_kernels_sums_roles_per_call_and_takes_the_median():
    log = ["gemm1", "gemm2", "gemm2", "dw13s"] * 3
    recs = []
    for scale in (1.0, 3.0, 2.0):
        recs += [("void blz::moe_gemm_sm90<a>", 1.0 * scale), ("blz::moe_combine", 9.0),
                 ("void blz::moe_gemm_sm90<b>", 0.5 * scale), ("void blz::moe_gemm_sm90<b>", 0.25 * scale),
                 ("blz::moe_gather_rows", 0.125 * scale), ("void blz::moe_wgrad_sm90<c>", 2.0 * scale),
                 ("Memset (Device)", 7.0)]
    out = attribute_kernels(log, _recs(recs), 3, key=lambda w: {"dw13s": "dw13"}.get(w, w))
    # medians over the three calls (scales 1, 3, 2 -> 2); the combine and the memset belong to no GEMM, the staging
    # copy to the GEMM launched after it
    assert out == {"gemm1": 2.0, "gemm2": 1.5, "dw13": 4.25}


def test_attribute_kernels_refuses_a_mismatch():
    recs = _recs([("void blz::moe_gemm_sm90<a>", 1.0)] * 3)
    with pytest.raises(RuntimeError, match="launcher calls"):
        attribute_kernels(["gemm1", "gemm2"], recs, 1)
    with pytest.raises(RuntimeError, match="launcher calls"):
        attribute_kernels(["gemm1"] * 3, recs, 2)


def test_gpu_state_parses_nvidia_smi_and_gives_none_without_it(monkeypatch):
    import subprocess

    from bench import _common

    class Done:
        def __init__(self, rc, out):
            self.returncode, self.stdout = rc, out

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: Done(0, "1530, 176.78, 46, 0x0000000000000004\n"))
    assert _common.gpu_state() == {"sm_clock_mhz": 1530.0, "power_w": 176.78, "temperature_c": 46.0,
                                   "throttle_reasons": "0x0000000000000004"}
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: Done(0, "[N/A], 176.78, 46, 0x4\n"))
    assert _common.gpu_state() is None
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: Done(9, ""))
    assert _common.gpu_state() is None

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", missing)
    assert _common.gpu_state() is None


def test_round_ratios_pair_the_rounds_and_the_table_shows_their_range():
    from bench.bench_gemm import round_ratios, tables

    assert round_ratios([2.0, 3.0, 3.3], [2.0, 2.5, 3.0]) == pytest.approx([1.0, 1.2, 1.1])
    assert round_ratios(None, [1.0]) is None
    assert round_ratios([1.0, 2.0], [1.0]) is None
    row = {"shape": "olmoe", "tokens": 32768, "kind": "gemm", "gemm": "gemm1", "blazecore_ms": 3.0,
           "blazecore_tflops": 600.0, "grouped_mm_ms": 2.5, "grouped_mm_tflops": 700.0, "ratio": 1.2,
           "round_ratios": [1.25, 0.96, 1.2]}
    text = tables([row, {**row, "gemm": "gemm2", "round_ratios": None}])
    lines = text.splitlines()
    assert lines[0].split()[-1] == "rounds"
    assert lines[2].split()[-1] == "0.96-1.25" and lines[3].split()[-1] == "-"
