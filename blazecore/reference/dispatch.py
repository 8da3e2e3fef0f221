"""NumPy reference for the dispatch build, in the same three phases as ``cuda/dispatch.cu``.

Pairs (token t, k) route to expert ``expert_ids[t, k]``. The dispatch lists, for each expert in turn,
its pairs ordered by token then k:

1. token-expert map: for a tile of tokens, ``route[t, e] = k`` if token t picked expert e as its k-th
   choice, else -1 (a dense tile x E map; only one tile exists at a time, so memory is tile * E).
2. per-expert counts: the number of routed tokens in each column of each tile; their sum over tiles
   is the expert's count and the exclusive cumulative sum over experts gives ``expert_offsets``.
3. tile-level scan: a pair's slot is its expert's offset, plus the expert's pairs in earlier tiles,
   plus the routed tokens above it in the same column of its tile (an exclusive cumulative sum down
   the column).

An id of -1 (any negative id, as in the kernels) drops its pair: the dropped pairs take the slots after the
last expert's, in pair order, ``expert_offsets[E]`` counts the routed pairs only and ``pair_slot`` is -1
for a dropped pair. Ids >= E are clamped to E - 1 (as the kernels do); a row holding one expert twice is
invalid and leaves some outputs at -1 (``blazecore.dispatch`` validates rows first by default).
"""

from __future__ import annotations

import numpy as np

TILE_TOKENS = 1024


def _token_expert_map(ids_tile: np.ndarray, num_experts: int) -> np.ndarray:
    """Phase 1 for one tile: (rows, E) int32, entry k where the row's k-th pick is e, else -1 (dropped
    pairs, id -1, appear nowhere)."""
    rows, top_k = ids_tile.shape
    route = np.full((rows, num_experts), -1, dtype=np.int32)
    t = np.repeat(np.arange(rows), top_k)
    k = np.tile(np.arange(top_k, dtype=np.int32), rows)
    e = ids_tile.reshape(-1)
    keep = e >= 0
    route[t[keep], e[keep]] = k[keep]
    return route


def build_dispatch(expert_ids: np.ndarray, num_experts: int, tile_tokens: int = TILE_TOKENS):
    """Reference dispatch of ``expert_ids`` (L, K) integer over ``num_experts`` experts.

    Returns (expert_offsets (E+1,), slot_token (L*K,), slot_k (L*K,), pair_slot (L, K)), all int32.
    """
    ids = np.asarray(expert_ids).astype(np.int64, copy=False)
    ids = np.where(ids < 0, -1, np.minimum(ids, num_experts - 1))
    num_tokens, top_k = ids.shape
    n_pairs = num_tokens * top_k
    starts = list(range(0, num_tokens, tile_tokens))

    # Phases 1 and 2: counts per (tile, expert), then per expert, then offsets.
    tile_counts = np.zeros((len(starts), num_experts), dtype=np.int64)
    for i, t0 in enumerate(starts):
        route = _token_expert_map(ids[t0 : t0 + tile_tokens], num_experts)
        tile_counts[i] = (route >= 0).sum(axis=0)
    counts = tile_counts.sum(axis=0)
    expert_offsets = np.zeros(num_experts + 1, dtype=np.int64)
    expert_offsets[1:] = np.cumsum(counts)
    # Where each tile's run of each expert begins: the expert's offset plus its pairs in earlier tiles.
    tile_base = expert_offsets[:-1] + np.cumsum(tile_counts, axis=0) - tile_counts

    # Phase 3: every pair's slot.
    slot_token = np.full(n_pairs, -1, dtype=np.int32)
    slot_k = np.full(n_pairs, -1, dtype=np.int32)
    pair_slot = np.full((num_tokens, top_k), -1, dtype=np.int32)
    for i, t0 in enumerate(starts):
        route = _token_expert_map(ids[t0 : t0 + tile_tokens], num_experts)
        routed = route >= 0
        above = np.cumsum(routed, axis=0) - routed  # routed tokens above, same column, same tile
        slot = tile_base[i] + above
        rows, experts = np.nonzero(routed)
        s = slot[rows, experts]
        k = route[rows, experts]
        slot_token[s] = t0 + rows
        slot_k[s] = k
        pair_slot[t0 + rows, k] = s
    # The dropped pairs: the slots after the experts', in pair order (pair_slot stays -1).
    dropped = np.flatnonzero(ids.reshape(-1) < 0)
    s = int(expert_offsets[-1]) + np.arange(dropped.size)
    slot_token[s] = dropped // max(top_k, 1)
    slot_k[s] = dropped % max(top_k, 1)
    return expert_offsets.astype(np.int32), slot_token, slot_k, pair_slot
