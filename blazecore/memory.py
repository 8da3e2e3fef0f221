"""Memory model of the MoE layer and the chunk planner (token chunking sized to a memory budget).

:func:`moe_memory` predicts the bytes one GPU forward + backward of :func:`blazecore.moe.moe_forward` /
:func:`blazecore.moe.moe_backward` allocates beyond its inputs (x, the weights, gates, ids, dy): its peak, and
what the forward leaves held for the backward. It is not a formula: it runs the layer's own GPU path
(:func:`blazecore._moe_gpu.layer_forward` and :func:`~blazecore._moe_gpu.layer_backward`: output y, the dispatch,
the saved pre-activations, each chunk's transients, the gradients, the fp32 partial sums carried between chunks)
dry, under a recording allocator (:func:`blazecore._array.dry_run`): every allocation becomes a placeholder with a
shape and a dtype and no memory, no kernel is launched and no device is asked anything, and a buffer is released
where the real call releases it (when its last view goes). Sizes are rounded up to 512 bytes as torch's caching
allocator and CuPy's pool round them. A change to the launchers changes the model with it; the GPU tests compare
the predictions with the pools' measured peaks byte for byte.

For L*K slots (Lc*K in the largest chunk), R = 2h (gated) or h, b = bytes per element, what the run allocates
comes to about:

    forward peak  = y (L d b) + dispatch (~12 L K) + z_ab (L K R b) + chunk [hcur (Lc K h b) + o (Lc K w b)]
                    (w: the widest column slice of o, at most 1024)
    backward peak = y + dispatch + z_ab + grads (L d b + E R d b + E d h b + 4 L K) + carry (c > 1: 4 E (R d + d h))
                    + chunk [z_none (Lc K R b) + blk + max(part (4 Lc K h / 256) + hg (Lc K w b), dx rows (Lc K d b))]
                    (hg: the g * hcur rows of one column slice of h, w at most d; all of h with several chunks)

:func:`plan_chunks` picks the smallest chunk count (and, when asked, the checkpoint policy) whose predicted peak
fits a budget: bytes, or a fraction of the device's free memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from . import _array, _moe_gpu
from ._moe_common import BLOCK_TOKENS, CHECKPOINTS, Sizes, activation_info, check_weight_layout, chunk_bounds

_ROUND = 512  # torch's caching allocator and CuPy's pool both round block sizes up to 512 bytes
_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), _array.BF16)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes of one forward + backward beyond the inputs.

    peak_bytes: the most allocated at once (forward or backward); held_bytes: what the forward keeps for the
    backward (dispatch and saved pre-activations, as ``MoESaved.held_bytes``); forward_peak_bytes and
    backward_peak_bytes: the two phases' peaks (y stays alive through the backward); chunks: the chunk count
    that runs (chunk_bounds may run fewer than asked); chunk_tokens: tokens of the largest chunk; gradient_bytes:
    what the backward returns (dx, dw13, dw2, dgates, the bias gradients), part of backward_peak_bytes.
    """

    peak_bytes: int
    held_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    chunks: int
    chunk_tokens: int
    checkpoint: str
    gradient_bytes: int = 0


@dataclass(frozen=True)
class MemoryTrace:
    """The dry run behind a :class:`MemoryEstimate`: ``events`` lists ("alloc" | "free", bytes, shape, dtype) in
    order, bytes rounded up to ``round_bytes``; the first ``forward_events`` of them belong to the forward. Inputs
    (x, weights, gates, ids, dy) are not in it; what is alive at the end (y, the gradients) is never freed."""

    estimate: MemoryEstimate
    events: tuple
    forward_events: int
    round_bytes: int


def _dtype(dtype) -> np.dtype:
    try:
        dt = np.dtype(_array.BF16 if str(dtype) == "bfloat16" else dtype)
    except TypeError:
        dt = None
    if dt not in _DTYPES:
        raise TypeError(f"dtype {dtype!r} not supported (expected bfloat16, float16 or float32)")
    return dt


def _check(L, d, h, E, K, checkpoint, activation) -> tuple:
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"unknown checkpoint policy {checkpoint!r} (expected one of {', '.join(CHECKPOINTS)})")
    gated = activation_info(activation)
    L, d, h, E, K = (int(v) for v in (L, d, h, E, K))
    if min(d, h, E, K) < 1 or L < 0:
        raise ValueError(f"sizes must be positive (L >= 0): L={L} d={d} h={h} E={E} K={K}")
    if K > E:
        raise ValueError(f"top_k K = {K} exceeds the number of experts E = {E} (a token picks K distinct experts)")
    return L, d, h, E, K, gated


@lru_cache(maxsize=4096)
def _dry_run(L: int, d: int, h: int, E: int, K: int, dtype: np.dtype, activation: str, checkpoint: str, chunks: int,
             bias: tuple, block_tokens: int, arch: str, retain: bool, round_bytes: int,
             act_in_operand: bool = False, kernel_settings: tuple = (), weight_layout: str = "out_in") -> MemoryTrace:
    """Forward + backward of the layer's GPU path with placeholders for the inputs, under a recording allocator.
    ``kernel_settings``: the environment's kernel settings (_moe_gpu.settings(), which decide e.g. whether rows are
    staged), part of the cache key."""
    gated = activation_info(activation)
    R = 2 * h if gated else h

    def inp(shape, dt):  # an input: a placeholder the recorder never saw (its bytes are not counted)
        return _array.Placeholder(shape, _array.storage_dtype(dt, True))

    f32, i32 = np.dtype(np.float32), np.dtype(np.int32)
    t = weight_layout == "in_out"
    x = inp((L, d), dtype)
    w13, w2 = inp((E, d, R) if t else (E, R, d), dtype), inp((E, h, d) if t else (E, d, h), dtype)
    gates, ids, dy = inp((L, K), f32), inp((L, K), i32), inp((L, d), dtype)
    b13 = inp((E, R), dtype) if bias[0] else None
    b2 = inp((E, d), dtype) if bias[1] else None
    sz = Sizes(L, d, h, R, E, K, dtype, gated)
    with _array.dry_run(arch, round_bytes) as run:
        y, saved = _moe_gpu.layer_forward(x, w13, w2, gates, ids, b13, b2, sz, activation, checkpoint, None, None,
                                          None, (chunks, block_tokens), weight_layout=weight_layout,
                                          act_in_operand=act_in_operand)
        forward_peak = run.peak
        forward_events = len(run.events)
        held = run.live - run.rounded(y.nbytes)  # the dispatch and the saved pre-activations
        grads = _moe_gpu.layer_backward(dy, saved, None, None, None, None, None, retain)
        backward_peak = run.peak  # includes the forward's (monotone), as the peak a pool reports after both
        grad_bytes = sum(run.rounded(g.nbytes) for g in grads if g is not None)
        events = tuple(run.events)
        del y, saved, grads
    bounds = chunk_bounds(L, chunks, block_tokens)
    est = MemoryEstimate(max(forward_peak, backward_peak), held, forward_peak, backward_peak, len(bounds),
                         max(t1 - t0 for t0, t1 in bounds), checkpoint, grad_bytes)
    return MemoryTrace(est, events, forward_events, round_bytes)


def moe_memory_trace(L: int, d: int, h: int, E: int, K: int, *, dtype="bfloat16", activation: str = "swiglu",
                     checkpoint: str = "ab", chunks: int = 1, bias: tuple[bool, bool] = (False, False),
                     block_tokens: int = BLOCK_TOKENS, sm90: bool = True, retain: bool = False,
                     round_bytes: int = _ROUND, act_in_operand: bool = False,
                     weight_layout: str = "out_in") -> MemoryTrace:
    """:func:`moe_memory` with the allocation events behind it, sizes rounded up to ``round_bytes`` (512: the pools'
    blocks, as :func:`moe_memory`; 1: the bytes asked for, as torch's ``requested_bytes`` statistic counts them)."""
    L, d, h, E, K, _ = _check(L, d, h, E, K, checkpoint, activation)
    check_weight_layout(weight_layout)
    dt = _dtype(dtype)
    if isinstance(round_bytes, bool) or int(round_bytes) < 1:
        raise ValueError(f"round_bytes must be an int >= 1, got {round_bytes!r}")
    chunk_bounds(L, chunks, block_tokens)  # validates chunks and block_tokens
    return _dry_run(L, d, h, E, K, dt, activation, checkpoint, int(chunks), (bool(bias[0]), bool(bias[1])),
                    int(block_tokens), "sm_90a" if sm90 else "sm_80", bool(retain), int(round_bytes),
                    bool(act_in_operand), tuple(sorted(_moe_gpu.settings().items())), weight_layout)


def moe_memory(L: int, d: int, h: int, E: int, K: int, *, dtype="bfloat16", activation: str = "swiglu",
               checkpoint: str = "ab", chunks: int = 1, bias: tuple[bool, bool] = (False, False),
               block_tokens: int = BLOCK_TOKENS, sm90: bool = True, retain: bool = False,
               act_in_operand: bool = False, weight_layout: str = "out_in") -> MemoryEstimate:
    """Predicted peak and held bytes of one GPU forward + backward of the layer beyond its inputs.

    Runs the layer's GPU path dry (see the module's docstring): no GPU, CuPy device or compiler is needed.

    Args:
        L, d, h, E, K: tokens, model dim, expert hidden dim, experts, top-k (as ``moe_forward``; 1 <= K <= E).
        dtype: x's dtype (name or numpy dtype; "bfloat16", "float16", "float32").
        activation, checkpoint: as ``moe_forward``.
        chunks: token chunks asked for (``chunk_bounds`` decides how many run).
        bias: (b13 given, b2 given).
        block_tokens: as ``moe_forward``.
        sm90: the GPU is a Hopper (sm_90a): 16-bit types run the sm_90a kernels and their tiles rather than the
            mma.sync ones; only the small per-slot partial sums and the chunk carry depend on it.
        retain: the backward keeps the saved pre-activations (``retain=True``, e.g. the PyTorch adapter), so
            under "ab" dz takes its own buffer instead of overwriting them.
        act_in_operand: as ``moe_forward`` (with sm90 and "ab": no (L*K, h) activations in the forward).
        weight_layout: as ``moe_forward`` ("in_out" weights, like interleaved gate/up rows, keep the activations
            under act_in_operand: there is no second GEMM that activates z for them).

    Raises:
        ValueError: an unknown policy, activation or weight layout, sizes < 1 (L < 0), K > E, chunks or
            block_tokens < 1.
        TypeError: a dtype other than bfloat16, float16, float32.
    """
    return moe_memory_trace(L, d, h, E, K, dtype=dtype, activation=activation, checkpoint=checkpoint, chunks=chunks,
                            bias=bias, block_tokens=block_tokens, sm90=sm90, retain=retain,
                            act_in_operand=act_in_operand, weight_layout=weight_layout).estimate


def act_in_operand_lowers_peak(L: int, d: int, h: int, E: int, K: int, *, dtype="bfloat16",
                               activation: str = "swiglu", checkpoint: str = "ab", chunks: int = 1,
                               bias: tuple[bool, bool] = (False, False), block_tokens: int = BLOCK_TOKENS,
                               weight_layout: str = "out_in") -> bool:
    """Whether ``moe_forward(act_in_operand=True)`` lowers the peak of a call whose framework allocates the
    gradients before the forward runs (XLA allocates a computation's outputs up front): such a call holds
    max(forward peak + gradients, backward peak), and ``act_in_operand`` lowers only the forward's peak. False where
    the backward's peak is the larger either way (then the faster second GEMM, on stored activations, costs no peak).
    Arguments as :func:`moe_memory`."""
    if checkpoint != "ab":
        return False

    def held(act_in_operand: bool) -> int:
        est = moe_memory(L, d, h, E, K, dtype=dtype, activation=activation, checkpoint=checkpoint, chunks=chunks,
                         bias=bias, block_tokens=block_tokens, act_in_operand=act_in_operand,
                         weight_layout=weight_layout)
        return max(est.forward_peak_bytes + est.gradient_bytes, est.backward_peak_bytes)

    return held(True) < held(False)


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
                device: int | None = None, free_bytes=None, reserved: int = 0,
                act_in_operand: bool = False, weight_layout: str = "out_in") -> ChunkPlan:
    """The smallest chunk count whose predicted peak (:func:`moe_memory`) fits ``budget``.

    Args:
        checkpoint: the policy to plan for; None lets the planner choose: "ab" (no recomputation) if some
            chunk count fits with it, else "none".
        budget: bytes (int), or a fraction in (0, 1] of the device's free memory (float); default 0.9 of the
            free memory of ``device`` (the current device when None), read with cudaMemGetInfo.
        free_bytes: a callable giving the free bytes instead (a framework's own count, e.g. torch's cache).
        reserved: bytes the caller holds beside the core's allocations during the call (an adapter's router
            logits, gates, dy ...): a plan fits when its predicted peak plus ``reserved`` fits the budget.
        the rest: as :func:`moe_memory`.

    Returns:
        :class:`ChunkPlan`. Distinct chunkings are tried in increasing count (chunk_bounds rounds chunks to
        multiples of ``block_tokens``); if none fits, the one with the smallest peak and ``fits=False``.
    """
    want = _budget_bytes(budget, device, free_bytes) - int(reserved)
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
                             block_tokens=block_tokens, sm90=sm90, retain=retain, act_in_operand=act_in_operand,
                             weight_layout=weight_layout)
            if est.peak_bytes <= want:
                return ChunkPlan(c, pol, est, want, True)
            if best is None or est.peak_bytes < best[1].peak_bytes:
                best = (c, est, pol)
    c, est, pol = best
    return ChunkPlan(c, pol, est, want, False)


__all__ = ["ChunkPlan", "MemoryEstimate", "MemoryTrace", "free_device_bytes", "moe_memory", "moe_memory_trace",
           "plan_chunks"]
