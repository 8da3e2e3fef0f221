"""JAX adapter of blazecore: ``jax.custom_vjp`` ops over ``jax.experimental.buffer_callback`` and the
functional ``moe_layer``.

Importing this package imports jax; ``import blazecore`` alone never does.
"""

from .layer import init_moe_params, moe_layer
from .ops import (
    JaxDispatch,
    MoEGrads,
    build_dispatch,
    load_balancing_loss,
    moe_backward,
    moe_ffn,
    moe_forward,
    route_topk,
    router_z_loss,
)

__all__ = [
    "JaxDispatch",
    "MoEGrads",
    "build_dispatch",
    "init_moe_params",
    "load_balancing_loss",
    "moe_backward",
    "moe_ffn",
    "moe_forward",
    "moe_layer",
    "route_topk",
    "router_z_loss",
]
