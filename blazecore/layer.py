"""The MoE layer's composition, shared by the framework adapters (no math, no framework import).

An adapter passes its ops module, which must provide ``route_topk``, ``build_dispatch``, ``moe_ffn``,
``load_balancing_loss`` and ``router_z_loss`` with the signatures of ``blazecore_torch.ops`` /
``blazecore_jax.ops``; the arrays are that framework's.
"""

from __future__ import annotations


def resolve_chunks(chunks, L: int, d: int, h: int, E: int, K: int, *, dtype, activation: str, checkpoint: str,
                   budget=None, free_bytes=None, retain: bool = True) -> int:
    """The chunk count a layer runs: ``chunks`` itself, or for "auto" the planner's choice.

    "auto" plans with :func:`blazecore.memory.plan_chunks` for ``budget`` bytes, or for a fraction (default 0.9)
    of ``free_bytes()`` (the framework's count of free device memory); ``free_bytes=None`` means no device
    (the reference path): one chunk. ``retain``: the adapters' backward keeps the saved pre-activations.
    """
    if not (isinstance(chunks, str) and chunks == "auto"):
        return chunks
    if free_bytes is None:
        return 1
    from .memory import plan_chunks

    return plan_chunks(L, d, h, E, K, dtype=dtype, activation=activation, checkpoint=checkpoint, budget=budget,
                       retain=retain, free_bytes=free_bytes).chunks


def compose_moe_layer(ops, tokens, logits, w13, w2, *, top_k: int, num_experts: int, score: str, renormalize: bool,
                      expert_bias, activation: str, checkpoint: str, chunks: int = 1):
    """Route, build the dispatch, run the experts and collect the auxiliary terms.

    Args:
        ops: the adapter's ops module.
        tokens: (L, d) layer input; logits: (L, E) router logits; w13: (E, R, d); w2: (E, d, h).
        chunks: token chunks of the expert FFNs (an int; see ``resolve_chunks`` for "auto").

    Returns:
        (y (L, d), aux) with aux = {"load_balancing_loss", "z_loss" (0-d float32, differentiable through the
        logits), "router_logits" (L, E), "tokens_per_expert" (E,) int32}.
    """
    gates, ids = ops.route_topk(logits, top_k, score=score, renormalize=renormalize, expert_bias=expert_bias)
    # ids come from route_topk (in range, distinct): the dispatch build needs no validation read on the GPU
    dispatch = ops.build_dispatch(ids, num_experts, validate=False)
    y = ops.moe_ffn(tokens, w13, w2, gates, ids, activation=activation, checkpoint=checkpoint, dispatch=dispatch,
                    chunks=chunks)
    aux = {
        "load_balancing_loss": ops.load_balancing_loss(logits, ids),
        "z_loss": ops.router_z_loss(logits),
        "router_logits": logits,
        "tokens_per_expert": dispatch.counts(),
    }
    return y, aux
