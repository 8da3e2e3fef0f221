"""blazecore: memory-efficient Mixture-of-Experts training kernels.

Core ops take any DLPack array; CUDA arrays run CUDA kernels compiled at first use with NVRTC,
CPU arrays run the NumPy reference in ``blazecore.reference``. Importing does no work: no CUDA
context, no compilation, no torch or jax import.

``blazecore.route_topk`` is the router function; its module is ``blazecore.router`` (its NumPy reference
``blazecore.reference.router``). The modules' old names, ``blazecore.route_topk`` and
``blazecore.reference.route_topk``, stay importable (``from blazecore.route_topk import ...``) with a
DeprecationWarning until the next release.

``blazecore.testing`` holds the helpers that the project's tests and benchmarks share (routing generators,
the argsort dispatch oracle, the comparison helper); it is not imported here.
"""

import sys as _sys

from . import _deprecated, _moe_gpu, dispatch, memory, moe, router  # noqa: F401  (op modules register their kernels)
from ._array import BF16, allocator, asarray, logical_dtype, set_allocator
from ._compile import CompileError
from .dispatch import Dispatch, build_dispatch
from .memory import ChunkPlan, MemoryEstimate, moe_memory, plan_chunks
from .moe import (
    ACTIVATIONS,
    BLOCK_TOKENS,
    CHECKPOINTS,
    GEMM_PATHS,
    WEIGHT_LAYOUTS,
    MoEGrads,
    MoESaved,
    activation_info,
    chunk_bounds,
    moe_backward,
    moe_flops,
    moe_forward,
    sum_rows,
)
from .router import (
    load_balancing_loss,
    load_balancing_loss_backward,
    route_topk,
    route_topk_backward,
    router_z_loss,
    router_z_loss_backward,
)

__version__ = "0.1.0"

# the router modules' old names (deprecated): importable, with a warning; blazecore.route_topk stays the function
_deprecated.install(_sys.modules[__name__])

__all__ = [
    "ACTIVATIONS",
    "BF16",
    "BLOCK_TOKENS",
    "CHECKPOINTS",
    "ChunkPlan",
    "CompileError",
    "Dispatch",
    "GEMM_PATHS",
    "MemoryEstimate",
    "MoEGrads",
    "MoESaved",
    "WEIGHT_LAYOUTS",
    "activation_info",
    "allocator",
    "asarray",
    "build_dispatch",
    "chunk_bounds",
    "load_balancing_loss",
    "load_balancing_loss_backward",
    "logical_dtype",
    "moe_backward",
    "moe_flops",
    "moe_forward",
    "moe_memory",
    "plan_chunks",
    "route_topk",
    "route_topk_backward",
    "router_z_loss",
    "router_z_loss_backward",
    "sum_rows",
    "set_allocator",
]
