"""Array intake and output allocation.

Every public op takes any DLPack array (``__dlpack__`` / ``__dlpack_device__``): NumPy, CuPy,
PyTorch, JAX, ... CUDA arrays become zero-copy CuPy views and run the kernels; CPU arrays become
zero-copy NumPy views and run the NumPy reference.

bfloat16: CuPy has no bfloat16 dtype, so on the GPU a bf16 array is held as a ``cupy.uint16`` view of
the same bits (no op of blazecore takes real uint16 data, so the storage dtype names the logical one).
On the CPU, bf16 is ``ml_dtypes.bfloat16``. Use :func:`logical_dtype` to read an array's dtype.

Outputs come from a pluggable allocator (``set_allocator``) so a framework can own the memory: the
op returns whatever the allocator returned, and the kernel writes through a CuPy view of it.
"""

from __future__ import annotations

import contextlib
import ctypes
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

    Raises TypeError for objects that are not arrays and ValueError for unsupported devices.
    """
    if isinstance(obj, np.ndarray):
        return obj
    mod = type(obj).__module__.split(".")[0]
    if mod == "cupy":
        return obj
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


def dtype_name(dtype) -> str:
    dtype = np.dtype(dtype)
    return "bfloat16" if dtype == BF16 else dtype.name


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
    current device; its contents may be uninitialised.
    """
    global _allocator
    _allocator = fn


@contextlib.contextmanager
def allocator(fn: Allocator | None):
    """Context manager form of :func:`set_allocator`."""
    global _allocator
    prev, _allocator = _allocator, fn
    try:
        yield
    finally:
        _allocator = prev


@dataclass
class Out:
    """An output buffer: ``user`` is what the op returns, ``view`` is what the kernel writes."""

    user: Any
    view: Any


def empty_gpu(shape, dtype) -> Out:
    shape = tuple(int(s) for s in shape)
    if _allocator is None:
        v = _poison(_cupy().empty(shape, dtype=storage_dtype(dtype, True)))
        return Out(v, v)
    user = _allocator(shape, dtype_name(dtype))
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
    """A cupy Stream for ``stream`` (cupy Stream, raw handle int, or None for cupy's current)."""
    cp = _cupy()
    if stream is None:
        return cp.cuda.get_current_stream()
    if isinstance(stream, int):
        return cp.cuda.ExternalStream(stream)
    return stream
