"""The dispatch build: which slots each expert owns, sort-free and atomic-free (MoEBlaze's three phases).

``build_dispatch(expert_ids, num_experts)`` turns top-k routing, ``expert_ids`` (L, K), into the
layout the expert kernels read: the L*K (token, k) pairs listed expert by expert, within an expert by
token then k (deterministic, the same bits every run). An id of -1 drops its pair: it goes to no expert
and is listed after every expert's pairs. CUDA arrays run ``cuda/dispatch.cu`` in at most
three launches (count, scan over tiles, scatter) with no atomics and no host synchronisation, so the
build can be captured in a CUDA graph; CPU arrays run ``blazecore/reference/dispatch.py``.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _array, _compile, _validate

_FILE = "dispatch.cu"
_ID_TYPES = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}

# Tile configurations (BLOCK threads, ITEMS pairs per thread): a tile is BLOCK * ITEMS consecutive
# pairs, one block each. ITEMS = 16 is the most that fits the scatter kernel's 64-register cap
# without spills; larger tiles come from larger blocks.
_TILES = ((256, 8), (256, 16), (512, 16))
_SCAN_BLOCK = 1024
_CHECK_BLOCK = 256
_CHECK_MAX_BLOCKS = 1024  # the host reads one int per check block
# The scatter blocks sum the raw tile counts themselves (no scan launch) while there are at most
# _DIRECT_SUM_TILES tiles and num_tiles * E <= _DIRECT_SUM_MAX: a thread then reads at most 32 L2-resident
# counts (one column, or E / 256 columns of <= 32 / (E / 256) rows), cheaper than another launch.
_DIRECT_SUM_TILES = 32
_DIRECT_SUM_MAX = 8192
_DEFAULT_SMEM = 48 * 1024

MODE_SINGLE_TILE, MODE_DIRECT_SUM, MODE_SCANNED = 0, 1, 2


def _kernel_names() -> list[str]:
    names = [f"dispatch_scan_tiles<{_SCAN_BLOCK}>"]
    for idt in _ID_TYPES.values():
        names.append(f"dispatch_check<{idt}>")
        for block, items in _TILES:
            names.append(f"dispatch_count<{block}, {items}, {idt}>")
            names.append(f"dispatch_scatter<{block}, {items}, {idt}>")
    return names


_KERNEL_NAMES = tuple(_kernel_names())
_compile.register_kernels(_FILE, _KERNEL_NAMES)


@dataclass(repr=False, eq=False)
class Dispatch:
    """Where every (token, k) pair of a top-k routing goes, expert by expert.

    All arrays are int32 and live where ``expert_ids`` lived (cupy on the GPU, numpy on the CPU).
    With N = num_tokens * top_k and E = num_experts:

    - ``expert_offsets`` (E + 1,): expert e owns slots ``expert_offsets[e] : expert_offsets[e + 1]``;
      ``expert_offsets[0] == 0`` and ``expert_offsets[E]`` is the number of routed pairs (N when no id is
      -1).
    - ``slot_token`` (N,): the token of each slot.
    - ``slot_k`` (N,): which of the token's K choices each slot is (``expert_ids[slot_token, slot_k]``
      is the slot's expert, or -1 for the slots ``expert_offsets[E]:`` of the dropped pairs).
    - ``pair_slot`` (num_tokens, top_k): the slot of each routed pair, the inverse of (slot_token,
      slot_k); -1 for a dropped pair.

    Within an expert, slots are ordered by token, then k; the dropped pairs follow the last expert's, in
    the same order.
    """

    expert_offsets: Any
    slot_token: Any
    slot_k: Any
    pair_slot: Any
    num_tokens: int
    top_k: int
    num_experts: int

    def __repr__(self) -> str:  # shapes only: no device read
        where = "cpu" if isinstance(self.slot_token, np.ndarray) else "gpu"
        return (
            f"Dispatch(num_tokens={self.num_tokens}, top_k={self.top_k}, num_experts={self.num_experts}, "
            f"{where}, int32 expert_offsets{tuple(self.expert_offsets.shape)}, slot_token"
            f"{tuple(self.slot_token.shape)}, slot_k{tuple(self.slot_k.shape)}, "
            f"pair_slot{tuple(self.pair_slot.shape)})"
        )

    def counts(self):
        """Pairs per expert, (E,) int32, same backend as the fields."""
        return self.expert_offsets[1:] - self.expert_offsets[:-1]


# ---------------------------------------------------------------------------------------------
# Host-side checks (no device access)
# ---------------------------------------------------------------------------------------------


def check_sizes(num_tokens: int, top_k: int, num_experts: int) -> None:
    """Size rules of a dispatch, before anything is allocated: 1 <= E, K <= E, L * K < 2**31."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if top_k > num_experts:
        raise ValueError(f"expert_ids: top_k = {top_k} exceeds num_experts = {num_experts} "
                         "(each token picks K distinct experts)")
    _validate.check_int32_range(num_tokens * top_k, f"num_tokens * top_k ({num_tokens} * {top_k})")


DROPPED = -1  # the expert id of a pair that goes to no expert


def _describe_bad(row: np.ndarray, t: int, k: int, num_experts: int) -> str:
    v = int(row[k])
    if not 0 <= v < num_experts:
        tail = " and is not -1 (a dropped pair)" if v < 0 else ""
        return f"expert_ids[{t}, {k}] = {v} is outside [0, {num_experts}){tail}"
    k0 = int(np.flatnonzero(row[:k] == v)[0])
    return (f"expert_ids[{t}, {k}] = {v} repeats expert_ids[{t}, {k0}]: "
            f"a token must pick {row.shape[0]} distinct experts")


def _first_bad_cpu(ids: np.ndarray, num_experts: int) -> int:
    """Smallest flat index t*K + k of an id outside [0, E) other than -1, or of an id in [0, E) equal to one at a
    smaller k; -1 if none."""
    bad = ((ids < 0) | (ids >= num_experts)) & (ids != DROPPED)
    if ids.shape[1] > 1:
        order = np.argsort(ids, axis=1, kind="stable")
        srt = np.take_along_axis(ids, order, axis=1)
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] != DROPPED)  # the later k of an equal pair (stable order)
        rows, cols = np.nonzero(dup)
        bad[rows, order[rows, cols + 1]] = True
    flat = np.flatnonzero(bad.reshape(-1))
    return int(flat[0]) if flat.size else -1


def check_ids_host(expert_ids: np.ndarray, num_experts: int) -> None:
    """Raise ValueError naming the first (token, k) of the (L, K) host array ``expert_ids`` whose id is outside
    [0, num_experts) and not -1, or repeats an expert earlier in its row (what ``build_dispatch(..., validate=True)``
    checks)."""
    ids = np.asarray(expert_ids)
    if ids.size:
        first = _first_bad_cpu(ids, num_experts)
        if first >= 0:
            t, k = divmod(first, ids.shape[1])
            raise ValueError(_describe_bad(ids[t], t, k, num_experts))


# ---------------------------------------------------------------------------------------------
# GPU: plan, functions, launchers
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """How the GPU build runs for N pairs: tile shape, tile count and how tile bases are found."""

    block: int
    items: int
    num_tiles: int
    mode: int  # MODE_SINGLE_TILE: one launch; MODE_DIRECT_SUM: two; MODE_SCANNED: three

    @property
    def tile(self) -> int:
        return self.block * self.items


def plan(n_pairs: int, num_experts: int, tile: tuple[int, int] | None = None, mode: int | None = None) -> Plan:
    """The launch plan for ``n_pairs`` pairs. ``tile=(block, items)`` and ``mode`` force a choice (tests
    run every configuration on small inputs); MODE_DIRECT_SUM and MODE_SCANNED work for any tile count.

    Up to 8192 pairs, one tile (one launch). Up to 128k pairs, 2048-pair tiles (<= 64 tiles); up to
    2M, 4096 (<= 512 tiles, about 4 per SM on 132 SMs); beyond, 8192, which halves the (tiles, E)
    count matrix and the per-tile work over E against 4096. Above E = 1024 the 512-thread tile is
    avoided: its warp counters (32 * E bytes) would crowd shared memory.
    """
    if tile is None:
        if n_pairs <= 8192 and num_experts <= 1024:
            tile = next(t for t in _TILES if t[0] * t[1] >= n_pairs)
        elif n_pairs <= 1 << 17:
            tile = _TILES[0]
        elif n_pairs <= 1 << 21 or num_experts > 1024:
            tile = _TILES[1]
        else:
            tile = _TILES[2]
    block, items = tile
    num_tiles = max(1, -(-n_pairs // (block * items)))
    if mode is not None:
        if mode not in (MODE_SINGLE_TILE, MODE_DIRECT_SUM, MODE_SCANNED) or (
            mode == MODE_SINGLE_TILE and num_tiles > 1
        ):
            raise ValueError(f"mode {mode} does not fit {num_tiles} tiles")
    elif num_tiles == 1:
        mode = MODE_SINGLE_TILE
    elif num_tiles <= _DIRECT_SUM_TILES and num_tiles * num_experts <= _DIRECT_SUM_MAX:
        mode = MODE_DIRECT_SUM
    else:
        mode = MODE_SCANNED
    return Plan(block, items, num_tiles, mode)


_cached_plan = functools.lru_cache(maxsize=4096)(plan)  # the op's hot path: no dataclass built per call


def _round16(n: int) -> int:
    return (n + 15) & ~15


def count_smem(p: Plan, num_experts: int) -> int:
    return 2 * (p.block // 32) * (num_experts + 1)  # one bucket more, the dropped pairs'


def scatter_smem(p: Plan, num_experts: int) -> int:
    nb = num_experts + 1
    return 3 * _round16(4 * nb) + max(2 * (p.block // 32) * nb, 4 * p.tile)


def workspace_size(p: Plan, num_experts: int) -> int:
    """int32 entries of the build's workspace: the (tiles, E + 1) counts and the E + 1 totals (0 for one tile)."""
    return 0 if p.mode == MODE_SINGLE_TILE else (p.num_tiles + 1) * (num_experts + 1)


def check_smem(top_k: int, num_experts: int) -> int:
    return 0 if top_k <= 32 else (_CHECK_BLOCK // 32) * _round16(num_experts)


_fn_cache: dict = {}
_smem_limit: dict = {}


def _device_smem_limit(dev: int) -> int:
    if _array.dry() is not None:
        return 1 << 30  # a dry run models memory, not a device's shared-memory limit
    lim = _smem_limit.get(dev)
    if lim is None:
        import cupy

        lim = int(cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, dev))
        _smem_limit[dev] = lim
    return lim


def _function(dev: int, name: str, smem: int):
    """The cached Function for ``name`` on device ``dev``, opted in to ``smem`` dynamic bytes."""
    if _array.dry() is not None:
        return _array.no_launch
    entry = _fn_cache.get((dev, name))
    if entry is None:
        entry = [_compile.get_function(_FILE, name, module_names=_KERNEL_NAMES), _DEFAULT_SMEM]
        _fn_cache[(dev, name)] = entry
    if smem > entry[1]:  # above 48 KB a kernel must opt in, once per function
        from cupy_backends.cuda.api import driver

        driver.funcSetAttribute(entry[0].ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        entry[1] = smem
    return entry[0]


def _check_smem_fits(dev: int, need: int, num_experts: int) -> None:
    limit = _device_smem_limit(dev)
    if need > limit:
        raise ValueError(f"num_experts = {num_experts} needs {need} bytes of shared memory per block; "
                         f"this GPU allows {limit} (E <= 2048 fits every supported GPU)")


def check_blocks(num_tokens: int, top_k: int) -> int:
    """Grid of the check kernel: a warp step covers 32 // next_pow2(K) rows (K <= 32) or one row."""
    rows_per_warp = 32 // (1 << max(0, top_k - 1).bit_length()) if top_k <= 32 else 1
    warps = -(-num_tokens // rows_per_warp)
    return max(1, min(_CHECK_MAX_BLOCKS, -(-warps // (_CHECK_BLOCK // 32))))


def _check_int32_out(arr, name: str, shape: tuple) -> None:
    _validate.check_array(arr, name, (np.int32,), shape)


def _check_ids_gpu(ids, num_experts: int) -> int:
    """Launcher-level checks of GPU ids; returns the device id."""
    import cupy

    if not _array.is_gpu(ids):
        raise ValueError("expert_ids: launchers take CUDA arrays")
    _validate.check_dtype(ids, "expert_ids", tuple(_ID_TYPES))
    _validate.check_ndim(ids, "expert_ids", 2, "(num_tokens, top_k) expert ids")
    check_sizes(int(ids.shape[0]), int(ids.shape[1]), num_experts)
    _validate.check_contiguous(ids, "expert_ids")
    dev = ids.device.id
    if dev != cupy.cuda.runtime.getDevice():
        raise ValueError(f"expert_ids is on GPU {dev} but the current device is {cupy.cuda.runtime.getDevice()} "
                         f"(use `with cupy.cuda.Device({dev}):`)")
    return dev


def launch_check(ids, num_experts: int, block_first_bad, stream=None) -> None:
    """Launcher of ``dispatch_check``: ids (L, K) int32/int64 CUDA, L*K >= 1; ``block_first_bad``
    (check_blocks(L, K),) int32 receives each block's smallest bad flat index t*K + k, or 2**31 - 1.
    """
    dev = _check_ids_gpu(ids, num_experts)
    if ids.size == 0:
        raise ValueError("expert_ids: nothing to check (L * K == 0)")
    _check_int32_out(block_first_bad, "block_first_bad", (check_blocks(*ids.shape),))
    _validate.same_device({"expert_ids": ids, "block_first_bad": block_first_bad})
    _check_smem_fits(dev, check_smem(int(ids.shape[1]), num_experts), num_experts)
    _launch_check(dev, ids, num_experts, block_first_bad, _array.current_stream(stream))


def _launch_check(dev: int, ids, num_experts: int, block_first_bad, stream) -> None:
    num_tokens, top_k = ids.shape
    smem = check_smem(top_k, num_experts)
    fn = _function(dev, f"dispatch_check<{_ID_TYPES[ids.dtype]}>", smem)
    fn((int(block_first_bad.shape[0]),), (_CHECK_BLOCK,),
       (ids, np.int32(num_tokens), np.int32(top_k), np.int32(num_experts), block_first_bad),
       shared_mem=smem, stream=stream)


def launch_build(ids, num_experts: int, p: Plan, workspace, expert_offsets, slot_token, slot_k, pair_slot,
                 stream=None) -> None:
    """Launcher of the build for plan ``p`` (see :func:`plan`), all CUDA arrays on one device:

    ids (L, K) int32/int64 with L*K >= 1; workspace (:func:`workspace_size`,) int32, or None when
    ``p.mode == MODE_SINGLE_TILE``; expert_offsets (E + 1,), slot_token (L*K,), slot_k (L*K,),
    pair_slot (L, K), int32 outputs.
    """
    dev = _check_ids_gpu(ids, num_experts)
    num_tokens, top_k = (int(s) for s in ids.shape)
    n = num_tokens * top_k
    if n == 0:
        raise ValueError("expert_ids: nothing to build (L * K == 0); build_dispatch handles it")
    if p.num_tiles != -(-n // p.tile) or (p.block, p.items) not in _TILES:
        raise ValueError(f"plan {p} does not fit {n} pairs")
    arrays = {"expert_ids": ids, "expert_offsets": expert_offsets, "slot_token": slot_token, "slot_k": slot_k,
              "pair_slot": pair_slot}
    _check_int32_out(expert_offsets, "expert_offsets", (num_experts + 1,))
    _check_int32_out(slot_token, "slot_token", (n,))
    _check_int32_out(slot_k, "slot_k", (n,))
    _check_int32_out(pair_slot, "pair_slot", (num_tokens, top_k))
    if p.mode != MODE_SINGLE_TILE:
        _check_int32_out(workspace, "workspace", (workspace_size(p, num_experts),))
        arrays["workspace"] = workspace
    _validate.same_device(arrays)
    _check_smem_fits(dev, scatter_smem(p, num_experts), num_experts)
    _launch_build(dev, ids, num_experts, p, workspace, expert_offsets, slot_token, slot_k, pair_slot,
                  _array.current_stream(stream))


def _launch_build(dev: int, ids, num_experts: int, p: Plan, workspace, expert_offsets, slot_token, slot_k,
                  pair_slot, stream) -> None:
    num_tokens, top_k = ids.shape
    idt = _ID_TYPES[ids.dtype]
    grid = (p.num_tiles,)
    n32, e32 = np.int32(num_tokens * top_k), np.int32(num_experts)
    if p.mode == MODE_SINGLE_TILE:
        tile_counts = totals = expert_offsets  # never read in this mode; any device pointer will do
    else:
        split = p.num_tiles * (num_experts + 1)
        tile_counts, totals = workspace[:split], workspace[split:]
        c_smem = count_smem(p, num_experts)
        fn = _function(dev, f"dispatch_count<{p.block}, {p.items}, {idt}>", c_smem)
        fn(grid, (p.block,), (ids, n32, e32, tile_counts), shared_mem=c_smem, stream=stream)
        if p.mode == MODE_SCANNED:
            fn = _function(dev, f"dispatch_scan_tiles<{_SCAN_BLOCK}>", 0)
            # over the E + 1 buckets (the dropped pairs' last)
            fn((-(-(num_experts + 1) // 8),), (_SCAN_BLOCK,),
               (tile_counts, totals, np.int32(p.num_tiles), np.int32(num_experts + 1)), stream=stream)
    s_smem = scatter_smem(p, num_experts)
    fn = _function(dev, f"dispatch_scatter<{p.block}, {p.items}, {idt}>", s_smem)
    fn(grid, (p.block,),
       (ids, n32, np.int32(top_k), e32, tile_counts, totals, np.int32(p.mode), np.int32(p.num_tiles),
        expert_offsets, slot_token, slot_k, pair_slot),
       shared_mem=s_smem, stream=stream)


# ---------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------


def _intake(expert_ids, num_experts):
    ids = _array.asarray(expert_ids, "expert_ids")
    dt = _validate.check_integer(ids, "expert_ids")
    if dt not in _ID_TYPES:
        raise TypeError(f"expert_ids: dtype {dt.name} not supported (expected int32 or int64)")
    _validate.check_ndim(ids, "expert_ids", 2, "(num_tokens, top_k) expert ids")
    if isinstance(num_experts, (bool, np.bool_)):
        raise TypeError(f"num_experts must be an integer, got bool ({num_experts})")
    try:
        num_experts = operator.index(num_experts)
    except TypeError:
        raise TypeError(f"num_experts must be an integer, got {type(num_experts).__name__}") from None
    num_tokens, top_k = (int(s) for s in ids.shape)
    check_sizes(num_tokens, top_k, num_experts)
    _validate.check_contiguous(ids, "expert_ids")
    return ids, num_experts, num_tokens, top_k


def _validate_gpu(dev: int, ids, num_experts: int, stream) -> None:
    num_tokens, top_k = ids.shape
    buf = _array.empty_gpu((check_blocks(num_tokens, top_k),), np.int32).view
    _launch_check(dev, ids, num_experts, buf, stream)
    if _array.dry() is not None:
        return  # nothing ran, nothing to read
    first = int(buf.get(stream=stream).min())  # the one device read of validate=True (synchronises)
    if first != 2**31 - 1:
        t, k = divmod(first, top_k)
        raise ValueError(_describe_bad(ids[t].get(stream=stream), t, k, num_experts))


def _build_gpu(ids, num_experts: int, num_tokens: int, top_k: int, stream, validate: bool,
               tile: tuple[int, int] | None = None, mode: int | None = None) -> Dispatch:
    """The GPU op after intake; ``tile`` and ``mode`` force a plan (tests cover every one)."""
    dry = _array.dry() is not None
    dev = ids.device.id
    if not dry:
        import cupy

        if dev != cupy.cuda.runtime.getDevice():
            raise ValueError(f"expert_ids is on GPU {dev} but the current device is {cupy.cuda.runtime.getDevice()} "
                             f"(use `with cupy.cuda.Device({dev}):`)")
    n = num_tokens * top_k
    p = _cached_plan(n, num_experts, tile, mode) if n else None
    if p is not None:
        _check_smem_fits(dev, max(scatter_smem(p, num_experts), check_smem(top_k, num_experts)), num_experts)
        if validate:
            _validate_gpu(dev, ids, num_experts, stream)
    offsets = _array.empty_gpu((num_experts + 1,), np.int32).view
    slot_token = _array.empty_gpu((n,), np.int32).view
    slot_k = _array.empty_gpu((n,), np.int32).view
    pair_slot = _array.empty_gpu((num_tokens, top_k), np.int32).view
    if p is None:
        if not dry:
            cupy.cuda.runtime.memsetAsync(offsets.data.ptr, 0, 4 * (num_experts + 1), stream.ptr)
    else:
        workspace = None
        if p.mode != MODE_SINGLE_TILE:
            workspace = _array.empty_gpu((workspace_size(p, num_experts),), np.int32).view
        _launch_build(dev, ids, num_experts, p, workspace, offsets, slot_token, slot_k, pair_slot, stream)
    return Dispatch(offsets, slot_token, slot_k, pair_slot, num_tokens, top_k, num_experts)


def build_dispatch(expert_ids, num_experts: int, *, validate: bool = True, stream=None) -> Dispatch:
    """Build the dispatch of a top-k routing, sort-free and atomic-free.

    Args:
        expert_ids: (L, K) int32 or int64, C-contiguous, any DLPack array. Row t holds the K distinct
            experts token t is routed to, in [0, num_experts), or -1 (any number of times) for a pair
            that goes to no expert (dropped: listed after the experts' slots, ``pair_slot`` -1). CUDA
            arrays run the kernels (at most three launches); CPU arrays run the NumPy reference.
        num_experts: E >= K.
        validate: check the ids' values (in range or -1, no expert twice in a row) before building and raise
            ValueError naming the first bad (token, k). On the GPU this is one check kernel and a
            device-to-host read, which synchronises the stream; pass ``validate=False`` to skip it
            (required under CUDA graph capture, and the fast path). Unvalidated kernels still never
            read or write out of bounds: a negative id drops its pair, one >= E is clamped to E - 1, and a repeated id
            is placed like any other, so bad ids give a well-formed but meaningless dispatch (the CPU
            reference clamps too, but leaves the entries of a repeated id at -1).
        stream: cupy Stream or raw ``cudaStream_t`` int for GPU inputs (default: cupy's current
            stream). Outputs and workspace are allocated, and kernels launched, under it.

    Returns:
        Dispatch with int32 ``expert_offsets`` (E+1,), ``slot_token`` (L*K,), ``slot_k`` (L*K,),
        ``pair_slot`` (L, K) on the input's device; GPU arrays come from the pluggable allocator.

    Raises:
        TypeError: non-integer ids, or integers other than int32/int64.
        ValueError: ids not 2-D, K > E, L*K >= 2**31, not C-contiguous, on another GPU than the
            current one, a stream given for CPU ids, E too large for shared memory, or (validate=True)
            a bad id value.
    """
    ids, num_experts, num_tokens, top_k = _intake(expert_ids, num_experts)
    if not _array.is_gpu(ids):
        if stream is not None:
            raise ValueError("stream given, but expert_ids is a CPU array (streams apply to CUDA arrays)")
        if validate:
            check_ids_host(ids, num_experts)
        from .reference.dispatch import build_dispatch as reference_build

        offsets, slot_token, slot_k, pair_slot = reference_build(ids, num_experts)
        # the caller's array type (torch, JAX) where it passed one
        offsets, slot_token, slot_k, pair_slot = (_array.like_caller(a, expert_ids)
                                                  for a in (offsets, slot_token, slot_k, pair_slot))
        return Dispatch(offsets, slot_token, slot_k, pair_slot, num_tokens, top_k, num_experts)
    if stream is None:
        return _build_gpu(ids, num_experts, num_tokens, top_k, _array.current_stream(None), validate)
    s = _array.current_stream(stream)
    with s:  # allocations belong to the stream the kernels run on
        return _build_gpu(ids, num_experts, num_tokens, top_k, s, validate)
