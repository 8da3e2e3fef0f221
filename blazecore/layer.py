"""The MoE layer's composition, shared by the framework adapters (no math, no framework import).

An adapter passes its ops module, which must provide ``route_topk``, ``build_dispatch``, ``moe_ffn``,
``load_balancing_loss`` and ``router_z_loss`` with the signatures of ``blazecore_torch.ops`` /
``blazecore_jax.ops``; the arrays are that framework's.
"""

from __future__ import annotations

from ._moe_common import check_weight_layout  # noqa: F401  (the adapters' layers validate their layout with it)


def _itemsize(dtype) -> int:
    import numpy as np

    from ._array import BF16

    return np.dtype(BF16 if str(dtype) == "bfloat16" else dtype).itemsize


def layer_call_bytes(L: int, d: int, E: int, K: int, *, dtype) -> tuple[int, int]:
    """Bytes a layer call holds beside the core's allocations (``blazecore.moe_memory``), for a forward and
    backward of x (L, d) through router -> top-k -> experts with autograd (the PyTorch and JAX layers alike).

    Returns ``(beside_core, after_core)``:

    * ``beside_core``: alive while the core runs: the router logits (L, E) that autograd keeps for the router's
      backward, the gates (L, K) float32 and ids (L, K) int32, and the incoming gradient dy (L, d);
    * ``after_core``: alive once the core's backward has returned (its transients and the saved pre-activations
      are gone; y, dy and the core's gradients are still there): the logits and their gradient (L, E), the
      router's input gradient (L, d) that autograd adds to the experts' dx, gates and ids.
    """
    b = _itemsize(dtype)
    L, d, E, K = (int(v) for v in (L, d, E, K))
    r = lambda n: -(-n // 512) * 512  # noqa: E731  (the caching allocators' block rounding)
    logits, gid, dy = r(L * E * b), 2 * r(4 * L * K), r(L * d * b)
    return logits + gid + dy, 2 * logits + gid + r(L * d * b)


def layer_memory(L: int, d: int, h: int, E: int, K: int, *, dtype, activation: str, checkpoint: str, chunks: int = 1,
                 retain: bool = False, sm90: bool = True) -> int:
    """Predicted peak bytes of one layer call's forward + backward beyond its inputs x and the parameters:
    the core's peak (:func:`blazecore.moe_memory`) plus what the layer holds beside it (:func:`layer_call_bytes`),
    or, if larger, what is alive after the core's backward (y, dy, the gradients and the router's terms)."""
    from .memory import moe_memory

    est = moe_memory(L, d, h, E, K, dtype=dtype, activation=activation, checkpoint=checkpoint, chunks=chunks,
                     retain=retain, sm90=sm90)
    beside, after = layer_call_bytes(L, d, E, K, dtype=dtype)
    b = _itemsize(dtype)
    from .moe import activation_info

    rows = 2 * h if activation_info(activation) else h
    r = lambda n: -(-n // 512) * 512  # noqa: E731
    core_after = r(L * d * b) * 2 + r(E * rows * d * b) + r(E * d * h * b)  # y, dx, dw13, dw2 (dgates is consumed)
    return max(est.peak_bytes + beside, core_after + after)


def resolve_plan(chunks, checkpoint: str, L: int, d: int, h: int, E: int, K: int, *, dtype, activation: str,
                 budget=None, free_bytes=None, retain: bool = False, bias: tuple[bool, bool] = (False, False),
                 weight_layout: str = "out_in") -> tuple[int, str]:
    """The chunk count and checkpoint policy a layer runs.

    ``chunks`` an int runs as given; "auto" plans with :func:`blazecore.memory.plan_chunks` for ``budget`` bytes,
    or a fraction (default 0.9) of ``free_bytes()`` (the framework's count of free device memory), keeping
    :func:`layer_call_bytes` of it for what the layer holds beside the core. ``checkpoint`` "auto" lets the planner
    choose ("ab" if some chunk count fits with it, else "none"); with an int ``chunks`` it means "ab".
    ``free_bytes=None`` means no device (the reference path): one chunk. ``retain``: the adapter's backward keeps
    the saved pre-activations (dz then takes its own buffer). ``bias`` (whether b13 and b2 are given) and
    ``weight_layout`` are the call's, as :func:`blazecore.moe_memory` takes them.
    """
    from .memory import _budget_bytes, plan_chunks

    if checkpoint != "auto" and checkpoint not in ("ab", "none"):
        raise ValueError(f"unknown checkpoint policy {checkpoint!r} (expected 'ab', 'none' or 'auto')")
    auto = isinstance(chunks, str) and chunks == "auto"
    if not auto:
        return chunks, ("ab" if checkpoint == "auto" else checkpoint)
    if free_bytes is None:
        if budget is not None:
            _budget_bytes(budget, None, lambda: 0)  # the same validation as on a device
        return 1, ("ab" if checkpoint == "auto" else checkpoint)
    beside, _ = layer_call_bytes(L, d, E, K, dtype=dtype)
    plan = plan_chunks(L, d, h, E, K, dtype=dtype, activation=activation,
                       checkpoint=None if checkpoint == "auto" else checkpoint, budget=budget, retain=retain,
                       free_bytes=free_bytes, reserved=beside, bias=tuple(bias), weight_layout=weight_layout)
    return plan.chunks, plan.checkpoint


def resolve_chunks(chunks, L: int, d: int, h: int, E: int, K: int, *, dtype, activation: str, checkpoint: str,
                   budget=None, free_bytes=None, retain: bool = False) -> int:
    """The chunk count of :func:`resolve_plan` for a fixed checkpoint policy."""
    return resolve_plan(chunks, checkpoint, L, d, h, E, K, dtype=dtype, activation=activation, budget=budget,
                        free_bytes=free_bytes, retain=retain)[0]


def compose_moe_layer(ops, tokens, logits, w13, w2, *, top_k: int, num_experts: int, score: str, renormalize: bool,
                      expert_bias, activation: str, checkpoint: str, chunks: int = 1, **ffn_options):
    """Route, build the dispatch, run the experts and collect the auxiliary terms.

    Args:
        ops: the adapter's ops module.
        tokens: (L, d) layer input; logits: (L, E) router logits; w13: (E, R, d); w2: (E, d, h).
        chunks: token chunks of the expert FFNs (an int; see ``resolve_chunks`` for "auto").
        ffn_options: further keyword arguments of the adapter's ``moe_ffn`` (e.g. torch's ``retain_saved``).

    Returns:
        (y (L, d), aux) with aux = {"load_balancing_loss", "z_loss" (0-d float32, differentiable through the
        logits), "router_logits" (L, E), "tokens_per_expert" (E,) int32}.
    """
    gates, ids = ops.route_topk(logits, top_k, score=score, renormalize=renormalize, expert_bias=expert_bias)
    # ids come from route_topk (in range, distinct): the dispatch build needs no validation read on the GPU
    dispatch = ops.build_dispatch(ids, num_experts, validate=False)
    y = ops.moe_ffn(tokens, w13, w2, gates, ids, activation=activation, checkpoint=checkpoint, dispatch=dispatch,
                    chunks=chunks, **ffn_options)
    aux = {
        "load_balancing_loss": ops.load_balancing_loss(logits, ids),
        "z_loss": ops.router_z_loss(logits),
        "router_logits": logits,
        "tokens_per_expert": dispatch.counts(),
    }
    return y, aux
