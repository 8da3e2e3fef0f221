"""Array intake and output allocation.

Every public op takes any DLPack array (``__dlpack__`` / ``__dlpack_device__``): NumPy, CuPy,
PyTorch, JAX, ... CUDA arrays become zero-copy CuPy views and run the kernels; CPU arrays become
zero-copy NumPy views and run the NumPy reference, whose results go back as the caller's array type
(:func:`like_caller`: torch tensors for torch inputs, JAX arrays for JAX inputs).

bfloat16: CuPy has no bfloat16 dtype, so on the GPU a bf16 array is held as a ``cupy.uint16`` view of
the same bits (no op of blazecore takes real uint16 data, so the storage dtype names the logical one).
On the CPU, bf16 is ``ml_dtypes.bfloat16``. Use :func:`logical_dtype` to read an array's dtype.

Outputs come from a pluggable allocator (``set_allocator``) so a framework can own the memory: the
op returns whatever the allocator returned, and the kernel writes through a CuPy view of it.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import math
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
_BF16_STORAGE = np.dtype(np.uint16)

# DLPack constants (dlpack.h)
_kDLCPU, _kDLCUDA, _kDLCUDAHost, _kDLCUDAManaged = 1, 2, 3, 13
_kDLUInt, _kDLBfloat = 1, 4


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_PyCapsule_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
_PyCapsule_GetPointer.restype = ctypes.c_void_p
_PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class _RetaggedCapsule:
    """Hands an (already retagged) legacy DLPack capsule to a consumer's ``from_dlpack``."""

    def __init__(self, capsule, device):
        self._capsule = capsule
        self._device = device

    def __dlpack__(self, *args, **kwargs):
        cap, self._capsule = self._capsule, None
        return cap

    def __dlpack_device__(self):
        return self._device


def _cupy():
    import cupy

    return cupy


def _retag_bf16_as_uint16(obj):
    """Export ``obj`` as a legacy capsule, relabelling bfloat16 as uint16 (same bits)."""
    cap = obj.__dlpack__()
    tensor = _DLTensor.from_address(_PyCapsule_GetPointer(cap, b"dltensor"))
    if tensor.dtype.code == _kDLBfloat and tensor.dtype.bits == 16 and tensor.dtype.lanes == 1:
        tensor.dtype.code = _kDLUInt
        return cap, True
    return cap, False


def asarray(obj: Any, name: str = "array"):
    """Zero-copy view of a DLPack array: ``cupy.ndarray`` for CUDA memory, ``numpy.ndarray`` for CPU.

    Raises TypeError for objects that are not arrays (a torch tensor that requires grad and a JAX tracer say
    what to pass instead) and ValueError for unsupported devices.
    """
    if isinstance(obj, (np.ndarray, Placeholder)):
        return obj
    mod = type(obj).__module__.split(".")[0]
    if mod == "cupy":
        return obj
    fast = _intake.get()
    if fast is not None:
        view = fast(obj)
        if view is not None:
            return view
    fw = framework(obj)
    if fw == "torch" and getattr(obj, "requires_grad", False):
        raise TypeError(f"{name}: a torch tensor that requires grad (DLPack cannot export it); pass {name}.detach(), "
                        f"or call blazecore_torch's ops for autograd")
    if fw == "jax" and "Tracer" in type(obj).__name__:
        raise TypeError(f"{name}: a JAX tracer (inside jit, grad or vmap) has no data to read; pass a concrete "
                        f"array, or call blazecore_jax's ops, which work under jit")
    if not hasattr(obj, "__dlpack_device__"):
        if isinstance(obj, (list, tuple, int, float)):
            return np.asarray(obj)
        raise TypeError(f"{name}: expected a DLPack array (numpy, cupy, torch, jax ...), got {type(obj).__name__}")
    dev_type, dev_id = obj.__dlpack_device__()
    dev_type = int(dev_type)
    if dev_type in (_kDLCPU, _kDLCUDAHost):
        try:
            return np.from_dlpack(obj)
        except (BufferError, TypeError, RuntimeError, ValueError):
            cap, was_bf16 = _retag_bf16_as_uint16(obj)
            arr = np.from_dlpack(_RetaggedCapsule(cap, (_kDLCPU, 0)))
            return arr.view(BF16) if was_bf16 else arr
    if dev_type in (_kDLCUDA, _kDLCUDAManaged):
        cp = _cupy()
        try:
            return cp.from_dlpack(obj)
        except (BufferError, TypeError, RuntimeError, ValueError):
            cap, _ = _retag_bf16_as_uint16(obj)
            return cp.from_dlpack(_RetaggedCapsule(cap, (dev_type, dev_id)))
    raise ValueError(f"{name}: unsupported DLPack device type {dev_type} (only CPU and CUDA arrays)")


def framework(obj) -> str | None:
    """"torch" or "jax" when ``obj`` is that framework's array (by its type's module: nothing is imported), else
    None."""
    mod = type(obj).__module__.split(".")[0]
    if mod == "torch":
        return "torch"
    if mod in ("jax", "jaxlib"):
        return "jax"
    return None


def like_caller(result, caller):
    """An op's result as the caller's array type: a NumPy result (the CPU path) becomes a torch tensor or a JAX
    array when ``caller`` (the array the caller passed first) is one, through DLPack (zero-copy where the
    framework allows; JAX copies what it cannot share). Anything else (CuPy, an ``out=`` buffer, None) is
    returned as it is. The framework is the caller's own, already imported: it is looked up, never imported."""
    if not isinstance(result, np.ndarray):
        return result
    fw = framework(caller)
    if fw == "torch":
        torch = sys.modules["torch"]
        if result.dtype == BF16:
            return torch.from_dlpack(result.view(np.uint16)).view(torch.bfloat16)
        return torch.from_dlpack(result)
    if fw == "jax":
        jnp = sys.modules["jax"].numpy
        try:
            return jnp.from_dlpack(result)
        except (BufferError, TypeError, RuntimeError, ValueError):
            return jnp.asarray(result)  # e.g. bfloat16, which NumPy's DLPack export does not describe
    return result


def is_gpu(arr) -> bool:
    return not isinstance(arr, np.ndarray)


def logical_dtype(arr) -> np.dtype:
    """The dtype an intake array stands for (GPU uint16 storage reads as bfloat16)."""
    dt = np.dtype(arr.dtype)
    if is_gpu(arr) and dt == _BF16_STORAGE:
        return BF16
    return dt


def storage_dtype(dtype, gpu: bool) -> np.dtype:
    dtype = np.dtype(dtype)
    return _BF16_STORAGE if (gpu and dtype == BF16) else dtype


_DTYPE_NAMES: dict = {}


def dtype_name(dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        dt = np.dtype(dtype)
        name = _DTYPE_NAMES[dtype] = "bfloat16" if dt == BF16 else dt.name
    return name


# ---------------------------------------------------------------------------------------------
# Allocation
# ---------------------------------------------------------------------------------------------

Allocator = Callable[[tuple, str], Any]
_allocator: Allocator | None = None
# Tests set this so an element a kernel forgot to write can never pass: floats become NaN,
# integers all-ones bytes (-1).
POISON = False


def _poison(view):
    if POISON:
        if np.dtype(view.dtype).kind == "f" or logical_dtype(view) == BF16:
            if logical_dtype(view) == BF16 and is_gpu(view):
                view.fill(0x7FC0)  # bf16 NaN bits
            else:
                view.fill(np.nan)
        else:
            view.fill(-1 if np.dtype(view.dtype).kind == "i" else np.iinfo(view.dtype).max)
    return view


def set_allocator(fn: Allocator | None) -> None:
    """Route every GPU output and workspace through ``fn(shape, dtype_name) -> DLPack CUDA array``.

    ``dtype_name`` is one of 'float32', 'float16', 'bfloat16', 'int32', 'int64', 'uint8'.
    ``None`` restores the default (CuPy's memory pool). The array must be C-contiguous and on the
    current device; its contents may be uninitialised. An adapter's allocator may carry a ``blazecore_view``
    attribute, ``(array) -> CuPy view or None``: a view it returns is used as is, without the checks (shape, dtype,
    contiguity) that the other results get.
    """
    global _allocator
    _allocator = _check_allocator(fn)


def _check_allocator(fn):
    if fn is not None and not callable(fn):
        raise TypeError(f"allocator: expected a callable (shape, dtype_name) -> array, or None; got "
                        f"{type(fn).__name__}")
    return fn


@contextlib.contextmanager
def allocator(fn: Allocator | None):
    """Context manager form of :func:`set_allocator`."""
    global _allocator
    prev, _allocator = _allocator, _check_allocator(fn)
    try:
        yield
    finally:
        _allocator = prev


# ---------------------------------------------------------------------------------------------
# Intake without DLPack (adapters)
# ---------------------------------------------------------------------------------------------

_intake: contextvars.ContextVar = contextvars.ContextVar("blazecore_intake", default=None)


@contextlib.contextmanager
def intake(fn: Callable[[Any], Any] | None):
    """Within the block, :func:`asarray` first offers each object that is not a NumPy or CuPy array to
    ``fn(obj)``, which returns a zero-copy ``cupy.ndarray`` (bf16 as its uint16 bits) or ``numpy.ndarray`` view
    of it, or None to fall back to DLPack.

    For adapters that already run the core on the framework's current stream: they can view their own arrays
    directly (pointer, shape, strides) and skip DLPack's per-array stream handshake (``__dlpack__(stream=)``
    queries and events), which costs tens of microseconds an array on the host.
    """
    if fn is not None and not callable(fn):
        raise TypeError(f"intake: expected a callable obj -> array or None, or None; got {type(fn).__name__}")
    token = _intake.set(fn)
    try:
        yield
    finally:
        _intake.reset(token)


@dataclass
class Out:
    """An output buffer: ``user`` is what the op returns, ``view`` is what the kernel writes."""

    user: Any
    view: Any


def empty_gpu(shape, dtype) -> Out:
    shape = tuple(int(s) for s in shape)
    run = _dry.get()
    if run is not None:
        v = run.empty(shape, dtype)
        return Out(v, v)
    if _allocator is None:
        v = _poison(_cupy().empty(shape, dtype=storage_dtype(dtype, True)))
        return Out(v, v)
    user = _allocator(shape, dtype_name(dtype))
    trusted = getattr(_allocator, "blazecore_view", None)
    if trusted is not None:  # an adapter's own allocator: its view of what it allocated is right by construction
        view = trusted(user)
        if view is not None:
            return Out(user, _poison(view))
    view = asarray(user, "allocator result")
    if tuple(view.shape) != shape or logical_dtype(view) != np.dtype(dtype) or not view.flags.c_contiguous:
        raise RuntimeError(
            f"allocator returned {tuple(view.shape)} {dtype_name(logical_dtype(view))}, "
            f"expected a C-contiguous {shape} {dtype_name(dtype)}"
        )
    return Out(user, _poison(view))


def out_or_empty(out, shape, dtype, gpu: bool, name: str) -> Out:
    """Validate a caller's ``out=`` buffer, or allocate one."""
    shape = tuple(int(s) for s in shape)
    if out is None:
        if gpu:
            return empty_gpu(shape, dtype)
        v = _poison(np.empty(shape, dtype=dtype))
        return Out(v, v)
    view = asarray(out, name)
    if is_gpu(view) != gpu:
        raise ValueError(f"{name}: on {'GPU' if is_gpu(view) else 'CPU'}, inputs are on {'GPU' if gpu else 'CPU'}")
    if tuple(view.shape) != shape:
        raise ValueError(f"{name}: shape {tuple(view.shape)}, expected {shape}")
    if logical_dtype(view) != np.dtype(dtype):
        raise TypeError(f"{name}: dtype {dtype_name(logical_dtype(view))}, expected {dtype_name(dtype)}")
    if not view.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")
    return Out(out, view)


def current_stream(stream=None):
    """A cupy Stream for ``stream`` (cupy Stream, raw handle int, or None for cupy's current); in a dry run a
    stand-in that launches nothing."""
    if _dry.get() is not None:
        return _DRY_STREAM
    cp = _cupy()
    if stream is None:
        return cp.cuda.get_current_stream()
    if isinstance(stream, int):
        return external_stream(stream)
    return stream


class _StreamHandle:
    """A raw CUDA stream handle offered through the CUDA stream protocol (``__cuda_stream__``)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = int(handle)

    def __cuda_stream__(self):
        return (0, self.handle)


def external_stream(handle: int, device: int | None = None):
    """A CuPy Stream for a stream another library owns (a raw ``cudaStream_t`` handle), which it leaves alone:
    ``cupy.cuda.Stream.from_external`` where CuPy has it (14 and later, which deprecate ``ExternalStream``), else
    ``cupy.cuda.ExternalStream`` (given ``device``). Where the handle is not the current device's, call it inside
    ``cupy.cuda.Device(device)`` (the adapters do): ``from_external`` takes the current device."""
    cp = _cupy()
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(handle))
    return cp.cuda.ExternalStream(int(handle)) if device is None else cp.cuda.ExternalStream(int(handle), device)


def stream_scope(stream=None, gpu: bool = True):
    """``with stream_scope(stream, gpu):`` makes ``stream`` (as :func:`current_stream` takes it) CuPy's current stream,
    so that the CuPy work of a call (its outputs' allocations, and their poison fills in tests) runs in order with the
    kernels the call launches there; nothing for a CPU call or in a dry run."""
    return current_stream(stream) if gpu else contextlib.nullcontext()


def device_scope(device_id: int):
    """``with device_scope(i):`` makes GPU i current (``cupy.cuda.Device``); in a dry run it does nothing."""
    if _dry.get() is not None:
        return contextlib.nullcontext()
    return _cupy().cuda.Device(device_id)


# ---------------------------------------------------------------------------------------------
# Dry runs: a GPU call's allocations, recorded, with no memory allocated and no kernel launched
# ---------------------------------------------------------------------------------------------


class _Flags:
    c_contiguous = True


class _Device:
    def __init__(self, device_id: int):
        self.id = device_id


class Placeholder:
    """What a dry run allocates instead of a GPU array: shape, storage dtype and nbytes, and views of it.

    A view (basic indexing, ``reshape``) keeps its base alive, as a CuPy view keeps its memory, so the base is
    released exactly where the real call would return its buffer to the pool. ``fill`` does nothing.
    """

    __slots__ = ("shape", "dtype", "base", "__weakref__")
    flags = _Flags()
    device = _Device(0)

    def __init__(self, shape, dtype, base: Placeholder | None = None):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.base = base

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def _root(self) -> Placeholder:
        return self if self.base is None else self.base

    def __getitem__(self, key) -> Placeholder:
        # the shape numpy gives the same index on a zero-stride array of this shape (no memory)
        shape = np.broadcast_to(np.uint8(0), self.shape)[key].shape
        return Placeholder(shape, self.dtype, self._root())

    def reshape(self, *shape) -> Placeholder:
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        shape = [int(s) for s in shape]
        if -1 in shape:
            rest = math.prod(s for s in shape if s != -1)
            shape[shape.index(-1)] = self.size // rest if rest else 0
        if math.prod(shape) != self.size:
            raise ValueError(f"cannot reshape {self.shape} into {tuple(shape)}")
        return Placeholder(shape, self.dtype, self._root())

    def fill(self, value) -> None:
        pass

    def __repr__(self) -> str:
        return f"Placeholder({self.shape}, {dtype_name(logical_dtype(self))})"


class _DryStream:
    """The stream of a dry run: a context manager that does nothing, with a null handle."""

    ptr = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_DRY_STREAM = _DryStream()


def no_launch(*args, **kwargs) -> None:
    """The kernel function of a dry run: launches nothing."""


class DryRun:
    """Records the allocations of GPU calls made under :func:`dry_run`.

    Each ``empty_gpu`` becomes a :class:`Placeholder` and an ``("alloc", bytes, shape, dtype)`` event, its release
    (when the placeholder and its views are gone) a ``("free", ...)`` event; bytes are rounded up to
    ``round_bytes`` as the caching allocators do (torch's and CuPy's pools: 512), 0 for an empty array. ``live``
    and ``peak`` follow the events. ``arch`` is the GPU the run stands for (it picks kernel variants and tiles).
    """

    def __init__(self, arch: str, round_bytes: int = 512):
        self.arch = arch
        self.round_bytes = int(round_bytes)
        self.live = 0
        self.peak = 0
        self.events: list[tuple] = []

    def rounded(self, nbytes: int) -> int:
        r = self.round_bytes
        return -(-int(nbytes) // r) * r if nbytes else 0

    def empty(self, shape, dtype) -> Placeholder:
        p = Placeholder(shape, storage_dtype(dtype, True))
        n = self.rounded(p.nbytes)
        self.events.append(("alloc", n, p.shape, dtype_name(dtype)))
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(p, self._free, n, p.shape, dtype_name(dtype))
        return p

    def _free(self, n: int, shape, dtype: str) -> None:
        self.events.append(("free", n, shape, dtype))
        self.live -= n


_dry: contextvars.ContextVar = contextvars.ContextVar("blazecore_dry_run", default=None)


@contextlib.contextmanager
def dry_run(arch: str, round_bytes: int = 512):
    """Run GPU calls without a GPU: every ``empty_gpu`` records into the yielded :class:`DryRun` and returns a
    placeholder, kernel functions launch nothing, streams and device scopes do nothing. Launchers read
    ``dry()`` where they would ask the device (its arch, shared-memory limits) or read results back."""
    run = DryRun(arch, round_bytes)
    token = _dry.set(run)
    try:
        yield run
    finally:
        _dry.reset(token)


def dry() -> DryRun | None:
    """The active :class:`DryRun`, or None."""
    return _dry.get()
