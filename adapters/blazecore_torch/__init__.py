"""PyTorch adapter of blazecore: custom ops (``torch.ops.blazecore.*``) and the ``MoELayer`` module.

Importing this package imports torch and registers the ops; ``import blazecore`` alone never does.
"""

from .layer import MoELayer
from .ops import TorchDispatch, build_dispatch, load_balancing_loss, moe_ffn, route_topk, router_z_loss

__all__ = [
    "MoELayer",
    "TorchDispatch",
    "build_dispatch",
    "load_balancing_loss",
    "moe_ffn",
    "route_topk",
    "router_z_loss",
]
