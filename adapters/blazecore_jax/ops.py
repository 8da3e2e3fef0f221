"""blazecore's ops as JAX functions: ``jax.custom_vjp`` over ``jax.experimental.buffer_callback``.

Every forward and backward is one buffer callback: XLA hands the callback its input buffers and the
output buffers it owns, and the callback runs the core op into them. Functions (all usable under
``jax.jit``, ``jax.grad`` and ``jax.vmap``):

    route_topk(logits, top_k, score, renormalize, expert_bias?) -> (gates, expert_ids)    VJP -> dlogits
    load_balancing_loss(logits, expert_ids) -> loss                                      VJP -> dlogits
    router_z_loss(logits) -> loss                                                        VJP -> dlogits
    build_dispatch(expert_ids, num_experts) -> JaxDispatch (int32 arrays, no gradient)
    moe_forward(x, w13, w2, gates, expert_ids, dispatch, b13?, b2?, activation, checkpoint) -> (y, ab)
    moe_backward(dy, x, w13, w2, gates, expert_ids, dispatch, ab, b13?, b2?, ...) -> MoEGrads
    moe_ffn(x, w13, w2, gates, expert_ids, ...) -> y       (custom_vjp of the two above)

What the adapter does: no math. Shapes and dtypes are checked at trace time (ValueError / TypeError
before anything is compiled); the values are checked by the core when the callback runs.

Where the buffers go:
- CPU buffers become NumPy views (``numpy.asarray`` on the buffer, zero-copy, bf16 as
  ``ml_dtypes.bfloat16``) and run the core's NumPy reference path, which writes straight into the
  XLA-owned outputs through ``out=``.
- CUDA buffers become CuPy views (DLPack, bf16 relabelled as uint16 by ``blazecore.asarray``; the
  raw ``__cuda_array_interface__`` pointer as a fallback). The core launches on XLA's stream
  (``ctx.stream``), writing the outputs the core takes as ``out=`` (y, dx, dw13, dw2, dgates, gates,
  ids, dlogits, losses) in place. The saved pre-activations ``ab`` have no ``out=``: the forward's
  allocator hands the core XLA's ``ab`` buffer for its (L*K, R) request (``_Views.serve``), with a copy
  as the fallback. The other outputs the core has no ``out=`` for (the dispatch arrays, db13, db2) are
  allocated by the core from CuPy's pool and copied into the XLA buffers on the same stream
  (device-to-device, asynchronous); workspaces come from CuPy's pool too, so set
  XLA_PYTHON_CLIENT_PREALLOCATE=false when the GPU path runs.

XLA allocates a computation's outputs (the gradients among them) before it starts, so every transient of the
forward sits on top of the gradients. The forward therefore runs with ``act_in_operand=True``
(``blazecore.moe_forward``: on the sm_90a kernels under "ab" the second GEMM activates the saved pre-activations in
registers, and the forward holds no (L*K, h) activations) where that lowers the peak of the call, as the memory
model predicts it (``blazecore.memory.act_in_operand_lowers_peak``): the forward's peak plus the gradients against
the backward's peak, which holds the gradients anyway. Where the backward's peak stays the larger either way
(e.g. h <= d with many experts, as olmoe or qwen3), the forward keeps the activations and runs the faster second
GEMM.

Saved state: a custom_vjp residual must be arrays, so the FFN forward returns ``ab`` (the (L*K, R)
pre-activations in x's dtype, expert-slot order, under checkpoint "ab"; a (0, R) placeholder under
"none") and the backward rebuilds a ``blazecore.MoESaved`` from the residuals. As in the core, the backward
writes the activation gradient dz over ``ab``: its callback has an extra (L*K, R) output aliased to the ``ab``
input (``input_output_aliases``), and the core works in that buffer. Inside one jitted computation (``jax.grad``
of a jitted loss, a jitted train step) ``ab``'s last use is the backward, so XLA hands the callback ``ab``'s own
buffer and no second (L*K, R) buffer exists; where ``ab`` is still needed afterwards (a residual passed between
separately compiled forward and backward calls, or used twice), XLA copies it first, so results are always right
and only the memory saving is lost. Where XLA gives dz a buffer of its own instead (it does inside the loop of a
sequential vmap on the GPU), the callback copies ab into it before the core runs.

vmap: every callback declares ``vmap_method="sequential"`` (a batch of B runs the op B times, in a loop).
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import blazecore
from blazecore import _array
from blazecore.moe import ffn_shapes

try:
    from jax.experimental.buffer_callback import buffer_callback as _buffer_callback
except ImportError as e:  # JAX < 0.6.1
    raise ImportError("blazecore_jax needs jax.experimental.buffer_callback (JAX >= 0.6.1)") from e

__all__ = [
    "JaxDispatch",
    "MoEGrads",
    "build_dispatch",
    "load_balancing_loss",
    "moe_backward",
    "moe_ffn",
    "moe_forward",
    "route_topk",
    "router_z_loss",
]

VMAP_METHOD = "sequential"
_FLOATS = (np.dtype(np.float32), np.dtype(np.float16), _array.BF16)
_INTS = (np.dtype(np.int32), np.dtype(np.int64))
_kDLCUDA, _kDLCUDAManaged = 2, 13


# ---------------------------------------------------------------------------------------------
# Buffers: CPU -> NumPy views, CUDA -> CuPy views on XLA's stream
# ---------------------------------------------------------------------------------------------


def _buffer_on_gpu(buf) -> bool:
    return int(buf.__dlpack_device__()[0]) in (_kDLCUDA, _kDLCUDAManaged)


def _gpu_view(buf):
    """Zero-copy CuPy view of an XLA CUDA buffer (bf16 as uint16, like every core GPU array)."""
    try:
        return _array.asarray(buf, "buffer")
    except Exception:
        import cupy

        cai = buf.__cuda_array_interface__
        dt = _array.storage_dtype(np.dtype(buf.dtype), True)
        shape = tuple(int(s) for s in buf.shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        dev = int(buf.__dlpack_device__()[1])
        mem = cupy.cuda.UnownedMemory(int(cai["data"][0]), nbytes, buf, dev)
        return cupy.ndarray(shape, dt, cupy.cuda.MemoryPointer(mem, 0))


class _Views:
    """The callback's buffers as core arrays, and the ``stream=`` to pass the core (None on the CPU)."""

    def __init__(self, gpu: bool, stream):
        self.gpu = gpu
        self.stream = stream

    def __call__(self, buf):
        if buf is None:
            return None
        return _gpu_view(buf) if self.gpu else np.asarray(buf)

    @contextlib.contextmanager
    def serve(self, out_view):
        """On the GPU: the core's first allocation with ``out_view``'s shape and dtype is ``out_view`` itself (an
        XLA output buffer), the others come from CuPy's pool. A no-op on the CPU or for ``None``.

        Which of the core's buffers lands there is not assumed: :meth:`put` afterwards copies the result only if
        the core kept it elsewhere (another buffer of that shape asked first), and a buffer the core took as a
        transient is written by kernels that come before that copy on the same stream.
        """
        if not self.gpu or out_view is None or out_view.size == 0:
            yield
            return
        import cupy

        want = (tuple(int(s) for s in out_view.shape), _array.dtype_name(_array.logical_dtype(out_view)))
        served = []

        def alloc(shape, dtype_name):
            if not served and (tuple(int(s) for s in shape), dtype_name) == want:
                served.append(True)
                return out_view
            dt = _array.BF16 if dtype_name == "bfloat16" else np.dtype(dtype_name)
            return cupy.empty(shape, dtype=_array.storage_dtype(dt, True))

        with blazecore.allocator(alloc):
            yield

    def put(self, out_view, result) -> None:
        """Copy a core result into an XLA output view unless the core already wrote it there."""
        if result is None or out_view.size == 0:
            return
        src = _array.asarray(result, "result")
        if self.gpu:
            if src.data.ptr != out_view.data.ptr:
                out_view[...] = src.view(out_view.dtype)  # async D2D on the current (XLA's) stream
        elif src.ctypes.data != out_view.ctypes.data:
            out_view[...] = src


@contextlib.contextmanager
def _scope(ctx, bufs):
    """Decide CPU / GPU from the buffers; on the GPU make XLA's stream CuPy's current one."""
    first = next(b for b in bufs if b is not None)
    if not _buffer_on_gpu(first):
        yield _Views(False, None)
        return
    import cupy

    dev = int(first.__dlpack_device__()[1])
    handle = int(ctx.stream)
    with cupy.cuda.Device(dev), _array.external_stream(handle, dev):
        # allocations the core makes (workspaces, outputs it has no out= for) come from CuPy's pool
        # on this stream; XLA's own buffers are only ever written through views
        with blazecore.allocator(None):
            yield _Views(True, handle)


def _callback(fn, result_shapes):
    return _buffer_callback(fn, result_shapes, vmap_method=VMAP_METHOD)


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(int(s) for s in shape), np.dtype(dtype))


# ---------------------------------------------------------------------------------------------
# Trace-time checks (static shapes and dtypes only)
# ---------------------------------------------------------------------------------------------


def _dtype(a) -> np.dtype:
    return np.dtype(a.dtype)


def _dname(dt) -> str:
    return _array.dtype_name(dt)


def _check_float(a, name: str, allowed=_FLOATS) -> np.dtype:
    dt = _dtype(a)
    if dt not in allowed:
        raise TypeError(f"{name}: dtype {_dname(dt)} not supported (expected one of "
                        f"{', '.join(_dname(t) for t in allowed)})")
    return dt


def _check_ndim(a, name: str, ndim: int, what: str) -> None:
    if len(a.shape) != ndim:
        raise ValueError(f"{name}: expected {ndim}-D {what}, got shape {tuple(a.shape)}")


def _check_logits(logits, name="logits") -> tuple[int, int]:
    _check_ndim(logits, name, 2, "(L, E) router logits")
    _check_float(logits, name)
    return int(logits.shape[0]), int(logits.shape[1])


def _check_ids(ids, name: str, L: int) -> int:
    _check_ndim(ids, name, 2, "(L, K) expert ids")
    if _dtype(ids) not in _INTS:
        raise TypeError(f"{name}: dtype {_dname(_dtype(ids))}, expected int32 or int64")
    if int(ids.shape[0]) != L:
        raise ValueError(f"{name} has {int(ids.shape[0])} rows, expected L = {L}")
    return int(ids.shape[1])


def _check_ffn(x, w13, w2, gates, expert_ids, b13, b2, activation: str, checkpoint: str, weight_layout="out_in"):
    """dtypes here (JAX's); shapes by the core's rules (``blazecore.moe.ffn_shapes``, the weights read in
    ``weight_layout``)."""
    if checkpoint not in blazecore.CHECKPOINTS:
        raise ValueError(f"unknown checkpoint policy {checkpoint!r} (expected one of "
                         f"{', '.join(blazecore.CHECKPOINTS)})")
    dt = _check_float(x, "x")
    for name, a in (("w13", w13), ("w2", w2), ("b13", b13), ("b2", b2)):
        if a is not None and _dtype(a) != dt:
            raise TypeError(f"{name}: dtype {_dname(_dtype(a))} differs from x's {_dname(dt)} "
                            "(x, w13, w2, b13 and b2 share one dtype)")
    _check_float(gates, "gates", (np.dtype(np.float32),))
    if _dtype(expert_ids) not in _INTS:
        raise TypeError(f"expert_ids: dtype {_dname(_dtype(expert_ids))}, expected int32 or int64")
    L, d, E, R, h, K = ffn_shapes(x.shape, w13.shape, w2.shape, gates.shape, expert_ids.shape, activation=activation,
                                  b13=None if b13 is None else b13.shape, b2=None if b2 is None else b2.shape,
                                  weight_layout=weight_layout)
    return L, d, E, R, h, K, dt


# ---------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------


class JaxDispatch(NamedTuple):
    """:class:`blazecore.Dispatch` as int32 JAX arrays: expert_offsets (E+1,), slot_token (L*K,),
    slot_k (L*K,), pair_slot (L, K). Built by :func:`build_dispatch`; pass it to :func:`moe_ffn`."""

    expert_offsets: jax.Array
    slot_token: jax.Array
    slot_k: jax.Array
    pair_slot: jax.Array

    def counts(self) -> jax.Array:
        """Pairs per expert, (E,) int32."""
        return self.expert_offsets[1:] - self.expert_offsets[:-1]


def _build_dispatch_cb(ctx, outs, ids, *, num_experts: int, validate: bool):
    with _scope(ctx, (ids,)) as v:
        d = blazecore.build_dispatch(v(ids), num_experts, validate=validate, stream=v.stream)
        for o, r in zip(outs, (d.expert_offsets, d.slot_token, d.slot_k, d.pair_slot), strict=True):
            v.put(v(o), r)


def build_dispatch(expert_ids, num_experts: int, *, validate: bool = True) -> JaxDispatch:
    """Dispatch of a routing (``blazecore.build_dispatch``), int32 arrays without gradient.

    Args:
        expert_ids: (L, K) int32 / int64, K distinct values in [0, num_experts) per row.
        num_experts: E >= K.
        validate: check the id values (on the GPU a device-to-host read that synchronises XLA's stream;
            pass False for ids from :func:`route_topk`). The CPU always checks. Concrete ids (outside ``jit``)
            are checked here, before anything is staged: a bad id raises ValueError naming the (token, k).
            Inside ``jit`` the values exist only when the callback runs, and JAX reports the callback's
            ValueError as a ``JaxRuntimeError`` whose message ends with it.
    """
    L, K = (int(s) for s in expert_ids.shape) if len(expert_ids.shape) == 2 else (0, 0)
    _check_ids(expert_ids, "expert_ids", L)
    E = int(num_experts)
    if not 1 <= K <= E:
        raise ValueError(f"top_k K = {K} must be in [1, num_experts = {E}]")
    shapes = (_sds((E + 1,), np.int32), _sds((L * K,), np.int32), _sds((L * K,), np.int32),
              _sds((L, K), np.int32))
    if validate and _concrete(expert_ids):
        # concrete ids (outside jit): check them here, so a bad id is a ValueError with its own message; inside
        # the callback it would reach the caller as a JaxRuntimeError that wraps the traceback around it
        _check_id_values(expert_ids, E)
        validate = False
    cb = functools.partial(_build_dispatch_cb, num_experts=E, validate=bool(validate))
    return JaxDispatch(*_callback(cb, shapes)(jax.lax.stop_gradient(expert_ids)))


def _concrete(a) -> bool:
    """True for an array with values (not a tracer of jit, vmap or grad)."""
    return not isinstance(a, jax.core.Tracer)


def _check_id_values(expert_ids, num_experts: int) -> None:
    """ValueError naming the first (token, k) whose id is outside [0, E) or repeats in its row (a host read)."""
    from blazecore.dispatch import check_ids_host

    check_ids_host(np.asarray(expert_ids), num_experts)


def _core_dispatch(v: _Views, offsets, slot_token, slot_k, pair_slot) -> blazecore.Dispatch:
    L, K = (int(s) for s in pair_slot.shape)
    return blazecore.Dispatch(v(offsets), v(slot_token), v(slot_k), v(pair_slot), L, K, int(offsets.shape[0]) - 1)


# ---------------------------------------------------------------------------------------------
# Router
# ---------------------------------------------------------------------------------------------


def _route_fwd_cb(ctx, outs, logits, bias, *, top_k, score, renormalize):
    with _scope(ctx, (logits,)) as v:
        blazecore.route_topk(v(logits), top_k, score=score, renormalize=renormalize,
                                        expert_bias=v(bias), out_gates=v(outs[0]), out_ids=v(outs[1]),
                                        stream=v.stream)


def _route_bwd_cb(ctx, outs, dgates, logits, ids, *, score, renormalize):
    with _scope(ctx, (logits,)) as v:
        blazecore.route_topk_backward(v(dgates), v(logits), v(ids), score=score, renormalize=renormalize,
                                      out=v(outs), stream=v.stream)


def _route_call(logits, bias, top_k, score, renormalize):
    L, _ = logits.shape
    shapes = (_sds((L, top_k), np.float32), _sds((L, top_k), np.int32))
    cb = functools.partial(_route_fwd_cb, top_k=top_k, score=score, renormalize=renormalize)
    return tuple(_callback(cb, shapes)(logits, bias))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _route(logits, bias, top_k, score, renormalize):
    return _route_call(logits, bias, top_k, score, renormalize)


def _route_fwd(logits, bias, top_k, score, renormalize):
    gates, ids = _route_call(logits, bias, top_k, score, renormalize)
    return (gates, ids), (logits, ids, bias)


def _route_bwd(top_k, score, renormalize, res, cts):
    logits, ids, bias = res
    dgates = cts[0]
    cb = functools.partial(_route_bwd_cb, score=score, renormalize=renormalize)
    dlogits = _callback(cb, _sds(logits.shape, logits.dtype))(dgates.astype(jnp.float32), logits, ids)
    return dlogits, (None if bias is None else jnp.zeros_like(bias))


_route.defvjp(_route_fwd, _route_bwd)


def route_topk(logits, top_k: int, *, score: str = "softmax", renormalize: bool = True, expert_bias=None):
    """Top-k routing (``blazecore.route_topk``); differentiable w.r.t. the logits.

    Args:
        logits: (L, E) float32 / float16 / bfloat16.
        top_k: K in [1, E].
        score: "softmax" or "sigmoid".
        renormalize: divide the selected scores by their sum.
        expert_bias: optional (E,) selection-only bias, cast to float32; gets a zero gradient.

    Returns:
        (gates (L, K) float32, expert_ids (L, K) int32).
    """
    L, E = _check_logits(logits)
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if not 1 <= int(top_k) <= E:
        raise ValueError(f"top_k = {top_k} must be in [1, E] with E = {E} experts")
    if score not in ("softmax", "sigmoid"):
        raise ValueError(f"score must be 'softmax' or 'sigmoid', got {score!r}")
    if expert_bias is not None:
        if tuple(expert_bias.shape) != (E,):
            raise ValueError(f"expert_bias: expected shape {(E,)}, got {tuple(expert_bias.shape)}")
        expert_bias = jax.lax.stop_gradient(jnp.asarray(expert_bias, jnp.float32))
    return _route(logits, expert_bias, int(top_k), score, bool(renormalize))


def _lb_fwd_cb(ctx, out, logits, ids):
    with _scope(ctx, (logits,)) as v:
        blazecore.load_balancing_loss(v(logits), v(ids), out=v(out), stream=v.stream)


def _lb_bwd_cb(ctx, out, dloss, logits, ids):
    with _scope(ctx, (logits,)) as v:
        blazecore.load_balancing_loss_backward(v(dloss), v(logits), v(ids), out=v(out), stream=v.stream)


def _z_fwd_cb(ctx, out, logits):
    with _scope(ctx, (logits,)) as v:
        blazecore.router_z_loss(v(logits), out=v(out), stream=v.stream)


def _z_bwd_cb(ctx, out, dloss, logits):
    with _scope(ctx, (logits,)) as v:
        blazecore.router_z_loss_backward(v(dloss), v(logits), out=v(out), stream=v.stream)


_LOSS = _sds((), np.float32)


@jax.custom_vjp
def _lb(logits, ids):
    return _callback(_lb_fwd_cb, _LOSS)(logits, ids)


def _lb_fwd(logits, ids):
    return _lb(logits, ids), (logits, ids)


def _lb_bwd(res, dloss):
    logits, ids = res
    d = _callback(_lb_bwd_cb, _sds(logits.shape, logits.dtype))(dloss.astype(jnp.float32), logits, ids)
    return d, None


_lb.defvjp(_lb_fwd, _lb_bwd)


@jax.custom_vjp
def _z(logits):
    return _callback(_z_fwd_cb, _LOSS)(logits)


def _z_fwd(logits):
    return _z(logits), (logits,)


def _z_bwd(res, dloss):
    (logits,) = res
    return (_callback(_z_bwd_cb, _sds(logits.shape, logits.dtype))(dloss.astype(jnp.float32), logits),)


_z.defvjp(_z_fwd, _z_bwd)


def load_balancing_loss(logits, expert_ids):
    """Switch load-balancing loss E * sum_e f_e P_e, a 0-d float32, differentiable w.r.t. the logits."""
    L, _ = _check_logits(logits)
    _check_ids(expert_ids, "expert_ids", L)
    return _lb(logits, jax.lax.stop_gradient(expert_ids))


def router_z_loss(logits):
    """Router z-loss mean_t logsumexp(logits_t)^2, a 0-d float32, differentiable w.r.t. the logits."""
    _check_logits(logits)
    return _z(logits)


# ---------------------------------------------------------------------------------------------
# Expert FFN
# ---------------------------------------------------------------------------------------------


class MoEGrads(NamedTuple):
    """Gradients of :func:`moe_backward`: dx, dw13, dw2 (x's dtype), dgates float32, db13 / db2 or None."""

    dx: jax.Array
    dw13: jax.Array
    dw2: jax.Array
    dgates: jax.Array
    db13: jax.Array | None
    db2: jax.Array | None


def _ffn_fwd_cb(ctx, outs, x, w13, w2, gates, ids, disp, b13, b2, *, activation, checkpoint, chunks=1,
                act_in_operand=True, weight_layout="out_in"):
    y_out, ab_out = outs
    with _scope(ctx, (x,)) as v:
        ab_view = v(ab_out) if checkpoint == "ab" else None
        # the core has no out= for the pre-activations: its (L*K, R) allocation is served XLA's ab buffer, which
        # saves a device copy of L*K*R elements and that much CuPy memory (put copies only if it went elsewhere)
        with v.serve(ab_view):
            y, saved = blazecore.moe_forward(v(x), v(w13), v(w2), v(gates), v(ids), activation=activation,
                                             checkpoint=checkpoint, b13=v(b13), b2=v(b2),
                                             dispatch=_core_dispatch(v, *disp), out=v(y_out), stream=v.stream,
                                             chunks=chunks, act_in_operand=act_in_operand,
                                             weight_layout=weight_layout)
        if ab_view is not None:
            v.put(ab_view, saved.ab)


def _ffn_bwd_cb(ctx, outs, ab, dy, x, w13, w2, gates, ids, disp, b13, b2, *, activation, checkpoint, chunks=1,
                weight_layout="out_in"):
    dz, dx, dw13, dw2, dgates, db13, db2 = outs
    with _scope(ctx, (x,)) as v:
        # under "ab", dz is the output aliased to the ab input (input_output_aliases): the same bytes as ab
        # whenever XLA could donate them, a copy of ab otherwise; the core writes dz over it (retain=False)
        # (an aliased output starts out holding the input's values)
        z = v(dz) if checkpoint == "ab" else None
        if z is not None:
            # where XLA gave dz a buffer of its own after all (seen inside the loop of a sequential vmap on the
            # GPU), it starts from ab's values: copied on XLA's stream, nothing to do when the two are one buffer
            v.put(z, v(ab))
        saved = blazecore.MoESaved(v(x), v(w13), v(w2), v(gates), v(ids), _core_dispatch(v, *disp), activation,
                                   checkpoint, v(b13), v(b2), z, chunks=chunks, weight_layout=weight_layout)
        g = blazecore.moe_backward(v(dy), saved, out_dx=v(dx), out_dw13=v(dw13), out_dw2=v(dw2),
                                   out_dgates=v(dgates), stream=v.stream, retain=False)
        if db13 is not None:
            v.put(v(db13), g.db13)
        if db2 is not None:
            v.put(v(db2), g.db2)


def moe_forward(x, w13, w2, gates, expert_ids, dispatch: JaxDispatch, *, b13=None, b2=None,
                activation: str = "swiglu", checkpoint: str = "ab", chunks: int = 1, weight_layout: str = "out_in"):
    """Forward op (no gradient of its own; :func:`moe_ffn` is the differentiable entry point).

    Returns (y (L, d) in x's dtype, ab): ab the (L*K, R) pre-activations in expert-slot order under
    checkpoint "ab", a (0, R) placeholder under "none"; pass it to :func:`moe_backward` with the same
    ``chunks`` (token chunks, see ``blazecore.moe_forward``; ab's rows are laid out chunk by chunk) and the same
    ``weight_layout`` (``blazecore.moe_forward``'s).
    """
    L, d, E, R, h, K, dt = _check_ffn(x, w13, w2, gates, expert_ids, b13, b2, activation, checkpoint, weight_layout)
    _check_dispatch(dispatch, L, K, E)
    shapes = (_sds((L, d), dt), _sds((L * K if checkpoint == "ab" else 0, R), dt))
    chunks = _chunks(chunks)
    aio = blazecore.memory.act_in_operand_lowers_peak(L, d, h, E, K, dtype=np.dtype(dt).name, activation=activation,
                                                      checkpoint=checkpoint, chunks=chunks,
                                                      bias=(b13 is not None, b2 is not None),
                                                      weight_layout=weight_layout)
    cb = functools.partial(_ffn_fwd_cb, activation=activation, checkpoint=checkpoint, chunks=chunks,
                           act_in_operand=aio, weight_layout=weight_layout)
    y, ab = _callback(cb, shapes)(x, w13, w2, gates, expert_ids, tuple(dispatch), b13, b2)
    return y, ab


def moe_backward(dy, x, w13, w2, gates, expert_ids, dispatch: JaxDispatch, ab, *, b13=None, b2=None,
                 activation: str = "swiglu", checkpoint: str = "ab", chunks: int = 1,
                 weight_layout: str = "out_in") -> MoEGrads:
    """Backward op: gradients of sum(dy * y) from the forward's inputs and its ``ab`` (dw13 and dw2 in the weights'
    ``weight_layout``)."""
    L, d, E, R, h, K, dt = _check_ffn(x, w13, w2, gates, expert_ids, b13, b2, activation, checkpoint, weight_layout)
    _check_dispatch(dispatch, L, K, E)
    if tuple(dy.shape) != (L, d) or _dtype(dy) != dt:
        raise ValueError(f"dy: expected ({L}, {d}) {_dname(dt)}, got {tuple(dy.shape)} {_dname(_dtype(dy))}")
    want_ab = (L * K if checkpoint == "ab" else 0, R)
    if tuple(ab.shape) != want_ab or _dtype(ab) != dt:
        raise ValueError(f"ab: expected the forward's saved pre-activations, {want_ab} {_dname(dt)}; got "
                         f"{tuple(ab.shape)} {_dname(_dtype(ab))}")
    shapes = (_sds(ab.shape, dt), _sds(x.shape, dt), _sds(w13.shape, dt), _sds(w2.shape, dt),
              _sds(gates.shape, np.float32), None if b13 is None else _sds(b13.shape, dt),
              None if b2 is None else _sds(b2.shape, dt))
    cb = functools.partial(_ffn_bwd_cb, activation=activation, checkpoint=checkpoint, chunks=_chunks(chunks),
                           weight_layout=weight_layout)
    # ab is input 0 and dz output 0 (ab first: buffer_callback checks alias indices against the top-level
    # argument count)
    aliases = {0: 0} if checkpoint == "ab" else None
    out = _buffer_callback(cb, shapes, vmap_method=VMAP_METHOD, input_output_aliases=aliases)(
        ab, dy, x, w13, w2, gates, expert_ids, tuple(dispatch), b13, b2)
    return MoEGrads(*out[1:])


def _chunks(chunks) -> int:
    if isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer)) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
    return int(chunks)


def _check_dispatch(dispatch, L: int, K: int, E: int) -> None:
    if not isinstance(dispatch, JaxDispatch):
        raise TypeError(f"dispatch: expected a JaxDispatch (from build_dispatch), got {type(dispatch).__name__}")
    want = {"expert_offsets": (E + 1,), "slot_token": (L * K,), "slot_k": (L * K,), "pair_slot": (L, K)}
    for name, shape in want.items():
        a = getattr(dispatch, name)
        if tuple(a.shape) != shape or _dtype(a) != np.dtype(np.int32):
            raise ValueError(f"dispatch.{name}: expected {shape} int32, got {tuple(a.shape)} {_dname(_dtype(a))} "
                             "(was the dispatch built for other expert_ids or another number of experts?)")


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def _ffn(x, w13, w2, gates, ids, disp, b13, b2, activation, checkpoint, chunks, weight_layout):
    return moe_forward(x, w13, w2, gates, ids, disp, b13=b13, b2=b2, activation=activation,
                       checkpoint=checkpoint, chunks=chunks, weight_layout=weight_layout)[0]


def _ffn_fwd(x, w13, w2, gates, ids, disp, b13, b2, activation, checkpoint, chunks, weight_layout):
    y, ab = moe_forward(x, w13, w2, gates, ids, disp, b13=b13, b2=b2, activation=activation, checkpoint=checkpoint,
                        chunks=chunks, weight_layout=weight_layout)
    return y, (x, w13, w2, gates, ids, disp, ab, b13, b2)


def _ffn_bwd(activation, checkpoint, chunks, weight_layout, res, dy):
    x, w13, w2, gates, ids, disp, ab, b13, b2 = res
    g = moe_backward(dy.astype(x.dtype), x, w13, w2, gates, ids, disp, ab, b13=b13, b2=b2, activation=activation,
                     checkpoint=checkpoint, chunks=chunks, weight_layout=weight_layout)
    return g.dx, g.dw13, g.dw2, g.dgates, None, None, g.db13, g.db2


_ffn.defvjp(_ffn_fwd, _ffn_bwd)


def moe_ffn(x, w13, w2, gates, expert_ids, *, activation: str = "swiglu", checkpoint: str = "ab", b13=None,
            b2=None, dispatch: JaxDispatch | None = None, chunks: int = 1, weight_layout: str = "out_in"):
    """The expert FFNs and gate-weighted combine, differentiable w.r.t. x, w13, w2, gates, b13, b2.

    Args:
        x: (L, d) float32 / float16 / bfloat16.
        w13: (E, 2h, d) for gated activations ([gate rows; up rows], or interleaved pairs with an activation named
            "<gated>_interleaved"), (E, h, d) otherwise; x's dtype; (E, d, 2h or h) with ``weight_layout="in_out"``.
        w2: (E, d, h), x's dtype; (E, h, d) with ``weight_layout="in_out"``.
        gates: (L, K) float32.
        expert_ids: (L, K) int32 / int64, distinct per row, in [0, E).
        activation: one of ``blazecore.ACTIVATIONS``.
        checkpoint: "ab" (keep the (L*K, R) pre-activations for the backward) or "none" (recompute).
        b13, b2: optional (E, R) and (E, d) biases, x's dtype.
        dispatch: a :class:`JaxDispatch` of ``expert_ids``; built here (validating the ids) when None.
        chunks: run the tokens in this many chunks (``blazecore.moe_forward``): transients scale with
            L / chunks, results are bit-identical to one chunk.
        weight_layout: "out_in" (default) or "in_out" (``blazecore.moe_forward``'s): how w13 and w2 are stored,
            read as stored; their gradients come in the same layout.

    Returns:
        y (L, d) in x's dtype.
    """
    _, _, E, _, _, _, _ = _check_ffn(x, w13, w2, gates, expert_ids, b13, b2, activation, checkpoint, weight_layout)
    expert_ids = jax.lax.stop_gradient(expert_ids)
    if dispatch is None:
        dispatch = build_dispatch(expert_ids, E)
    dispatch = JaxDispatch(*(jax.lax.stop_gradient(a) for a in dispatch))
    return _ffn(x, w13, w2, gates, expert_ids, dispatch, b13, b2, activation, checkpoint, _chunks(chunks),
                weight_layout)
