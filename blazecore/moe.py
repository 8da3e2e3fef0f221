"""The MoE layer: expert FFNs over a top-k routing and the gate-weighted combine, forward and backward.

``moe_forward(x, w13, w2, gates, expert_ids)`` returns ``(y, saved)``; ``moe_backward(dy, saved)``
returns :class:`MoEGrads`. For token t and its k-th expert e = expert_ids[t, k]:

    z = w13[e] @ x[t] (+ b13[e]);  gated: hcur = act(z[:h]) * z[h:];  non-gated: hcur = act(z)
    y[t] = sum_k gates[t, k] * (w2[e] @ hcur (+ b2[e]))

Inputs are any DLPack arrays. CUDA arrays run the kernels of ``blazecore._moe_gpu``; CPU arrays run
the float64 NumPy reference (``blazecore.reference.moe``) and cast the results to the input dtypes,
so the whole API works on a machine without a GPU. Every check below runs before anything is
launched; the GPU path never synchronises with the host when a ``dispatch`` is passed in (CUDA-graph
capturable).

Checkpoint policies (what ``saved`` holds between forward and backward besides the inputs and the
dispatch): "ab" keeps the pre-activations z of every slot, (L*K, R) in x's dtype in expert-slot order
(R = 2h for gated activations, columns [a | b]; R = h otherwise), and the backward recomputes act and
hcur from them; "none" keeps nothing more and the backward recomputes the first GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import numpy as np

from . import _array, _validate
from .dispatch import Dispatch, build_dispatch

# name -> gated (the first GEMM yields [a | b], 2h rows) or not (h rows)
_GATED = {"swiglu": True, "geglu": True, "gelu": False, "silu": False, "relu2": False, "swiglu_oai": True}
ACTIVATIONS = tuple(_GATED)
CHECKPOINTS = ("ab", "none")
# Token-block size of the weight-gradient reductions (see chunk_bounds): chunks start on these boundaries.
BLOCK_TOKENS = 16384
_FLOAT_TYPES = (np.float32, np.float16, _array.BF16)


def activation_info(name: str) -> bool:
    """Whether activation ``name`` is gated (hcur = act(a) * b from 2h first-GEMM rows).

    Names: "swiglu" silu(a)*b, "geglu" gelu_tanh(a)*b, "swiglu_oai" gpt-oss's clamped SwiGLU
    a' sigmoid(1.702 a') (b' + 1) with a' = min(a, 7), b' = clip(b, -7, 7) (gated); "gelu" gelu_tanh(z),
    "silu" silu(z), "relu2" max(z, 0)**2 (non-gated). Raises ValueError for any other name.
    """
    try:
        return _GATED[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown activation {name!r} (expected one of {', '.join(ACTIVATIONS)})") from None


def moe_flops(L: int, d: int, h: int, K: int, activation: str = "swiglu") -> int:
    """GEMM flops of one forward + backward of the layer (what benchmarks divide by time).

    Each of the L*K (token, expert) slots does, for gated activations (first GEMM 2h outputs):
    forward 2*d*2h (w13) + 2*h*d (w2) = 6dh; backward twice the forward, since every forward GEMM
    has two backward GEMMs of the same size (dx and dw13 for w13; dhcur and dw2 for w2) = 12dh;
    total 18*L*K*d*h. Non-gated (h outputs): forward 4dh, backward 8dh, total 12*L*K*d*h.
    Recomputing the first GEMM under checkpoint "none" is not counted (model flops, not executed
    flops); neither are the elementwise activation, bias and combine terms.
    """
    per_slot = 18 if activation_info(activation) else 12
    return per_slot * int(L) * int(K) * int(d) * int(h)


def chunk_bounds(L: int, chunks: int, block_tokens: int = BLOCK_TOKENS) -> list[tuple[int, int]]:
    """The token ranges [t0, t1) that ``chunks`` chunks of L tokens run as (at most ``chunks`` of them).

    Chunks are equal runs of tokens except the last, each a multiple of ``block_tokens`` long: the weight-
    gradient reductions restart their tiles at every multiple of ``block_tokens`` (chunked or not), so a chunk
    boundary never splits a tile and chunked gradients are bit-identical to unchunked ones. Hence fewer chunks
    than asked when L / chunks < block_tokens (L <= block_tokens: one chunk).
    """
    L, chunks, block_tokens = int(L), int(chunks), int(block_tokens)
    if chunks <= 1 or L <= block_tokens:
        return [(0, L)]
    per = -(-L // chunks)
    per = -(-per // block_tokens) * block_tokens
    return [(t0, min(t0 + per, L)) for t0 in range(0, L, per)]


def _check_chunking(chunks, block_tokens) -> None:
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


# ---------------------------------------------------------------------------------------------
# Validation (host side only: shapes, dtypes, devices; no device reads)
# ---------------------------------------------------------------------------------------------


class _Sizes(NamedTuple):
    L: int
    d: int
    h: int
    R: int
    E: int
    K: int
    dtype: np.dtype
    gated: bool


def _check_sizes(L: int, d: int, h: int, R: int, E: int, K: int) -> None:
    """Size rules: d, h, E, K >= 1, K <= E, and int32 where the kernels index with int32.

    Slot ids (and expert_offsets values) are int32, so L*K must fit; row lengths d and R are int32
    kernel arguments. Element offsets into x, y, ab and the weights (L*d, L*K*R, E*R*d ...) are
    int64 in the kernels, so those products may exceed 2**31.
    """
    for name, v in (("d (x's columns)", d), ("h (w2's columns)", h), ("E (experts)", E), ("K (top_k)", K)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if K > E:
        raise ValueError(f"top_k K = {K} exceeds the number of experts E = {E} (a token picks K distinct experts)")
    _validate.check_int32_range(L * K, f"L * K ({L} * {K}), the number of slots")
    _validate.check_int32_range(R, "w13 rows")
    _validate.check_int32_range(d, "d")


def _check_gpu_device(arrays: dict, dev: int) -> None:
    for name, a in arrays.items():
        if a is not None and _array.is_gpu(a) and a.device.id != dev:
            raise ValueError(f"{name} is on GPU {a.device.id}, the inputs on GPU {dev}")


def _check_dispatch(disp, L: int, K: int, E: int, gpu: bool, dev: int | None) -> None:
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


def _check_dispatch_matches_ids_cpu(disp: Dispatch, ids: np.ndarray, E: int) -> None:
    """CPU only (cheap there): the dispatch is the one ``ids`` give (the reference reads ids)."""
    want = build_dispatch(ids, E)  # validates ids: in range, distinct within a row
    for name in ("expert_offsets", "slot_token", "slot_k", "pair_slot"):
        if not np.array_equal(getattr(disp, name), getattr(want, name)):
            raise ValueError(f"dispatch.{name} does not match expert_ids (was the dispatch built from other ids?)")


def _intake_forward(x, w13, w2, gates, expert_ids, activation, checkpoint, b13, b2):
    gated = activation_info(activation)
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"unknown checkpoint policy {checkpoint!r} (expected one of {', '.join(CHECKPOINTS)})")
    x = _array.asarray(x, "x")
    w13 = _array.asarray(w13, "w13")
    w2 = _array.asarray(w2, "w2")
    gates = _array.asarray(gates, "gates")
    ids = _array.asarray(expert_ids, "expert_ids")
    b13 = None if b13 is None else _array.asarray(b13, "b13")
    b2 = None if b2 is None else _array.asarray(b2, "b2")
    arrays = {"x": x, "w13": w13, "w2": w2, "gates": gates, "expert_ids": ids}
    if b13 is not None:
        arrays["b13"] = b13
    if b2 is not None:
        arrays["b2"] = b2
    gpu = _validate.same_device(arrays)

    # dtypes
    dtype = _validate.check_dtype(x, "x", _FLOAT_TYPES)
    for name in ("w13", "w2", "b13", "b2"):
        a = arrays.get(name)
        if a is not None and _array.logical_dtype(a) != dtype:
            raise TypeError(f"{name}: dtype {_array.dtype_name(_array.logical_dtype(a))} differs from x's "
                            f"{_array.dtype_name(dtype)} (x, w13, w2, b13 and b2 share one dtype)")
    _validate.check_dtype(gates, "gates", (np.float32,))
    idt = _validate.check_integer(ids, "expert_ids")
    if idt not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise TypeError(f"expert_ids: dtype {idt.name} not supported (expected int32 or int64)")

    # shapes
    _validate.check_ndim(x, "x", 2, "(L, d) tokens")
    _validate.check_ndim(w13, "w13", 3, "(E, 2h or h, d) weights")
    _validate.check_ndim(w2, "w2", 3, "(E, d, h) weights")
    _validate.check_ndim(gates, "gates", 2, "(L, K) gates")
    _validate.check_ndim(ids, "expert_ids", 2, "(L, K) expert ids")
    L, d = (int(s) for s in x.shape)
    E, R, d13 = (int(s) for s in w13.shape)
    E2, d2, h = (int(s) for s in w2.shape)
    if E2 != E:
        raise ValueError(f"w2 has {E2} experts, w13 has {E}")
    if d13 != d:
        raise ValueError(f"w13: in-features {d13} (w13.shape[2]) do not match x's d = {d}")
    if d2 != d:
        raise ValueError(f"w2: out-features {d2} (w2.shape[1]) do not match x's d = {d}")
    want_r = 2 * h if gated else h
    if R != want_r:
        raise ValueError(f"w13 has {R} rows per expert; {activation} ({'gated' if gated else 'non-gated'}) "
                         f"with w2's h = {h} needs {want_r}")
    if tuple(ids.shape) != tuple(gates.shape):
        raise ValueError(f"expert_ids shape {tuple(ids.shape)} differs from gates shape {tuple(gates.shape)}")
    if int(gates.shape[0]) != L:
        raise ValueError(f"gates has {int(gates.shape[0])} rows, x has L = {L} tokens")
    K = int(gates.shape[1])
    if b13 is not None:
        _validate.check_shape(b13, "b13", (E, R))
    if b2 is not None:
        _validate.check_shape(b2, "b2", (E, d))
    _check_sizes(L, d, h, R, E, K)

    for name, a in arrays.items():
        _validate.check_contiguous(a, name)
    sizes = _Sizes(L, d, h, R, E, K, dtype, gated)
    return x, w13, w2, gates, ids, b13, b2, gpu, sizes


def _intake_backward(dy, saved):
    if not isinstance(saved, MoESaved):
        raise TypeError(f"saved: expected the MoESaved returned by moe_forward, got {type(saved).__name__}")
    dy = _array.asarray(dy, "dy")
    x = saved.x
    gpu = _array.is_gpu(x)
    if _array.is_gpu(dy) != gpu:
        raise ValueError(f"dy is on the {'GPU' if _array.is_gpu(dy) else 'CPU'}, "
                         f"the forward ran on the {'GPU' if gpu else 'CPU'}")
    if gpu and dy.device.id != x.device.id:
        raise ValueError(f"dy is on GPU {dy.device.id}, the forward ran on GPU {x.device.id}")
    dtype = _array.logical_dtype(x)
    if _array.logical_dtype(dy) != dtype:
        raise TypeError(f"dy: dtype {_array.dtype_name(_array.logical_dtype(dy))}, expected x's "
                        f"{_array.dtype_name(dtype)}")
    _validate.check_shape(dy, "dy", tuple(x.shape))
    _validate.check_contiguous(dy, "dy")
    return dy, gpu


# ---------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------


def moe_forward(x, w13, w2, gates, expert_ids, *, activation: str = "swiglu", checkpoint: str = "ab",
                b13=None, b2=None, dispatch: Dispatch | None = None, out=None, stream=None, check_finite: bool = False,
                chunks=1, block_tokens: int = BLOCK_TOKENS, memory_budget=None):
    """Forward of the MoE layer: expert FFNs of the routed tokens, combined with the gates.

    Args:
        x: (L, d) tokens; float32, float16 or bfloat16; C-contiguous, any DLPack array. L >= 0.
        w13: (E, 2h, d) for gated activations ([gate rows w1; up rows w3]) or (E, h, d) otherwise;
            x's dtype; (out, in) per expert like nn.Linear.
        w2: (E, d, h), x's dtype.
        gates: (L, K) float32, the routing weights of each token's K experts.
        expert_ids: (L, K) int32 or int64, row t holds K distinct experts in [0, E). 1 <= K <= E.
        activation: one of ``ACTIVATIONS`` ("swiglu", "geglu", "gelu", "silu", "relu2", "swiglu_oai").
        checkpoint: "ab" (save the (L*K, R) pre-activations) or "none" (recompute them).
        b13: optional (E, R) bias of the first GEMM, x's dtype (R = w13.shape[1]).
        b2: optional (E, d) bias of the second GEMM, x's dtype.
        dispatch: a :class:`blazecore.dispatch.Dispatch` of ``expert_ids`` (E experts) on the same
            device, e.g. built under CUDA-graph capture with ``validate=False``. When None it is
            built here with ``build_dispatch(expert_ids, E)``, which checks the ids' values (on the
            GPU that synchronises the stream).
        out: optional (L, d) C-contiguous output buffer in x's dtype on x's device.
        stream: cupy Stream or raw ``cudaStream_t`` int for CUDA inputs (default: cupy's current
            stream); every allocation and launch goes on it. Must be None for CPU inputs.
        check_finite: first count the NaN / inf values of x, w13, w2, gates, b13 and b2 and raise
            FloatingPointError naming the first array that has any and its count, before anything is
            written. Off by default: on the GPU each array costs a reduction and a host read (a stream
            synchronisation), which would also break CUDA-graph capture.
        chunks: run the tokens in this many chunks (forward and backward), so the transient buffers scale
            with L / chunks; outputs and gradients have the same bits as ``chunks=1``. Chunk boundaries are
            multiples of ``block_tokens`` (see :func:`chunk_bounds`), so fewer chunks may run. "auto": the
            smallest count whose predicted peak fits ``memory_budget`` (:func:`blazecore.memory.plan_chunks`).
        block_tokens: token-block size of the weight-gradient reductions (tests use small ones; gradients
            depend on it in the last bits, so runs compared bit for bit must share it).
        memory_budget: for ``chunks="auto"``: bytes, or a fraction in (0, 1] of the device's free memory
            (default 0.9 of it); the CPU path always runs one chunk for "auto".

    Returns:
        (y, saved): y (L, d) in x's dtype (``out`` if given, else from the pluggable allocator);
        ``saved`` a :class:`MoESaved` for :func:`moe_backward`.

    Raises:
        TypeError: wrong dtypes (x not float32/float16/bfloat16, weights or biases not x's dtype,
            gates not float32, ids not int32/int64) or a dispatch of the wrong type.
        ValueError: inconsistent shapes, K > E, L*K >= 2**31, arrays not C-contiguous or on
            different devices, an unknown activation or policy, a dispatch that does not match the
            inputs, bad id values (when the dispatch is built here, or always on the CPU).
        FloatingPointError: (check_finite=True) an input holds NaN or inf.
    """
    x, w13, w2, gates, ids, b13, b2, gpu, sz = _intake_forward(
        x, w13, w2, gates, expert_ids, activation, checkpoint, b13, b2)
    if check_finite:
        _validate.check_finite_arrays({"x": x, "w13": w13, "w2": w2, "gates": gates, "b13": b13, "b2": b2}, stream)
    if isinstance(chunks, str) and chunks == "auto":
        _check_chunking(1, block_tokens)
        if gpu:
            from .memory import plan_chunks

            chunks = plan_chunks(sz.L, sz.d, sz.h, sz.E, sz.K, dtype=sz.dtype, activation=activation,
                                 checkpoint=checkpoint, budget=memory_budget, bias=(b13 is not None, b2 is not None),
                                 block_tokens=block_tokens, device=x.device.id).chunks
        else:
            chunks = 1
    _check_chunking(chunks, block_tokens)
    chunking = (int(chunks), int(block_tokens))
    if gpu:
        return _forward_gpu(x, w13, w2, gates, ids, b13, b2, sz, activation, checkpoint, dispatch, out, stream,
                            chunking)
    if stream is not None:
        raise ValueError("stream given, but the inputs are CPU arrays (streams apply to CUDA arrays)")
    return _forward_cpu(x, w13, w2, gates, ids, b13, b2, sz, activation, checkpoint, dispatch, out, chunking)


def moe_backward(dy, saved: MoESaved, *, out_dx=None, out_dw13=None, out_dw2=None, out_dgates=None,
                 stream=None, retain: bool = False, check_finite: bool = False) -> MoEGrads:
    """Backward of :func:`moe_forward`: gradients of sum(dy * y) w.r.t. x, the weights, gates, biases.

    Args:
        dy: (L, d) gradient of y, x's dtype, C-contiguous, on the forward's device.
        saved: the :class:`MoESaved` returned by the forward (its arrays unchanged since).
        out_dx: optional (L, d) buffer, x's dtype.
        out_dw13: optional (E, R, d) buffer, the weights' dtype.
        out_dw2: optional (E, d, h) buffer, the weights' dtype.
        out_dgates: optional (L, K) float32 buffer.
        stream: as in :func:`moe_forward`.
        check_finite: first check dy for NaN / inf and raise FloatingPointError with their count,
            before anything is written (off by default: a reduction and a host read on the GPU).
        retain: keep ``saved`` usable for another backward. By default (False) the GPU backward of
            policy "ab" writes the activation gradient over the saved pre-activations (one (L*K, R)
            buffer less at the peak, like a framework freeing saved tensors after the backward) and
            marks ``saved.consumed``; a second backward on it then raises RuntimeError.

    Returns:
        :class:`MoEGrads` (dx, dw13, dw2, dgates, db13, db2). dgates[t, k] = dy[t] . o[t, k], with
        o the k-th expert's output (b2 included) before the gate. Experts with no token get zero
        weight gradients; L == 0 gives empty dx / dgates and zero dw13, dw2, db13, db2.

    Raises:
        TypeError: ``saved`` not a MoESaved, dy or an out buffer of the wrong dtype.
        ValueError: dy or an out buffer of the wrong shape, device or layout.
        RuntimeError: ``saved`` was consumed by an earlier backward without ``retain=True``.
        FloatingPointError: (check_finite=True) dy holds NaN or inf.
    """
    if isinstance(saved, MoESaved) and saved.consumed:
        raise RuntimeError("this MoESaved was consumed by an earlier moe_backward (its saved pre-activations "
                           "were overwritten); pass retain=True to the first backward to run another")
    dy, gpu = _intake_backward(dy, saved)
    if check_finite:
        _validate.check_finite_arrays({"dy": dy}, stream)
    if gpu:
        return _backward_gpu(dy, saved, out_dx, out_dw13, out_dw2, out_dgates, stream, retain)
    if stream is not None:
        raise ValueError("stream given, but the inputs are CPU arrays (streams apply to CUDA arrays)")
    return _backward_cpu(dy, saved, out_dx, out_dw13, out_dw2, out_dgates)


def _grad_outs(saved: MoESaved, gpu: bool, out_dx, out_dw13, out_dw2, out_dgates):
    x, w13, w2, gates = saved.x, saved.w13, saved.w2, saved.gates
    dtype = _array.logical_dtype(x)
    dx = _array.out_or_empty(out_dx, x.shape, dtype, gpu, "out_dx")
    dw13 = _array.out_or_empty(out_dw13, w13.shape, dtype, gpu, "out_dw13")
    dw2 = _array.out_or_empty(out_dw2, w2.shape, dtype, gpu, "out_dw2")
    dgates = _array.out_or_empty(out_dgates, gates.shape, np.float32, gpu, "out_dgates")
    db13 = None if saved.b13 is None else _array.out_or_empty(None, saved.b13.shape, dtype, gpu, "db13")
    db2 = None if saved.b2 is None else _array.out_or_empty(None, saved.b2.shape, dtype, gpu, "db2")
    if gpu:
        _check_gpu_device({"out_dx": dx.view, "out_dw13": dw13.view, "out_dw2": dw2.view,
                           "out_dgates": dgates.view}, x.device.id)
    return dx, dw13, dw2, dgates, db13, db2


def _user(o):
    return None if o is None else o.user


# ---------------------------------------------------------------------------------------------
# CPU: the float64 reference, cast to the input dtypes
# ---------------------------------------------------------------------------------------------


def _forward_cpu(x, w13, w2, gates, ids, b13, b2, sz: _Sizes, activation, checkpoint, dispatch, out, chunking):
    # The float64 reference runs all tokens at once whatever the chunking (chunks shape the GPU's memory use
    # only; the reference has no transient it could bound); ``ab`` keeps the GPU path's layout per chunk.
    from .reference import moe as ref

    y = _array.out_or_empty(out, (sz.L, sz.d), sz.dtype, False, "out")
    if dispatch is None:
        dispatch = build_dispatch(ids, sz.E)  # checks the id values
    else:
        _check_dispatch(dispatch, sz.L, sz.K, sz.E, False, None)
        _check_dispatch_matches_ids_cpu(dispatch, ids, sz.E)
    y.view[...] = ref.moe_forward_ref(x, w13, w2, gates, ids, activation, b13, b2).astype(sz.dtype)
    ab = None
    if checkpoint == "ab":
        # held like the GPU path holds it (same shape, dtype, slot order) so held bytes compare;
        # the CPU backward recomputes in float64 from x, so both policies give identical gradients
        z = ref.moe_preact_ref(x, w13, ids, b13).reshape(sz.L * sz.K, sz.R)
        parts = []
        for t0, t1 in chunk_bounds(sz.L, *chunking):
            dc = dispatch if (t0, t1) == (0, sz.L) else build_dispatch(ids[t0:t1], sz.E)
            parts.append(t0 * sz.K + dc.slot_token.astype(np.int64) * sz.K + dc.slot_k)
        pair = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        ab = np.ascontiguousarray(z[pair].astype(sz.dtype))
    saved = MoESaved(x, w13, w2, gates, ids, dispatch, activation, checkpoint, b13, b2, ab,
                     chunks=chunking[0], block_tokens=chunking[1])
    return y.user, saved


def _backward_cpu(dy, saved: MoESaved, out_dx, out_dw13, out_dw2, out_dgates) -> MoEGrads:
    from .reference import moe as ref

    outs = _grad_outs(saved, False, out_dx, out_dw13, out_dw2, out_dgates)
    g = ref.moe_backward_ref(dy, saved.x, saved.w13, saved.w2, saved.gates, saved.expert_ids, saved.activation,
                             saved.b13, saved.b2)
    for o, key in zip(outs, ("dx", "dw13", "dw2", "dgates", "db13", "db2"), strict=True):
        if o is not None:
            o.view[...] = g[key].astype(o.view.dtype)
    return MoEGrads(*(_user(o) for o in outs))


# ---------------------------------------------------------------------------------------------
# GPU: blazecore._moe_gpu
# ---------------------------------------------------------------------------------------------


def _chunk_dispatches(ids, E, bounds, s, validate: bool) -> tuple:
    """The dispatch of each chunk's ids (GPU; the ids were validated already unless ``validate``)."""
    if validate and bounds:
        from .dispatch import _validate_gpu

        _validate_gpu(ids.device.id, ids, E, s)
    return tuple(build_dispatch(ids[t0:t1], E, validate=False, stream=s) for t0, t1 in bounds)


def _forward_gpu(x, w13, w2, gates, ids, b13, b2, sz: _Sizes, activation, checkpoint, dispatch, out, stream,
                 chunking):
    import cupy

    dev = x.device.id
    with cupy.cuda.Device(dev):
        s = _array.current_stream(stream)
        with s:  # allocations (and their poison fills in tests) belong to the stream the kernels use
            y = _array.out_or_empty(out, (sz.L, sz.d), sz.dtype, True, "out")
            _check_gpu_device({"out": y.view}, dev)
            from . import _moe_gpu

            _moe_gpu.check_shapes(x, w13, w2, activation)  # the kernels' own limits (row alignment)
            bounds = chunk_bounds(sz.L, *chunking)
            if dispatch is not None:
                _check_dispatch(dispatch, sz.L, sz.K, sz.E, True, dev)
            if len(bounds) > 1:
                chunk_disp = _chunk_dispatches(ids, sz.E, bounds, s, validate=dispatch is None)
            else:
                if dispatch is None:
                    dispatch = build_dispatch(ids, sz.E, stream=s)
                chunk_disp = (dispatch,)
            if sz.L == 0:
                # nothing to compute; a zero-sized grid would be a launch error
                ab = _array.empty_gpu((0, sz.R), sz.dtype).user if checkpoint == "ab" else None
                extra = {}
            else:
                chunk_list = [(t0, t1, dp) for (t0, t1), dp in zip(bounds, chunk_disp, strict=True)]
                ab, extra = _moe_gpu.forward(x, w13, w2, gates, chunk_list, activation, checkpoint, b13, b2,
                                             y.view, s)
    saved = MoESaved(x, w13, w2, gates, ids, dispatch, activation, checkpoint, b13, b2, ab, dict(extra or {}),
                     chunks=chunking[0], block_tokens=chunking[1],
                     chunk_dispatches=chunk_disp if len(bounds) > 1 else ())
    return y.user, saved


def _backward_gpu(dy, saved: MoESaved, out_dx, out_dw13, out_dw2, out_dgates, stream, retain) -> MoEGrads:
    import cupy

    dev = saved.x.device.id
    with cupy.cuda.Device(dev):
        s = _array.current_stream(stream)
        with s:
            outs = _grad_outs(saved, True, out_dx, out_dw13, out_dw2, out_dgates)
            dx, dw13, dw2, dgates, db13, db2 = outs
            if int(saved.x.shape[0]) == 0:
                # no slot: weight gradients are zero, dx and dgates are empty
                for o in (dw13, dw2, db13, db2):
                    if o is not None:
                        o.view.fill(0)
            else:
                from . import _moe_gpu

                reuse = not retain and saved.ab is not None
                bounds = chunk_bounds(int(saved.x.shape[0]), saved.chunks, saved.block_tokens)
                disps = saved.chunk_dispatches
                if len(bounds) == 1 and saved.dispatch is not None:
                    disps = (saved.dispatch,)
                if len(disps) != len(bounds):  # e.g. a MoESaved rebuilt by an adapter from the full dispatch
                    disps = _chunk_dispatches(saved.expert_ids, int(saved.w13.shape[0]), bounds, s, validate=False)
                chunk_list = [(t0, t1, dp) for (t0, t1), dp in zip(bounds, disps, strict=True)]
                _moe_gpu.backward(dy, saved, chunk_list, saved.block_tokens, dx.view, dw13.view, dw2.view,
                                  dgates.view,
                                  None if db13 is None else db13.view, None if db2 is None else db2.view, s,
                                  reuse_saved=reuse)
                saved.consumed = reuse
    return MoEGrads(*(_user(o) for o in outs))


__all__ = [
    "ACTIVATIONS",
    "BLOCK_TOKENS",
    "CHECKPOINTS",
    "MoEGrads",
    "MoESaved",
    "activation_info",
    "chunk_bounds",
    "moe_backward",
    "moe_flops",
    "moe_forward",
]
