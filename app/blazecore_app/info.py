"""What ``blazecore info`` reports: the GPU, CUDA, NVRTC and library versions, the kernel cache.

Every probe is guarded: a missing library, driver or GPU is reported as such, never raised. Versions of
optional libraries come from the installed distributions' metadata; torch and jax are imported only to
ask which devices they see.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import platform
import subprocess
import sys

import blazecore

NO_DRIVER = "no NVIDIA driver or GPU found"


def source_commit() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the code that runs, for results and logs: $BLAZECORE_GIT_COMMIT when set (a copy of the
    tree whose .git is not its history; dirty then unknown), else the HEAD of the git checkout holding blazecore
    and whether tracked files differ from it, else (None, None)."""
    if os.environ.get("BLAZECORE_GIT_COMMIT"):
        return os.environ["BLAZECORE_GIT_COMMIT"], None
    root = os.path.dirname(os.path.dirname(os.path.abspath(blazecore.__file__)))

    def git(*args):
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    if not os.path.exists(os.path.join(root, ".git")):
        return None, None
    commit = git("rev-parse", "HEAD")
    if not commit:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit, (bool(status) if status is not None else None)


def _editable_checkout() -> str | None:
    """The source directory when blazecore is installed from a checkout in editable mode (pip install -e), else None."""
    try:
        text = metadata.distribution("blazecore").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        text = None
    if text:
        try:
            url = json.loads(text)
        except ValueError:
            url = {}
        if url.get("dir_info", {}).get("editable") and str(url.get("url", "")).startswith("file://"):
            return url["url"][len("file://"):]
    return None


def install_hint(extra: str) -> str:
    """The pip command that adds the optional dependencies ``extra`` to this installation."""
    checkout = _editable_checkout()
    if checkout is not None:
        return f"pip install -e '{checkout}[{extra}]'"
    return f"pip install 'blazecore[{extra}]'"


def _dist_version(*names: str) -> tuple[str, str] | None:
    """(distribution, version) of the first installed distribution among ``names``."""
    for name in names:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _why(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _cuda_version(v: int) -> str:
    """CUDA's integer version (12040) as text (12.4)."""
    return f"{v // 1000}.{(v % 1000) // 10}"


def _cupy_info() -> dict:
    info: dict = {}
    dist = _dist_version("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy")
    info["cupy"] = f"{dist[1]} ({dist[0]})" if dist else None
    if dist is None:
        info["gpus"] = []
        info["gpu_error"] = f"cupy is not installed ({install_hint('cuda12')}, or cuda13 for CUDA 13)"
        return info
    try:
        from blazecore import _compile

        info["nvrtc"] = ".".join(str(v) for v in _compile.nvrtc_version())
    except Exception as exc:
        info["nvrtc"] = None
        info["nvrtc_error"] = _why(exc)
    try:
        import cupy

        info["cuda_runtime"] = _cuda_version(cupy.cuda.runtime.runtimeGetVersion())
    except Exception as exc:
        info["cuda_runtime"] = None
        info["cuda_runtime_error"] = _why(exc)
    try:
        import cupy

        v = cupy.cuda.runtime.driverGetVersion()
        info["cuda_driver"] = _cuda_version(v) if v > 0 else None  # 0: no driver installed
        if v <= 0:
            info["cuda_driver_error"] = NO_DRIVER
    except Exception as exc:
        info["cuda_driver"] = None
        info["cuda_driver_error"] = _why(exc)
    gpus = []
    try:
        import cupy

        from blazecore._compile import arch_for_capability

        for i in range(cupy.cuda.runtime.getDeviceCount()):
            p = cupy.cuda.runtime.getDeviceProperties(i)
            name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
            gpus.append({"index": i, "name": name, "capability": f"{p['major']}.{p['minor']}",
                         "memory_bytes": int(p["totalGlobalMem"]), "sm_count": int(p["multiProcessorCount"]),
                         "kernel_arch": arch_for_capability(p["major"], p["minor"])})
    except Exception as exc:
        no_driver = info.get("cuda_driver_error") == NO_DRIVER or any(
            code in str(exc) for code in ("cudaErrorInsufficientDriver", "cudaErrorNoDevice"))
        info["gpu_error"] = NO_DRIVER if no_driver else _why(exc)
    info["gpus"] = gpus
    return info


def _nvidia_smi() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if lines else None


def _torch_info() -> dict | None:
    dist = _dist_version("torch")
    if dist is None:
        return None
    info = {"version": dist[1]}
    try:
        import torch

        info["cuda"] = torch.version.cuda
        info["cuda_available"] = bool(torch.cuda.is_available())
        if info["cuda_available"]:
            info["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as exc:
        info["error"] = _why(exc)
    try:
        import importlib.util

        info["adapter"] = importlib.util.find_spec("blazecore_torch") is not None
    except Exception:
        info["adapter"] = False
    return info


def _jax_info() -> dict | None:
    dist = _dist_version("jax")
    if dist is None:
        return None
    info = {"version": dist[1], "jaxlib": (_dist_version("jaxlib") or (None, None))[1]}
    try:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        import jax

        info["devices"] = [str(d) for d in jax.devices()]
    except Exception as exc:
        info["error"] = _why(exc)
    return info


def _cache_info() -> dict:
    from blazecore._compile import cache_dir

    path = cache_dir()
    info = {"path": str(path), "exists": path.is_dir(), "files": 0, "bytes": 0}
    if path.is_dir():
        for root, _, files in os.walk(path):
            for f in files:
                try:
                    info["bytes"] += os.path.getsize(os.path.join(root, f))
                    info["files"] += 1
                except OSError:
                    pass
    return info


def collect() -> dict:
    """Everything ``info`` prints, as a JSON-able dict."""

    versions = {}
    for name in ("numpy", "ml_dtypes", "transformers", "matplotlib"):
        dist = _dist_version(name)
        versions[name] = dist[1] if dist else None
    for name in ("nvidia-cuda-nvrtc-cu12", "nvidia-cuda-nvrtc"):  # NVRTC from a wheel (CPU-only machines)
        dist = _dist_version(name)
        if dist:
            versions[name] = dist[1]
    return {
        "blazecore": blazecore.__version__,
        "location": os.path.dirname(os.path.abspath(blazecore.__file__)),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "libraries": versions,
        "cuda": {**_cupy_info(), "nvidia_smi_driver": _nvidia_smi()},
        "torch": _torch_info(),
        "jax": _jax_info(),
        "kernel_cache": _cache_info(),
    }


def format_info(info: dict) -> str:
    lines = [f"blazecore {info['blazecore']} ({info['location']})",
             f"python {info['python']} on {info['platform']}"]
    c = info["cuda"]
    gpus = c.get("gpus") or []
    if gpus:
        for g in gpus:
            lines.append(f"GPU {g['index']}: {g['name']} (compute capability {g['capability']}, {g['sm_count']} SMs, "
                         f"{g['memory_bytes'] / 2**30:.0f} GiB); kernels compiled for {g['kernel_arch']}")
    else:
        why = c.get("gpu_error") or "no CUDA device"
        lines.append(f"GPU: none ({why}); blazecore runs its NumPy reference on CPU arrays")
    driver = c.get("cuda_driver") or c.get("nvidia_smi_driver") or f"n/a ({c.get('cuda_driver_error', NO_DRIVER)})"
    if c.get("cuda_driver") and c.get("nvidia_smi_driver"):
        driver = f"{c['cuda_driver']} (driver {c['nvidia_smi_driver']})"
    lines.append(f"CUDA driver: {driver}")
    runtime = c.get("cuda_runtime") or f"n/a ({c.get('cuda_runtime_error', 'cupy missing')})"
    lines.append(f"CUDA runtime (CuPy): {runtime}")
    lines.append(f"CuPy: {c.get('cupy') or 'not installed'}")
    lines.append(f"NVRTC: {c.get('nvrtc') or 'n/a (' + c.get('nvrtc_error', 'cupy missing') + ')'}")
    t = info["torch"]
    if t is None:
        lines.append(f"torch: not installed ({install_hint('torch')} for train, bench and the PyTorch adapter)")
    else:
        dev = ", ".join(t.get("devices", [])) or "no CUDA device"
        lines.append(f"torch: {t['version']} (CUDA {t.get('cuda')}; {dev}); blazecore_torch "
                     f"{'importable' if t.get('adapter') else 'not importable'}")
    j = info["jax"]
    if j is None:
        lines.append("jax: not installed")
    else:
        lines.append(f"jax: {j['version']} (jaxlib {j['jaxlib']}; devices {', '.join(j.get('devices', [])) or '?'})")
    libs = info["libraries"]
    missing = [k for k, v in libs.items() if not v]
    lines.append("other: " + ", ".join(f"{k} {v}" for k, v in libs.items() if v) +
                 (f"; not installed: {', '.join(missing)}" if missing else ""))
    k = info["kernel_cache"]
    state = f"{k['files']} files, {k['bytes'] / 2**20:.1f} MiB" if k["exists"] else "not created yet"
    lines.append(f"compiled-kernel cache: {k['path']} ({state}; set BLAZECORE_CACHE_DIR to move it)")
    return "\n".join(lines)


def main(as_json: bool = False, out=None) -> int:
    out = out if out is not None else sys.stdout
    info = collect()
    print(json.dumps(info, indent=1) if as_json else format_info(info), file=out)
    return 0
