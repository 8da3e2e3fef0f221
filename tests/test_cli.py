"""The command line (``python -m blazecore``): parsing, ``info`` and ``bench`` without a GPU, the import rule,
and the bench report and plots on a results document (CPU only; ``train`` is tested in test_train.py)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from conftest import gpu_available

from blazecore import __main__ as cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "adapters"), env.get("PYTHONPATH", "")])
    return env


def _run(*args, timeout=120):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=_env(),
                          cwd=ROOT)


@pytest.mark.parametrize("argv", [
    ["train"], ["train", "--steps", "3", "--layers", "1", "--baseline", "--ckpt", "d", "--resume", "--log", "l.json"],
    ["train", "--baseline", "grouped_mm", "--dtype", "float64", "--device", "cpu", "--checkpoint-policy", "none"],
    ["bench"], ["bench", "--shape", "fine", "--tokens", "8k,16k", "--largest-cap", "", "--no-plots", "--readme"],
    ["info"], ["info", "--json"], ["demo", "--tokens", "100"],
], ids=["train", "train-options", "train-baseline-gmm", "bench", "bench-options", "info", "info-json", "demo"])
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


def test_every_train_option_is_a_config_field():
    pytest.importorskip("torch")
    train = cli._import_torch_adapter()
    import dataclasses

    fields = {f.name for f in dataclasses.fields(train.TrainConfig)}
    assert set(cli._TRAIN_OPTIONS.values()) <= fields


def test_bare_command_prints_help(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for command in ("train", "bench", "info", "demo"):
        assert command in out


def test_parser_rejects_unknown_command():
    with pytest.raises(SystemExit) as exc:
        cli.main(["nope"])
    assert exc.value.code == 2


def test_info_without_failing(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "blazecore" in out and "compiled-kernel cache" in out and "NVRTC" in out
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"blazecore", "cuda", "torch", "jax", "kernel_cache"} <= set(info)
    if not gpu_available():
        assert info["cuda"]["gpus"] == []


@pytest.mark.skipif(gpu_available(), reason="checks the message of a machine without a GPU")
def test_bench_without_gpu_fails_clearly():
    r = _run("-m", "blazecore", "bench")
    assert r.returncode != 0
    assert "needs a CUDA GPU" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_import_does_no_framework_work():
    r = _run("-c", "import sys, blazecore, blazecore.__main__, blazecore._info; "
                   "print(sorted(m for m in ('torch', 'jax', 'cupy', 'matplotlib') if m in sys.modules))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_train_print_config_cpu(capsys):
    pytest.importorskip("torch")
    assert cli.main(["train", "--device", "cpu", "--steps", "7", "--print-config"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["steps"] == 7 and cfg["device"] == "cpu" and cfg["dtype"] == "float32" and cfg["impl"] == "blazecore"


def test_train_bad_option_is_a_message(capsys):
    pytest.importorskip("torch")
    assert cli.main(["train", "--device", "cpu", "--experts", "2", "--top-k", "3", "--print-config"]) == 2
    assert "top_k" in capsys.readouterr().err


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
    sys.path.insert(0, str(ROOT))
    try:
        return __import__(f"bench.{name}", fromlist=[name])
    finally:
        sys.path.remove(str(ROOT))


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
