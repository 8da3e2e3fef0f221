"""blazecore: memory-efficient Mixture-of-Experts training kernels.

Core ops take any DLPack array; CUDA arrays run CUDA kernels compiled at first use with NVRTC,
CPU arrays run the NumPy reference in ``blazecore.reference``. Importing does no work: no CUDA
context, no compilation, no torch or jax import.

The router lives in the module ``blazecore.route_topk`` (``blazecore.route_topk.route_topk(...)``);
its other functions are also exported here.
"""

from . import _moe_gpu, dispatch, memory, moe, route_topk  # noqa: F401  (op modules register their kernels)
from ._array import BF16, allocator, asarray, logical_dtype, set_allocator
from ._compile import CompileError
from .dispatch import Dispatch, build_dispatch
from .memory import ChunkPlan, MemoryEstimate, moe_memory, plan_chunks
from .moe import (
    ACTIVATIONS,
    BLOCK_TOKENS,
    CHECKPOINTS,
    MoEGrads,
    MoESaved,
    activation_info,
    chunk_bounds,
    moe_backward,
    moe_flops,
    moe_forward,
)
from .route_topk import (
    load_balancing_loss,
    load_balancing_loss_backward,
    route_topk_backward,
    router_z_loss,
    router_z_loss_backward,
)

__version__ = "0.1.0"

__all__ = [
    "ACTIVATIONS",
    "BF16",
    "BLOCK_TOKENS",
    "CHECKPOINTS",
    "ChunkPlan",
    "CompileError",
    "Dispatch",
    "MemoryEstimate",
    "MoEGrads",
    "MoESaved",
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
    "set_allocator",
]
