"""``MoE``: a Flax NNX module over :func:`blazecore_jax.moe_layer` (needs flax >= 0.11).

``import blazecore_jax`` never imports flax; this module does (``from blazecore_jax.nnx import MoE``, or the
attribute ``blazecore_jax.nnx`` once flax is installed).

The module holds the parameters of :func:`blazecore_jax.moe_layer` as ``nnx.Param`` variables with the same
names and layouts (transformers' fused-experts layout, like ``blazecore_torch.MoELayer``):

    router             (E, d)        logits = x @ router^T
    gate_up_proj       (E, 2h, d)    rows [0, h) the gate projection, [h, 2h) the up projection
                                     ((E, h, d) for non-gated activations; (E, d, 2h) with weight_layout="in_out")
    down_proj          (E, d, h)     ((E, h, d) with weight_layout="in_out")
    gate_up_proj_bias  (E, 2h)       with bias=True
    down_proj_bias     (E, d)        with bias=True

and, with ``expert_bias=True``, an ``ExpertBias`` variable (E,) float32 that selects experts without being
trained (aux-loss-free balancing): ``nnx.grad`` and ``nnx.Optimizer(..., wrt=nnx.Param)`` leave it alone, and
:meth:`MoE.update_expert_bias` moves it.
"""

from __future__ import annotations

try:
    from flax import nnx as _nnx
except ImportError as e:  # flax is optional: only this module needs it
    raise ImportError("blazecore_jax.nnx needs flax (pip install 'flax>=0.11')") from e

import jax.numpy as jnp

import blazecore

from .layer import init_moe_params, moe_layer

__all__ = ["ExpertBias", "MoE"]


class ExpertBias(_nnx.Variable):
    """The (E,) float32 selection-only bias of :class:`MoE` (not an ``nnx.Param``: no gradient, not trained)."""


class MoE(_nnx.Module):
    """Mixture-of-Experts feed-forward layer: router -> top-k -> expert FFNs -> gate-weighted combine.

    Args:
        hidden_size: d.
        intermediate_size: h, each expert's hidden width.
        num_experts: E.
        top_k: K experts per token, 1 <= K <= E.
        activation: one of ``blazecore.ACTIVATIONS`` ("swiglu" default).
        checkpoint: "ab" (keep the (L*K, R) pre-activations for the backward) or "none" (recompute them).
        score: router score, "softmax" or "sigmoid".
        renormalize: divide the K selected scores by their sum.
        expert_bias: keep an :class:`ExpertBias` (E,) float32 variable added to the scores for selection only.
        chunks, memory_budget: token chunking of the expert FFNs, as :func:`blazecore_jax.moe_layer`.
        weight_layout: "out_in" (default) or "in_out", as :func:`blazecore_jax.moe_layer` takes it.
        bias: give the experts trained biases (``gate_up_proj_bias``, ``down_proj_bias``).
        dtype: of the parameters (float32, float16 or bfloat16); inputs must have it too.
        rngs: ``nnx.Rngs``; the ``params`` stream initialises the weights (uniform(+-1/sqrt(fan_in)), as
            :func:`blazecore_jax.init_moe_params`).

    ``__call__(x)`` takes x (..., d) and returns ``(y, aux)`` like :func:`blazecore_jax.moe_layer`: y with x's
    shape and dtype; aux with ``load_balancing_loss`` and ``z_loss`` (0-d float32, differentiable through the
    router), ``router_logits`` (L, E) and ``tokens_per_expert`` (E,) int32.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 activation: str = "swiglu", checkpoint: str = "ab", score: str = "softmax", renormalize: bool = True,
                 expert_bias: bool = False, chunks=1, memory_budget=None, weight_layout: str = "out_in",
                 bias: bool = False, dtype=jnp.float32, rngs: _nnx.Rngs):
        blazecore.activation_info(activation)  # raises ValueError for an unknown name
        if checkpoint not in blazecore.CHECKPOINTS:
            raise ValueError(f"unknown checkpoint policy {checkpoint!r} (expected one of "
                             f"{', '.join(blazecore.CHECKPOINTS)})")
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"score must be 'softmax' or 'sigmoid', got {score!r}")
        if not 1 <= int(top_k) <= int(num_experts):
            raise ValueError(f"top_k = {top_k} must be in [1, num_experts = {num_experts}]")
        self.hidden_size, self.intermediate_size = int(hidden_size), int(intermediate_size)
        self.num_experts, self.top_k = int(num_experts), int(top_k)
        self.activation, self.checkpoint, self.score, self.renormalize = activation, checkpoint, score, renormalize
        self.chunks, self.memory_budget = chunks, memory_budget
        self.weight_layout = weight_layout
        p = init_moe_params(rngs.params(), hidden_size, intermediate_size, num_experts, activation=activation,
                            dtype=dtype, weight_layout=weight_layout, bias=bias)
        self.router = _nnx.Param(p["router"])
        self.gate_up_proj = _nnx.Param(p["gate_up_proj"])
        self.down_proj = _nnx.Param(p["down_proj"])
        self.gate_up_proj_bias = _nnx.Param(p["gate_up_proj_bias"]) if bias else None
        self.down_proj_bias = _nnx.Param(p["down_proj_bias"]) if bias else None
        self.expert_bias = ExpertBias(jnp.zeros((self.num_experts,), jnp.float32)) if expert_bias else None

    def param_dict(self) -> dict:
        """The parameters as the dict :func:`blazecore_jax.moe_layer` takes (arrays, not variables)."""
        p = {"router": self.router[...], "gate_up_proj": self.gate_up_proj[...], "down_proj": self.down_proj[...]}
        if self.gate_up_proj_bias is not None:
            p["gate_up_proj_bias"] = self.gate_up_proj_bias[...]
            p["down_proj_bias"] = self.down_proj_bias[...]
        return p

    def __call__(self, x):
        bias = None if self.expert_bias is None else self.expert_bias[...]
        return moe_layer(self.param_dict(), x, top_k=self.top_k, activation=self.activation, checkpoint=self.checkpoint,
                         score=self.score, renormalize=self.renormalize, expert_bias=bias, chunks=self.chunks,
                         memory_budget=self.memory_budget, weight_layout=self.weight_layout)

    def update_expert_bias(self, tokens_per_expert, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing step: bias_e += rate * sign(mean_count - count_e).

        ``tokens_per_expert`` is (E,) from ``aux``; raises RuntimeError for a module built without expert_bias.
        """
        if self.expert_bias is None:
            raise RuntimeError("this MoE was built without expert_bias=True")
        counts = jnp.asarray(tokens_per_expert, jnp.float32)
        new = self.expert_bias[...] + rate * jnp.sign(counts.mean() - counts)
        if hasattr(self.expert_bias, "set_value"):
            self.expert_bias.set_value(new)
        else:  # flax < 0.12
            self.expert_bias.value = new
