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

import dataclasses

import numpy as np

from . import _array, _compile, _moe_gpu, _validate
from ._moe_common import (
    _GATED,  # noqa: F401  (kept importable from here)
    ACTIVATIONS,
    BLOCK_TOKENS,
    CHECKPOINTS,
    GEMM_PATHS,
    WEIGHT_LAYOUTS,
    MoEGrads,
    MoESaved,
    activation_info,
    check_gemm_path,
    check_weight_layout,
    chunk_bounds,
    weight_dims,
)
from ._moe_common import Sizes as _Sizes
from ._moe_common import check_chunking as _check_chunking
from ._moe_common import check_dispatch as _check_dispatch
from ._moe_common import check_gpu_device as _check_gpu_device  # noqa: F401  (kept importable from here)
from ._moe_common import grad_outs as _grad_outs
from ._moe_common import user as _user
from .dispatch import Dispatch, build_dispatch
from .memory import _budget_bytes, plan_chunks

_FLOAT_TYPES = (np.float32, np.float16, _array.BF16)
_DISPATCH_ARRAYS = ("expert_offsets", "slot_token", "slot_k", "pair_slot")


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


# ---------------------------------------------------------------------------------------------
# Validation (host side only: shapes, dtypes, devices; no device reads)
# ---------------------------------------------------------------------------------------------


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


def _check_dispatch_matches_ids_cpu(disp: Dispatch, ids: np.ndarray, E: int) -> None:
    """CPU only (cheap there): the dispatch is the one ``ids`` give (the reference reads ids)."""
    want = build_dispatch(ids, E)  # validates ids: in range, distinct within a row
    for name in ("expert_offsets", "slot_token", "slot_k", "pair_slot"):
        if not np.array_equal(getattr(disp, name), getattr(want, name)):
            raise ValueError(f"dispatch.{name} does not match expert_ids (was the dispatch built from other ids?)")


def ffn_shapes(x, w13, w2, gates, expert_ids, *, activation: str, b13=None, b2=None,
               weight_layout: str = "out_in") -> tuple:
    """The expert FFN's shape rules, on shapes alone: the one check that the core and the adapters share.

    Args:
        x, w13, w2, gates, expert_ids: the operands' shapes: x (L, d), w13 (E, R, d) with R = 2h for gated
            activations (h otherwise), w2 (E, d, h), gates and expert_ids (L, K); w13 (E, d, R) and w2 (E, h, d)
            with ``weight_layout="in_out"``.
        activation: the activation's name (one of ACTIVATIONS).
        b13, b2: the optional biases' shapes, (E, R) and (E, d), or None.
        weight_layout: how w13 and w2 are stored (one of WEIGHT_LAYOUTS).

    Returns:
        (L, d, E, R, h, K).

    Raises:
        ValueError: a wrong rank or size (the message names the operand, and for "in_out" the shapes it read), K > E,
            sizes past the int32 limits, an unknown weight layout.
    """
    check_weight_layout(weight_layout)
    if weight_layout == "out_in" or not len(w13) == len(w2) == 3:
        return _ffn_shapes(x, w13, w2, gates, expert_ids, activation, b13, b2)
    s13, s2 = weight_dims(w13, w2, weight_layout)
    try:
        return _ffn_shapes(x, s13, s2, gates, expert_ids, activation, b13, b2)
    except ValueError as exc:  # the shapes in the message are the (out, in) ones the check compares
        raise ValueError(f"{exc} (weight_layout 'in_out': w13 {tuple(w13)} is read as {tuple(s13)}, "
                         f"w2 {tuple(w2)} as {tuple(s2)})") from None


def _ffn_shapes(x, w13, w2, gates, expert_ids, activation, b13, b2) -> tuple:
    """:func:`ffn_shapes` on "out_in" shapes."""
    gated = activation_info(activation)
    for name, shape, ndim, what in (("x", x, 2, "(L, d) tokens"), ("w13", w13, 3, "(E, 2h or h, d) weights"),
                                    ("w2", w2, 3, "(E, d, h) weights"), ("gates", gates, 2, "(L, K) gates"),
                                    ("expert_ids", expert_ids, 2, "(L, K) expert ids")):
        if len(shape) != ndim:
            raise ValueError(f"{name}: expected {ndim}-D {what}, got shape {tuple(shape)}")
    L, d = (int(s) for s in x)
    E, R, d13 = (int(s) for s in w13)
    E2, d2, h = (int(s) for s in w2)
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
    if tuple(expert_ids) != tuple(gates):
        raise ValueError(f"expert_ids shape {tuple(expert_ids)} differs from gates shape {tuple(gates)}")
    if int(gates[0]) != L:
        raise ValueError(f"gates has {int(gates[0])} rows, x has L = {L} tokens")
    K = int(gates[1])
    for name, shape, want in (("b13", b13, (E, R)), ("b2", b2, (E, d))):
        if shape is not None and tuple(shape) != want:
            raise ValueError(f"{name}: expected shape {want}, got {tuple(shape)}")
    _check_sizes(L, d, h, R, E, K)
    return L, d, E, R, h, K


def _intake_forward(x, w13, w2, gates, expert_ids, activation, checkpoint, b13, b2, weight_layout="out_in"):
    gated = activation_info(activation)
    check_weight_layout(weight_layout)
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
    if gpu and _array.logical_dtype(x) == np.float64:
        raise TypeError("x: dtype float64 not supported on the GPU (float64 runs on the CPU, in the NumPy reference; "
                        "pass float32, float16 or bfloat16)")
    dtype = _validate.check_dtype(x, "x", _FLOAT_TYPES + (() if gpu else (np.float64,)))
    for name in ("w13", "w2", "b13", "b2"):
        a = arrays.get(name)
        if a is not None and _array.logical_dtype(a) != dtype:
            raise TypeError(f"{name}: dtype {_array.dtype_name(_array.logical_dtype(a))} differs from x's "
                            f"{_array.dtype_name(dtype)} (x, w13, w2, b13 and b2 share one dtype)")
    # float64 (CPU only): the reference's own precision, gates and dgates included (gradcheck)
    _validate.check_dtype(gates, "gates", (np.float64,) if dtype == np.float64 else (np.float32,))
    idt = _validate.check_integer(ids, "expert_ids")
    if idt not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise TypeError(f"expert_ids: dtype {idt.name} not supported (expected int32 or int64)")

    L, d, E, R, h, K = ffn_shapes(x.shape, w13.shape, w2.shape, gates.shape, ids.shape, activation=activation,
                                  b13=None if b13 is None else b13.shape, b2=None if b2 is None else b2.shape,
                                  weight_layout=weight_layout)

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
                chunks=1, block_tokens: int = BLOCK_TOKENS, memory_budget=None, weight_layout: str = "out_in",
                act_in_operand: bool = False, gemm_path: str | None = None):
    """Forward of the MoE layer: expert FFNs of the routed tokens, combined with the gates.

    Args:
        x: (L, d) tokens; float32, float16 or bfloat16; C-contiguous, any DLPack array. L >= 0. CPU arrays
            may also be float64 (the reference's own precision, e.g. for gradcheck): gates are then float64 too,
            and so are dgates.
        w13: (E, 2h, d) for gated activations ([gate rows w1; up rows w3]) or (E, h, d) otherwise;
            x's dtype; (out, in) per expert like nn.Linear.
        w2: (E, d, h), x's dtype.
        gates: (L, K) float32, the routing weights of each token's K experts.
        expert_ids: (L, K) int32 or int64, row t holds K distinct experts in [0, E). 1 <= K <= E.
        activation: one of ``ACTIVATIONS`` ("swiglu", "geglu", "gelu", "silu", "relu2", "swiglu_oai"); a gated
            one may carry the suffix "_interleaved": w13's 2h rows (and b13's entries) then alternate gate and up,
            [g0, u0, g1, u1, ...] (gpt-oss), and so do the saved pre-activations' columns.
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
            (default 0.9 of it); the CPU path always runs one chunk for "auto" (and still checks the budget).
        weight_layout: "out_in" (default): w13 (E, R, d) and w2 (E, d, h), (out, in) per expert like nn.Linear;
            "in_out": the transposes, w13 (E, d, R) and w2 (E, h, d), read as stored (no copy); the backward's
            dw13 and dw2 then come in that layout too. On Hopper both layouts run the wgmma kernels (16-bit
            types), with [gate; up] or interleaved rows alike.
        act_in_operand: checkpoint "ab" on the sm_90a kernels: the second GEMM reads the saved pre-activations z
            and applies the activation to its operand tiles in registers, so the forward never holds the
            (L*K, h) activations (its peak is y, z and the per-slot output rows). The same bits of y; slower,
            because the activation is recomputed for every 256 output columns (a few percent of the layer on
            wide d). Ignored elsewhere (and with "in_out" weights or interleaved rows). For callers whose
            buffers all live through the whole call (JAX: XLA allocates a computation's outputs before it starts),
            where the forward's transients add to the backward's.
        gemm_path: the expert GEMMs' kernels on the GPU, one of ``blazecore.GEMM_PATHS``: "wgmma" (the sm_90a
            kernels, for bf16 / fp16 on Hopper; other cases fall back to mma.sync) or "mma_sync" (the portable
            kernels). None (default): "wgmma" unless the environment sets BLAZECORE_SM90=0. The backward of
            this forward uses the same path. The two paths agree to rounding, not bit for bit. Ignored on the
            CPU.

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
    caller = x
    if not isinstance(act_in_operand, (bool, np.bool_)):
        raise TypeError(f"act_in_operand must be a bool, got {type(act_in_operand).__name__}")
    check_gemm_path(gemm_path)
    x, w13, w2, gates, ids, b13, b2, gpu, sz = _intake_forward(
        x, w13, w2, gates, expert_ids, activation, checkpoint, b13, b2, weight_layout)
    if isinstance(dispatch, Dispatch):  # its arrays as the intake's views (a CPU one may hold torch tensors)
        views = {f: _array.asarray(getattr(dispatch, f), f"dispatch.{f}") for f in _DISPATCH_ARRAYS}
        if any(v is not getattr(dispatch, f) for f, v in views.items()):
            dispatch = dataclasses.replace(dispatch, **views)
    if check_finite:
        _validate.check_finite_arrays({"x": x, "w13": w13, "w2": w2, "gates": gates, "b13": b13, "b2": b2}, stream)
    if memory_budget is not None:
        _budget_bytes(memory_budget, None, lambda: 0)  # its type and range, on the CPU as well
    if isinstance(chunks, str) and chunks == "auto":
        _check_chunking(1, block_tokens)
        if gpu:
            # the kernels' family as the call will pick it (their partial sums and carries differ a little)
            sm90 = _moe_gpu.wgmma_asked(gemm_path) and _compile.device_arch(x.device.id) == "sm_90a"
            chunks = plan_chunks(sz.L, sz.d, sz.h, sz.E, sz.K, dtype=sz.dtype, activation=activation,
                                 checkpoint=checkpoint, budget=memory_budget, bias=(b13 is not None, b2 is not None),
                                 block_tokens=block_tokens, device=x.device.id, sm90=sm90,
                                 act_in_operand=act_in_operand, weight_layout=weight_layout).chunks
        else:
            chunks = 1
    _check_chunking(chunks, block_tokens)
    chunking = (int(chunks), int(block_tokens))
    if gpu:
        return _forward_gpu(x, w13, w2, gates, ids, b13, b2, sz, activation, checkpoint, dispatch, out, stream,
                            chunking, weight_layout, bool(act_in_operand), gemm_path)
    if stream is not None:
        raise ValueError("stream given, but the inputs are CPU arrays (streams apply to CUDA arrays)")
    y, saved = _forward_cpu(x, w13, w2, gates, ids, b13, b2, sz, activation, checkpoint, dispatch, out, chunking,
                            weight_layout)
    return _array.like_caller(y, caller), saved


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
    caller = dy
    dy, gpu = _intake_backward(dy, saved)
    if check_finite:
        _validate.check_finite_arrays({"dy": dy}, stream)
    if gpu:
        return _backward_gpu(dy, saved, out_dx, out_dw13, out_dw2, out_dgates, stream, retain)
    if stream is not None:
        raise ValueError("stream given, but the inputs are CPU arrays (streams apply to CUDA arrays)")
    grads = _backward_cpu(dy, saved, out_dx, out_dw13, out_dw2, out_dgates)
    return MoEGrads(*(_array.like_caller(g, caller) for g in grads))


# ---------------------------------------------------------------------------------------------
# CPU: the float64 reference, cast to the input dtypes
# ---------------------------------------------------------------------------------------------


def _out_in(w13, w2, layout):
    """w13 (E, R, d) and w2 (E, d, h) views of weights stored in ``layout`` (CPU; the reference reads views)."""
    return (w13.transpose(0, 2, 1), w2.transpose(0, 2, 1)) if layout == "in_out" else (w13, w2)


def _forward_cpu(x, w13, w2, gates, ids, b13, b2, sz: _Sizes, activation, checkpoint, dispatch, out, chunking,
                 weight_layout):
    # The float64 reference runs all tokens at once whatever the chunking (chunks shape the GPU's memory use
    # only; the reference has no transient it could bound); ``ab`` keeps the GPU path's layout per chunk.
    from .reference import moe as ref

    saved_w13, saved_w2 = w13, w2
    w13, w2 = _out_in(w13, w2, weight_layout)

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
        z = ref.moe_preact_ref(x, w13, ids, b13).reshape(sz.L * sz.K, sz.R)  # w13's row order: interleaved too
        parts = []
        for t0, t1 in chunk_bounds(sz.L, *chunking):
            dc = dispatch if (t0, t1) == (0, sz.L) else build_dispatch(ids[t0:t1], sz.E)
            parts.append(t0 * sz.K + dc.slot_token.astype(np.int64) * sz.K + dc.slot_k)
        pair = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        ab = np.ascontiguousarray(z[pair].astype(sz.dtype))
    saved = MoESaved(x, saved_w13, saved_w2, gates, ids, dispatch, activation, checkpoint, b13, b2, ab,
                     chunks=chunking[0], block_tokens=chunking[1], weight_layout=weight_layout)
    return y.user, saved


def _backward_cpu(dy, saved: MoESaved, out_dx, out_dw13, out_dw2, out_dgates) -> MoEGrads:
    from .reference import moe as ref

    outs = _grad_outs(saved, False, out_dx, out_dw13, out_dw2, out_dgates)
    w13, w2 = _out_in(saved.w13, saved.w2, saved.weight_layout)
    g = ref.moe_backward_ref(dy, saved.x, w13, w2, saved.gates, saved.expert_ids, saved.activation,
                             saved.b13, saved.b2)
    g["dw13"], g["dw2"] = _out_in(g["dw13"], g["dw2"], saved.weight_layout)  # back to the stored layout
    for o, key in zip(outs, ("dx", "dw13", "dw2", "dgates", "db13", "db2"), strict=True):
        if o is not None:
            o.view[...] = g[key].astype(o.view.dtype)
    return MoEGrads(*(_user(o) for o in outs))


# ---------------------------------------------------------------------------------------------
# GPU: blazecore._moe_gpu
# ---------------------------------------------------------------------------------------------


def _forward_gpu(x, w13, w2, gates, ids, b13, b2, sz: _Sizes, activation, checkpoint, dispatch, out, stream,
                 chunking, weight_layout, act_in_operand=False, gemm_path=None):
    with _array.device_scope(x.device.id):
        return _moe_gpu.layer_forward(x, w13, w2, gates, ids, b13, b2, sz, activation, checkpoint, dispatch, out,
                                      stream, chunking, weight_layout=weight_layout, act_in_operand=act_in_operand,
                                      gemm_path=gemm_path)


def _backward_gpu(dy, saved: MoESaved, out_dx, out_dw13, out_dw2, out_dgates, stream, retain) -> MoEGrads:
    with _array.device_scope(saved.x.device.id):
        return _moe_gpu.layer_backward(dy, saved, out_dx, out_dw13, out_dw2, out_dgates, stream, retain)


__all__ = [
    "ACTIVATIONS",
    "BLOCK_TOKENS",
    "CHECKPOINTS",
    "GEMM_PATHS",
    "MoEGrads",
    "MoESaved",
    "WEIGHT_LAYOUTS",
    "activation_info",
    "chunk_bounds",
    "moe_backward",
    "moe_flops",
    "moe_forward",
    "sum_rows",
]


_SUM_ROWS_DTYPES = _FLOAT_TYPES


def sum_rows(rows, index, *, out=None, stream=None, validate: bool = True):
    """Row sums by index: out[i] = sum_j rows[index[i, j]] over the entries index[i, j] >= 0, in j order,
    accumulated in float32 (float64 rows on the CPU: float64) and rounded once to the rows' dtype; an output row
    whose entries are all negative is 0. Deterministic: the GPU sums each output row in one thread block, in j
    order, with no atomics (the layer's combine kernel, which skips the negative entries). The expert-parallel
    layers sum their exchanged rows with it.

    Args:
        rows: (n, w) float32, float16 or bfloat16 (float64 on the CPU), C-contiguous; on the GPU w * itemsize a
            multiple of 16 and the data on a 16-byte boundary.
        index: (m, J) int32, C-contiguous: row numbers in [0, n), or -1 (or any negative) for nothing.
        out: optional (m, w) buffer in the rows' dtype (the same alignment on the GPU).
        stream: as in :func:`moe_forward`.
        validate: check that every entry is below n and raise ValueError if not (on the GPU a reduction and one
            host read, which synchronises the stream; pass False where the index is known to be in range). With
            False, the GPU kernel skips an entry >= n as it skips -1 (it never reads past the rows); the CPU checks
            always.

    Returns:
        (m, w) in the rows' dtype, on the rows' device.
    """
    r = _array.asarray(rows, "rows")
    ix = _array.asarray(index, "index")
    _validate.check_ndim(r, "rows", 2, "rows (n, w)")
    _validate.check_ndim(ix, "index", 2, "row numbers (m, J)")
    gpu = _validate.same_device({"rows": r, "index": ix})
    dt = _validate.check_dtype(r, "rows", _SUM_ROWS_DTYPES if gpu else (*_SUM_ROWS_DTYPES, np.float64))
    if np.dtype(ix.dtype) != np.int32:
        raise TypeError(f"index: expected int32, got {_array.dtype_name(_array.logical_dtype(ix))}")
    _validate.check_contiguous(r, "rows")
    _validate.check_contiguous(ix, "index")
    (n, w), m = r.shape, ix.shape[0]
    _validate.check_int32_range(m, "index rows")
    if gpu and (w * dt.itemsize) % 16:
        raise ValueError(f"rows: the GPU kernel reads 16 bytes at a time: w * itemsize = {w * dt.itemsize} must be a "
                         "multiple of 16")
    if stream is not None and not gpu:
        raise ValueError("stream given, but the inputs are CPU arrays (streams apply to CUDA arrays)")
    with _array.stream_scope(stream, gpu):
        if (validate or not gpu) and ix.size:
            hi = int(ix.max())
            if hi >= n:
                raise ValueError(f"index: entry {hi} is out of range for {n} rows")
        res = _array.out_or_empty(out, (m, w), dt, gpu, "out")
        if gpu:
            _moe_gpu.check_aligned({"rows": r, "out": res.view})
            _check_gpu_device({"out": res.view}, r.device.id)
            if m:
                _moe_gpu.sum_rows(r, ix, res.view, _array.current_stream(stream))
        else:
            from .reference import moe as ref

            res.view[...] = ref.sum_rows_ref(r, ix)
        return _array.like_caller(res.user, rows)

