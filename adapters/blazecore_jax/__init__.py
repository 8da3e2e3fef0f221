"""JAX adapter of blazecore: ``jax.custom_vjp`` ops over ``jax.experimental.buffer_callback`` and the
functional ``moe_layer``; with flax installed, the Flax NNX module ``blazecore_jax.nnx.MoE``.

Importing this package imports jax; ``import blazecore`` alone never does. flax is imported only when
``blazecore_jax.nnx`` is first used.
"""

import importlib

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


def __getattr__(name):
    # blazecore_jax.nnx on first use, so that importing the package never needs flax
    if name == "nnx":
        try:
            return importlib.import_module(f"{__name__}.nnx")
        except ImportError as e:
            raise AttributeError(f"blazecore_jax.nnx is unavailable: {e}") from e
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
