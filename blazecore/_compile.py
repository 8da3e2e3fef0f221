"""Run-time compilation of the CUDA sources in ``blazecore/cuda`` with NVRTC.

``compile_cubin`` needs no GPU: it calls NVRTC through ``cupy_backends.cuda.libs.nvrtc`` with the
include options CuPy assembles (CUDA headers from the toolkit or the nvidia-cuda-runtime wheel), so
the CPU-only test compiles every kernel for sm_80 and sm_90a. ``get_function`` compiles for the
current device on first use and loads the cubin as a CuPy ``Function``. Results are cached in memory
and on disk, keyed by (source hash incl. local headers, options, arch, NVRTC version, template args).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from functools import lru_cache
from pathlib import Path

from . import _array

CUDA_DIR = Path(__file__).resolve().parent / "cuda"
_BASE_OPTIONS = ("--std=c++17", "-DNDEBUG", "--generate-line-info", "-default-device")
_lock = threading.Lock()
_functions: dict = {}
_modules: dict = {}


class CompileError(RuntimeError):
    pass


def cache_dir() -> Path:
    """Where compiled cubins are kept: $BLAZECORE_CACHE_DIR or ~/.cache/blazecore."""
    root = os.environ.get("BLAZECORE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "blazecore"
    )
    return Path(root)


def _nvrtc():
    from cupy_backends.cuda.libs import nvrtc

    return nvrtc


@lru_cache(maxsize=None)
def nvrtc_version() -> tuple:
    return tuple(_nvrtc().getVersion())


@lru_cache(maxsize=None)
def _cupy_include_options() -> tuple:
    from cupy._core.core import assemble_cupy_compiler_options

    return tuple(o for o in assemble_cupy_compiler_options(()) if o.startswith("-I"))


def _read_with_headers(filename: str) -> tuple[str, str]:
    """Source text and a hash covering it and every local header it includes (transitively)."""
    h = hashlib.sha256()
    seen = set()

    def visit(name):
        if name in seen:
            return
        seen.add(name)
        text = (CUDA_DIR / name).read_text()
        h.update(name.encode() + b"\0" + text.encode())
        for inc in re.findall(r'#include\s+"([^"]+)"', text):
            visit(inc)

    visit(filename)
    return (CUDA_DIR / filename).read_text(), h.hexdigest()


def arch_for_capability(major: int, minor: int) -> str:
    """sm_90a on Hopper (wgmma, setmaxnreg), otherwise the device's own sm_XY."""
    if (major, minor) == (9, 0):
        return "sm_90a"
    return f"sm_{major}{minor}"


def current_device() -> int:
    """The ordinal of CuPy's current device."""
    import cupy

    return int(cupy.cuda.runtime.getDevice())


def device_arch(device_id: int | None = None) -> str:
    """The arch kernels are compiled for on the device (the current one when None); a dry run's own arch."""
    run = _array.dry()
    if run is not None:
        return run.arch
    import cupy

    dev = cupy.cuda.Device(device_id) if device_id is not None else cupy.cuda.Device()
    cc = dev.compute_capability
    major, minor = int(cc[:-1]), int(cc[-1])
    if major < 8:
        raise RuntimeError(f"blazecore needs compute capability >= 8.0 (bf16 tensor cores); device has {major}.{minor}")
    return arch_for_capability(major, minor)


def compile_cubin(filename: str, name_expressions, arch: str, options=()):
    """Compile ``cuda/<filename>`` for ``arch``; returns (cubin bytes, {name_expr: lowered}, log).

    Raises CompileError on any error. Works without a GPU.
    """
    source, _ = _read_with_headers(filename)
    return compile_source(source, filename, name_expressions, arch, options)


def compile_source(source: str, filename: str, name_expressions, arch: str, options=(), ptx: bool = False):
    """:func:`compile_cubin` of source text (``filename`` names it in messages; ``cuda/`` is on the include path).
    ``ptx``: compile for the virtual architecture of ``arch`` and return the PTX text in place of the cubin."""
    nvrtc = _nvrtc()
    target = arch.replace("sm_", "compute_") if ptx else arch
    opts = list(_cupy_include_options()) + [f"-I{CUDA_DIR}", f"-arch={target}", *_BASE_OPTIONS, *options]
    prog = nvrtc.createProgram(source, filename, [], [])
    try:
        for ne in name_expressions:
            nvrtc.addNameExpression(prog, ne)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise CompileError(f"NVRTC failed on {filename} for {arch}:\n{nvrtc.getProgramLog(prog)}") from e
        log = nvrtc.getProgramLog(prog)
        lowered = {ne: nvrtc.getLoweredName(prog, ne) for ne in name_expressions}
        cubin = nvrtc.getPTX(prog) if ptx else nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return cubin, lowered, log


def _cache_key(filename, name_expressions, arch, options) -> str:
    _, src_hash = _read_with_headers(filename)
    payload = json.dumps([src_hash, sorted(name_expressions), arch, list(options), nvrtc_version(), _BASE_OPTIONS])
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def _load_or_compile(filename, name_expressions, arch, options):
    key = _cache_key(filename, name_expressions, arch, options)
    d = cache_dir()
    cubin_path, names_path = d / f"{key}.cubin", d / f"{key}.json"
    if cubin_path.exists() and names_path.exists():
        try:
            return cubin_path.read_bytes(), json.loads(names_path.read_text())
        except (OSError, ValueError):
            pass
    cubin, lowered, _ = compile_cubin(filename, name_expressions, arch, options)
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = cubin_path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(cubin)
        os.replace(tmp, cubin_path)
        names_path.write_text(json.dumps(lowered))
    except OSError:
        pass  # a read-only cache is not an error
    return cubin, lowered


def get_function(filename: str, name_expression: str, *, module_names=None, options=(), max_dynamic_smem=0):
    """The CuPy Function for ``name_expression`` (e.g. ``"dispatch_count<256>"``) in ``cuda/<filename>``.

    ``module_names``: every name expression to compile into the same module (defaults to just this
    one); the module is cached per (file, names, options, device arch). The environment's BLAZECORE_NVRTC_OPTIONS
    (space-separated) are added to ``options``. In a dry run
    (:func:`blazecore._array.dry_run`): a function that launches nothing.
    """
    if _array.dry() is not None:
        return _array.no_launch
    import cupy

    # BLAZECORE_NVRTC_OPTIONS: extra NVRTC options for every kernel (e.g. -DBLZ_SM90_PRODUCER_FENCE=1 to build a
    # variant the sources describe); part of the cache keys
    options = tuple(options) + tuple(os.environ.get("BLAZECORE_NVRTC_OPTIONS", "").split())
    dev = current_device()
    names = tuple(sorted(set(module_names or ()) | {name_expression}))
    key = (filename, name_expression, names, tuple(options), dev, max_dynamic_smem)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _functions.get(key)
        if fn is not None:
            return fn
        arch = device_arch(dev)
        cubin, lowered = _load_or_compile(filename, names, arch, tuple(options))
        mod = cupy.cuda.function.Module()
        mod.load(cubin)
        fn = mod.get_function(lowered[name_expression])
        _modules[key] = mod  # keep the module loaded as long as its function is cached
        if max_dynamic_smem:
            from cupy_backends.cuda.api import driver

            driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, max_dynamic_smem)
        _functions[key] = fn
        return fn


_cluster_occupancy: dict = {}


@lru_cache(maxsize=None)
def libcuda():
    """The CUDA driver library through ctypes (for the entry points CuPy's bindings do not expose); OSError where it
    cannot be loaded."""
    import ctypes

    return ctypes.CDLL("libcuda.so.1")


def max_active_clusters(fn, threads: int, smem: int, cluster: int) -> int:
    """How many clusters of ``cluster`` CTAs of ``fn`` (a CuPy Function whose kernel has compile-time cluster
    dimensions) the current device holds at once with ``threads`` threads and ``smem`` bytes of dynamic shared memory
    each (the driver's cuOccupancyMaxActiveClusters; CuPy does not expose it); 0 where the driver cannot say."""
    import ctypes

    key = (int(fn.ptr), threads, smem, cluster)
    n = _cluster_occupancy.get(key)
    if n is not None:
        return n

    class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
        _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                    ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                    ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p), ("attrs", ctypes.c_void_p),
                    ("numAttrs", ctypes.c_uint)]

    try:
        query = libcuda().cuOccupancyMaxActiveClusters
    except (OSError, AttributeError):
        return 0
    query.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.POINTER(LaunchConfig)]
    query.restype = ctypes.c_int
    cfg = LaunchConfig(cluster, 1, 1, threads, 1, 1, smem, None, None, 0)
    out = ctypes.c_int(0)
    n = out.value if query(ctypes.byref(out), ctypes.c_void_p(int(fn.ptr)), ctypes.byref(cfg)) == 0 else 0
    _cluster_occupancy[key] = n
    return n


# Every kernel the package launches, as (file, name expressions). The CPU-only compile test walks
# this table, so a kernel added to a launcher must be added here too.
KERNELS: dict[str, tuple[str, ...]] = {}


def register_kernels(filename: str, name_expressions) -> None:
    KERNELS[filename] = tuple(sorted(set(KERNELS.get(filename, ())) | set(name_expressions)))
