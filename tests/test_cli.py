"""The command line (``blazecore``, ``python -m blazecore``): parsing, one-line errors for bad options and failed
runs, ``train`` with each MoE implementation for a few steps, ``info`` and ``bench`` without a GPU, and the bench
report and plots on a results document (CPU only; the training example itself is tested in test_train.py)."""

from __future__ import annotations

import importlib
import json
import pathlib
import subprocess
import sys

import pytest
from blazecore_app import cli
from conftest import gpu_available

ROOT = pathlib.Path(__file__).resolve().parents[1]
# a tiny model: a few CPU steps take about a second
TINY = ["--device", "cpu", "--steps", "3", "--batch", "4", "--seq-len", "16", "--d-model", "32", "--layers", "1",
        "--heads", "2", "--experts", "4", "--top-k", "2", "--expert-hidden", "32", "--corpus-tokens", "20000",
        "--eval-batches", "1", "--sample-tokens", "0"]


def _run(*args, cwd, timeout=300):
    """``python -m blazecore ARGS`` in a subprocess, from ``cwd`` (not the checkout)."""
    return subprocess.run([sys.executable, "-m", "blazecore", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def _main(argv, capsys):
    """(exit status, stdout, stderr) of ``cli.main(argv)``, argparse's exits included."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv", [
    ["train"], ["train", "--steps", "3", "--layers", "1", "--baseline", "--ckpt", "d", "--resume", "--log", "l.json"],
    ["train", "--baseline", "grouped_mm", "--dtype", "float64", "--device", "cpu", "--checkpoint-policy", "none"],
    ["train", "--chunks", "auto"], ["train", "--chunks", "4", "--lr", "0.5", "--warmup", "0"],
    ["bench"], ["bench", "--shape", "fine", "--tokens", "8k,16k", "--largest-cap", "", "--no-plots", "--readme"],
    ["bench", "--results-dir", "out"], ["info"], ["info", "--json"], ["demo", "--tokens", "100"],
], ids=["train", "train-options", "train-baseline-gmm", "train-chunks-auto", "train-chunks", "bench", "bench-options",
        "bench-results-dir", "info", "info-json", "demo"])
def test_parser_accepts(argv):
    args = cli._parser().parse_args(argv)
    assert args.command == argv[0]


def test_train_options_map_to_config_fields():
    args = cli._parser().parse_args(["train", "--steps", "3", "--layers", "1", "--experts", "4", "--baseline",
                                     "--ckpt", "d", "--resume", "--stop-at", "2"])
    options = cli._train_options(args)
    assert options == {"steps": 3, "n_layers": 1, "num_experts": 4, "impl": "conventional", "ckpt_dir": "d",
                       "resume": True, "stop_at": 2}
    assert cli._train_options(cli._parser().parse_args(["train"])) == {}  # everything from the device preset
    args = cli._parser().parse_args(["train", "--weight-layout", "in_out", "--ffn-bias", "--activation",
                                     "swiglu_oai_interleaved"])
    assert cli._train_options(args) == {"weight_layout": "in_out", "ffn_bias": True,
                                        "activation": "swiglu_oai_interleaved"}
    with pytest.raises(SystemExit):  # only gated activations have an interleaved form
        cli._parser().parse_args(["train", "--activation", "gelu_interleaved"])


def test_every_train_option_is_a_config_field():
    pytest.importorskip("torch")
    train = cli._import_train()
    import dataclasses

    fields = {f.name for f in dataclasses.fields(train.TrainConfig)}
    assert set(cli._TRAIN_OPTIONS.values()) <= fields


def test_bare_command_prints_help(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for command in ("train", "bench", "info", "demo"):
        assert command in out


# ------------------------------------------------------------------------------------------------
# Bad input: one line naming the option, status 2, no traceback
# ------------------------------------------------------------------------------------------------

BAD = {
    "unknown-command": (["nope"], "invalid choice"),
    "train-lr-negative": (["train", "--lr", "-1"], "--lr"),
    "train-lr-text": (["train", "--lr", "fast"], "--lr"),
    "train-steps-zero": (["train", "--steps", "0"], "--steps"),
    "train-activation": (["train", "--activation", "tanh"], "--activation"),
    "train-baseline": (["train", "--baseline", "fused"], "--baseline"),
    "train-chunks": (["train", "--chunks", "0"], "--chunks"),
    "train-dtype": (["train", "--dtype", "int8"], "--dtype"),
    "train-device": (["train", "--device", "tpu:3", "--print-config"], "--device"),
    "train-top-k": (["train", "--device", "cpu", "--experts", "2", "--top-k", "3", "--print-config"], "top_k"),
    "train-heads": (["train", "--device", "cpu", "--d-model", "30", "--heads", "4", "--print-config"], "n_heads"),
    "demo-top-k": (["demo", "--top-k", "100"], "--top-k"),
    "demo-tokens": (["demo", "--tokens", "-5"], "--tokens"),
    "demo-device": (["demo", "--device", "tpu"], "--device"),
    "bench-repeats": (["bench", "--repeats", "0"], "--repeats"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_option_is_one_line(case, capsys):
    if case.startswith("train-") and case in ("train-device", "train-top-k", "train-heads"):
        pytest.importorskip("torch")
    argv, names = BAD[case]
    code, out, err = _main(argv, capsys)
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"blazecore{' ' + argv[0] if argv[0] != 'nope' else ''}: error: ") and names in lines[0]
    assert "Traceback" not in err + out


def test_bad_options_in_a_process_print_no_traceback(tmp_path):
    """The installed entry point, from another directory: the same one line and status 2."""
    for argv, names in (BAD["train-lr-negative"][0] + ["--device", "cpu"], "--lr"), (BAD["demo-top-k"][0], "--top-k"):
        r = _run(*argv, cwd=tmp_path)
        assert r.returncode == 2, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and names in r.stderr
        assert "Traceback" not in r.stderr + r.stdout


def test_failure_inside_a_run_is_one_line_and_a_log(monkeypatch, capsys):
    def broken(args):
        raise RuntimeError("the kernel cache is\nunreadable")

    monkeypatch.setitem(cli._COMMANDS, "demo", broken)
    code, out, err = _main(["demo"], capsys)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "blazecore demo: failed: RuntimeError: the kernel cache is unreadable" in lines[0]
    log = pathlib.Path(lines[0].rsplit("traceback in ", 1)[1].rstrip(")"))
    try:
        text = log.read_text()
        assert "Traceback" in text and "RuntimeError" in text
    finally:
        log.unlink()


# ------------------------------------------------------------------------------------------------
# train: blazecore and both baselines, a few steps on the CPU
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["blazecore", "conventional", "grouped_mm"])
def test_train_runs_a_few_steps(impl, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from blazecore_app import baselines

    if impl == "grouped_mm":
        why = baselines.grouped_mm_unsupported(torch.zeros(1, 32), torch.zeros(1, 64, 32), torch.zeros(1, 32, 32))
        if why is not None:
            pytest.skip(why)
    log = tmp_path / "log.json"
    argv = ["train", *TINY, "--log", str(log)] + ([] if impl == "blazecore" else ["--baseline", impl])
    code, out, err = _main(argv, capsys)
    assert code == 0, err
    assert "Traceback" not in err
    doc = json.loads(log.read_text())
    assert doc["impl"] == impl and doc["status"] == "done" and [h["step"] for h in doc["history"]] == [1, 2, 3]
    assert all(v == v for v in (doc["summary"]["first_loss"], doc["summary"]["final_loss"]))  # finite, not NaN


def test_grouped_mm_probe_ignores_the_callers_grad_mode():
    """The support probe's first call may come from an evaluation under no_grad; its answer must not depend on
    it (it is cached)."""
    torch = pytest.importorskip("torch")
    from blazecore_app import baselines

    x, w13, w2 = torch.zeros(4, 32), torch.zeros(2, 64, 32), torch.zeros(2, 32, 32)
    baselines._probe_grouped_mm.cache_clear()
    with torch.no_grad():
        quiet = baselines.grouped_mm_unsupported(x, w13, w2)
    baselines._probe_grouped_mm.cache_clear()
    assert quiet == baselines.grouped_mm_unsupported(x, w13, w2)
    if quiet is None:  # where grouped_mm runs, the baseline runs under no_grad after the probe
        with torch.no_grad():
            y = baselines.grouped_mm_moe(x, w13, w2, torch.ones(4, 1), torch.zeros(4, 1, dtype=torch.int64))
        assert y.shape == (4, 32)


def test_train_print_config_cpu(capsys):
    pytest.importorskip("torch")
    assert cli.main(["train", "--device", "cpu", "--steps", "7", "--print-config"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["steps"] == 7 and cfg["device"] == "cpu" and cfg["dtype"] == "float32" and cfg["impl"] == "blazecore"


def test_train_unavailable_baseline_is_a_usage_error(capsys):
    """grouped_mm has no float64 kernels: the run refuses before it starts, in one line."""
    pytest.importorskip("torch")
    code, _, err = _main(["train", *TINY, "--dtype", "float64", "--baseline", "grouped_mm"], capsys)
    assert code == 2 and err.startswith("blazecore train: error: --baseline grouped_mm: ")
    assert len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------------
# info, bench, demo
# ------------------------------------------------------------------------------------------------


def test_info_without_failing(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "blazecore" in out and "compiled-kernel cache" in out and "NVRTC" in out
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"blazecore", "cuda", "torch", "jax", "kernel_cache"} <= set(info)
    if not gpu_available():
        assert info["cuda"]["gpus"] == []


def _no_driver() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.driverGetVersion() == 0
    except Exception:
        return False


@pytest.mark.skipif(not _no_driver(), reason="checks the message of a machine without an NVIDIA driver")
def test_info_says_no_driver(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "GPU: none (no NVIDIA driver or GPU found)" in out and "InsufficientDriver" not in out


def test_install_hint_follows_the_installation(monkeypatch):
    from blazecore_app import info

    monkeypatch.setattr(info, "_editable_checkout", lambda: None)  # a wheel install
    assert info.install_hint("torch") == "pip install 'blazecore[torch]'"
    monkeypatch.setattr(info, "_editable_checkout", lambda: "/src/blazecore")
    assert info.install_hint("plot") == "pip install -e '/src/blazecore[plot]'"


@pytest.mark.skipif(gpu_available(), reason="checks the message of a machine without a GPU")
def test_bench_without_gpu_fails_clearly(tmp_path):
    r = _run("bench", cwd=tmp_path)
    assert r.returncode == 1
    assert "needs a CUDA GPU" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert not any(tmp_path.iterdir())


def test_bench_harness_from_an_uninstalled_checkout(monkeypatch):
    """With blazecore_app.bench not installed (the checkout on PYTHONPATH only), the bench command loads the
    checkout's bench/ package under that name; a module missing inside the harness still raises."""
    bench_dir = pathlib.Path(__file__).resolve().parents[1] / "bench"
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "blazecore_app.bench", None)  # an import of it now fails as not found
        for sub in ("bench_moe", "plot", "report", "_common"):
            m.delitem(sys.modules, f"blazecore_app.bench.{sub}", raising=False)
        mods = cli._bench_modules()
        assert sys.modules["blazecore_app.bench"].__file__ == str(bench_dir / "__init__.py")
        assert [mod.__name__ for mod in mods] == [f"blazecore_app.bench.{n}" for n in ("bench_moe", "plot", "report")]
        assert [pathlib.Path(mod.__file__) for mod in mods] == [bench_dir / f"{n}.py"
                                                                 for n in ("bench_moe", "plot", "report")]
    monkeypatch.setitem(sys.modules, "blazecore_app.bench.plot", None)
    with pytest.raises(ModuleNotFoundError, match="blazecore_app.bench.plot"):
        cli._bench_modules()


def test_demo_cpu(capsys):
    code, out, err = _main(["demo", "--tokens", "300", "--experts", "8", "--top-k", "2", "--device", "cpu",
                            "--repeats", "2"], capsys)
    assert code == 0, err
    assert "agrees with the NumPy argsort build" in out and "median of 2" in out


def test_import_does_no_framework_work(tmp_path):
    r = subprocess.run([sys.executable, "-c", "import sys, blazecore, blazecore.__main__, blazecore_app.cli, "
                        "blazecore_app.info, blazecore.testing; print(sorted(m for m in ('torch', 'jax', 'cupy', "
                        "'matplotlib', 'blazecore_torch') if m in sys.modules))"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------------------
# The bench report and plots, on a small results document of the shape bench_moe.py writes
# ------------------------------------------------------------------------------------------------


def _scaling_doc():
    base = {"shape": "tiny", "d": 64, "h": 32, "E": 4, "K": 2, "dtype": "bfloat16"}
    rows, largest, stopped = [], [], []
    for key, ms_per_k, bytes_per_token, oom in (("blazecore[ab]", 1.0, 1000, None), ("conventional", 3.0, 4000, 8192)):
        for L in (1024, 2048, 4096):
            rows.append({**base, "impl_key": key, "tokens": L, "status": "ok", "fwd_bwd_ms": ms_per_k * L / 1024,
                         "peak_bytes": bytes_per_token * L})
        if oom:
            stopped.append({**base, "impl_key": key, "tokens": oom, "status": "oom", "message": "out of memory"})
        else:
            largest.append({**base, "impl_key": key, "tokens": 16384, "status": "ok", "peak_bytes": 16384 * 1000})
    header = {"bench": "moe_scaling", "gpu": "Test GPU", "gpu_memory_bytes": 64 << 20, "date": "2026-01-01",
              "git_commit": "0" * 40, "torch": "x"}
    return {"header": header, "rows": rows, "largest": largest, "stopped": stopped}


def _bench_module(name):
    return importlib.import_module(f"blazecore_app.bench.{name}")


def test_scaling_report_marks_oom(tmp_path, monkeypatch):
    report = _bench_module("report")
    monkeypatch.setattr(report, "ROOT", tmp_path)
    path = tmp_path / "moe_scaling_test.json"
    table = report.scaling_table(_scaling_doc(), path)
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    assert lines[0] == "| tokens | blazecore[ab] | conventional |"
    assert any(line.startswith("| 8k |") and "OOM" in line for line in lines)
    assert any(line.startswith("| 16k |") and "- / " in line for line in lines)


def test_readme_blocks_rewritten(monkeypatch, tmp_path):
    report = _bench_module("report")
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "ROOT", tmp_path)
    text = (f"a\n{report.begin_marker()}\nold\n{report.END}\nb\n{report.begin_marker('scaling')}\nold\n{report.END}\n"
            "c\n")
    new, found = report.rewrite_readme(text)
    assert found == ["main", "scaling"]
    assert "old" not in new and new.startswith("a\n") and new.endswith("c\n")
    assert "python -m blazecore bench --readme" in new


def test_scaling_plots(tmp_path):
    pytest.importorskip("matplotlib")
    plot = _bench_module("plot")
    path = tmp_path / "moe_scaling_test.json"
    path.write_text(json.dumps(_scaling_doc()))
    pngs = plot.plot_file(path)
    assert sorted(p.name for p in pngs) == ["moe_scaling_test_tiny_memory.png", "moe_scaling_test_tiny_time.png"]
    series = plot._series(_scaling_doc(), "tiny")
    assert series["conventional"]["oom"] == 8192 and series["blazecore[ab]"]["oom"] is None
    assert series["blazecore[ab]"]["memory"][-1] == (16384, 16384 * 1000)
    for p in pngs:
        assert p.stat().st_size > 1000


def test_source_commit_prefers_the_environment(monkeypatch):
    """Results and train logs name the code's commit from one place: $BLAZECORE_GIT_COMMIT when set (a copied tree),
    else this checkout's HEAD (what `git rev-parse HEAD` says), and the benchmarks' headers take the same."""
    from blazecore_app import info

    from bench import _common

    monkeypatch.setenv("BLAZECORE_GIT_COMMIT", "feedc0de")
    assert info.source_commit() == ("feedc0de", None)
    assert _common.git_commit() == ("feedc0de", None)
    monkeypatch.delenv("BLAZECORE_GIT_COMMIT")
    root = pathlib.Path(info.blazecore.__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        head = None
    commit, dirty = info.source_commit()
    assert commit == head
    assert _common.git_commit()[0] == (head or "unknown")
    if head is not None:
        assert dirty in (True, False)
