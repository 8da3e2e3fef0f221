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


def _interleaved(repeats, ours, gmm):
    """Device records of ``repeats`` repetitions of blazecore's step (``ours``: [(name, ms)]) and grouped_mm's calls
    (``gmm``: [(gemm, [(name, ms)])]); repetition r scales every duration by r + 1."""
    recs = []
    for r in range(repeats):
        recs += [(n, ms * (r + 1)) for n, ms in ours]
        for _, calls in gmm:
            recs += [(n, ms * (r + 1)) for n, ms in calls]
    return _recs(recs)


def test_split_interleaved_separates_the_sides_and_sums_each_call():
    from bench.bench_gemm import split_interleaved

    ours = [("void blz::moe_gemm_sm90<a>", 1.0), ("blz::moe_combine", 0.5), ("void blz::moe_wgrad_sm90<c>", 2.0)]
    # grouped_mm's kernels share names across GEMMs (one CUTLASS kernel) and a call may launch more than one
    gmm = [("gemm1", [("cutlass::device_kernel<G>", 0.75)]),
           ("dw2", [("Memset (Device)", 0.125), ("cutlass::device_kernel<G>", 0.5)])]
    recs = _interleaved(3, ours, gmm)
    mine, theirs = split_interleaved(recs, [n for n, _ in ours], [(g, [n for n, _ in c]) for g, c in gmm], 3)
    assert [r[1:] for r in mine] == [(ms * k, n) for k in (1, 2, 3) for n, ms in ours]
    assert theirs == {"gemm1": [0.75, 1.5, 2.25], "dw2": [0.625, 1.25, 1.875]}
    # blazecore's records then go through the launcher attribution as in the blocks order
    assert attribute_kernels(["gemm1", "dw2"] * 3, mine, 3) == {"gemm1": 2.0, "dw2": 4.0}


def test_step_kernel_ms_sums_every_kernel_of_each_step():
    from bench.bench_gemm import split_interleaved, step_kernel_ms

    ours = [("void blz::moe_gemm_sm90<a>", 1.0), ("blz::moe_combine", 0.5), ("blz::moe_tile_offsets", 0.25)]
    gmm = [("gemm1", [("cutlass::device_kernel<G>", 0.75)])]
    mine, _ = split_interleaved(_interleaved(3, ours, gmm), [n for n, _ in ours],
                                [(g, [n for n, _ in c]) for g, c in gmm], 3)
    # repetition k's records are the step's kernels times k: 1.75 k ms a step, grouped_mm's left out
    assert step_kernel_ms(mine, 3, 3) == [1.75, 3.5, 5.25]
    with pytest.raises(RuntimeError, match="5 kernels recorded for 2 steps of 3"):
        step_kernel_ms(mine[:5], 3, 2)


def test_split_interleaved_refuses_records_that_do_not_match():
    from bench.bench_gemm import split_interleaved

    ours = [("void blz::moe_gemm_sm90<a>", 1.0)]
    gmm = [("gemm1", [("cutlass::device_kernel<G>", 0.75)])]
    names = ([n for n, _ in ours], [(g, [n for n, _ in c]) for g, c in gmm])
    recs = _interleaved(2, ours, gmm)
    with pytest.raises(RuntimeError, match="kernels recorded for 2 repetitions"):
        split_interleaved(recs[:-1], *names, 2)
    swapped = [recs[1], recs[0], *recs[2:]]  # one repetition's kernels out of order
    with pytest.raises(RuntimeError, match="repetition 0: kernel 0"):
        split_interleaved(swapped, *names, 2)
    extra = recs[:2] + _recs([("Memcpy HtoD", 0.1)]) + recs[2:3]  # a kernel neither side launches alone
    with pytest.raises(RuntimeError, match="repetition 1: kernel 0"):
        split_interleaved(extra, *names, 2)


def test_the_interleaved_order_needs_cupti():
    from bench.bench_gemm import parse_args

    args = parse_args(["--shapes", "fine", "--tokens", "1k"])
    assert args.order == "interleaved" and args.clock == "cupti"
    assert parse_args(["--order", "blocks", "--clock", "events"]).order == "blocks"
    with pytest.raises(SystemExit):
        parse_args(["--clock", "events"])


def _gemm_doc(order, beside, step_kernels=None):
    gemm = {"shape": "olmoe", "tokens": 32768, "kind": "gemm", "gemm": "gemm1", "blazecore_ms": 3.0,
            "blazecore_tflops": 600.0, "grouped_mm_ms": 2.5, "grouped_mm_tflops": 720.0, "ratio": 1.2}
    layer = {"shape": "olmoe", "tokens": 32768, "kind": "layer", "blazecore_moe_ffn_ms": 15.0,
             "blazecore_beside_six_ms": beside, "six_grouped_mm_ms": 14.0,
             "layer_over_six": (beside or 15.0) / 14.0, "grouped_mm_moe_ms": 30.0, "grouped_mm_moe_over_layer": 2.0,
             "step_kernels_over_six": None if step_kernels is None else step_kernels / 14.0}
    header = {"gpu": "GPU", "date": "2026-01-01T00:00:00", "git_commit": "0" * 40, "torch": "x", "clock": "cupti",
              "warm_seconds": 10.0, "rounds": 5, "order": order}
    return {"header": header, "rows": [gemm, layer]}


def test_report_names_the_order_and_which_layer_time_each_ratio_uses():
    from bench.report import gemm_table

    text = gemm_table(_gemm_doc("interleaved", 16.1))
    assert "blazecore's step, then grouped_mm's six" in text
    head = next(line for line in text.splitlines() if line.startswith("|") and "layer / six" in line)
    assert "CUDA-event time beside the six over the six's kernel time" in text  # the caption says which is which
    assert "beside the six" in head and "beside the MoE" in head and "step's kernels / six" in head
    # a file from before the step's kernel time: "-" in its column
    assert "| olmoe | 32k | 16.10 | 14.00 | 1.15 | - | 15.00 | 30.00 | 2.00 |" in text
    assert "| olmoe | 32k | 16.10 | 14.00 | 1.15 | 1.08 | 15.00 | 30.00 | 2.00 |" in gemm_table(
        _gemm_doc("interleaved", 16.1, 15.12))
    doc = _gemm_doc("interleaved", 16.1)
    doc["rows"].append({**doc["rows"][1], "shape": "mixtral", "tokens": 131072, "order": "blocks",
                        "blazecore_beside_six_ms": None})
    text = gemm_table(doc)
    assert "| mixtral | 128k | - | 14.00 |" in text
    last = text.splitlines()[-1]
    assert last == "Timed in the blocks order (out of GPU memory in the interleaved one): mixtral 128k."
    old = gemm_table(_gemm_doc("blocks", None))
    assert "each grouped_mm GEMM back to back" in old and "beside" not in old
    assert "| olmoe | 32k | 15.00 | 14.00 | 1.07 | 30.00 | 2.00 |" in old


class _OOM(RuntimeError):
    pass


def _fake_torch():
    import types

    return types.SimpleNamespace(cuda=types.SimpleNamespace(OutOfMemoryError=_OOM, empty_cache=lambda: None))


def test_measure_problem_falls_back_to_the_blocks_order_on_oom(monkeypatch):
    from bench import _common
    from bench.bench_gemm import measure_problem

    monkeypatch.setattr(_common, "_oom_types", lambda: (_OOM,))
    calls = []

    def fake(torch, ops, shape, L, *, order, **kw):
        calls.append(order)
        if order == "interleaved":
            raise _OOM("CUDA out of memory. Tried to allocate 15.00 GiB")
        return [{"shape": shape, "tokens": L, "order": order, **kw}]

    rows = measure_problem(_fake_torch(), None, "mixtral", 131072, order="interleaved", measure_fn=fake, rounds=5)
    assert calls == ["interleaved", "blocks"] and rows == [{"shape": "mixtral", "tokens": 131072, "order": "blocks",
                                                              "rounds": 5}]
    # other errors, and an OOM in the blocks order, are the problem's error
    def always_oom(torch, ops, shape, L, *, order, **kw):
        calls.append(order)
        raise _OOM("CUDA out of memory")

    calls.clear()
    with pytest.raises(_OOM):
        measure_problem(_fake_torch(), None, "olmoe", 1024, order="blocks", measure_fn=always_oom)
    assert calls == ["blocks"]
    calls.clear()
    with pytest.raises(_OOM):  # the fallback's own OOM is the problem's error
        measure_problem(_fake_torch(), None, "olmoe", 1024, order="interleaved", measure_fn=always_oom)
    assert calls == ["interleaved", "blocks"]

    def broken(torch, ops, shape, L, *, order, **kw):
        raise ValueError("not an OOM")

    with pytest.raises(ValueError):
        measure_problem(_fake_torch(), None, "olmoe", 1024, order="interleaved", measure_fn=broken)


def test_the_launcher_patches_route_every_launch_and_restore_the_launchers(monkeypatch):
    from bench.bench_gemm import GemmTimer, _LauncherLog, _role_key
    from blazecore import _moe_gpu

    ran = []
    for n in _moe_gpu.GEMM_LAUNCHERS:  # the launchers as the patches find them
        monkeypatch.setattr(_moe_gpu, n, lambda kern, which, *a, _n=n, **kw: ran.append((_n, which)) or which)
    origs = {n: getattr(_moe_gpu, n) for n in _moe_gpu.GEMM_LAUNCHERS}
    with _LauncherLog() as ll:
        assert all(getattr(_moe_gpu, n) is not o for n, o in origs.items())
        assert _moe_gpu._launch_m(None, "dw13s", 1, None) == "dw13s"
        _moe_gpu._launch_k(None, "dh", 1, None)
    assert ll.log == ["dw13s", "dh"] and ran == [("_launch_m", "dw13s"), ("_launch_k", "dh")]
    assert [_role_key(w) for w in ll.log] == ["dw13", "dhcur"]
    assert {n: getattr(_moe_gpu, n) for n in origs} == origs
    with GemmTimer() as timer:  # off: the launch goes straight to the original, nothing recorded
        _moe_gpu._launch_k(None, "dw2", 1, None)
    assert timer.events == [] and ran[-1] == ("_launch_k", "dw2")
    assert {n: getattr(_moe_gpu, n) for n in origs} == origs


def test_report_tables_the_host_times_as_probe_host_writes_them(tmp_path, monkeypatch):
    """probe_host's JSON (written by the results writer) is a table in the report: a row per shape and token count
    with its host, back-to-back and replay ms, and the CPU named in the caption; its file name decides the kind."""
    from bench import report
    from bench._common import write_json

    rows = [{"shape": "fine", "tokens": 8192, "host_ms": 1.934, "host_rounds_ms": [1.9, 1.934, 2.0],
             "eager_ms": 2.349, "graph_ms": 1.121}]
    header = {"gpu": "GPU X", "gpu_slug": "x", "date": "2026-01-01", "git_commit": "abc", "torch": "2",
              "cpu": "CPU Y", "steps": 20, "repeats": 3}
    path = write_json("host", header, rows, tmp_path)
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "ROOT", tmp_path.parent)
    text = report.render()
    assert path.name == "host_x.json" and f"`{tmp_path.name}/host_x.json`" in text
    assert "CPU Y" in text and "median of 3 timings of 20 steps" in text
    assert "| fine | 8k | 1.93 | 2.35 | 1.12 |" in text
