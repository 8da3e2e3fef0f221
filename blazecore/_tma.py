"""Tensor maps for the sm_90a kernels' TMA loads (``cuda/sm90_tma.cuh``), encoded on the host by the driver.

``cuTensorMapEncodeTiled`` (libcuda, through ctypes: CuPy's driver bindings do not expose it) fills a 128-byte
CUtensorMap; it is a pure host call (no device work, no synchronisation), so it is safe inside CUDA-graph capture.
The maps are cached per (address, shape, strides, box, dtype, swizzle) and travel to the kernel by value as a
``__grid_constant__`` parameter (a 128-byte NumPy structured scalar, which CuPy passes as raw bytes).
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict

import numpy as np

MAP_BYTES = 128
# a structured scalar CuPy passes by value: the kernel parameter's bytes
MAP_DTYPE = np.dtype([("opaque", "<u8", (MAP_BYTES // 8,))])

# CUtensorMapDataType / CUtensorMapSwizzle / CUtensorMapL2promotion (cuda.h)
_DATA_TYPES = {"uint16": 1, "float16": 6, "bfloat16": 9}
SWIZZLE_NONE, SWIZZLE_128B = 0, 3
_L2_PROMOTION_256B = 3

_lock = threading.Lock()
_cache: OrderedDict = OrderedDict()
_CACHE_SIZE = 1024
_encode = None


class TmaError(RuntimeError):
    pass


def _encoder():
    global _encode
    if _encode is None:
        from . import _compile

        fn = _compile.libcuda().cuTensorMapEncodeTiled
        u32, u64p, u32p = ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, u32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        _encode = fn
    return _encode


def null_map() -> np.void:
    """An all-zero map, for kernels launched without TMA (the parameter exists in every variant)."""
    return np.zeros((), MAP_DTYPE)[()]


def tiled_map(address: int, dtype: str, dims, strides_bytes, box, swizzle: int = SWIZZLE_128B) -> np.void:
    """The tensor map of a tiled view of 16-bit elements at ``address``.

    dims: element extents, innermost first (rank 1..5); strides_bytes: byte strides of dims[1:] (multiples of 16);
    box: the box extents in elements (each <= 256; with the 128-byte swizzle the inner box is at most 128 bytes).
    Elements outside ``dims`` read as zero. Raises TmaError if the driver rejects the description.
    """
    key = (address, dtype, tuple(dims), tuple(strides_bytes), tuple(box), swizzle)  # (NumPy integers hash as ints)
    with _lock:
        m = _cache.get(key)
        if m is not None:
            _cache.move_to_end(key)
            return m
    dims = tuple(int(v) for v in dims)
    strides_bytes = tuple(int(v) for v in strides_bytes)
    box = tuple(int(v) for v in box)
    rank = len(dims)
    if not (1 <= rank <= 5 and len(strides_bytes) == rank - 1 and len(box) == rank):
        raise TmaError(f"tensor map rank {rank}: dims {dims}, strides {strides_bytes}, box {box}")
    buf = np.zeros((), MAP_DTYPE)
    gdim = (ctypes.c_uint64 * rank)(*dims)
    gstr = (ctypes.c_uint64 * max(rank - 1, 1))(*(strides_bytes or (0,)))
    bdim = (ctypes.c_uint32 * rank)(*box)
    estr = (ctypes.c_uint32 * rank)(*([1] * rank))
    rc = _encoder()(buf.ctypes.data, _DATA_TYPES[dtype], rank, ctypes.c_void_p(int(address)), gdim, gstr, bdim, estr,
                    0, int(swizzle), _L2_PROMOTION_256B, 0)
    if rc != 0:
        raise TmaError(f"cuTensorMapEncodeTiled failed ({rc}): address {address:#x}, dims {dims}, "
                       f"strides {strides_bytes}, box {box}")
    m = buf[()]
    with _lock:
        _cache[key] = m
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return m
