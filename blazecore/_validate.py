"""Input checks shared by the launchers. Every check runs before any kernel is launched."""

from __future__ import annotations

import numpy as np

from ._array import BF16, dtype_name, is_gpu, logical_dtype

INT32_MAX = 2**31 - 1


def check_dtype(arr, name: str, allowed) -> np.dtype:
    dt = logical_dtype(arr)
    allowed = tuple(np.dtype(a) for a in allowed)
    if dt not in allowed:
        raise TypeError(f"{name}: dtype {dtype_name(dt)} not supported (expected one of "
                        f"{', '.join(dtype_name(a) for a in allowed)})")
    return dt


def check_integer(arr, name: str) -> np.dtype:
    dt = np.dtype(arr.dtype)
    if dt.kind not in "iu" or (is_gpu(arr) and dt == np.uint16):
        raise TypeError(f"{name}: expected an integer array (int32 or int64), got {dtype_name(logical_dtype(arr))}")
    return dt


def check_ndim(arr, name: str, ndim: int, what: str) -> None:
    if arr.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim}-D {what}, got shape {tuple(arr.shape)}")


def check_shape(arr, name: str, shape: tuple) -> None:
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(arr.shape)}")


def check_contiguous(arr, name: str) -> None:
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous (call .contiguous() / ascontiguousarray first)")


def check_array(arr, name: str, dtypes, shape: tuple) -> None:
    """dtype in ``dtypes``, exactly ``shape``, C-contiguous (an output buffer or an operand a kernel indexes)."""
    check_dtype(arr, name, dtypes)
    check_shape(arr, name, shape)
    check_contiguous(arr, name)


def check_aligned(arrays: dict, nbytes: int) -> None:
    """Each GPU array of ``{name: array or None}`` starts on an ``nbytes`` boundary (the kernels' 16-byte row copies
    and the tensor maps need it; a view that starts a few elements into a buffer does not), else ValueError naming
    it. Empty arrays are not read."""
    for name, a in arrays.items():
        if a is None or not is_gpu(a) or a.size == 0:
            continue
        off = int(a.data.ptr) % nbytes
        if off:
            raise ValueError(f"{name}: the GPU kernels need its data to start on a boundary of {nbytes} bytes; it "
                             f"starts {off} bytes past one (a view into a larger buffer?): pass a fresh copy")


def same_device(arrays: dict) -> bool:
    """True if all arrays are on the GPU (same device), False if all on the CPU; else ValueError."""
    kinds = {name: is_gpu(a) for name, a in arrays.items()}
    if len(set(kinds.values())) > 1:
        where = ", ".join(f"{n} on {'GPU' if g else 'CPU'}" for n, g in kinds.items())
        raise ValueError(f"inputs must all be on the same device: {where}")
    gpu = next(iter(kinds.values()))
    if gpu:
        devs = {n: a.device.id for n, a in arrays.items()}
        if len(set(devs.values())) > 1:
            raise ValueError(f"inputs must all be on the same GPU: {devs}")
    return gpu


def check_int32_range(n: int, what: str) -> None:
    if n > INT32_MAX:
        raise ValueError(f"{what} = {n} exceeds the int32 range these kernels index with (2**31 - 1)")


def count_nonfinite(arr) -> int:
    """Number of NaN / +-inf elements of a float array (numpy, or cupy with bf16 held as uint16).

    On the GPU this is one reduction on the current stream and one host read of its result, which
    synchronises the stream: callers run it only when asked (``check_finite=True``).
    """
    dt = logical_dtype(arr)
    if arr.size == 0:
        return 0
    if not is_gpu(arr):
        with np.errstate(invalid="ignore"):  # signalling NaNs warn in isfinite
            return int(arr.size - np.count_nonzero(np.isfinite(arr)))
    import cupy

    if dt == BF16:
        # bf16 bits: exponent field 0x7F80 all ones means inf (mantissa 0) or NaN
        return int(_bf16_nonfinite_count()(arr))
    if np.dtype(dt).kind != "f":
        raise TypeError(f"count_nonfinite: expected a float array, got {dtype_name(dt)}")
    return int(cupy.count_nonzero(~cupy.isfinite(arr)))


_bf16_kernel = None


def _bf16_nonfinite_count():
    global _bf16_kernel
    if _bf16_kernel is None:
        import cupy

        # decimal constants: CuPy rewrites parameter names inside the expressions (a hex literal could be hit)
        _bf16_kernel = cupy.ReductionKernel("uint16 bits", "int64 count", "(bits & 32640) == 32640 ? 1 : 0",
                                            "a + b", "count = a", "0", "blazecore_bf16_nonfinite")
    return _bf16_kernel


def check_finite(arr, name: str) -> None:
    """Raise FloatingPointError if ``arr`` (a float intake view) holds NaN or +-inf, naming it and the count."""
    n = count_nonfinite(arr)
    if n:
        raise FloatingPointError(f"{name}: {n} non-finite value{'s' if n != 1 else ''} (NaN or inf) "
                                 f"of {int(arr.size)}")


def check_finite_arrays(arrays: dict, stream=None) -> None:
    """:func:`check_finite` on each array of ``{name: array or None}`` (the GPU ones on ``stream``'s device and
    stream, one host read each), in order, before an op writes anything."""
    from ._array import current_stream

    for name, a in arrays.items():
        if a is None:
            continue
        if not is_gpu(a):
            check_finite(a, name)
            continue
        import cupy

        with cupy.cuda.Device(a.device.id), current_stream(stream):
            check_finite(a, name)
