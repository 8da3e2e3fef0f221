"""The layers' planning (blazecore/layer.py): what a layer call holds beside the core, and the plan it runs."""

from __future__ import annotations

import pytest

from blazecore import memory
from blazecore.layer import layer_call_bytes, layer_memory, resolve_plan

OLMOE = {"d": 2048, "h": 1024, "E": 64, "K": 8}
KW = {"dtype": "bfloat16", "activation": "swiglu"}


def _r(n):
    return -(-n // 512) * 512


def test_layer_call_bytes_terms():
    """Independent sum of the terms: logits (L, E), gates and ids (L, K) 4 bytes each, dy (L, d); after the core
    the logits and their gradient, gates, ids and the router's dx (L, d)."""
    L, d, E, K = 1000, 96, 12, 3
    beside, after = layer_call_bytes(L, d, E, K, dtype="bfloat16")
    assert beside == _r(L * E * 2) + 2 * _r(4 * L * K) + _r(L * d * 2)
    assert after == 2 * _r(L * E * 2) + 2 * _r(4 * L * K) + _r(L * d * 2)
    beside32, _ = layer_call_bytes(L, d, E, K, dtype="float32")
    assert beside32 == _r(L * E * 4) + 2 * _r(4 * L * K) + _r(L * d * 4)


def test_layer_memory_adds_the_layer_terms():
    L = 1 << 16
    for ckpt in ("ab", "none"):
        core = memory.moe_memory(L, **OLMOE, **KW, checkpoint=ckpt, chunks=4)
        beside, _ = layer_call_bytes(L, OLMOE["d"], OLMOE["E"], OLMOE["K"], dtype="bfloat16")
        assert layer_memory(L, **OLMOE, **KW, checkpoint=ckpt, chunks=4) >= core.peak_bytes + beside


def test_resolve_plan_reserves_the_layer_terms():
    """"auto" fits the core's peak plus what the layer holds: a budget that fits the core alone at c chunks is
    not enough for the layer, which then plans more chunks (or the other policy)."""
    L = 1 << 18
    beside, _ = layer_call_bytes(L, OLMOE["d"], OLMOE["E"], OLMOE["K"], dtype="bfloat16")
    core4 = memory.moe_memory(L, **OLMOE, **KW, checkpoint="ab", chunks=4).peak_bytes
    c_core = memory.plan_chunks(L, **OLMOE, **KW, checkpoint="ab", budget=core4).chunks
    c_layer, ckpt = resolve_plan("auto", "ab", L, **OLMOE, **KW, budget=core4, free_bytes=lambda: 1)
    assert ckpt == "ab" and c_layer > c_core
    est = memory.moe_memory(L, **OLMOE, **KW, checkpoint="ab", chunks=c_layer)
    assert est.peak_bytes + beside <= core4 or est.chunks == len(memory.chunk_bounds(L, 10**9))
    c_same, _ = resolve_plan("auto", "ab", L, **OLMOE, **KW, budget=core4 + beside, free_bytes=lambda: 1)
    assert c_same == c_core


def test_resolve_plan_policy():
    L = 1 << 16
    big = 1 << 50
    assert resolve_plan("auto", "auto", L, **OLMOE, **KW, budget=big, free_bytes=lambda: 1) == (1, "ab")
    # a budget only "none" fits at some chunk count
    none_min = min(memory.moe_memory(L, **OLMOE, **KW, checkpoint="none", chunks=c).peak_bytes for c in (1, 8, 64))
    ab_min = min(memory.moe_memory(L, **OLMOE, **KW, checkpoint="ab", chunks=c).peak_bytes for c in (1, 8, 64))
    assert none_min < ab_min
    beside, _ = layer_call_bytes(L, OLMOE["d"], OLMOE["E"], OLMOE["K"], dtype="bfloat16")
    c, ckpt = resolve_plan("auto", "auto", L, **OLMOE, **KW, budget=none_min + beside, free_bytes=lambda: 1)
    assert ckpt == "none"
    # fixed chunks: the policy as given ("auto" means "ab"); no device: one chunk
    assert resolve_plan(3, "none", L, **OLMOE, **KW) == (3, "none")
    assert resolve_plan(3, "auto", L, **OLMOE, **KW) == (3, "ab")
    assert resolve_plan("auto", "auto", L, **OLMOE, **KW, free_bytes=None) == (1, "ab")


@pytest.mark.parametrize("bad", [-5, 1.5, "lots", True])
def test_resolve_plan_validates_the_budget_without_a_device(bad):
    with pytest.raises((ValueError, TypeError), match="budget"):
        resolve_plan("auto", "ab", 1024, **OLMOE, **KW, budget=bad, free_bytes=None)


def test_resolve_plan_rejects_unknown_policy():
    with pytest.raises(ValueError, match="checkpoint"):
        resolve_plan("auto", "everything", 1024, **OLMOE, **KW)
