"""An experts backend for torchtitan's MoE: blazecore's fused expert FFN in place of its grouped_mm experts.

torchtitan's ``RoutedExperts`` dispatches the tokens (locally, or with its own all-to-all under EP), hands
its ``inner_experts`` the routed rows grouped by local expert with the per-expert counts, and combines the
results. The backend replaces only that inner module, so torchtitan's router, token dispatchers, expert
parallelism, FSDP2 and checkpoints stay as they are:

    from blazecore_torch.titan import use_blazecore_experts
    model_config = use_blazecore_experts(model_config)     # before the model is built

The replaced module keeps ``GroupedExperts``' parameters (``w1_EFD``, ``w3_EFD`` (E, F, D), ``w2_EDF`` (E, D,
F)), so checkpoints, ``param_init`` and sharding configs apply unchanged. Its forward treats the R routed rows as
R tokens with K = 1 and gate 1 (torchtitan applies the router scores in its combine), builds the ids on the
device from the counts (no host read) and runs ``moe_ffn`` (gather, activation and down projection fused).
blazecore takes the gate and up projections as one (E, 2F, D) operand, so the forward concatenates w1 and w3
(a weight-sized transient per step, no activation-sized copy). Rows past the counts' total (padding) get the id
-1 (a dropped pair): no expert computes them and their outputs are 0. Works with torchtitan >= 0.3
(``torchtitan.models.common.moe``); importing this module imports torchtitan.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import GroupedExperts

from . import ops

__all__ = ["blazecore_experts_class", "use_blazecore_experts"]

_CLASSES: dict[type, type] = {}


def _local(p):
    return p.to_local() if isinstance(p, DTensor) else p


def blazecore_experts_class(parent_cls: type = GroupedExperts) -> type:
    """The blazecore subclass of a torchtitan experts class (``GroupedExperts`` or one with its parameters)."""
    if parent_cls in _CLASSES:
        return _CLASSES[parent_cls]

    class BlazecoreGroupedExperts(parent_cls):
        @dataclass(kw_only=True, slots=True)
        class Config(parent_cls.Config):
            checkpoint: str = "ab"
            chunks: int = 1

        def __init__(self, config):
            super().__init__(config)
            self.checkpoint, self.chunks = config.checkpoint, config.chunks

        def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
            """x_RD (R, D): routed rows grouped by local expert; num_tokens_per_expert_E (e,): rows per expert."""
            w1, w3, w2 = _local(self.w1_EFD), _local(self.w3_EFD), _local(self.w2_EDF)
            e = w1.shape[0]
            R = x_RD.shape[0]
            counts = num_tokens_per_expert_E.to(torch.int64)
            ends = torch.cumsum(counts, 0)
            rows = torch.arange(R, device=x_RD.device)
            # row r belongs to the first expert whose cumulative count exceeds r (no host read of the counts); a
            # padding row past the counts' total is a dropped pair (id -1): no expert computes it, its output is 0
            ids = torch.searchsorted(ends, rows, right=True).clamp_(max=e - 1)
            ids = torch.where(rows < ends[-1:], ids, -1).to(torch.int32).view(R, 1)
            gate_dtype = torch.float64 if w1.dtype == torch.float64 else torch.float32
            gates = torch.ones(R, 1, dtype=gate_dtype, device=x_RD.device)
            w13 = torch.cat([w1, w3], dim=1)  # (e, 2F, D) = [gate rows; up rows]
            dispatch = ops.build_dispatch(ids, e, validate=False)
            y = ops.moe_ffn(x_RD.to(w1.dtype), w13, w2, gates, ids, activation="swiglu",
                            checkpoint=self.checkpoint, dispatch=dispatch, chunks=self.chunks)
            return y.type_as(x_RD)

    BlazecoreGroupedExperts.__name__ = BlazecoreGroupedExperts.__qualname__ = f"Blazecore{parent_cls.__name__}"
    _CLASSES[parent_cls] = BlazecoreGroupedExperts
    return BlazecoreGroupedExperts


def use_blazecore_experts(model_config, *, checkpoint: str = "ab", chunks: int = 1):
    """Swap every ``GroupedExperts.Config`` in a torchtitan model config for the blazecore backend's; returns the
    config (the same object unless the root itself was an experts config)."""
    for _fqn, config, parent, attr in model_config.traverse(GroupedExperts.Config):
        cls = blazecore_experts_class(type(config)._owner)
        new = cls.Config(**{f.name: getattr(config, f.name) for f in fields(config)}, checkpoint=checkpoint,
                         chunks=chunks)
        if parent is None:
            model_config = new
        elif isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    return model_config
