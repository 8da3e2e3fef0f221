"""``moe_layer``: a functional Mixture-of-Experts layer (router -> top-k -> expert FFNs -> combine) on
blazecore's JAX ops.

Parameters are a dict laid out like transformers' fused experts (and ``blazecore_torch.MoELayer``), so the
same weights run on both adapters:

    "router"             (E, d)        logits = x @ router^T
    "gate_up_proj"       (E, 2h, d)    rows [0, h) the gate projection, [h, 2h) the up projection
                                       ((E, h, d) for non-gated activations; interleaved gate/up rows with an
                                       activation named "<gated>_interleaved")
    "down_proj"          (E, d, h)
    "gate_up_proj_bias"  (E, 2h)       optional expert biases (gpt-oss's experts have them)
    "down_proj_bias"     (E, d)        optional, given together with gate_up_proj_bias

With ``weight_layout="in_out"`` the two projections are stored transposed, as gpt-oss and Llama 4 store them:
gate_up_proj (E, d, 2h), down_proj (E, h, d).

``blazecore_jax.nnx.MoE`` wraps this function in a Flax NNX module (flax is needed only there).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

import blazecore
from blazecore.layer import check_weight_layout, compose_moe_layer, resolve_plan

from . import ops

__all__ = ["init_moe_params", "moe_layer"]

_PARAMS = ("router", "gate_up_proj", "down_proj")
_BIASES = ("gate_up_proj_bias", "down_proj_bias")


def expert_biases(params: dict) -> tuple:
    """(b13, b2): the expert biases of a layer's ``params`` ("gate_up_proj_bias", "down_proj_bias"), or (None,
    None); a ValueError where only one of them is given."""
    given = [k for k in _BIASES if params.get(k) is not None]
    if len(given) == 1:
        raise ValueError(f"params has {given[0]} without {_BIASES[1 - _BIASES.index(given[0])]}: give both expert "
                         "biases or neither")
    return tuple(params.get(k) for k in _BIASES)


def init_moe_params(key, hidden_size: int, intermediate_size: int, num_experts: int, *,
                    activation: str = "swiglu", dtype=jnp.float32, weight_layout: str = "out_in",
                    bias: bool = False) -> dict:
    """Parameters for :func:`moe_layer`: uniform(+-1/sqrt(fan_in)) like ``blazecore_torch.MoELayer``, the
    projections stored in ``weight_layout`` (the same values transposed for "in_out": a key gives the same weights
    in either layout) and, with ``bias``, the expert biases (nn.Linear's bias bound; drawn from a key of their own,
    so the weights are the same with or without them)."""
    gated = blazecore.activation_info(activation)
    t = check_weight_layout(weight_layout) == "in_out"
    d, h, E = int(hidden_size), int(intermediate_size), int(num_experts)
    R = 2 * h if gated else h
    k1, k2, k3 = jax.random.split(key, 3)
    bd, bh = 1 / math.sqrt(d), 1 / math.sqrt(h)
    w13 = jax.random.uniform(k2, (E, R, d), dtype, -bd, bd)
    w2 = jax.random.uniform(k3, (E, d, h), dtype, -bh, bh)
    p = {
        "router": jax.random.uniform(k1, (E, d), dtype, -bd, bd),
        "gate_up_proj": jnp.swapaxes(w13, 1, 2) if t else w13,
        "down_proj": jnp.swapaxes(w2, 1, 2) if t else w2,
    }
    if bias:
        k4, k5 = jax.random.split(jax.random.fold_in(key, 1), 2)
        p["gate_up_proj_bias"] = jax.random.uniform(k4, (E, R), dtype, -bd, bd)
        p["down_proj_bias"] = jax.random.uniform(k5, (E, d), dtype, -bh, bh)
    return p


def moe_layer(params: dict, x, *, top_k: int, activation: str = "swiglu", checkpoint: str = "ab",
              score: str = "softmax", renormalize: bool = True, expert_bias=None, chunks=1, memory_budget=None,
              weight_layout: str = "out_in"):
    """Mixture-of-Experts feed-forward layer.

    Args:
        params: {"router": (E, d), "gate_up_proj": (E, R, d), "down_proj": (E, d, h)}, one dtype
            (float32, float16 or bfloat16), and optionally the expert biases "gate_up_proj_bias" (E, R) and
            "down_proj_bias" (E, d) (both or neither).
        x: (..., d) tokens in the parameters' dtype.
        top_k: K experts per token, 1 <= K <= E.
        activation: one of ``blazecore.ACTIVATIONS``.
        checkpoint: "ab" or "none" (see ``blazecore.moe_forward``), or "auto" with ``chunks="auto"``: the
            planner's choice ("ab" if some chunk count fits with it, else "none").
        score, renormalize: router scoring (see :func:`ops.route_topk`).
        expert_bias: optional (E,) selection-only bias (aux-loss-free balancing), no gradient.
        chunks: token chunks of the expert FFNs (an int >= 1; bit-identical results, transients scale with
            L / chunks), or "auto": planned at trace time from the static shapes with
            ``blazecore.plan_chunks`` for ``memory_budget`` (bytes, or a fraction of the free memory of x's
            device as its memory_stats report, default 0.9), keeping room for what the call holds beside the
            core (``blazecore.layer.layer_call_bytes``: router logits, gates, ids, the incoming gradient); one
            chunk on the CPU.
        weight_layout: "out_in" (default) or "in_out": how gate_up_proj and down_proj are stored, (E, d, R) and
            (E, h, d) for "in_out"; read as stored, their gradients in the same layout.

    Returns:
        (y, aux): y with x's shape and dtype; aux a dict with ``load_balancing_loss`` and ``z_loss``
        (0-d float32, differentiable through the router logits), ``router_logits`` (L, E) and
        ``tokens_per_expert`` (E,) int32.
    """
    missing = [k for k in _PARAMS if k not in params]
    if missing:
        raise KeyError(f"params lacks {', '.join(missing)} (expected keys {', '.join(_PARAMS)})")
    t = check_weight_layout(weight_layout) == "in_out"
    router, w13, w2 = (params[k] for k in _PARAMS)
    b13, b2 = expert_biases(params)
    if len(router.shape) != 2 or len(w13.shape) != 3 or len(w2.shape) != 3:
        raise ValueError(f"router {tuple(router.shape)} must be (E, d), gate_up_proj {tuple(w13.shape)} "
                         f"{'(E, d, R)' if t else '(E, R, d)'} and down_proj {tuple(w2.shape)} "
                         f"{'(E, h, d)' if t else '(E, d, h)'} (weight_layout {weight_layout!r})")
    E, d = (int(s) for s in router.shape)
    if int(w13.shape[0]) != E:
        raise ValueError(f"router has {E} experts, gate_up_proj {int(w13.shape[0])}")
    if not x.shape or int(x.shape[-1]) != d:
        raise ValueError(f"x: last dimension {x.shape[-1] if x.shape else None}, expected hidden size d = {d}")
    if x.dtype != w13.dtype or router.dtype != w13.dtype:
        raise TypeError(f"x ({x.dtype}), router ({router.dtype}) and gate_up_proj ({w13.dtype}) must share a dtype")
    shape = x.shape
    tokens = x.reshape(-1, d)
    logits = tokens @ router.T
    h = int(w2.shape[1 if t else 2])
    chunks, checkpoint = resolve_plan(chunks, checkpoint, int(tokens.shape[0]), d, h, E, top_k,
                                      dtype=str(np.dtype(w13.dtype)), activation=activation, budget=memory_budget,
                                      free_bytes=_free_bytes_probe(), bias=(b13 is not None,) * 2,
                                      weight_layout=weight_layout)
    y, aux = compose_moe_layer(ops, tokens, logits, w13, w2, top_k=top_k, num_experts=E, score=score,
                               renormalize=renormalize, expert_bias=expert_bias, activation=activation,
                               checkpoint=checkpoint, chunks=chunks, b13=b13, b2=b2, weight_layout=weight_layout)
    return y.reshape(shape), aux


def _free_bytes_probe():
    """Free bytes of the default device from its memory_stats (None on the CPU or without the stats)."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return None
    stats = dev.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return lambda: int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
