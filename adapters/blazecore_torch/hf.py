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

Supported experts: the default gate (act(gate) * up) with a ``hidden_act`` blazecore has, or a gate function
the backend knows (:data:`KNOWN_GATES`: gpt-oss's clamped SwiGLU "swiglu_oai"); optional biases; no
post-expert norm, no expert parallelism. Weight layouts: (E, out, in) with [gate; up] rows, transposed
(E, in, out) weights (``is_transposed``: blazecore's ``weight_layout="in_out"``) and interleaved gate/up
columns (``is_concatenated=False``, gpt-oss: the activation's "_interleaved" form), all read as the parameters
are stored, with no copy per step (on the GPU the latter two run on the mma.sync kernels). Anything else raises
NotImplementedError naming the feature rather than computing something different.

The checkpoint policy is ``config.blazecore_checkpoint`` when set, else :data:`DEFAULT_CHECKPOINT` ("none"): in a
model's training step every MoE layer's saved tensors stay alive until its backward, so policy "ab"'s (L*K, 2h)
pre-activations add up over the layers, while "none" recomputes them with one more first GEMM per layer. Set
``config.blazecore_checkpoint = "ab"`` to keep them (faster, more memory).
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import ExpertsInterface, _default_apply_gate

from . import ops

__all__ = ["BACKEND_NAME", "DEFAULT_CHECKPOINT", "KNOWN_GATES", "blazecore_experts_forward", "experts_activation",
           "register", "unsupported"]

BACKEND_NAME = "blazecore"
DEFAULT_CHECKPOINT = "none"  # the policy when config.blazecore_checkpoint is not set (see the module docstring)

# config.hidden_act -> blazecore activation, for experts with a gate (act(gate) * up) and without
_GATED_ACTS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu",
               "gelu_fast": "geglu"}
_PLAIN_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu",
               "gelu_fast": "gelu", "relu2": "relu2"}

# Gate functions (``_apply_gate`` overrides, by qualified name) that compute a blazecore activation:
# name -> (blazecore activation or None for "the default gate's act from hidden_act", the experts' attributes
# holding (alpha, limit) that must equal blazecore's constants, or None).
KNOWN_GATES = {
    # (up.clamp(-limit, limit) + 1) * gate' * sigmoid(alpha * gate'), gate' = gate.clamp(max=limit)
    "GptOssExperts._apply_gate": ("swiglu_oai", ("alpha", "limit")),
    "OpenAIPrivacyFilterExperts._apply_gate": ("swiglu_oai", ("alpha", "limit")),
    "MiniMaxM3VLExperts._apply_gate": ("swiglu_oai", ("swiglu_alpha", "swiglu_limit")),
    # act(gate.float()) * up.float(), cast back: the default gate computed in fp32, as blazecore's epilogue does
    "BeamExperts._apply_gate": (None, None),
}
_OAI_CONSTANTS = (1.702, 7.0)  # blazecore.reference.moe.OAI_ALPHA, OAI_LIMIT


def _act_name(experts: torch.nn.Module):
    """The transformers activation name of the experts' ``act_fn`` (matched by type against ACT2FN's entries, or
    torch.nn.functional.silu), else the config's ``hidden_act``."""
    from transformers.activations import ACT2FN

    fn = getattr(experts, "act_fn", None)
    if fn is torch.nn.functional.silu:
        return "silu"
    if isinstance(fn, torch.nn.Module):
        for name in (*_GATED_ACTS, *_PLAIN_ACTS):
            try:
                if type(ACT2FN[name]) is type(fn):
                    return name
            except KeyError:
                continue
    return getattr(experts.config, "hidden_act", None)


def _hidden_act(experts: torch.nn.Module) -> str:
    act = _act_name(experts)
    table = _GATED_ACTS if experts.has_gate else _PLAIN_ACTS
    if act not in table:
        kind = "gated" if experts.has_gate else "non-gated"
        fn = getattr(experts, "act_fn", None)
        what = f"hidden_act {act!r}" if act is not None else f"the activation {type(fn).__name__}"
        raise NotImplementedError(f"blazecore experts backend: {what} has no blazecore equivalent for {kind} "
                                  f"experts (supported: {sorted(table)})")
    return table[act]


def experts_activation(experts: torch.nn.Module) -> str:
    """The blazecore activation name of an HF experts module (raises NotImplementedError if it has none)."""
    apply_gate = getattr(type(experts), "_apply_gate", _default_apply_gate)
    if not experts.has_gate or apply_gate is _default_apply_gate:
        return _hidden_act(experts)
    name = getattr(apply_gate, "__qualname__", repr(apply_gate))
    if name not in KNOWN_GATES:
        raise NotImplementedError(f"blazecore experts backend: the gate function {name} has no blazecore "
                                  "activation equivalent")
    activation, params = KNOWN_GATES[name]
    if activation is None:
        return _hidden_act(experts)
    if params is not None:
        got = tuple(float(getattr(experts, a)) for a in params)
        if got != _OAI_CONSTANTS:
            raise NotImplementedError(f"blazecore experts backend: {name} with ({params[0]}, {params[1]}) = {got}; "
                                      f"blazecore's {activation} has {_OAI_CONSTANTS}")
    return activation


def _flag(experts, name: str, default=False):
    # flags a transformers release may not set (the post-expert norm and expert parallelism are newer than
    # 5.17): a missing one means the experts do not use that feature
    return getattr(experts, name, default)


def unsupported(experts: torch.nn.Module, device: torch.device | None = None) -> list[str]:
    """What the backend lacks to run ``experts`` on ``device`` (default: where its weights are); [] if nothing."""
    device = device if device is not None else next(experts.parameters()).device
    found = []
    if _flag(experts, "has_post_expert_norm"):
        found.append("a post-expert norm")
    if _flag(experts, "_is_expert_parallel"):
        found.append("expert parallelism")
    try:
        experts_activation(experts)
    except NotImplementedError as e:
        found.append(str(e).removeprefix("blazecore experts backend: "))
    return found


def _check_supported(experts: torch.nn.Module, device: torch.device) -> None:
    found = unsupported(experts, device)
    if found:
        raise NotImplementedError(f"blazecore experts backend: {type(experts).__name__} needs what the backend "
                                  f"does not implement: {'; '.join(found)}")


def _weights(experts: torch.nn.Module):
    """(w13, w2, b13 or None, b2 or None, weight_layout): the parameters as stored, and blazecore's name for
    their layout ("in_out" for transposed (E, in, out) weights, else "out_in")."""
    w13 = experts.gate_up_proj if experts.has_gate else experts.up_proj
    w2 = experts.down_proj
    b13 = b2 = None
    if experts.has_bias:
        b13 = experts.gate_up_proj_bias if experts.has_gate else experts.up_proj_bias
        b2 = experts.down_proj_bias
    return w13, w2, b13, b2, "in_out" if _flag(experts, "is_transposed") else "out_in"


def blazecore_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' forward on blazecore (the signature transformers' ExpertsInterface calls).

    Args:
        self: the HF experts module (``gate_up_proj`` (E, 2h, d) or ``up_proj`` (E, h, d), ``down_proj``
            (E, d, h), or their transposes, optional ``*_bias``).
        hidden_states: (N, d) tokens.
        top_k_index: (N, K) integer expert ids from the HF router.
        top_k_weights: (N, K) routing weights (any float dtype; used as float32 gates).

    Returns:
        (N, d) in hidden_states' dtype.
    """
    _check_supported(self, hidden_states.device)
    activation = experts_activation(self)
    if self.has_gate and not _flag(self, "is_concatenated", True):
        activation += "_interleaved"  # rows [g0, u0, g1, u1, ...] (gpt-oss)
    w13, w2, b13, b2, layout = _weights(self)
    gate_dtype = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
    checkpoint = getattr(self.config, "blazecore_checkpoint", None) or DEFAULT_CHECKPOINT
    # the HF router's top-k ids are in range and distinct: no validation read (it would sync a CUDA stream)
    dispatch = ops.build_dispatch(top_k_index, w13.shape[0], validate=False)
    return ops.moe_ffn(hidden_states, w13, w2, top_k_weights.to(gate_dtype), top_k_index,
                       activation=activation, checkpoint=checkpoint, b13=b13, b2=b2, dispatch=dispatch,
                       weight_layout=layout)


def register() -> None:
    """Register the backend (idempotent; done on import)."""
    ExpertsInterface.register(BACKEND_NAME, blazecore_experts_forward)


register()
