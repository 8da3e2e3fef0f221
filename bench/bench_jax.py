"""Benchmark of the JAX adapter: a jitted forward+backward of ``blazecore_jax.moe_ffn`` against the core it wraps.

For each shape (d, h, E, K), token count L and checkpoint policy, in bf16 with a fixed random routing (softmax
over E of random logits, top-k, renormalised), the same inputs run two ways:

* core: ``blazecore.build_dispatch(ids, E, validate=False)``, ``blazecore.moe_forward`` and
  ``blazecore.moe_backward`` on CuPy arrays, on one CuPy stream, every allocation from CuPy's pool;
* jax: one ``jax.jit`` function: ``blazecore_jax.build_dispatch(ids, E, validate=False)``, then
  ``jax.vjp`` of ``blazecore_jax.moe_ffn`` (routing given, that dispatch) applied to dy; it returns y, dx,
  dw13, dw2 and dgates, in buffers XLA allocates.

Same kernels, same routing, same dispatch build, same checkpoint policy: what differs is the adapter (buffer
callbacks on XLA's stream, XLA-owned outputs, the copy of the saved pre-activations into XLA's buffer under
"ab", a backward that leaves those pre-activations intact). Each call is timed on the wall clock up to a
device synchronisation (``block_until_ready`` / ``Stream.synchronize``), core and jax calls alternating after
warm-up calls; a figure is the median of the repeats. The core's CUDA-event time is recorded beside it.

    ratio = jax median / core median      acceptance: ratio <= --max-ratio (1.10) at --gate-tokens (32k)

Peak memory, as bench/bench_moe.py's ``measure_memory`` counts it for the PyTorch layer, of one call of each
(the dispatch build included on both sides, as it is inside the jitted function):

* peak bytes: the most allocated at once over one dispatch build + forward + backward, minus what was allocated
  before it (the inputs x, w13, w2, gates, ids, dy), so y, the dispatch, the saved pre-activations, the
  transients and the gradients count;
* peak beyond gradients: the peak minus the bytes of the returned dx, dw13, dw2, dgates.

    peak_ratio = jax / core peak beyond gradients      acceptance: peak_ratio <= --max-peak-ratio (1.05), every row

The core allocates only from CuPy's pool. The JAX call allocates from XLA's allocator (its inputs, outputs and
temporaries, the saved pre-activations among them) and from CuPy's pool (the core's workspaces inside the
buffer callbacks), so its peak is that of the sum of the two. Both are read in a fresh process per row (this
script with --memory-worker), because XLA's peak_bytes_in_use cannot be reset and its allocator never hands
memory back: a row measured after another would report the larger of the two. The worker measures the core
first and returns CuPy's blocks to the device before XLA's allocator grows, so the two never hold memory at
once; every worker runs before this process times anything, so none competes with the timing's buffers. In
the worker, each side runs one warm-up call (kernels compiled and loaded) and then the measured call:

* CuPy: a counting allocator (``PoolTracker``) in front of the pool, installed for the measured call: every
  block counted from when it is handed out until its last reference goes, in the pool's rounded sizes (what
  ``used_bytes`` counts), on every thread (XLA runs the buffer callbacks on threads of its own). The JSON
  keeps ``blazecore.moe_memory``'s prediction of the core's peak beside it (core_predicted_peak_bytes).
* XLA: the bytes its buffer assignment gives the execution (``compiled.memory_analysis()``: outputs plus
  temporaries, less outputs aliased to inputs; jax_xla_program_bytes). XLA allocates an execution's outputs and
  temporaries when it starts and holds them to its end, so the callbacks run beside all of them and CuPy holds
  nothing between callbacks (jax_cupy_after_bytes): jax_peak_bytes = program bytes + CuPy's peak. That is the
  gated figure: requested sizes, as the core's side counts them.
* The same call as XLA's default BFC allocator counts it, beside it (jax_bfc_peak_bytes, bfc_peak_ratio; not
  gated): ``device.memory_stats()`` (XLA_PYTHON_CLIENT_ALLOCATOR=bfc in the worker; "platform" has no peak),
  peak_bytes_in_use after the call minus bytes_in_use before it, or the largest (XLA in use + CuPy in use) read
  at a CuPy allocation when larger. The jitted function is compiled before any input is on the device, so
  compiling cannot have set that peak (the worker checks); XLA's bytes in use stay put while the callbacks run
  (jax_xla_in_callbacks_bytes: the least and the most read there). BFC hands out a free chunk whole when it is
  less than twice the request (and not 128 MiB larger), so after the warm-up call a 96 MiB buffer can occupy
  a 128 MiB chunk: this figure exceeds the program's bytes by such remainders, which depend on the allocator's
  history, not on the layer.

The outputs of both are compared before timing (relative norm error under 1e-2 for each of y, dx, dw13, dw2,
dgates; they are expected to be identical, which the JSON records). The script exits 1 when a check, a gated
ratio or (on a GPU) a peak ratio or a peak measurement fails, 0 otherwise (also when there is no GPU: nothing is
measured then). The JSON's "summary" holds the verdict and both gates.

XLA_PYTHON_CLIENT_PREALLOCATE is set to false before jax is imported: JAX shares the GPU with CuPy's pool.

Usage (from the repository root, with the project installed: pip install -e .):
    python -m bench.bench_jax                                   # olmoe, 8k and 32k tokens, policy "ab"
    python -m bench.bench_jax --tokens 32k --checkpoint both --results-dir /tmp/out
    python -m bench.bench_jax --shapes olmoe,qwen3,fine,mixtral --tokens 32k,128k --checkpoint both --memory-only
    python -m bench.bench_jax --device cpu --shape tiny=64,32,8,2 --tokens 96   # CPU smoke test of the flow
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

try:
    from . import _common as common
except ImportError:  # run as a script: python bench/bench_jax.py
    import _common as common

SHAPES = {
    # name: (d, h, E, K)
    "olmoe": (2048, 1024, 64, 8),
    "qwen3": (2048, 768, 128, 8),
    "mixtral": (4096, 14336, 8, 2),
    "fine": (1536, 256, 128, 8),
}
ACTIVATION = "swiglu"
OUTPUTS = ("y", "dx", "dw13", "dw2", "dgates")
GRADS = ("dx", "dw13", "dw2", "dgates")
ARGS = ("x", "w13", "w2", "gates", "ids", "dy")  # the jitted function's arguments, in order
CHECK_TOL = 1e-2
# the memory worker's one line of JSON on stdout starts with this (whatever else the libraries print)
MEMORY_MARKER = "bench_jax memory: "
# XLA's allocator in the memory worker: BFC (the default) keeps peak_bytes_in_use; "platform" keeps no peak
WORKER_XLA_ALLOCATOR = "bfc"


# ------------------------------------------------------------------------------------------------
# Environment
# ------------------------------------------------------------------------------------------------


def jax_gpu(device: str):
    """(jax module, jax device, "") or (None, None, why not)."""
    try:
        import jax
    except ImportError:
        return None, None, "jax is not installed"
    if device == "cpu":
        return jax, jax.devices("cpu")[0], ""
    try:
        return jax, jax.devices("gpu")[0], ""
    except RuntimeError as exc:
        return None, None, f"JAX has no GPU backend ({' '.join(str(exc).split())[:200]})"


def header_for(device: str, jdev) -> dict:
    if device == "cpu":
        header = common.cpu_header()
    else:
        ok, _ = common.cuda_gpu_available()
        if ok:  # torch sees the GPU: the common header (GPU name, driver, CUDA, versions)
            header = common.gpu_header()
        else:  # no torch: name the GPU from JAX
            name = getattr(jdev, "device_kind", "gpu")
            header = {"device": "cuda", "gpu": name, "gpu_slug": common.gpu_slug(name), **common._software()}
    import jax

    header["jax"] = jax.__version__
    try:
        import jaxlib

        header["jaxlib"] = jaxlib.__version__
    except Exception:
        header["jaxlib"] = None
    header["jax_device"] = str(jdev)
    header["jax_device_kind"] = getattr(jdev, "device_kind", None)
    header["xla_python_client_preallocate"] = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")
    header["xla_python_client_allocator"] = os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR")  # of the timing process
    header["bench"] = "jax"
    return header


def print_header(header: dict) -> None:
    if header.get("gpu") is None or "sm_count" not in header:
        print(f"# {header.get('gpu') or 'CPU smoke run'}, commit {str(header.get('git_commit'))[:12]}, "
              f"{header.get('date')}", flush=True)
    else:
        common.print_header(header)
    print(f"# jax {header.get('jax')} ({header.get('jax_device')}), cupy {header.get('cupy')}", flush=True)


# ------------------------------------------------------------------------------------------------
# Inputs: NumPy on the host, the same bits to CuPy (bf16 as uint16) and to JAX
# ------------------------------------------------------------------------------------------------


def host_inputs(d, h, E, K, L, seed):
    """bf16 x, w13, w2, dy (ml_dtypes), gates (L, K) float32 and ids (L, K) int32 from one seed."""
    import numpy as np

    from blazecore import BF16

    rng = np.random.default_rng(seed)

    def bf(shape, scale):
        a = rng.standard_normal(shape, dtype=np.float32)
        a *= scale
        return a.astype(BF16)

    w13 = bf((E, 2 * h, d), d**-0.5)
    w2 = bf((E, d, h), h**-0.5)
    x = bf((L, d), 1.0)
    dy = bf((L, d), 1.0)
    logits = rng.standard_normal((L, E), dtype=np.float32)
    ids = np.argpartition(-logits, K - 1, axis=1)[:, :K].astype(np.int32)
    top = np.take_along_axis(logits, ids, 1)
    p = np.exp(top - logits.max(axis=1, keepdims=True))  # softmax restricted to the top-k, renormalised
    gates = (p / p.sum(axis=1, keepdims=True)).astype(np.float32)
    return {"x": x, "w13": w13, "w2": w2, "gates": gates, "ids": np.ascontiguousarray(ids), "dy": dy}


def to_core(host: dict, device: str) -> dict:
    """The core's arrays: NumPy on the CPU; CuPy on the GPU (bf16 as its uint16 bits)."""
    import numpy as np

    from blazecore import BF16

    if device == "cpu":
        return dict(host)
    import cupy

    return {k: cupy.asarray(v.view(np.uint16) if v.dtype == BF16 else v) for k, v in host.items()}


def to_jax(host: dict, jdev) -> dict:
    import jax

    return {k: jax.device_put(v, jdev) for k, v in host.items()}


# ------------------------------------------------------------------------------------------------
# The two runs
# ------------------------------------------------------------------------------------------------


class CoreRun:
    """build_dispatch + moe_forward + moe_backward on the core's arrays, on one stream (None on the CPU)."""

    def __init__(self, bc, arrays, E, checkpoint, retain, device):
        self.bc, self.a, self.E, self.checkpoint, self.retain = bc, arrays, E, checkpoint, retain
        self.gpu = device != "cpu"
        if self.gpu:
            import cupy

            self.stream = cupy.cuda.Stream(non_blocking=True)
        else:
            self.stream = None

    def __call__(self):
        bc, a, s = self.bc, self.a, self.stream
        disp = bc.build_dispatch(a["ids"], self.E, validate=False, stream=s)
        y, saved = bc.moe_forward(a["x"], a["w13"], a["w2"], a["gates"], a["ids"], activation=ACTIVATION,
                                  checkpoint=self.checkpoint, dispatch=disp, stream=s)
        g = bc.moe_backward(a["dy"], saved, stream=s, retain=self.retain)
        return {"y": y, "dx": g.dx, "dw13": g.dw13, "dw2": g.dw2, "dgates": g.dgates}

    def sync(self):
        if self.gpu:
            self.stream.synchronize()


class JaxRun:
    """jax.jit of build_dispatch + vjp(moe_ffn) applied to dy (``arrays`` may be set later, as ``a``)."""

    def __init__(self, jax, bj, arrays, E, checkpoint):
        self.jax, self.a = jax, arrays

        def step(x, w13, w2, gates, ids, dy):
            disp = bj.build_dispatch(ids, E, validate=False)

            def ffn(x, w13, w2, gates):
                return bj.moe_ffn(x, w13, w2, gates, ids, activation=ACTIVATION, checkpoint=checkpoint,
                                  dispatch=disp)

            y, vjp = jax.vjp(ffn, x, w13, w2, gates)
            dx, dw13, dw2, dgates = vjp(dy)
            return {"y": y, "dx": dx, "dw13": dw13, "dw2": dw2, "dgates": dgates}

        self.fn = jax.jit(step)

    def compile(self, host, device):
        """Trace and compile for the shapes and dtypes of ``host`` on ``device`` now (ahead of time: no input need
        be there yet); later calls run that executable."""
        on = self.jax.sharding.SingleDeviceSharding(device)  # not the default device: --device cpu beside a GPU
        structs = [self.jax.ShapeDtypeStruct(host[k].shape, host[k].dtype, sharding=on) for k in ARGS]
        self.fn = self.fn.lower(*structs).compile()

    def __call__(self):
        a = self.a
        return self.fn(*(a[k] for k in ARGS))


# ------------------------------------------------------------------------------------------------
# Output comparison (on the device where possible)
# ------------------------------------------------------------------------------------------------


def _as_core_array(a, device):
    """A JAX result as the core holds arrays (CuPy, bf16 as uint16; NumPy on the CPU)."""
    import numpy as np

    from blazecore import BF16, asarray

    if device == "cpu":
        return np.asarray(a)
    try:
        return asarray(a, "jax output")  # zero-copy through DLPack
    except Exception:  # a host round trip if this JAX build exports no DLPack for it
        import cupy

        h = np.asarray(a)
        return cupy.asarray(h.view(np.uint16) if h.dtype == BF16 else h)


def _float32(a):
    """float32 copy of a core array (uint16 bf16 bits on the GPU, ml_dtypes bf16 on the CPU)."""
    import numpy as np

    mod = type(a).__module__.split(".")[0]
    if mod == "cupy":
        import cupy

        if a.dtype == cupy.uint16:
            return (a.astype(cupy.uint32) << 16).view(cupy.float32)
        return a.astype(cupy.float32)
    return np.asarray(a).astype(np.float32)


def compare(core_out: dict, jax_out: dict, device: str) -> dict:
    """Per output: relative norm error of jax against core, and whether the bits are identical."""
    res = {}
    for name in OUTPUTS:
        c = core_out[name]
        j = _as_core_array(jax_out[name], device)
        if tuple(c.shape) != tuple(j.shape):
            res[name] = {"rel_err": float("inf"), "identical": False, "message": f"shape {j.shape} != {c.shape}"}
            continue
        xp = sys.modules["cupy"] if type(c).__module__.split(".")[0] == "cupy" else sys.modules["numpy"]
        identical = bool(xp.array_equal(c.view(xp.uint16) if c.dtype.itemsize == 2 else c,
                                        j.view(xp.uint16) if j.dtype.itemsize == 2 else j))
        c32, j32 = _float32(c), _float32(j)
        den = float(xp.linalg.norm(c32.ravel()))
        num = float(xp.linalg.norm((j32 - c32).ravel()))
        res[name] = {"rel_err": num / (den if den > 0 else 1.0), "identical": identical}
        del c32, j32
    return res


# ------------------------------------------------------------------------------------------------
# Peak memory: one row in a fresh process (--memory-worker)
# ------------------------------------------------------------------------------------------------


class PoolTracker:
    """CuPy's allocator while installed: blocks from CuPy's default pool, counted from when one is handed out
    until its last reference goes, in the pool's rounded sizes (what ``used_bytes`` counts).

    ``used_bytes`` read now and then would miss the peaks between two readings; this sees every allocation.
    ``cupy.cuda.set_allocator`` is process-wide, so the blocks the core takes inside XLA's buffer callbacks, on
    XLA's threads, are counted too. ``other`` (a callable returning bytes), when given, is read at every
    allocation: the bytes another allocator holds at that moment, for the peak of the sum of the two."""

    def __init__(self, cupy, other=None):
        self.cupy, self.pool, self.other = cupy, cupy.get_default_memory_pool(), other
        self.lock = threading.Lock()
        self.live = self.peak = 0
        self.peak_with_other = None  # the largest live + other() read at an allocation
        self.other_range = None  # (least, most) other() read

    def malloc(self, size):
        mp = self.pool.malloc(size)
        n = mp.mem.size
        if n == 0:
            return mp
        with self.lock:  # nothing in here can drop a block (whose release takes the lock)
            self.live += n
            self.peak = max(self.peak, self.live)
            live = self.live
        if self.other is not None:
            o = self.other()
            with self.lock:
                self.peak_with_other = max(self.peak_with_other or 0, live + o)
                lo, hi = self.other_range or (o, o)
                self.other_range = (min(lo, o), max(hi, o))
        # the caller gets a view of the pool's block that owns it: when the view goes, _Block's __del__ counts
        # the release and drops the pool's pointer, which hands the block back to the pool
        mem = self.cupy.cuda.UnownedMemory(mp.ptr, n, _Block(self, n, mp), mp.device_id)
        return self.cupy.cuda.MemoryPointer(mem, 0)

    def release(self, n):
        with self.lock:
            self.live -= n

    def __enter__(self):
        self.prev = self.cupy.cuda.get_allocator()
        self.cupy.cuda.set_allocator(self.malloc)
        return self

    def __exit__(self, *exc):
        self.cupy.cuda.set_allocator(self.prev)


class _Block:
    __slots__ = ("tracker", "n", "mp")

    def __init__(self, tracker, n, mp):
        self.tracker, self.n, self.mp = tracker, n, mp

    def __del__(self):
        self.tracker.release(self.n)


def _nbytes(outputs: dict, names) -> int:
    return sum(int(outputs[n].nbytes) for n in names)


def release_device_memory():
    """Collect dropped arrays and hand CuPy's cached blocks back to the device (XLA's allocator keeps its own)."""
    gc.collect()
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return
    try:
        cupy.get_default_memory_pool().free_all_blocks()
    except Exception:  # no usable device (CPU runs): nothing cached
        pass


def core_memory(bc, host, E, policy, args) -> dict:
    """The core's peak over one dispatch build + forward + backward, beyond its inputs (CuPy's pool only)."""
    core = CoreRun(bc, to_core(host, args.device), E, policy, args.core_retain, args.device)
    out = core()
    core.sync()
    grad_bytes = _nbytes(out, GRADS)
    if not core.gpu:
        return {"core_peak_bytes": None, "core_grad_bytes": grad_bytes}
    del out  # that call was the warm-up: kernels compiled and loaded, whatever the core caches made
    gc.collect()
    import cupy

    pool = cupy.get_default_memory_pool()
    used = pool.used_bytes()
    with PoolTracker(cupy) as t:
        out = core()
        core.sync()
    untracked = pool.used_bytes() - used - t.live  # blocks taken past the tracker (expected 0)
    del out, core
    return {"core_peak_bytes": t.peak, "core_grad_bytes": grad_bytes, "core_untracked_bytes": untracked}


def _xla_program_bytes(compiled):
    """Bytes XLA's buffer assignment gives one execution of ``compiled``: outputs plus temporaries, less the outputs
    that alias inputs (None where this JAX build has no memory analysis)."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # not every backend implements it
        return None
    if ma is None:
        return None
    return int(ma.output_size_in_bytes) + int(ma.temp_size_in_bytes) - int(ma.alias_size_in_bytes)


def jax_memory(jax, jdev, bj, host, E, policy, args) -> dict:
    """The jitted call's peak, beyond its inputs: XLA's allocator and CuPy's pool together (module docstring)."""
    jx = JaxRun(jax, bj, None, E, policy)
    jx.compile(host, jdev)  # before any input is on the device: compiling cannot set the peak read below
    if args.device == "cpu":
        jx.a = to_jax(host, jdev)
        out = jax.block_until_ready(jx())
        return {"jax_peak_bytes": None, "jax_grad_bytes": _nbytes(out, GRADS)}
    import cupy

    def stats():
        return jdev.memory_stats() or {}

    compile_peak = stats().get("peak_bytes_in_use")
    if compile_peak is None:
        raise RuntimeError(f"{jdev}.memory_stats() has no peak_bytes_in_use (XLA_PYTHON_CLIENT_ALLOCATOR="
                           f"{os.environ.get('XLA_PYTHON_CLIENT_ALLOCATOR')!r})")
    jx.a = to_jax(host, jdev)
    jax.block_until_ready(jx.a)
    out = jax.block_until_ready(jx())  # the warm-up; the same executable on the same inputs allocates alike
    for v in out.values():
        v.delete()
    del out
    gc.collect()
    pool = cupy.get_default_memory_pool()
    base, used = stats()["bytes_in_use"], pool.used_bytes()
    with PoolTracker(cupy, other=lambda: stats()["bytes_in_use"]) as t:
        out = jax.block_until_ready(jx())
    after = stats()
    if after["peak_bytes_in_use"] <= compile_peak:
        raise RuntimeError(f"XLA's peak ({after['peak_bytes_in_use']} bytes) was reached before the inputs were on "
                           "the device: it says nothing of the call")
    xla_peak = after["peak_bytes_in_use"] - base
    cupy_after = t.live  # blocks the call took and still holds (expected 0): counted at XLA's peak too
    bfc_peak = xla_peak + cupy_after
    if t.peak_with_other is not None:
        bfc_peak = max(bfc_peak, t.peak_with_other - base)
    program = _xla_program_bytes(jx.fn)
    lo, hi = t.other_range or (None, None)
    res = {
        # what the call allocates: XLA's buffers (outputs and temporaries, held through the whole execution) plus
        # the most CuPy held at once inside the callbacks
        "jax_peak_bytes": None if program is None else program + max(t.peak, cupy_after),
        "jax_xla_program_bytes": program,
        # the same call as XLA's BFC allocator counts it: chunks it handed out, larger than asked where it did not
        # split a free chunk (less than twice the request); depends on what the allocator held before
        "jax_bfc_peak_bytes": bfc_peak,
        "jax_grad_bytes": _nbytes(out, GRADS),
        "jax_xla_peak_bytes": xla_peak,  # XLA's allocator alone
        "jax_cupy_peak_bytes": t.peak,  # CuPy's pool alone (the core's workspaces in the callbacks)
        "jax_xla_in_callbacks_bytes": None if lo is None else [lo - base, hi - base],  # XLA's in use, least/most
        "jax_cupy_after_bytes": cupy_after,
        "jax_untracked_bytes": pool.used_bytes() - used - t.live,
    }
    del out
    return res


def measure_memory(shape, L, policy, args) -> dict:
    """The worker's measurement of one row: the core's, then the JAX layer's peak (``*_peak_bytes``: None on the
    CPU, which has no such figures) and the bytes of the gradients each returned."""
    d, h, E, K = shape
    jax, jdev, why = jax_gpu(args.device)
    if jax is None:
        raise RuntimeError(why)
    import blazecore_jax as bj

    import blazecore as bc

    host = host_inputs(d, h, E, K, L, args.seed)
    res = core_memory(bc, host, E, policy, args)
    # the core's memory model (a dry run of the same launchers), beside the measured peak as a cross-check
    res["core_predicted_peak_bytes"] = bc.moe_memory(L, d, h, E, K, activation=ACTIVATION, checkpoint=policy).peak_bytes
    # the core first: its blocks go back to the device before XLA's allocator grows, which never shrinks
    release_device_memory()
    res.update(jax_memory(jax, jdev, bj, host, E, policy, args))
    res["memory_status"] = "ok" if args.device != "cpu" else "cpu"
    res["xla_python_client_allocator"] = os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR")
    return res


def _is_oom(exc) -> bool:
    return "out of memory" in str(exc).lower() or "resource_exhausted" in str(exc).lower()


def memory_worker(args) -> int:
    """--memory-worker: measure_memory of the one row the arguments name; print it as MEMORY_MARKER + JSON."""
    shape_name = args.shapes[0]
    try:
        res = measure_memory(args.shape_table[shape_name], args.tokens[0], args.policies[0], args)
    except Exception as exc:
        msg = " ".join(f"{type(exc).__name__}: {exc}".split())[:2000]
        res = {"memory_status": "oom" if _is_oom(exc) else "error", "memory_message": msg}
    print(MEMORY_MARKER + json.dumps(common._jsonable(res)), flush=True)
    return 0 if res["memory_status"] in ("ok", "cpu") else 1


def _worker_command(shape_name, shape, L, policy, args) -> list:
    me = __spec__.name if __spec__ is not None else None  # None when run as a script
    cmd = [sys.executable, "-m", me] if me and me != "__main__" else [sys.executable, os.path.abspath(__file__)]
    cmd += ["--memory-worker", "--device", args.device, "--shape", f"{shape_name}={','.join(map(str, shape))}",
            "--tokens", str(L), "--checkpoint", policy, "--seed", str(args.seed)]
    return cmd + (["--core-retain"] if args.core_retain else [])


def _worker_env() -> dict:
    """This environment, with this process's import path (so the worker imports the same blazecore, adapters and
    bench) and XLA's BFC allocator, not preallocating."""
    env = dict(os.environ)
    path = [os.path.abspath(p or os.curdir) for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in path if os.path.exists(p)))
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env["XLA_PYTHON_CLIENT_ALLOCATOR"] = WORKER_XLA_ALLOCATOR
    return env


def run_memory_worker(shape_name, shape, L, policy, args) -> dict:
    """measure_memory of one row in a fresh process (this script with --memory-worker): the worker's dict, or
    {"memory_status": "error" | "timeout", "memory_message": why} when it returned none."""
    cmd = _worker_command(shape_name, shape, L, policy, args)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.memory_timeout, env=_worker_env())
    except subprocess.TimeoutExpired:
        return {"memory_status": "timeout", "memory_message": f"the memory worker ran past {args.memory_timeout} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(MEMORY_MARKER):
            return json.loads(line[len(MEMORY_MARKER):])
    tail = " ".join((p.stderr or p.stdout or "").split())[-1500:]
    return {"memory_status": "error", "memory_message": f"the memory worker exited {p.returncode}: {tail}"}


def memory_figures(m: dict, max_peak_ratio: float) -> dict:
    """A worker's result as row fields: peaks, peaks beyond gradients, their ratio jax / core and its verdict."""
    row = dict.fromkeys(("core_peak_bytes", "core_grad_bytes", "jax_peak_bytes", "jax_grad_bytes"))
    row.update(m)
    core, jx = m.get("core_peak_bytes"), m.get("jax_peak_bytes")
    cg, jg = m.get("core_grad_bytes"), m.get("jax_grad_bytes")
    row["core_peak_beyond_grads_bytes"] = core - cg if core is not None and cg is not None else None
    row["jax_peak_beyond_grads_bytes"] = jx - jg if jx is not None and jg is not None else None
    cb, jb = row["core_peak_beyond_grads_bytes"], row["jax_peak_beyond_grads_bytes"]
    row["peak_ratio"] = jb / cb if cb and jb is not None else None
    row["peak_ok"] = row["peak_ratio"] <= max_peak_ratio if row["peak_ratio"] is not None else None
    bfc = m.get("jax_bfc_peak_bytes")
    row["bfc_peak_ratio"] = (bfc - jg) / cb if cb and bfc is not None and jg is not None else None  # not gated
    return row


# ------------------------------------------------------------------------------------------------
# One (shape, tokens, policy)
# ------------------------------------------------------------------------------------------------


def measure(core, jx, args):
    """Core and jax calls interleaved after warm-up (bench/_common.py's timer, wall clock up to a device
    synchronisation): medians, spreads and samples of both, and the ratio; on a GPU also the core's CUDA-event time."""

    def core_call():
        core()
        core.sync()

    def jax_call():
        jx.jax.block_until_ready(jx())

    t = common.time_calls({"core": core_call, "jax": jax_call}, warmup=args.warmup, repeats=args.repeats,
                          clock="wall")
    c, j = t["core"], t["jax"]
    event = (common.time_call(core, warmup=1, repeats=args.repeats, clock="cupy", stream=core.stream)
             if core.gpu else None)
    return {
        "core_ms": c.median_ms,
        "jax_ms": j.median_ms,
        "ratio": j.median_ms / c.median_ms,
        "core_event_ms": event.median_ms if event else None,
        "core_min_ms": c.min_ms,
        "jax_min_ms": j.min_ms,
        "core_spread_ms": c.spread_ms,
        "jax_spread_ms": j.spread_ms,
        "core_samples_ms": c.samples_ms,
        "jax_samples_ms": j.samples_ms,
        "core_event_samples_ms": event.samples_ms if event else [],
    }


def base_row(bc, shape_name, shape, L, policy, args) -> dict:
    d, h, E, K = shape
    gpu = args.device != "cpu"
    return {
        "shape": shape_name, "d": d, "h": h, "E": E, "K": K, "tokens": L, "checkpoint": policy,
        "dtype": "bfloat16", "activation": ACTIVATION, "routing": f"softmax-topk-renorm seed={args.seed}",
        "flops": bc.moe_flops(L, d, h, K, ACTIVATION), "repeats": args.repeats, "warmup": args.warmup,
        "core_retain": args.core_retain, "timed": not args.memory_only,
        "gated": gpu and not args.memory_only and L in args.gate_tokens, "max_ratio": args.max_ratio,
        "peak_gated": gpu and not args.no_memory, "max_peak_ratio": args.max_peak_ratio,
        "status": "pending" if not args.memory_only else "ok",
        # filled by the row's memory worker (None where it measured none: the CPU, --no-memory, a failure)
        "memory_status": "skipped" if args.no_memory else "pending",
        **dict.fromkeys(("core_peak_bytes", "core_grad_bytes", "core_peak_beyond_grads_bytes", "jax_peak_bytes",
                         "jax_grad_bytes", "jax_peak_beyond_grads_bytes", "peak_ratio", "peak_ok")),
    }


def run_case(bc, bj, jax, jdev, row, host, args):
    """Check and time one row (its memory figures come from its worker); updates and returns ``row``."""
    E, policy, flops = row["E"], row["checkpoint"], row["flops"]
    core_arrays, jax_arrays = to_core(host, args.device), to_jax(host, jdev)
    core = CoreRun(bc, core_arrays, E, policy, args.core_retain, args.device)
    jx = JaxRun(jax, bj, jax_arrays, E, policy)
    t0 = time.perf_counter()
    jax_out = jx()
    jax.block_until_ready(jax_out)
    row["jax_first_call_s"] = time.perf_counter() - t0  # trace + XLA compile + first run
    core_out = core()
    core.sync()
    cmp_ = compare(core_out, jax_out, args.device)
    del core_out, jax_out
    release_device_memory()  # the comparison's float32 copies
    row["check"] = cmp_
    row["check_ok"] = all(c["rel_err"] < CHECK_TOL for c in cmp_.values())
    row["identical"] = all(c["identical"] for c in cmp_.values())
    row.update(measure(core, jx, args))
    row["core_tflops"] = common.tflops(flops, row["core_ms"])
    row["jax_tflops"] = common.tflops(flops, row["jax_ms"])
    row["ratio_ok"] = row["ratio"] <= args.max_ratio
    row["status"] = "ok"
    return row


def _mib(key):
    return lambda r: None if r.get(key) is None else r[key] / common.MIB


TABLE = [
    ("shape", "shape", None),
    ("tokens", lambda r: common.format_count(r["tokens"]), None),
    ("ckpt", "checkpoint", None),
    ("core ms", "core_ms", ".3f"),
    ("core event ms", "core_event_ms", ".3f"),
    ("jax ms", "jax_ms", ".3f"),
    ("ratio", "ratio", ".3f"),
    ("jax TFLOP/s", "jax_tflops", ".1f"),
    ("core peak MiB", _mib("core_peak_bytes"), ".0f"),
    ("jax peak MiB", _mib("jax_peak_bytes"), ".0f"),
    ("core peak-grads MiB", _mib("core_peak_beyond_grads_bytes"), ".0f"),
    ("jax peak-grads MiB", _mib("jax_peak_beyond_grads_bytes"), ".0f"),
    ("peak ratio", "peak_ratio", ".3f"),
    ("BFC peak ratio", "bfc_peak_ratio", ".3f"),
    ("check", lambda r: None if r.get("check_ok") is None else
     ("identical" if r.get("identical") else ("ok" if r["check_ok"] else "FAIL")), None),
    ("verdict", lambda r: _verdict(r), None),
]


def _failures(r) -> list:
    """Why a row fails its checks or gates ([] when it passes or is not gated)."""
    if r.get("status") not in ("ok", "pending"):
        return [f"{r.get('status', '?')}: {' '.join(str(r.get('message', '')).split())[:80]}"]
    out = []
    if r.get("timed", True) and r.get("status") == "ok" and not r.get("check_ok"):
        out.append("outputs differ")
    if r.get("gated") and r.get("status") == "ok" and not r.get("ratio_ok"):
        out.append(f"ratio > {r['max_ratio']:.2f}")
    if r.get("peak_gated"):
        if r.get("memory_status") != "ok":
            why = " ".join(str(r.get("memory_message", "")).split())[:80]
            out.append(f"memory {r.get('memory_status', 'not measured')}{': ' + why if why else ''}")
        elif not r.get("peak_ok"):
            out.append(f"peak ratio > {r['max_peak_ratio']:.2f}")
    return out


def _verdict(r):
    fails = _failures(r)
    if r.get("status") not in ("ok", "pending"):
        return fails[0].upper()
    if fails:
        return f"FAIL ({'; '.join(fails)})"
    gates = [g for g, on in (("time", r.get("gated")), ("peak", r.get("peak_gated"))) if on]
    return f"pass ({', '.join(gates)})" if gates else "(not gated)"


def summary(rows, args) -> dict:
    """The run's verdict and its two gates, for the JSON."""
    failed = [r for r in rows if _failures(r)]
    timed = [r for r in rows if r.get("gated")]
    peaked = [r for r in rows if r.get("peak_gated")]
    ratios = [r["peak_ratio"] for r in peaked if r.get("peak_ratio") is not None]
    return {
        "verdict": "fail" if failed else "pass",
        "rows": len(rows),
        "failed_rows": [f"{r['shape']} {common.format_count(r['tokens'])} {r['checkpoint']}: {'; '.join(_failures(r))}"
                        for r in failed],
        "time_gate": {"max_ratio": args.max_ratio, "tokens": sorted(args.gate_tokens), "rows": len(timed),
                      "failed": sum(1 for r in timed if not r.get("ratio_ok"))},
        "peak_gate": {"max_peak_ratio": args.max_peak_ratio, "rows": len(peaked),
                      "failed": sum(1 for r in peaked if not r.get("peak_ok")),
                      "worst_peak_ratio": max(ratios) if ratios else None},
    }


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


def _csv(text):
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", default=None, help=f"comma list of {', '.join(SHAPES)} (default: olmoe)")
    ap.add_argument("--shape", action="append", default=[], metavar="NAME=d,h,E,K",
                    help="an extra shape (repeatable); with --shape and no --shapes only the extra shapes run")
    ap.add_argument("--tokens", default="8k,32k", help="comma list of token counts (default 8k,32k)")
    ap.add_argument("--gate-tokens", default="32k",
                    help="token counts whose ratio must be <= --max-ratio (default 32k; 'all' for every count)")
    ap.add_argument("--max-ratio", type=float, default=1.10, help="acceptance: jax time / core time (default 1.10)")
    ap.add_argument("--max-peak-ratio", type=float, default=1.05,
                    help="acceptance on every GPU row: jax / core peak memory beyond gradients (default 1.05)")
    ap.add_argument("--checkpoint", choices=("ab", "none", "both"), default="ab", help="checkpoint policy")
    ap.add_argument("--core-retain", action="store_true",
                    help="the core's backward keeps the saved pre-activations (retain=True), as the adapter's does")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls of each (median)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls of each before timing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--memory-only", action="store_true", help="only the peak memory of each row: no check, no timing")
    ap.add_argument("--no-memory", action="store_true", help="no peak memory (no worker processes): check and time")
    ap.add_argument("--memory-timeout", type=int, default=900, help="seconds one row's memory worker may run")
    ap.add_argument("--memory-worker", action="store_true",
                    help="measure the peak memory of the one row named (one shape, token count and policy) in\n"
                         "this process and print it as one line of JSON (what this script runs per row)")
    ap.add_argument("--name", default="jax", help="results file stem (default jax)")
    ap.add_argument("--results-dir", default=None, help="default bench/results")
    ap.add_argument("--no-json", action="store_true", help="print only")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: smoke-test this script's flow on the NumPy reference path (tiny --shape)")
    args = ap.parse_args(argv)
    args.shape_table = dict(SHAPES)
    extra = []
    for spec in args.shape:
        name, _, dims = spec.partition("=")
        try:
            d, h, E, K = (int(v) for v in dims.split(","))
        except ValueError:
            ap.error(f"--shape {spec!r}: expected NAME=d,h,E,K")
        if not (name and min(d, h, E, K) >= 1 and K <= E):
            ap.error(f"--shape {spec!r}: need a name, positive sizes and K <= E")
        args.shape_table[name] = (d, h, E, K)
        extra.append(name)
    if args.shapes is None:
        args.shapes = extra or ["olmoe"]
    else:
        args.shapes = _csv(args.shapes) + [n for n in extra if n not in args.shapes]
    unknown = [s for s in args.shapes if s not in args.shape_table]
    if unknown:
        ap.error(f"unknown shapes {unknown}; known: {list(args.shape_table)}")
    try:
        args.tokens = [common.parse_count(t) for t in _csv(args.tokens)]
        args.gate_tokens = (set(args.tokens) if args.gate_tokens.strip().lower() == "all"
                            else {common.parse_count(t) for t in _csv(args.gate_tokens)})
    except ValueError as exc:
        ap.error(f"bad token count: {exc}")
    if not args.tokens or min(args.tokens) < 1:
        ap.error("--tokens needs positive counts")
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be positive and --warmup not negative")
    if args.memory_only and args.no_memory:
        ap.error("--memory-only and --no-memory exclude each other")
    if args.memory_timeout < 1:
        ap.error("--memory-timeout must be positive")
    args.policies = ["ab", "none"] if args.checkpoint == "both" else [args.checkpoint]
    if args.memory_worker and (len(args.shapes) != 1 or len(args.tokens) != 1 or len(args.policies) != 1):
        ap.error("--memory-worker measures one row: one shape, one token count, --checkpoint ab or none")
    return args


def _memory_line(r) -> str:
    if r.get("memory_status") not in ("ok", "cpu"):
        return f"memory {r.get('memory_status')}: {' '.join(str(r.get('memory_message', '')).split())[:300]}"
    if r.get("peak_ratio") is None:
        return "memory: no figures on the CPU (the worker ran both)"
    return (f"peak beyond gradients: core {r['core_peak_beyond_grads_bytes'] / common.MIB:.0f} MiB, jax "
            f"{r['jax_peak_beyond_grads_bytes'] / common.MIB:.0f} MiB, ratio {r['peak_ratio']:.3f} "
            f"({'pass' if r['peak_ok'] else 'FAIL'} at {r['max_peak_ratio']:.2f})")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.memory_worker:
        return memory_worker(args)
    jax, jdev, why = jax_gpu(args.device)
    if jax is None:
        print(f"bench_jax: nothing measured: {why}", flush=True)
        return 0
    if args.device == "cuda":
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() < 1:
                raise RuntimeError("no CUDA device")
        except Exception as exc:
            print(f"bench_jax: nothing measured: CuPy sees no GPU ({type(exc).__name__}: {exc})", flush=True)
            return 0
    import blazecore_jax as bj

    import blazecore as bc

    header = header_for(args.device, jdev)
    header["memory_worker_xla_allocator"] = None if args.no_memory else WORKER_XLA_ALLOCATOR
    print_header(header)
    rows = [base_row(bc, s, args.shape_table[s], L, policy, args)
            for s in args.shapes for L in args.tokens for policy in args.policies]

    def save():
        if args.no_json:
            return None
        return common.write_json(args.name, header, rows, args.results_dir, summary=summary(rows, args))

    if not args.no_memory:
        # every worker before any timing here: this process then holds no buffers (XLA's allocator would keep
        # what the timing grew it to) that a worker's row would have to fit beside
        print("\n## peak memory (one process per row)", flush=True)
        for row in rows:
            shape = args.shape_table[row["shape"]]
            t0 = time.perf_counter()
            m = run_memory_worker(row["shape"], shape, row["tokens"], row["checkpoint"], args)
            row.update(memory_figures(m, args.max_peak_ratio))
            row["memory_worker_s"] = time.perf_counter() - t0
            print(f"  {row['shape']} {common.format_count(row['tokens'])} {row['checkpoint']}: {_memory_line(row)} "
                  f"[{row['memory_worker_s']:.0f} s]", flush=True)
            save()

    if not args.memory_only:
        for shape_name in args.shapes:
            d, h, E, K = args.shape_table[shape_name]
            print(f"\n## {shape_name}: d={d} h={h} E={E} K={K}, bf16, {ACTIVATION}", flush=True)
            for L in args.tokens:
                host = host_inputs(d, h, E, K, L, args.seed)
                for row in (r for r in rows if r["shape"] == shape_name and r["tokens"] == L):
                    try:
                        run_case(bc, bj, jax, jdev, row, host, args)
                    except Exception as exc:
                        msg = " ".join(f"{type(exc).__name__}: {exc}".split())
                        row.update(status="error", message=msg[:2000])
                        print(f"  {common.format_count(L)} {row['checkpoint']}: ERROR {msg[:500]}", flush=True)
                    release_device_memory()  # this row's CuPy blocks, before the next row's
                    common.print_table([row], TABLE)
                    save()
                del host
                release_device_memory()

    print("\n## all rows")
    common.print_table(rows, TABLE)
    path = save()
    if path is not None:
        print(f"\nwrote {path}")
    summ = summary(rows, args)
    if summ["verdict"] != "pass":
        print(f"\nbench_jax: FAILED: {len(summ['failed_rows'])} of {len(rows)} rows (see the verdict column)",
              flush=True)
        return 1
    gates = []
    if not args.memory_only:
        gates.append(f"ratio <= {args.max_ratio:.2f} at "
                     f"{', '.join(common.format_count(t) for t in sorted(args.gate_tokens))} tokens")
    if summ["peak_gate"]["rows"]:
        gates.append(f"peak beyond gradients <= {args.max_peak_ratio:.2f} x core on {summ['peak_gate']['rows']} rows")
    print(f"\nbench_jax: pass ({len(rows)} rows; {'; '.join(gates) or 'nothing gated'})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
