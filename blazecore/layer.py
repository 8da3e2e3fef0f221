"""The MoE layer's composition, shared by the framework adapters (no math, no framework import).

An adapter passes its ops module, which must provide ``route_topk``, ``build_dispatch``, ``moe_ffn``,
``load_balancing_loss`` and ``router_z_loss`` with the signatures of ``blazecore_torch.ops`` /
``blazecore_jax.ops``; the arrays are that framework's.
"""

from __future__ import annotations


def compose_moe_layer(ops, tokens, logits, w13, w2, *, top_k: int, num_experts: int, score: str, renormalize: bool,
                      expert_bias, activation: str, checkpoint: str):
    """Route, build the dispatch, run the experts and collect the auxiliary terms.

    Args:
        ops: the adapter's ops module.
        tokens: (L, d) layer input; logits: (L, E) router logits; w13: (E, R, d); w2: (E, d, h).

    Returns:
        (y (L, d), aux) with aux = {"load_balancing_loss", "z_loss" (0-d float32, differentiable through the
        logits), "router_logits" (L, E), "tokens_per_expert" (E,) int32}.
    """
    gates, ids = ops.route_topk(logits, top_k, score=score, renormalize=renormalize, expert_bias=expert_bias)
    # ids come from route_topk (in range, distinct): the dispatch build needs no validation read on the GPU
    dispatch = ops.build_dispatch(ids, num_experts, validate=False)
    y = ops.moe_ffn(tokens, w13, w2, gates, ids, activation=activation, checkpoint=checkpoint, dispatch=dispatch)
    aux = {
        "load_balancing_loss": ops.load_balancing_loss(logits, ids),
        "z_loss": ops.router_z_loss(logits),
        "router_logits": logits,
        "tokens_per_expert": dispatch.counts(),
    }
    return y, aux
