"""blazecore: memory-efficient Mixture-of-Experts training kernels.

Core ops take any DLPack array; CUDA arrays run CUDA kernels compiled at first use with NVRTC,
CPU arrays run the NumPy reference in ``blazecore.reference``. Importing does no work: no CUDA
context, no compilation, no torch or jax import.
"""

from . import _moe_gpu, dispatch, moe, route_topk  # noqa: F401  (op modules register their kernels)
from ._array import BF16, allocator, asarray, logical_dtype, set_allocator
from ._compile import CompileError

__version__ = "0.1.0"

__all__ = [
    "BF16",
    "CompileError",
    "allocator",
    "asarray",
    "logical_dtype",
    "set_allocator",
]
