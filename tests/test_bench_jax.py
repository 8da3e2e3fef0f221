"""bench/bench_jax.py without a GPU: the per-row memory worker (a subprocess) and its plumbing, the CPU smoke run's
JSON, the verdicts of both gates, the counting allocator on a stand-in pool, and bench/report.py's table of it."""

from __future__ import annotations

import gc
import importlib
import json
import pathlib
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("jax")

try:  # the installed package (pip install -e .), else the checkout's bench/ (PYTHONPATH at the repository root)
    bench_jax = importlib.import_module("blazecore_app.bench.bench_jax")
except ImportError:
    bench_jax = importlib.import_module("bench.bench_jax")
report = importlib.import_module(bench_jax.__name__.rpartition(".")[0] + ".report")

TINY = ["--device", "cpu", "--shape", "tiny=64,32,8,2"]
NEW_FIELDS = ("core_peak_bytes", "core_peak_beyond_grads_bytes", "jax_peak_bytes", "jax_peak_beyond_grads_bytes",
              "peak_ratio", "peak_ok")


def _grad_bytes(L, d, h, E, K):
    return 2 * L * d + 2 * E * 2 * h * d + 2 * E * d * h + 4 * L * K  # dx, dw13, dw2 (bf16), dgates (float32)


def test_memory_worker_cpu_row():
    """The worker runs in its own process, runs the core and the jitted JAX call, and hands back one row's
    fields: no figures on the CPU, the gradients' bytes of both sides."""
    args = bench_jax.parse_args(TINY + ["--tokens", "96"])
    m = bench_jax.run_memory_worker("tiny", (64, 32, 8, 2), 96, "ab", args)
    assert m["memory_status"] == "cpu", m
    assert m["core_peak_bytes"] is None and m["jax_peak_bytes"] is None
    assert m["core_grad_bytes"] == m["jax_grad_bytes"] == _grad_bytes(96, 64, 32, 8, 2)
    assert m["xla_python_client_allocator"] == bench_jax.WORKER_XLA_ALLOCATOR
    row = bench_jax.memory_figures(m, args.max_peak_ratio)
    for key in NEW_FIELDS:
        assert key in row and row[key] is None, key


def test_memory_worker_failure_is_a_row(monkeypatch):
    """A worker that dies without its JSON line gives a row that says so (and fails the peak gate on a GPU)."""
    args = bench_jax.parse_args(TINY + ["--tokens", "96"])
    monkeypatch.setattr(bench_jax, "_worker_command",
                        lambda *a: [sys.executable, "-c", "import sys; print('noise'); sys.exit(3)"])
    m = bench_jax.run_memory_worker("tiny", (64, 32, 8, 2), 96, "ab", args)
    assert m["memory_status"] == "error" and "exited 3" in m["memory_message"]
    row = {"shape": "tiny", "tokens": 96, "checkpoint": "ab", "status": "ok", "timed": False, "gated": False,
           "peak_gated": True, "max_peak_ratio": 1.05, **bench_jax.memory_figures(m, 1.05)}
    assert bench_jax._verdict(row).startswith("FAIL (memory error")


def test_memory_worker_arguments():
    args = bench_jax.parse_args(TINY + ["--tokens", "96", "--checkpoint", "none", "--seed", "7", "--core-retain"])
    cmd = bench_jax._worker_command("tiny", (64, 32, 8, 2), 96, "none", args)
    assert cmd[:3] == [sys.executable, "-m", bench_jax.__name__]
    wargs = bench_jax.parse_args(cmd[3:])
    assert wargs.memory_worker and wargs.core_retain and wargs.seed == 7 and wargs.device == "cpu"
    assert (wargs.shapes, wargs.tokens, wargs.policies) == (["tiny"], [96], ["none"])
    assert wargs.shape_table["tiny"] == (64, 32, 8, 2)
    with pytest.raises(SystemExit):  # a worker measures one row
        bench_jax.parse_args(TINY + ["--tokens", "96,128", "--memory-worker"])
    with pytest.raises(SystemExit):
        bench_jax.parse_args(TINY + ["--memory-only", "--no-memory"])


def test_cpu_smoke_run_json(tmp_path, capsys):
    code = bench_jax.main(TINY + ["--tokens", "96", "--checkpoint", "both", "--repeats", "2", "--warmup", "0",
                                  "--results-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "peak ratio" in out and "no figures on the CPU" in out
    doc = json.loads((tmp_path / "jax_cpu.json").read_text())
    assert [r["checkpoint"] for r in doc["rows"]] == ["ab", "none"]
    for r in doc["rows"]:
        assert r["status"] == "ok" and r["check_ok"] and r["memory_status"] == "cpu"
        assert not r["gated"] and not r["peak_gated"]  # nothing is gated on the CPU
        assert r["max_peak_ratio"] == 1.05
        for key in NEW_FIELDS:
            assert key in r and r[key] is None, key
    assert doc["summary"]["verdict"] == "pass"
    assert doc["summary"]["peak_gate"] == {"max_peak_ratio": 1.05, "rows": 0, "failed": 0, "worst_peak_ratio": None}
    assert doc["header"]["memory_worker_xla_allocator"] == "bfc"
    assert "| tiny | 0k | ab |" in report.jax_table(doc)


def test_cpu_memory_only_and_no_memory(tmp_path, capsys):
    assert bench_jax.main(TINY + ["--tokens", "96", "--memory-only", "--results-dir", str(tmp_path)]) == 0
    (r,) = json.loads((tmp_path / "jax_cpu.json").read_text())["rows"]
    assert r["status"] == "ok" and not r["timed"] and r.get("core_ms") is None and r["memory_status"] == "cpu"
    assert bench_jax.main(TINY + ["--tokens", "96", "--no-memory", "--repeats", "1", "--warmup", "0",
                                  "--results-dir", str(tmp_path)]) == 0
    (r,) = json.loads((tmp_path / "jax_cpu.json").read_text())["rows"]
    assert r["memory_status"] == "skipped" and r["core_ms"] is not None
    assert all(r[key] is None for key in NEW_FIELDS)
    capsys.readouterr()


def _gpu_row(**kw):
    row = {"shape": "olmoe", "tokens": 32768, "checkpoint": "ab", "status": "ok", "timed": True, "check_ok": True,
           "identical": True, "gated": True, "ratio_ok": True, "max_ratio": 1.10, "peak_gated": True,
           "max_peak_ratio": 1.05}
    row.update(kw)
    return row


def test_peak_figures_and_gate():
    m = {"memory_status": "ok", "core_peak_bytes": 3000, "core_grad_bytes": 1000, "jax_peak_bytes": 3100,
         "jax_grad_bytes": 1000}
    ok = bench_jax.memory_figures(m, 1.05)
    assert (ok["core_peak_beyond_grads_bytes"], ok["jax_peak_beyond_grads_bytes"]) == (2000, 2100)
    assert ok["peak_ratio"] == pytest.approx(1.05) and ok["peak_ok"]
    bad = bench_jax.memory_figures({**m, "jax_peak_bytes": 3200}, 1.05)
    assert bad["peak_ratio"] == pytest.approx(1.10) and bad["peak_ok"] is False

    assert bench_jax._verdict(_gpu_row(**ok)) == "pass (time, peak)"
    assert bench_jax._verdict(_gpu_row(**ok, gated=False)) == "pass (peak)"
    assert bench_jax._verdict(_gpu_row(**bad)) == "FAIL (peak ratio > 1.05)"
    assert bench_jax._verdict(_gpu_row(**bad, ratio_ok=False)) == "FAIL (ratio > 1.10; peak ratio > 1.05)"
    assert bench_jax._verdict(_gpu_row(**bad, peak_gated=False)) == "pass (time)"  # --no-memory
    args = bench_jax.parse_args(["--tokens", "32k,128k"])
    summ = bench_jax.summary([_gpu_row(**ok), _gpu_row(**bad, tokens=131072, gated=False)], args)
    assert summ["verdict"] == "fail" and summ["failed_rows"] == ["olmoe 128k ab: peak ratio > 1.05"]
    assert summ["peak_gate"]["rows"] == 2 and summ["peak_gate"]["failed"] == 1
    assert summ["peak_gate"]["worst_peak_ratio"] == pytest.approx(1.10)
    assert summ["time_gate"] == {"max_ratio": 1.10, "tokens": [32768], "rows": 1, "failed": 0}


class _FakeCupy:
    """Just what PoolTracker uses of CuPy: a pool that rounds to 512 bytes and counts what it lent."""

    def __init__(self):
        self.lent = 0
        fake = self

        class Pooled:
            def __init__(self, size):
                self.size = -(-size // 512) * 512
                fake.lent += self.size

            def __del__(self):
                fake.lent -= self.size

        def malloc(size):
            return SimpleNamespace(mem=Pooled(size), ptr=4096, device_id=0)

        self.pool = SimpleNamespace(malloc=malloc)
        self.allocator = malloc
        self.cuda = SimpleNamespace(
            UnownedMemory=lambda ptr, size, owner, device_id: SimpleNamespace(ptr=ptr, size=size, owner=owner),
            MemoryPointer=lambda mem, offset: SimpleNamespace(mem=mem),
            get_allocator=lambda: self.allocator,
            set_allocator=lambda fn: setattr(self, "allocator", fn),
        )

    def get_default_memory_pool(self):
        return self.pool


def test_pool_tracker_counts_blocks_until_released():
    cupy = _FakeCupy()
    other = iter([100, 100, 50])
    with bench_jax.PoolTracker(cupy, other=lambda: next(other)) as t:
        assert cupy.allocator == t.malloc
        a = cupy.allocator(1000)  # 1024 in the pool
        b = cupy.allocator(512)
        assert (t.live, t.peak, cupy.lent) == (1536, 1536, 1536)
        del a
        gc.collect()
        assert (t.live, t.peak, cupy.lent) == (512, 1536, 512)  # the block went back to the pool with its view
        c = cupy.allocator(2048)
    assert cupy.allocator != t.malloc  # the previous allocator is back
    assert (t.live, t.peak) == (2560, 2560)
    assert t.peak_with_other == max(1536 + 100, 2560 + 50) and t.other_range == (50, 100)
    del b, c
    gc.collect()
    assert t.live == 0 and cupy.lent == 0


def test_report_table_old_and_new_rows():
    doc = json.loads((pathlib.Path(report.RESULTS) / "jax_h200.json").read_text())
    # a run from before the memory columns: the committed rows with every field of the memory measurement left out
    new_keys = {"bfc_peak_ratio", "core_grad_bytes", "core_peak_beyond_grads_bytes", "core_peak_bytes",
                "core_predicted_peak_bytes", "core_spread_ms", "core_untracked_bytes", "jax_bfc_peak_bytes",
                "jax_cupy_after_bytes", "jax_cupy_peak_bytes", "jax_grad_bytes", "jax_peak_beyond_grads_bytes",
                "jax_spread_ms", "jax_untracked_bytes", "jax_xla_in_callbacks_bytes", "jax_xla_peak_bytes",
                "jax_xla_program_bytes", "max_peak_ratio", "memory_status", "memory_worker_s", "peak_gated", "peak_ok",
                "peak_ratio", "timed", "xla_python_client_allocator"}
    old = {"header": doc["header"], "rows": [{k: v for k, v in r.items() if k not in new_keys} for r in doc["rows"]]}
    lines = [line for line in report.jax_table(old).splitlines() if line.startswith("| ")]
    assert "core peak - grads MiB" in lines[0] and "peak ratio" in lines[0]
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert all(" - | - | - |" in line for line in lines[1:])  # that run measured no peaks
    row = _gpu_row(core_ms=10.0, jax_ms=10.5, ratio=1.05, jax_tflops=400.0, memory_status="ok",
                   core_peak_beyond_grads_bytes=2000 << 20, jax_peak_beyond_grads_bytes=2010 << 20, peak_ratio=1.005,
                   bfc_peak_ratio=1.02)
    mem_only = _gpu_row(shape="mixtral", timed=False, check_ok=None, core_peak_beyond_grads_bytes=100 << 20,
                        jax_peak_beyond_grads_bytes=140 << 20, peak_ratio=1.4)
    table = report.jax_table({"header": old["header"], "rows": [row, mem_only, {**row, "status": "error"}]})
    assert "| olmoe | 32k | ab | 10.00 | 10.50 | 1.050 | 400 | 2000 | 2010 | 1.005 | 1.020 | identical |" in table
    assert "| mixtral | 32k | ab | - | - | - | - | 100 | 140 | 1.400 | - | - |" in table
    assert "| olmoe | 32k | ab | error |" in table


@pytest.mark.gpu
def test_memory_worker_gpu_row():
    """On a GPU: the core's counted peak is the memory model's, to the byte; the JAX call's is measured."""
    args = bench_jax.parse_args(["--shape", "small=256,128,8,2", "--tokens", "2k"])
    m = bench_jax.run_memory_worker("small", (256, 128, 8, 2), 2048, "ab", args)
    assert m["memory_status"] == "ok", m
    assert m["core_peak_bytes"] == m["core_predicted_peak_bytes"]
    assert m["core_untracked_bytes"] == 0 and m["jax_untracked_bytes"] == 0 and m["jax_cupy_after_bytes"] == 0
    assert m["jax_peak_bytes"] >= m["jax_xla_peak_bytes"] > 0
    assert m["core_grad_bytes"] == m["jax_grad_bytes"] == _grad_bytes(2048, 256, 128, 8, 2)


def test_bfc_peak_ratio_is_recorded_not_gated():
    m = {"memory_status": "ok", "core_peak_bytes": 3000, "core_grad_bytes": 1000, "jax_peak_bytes": 3000,
         "jax_bfc_peak_bytes": 3500, "jax_grad_bytes": 1000}
    row = bench_jax.memory_figures(m, 1.05)
    assert row["peak_ratio"] == pytest.approx(1.0) and row["peak_ok"]
    assert row["bfc_peak_ratio"] == pytest.approx(1.25)
    assert bench_jax._verdict(_gpu_row(**row)) == "pass (time, peak)"


def test_xla_program_bytes():
    class Stats:
        output_size_in_bytes, temp_size_in_bytes, alias_size_in_bytes = 1000, 300, 200

    class Compiled:
        def __init__(self, stats):
            self.stats = stats

        def memory_analysis(self):
            if isinstance(self.stats, Exception):
                raise self.stats
            return self.stats

    assert bench_jax._xla_program_bytes(Compiled(Stats())) == 1100  # outputs + temporaries - aliased outputs
    assert bench_jax._xla_program_bytes(Compiled(None)) is None
    assert bench_jax._xla_program_bytes(Compiled(NotImplementedError("no analysis"))) is None
