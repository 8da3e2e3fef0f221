"""``MoELayer``: a top-k router and fused experts on blazecore's ops.

Parameters are named and laid out like transformers' fused experts, so weights load from (and map to)
an HF MoE block without reshaping:

    router.weight       (E, d)        logits = x @ router.weight^T
    gate_up_proj        (E, 2h, d)    rows [0, h) the gate projection, [h, 2h) the up projection
                                      ((E, h, d) for non-gated activations; interleaved gate/up rows with an
                                      activation named "<gated>_interleaved")
    down_proj           (E, d, h)
    gate_up_proj_bias   (E, 2h)       with ``bias=True`` (gpt-oss's expert biases)
    down_proj_bias      (E, d)

which are blazecore's w13, w2, b13 and b2 as they are. With ``weight_layout="in_out"`` the two projections are
stored transposed, as gpt-oss and Llama 4 store them: gate_up_proj (E, d, 2h), down_proj (E, h, d).
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

import blazecore
from blazecore.layer import check_weight_layout, compose_moe_layer, resolve_plan

from . import ops

__all__ = ["MoELayer", "add_expert_parameters", "add_moe_parameters", "check_layer_options", "reset_expert_biases",
           "reset_expert_weights", "reset_moe_parameters"]


def check_layer_options(hidden_size, intermediate_size, num_experts, top_k, *, activation: str, score: str,
                        checkpoint: str, chunks, weight_layout: str) -> bool:
    """The constructor arguments of a MoE layer (``MoELayer``, ``ExpertParallelMoELayer``), each a ValueError
    naming it; returns whether the activation is gated."""
    gated = blazecore.activation_info(activation)
    check_weight_layout(weight_layout)
    if checkpoint not in (*blazecore.CHECKPOINTS, "auto"):
        raise ValueError(f"unknown checkpoint policy {checkpoint!r} (expected one of "
                         f"{(*blazecore.CHECKPOINTS, 'auto')})")
    if score not in ("softmax", "sigmoid"):
        raise ValueError(f"score must be 'softmax' or 'sigmoid', got {score!r}")
    for name, v in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                    ("num_experts", num_experts), ("top_k", top_k)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k = {top_k} must be in [1, num_experts = {num_experts}]")
    if not ((isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 1) or chunks == "auto"):
        raise ValueError(f"chunks must be an int >= 1 or \"auto\", got {chunks!r}")
    return gated


def add_expert_parameters(module: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int, rows: int,
                          *, weight_layout: str = "out_in", bias: bool = False, device=None, dtype=None) -> None:
    """The experts' parameters, uninitialised: ``gate_up_proj`` (E, rows, d) and ``down_proj`` (E, d, h)
    (``weight_layout="in_out"``: (E, d, rows) and (E, h, d)) and, with ``bias``, ``gate_up_proj_bias`` (E, rows) and
    ``down_proj_bias`` (E, d) (else both None); the layout is recorded as ``module.weight_layout``."""
    fk = {"device": device, "dtype": dtype}
    E, d, h = num_experts, hidden_size, intermediate_size
    t = check_weight_layout(weight_layout) == "in_out"
    module.weight_layout = weight_layout
    module.gate_up_proj = nn.Parameter(torch.empty((E, d, rows) if t else (E, rows, d), **fk))
    module.down_proj = nn.Parameter(torch.empty((E, h, d) if t else (E, d, h), **fk))
    if bias:
        module.gate_up_proj_bias = nn.Parameter(torch.empty(E, rows, **fk))
        module.down_proj_bias = nn.Parameter(torch.empty(E, d, **fk))
    else:
        module.gate_up_proj_bias = module.down_proj_bias = None


def add_moe_parameters(module: nn.Module, hidden_size: int, intermediate_size: int, num_experts: int, rows: int, *,
                       device=None, dtype=None, weight_layout: str = "out_in", bias: bool = False) -> None:
    """The parameters of a MoE layer (``MoELayer``, and any layer that wants the same state dict), initialised by
    :func:`reset_moe_parameters`: ``router`` (E, d) and the experts' (:func:`add_expert_parameters`)."""
    module.router = nn.Linear(hidden_size, num_experts, bias=False, device=device, dtype=dtype)
    add_expert_parameters(module, num_experts, hidden_size, intermediate_size, rows, weight_layout=weight_layout,
                          bias=bias, device=device, dtype=dtype)
    reset_moe_parameters(module)


def _fan_ins(module: nn.Module) -> tuple[int, int]:
    """(d, h): the fan-ins of the experts' two projections, whatever their layout."""
    i = 1 if getattr(module, "weight_layout", "out_in") == "in_out" else 2
    return module.gate_up_proj.shape[i], module.down_proj.shape[i]


@torch.no_grad()
def reset_expert_weights(module: nn.Module) -> None:
    """Each expert as an nn.Linear pair: uniform(+-1/sqrt(fan_in)), nn.Linear's default bound, drawn in the
    "out_in" shape and stored as the module holds it (transposed for "in_out"), so a seed gives the same weights
    in either layout."""
    t = getattr(module, "weight_layout", "out_in") == "in_out"
    for p, fan_in in zip((module.gate_up_proj, module.down_proj), _fan_ins(module), strict=True):
        w = torch.empty(p.shape[0], p.shape[2], p.shape[1], device=p.device, dtype=p.dtype) if t else p
        nn.init.uniform_(w, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
        if t:
            p.copy_(w.transpose(1, 2))


def reset_expert_biases(module: nn.Module) -> None:
    """The expert biases, if the module has them: nn.Linear's bias bound uniform(+-1/sqrt(fan_in))."""
    if getattr(module, "gate_up_proj_bias", None) is None:
        return
    for b, fan_in in zip((module.gate_up_proj_bias, module.down_proj_bias), _fan_ins(module), strict=True):
        nn.init.uniform_(b, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))


def reset_moe_parameters(module: nn.Module) -> None:
    """The experts' weights (:func:`reset_expert_weights`), then the router, then the expert biases. One order for
    every layer built by :func:`add_moe_parameters`, so the same seed gives the same weights, whatever the layout
    and with or without biases."""
    reset_expert_weights(module)
    module.router.reset_parameters()
    reset_expert_biases(module)


class MoELayer(nn.Module):
    """Mixture-of-Experts feed-forward layer: router -> top-k -> expert FFNs -> gate-weighted combine.

    Args:
        hidden_size: d.
        intermediate_size: h, each expert's hidden width.
        num_experts: E.
        top_k: K experts per token, 1 <= K <= E.
        activation: one of ``blazecore.ACTIVATIONS`` ("swiglu" default).
        score: router score, "softmax" or "sigmoid".
        renormalize: divide the K selected scores by their sum.
        expert_bias: keep an (E,) float32 buffer ``expert_bias`` added to the scores for selection only
            (aux-loss-free balancing); update it with :meth:`update_expert_bias`.
        checkpoint: "ab" (keep the (L*K, R) pre-activations for the backward), "none" (recompute them), or
            "auto" with ``chunks="auto"``: the planner's choice per call ("ab" if some chunk count fits with it,
            else "none"; "ab" wherever "auto" runs one chunk).
        chunks: token chunks of the expert FFNs (transient memory scales with L / chunks, results are
            bit-identical), or "auto": on a GPU, the smallest count whose predicted peak fits ``memory_budget``,
            planned per call from the token count for everything the call holds: the core's buffers
            (``blazecore.moe_memory``) and, beside them, the router logits, gates, ids and the incoming gradient
            (``blazecore.layer.layer_call_bytes``). Eager only; under torch.compile and on the CPU "auto" runs
            one chunk.
        memory_budget: for "auto": bytes, or a fraction of the free device memory (default 0.9).
        retain_saved: keep the saved pre-activations intact through the backward so that a second backward
            through the same graph works (``blazecore_torch.moe_ffn``'s option; off by default).
        weight_layout: "out_in" (default) or "in_out": how gate_up_proj and down_proj are stored (see the
            module's docstring); read as stored, their gradients in the same layout.
        bias: give the experts biases, ``gate_up_proj_bias`` (E, R) and ``down_proj_bias`` (E, d), trained with
            the weights (gpt-oss's experts have them).
        device, dtype: of the parameters.

    ``forward(x)`` takes x (..., d) and returns ``(y, aux)``: y with x's shape and dtype, and aux a dict with
    ``load_balancing_loss`` and ``z_loss`` (0-d float32, float64 for a float64 layer; differentiable through
    the router logits), ``router_logits`` (L, E) and ``tokens_per_expert`` (E,) int32 of this call.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 activation: str = "swiglu", score: str = "softmax", renormalize: bool = True,
                 expert_bias: bool = False, checkpoint: str = "ab", chunks=1, memory_budget=None,
                 retain_saved: bool = False, weight_layout: str = "out_in", bias: bool = False, device=None,
                 dtype=None):
        super().__init__()
        gated = check_layer_options(hidden_size, intermediate_size, num_experts, top_k, activation=activation,
                                    score=score, checkpoint=checkpoint, chunks=chunks, weight_layout=weight_layout)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.activation, self.score, self.renormalize, self.checkpoint = activation, score, renormalize, checkpoint
        self.chunks, self.memory_budget, self.retain_saved = chunks, memory_budget, bool(retain_saved)
        R = 2 * intermediate_size if gated else intermediate_size
        add_moe_parameters(self, hidden_size, intermediate_size, num_experts, R, device=device, dtype=dtype,
                           weight_layout=weight_layout, bias=bias)
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))
        else:
            self.expert_bias = None

    def reset_parameters(self) -> None:
        reset_moe_parameters(self)

    def extra_repr(self) -> str:
        return (f"d={self.hidden_size}, h={self.intermediate_size}, experts={self.num_experts}, top_k={self.top_k}, "
                f"activation={self.activation}, score={self.score}, checkpoint={self.checkpoint}, "
                f"expert_bias={self.expert_bias is not None}, chunks={self.chunks}, "
                f"weight_layout={self.weight_layout}, bias={self.gate_up_proj_bias is not None}")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: last dimension {x.shape[-1]}, expected hidden_size = {self.hidden_size}")
        if x.dtype != self.gate_up_proj.dtype:
            raise TypeError(f"x: dtype {x.dtype} differs from the layer's parameters ({self.gate_up_proj.dtype})")
        if x.device != self.gate_up_proj.device:
            raise ValueError(f"x is on {x.device}, the layer's parameters on {self.gate_up_proj.device}")
        shape = x.shape
        tokens = x.reshape(-1, self.hidden_size).contiguous()
        logits = self.router(tokens)
        chunks, checkpoint = resolve_plan(self.chunks, self.checkpoint, tokens.shape[0], self.hidden_size,
                                          self.intermediate_size, self.num_experts, self.top_k,
                                          dtype=str(x.dtype).removeprefix("torch."), activation=self.activation,
                                          budget=self.memory_budget, free_bytes=self._free_bytes(x),
                                          retain=self.retain_saved, bias=(self.gate_up_proj_bias is not None,) * 2,
                                          weight_layout=self.weight_layout)
        y, aux = compose_moe_layer(ops, tokens, logits, self.gate_up_proj, self.down_proj, top_k=self.top_k,
                                   num_experts=self.num_experts, score=self.score, renormalize=self.renormalize,
                                   expert_bias=self.expert_bias, activation=self.activation,
                                   checkpoint=checkpoint, chunks=chunks, retain_saved=self.retain_saved,
                                   b13=self.gate_up_proj_bias, b2=self.down_proj_bias,
                                   weight_layout=self.weight_layout)
        return y.reshape(shape), aux

    @staticmethod
    def _free_bytes(x: torch.Tensor):
        """A free-memory probe for the planner: torch's free device memory plus its cached unused blocks; None
        on the CPU or while compiling (no host query in a traced graph)."""
        if not x.is_cuda or torch.compiler.is_compiling():
            return None

        def free() -> int:
            f, _ = torch.cuda.mem_get_info(x.device)
            return int(f + torch.cuda.memory_reserved(x.device) - torch.cuda.memory_allocated(x.device))

        return free

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing step: raise the bias of under-loaded experts, lower it for over-loaded ones.

        bias_e += rate * sign(mean_count - count_e), with ``tokens_per_expert`` (E,) from ``aux``.
        """
        if self.expert_bias is None:
            raise RuntimeError("this MoELayer was built without expert_bias=True")
        counts = tokens_per_expert.to(self.expert_bias.device, torch.float32)
        self.expert_bias.add_(rate * torch.sign(counts.mean() - counts))
