"""blazecore's ops as PyTorch custom ops (namespace ``blazecore``), with fake kernels and autograd.

Ops (``torch.ops.blazecore.<name>``), each a ``torch.library.custom_op`` with ``register_fake``:

    route_topk(logits, top_k, score, renormalize, expert_bias?) -> (gates, expert_ids)
    route_topk_backward(dgates, logits, expert_ids, score, renormalize) -> dlogits
    load_balancing_loss(logits, expert_ids) -> loss            load_balancing_loss_backward(dloss, ...)
    router_z_loss(logits) -> loss                              router_z_loss_backward(dloss, logits)
    build_dispatch(expert_ids, num_experts, validate) -> (expert_offsets, slot_token, slot_k, pair_slot)
    moe_forward(x, w13, w2, gates, expert_ids, <dispatch>, b13?, b2?, activation, checkpoint) -> (y, ab)
    moe_backward(dy, x, w13, w2, gates, expert_ids, <dispatch>, ab, b13?, b2?, activation, checkpoint)
        -> (dx, dw13, dw2, dgates, db13, db2)

The forward ops carry ``register_autograd`` wiring to the backward ops, which are custom ops themselves, so
``torch.compile`` sees one opaque node per direction. The Python functions at the bottom
(:func:`route_topk`, :func:`build_dispatch`, :func:`moe_ffn`, ...) are the convenient entry points. In plain
eager mode (no compile or export tracing, no functorch transform, ordinary CPU/CUDA tensors) they run the same
implementations, setup_context and backward functions through one ``torch.autograd.Function`` instead of the
dispatcher, whose custom-op path costs a few hundred microseconds of host time a call (more than a router op's
GPU time); mutated arguments get their version bumped as the dispatcher would.

What the adapter does and does not do: no math. It converts tensors to blazecore's intake (DLPack,
zero-copy; bf16 included), installs an allocator so every GPU output and workspace is a ``torch.empty``
(the caching allocator owns and counts the memory: ``torch.cuda.max_memory_allocated`` sees it), launches
on torch's current stream, and turns the NumPy results of the CPU reference path into tensors.

The MoESaved record of ``blazecore.moe_forward`` cannot cross a custom-op boundary, so ``moe_forward``
returns what the backward needs besides its inputs as tensors: ``ab``, the pre-activations (L*K, R) in
x's dtype in expert-slot order under checkpoint "ab" (a (0, R) placeholder under "none"); the dispatch
tensors are inputs of both ops. ``moe_backward`` rebuilds a MoESaved from them and, as the core does, writes
the activation gradient dz over ``ab`` (the op declares ``ab`` mutated, so no (L*K, R) buffer is allocated
beside it). The mutation bumps ``ab``'s version counter: a second backward through the same graph
(``retain_graph=True``) raises PyTorch's error for a saved tensor modified in place instead of computing
garbage. ``moe_ffn(..., retain_saved=True)`` (and ``MoELayer(retain_saved=True)``) keeps the saved
pre-activations intact (the backward works on a copy), at the cost of one (L*K, R) transient. Under
``torch.compile`` the backward also works on a copy (AOTAutograd cannot partition a backward that mutates a saved
forward output), so the saving is eager-mode only.

dtypes: x, w13, w2 (and biases) float32, float16 or bfloat16 with float32 gates, on CPU or CUDA. On
the CPU, float64 is accepted as well (gates, router losses and their gradients float64 too): it goes through
the core's functions like every dtype, whose CPU path is the float64 NumPy reference; that is what
``torch.autograd.gradcheck`` needs. float64 CUDA tensors are the core's TypeError.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import NamedTuple

import numpy as np
import torch

import blazecore
from blazecore import _array

__all__ = [
    "TorchDispatch",
    "build_dispatch",
    "load_balancing_loss",
    "moe_ffn",
    "route_topk",
    "router_z_loss",
]

_LIB = "blazecore"


# ---------------------------------------------------------------------------------------------
# Conversion: tensors in, tensors out, torch-owned memory, torch's stream
# ---------------------------------------------------------------------------------------------


def _torch_allocator(device: torch.device):
    def alloc(shape, dtype_name):
        return torch.empty(shape, dtype=getattr(torch, dtype_name), device=device)

    alloc.blazecore_view = _cuda_view  # (the core then skips its checks of the view: a fresh tensor is plain)
    return alloc


_CUPY_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "uint16",  # bf16 as its bits
                torch.int32: "int32", torch.int64: "int64", torch.uint8: "uint8", torch.int8: "int8",
                torch.int16: "int16", torch.bool: "bool", torch.float64: "float64"}


def _cuda_view(t):
    """A zero-copy CuPy view of a plain, non-empty CUDA tensor that needs no grad (else None: DLPack decides).

    Used inside :func:`_core_call` only, where CuPy's current stream is torch's: the view needs none of DLPack's
    stream handshake. The view holds the tensor (its storage stays alive while the view lives).
    """
    if type(t) is not torch.Tensor or not t.is_cuda or t.requires_grad:
        return None
    name = _CUPY_DTYPES.get(t.dtype)
    n = t.numel()
    if name is None or n == 0:
        return None
    cupy = _array._cupy()
    item = t.element_size()
    shape = tuple(t.shape)
    if t.is_contiguous():  # (CuPy's default strides are the C-contiguous ones)
        mem = cupy.cuda.UnownedMemory(t.data_ptr(), n * item, t, t.get_device())
        return cupy.ndarray(shape, dtype=name, memptr=cupy.cuda.MemoryPointer(mem, 0))
    stride = t.stride()
    if any(st < 0 for st in stride):
        return None
    span = (sum((n_ - 1) * st for n_, st in zip(shape, stride, strict=True)) + 1) * item
    mem = cupy.cuda.UnownedMemory(t.data_ptr(), span, t, t.get_device())
    return cupy.ndarray(shape, dtype=name, memptr=cupy.cuda.MemoryPointer(mem, 0),
                        strides=tuple(st * item for st in stride))


@contextlib.contextmanager
def _core_call(device: torch.device):
    """Context for one core call on ``device``; yields the ``stream=`` argument (None on the CPU).

    On CUDA: the device is made current, torch's current stream becomes CuPy's current stream as well
    (DLPack hand-overs then need no cross-stream event), tensors reach the core as direct CuPy views
    (:func:`_cuda_view`) and every output or workspace is ``torch.empty``.
    """
    if device.type != "cuda":
        yield None
        return
    import cupy

    with torch.cuda.device(device):
        handle = torch.cuda.current_stream(device).cuda_stream
        with cupy.cuda.Device(device.index), _array.external_stream(handle, device.index):
            with blazecore.allocator(_torch_allocator(device)), _array.intake(_cuda_view):
                yield handle


def _to_torch(a) -> torch.Tensor:
    """A core result as a tensor: torch tensors (from the allocator) pass; NumPy (CPU path) is wrapped."""
    if isinstance(a, torch.Tensor):
        return a
    if isinstance(a, np.ndarray):
        if not a.flags.c_contiguous:
            a = a.copy(order="C")  # (np.ascontiguousarray would turn a 0-d loss into shape (1,))
        if a.dtype == blazecore.BF16:
            return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    t = torch.from_dlpack(a)  # a CuPy view of an allocator tensor: shares its memory
    # uint16 is how the core holds bf16 on the GPU (no blazecore op has real uint16 data)
    return t.view(torch.bfloat16) if t.dtype == torch.uint16 else t


def _detach(*tensors):
    """The op's inputs as plain tensors: a custom op's implementation can still see ``requires_grad`` inputs
    (autograd has been handled above it), and DLPack refuses to export those."""
    return tuple(None if t is None else t.detach() for t in tensors)


def _is_f64(t: torch.Tensor) -> bool:
    return t.dtype == torch.float64


def _check_same_device(tensors: dict) -> torch.device:
    devs = {n: t.device for n, t in tensors.items() if t is not None}
    if len(set(devs.values())) > 1:
        where = ", ".join(f"{n} on {d}" for n, d in devs.items())
        raise ValueError(f"blazecore: inputs must all be on one device: {where}")
    return next(iter(devs.values()))


# ---------------------------------------------------------------------------------------------
# Eager calls without the dispatcher
# ---------------------------------------------------------------------------------------------

# Every op is a torch.library.custom_op (what torch.compile, export and opcheck see). In plain eager mode the
# public functions call the same Python implementations through one torch.autograd.Function instead: the
# dispatcher's custom-op path costs a few hundred microseconds of host time a call, more than a router op's
# GPU time, so a layer of ten ops would wait on the host.
_IMPLS: dict = {}  # op name -> the undecorated implementation
_AUTOGRAD: dict = {}  # op name -> (setup_context, backward)
_MUTATED: dict = {}  # op name -> positions of the arguments it writes


def _op(name: str, mutates_args=()):
    """``torch.library.custom_op`` as ``blazecore::<name>``, keeping the implementation for :func:`_run`."""
    def deco(fn):
        _IMPLS[name] = fn
        params = list(inspect.signature(fn).parameters)
        _MUTATED[name] = tuple(params.index(a) for a in mutates_args)
        return torch.library.custom_op(f"{_LIB}::{name}", mutates_args=mutates_args)(fn)

    return deco


def _autograd(op, name: str, backward, setup_context) -> None:
    op.register_autograd(backward, setup_context=setup_context)
    _AUTOGRAD[name] = (setup_context, backward)


def _eager(args) -> bool:
    """Whether a call may skip the dispatcher: eager mode, no functorch transform, plain CPU/CUDA tensors."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    return all(type(a) is torch.Tensor and a.device.type in ("cpu", "cuda") for a in args
               if isinstance(a, torch.Tensor))


class _EagerOp(torch.autograd.Function):
    """An op with autograd, run eagerly: the op's implementation, its setup_context and its backward."""

    @staticmethod
    def forward(ctx, name, *args):
        out = _IMPLS[name](*args)
        _AUTOGRAD[name][0](ctx, args, out)
        ctx.blazecore_op = name
        return out

    @staticmethod
    def backward(ctx, *grads):
        g = _AUTOGRAD[ctx.blazecore_op][1](ctx, *grads)
        return (None, *(g if isinstance(g, tuple) else (g,)))


def _run(name: str, *args):
    """``torch.ops.blazecore.<name>(*args)``, or in eager mode its implementation (through :class:`_EagerOp` when
    it has autograd), with the version of every argument it writes bumped as the dispatcher would."""
    if not _eager(args):
        return getattr(torch.ops.blazecore, name)(*args)
    if name in _AUTOGRAD and torch.is_grad_enabled():
        return _EagerOp.apply(name, *args)
    out = _IMPLS[name](*args)
    for i in _MUTATED[name]:
        if args[i] is not None:
            torch.autograd.graph.increment_version(args[i])
    return out


# ---------------------------------------------------------------------------------------------
# Router
# ---------------------------------------------------------------------------------------------


@_op("route_topk", mutates_args=())
def _route_topk_op(logits: torch.Tensor, top_k: int, score: str, renormalize: bool,
                   expert_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    logits, expert_bias = _detach(logits, expert_bias)
    with _core_call(logits.device) as stream:
        g, i = blazecore.route_topk(logits, top_k, score=score, renormalize=renormalize,
                                               expert_bias=expert_bias, stream=stream)
        return _to_torch(g), _to_torch(i)


@_route_topk_op.register_fake
def _(logits, top_k, score, renormalize, expert_bias):
    L = logits.shape[0]
    gdt = torch.float64 if _is_f64(logits) else torch.float32
    return logits.new_empty((L, top_k), dtype=gdt), logits.new_empty((L, top_k), dtype=torch.int32)


@_op("route_topk_backward", mutates_args=())
def _route_topk_backward_op(dgates: torch.Tensor, logits: torch.Tensor, expert_ids: torch.Tensor, score: str,
                            renormalize: bool) -> torch.Tensor:
    dgates, logits, expert_ids = _detach(dgates, logits, expert_ids)
    with _core_call(logits.device) as stream:
        d = blazecore.route_topk_backward(dgates, logits, expert_ids, score=score, renormalize=renormalize,
                                          stream=stream)
        return _to_torch(d)


@_route_topk_backward_op.register_fake
def _(dgates, logits, expert_ids, score, renormalize):
    return torch.empty_like(logits)


def _route_setup(ctx, inputs, output):
    logits, _, score, renormalize, _ = inputs
    _, ids = output
    ctx.save_for_backward(logits, ids)
    ctx.score, ctx.renormalize = score, renormalize


def _route_backward(ctx, dgates, dids):
    logits, ids = ctx.saved_tensors
    if dgates is None:
        return None, None, None, None, None
    dlogits = _run("route_topk_backward", dgates.contiguous(), logits, ids, ctx.score, ctx.renormalize)
    return dlogits, None, None, None, None


_autograd(_route_topk_op, "route_topk", _route_backward, _route_setup)


def _loss_dtype(logits):
    return torch.float64 if _is_f64(logits) else torch.float32


@_op("load_balancing_loss", mutates_args=())
def _lb_loss_op(logits: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    logits, expert_ids = _detach(logits, expert_ids)
    with _core_call(logits.device) as stream:
        return _to_torch(blazecore.load_balancing_loss(logits, expert_ids, stream=stream))


@_lb_loss_op.register_fake
def _(logits, expert_ids):
    return logits.new_empty((), dtype=_loss_dtype(logits))


@_op("load_balancing_loss_backward", mutates_args=())
def _lb_loss_backward_op(dloss: torch.Tensor, logits: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    dloss, logits, expert_ids = _detach(dloss, logits, expert_ids)
    with _core_call(logits.device) as stream:
        # a CUDA dloss is read by the kernel (no host round trip); a CPU one becomes a Python number
        return _to_torch(blazecore.load_balancing_loss_backward(dloss.to(_loss_dtype(logits)).contiguous(), logits,
                                                                expert_ids, stream=stream))


@_lb_loss_backward_op.register_fake
def _(dloss, logits, expert_ids):
    return torch.empty_like(logits)


def _lb_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _lb_backward(ctx, dloss):
    logits, ids = ctx.saved_tensors
    return _run("load_balancing_loss_backward", dloss, logits, ids), None


_autograd(_lb_loss_op, "load_balancing_loss", _lb_backward, _lb_setup)


@_op("router_z_loss", mutates_args=())
def _z_loss_op(logits: torch.Tensor) -> torch.Tensor:
    (logits,) = _detach(logits)
    with _core_call(logits.device) as stream:
        return _to_torch(blazecore.router_z_loss(logits, stream=stream))


@_z_loss_op.register_fake
def _(logits):
    return logits.new_empty((), dtype=_loss_dtype(logits))


@_op("router_z_loss_backward", mutates_args=())
def _z_loss_backward_op(dloss: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    dloss, logits = _detach(dloss, logits)
    with _core_call(logits.device) as stream:
        return _to_torch(blazecore.router_z_loss_backward(dloss.to(_loss_dtype(logits)).contiguous(), logits,
                                                          stream=stream))


@_z_loss_backward_op.register_fake
def _(dloss, logits):
    return torch.empty_like(logits)


def _z_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _z_backward(ctx, dloss):
    (logits,) = ctx.saved_tensors
    return _run("router_z_loss_backward", dloss, logits)


_autograd(_z_loss_op, "router_z_loss", _z_backward, _z_setup)


# ---------------------------------------------------------------------------------------------
# Row sums (the expert-parallel exchange's combines)
# ---------------------------------------------------------------------------------------------


@_op("sum_rows", mutates_args=())
def _sum_rows_op(rows: torch.Tensor, index: torch.Tensor, validate: bool) -> torch.Tensor:
    rows, index = _detach(rows, index)
    _check_same_device({"rows": rows, "index": index})
    with _core_call(rows.device) as stream:
        return _to_torch(blazecore.sum_rows(rows, index, stream=stream, validate=validate))


@_sum_rows_op.register_fake
def _(rows, index, validate):
    return rows.new_empty((index.shape[0], rows.shape[1]))


def sum_rows(rows: torch.Tensor, index: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
    """``blazecore.sum_rows`` on tensors: out[i] = sum_j rows[index[i, j]] over the entries >= 0, in j order,
    accumulated in float32 and rounded once (deterministic). rows (n, w) float32 / float16 / bfloat16 (float64 on
    the CPU), index (m, J) int32, both C-contiguous. Forward only: the result carries no gradient (the
    expert-parallel layer pairs it with a gather in its own autograd Functions)."""
    return _run("sum_rows", rows, index, validate)


# ---------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------


@_op("build_dispatch", mutates_args=())
def _build_dispatch_op(expert_ids: torch.Tensor, num_experts: int,
                       validate: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    with _core_call(expert_ids.device) as stream:
        d = blazecore.build_dispatch(expert_ids, num_experts, validate=validate, stream=stream)
        # the core's GPU dispatch fields are CuPy views of allocator tensors: converted on torch's stream
        return (_to_torch(d.expert_offsets), _to_torch(d.slot_token), _to_torch(d.slot_k), _to_torch(d.pair_slot))


@_build_dispatch_op.register_fake
def _(expert_ids, num_experts, validate):
    L, K = expert_ids.shape
    i32 = torch.int32
    return (expert_ids.new_empty((num_experts + 1,), dtype=i32), expert_ids.new_empty((L * K,), dtype=i32),
            expert_ids.new_empty((L * K,), dtype=i32), expert_ids.new_empty((L, K), dtype=i32))


# ---------------------------------------------------------------------------------------------
# Expert FFN
# ---------------------------------------------------------------------------------------------


def _core_dispatch(expert_offsets, slot_token, slot_k, pair_slot, L: int, K: int) -> blazecore.Dispatch:
    a = _array.asarray
    return blazecore.Dispatch(a(expert_offsets, "expert_offsets"), a(slot_token, "slot_token"), a(slot_k, "slot_k"),
                              a(pair_slot, "pair_slot"), L, K, int(expert_offsets.shape[0]) - 1)


@_op("moe_forward", mutates_args=())
def _moe_forward_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, gates: torch.Tensor,
                    expert_ids: torch.Tensor, expert_offsets: torch.Tensor, slot_token: torch.Tensor,
                    slot_k: torch.Tensor, pair_slot: torch.Tensor, b13: torch.Tensor | None,
                    b2: torch.Tensor | None, activation: str, checkpoint: str,
                    chunks: int = 1, retain_saved: bool = False,
                    weight_layout: str = "out_in") -> tuple[torch.Tensor, torch.Tensor]:
    L, K = expert_ids.shape
    y, ab, _ = _core_forward(x, w13, w2, gates, expert_ids, b13, b2, activation, checkpoint, weight_layout,
                             lambda: _core_dispatch(expert_offsets, slot_token, slot_k, pair_slot, L, K), chunks)
    return y, ab


def _core_forward(x, w13, w2, gates, expert_ids, b13, b2, activation, checkpoint, weight_layout, dispatch, chunks=1):
    """blazecore.moe_forward inside one core call: (y, ab, the core's dispatch) as tensors (ab: a (0, R) placeholder
    under "none"); ``dispatch()`` gives the core's Dispatch (made inside the call, where the intake views exist), or
    None to have the core build and check it."""
    x, w13, w2, gates, b13, b2 = _detach(x, w13, w2, gates, b13, b2)
    R = w13.shape[2 if weight_layout == "in_out" else 1]
    with _core_call(x.device) as stream:
        y, saved = blazecore.moe_forward(x, w13, w2, gates, expert_ids, activation=activation, checkpoint=checkpoint,
                                         b13=b13, b2=b2, dispatch=dispatch(), stream=stream, chunks=chunks,
                                         weight_layout=weight_layout)
        ab = _to_torch(saved.ab) if saved.ab is not None else x.new_empty((0, R))
        return _to_torch(y), ab, saved.dispatch


@_moe_forward_op.register_fake
def _(x, w13, w2, gates, expert_ids, expert_offsets, slot_token, slot_k, pair_slot, b13, b2, activation,
      checkpoint, chunks=1, retain_saved=False, weight_layout="out_in"):
    L, K = expert_ids.shape
    R = w13.shape[2 if weight_layout == "in_out" else 1]
    rows = L * K if checkpoint == "ab" else 0
    return torch.empty_like(x), x.new_empty((rows, R))


@_op("moe_backward", mutates_args=("ab",))
def _moe_backward_op(dy: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, gates: torch.Tensor,
                     expert_ids: torch.Tensor, expert_offsets: torch.Tensor, slot_token: torch.Tensor,
                     slot_k: torch.Tensor, pair_slot: torch.Tensor, ab: torch.Tensor, b13: torch.Tensor | None,
                     b2: torch.Tensor | None, activation: str, checkpoint: str, chunks: int = 1,
                     weight_layout: str = "out_in"
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dy, x, w13, w2, gates, ab, b13, b2 = _detach(dy, x, w13, w2, gates, ab, b13, b2)
    L, K = expert_ids.shape
    R = w13.shape[2 if weight_layout == "in_out" else 1]
    if checkpoint == "ab" and (tuple(ab.shape) != (L * K, R) or ab.dtype != x.dtype):
        raise ValueError(f"ab: expected the forward's saved pre-activations, ({L * K}, {R}) "
                         f"{x.dtype}; got {tuple(ab.shape)} {ab.dtype}")
    with _core_call(x.device) as stream:
        a = _array.asarray
        saved = blazecore.MoESaved(
            a(x, "x"), a(w13, "w13"), a(w2, "w2"), a(gates, "gates"), a(expert_ids, "expert_ids"),
            _core_dispatch(expert_offsets, slot_token, slot_k, pair_slot, L, K), activation, checkpoint,
            None if b13 is None else a(b13, "b13"), None if b2 is None else a(b2, "b2"),
            a(ab, "ab") if checkpoint == "ab" else None, chunks=chunks, weight_layout=weight_layout)
        # dz is written over ab (declared mutated): the backward's peak holds no second (L*K, R) buffer
        g = blazecore.moe_backward(dy, saved, stream=stream, retain=False)
    grads = [_to_torch(t) for t in (g.dx, g.dw13, g.dw2, g.dgates)]
    g = {"db13": g.db13, "db2": g.db2}
    for key, b in (("db13", b13), ("db2", b2)):
        # custom ops return no None: an absent bias gets an empty gradient that autograd drops
        grads.append(x.new_empty((0,)) if b is None else _to_torch(g[key]))
    return tuple(grads)


@_moe_backward_op.register_fake
def _(dy, x, w13, w2, gates, expert_ids, expert_offsets, slot_token, slot_k, pair_slot, ab, b13, b2, activation,
      checkpoint, chunks=1, weight_layout="out_in"):
    db13 = torch.empty_like(b13) if b13 is not None else x.new_empty((0,))
    db2 = torch.empty_like(b2) if b2 is not None else x.new_empty((0,))
    return (torch.empty_like(x), torch.empty_like(w13), torch.empty_like(w2), torch.empty_like(gates), db13, db2)


def _moe_setup(ctx, inputs, output):
    (x, w13, w2, gates, ids, offsets, slot_token, slot_k, pair_slot, b13, b2, activation, checkpoint, chunks,
     retain_saved, weight_layout) = inputs
    _, ab = output
    ctx.mark_non_differentiable(ab)
    # no zero-filled (L*K, R) gradient for ab at the backward's peak (autograd materialises one by default)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, w13, w2, gates, ids, offsets, slot_token, slot_k, pair_slot, ab, b13, b2)
    ctx.activation, ctx.checkpoint, ctx.chunks, ctx.retain_saved = activation, checkpoint, chunks, retain_saved
    ctx.weight_layout = weight_layout


_SECOND_BACKWARD_HINT = (
    "blazecore: the expert FFN's backward writes the activation gradient over the saved pre-activations, so it "
    "runs once per forward. To backward through the same graph again (retain_graph=True), pass "
    "retain_saved=True to blazecore_torch.moe_ffn / MoELayer (one extra (L*K, R) buffer during the backward).")


def _moe_backward(ctx, dy, dab):
    try:
        x, w13, w2, gates, ids, offsets, slot_token, slot_k, pair_slot, ab, b13, b2 = ctx.saved_tensors
    except RuntimeError as exc:  # PyTorch's in-place-modified error, with the option that avoids it
        if "modified by an inplace operation" in str(exc):
            raise RuntimeError(f"{exc}\n{_SECOND_BACKWARD_HINT}") from exc
        raise
    if dy is None:
        dy = torch.zeros_like(x)
    if (ctx.retain_saved and ab.numel()) or type(ab) is not torch.Tensor:
        # the backward overwrites its ab argument: keep the saved one for another backward when asked, and while
        # a compiler traces (FakeTensor / FunctionalTensor): AOTAutograd's partitioner cannot take a backward
        # that mutates a saved forward output, so a compiled graph keeps dz beside ab
        ab = ab.clone()
    elif not ab.numel():
        ab = ab.new_empty(ab.shape)  # "none": nothing is overwritten; keep the saved placeholder's version as it is
    dx, dw13, dw2, dgates, db13, db2 = _run(
        "moe_backward",
        dy.contiguous(), x, w13, w2, gates, ids, offsets, slot_token, slot_k, pair_slot, ab, b13, b2,
        ctx.activation, ctx.checkpoint, ctx.chunks, ctx.weight_layout)
    return (dx, dw13, dw2, dgates, None, None, None, None, None, db13 if b13 is not None else None,
            db2 if b2 is not None else None, None, None, None, None, None)


_autograd(_moe_forward_op, "moe_forward", _moe_backward, _moe_setup)


# moe_ffn without a dispatch, eager mode on CUDA, one chunk: the core builds and validates the dispatch inside the
# forward's own call (no operator of its own: torch.compile and export trace build_dispatch + moe_forward). Its one
# device read (the id check) then comes after the inputs' intake and right before the forward's launches, as in
# blazecore.moe_forward, instead of between two ops whose host work would leave the GPU idle after it.
def _moe_forward_with_dispatch(x, w13, w2, gates, expert_ids, b13, b2, activation, checkpoint, retain_saved,
                               weight_layout):
    y, ab, d = _core_forward(x, w13, w2, gates, expert_ids, b13, b2, activation, checkpoint, weight_layout,
                             lambda: None)
    return y, ab, *(_to_torch(getattr(d, f)) for f in ("expert_offsets", "slot_token", "slot_k", "pair_slot"))


def _with_dispatch_setup(ctx, inputs, output):
    x, w13, w2, gates, ids, b13, b2, activation, checkpoint, retain_saved, weight_layout = inputs
    _moe_setup(ctx, (x, w13, w2, gates, ids, *output[2:], b13, b2, activation, checkpoint, 1, retain_saved,
                     weight_layout), output[:2])
    ctx.mark_non_differentiable(*output[1:])  # ab and the dispatch (one call: it replaces the set _moe_setup gave)


def _with_dispatch_backward(ctx, dy, dab, *_):
    g = _moe_backward(ctx, dy, dab)
    return (*g[:4], None, g[9], g[10], None, None, None, None)


_IMPLS["moe_forward_with_dispatch"] = _moe_forward_with_dispatch
_AUTOGRAD["moe_forward_with_dispatch"] = (_with_dispatch_setup, _with_dispatch_backward)


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


class TorchDispatch(NamedTuple):
    """:class:`blazecore.Dispatch` as int32 tensors: expert_offsets (E+1,), slot_token (L*K,), slot_k (L*K,),
    pair_slot (L, K). Built by :func:`build_dispatch`; pass it to :func:`moe_ffn` to reuse it."""

    expert_offsets: torch.Tensor
    slot_token: torch.Tensor
    slot_k: torch.Tensor
    pair_slot: torch.Tensor

    def counts(self) -> torch.Tensor:
        """Pairs per expert, (E,) int32."""
        return self.expert_offsets[1:] - self.expert_offsets[:-1]


def route_topk(logits: torch.Tensor, top_k: int, *, score: str = "softmax", renormalize: bool = True,
               expert_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing (``blazecore.route_topk``); differentiable w.r.t. the logits.

    Args:
        logits: (L, E) float32 / float16 / bfloat16 (float64 on the CPU).
        top_k: K in [1, E].
        score: "softmax" or "sigmoid".
        renormalize: divide the selected scores by their sum.
        expert_bias: optional (E,) selection-only bias (aux-loss-free balancing); cast to float32
            (float64 for float64 logits). Gets no gradient.

    Returns:
        (gates (L, K) float32 (float64 for float64 logits), expert_ids (L, K) int32).
    """
    _check_same_device({"logits": logits, "expert_bias": expert_bias})
    if expert_bias is not None:
        expert_bias = expert_bias.detach().to(torch.float64 if _is_f64(logits) else torch.float32).contiguous()
    return _run("route_topk", logits.contiguous(), int(top_k), score, bool(renormalize), expert_bias)


def build_dispatch(expert_ids: torch.Tensor, num_experts: int, *, validate: bool = True) -> TorchDispatch:
    """Dispatch of a routing (``blazecore.build_dispatch``).

    Args:
        expert_ids: (L, K) int32 or int64, K distinct values in [0, num_experts) per row.
        num_experts: E.
        validate: check the id values (on CUDA a device-to-host read that synchronises the stream; pass
            False for ids from :func:`route_topk`, or under CUDA-graph capture). The CPU always checks.
    """
    return TorchDispatch(*_run("build_dispatch", expert_ids.contiguous(), int(num_experts),
                                                             bool(validate)))


def moe_ffn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, gates: torch.Tensor, expert_ids: torch.Tensor,
            *, activation: str = "swiglu", checkpoint: str = "ab", b13: torch.Tensor | None = None,
            b2: torch.Tensor | None = None, dispatch: TorchDispatch | None = None, chunks: int = 1,
            retain_saved: bool = False, weight_layout: str = "out_in") -> torch.Tensor:
    """The expert FFNs and gate-weighted combine (``blazecore.moe_forward`` / ``moe_backward``).

    Args:
        x: (L, d) float32 / float16 / bfloat16 (float64 on the CPU).
        w13: (E, 2h, d) for gated activations ([gate rows; up rows]), (E, h, d) otherwise; x's dtype.
            (E, d, 2h or h) with ``weight_layout="in_out"``; interleaved gate/up rows with an activation named
            "<gated>_interleaved".
        w2: (E, d, h), x's dtype; (E, h, d) with ``weight_layout="in_out"``.
        gates: (L, K) float32 (float64 with float64 x).
        expert_ids: (L, K) int32 / int64, distinct per row, in [0, E).
        activation: one of ``blazecore.ACTIVATIONS``.
        checkpoint: "ab" (keep the (L*K, R) pre-activations for the backward) or "none" (recompute).
        b13, b2: optional (E, R) and (E, d) biases, x's dtype.
        dispatch: a :class:`TorchDispatch` of ``expert_ids``; built here when None, validating the ids (on
            CUDA a device-to-host read that synchronises the stream). To skip it (ids from :func:`route_topk`,
            CUDA-graph capture), pass ``build_dispatch(expert_ids, E, validate=False)``.
        chunks: run the tokens in this many chunks (``blazecore.moe_forward``): transients scale with
            L / chunks, results are bit-identical to one chunk.
        retain_saved: keep the saved pre-activations ("ab") intact through the backward, so a second backward
            through the same graph (``retain_graph=True``) works; off by default, when the backward writes the
            activation gradient over them (no (L*K, R) buffer beside them) and a second backward raises
            PyTorch's error for a saved tensor modified in place.
        weight_layout: "out_in" (default, nn.Linear's (out, in) per expert) or "in_out" (the transposes, as
            gpt-oss and Llama 4 store them): read as stored, their gradients in the same layout.

    Returns:
        y (L, d) in x's dtype, differentiable w.r.t. x, w13, w2, gates, b13, b2.
    """
    dev = _check_same_device({"x": x, "w13": w13, "w2": w2, "gates": gates, "expert_ids": expert_ids, "b13": b13,
                              "b2": b2})
    c = lambda t: None if t is None else t.contiguous()  # noqa: E731
    if dispatch is None and int(chunks) == 1 and dev.type == "cuda":
        args = (c(x), c(w13), c(w2), c(gates), c(expert_ids), c(b13), c(b2), activation, checkpoint,
                bool(retain_saved), weight_layout)
        if _eager(args):  # the dispatch built (and checked) inside the forward's call
            if torch.is_grad_enabled():
                return _EagerOp.apply("moe_forward_with_dispatch", *args)[0]
            return _moe_forward_with_dispatch(*args)[0]
    if dispatch is None:
        dispatch = build_dispatch(expert_ids, w13.shape[0])
    y, _ = _run("moe_forward", c(x), c(w13), c(w2), c(gates), c(expert_ids), *dispatch, c(b13), c(b2),
                                           activation, checkpoint, int(chunks), bool(retain_saved), weight_layout)
    return y


def load_balancing_loss(logits: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """Switch load-balancing loss E * sum_e f_e P_e, a 0-d float32 (float64) tensor, differentiable w.r.t. logits."""
    _check_same_device({"logits": logits, "expert_ids": expert_ids})
    return _run("load_balancing_loss", logits.contiguous(), expert_ids.contiguous())


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss mean_t logsumexp(logits_t)^2, a 0-d float32 (float64) tensor, differentiable."""
    return _run("router_z_loss", logits.contiguous())
