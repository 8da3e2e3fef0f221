"""The expert GEMMs' argument structs (``cuda/moe_args.cuh``), mirrored as NumPy structured dtypes.

A launcher fills one struct per launch with :func:`pack` and passes it by value (CuPy passes a NumPy structured scalar
as its raw bytes); the C++ kernels read named fields. The dtypes use C alignment, so their offsets and size are the
C structs' (tests/test_kernel_config.py checks each against the header with ``static_assert``s).
"""

from __future__ import annotations

import struct

import numpy as np

_PTR, _I64, _I32 = "<u8", "<i8", "<i4"


def _struct(fields: list[tuple[str, str]]) -> np.dtype:
    return np.dtype(fields, align=True)


# MGroupedArgs<T>: the M-grouped GEMMs (gemm1, gemm2, dh', dx)
M_GROUPED = _struct(
    [(n, _PTR) for n in ("A", "B", "slot_token", "slot_k", "offsets", "tile_offsets", "out", "out2", "aux", "bias",
                         "gates", "part")]
    + [(n, _I64) for n in ("lda", "ldb", "b_estride", "ldo", "ldo2", "ldaux", "bias_estride", "up")]
    + [(n, _I32) for n in ("num_experts", "N", "Kd", "topk", "part_ld", "store_h", "store_z")]
)

# KGroupedArgs<T>: the K-grouped weight gradients (dw13, dw2)
K_GROUPED = _struct(
    [(n, _PTR) for n in ("A", "B", "slot_token", "offsets", "kblocks", "out", "carry", "carry_seen")]
    + [(n, _I64) for n in ("lda", "ldb", "ldo", "o_estride")]
    + [(n, _I32) for n in ("num_experts", "M", "N", "num_kblocks", "carry_in", "carry_out", "a_off32", "b_off32")]
)

STRUCTS = {"MGroupedArgs": M_GROUPED, "KGroupedArgs": K_GROUPED}


def _address(v) -> int:
    """A pointer field's value: 0 for None, an array's device address (0 for a dry run's placeholder), or an int."""
    if v is None:
        return 0
    try:
        return int(v.data.ptr)  # a CuPy array
    except AttributeError:
        pass
    if isinstance(v, (int, np.integer)):
        return int(v)
    if type(v).__name__ == "Placeholder":  # a dry run's array: nothing is launched
        return 0
    raise TypeError(f"a pointer field takes a device array, an address or None, not {type(v).__name__}")


_FORMATS = {np.dtype(_PTR): "Q", np.dtype(_I64): "q", np.dtype(_I32): "i"}
_packers: dict = {}


def _packer(dtype: np.dtype) -> tuple:
    """(field names, their set, which are pointers, a ``struct.Struct`` writing the fields at their offsets with C
    padding)."""
    p = _packers.get(dtype)
    if p is None:
        fmt, pos = "<", 0
        for name in dtype.names:
            ft, off = dtype.fields[name][:2]
            fmt += "x" * (off - pos) + _FORMATS[ft]
            pos = off + ft.itemsize
        fmt += "x" * (dtype.itemsize - pos)
        p = _packers[dtype] = (dtype.names, frozenset(dtype.names),
                               tuple(dtype.fields[n][0] == np.dtype(_PTR) for n in dtype.names), struct.Struct(fmt))
    return p


def pack(dtype: np.dtype, **fields) -> np.void:
    """One struct of ``dtype`` (M_GROUPED or K_GROUPED) with every field given by name: pointer fields take a device
    array, an address or None; the others integers (bools as 0 / 1). A missing or unknown field is a TypeError."""
    names, name_set, is_ptr, packer = _packer(dtype)
    if fields.keys() != name_set:
        missing, unknown = name_set - fields.keys(), fields.keys() - name_set
        raise TypeError(f"argument struct fields: missing {sorted(missing)}, unknown {sorted(unknown)}")
    vals = []
    for n, p in zip(names, is_ptr, strict=True):
        v = fields[n]
        vals.append((0 if v is None else v if type(v) is int else _address(v)) if p else int(v))
    try:
        raw = packer.pack(*vals)
    except struct.error as exc:
        raise OverflowError(f"argument struct field out of range: {exc}") from None
    return np.frombuffer(raw, dtype)[0]
