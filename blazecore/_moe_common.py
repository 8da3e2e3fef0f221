"""What the MoE layer's modules share: activations, checkpoint policies, token chunks, the saved record and
the gradient buffers. :mod:`blazecore.moe` (the public ops) and the GPU path (:mod:`blazecore._moe_gpu`) and
memory model (:mod:`blazecore.memory`) below it import this; it imports neither.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import numpy as np

from . import _array, _validate
from .dispatch import Dispatch

# name -> gated (the first GEMM yields [a | b], 2h rows) or not (h rows)
_GATED = {"swiglu": True, "geglu": True, "gelu": False, "silu": False, "relu2": False, "swiglu_oai": True}
ACTIVATIONS = tuple(_GATED)
CHECKPOINTS = ("ab", "none")
# Token-block size of the weight-gradient reductions (see chunk_bounds): chunks start on these boundaries.
BLOCK_TOKENS = 16384


# A gated activation's name with this suffix reads w13's 2h rows (and b13, and the saved pre-activations) as
# interleaved (gate, up) pairs [g0, u0, g1, u1, ...] instead of [gate rows; up rows] (gpt-oss stores them so).
INTERLEAVED = "_interleaved"
# How w13 and w2 are stored per expert: "out_in" (E, 2h or h, d) and (E, d, h), as nn.Linear's weight;
# "in_out" (E, d, 2h or h) and (E, h, d), the transposes (gpt-oss, Llama 4). Gradients come in the same layout.
WEIGHT_LAYOUTS = ("out_in", "in_out")
# the expert GEMMs' kernel families on the GPU: "wgmma" (sm_90a, bf16 / fp16 "out_in" weights; elsewhere the
# layer falls back to mma.sync) and "mma_sync" (every GPU and dtype)
GEMM_PATHS = ("wgmma", "mma_sync")


def check_gemm_path(gemm_path) -> None:
    if gemm_path is not None and gemm_path not in GEMM_PATHS:
        raise ValueError(f"gemm_path must be one of {GEMM_PATHS} or None (the default), got {gemm_path!r}")


def split_activation(name: str) -> tuple[str, bool]:
    """(base activation, interleaved) of an activation name; ValueError for an unknown one."""
    base = name[:-len(INTERLEAVED)] if isinstance(name, str) and name.endswith(INTERLEAVED) else name
    if not isinstance(base, str) or base not in _GATED or (base != name and not _GATED[base]):
        raise ValueError(f"unknown activation {name!r} (expected one of {', '.join(ACTIVATIONS)}, or a gated one "
                         f"with the suffix {INTERLEAVED!r} for interleaved gate/up rows)")
    return base, base != name


def activation_info(name: str) -> bool:
    """Whether activation ``name`` is gated (hcur = act(a) * b from 2h first-GEMM rows).

    Names: "swiglu" silu(a)*b, "geglu" gelu_tanh(a)*b, "swiglu_oai" gpt-oss's clamped SwiGLU
    a' sigmoid(1.702 a') (b' + 1) with a' = min(a, 7), b' = clip(b, -7, 7) (gated); "gelu" gelu_tanh(z),
    "silu" silu(z), "relu2" max(z, 0)**2 (non-gated). A gated name may end with "_interleaved" (INTERLEAVED):
    w13's rows then alternate gate and up. Raises ValueError for any other name.
    """
    return _GATED[split_activation(name)[0]]


def check_weight_layout(layout) -> str:
    if not isinstance(layout, str) or layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout must be one of {', '.join(map(repr, WEIGHT_LAYOUTS))}, got {layout!r}")
    return layout


def weight_dims(w13_shape, w2_shape, layout: str) -> tuple[tuple, tuple]:
    """The (E, R, d) and (E, d, h) shapes of w13 and w2 given in ``layout``."""
    if layout == "in_out":
        return (w13_shape[0], w13_shape[2], w13_shape[1]), (w2_shape[0], w2_shape[2], w2_shape[1])
    return tuple(w13_shape), tuple(w2_shape)


def _count(v, name: str, least: int) -> int:
    if isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got bool ({v})")
    try:
        v = operator.index(v)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(v).__name__}") from None
    if v < least:
        raise ValueError(f"{name} must be >= {least}, got {v}")
    return v


def chunk_bounds(L: int, chunks: int, block_tokens: int = BLOCK_TOKENS) -> list[tuple[int, int]]:
    """The token ranges [t0, t1) that ``chunks`` chunks of L tokens run as (at most ``chunks`` of them).

    Chunks are equal runs of tokens except the last, each a multiple of ``block_tokens`` long: the weight-
    gradient reductions restart their tiles at every multiple of ``block_tokens`` (chunked or not), so a chunk
    boundary never splits a tile and chunked gradients are bit-identical to unchunked ones. Hence fewer chunks
    than asked when L / chunks < block_tokens (L <= block_tokens: one chunk). Raises ValueError for L < 0,
    chunks < 1 or block_tokens < 1, TypeError for a non-integer.
    """
    L, chunks, block_tokens = _count(L, "L (tokens)", 0), _count(chunks, "chunks", 1), _count(block_tokens,
                                                                                           "block_tokens", 1)
    if chunks <= 1 or L <= block_tokens:
        return [(0, L)]
    per = -(-L // chunks)
    per = -(-per // block_tokens) * block_tokens
    return [(t0, min(t0 + per, L)) for t0 in range(0, L, per)]


def check_chunking(chunks, block_tokens) -> None:
    if isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer)) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1 or \"auto\", got {chunks!r}")
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, (int, np.integer)) or block_tokens < 1:
        raise ValueError(f"block_tokens must be an int >= 1, got {block_tokens!r}")


class MoEGrads(NamedTuple):
    """Gradients of the layer. dx (L, d) in x's dtype; dw13 (E, R, d), dw2 (E, d, h), db13 (E, R),
    db2 (E, d) in the weights' dtype (db13 / db2 are None without the bias); dgates (L, K) float32."""

    dx: Any
    dw13: Any
    dw2: Any
    dgates: Any
    db13: Any
    db2: Any


@dataclass(eq=False)
class MoESaved:
    """What :func:`moe_forward` keeps for :func:`moe_backward`.

    The arrays are the intake views of the forward's inputs (cupy on the GPU, numpy on the CPU):
    they must not be modified before the backward. ``ab`` holds the pre-activations, (L*K, R) in x's
    dtype, in expert-slot order, under policy "ab" (None under "none"). ``extra`` is private to the
    GPU path (workspaces or tensors its kernels keep between forward and backward). ``chunks`` and
    ``block_tokens`` are the forward's token chunking (the backward runs the same chunks); with several
    chunks ``ab``'s rows [t0*K, t1*K) hold chunk [t0, t1)'s pre-activations in its own expert-slot order,
    ``chunk_dispatches`` the dispatch of each chunk, and ``dispatch`` the caller's dispatch (or None).
    """

    x: Any
    w13: Any
    w2: Any
    gates: Any
    expert_ids: Any
    dispatch: Dispatch | None
    activation: str
    checkpoint: str
    b13: Any = None
    b2: Any = None
    ab: Any = None
    extra: dict = field(default_factory=dict)
    consumed: bool = False  # a backward without retain=True used ``ab`` as scratch
    chunks: int = 1
    block_tokens: int = BLOCK_TOKENS
    chunk_dispatches: tuple = ()
    weight_layout: str = "out_in"  # how w13 and w2 (and so dw13, dw2) are stored: one of WEIGHT_LAYOUTS
    gemm_path: str | None = None  # the forward's GEMM_PATHS choice (None: the default), which the backward keeps

    def held_bytes(self) -> int:
        """Bytes this record keeps alive beyond the layer's inputs: the dispatch, ``ab`` and ``extra``.

        An array reachable twice (``ab`` and a view of it in ``extra``) counts once.
        """
        held = [getattr(dp, f.name) for dp in (self.dispatch, *self.chunk_dispatches) if dp is not None
                for f in fields(dp)]
        held += [self.ab, *self.extra.values()]
        seen = {}
        for a in held:
            if a is None or not (hasattr(a, "__dlpack__") or isinstance(a, np.ndarray)):
                continue
            v = _array.asarray(a)
            ptr = v.data.ptr if _array.is_gpu(v) else v.ctypes.data
            seen[(ptr, int(v.nbytes))] = int(v.nbytes)
        return sum(seen.values())


class Sizes(NamedTuple):
    L: int
    d: int
    h: int
    R: int
    E: int
    K: int
    dtype: np.dtype
    gated: bool


def check_gpu_device(arrays: dict, dev: int) -> None:
    for name, a in arrays.items():
        if a is not None and _array.is_gpu(a) and a.device.id != dev:
            raise ValueError(f"{name} is on GPU {a.device.id}, the inputs on GPU {dev}")


def check_dispatch(disp, L: int, K: int, E: int, gpu: bool, dev: int | None) -> None:
    if not isinstance(disp, Dispatch):
        raise TypeError(f"dispatch: expected a blazecore.dispatch.Dispatch, got {type(disp).__name__}")
    for name, want in (("num_tokens", L), ("top_k", K), ("num_experts", E)):
        got = getattr(disp, name)
        if got != want:
            raise ValueError(f"dispatch.{name} = {got} does not match the inputs ({want})")
    for name, shape in (("expert_offsets", (E + 1,)), ("slot_token", (L * K,)), ("slot_k", (L * K,)),
                        ("pair_slot", (L, K))):
        a = getattr(disp, name)
        what = f"dispatch.{name}"
        if _array.is_gpu(a) != gpu:
            raise ValueError(f"{what} is on the {'GPU' if _array.is_gpu(a) else 'CPU'}, "
                             f"the inputs on the {'GPU' if gpu else 'CPU'}")
        _validate.check_array(a, what, (np.int32,), shape)
        if gpu and a.device.id != dev:
            raise ValueError(f"{what} is on GPU {a.device.id}, the inputs on GPU {dev}")


def grad_outs(saved: MoESaved, gpu: bool, out_dx, out_dw13, out_dw2, out_dgates):
    x, w13, w2, gates = saved.x, saved.w13, saved.w2, saved.gates
    dtype = _array.logical_dtype(x)
    dx = _array.out_or_empty(out_dx, x.shape, dtype, gpu, "out_dx")
    dw13 = _array.out_or_empty(out_dw13, w13.shape, dtype, gpu, "out_dw13")
    dw2 = _array.out_or_empty(out_dw2, w2.shape, dtype, gpu, "out_dw2")
    dgates = _array.out_or_empty(out_dgates, gates.shape, _array.logical_dtype(gates), gpu, "out_dgates")
    db13 = None if saved.b13 is None else _array.out_or_empty(None, saved.b13.shape, dtype, gpu, "db13")
    db2 = None if saved.b2 is None else _array.out_or_empty(None, saved.b2.shape, dtype, gpu, "db2")
    if gpu:
        check_gpu_device({"out_dx": dx.view, "out_dw13": dw13.view, "out_dw2": dw2.view,
                           "out_dgates": dgates.view}, x.device.id)
    return dx, dw13, dw2, dgates, db13, db2


def user(o):
    return None if o is None else o.user
