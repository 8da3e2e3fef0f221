"""A transformers experts backend named "blazecore".

Importing this module registers :func:`blazecore_experts_forward` with transformers' ``ExpertsInterface``
under the name ``"blazecore"``, so an HF MoE model whose experts class carries transformers'
``@use_experts_implementation`` (Mixtral, Qwen3-MoE, OLMoE, ...) runs its experts on blazecore's ops:

    import blazecore_torch.hf  # registers "blazecore"
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="blazecore")
    # or, on a built model:  model.set_experts_implementation("blazecore")

The HF router stays as it is (it picks the top-k experts and their weights); the backend replaces the
experts' forward: ``gate_up_proj`` (E, 2h, d) and ``down_proj`` (E, d, h) are blazecore's w13 and w2 as
they are, the routing weights become the float32 gates (float64 for a float64 model on the CPU), and the
layer's activation is read from ``config.hidden_act``.

Supported experts: concatenated [gate; up] rows (not interleaved), not transposed, the default gate
(act(gate) * up), optional biases, no post-expert norm, no expert parallelism. Anything else raises
NotImplementedError naming the feature rather than computing something different. The checkpoint policy
is ``config.blazecore_checkpoint`` when set ("ab" by default).
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import ExpertsInterface, _default_apply_gate

from . import ops

__all__ = ["BACKEND_NAME", "blazecore_experts_forward", "experts_activation", "register"]

BACKEND_NAME = "blazecore"

# config.hidden_act -> blazecore activation, for experts with a gate (act(gate) * up) and without
_GATED_ACTS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu",
               "gelu_fast": "geglu"}
_PLAIN_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu",
               "gelu_fast": "gelu", "relu2": "relu2"}


def experts_activation(experts: torch.nn.Module) -> str:
    """The blazecore activation name of an HF experts module (raises NotImplementedError if it has none)."""
    act = getattr(experts.config, "hidden_act", None)
    table = _GATED_ACTS if experts.has_gate else _PLAIN_ACTS
    if act not in table:
        kind = "gated" if experts.has_gate else "non-gated"
        raise NotImplementedError(f"blazecore experts: hidden_act {act!r} has no blazecore equivalent for {kind} "
                                  f"experts (supported: {sorted(table)})")
    return table[act]


def _check_supported(experts: torch.nn.Module) -> None:
    # flags a transformers release may not set (the post-expert norm and expert parallelism are newer than
    # 5.17): a missing one means the experts do not use that feature
    flag = lambda name, default=False: getattr(experts, name, default)  # noqa: E731
    unsupported = {
        "transposed expert weights": flag("is_transposed"),
        "interleaved gate/up rows": not flag("is_concatenated", True),
        "a post-expert norm": flag("has_post_expert_norm"),
        "expert parallelism": flag("_is_expert_parallel"),
        "a custom gate function": experts.has_gate and type(experts)._apply_gate is not _default_apply_gate,
    }
    found = [what for what, present in unsupported.items() if present]
    if found:
        raise NotImplementedError(f"blazecore experts backend: {type(experts).__name__} uses {', '.join(found)}, "
                                  "which the backend does not implement")


def blazecore_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' forward on blazecore (the signature transformers' ExpertsInterface calls).

    Args:
        self: the HF experts module (``gate_up_proj`` (E, 2h, d) or ``up_proj`` (E, h, d), ``down_proj``
            (E, d, h), optional ``*_bias``).
        hidden_states: (N, d) tokens.
        top_k_index: (N, K) integer expert ids from the HF router.
        top_k_weights: (N, K) routing weights (any float dtype; used as float32 gates).

    Returns:
        (N, d) in hidden_states' dtype.
    """
    _check_supported(self)
    activation = experts_activation(self)
    w13 = self.gate_up_proj if self.has_gate else self.up_proj
    b13 = b2 = None
    if self.has_bias:
        b13 = self.gate_up_proj_bias if self.has_gate else self.up_proj_bias
        b2 = self.down_proj_bias
    gate_dtype = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
    checkpoint = getattr(self.config, "blazecore_checkpoint", "ab")
    # the HF router's top-k ids are in range and distinct: no validation read (it would sync a CUDA stream)
    dispatch = ops.build_dispatch(top_k_index, w13.shape[0], validate=False)
    return ops.moe_ffn(hidden_states, w13, self.down_proj, top_k_weights.to(gate_dtype), top_k_index,
                       activation=activation, checkpoint=checkpoint, b13=b13, b2=b2, dispatch=dispatch)


def register() -> None:
    """Register the backend (idempotent; done on import)."""
    ExpertsInterface.register(BACKEND_NAME, blazecore_experts_forward)


register()
