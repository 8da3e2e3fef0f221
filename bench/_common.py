"""Shared helpers of the blazecore benchmarks: run header, CUDA-event timing, JSON rows, tables.

Every benchmark writes ``bench/results/<name>_<gpu-slug>.json``::

    {"header": {gpu, capability, cuda, torch, cupy, ..., date, git_commit}, "rows": [{...}, ...]}

one row per measurement (long format), so results from several GPUs and commits can be merged.
Every timing goes through one helper, :func:`time_calls` (from blazecore_app.timing): warm-up calls, then the
median of the repeats and their spread (CUDA events on torch's or CuPy's stream, or the wall clock).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import pathlib
import platform
import re
import subprocess
import sys

from blazecore_app.timing import CLOCKS, Timing, cuda_time, time_call, time_calls, wall_time  # noqa: F401

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
MIB = float(1 << 20)


def cuda_gpu_available() -> tuple[bool, str]:
    """(True, "") if torch sees a CUDA GPU, else (False, why not)."""
    try:
        import torch
    except ImportError:
        return False, "torch is not installed (pip install torch) and the benchmarks time against it"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} sees no CUDA GPU (torch.cuda.is_available() is False)"
    return True, ""


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3' (for file names)."""
    s = re.sub(r"\bnvidia\b", "", name.lower())
    s = re.sub(r"[^a-z0-9]+", "-", s).strip("-")
    return s or "gpu"


def git_commit() -> tuple[str, bool | None]:
    """(commit, dirty): :func:`blazecore_app.info.source_commit`, 'unknown' where it finds none."""
    from blazecore_app.info import source_commit

    commit, dirty = source_commit()
    return commit or "unknown", dirty


def _version(module_name: str) -> str | None:
    try:
        mod = __import__(module_name)
    except Exception:
        return None
    return getattr(mod, "__version__", "unknown")


def _nvidia_smi_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if lines else None


def _software() -> dict:
    """Library versions, date and commit: the part of the header that needs no GPU."""
    commit, dirty = git_commit()
    header = {
        "torch": _version("torch"),
        "numpy": _version("numpy"),
        "cupy": _version("cupy"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit,
        "git_dirty": dirty,
        "argv": sys.argv,
    }
    try:
        import blazecore

        header["blazecore"] = blazecore.__version__
    except Exception as exc:
        header["blazecore"] = None
        header["blazecore_error"] = f"{type(exc).__name__}: {exc}"
    return header


def gpu_state() -> dict | None:
    """The GPU's SM clock (MHz), power draw (W), temperature (C) and active throttle reasons now, from nvidia-smi
    (None where it cannot be asked): beside a timing, it says at which clock the kernels ran."""
    q = ("clocks.sm", "power.draw", "temperature.gpu", "clocks_throttle_reasons.active")
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(q)}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    vals = [v.strip() for v in line.split(",")]
    if len(vals) != len(q):
        return None
    try:
        return {"sm_clock_mhz": float(vals[0]), "power_w": float(vals[1]), "temperature_c": float(vals[2]),
                "throttle_reasons": vals[3]}
    except ValueError:
        return None


def gpu_header(device: int | None = None) -> dict:
    """The run's identity: GPU, CUDA and library versions, date and commit (needs torch with CUDA)."""
    import torch

    dev = torch.cuda.current_device() if device is None else device
    props = torch.cuda.get_device_properties(dev)
    header = {
        "device": "cuda",
        "gpu": props.name,
        "gpu_slug": gpu_slug(props.name),
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "gpu_memory_bytes": props.total_memory,
        "driver": _nvidia_smi_driver(),
        "torch_cuda": torch.version.cuda,
        "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        **_software(),
    }
    try:
        import cupy

        header["cupy_cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        header["cuda_driver_api"] = cupy.cuda.runtime.driverGetVersion()
        header["nvrtc"] = ".".join(str(v) for v in cupy.cuda.nvrtc.getVersion())
    except Exception as exc:  # cupy absent or without a usable CUDA: record why, keep going
        header["cupy_error"] = f"{type(exc).__name__}: {exc}"
    return header


def cpu_header() -> dict:
    """Header of a CPU smoke run (no GPU fields; results go to <name>_cpu.json)."""
    return {"device": "cpu", "gpu": None, "gpu_slug": "cpu", "cpu": platform.processor() or None, **_software()}


def print_header(header: dict) -> None:
    dirty = " (dirty)" if header.get("git_dirty") else ""
    soft = (
        f"torch {header['torch']}, cupy {header.get('cupy')}, blazecore {header.get('blazecore')}, "
        f"commit {header['git_commit'][:12]}{dirty}, {header['date']}"
    )
    if header.get("gpu") is None:
        print(f"# CPU smoke run (no GPU figures), {soft}", flush=True)
        return
    print(
        f"# {header['gpu']} (sm_{header['capability'].replace('.', '')}, {header['sm_count']} SMs, "
        f"{header['gpu_memory_bytes'] / 2**30:.0f} GiB), driver {header.get('driver')}, "
        f"CUDA {header['torch_cuda']} (torch), {soft}",
        flush=True,
    )


def _oom_types() -> tuple:
    import torch

    types = [torch.cuda.OutOfMemoryError]
    try:
        import cupy

        types.append(cupy.cuda.memory.OutOfMemoryError)
    except Exception:
        pass
    return tuple(types)


def is_oom(exc) -> bool:
    """A GPU out-of-memory error: torch's or CuPy's, or one whose message says so."""
    return isinstance(exc, _oom_types()) or "out of memory" in str(exc).lower()


def probe_args(doc: str, argv=None, *, shape: str, tokens: str, repeats: int, extra=()):
    """The arguments of a probe script (scripts/probe_*.py): --shape (bench_gemm's shapes, comma-separated), --tokens
    (counts as parse_count reads them; ``args.token_counts`` the parsed list), --repeats, --json NAME (write
    bench/results/NAME_<gpu>.json) and --results-dir; ``extra``: the script's own, (flag, add_argument keywords)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    for flag, kw in extra:
        ap.add_argument(flag, **kw)
    ap.add_argument("--shape", default=shape, help="bench_gemm's shapes, comma-separated")
    ap.add_argument("--tokens", default=tokens, help="token counts, comma-separated (k = 1024)")
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--json", default=None, help="write bench/results/NAME_<gpu>.json")
    ap.add_argument("--results-dir", default=None)
    args = ap.parse_args(argv)
    try:
        args.token_counts = [parse_count(t) for t in args.tokens.split(",")]
    except ValueError as exc:
        ap.error(f"--tokens {args.tokens!r}: {exc}")
    return args


def write_probe_json(args, rows: list) -> None:
    """A probe's rows as JSON (``--json NAME``, with the GPU header), nothing without --json."""
    if args.json:
        path = write_json(args.json, gpu_header(), rows, pathlib.Path(args.results_dir) if args.results_dir else None)
        print(f"wrote {path}")


def tflops(flops: float, ms: float | None) -> float | None:
    if ms is None or not ms > 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def parse_count(text: str) -> int:
    """'8k' -> 8192, '1m' -> 1048576, '300' -> 300."""
    t = text.strip().lower()
    mult = 1
    if t.endswith("k"):
        mult, t = 1 << 10, t[:-1]
    elif t.endswith("m"):
        mult, t = 1 << 20, t[:-1]
    value = int(t) * mult
    if value < 0:
        raise ValueError(f"negative count {text!r}")
    return value


def format_count(n: int) -> str:
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}m"
    if n >= 1 << 10 and n % (1 << 10) == 0:
        return f"{n >> 10}k"
    return str(n)


def results_path(name: str, header: dict, results_dir: pathlib.Path | None = None) -> pathlib.Path:
    return pathlib.Path(results_dir or RESULTS_DIR) / f"{name}_{header['gpu_slug']}.json"


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def write_json(name: str, header: dict, rows: list, results_dir: pathlib.Path | None = None, **extra) -> pathlib.Path:
    """Write {"header", "rows", **extra} to results/<name>_<gpu-slug>.json (atomically) and return the path."""
    path = results_path(name, header, results_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_jsonable({"header": header, "rows": rows, **extra}), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def _cell(v, fmt: str | None) -> str:
    if v is None:
        return "-"
    if fmt and isinstance(v, (int, float)) and not isinstance(v, bool):
        return format(v, fmt)
    return str(v)


def format_table(rows: list, columns: list) -> str:
    """``columns``: (title, key or callable(row), format spec or None). Numbers right-aligned."""
    cells = []
    for r in rows:
        line = []
        for _, key, fmt in columns:
            v = key(r) if callable(key) else r.get(key)
            line.append(_cell(v, fmt))
        cells.append(line)
    widths = [max([len(c[0])] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]
    numeric = [fmt is not None for _, _, fmt in columns]

    def fmt_line(values):
        return "  ".join(v.rjust(w) if n else v.ljust(w) for v, w, n in zip(values, widths, numeric, strict=True))

    out = [fmt_line([c[0] for c in columns]), "  ".join("-" * w for w in widths)]
    out += [fmt_line(line) for line in cells]
    return "\n".join(out)


def print_table(rows: list, columns: list) -> None:
    print(format_table(rows, columns), flush=True)
