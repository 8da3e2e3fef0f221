"""``MoELayer``: a top-k router and fused experts on blazecore's ops.

Parameters are named and laid out like transformers' fused experts, so weights load from (and map to)
an HF MoE block without reshaping:

    router.weight   (E, d)        logits = x @ router.weight^T
    gate_up_proj    (E, 2h, d)    rows [0, h) the gate projection, [h, 2h) the up projection
                                  ((E, h, d) for non-gated activations)
    down_proj       (E, d, h)

which are blazecore's w13 and w2 as they are.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

import blazecore
from blazecore.layer import compose_moe_layer, resolve_plan

from . import ops

__all__ = ["MoELayer", "add_moe_parameters", "reset_moe_parameters"]


def add_moe_parameters(module: nn.Module, hidden_size: int, intermediate_size: int, num_experts: int, rows: int, *,
                       device=None, dtype=None) -> None:
    """The parameters of a MoE layer (``MoELayer``, and any layer that wants the same state dict), initialised by
    :func:`reset_moe_parameters`: ``router`` (E, d), ``gate_up_proj`` (E, rows, d), ``down_proj`` (E, d, h)."""
    fk = {"device": device, "dtype": dtype}
    module.router = nn.Linear(hidden_size, num_experts, bias=False, **fk)
    module.gate_up_proj = nn.Parameter(torch.empty(num_experts, rows, hidden_size, **fk))
    module.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **fk))
    reset_moe_parameters(module)


def reset_moe_parameters(module: nn.Module) -> None:
    """Each expert as an nn.Linear pair: uniform(+-1/sqrt(fan_in)), nn.Linear's default bound; then the router.
    One order for every layer built by :func:`add_moe_parameters`, so the same seed gives the same weights."""
    d, h = module.gate_up_proj.shape[2], module.down_proj.shape[2]
    nn.init.uniform_(module.gate_up_proj, -1 / math.sqrt(d), 1 / math.sqrt(d))
    nn.init.uniform_(module.down_proj, -1 / math.sqrt(h), 1 / math.sqrt(h))
    module.router.reset_parameters()


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
        device, dtype: of the parameters.

    ``forward(x)`` takes x (..., d) and returns ``(y, aux)``: y with x's shape and dtype, and aux a dict with
    ``load_balancing_loss`` and ``z_loss`` (0-d float32, float64 for a float64 layer; differentiable through
    the router logits), ``router_logits`` (L, E) and ``tokens_per_expert`` (E,) int32 of this call.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 activation: str = "swiglu", score: str = "softmax", renormalize: bool = True,
                 expert_bias: bool = False, checkpoint: str = "ab", chunks=1, memory_budget=None,
                 retain_saved: bool = False, device=None, dtype=None):
        super().__init__()
        gated = blazecore.activation_info(activation)
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
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.activation, self.score, self.renormalize, self.checkpoint = activation, score, renormalize, checkpoint
        if not ((isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 1) or chunks == "auto"):
            raise ValueError(f"chunks must be an int >= 1 or \"auto\", got {chunks!r}")
        self.chunks, self.memory_budget, self.retain_saved = chunks, memory_budget, bool(retain_saved)
        R = 2 * intermediate_size if gated else intermediate_size
        add_moe_parameters(self, hidden_size, intermediate_size, num_experts, R, device=device, dtype=dtype)
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))
        else:
            self.expert_bias = None

    def reset_parameters(self) -> None:
        reset_moe_parameters(self)

    def extra_repr(self) -> str:
        return (f"d={self.hidden_size}, h={self.intermediate_size}, experts={self.num_experts}, top_k={self.top_k}, "
                f"activation={self.activation}, score={self.score}, checkpoint={self.checkpoint}, "
                f"expert_bias={self.expert_bias is not None}, chunks={self.chunks}")

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
                                          retain=self.retain_saved)
        y, aux = compose_moe_layer(ops, tokens, logits, self.gate_up_proj, self.down_proj, top_k=self.top_k,
                                   num_experts=self.num_experts, score=self.score, renormalize=self.renormalize,
                                   expert_bias=self.expert_bias, activation=self.activation,
                                   checkpoint=checkpoint, chunks=chunks, retain_saved=self.retain_saved)
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
