"""Memory model of the MoE layer and the chunk planner (token chunking sized to a memory budget).

:func:`moe_memory` predicts the bytes one GPU forward + backward of :func:`blazecore.moe.moe_forward` /
:func:`blazecore.moe.moe_backward` allocates beyond its inputs (x, the weights, gates, ids, dy): its peak, and
what the forward leaves held for the backward. It replays the allocations and frees of ``_moe_gpu`` in order
(output y, the dispatch, the saved pre-activations, each chunk's transients, the gradients, the fp32 partial
sums that carry the weight gradients from chunk to chunk) with the caching allocators' 512-byte rounding, so
it tracks the code rather than a closed formula; bench/bench_scale.py checks it against measured peaks.

For L*K slots (Lc*K in the largest chunk), R = 2h (gated) or h, b = bytes per element, the terms are:

    forward peak  = y (L d b) + dispatch (~12 L K) + z_ab (L K R b) + chunk [hcur (Lc K h b) + o (Lc K w b)]
                    (w: the widest column slice of o, at most 1024)
    backward peak = y + dispatch + z_ab + grads (L d b + E R d b + E d h b + 4 L K) + carry (c > 1: 4 E (R d + d h))
                    + chunk [z_none (Lc K R b) + max(hg (Lc K h b) + part, dx rows (Lc K d b))]

:func:`plan_chunks` picks the smallest chunk count (and, when asked, the checkpoint policy) whose predicted peak
fits a budget: bytes, or a fraction of the device's free memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _array
from .moe import BLOCK_TOKENS, CHECKPOINTS, activation_info, chunk_bounds

_ROUND = 512  # torch's caching allocator and CuPy's pool both round block sizes up to 512 bytes


def _r(n: int) -> int:
    return -(-int(n) // _ROUND) * _ROUND


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes of one forward + backward beyond the inputs.

    peak_bytes: the most allocated at once (forward or backward); held_bytes: what the forward keeps for the
    backward (dispatch and saved pre-activations, as ``MoESaved.held_bytes``); forward_peak_bytes and
    backward_peak_bytes: the two phases' peaks (y stays alive through the backward); chunks: the chunk count
    that runs (chunk_bounds may run fewer than asked); chunk_tokens: tokens of the largest chunk.
    """

    peak_bytes: int
    held_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    chunks: int
    chunk_tokens: int
    checkpoint: str


class _Tracker:
    def __init__(self):
        self.cur = 0
        self.peak = 0

    def alloc(self, n: int) -> int:
        n = _r(n) if n else 0
        self.cur += n
        self.peak = max(self.peak, self.cur)
        return n

    def free(self, *ns: int) -> None:
        self.cur -= sum(ns)


def _dispatch_bytes(t: _Tracker, L: int, K: int, E: int) -> int:
    """Allocate one build_dispatch's outputs (kept) and its workspace (freed); returns the kept bytes."""
    from .dispatch import MODE_SINGLE_TILE, plan

    n = L * K
    kept = t.alloc(4 * (E + 1)) + t.alloc(4 * n) + t.alloc(4 * n) + t.alloc(4 * n)
    if n:
        p = plan(n, E)
        if p.mode != MODE_SINGLE_TILE:
            t.free(t.alloc(4 * (p.num_tiles * E + E)))
    return kept


def moe_memory(L: int, d: int, h: int, E: int, K: int, *, dtype="bfloat16", activation: str = "swiglu",
               checkpoint: str = "ab", chunks: int = 1, bias: tuple[bool, bool] = (False, False),
               block_tokens: int = BLOCK_TOKENS, sm90: bool = True, retain: bool = False) -> MemoryEstimate:
    """Predicted peak and held bytes of one GPU forward + backward of the layer beyond its inputs.

    Args:
        L, d, h, E, K: tokens, model dim, expert hidden dim, experts, top-k (as ``moe_forward``).
        dtype: x's dtype (name or numpy dtype; "bfloat16", "float16", "float32").
        activation, checkpoint: as ``moe_forward``.
        chunks: token chunks asked for (``chunk_bounds`` decides how many run).
        bias: (b13 given, b2 given).
        block_tokens: as ``moe_forward``.
        sm90: the sm_90a kernels' tiles (Hopper, 16-bit types) rather than the mma.sync ones; only the small
            per-slot partial sums and the chunk carry depend on it.
        retain: the backward keeps the saved pre-activations (``retain=True``, e.g. the PyTorch adapter), so
            under "ab" dz takes its own buffer instead of overwriting them.
    """
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"unknown checkpoint policy {checkpoint!r} (expected one of {', '.join(CHECKPOINTS)})")
    L, d, h, E, K = (int(v) for v in (L, d, h, E, K))
    if min(d, h, E, K) < 1 or L < 0:
        raise ValueError(f"sizes must be positive (L >= 0): L={L} d={d} h={h} E={E} K={K}")
    b = np.dtype(_array.BF16 if str(dtype) == "bfloat16" else dtype).itemsize
    R = 2 * h if activation_info(activation) else h
    bounds = chunk_bounds(L, chunks, block_tokens)
    Lc = max(t1 - t0 for t0, t1 in bounds)
    LK, LKc = L * K, Lc * K
    sm90 = sm90 and b == 2
    t = _Tracker()

    # ---- forward ----
    t.alloc(L * d * b)  # y
    disp = sum(_dispatch_bytes(t, t1 - t0, K, E) for t0, t1 in bounds)
    z = t.alloc(LK * R * b) if checkpoint == "ab" else 0
    if L:
        tiles = t.alloc(4 * (E + 1))
        hbuf = t.alloc(LKc * h * b)
        from ._moe_gpu import o_slices

        obuf = t.alloc(LKc * max(c1 - c0 for c0, c1 in o_slices(d)) * b)  # per-slot output rows, column-sliced
        t.free(hbuf, obuf, tiles)
    forward_peak = t.peak
    held = disp + z

    # ---- backward (y is still alive: the caller holds it) ----
    grads = [L * d * b, E * R * d * b, E * d * h * b, 4 * L * K]
    grads += [E * R * b] if bias[0] else []
    grads += [E * d * b] if bias[1] else []
    for g in grads:
        t.alloc(g)
    if len(bounds) > 1 and L:
        from ._moe_gpu import carry_arrays

        for n in carry_arrays(sm90, E, d, h, R, *bias):  # fp32 partial sums carried between the chunks
            t.alloc(n)
    if L:
        from ._moe_gpu import BN, BN90, dx_slices, h_slices

        tiles = t.alloc(4 * (E + 1))
        zc = t.alloc(LKc * R * b) if (checkpoint == "none" or retain) else 0  # recomputed z, or dz beside z
        hw = h if len(bounds) > 1 else max(c1 - c0 for c0, c1 in h_slices(h, d))  # g*hcur rows, h-sliced unchunked
        hg = t.alloc(LKc * hw * b)
        part = t.alloc(4 * LKc * _cdiv(h, BN90 if sm90 else BN))  # dgates partials, one per n-tile of dh'
        t.free(part)
        nb = _cdiv(Lc, block_tokens)
        blk = t.alloc(4 * E * nb) if nb > 1 else 0
        t.free(hg)
        dxs = t.alloc(LKc * max(c1 - c0 for c0, c1 in dx_slices(d, R)) * b)  # per-slot dx rows, column-sliced
        t.free(dxs, blk, zc, tiles)
    backward_peak = t.peak  # includes the forward's (monotone); report the larger of the phases
    return MemoryEstimate(max(forward_peak, backward_peak), held, forward_peak, backward_peak, len(bounds), Lc,
                          checkpoint)


@dataclass(frozen=True)
class ChunkPlan:
    """What :func:`plan_chunks` chose: run with ``chunks`` and ``checkpoint``; ``estimate`` its prediction,
    ``budget`` the bytes it had to fit, ``fits`` False when even the most chunks did not fit (the plan is then
    the one with the smallest predicted peak)."""

    chunks: int
    checkpoint: str
    estimate: MemoryEstimate
    budget: int
    fits: bool


def free_device_bytes(device: int | None = None) -> int:
    """Free memory of a CUDA device (cudaMemGetInfo) plus what CuPy's default pool holds unused."""
    import cupy

    with cupy.cuda.Device(device):
        free, _ = cupy.cuda.runtime.memGetInfo()
        pool = cupy.get_default_memory_pool()
        return int(free) + int(pool.free_bytes())


def _budget_bytes(budget, device, free_bytes=None) -> int:
    if budget is None:
        budget = 0.9
    if isinstance(budget, bool) or not isinstance(budget, (int, float, np.integer, np.floating)):
        raise TypeError(f"memory budget: expected bytes (int) or a fraction (float in (0, 1]), got {budget!r}")
    if isinstance(budget, (float, np.floating)):
        if not 0.0 < float(budget) <= 1.0:
            raise ValueError(f"memory budget fraction must be in (0, 1], got {budget}")
        return int(float(budget) * (free_bytes() if free_bytes is not None else free_device_bytes(device)))
    if budget < 0:
        raise ValueError(f"memory budget must be >= 0 bytes, got {budget}")
    return int(budget)


def plan_chunks(L: int, d: int, h: int, E: int, K: int, *, dtype="bfloat16", activation: str = "swiglu",
                checkpoint: str | None = "ab", budget=None, bias: tuple[bool, bool] = (False, False),
                block_tokens: int = BLOCK_TOKENS, sm90: bool = True, retain: bool = False,
                device: int | None = None, free_bytes=None) -> ChunkPlan:
    """The smallest chunk count whose predicted peak (:func:`moe_memory`) fits ``budget``.

    Args:
        checkpoint: the policy to plan for; None lets the planner choose: "ab" (no recomputation) if some
            chunk count fits with it, else "none".
        budget: bytes (int), or a fraction in (0, 1] of the device's free memory (float); default 0.9 of the
            free memory of ``device`` (the current device when None), read with cudaMemGetInfo.
        free_bytes: a callable giving the free bytes instead (a framework's own count, e.g. torch's cache).
        the rest: as :func:`moe_memory`.

    Returns:
        :class:`ChunkPlan`. Distinct chunkings are tried in increasing count (chunk_bounds rounds chunks to
        multiples of ``block_tokens``); if none fits, the one with the smallest peak and ``fits=False``.
    """
    want = _budget_bytes(budget, device, free_bytes)
    policies = CHECKPOINTS if checkpoint is None else (checkpoint,)
    best = None
    for pol in policies:
        seen = set()
        for c in range(1, max(1, _cdiv(int(L), int(block_tokens))) + 1):
            n_run = len(chunk_bounds(L, c, block_tokens))
            if n_run in seen:
                continue
            seen.add(n_run)
            est = moe_memory(L, d, h, E, K, dtype=dtype, activation=activation, checkpoint=pol, chunks=c, bias=bias,
                             block_tokens=block_tokens, sm90=sm90, retain=retain)
            if est.peak_bytes <= want:
                return ChunkPlan(c, pol, est, want, True)
            if best is None or est.peak_bytes < best[1].peak_bytes:
                best = (c, est, pol)
    c, est, pol = best
    return ChunkPlan(c, pol, est, want, False)


__all__ = ["ChunkPlan", "MemoryEstimate", "free_device_bytes", "moe_memory", "plan_chunks"]
