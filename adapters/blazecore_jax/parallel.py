"""Expert parallelism in JAX: the MoE layer over ``jax.shard_map`` with the experts split on a mesh axis.

``ep_moe_layer(params, x, mesh=..., axis="ep", top_k=...)`` runs :func:`blazecore_jax.moe_layer`'s math with
the tokens sharded over every axis of the mesh and the experts over ``axis`` (device j of the axis holds
experts [j * E_local, (j + 1) * E_local), E_local = E / axis size); the router is replicated.
:func:`ep_moe_local` is the per-device body, for models that already run inside their own ``shard_map``.

Per device, with L local tokens:

    1. route (``route_topk``), dispatch (``build_dispatch``: slots ordered by expert, hence by destination).
    2. the (E,) pair counts go through one ``all_to_all`` (each device learns what its experts receive).
    3. the send buffer x[slot_token] (L*K, d) is gathered straight from x, the gates alongside.
    4. rows and gates are exchanged: ``all_to_all`` of a buffer padded to L*K rows per destination
       (``exchange="padded"``), or with ``exchange="ragged"`` ``ragged_all_to_all`` (GPUs only: XLA:CPU has no
       ragged-all-to-all), which moves only the rows sent but made the step 11-14x slower on 2 H200s with
       JAX 0.11 (docs/expert_parallel.md, "JAX on 2 H200s").
    5. the local experts run ``moe_ffn`` on the received rows as tokens with K = 1 and their own gate; the
       rows of the buffer that hold nothing have the id -1 (a dropped pair), so no expert computes them.
    6. results go back the same way; y[t] = sum_k back[pair_slot[t, k]].

Shapes are static under ``jit``, so a device's receive buffer holds the worst case (every device sends it
all its L*K pairs): ep * L * K rows. The unused rows are dropped pairs (id -1): the dispatch lists them
after the experts' rows, the expert GEMMs never reach them and they add exactly 0 to y and to every
gradient, so the local experts cost the rows actually received, not the buffer's ep * L * K. No host
synchronisation: the counts stay on the device. Gradients come from JAX's transposes of the
collectives and gathers and from the ops' own VJPs; everything works under ``jit`` and ``grad``.

``exchange="gather"`` (the default) replaces steps 2-6: every device all-gathers the tokens, gates and ids of the
axis (ep * L rows), runs its local experts on them with the other devices' pairs dropped (id -1; a row keeps
min(K, E_local) columns, its local pairs first), and the (ep, L, d) partial sums go back by one ``all_to_all``;
y[t] adds its ep partial sums in float32 in device order. Its buffers hold ep * L rows, K times fewer than
"padded"'s ep * L * K, and on 4 H100s its step took 0.39-0.62 of "padded"'s (docs/expert_parallel.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from blazecore.layer import check_weight_layout

from . import ops
from .layer import _BIASES, expert_biases

__all__ = ["EXCHANGES", "ep_moe_layer", "ep_moe_local", "ep_param_specs"]

EXCHANGES = ("padded", "ragged", "gather")

_PARAMS = ("router", "gate_up_proj", "down_proj")


def _shard_map():
    if hasattr(jax, "shard_map"):
        return jax.shard_map
    from jax.experimental.shard_map import shard_map

    return shard_map


def _default_exchange() -> str:
    """"gather" on every backend: it moves K times fewer rows than "padded" with static shapes (on 4 H100s, JAX
    0.11, olmoe and qwen3 at 8k and 32k tokens a GPU, its step took 0.39-0.62 of "padded"'s); XLA:CPU has no
    ragged-all-to-all, and on GPUs XLA's moved the same rows about 80 times slower per byte than ``all_to_all``
    (NVIDIA H200, JAX 0.11)."""
    return "gather"


def _exclusive_cumsum(a):
    return jnp.cumsum(a) - a


def ep_moe_local(params: dict, x, *, axis: str, num_experts: int, top_k: int, activation: str = "swiglu",
                 checkpoint: str = "ab", score: str = "softmax", renormalize: bool = True, expert_bias=None,
                 exchange: str | None = None, chunks: int = 1, weight_layout: str = "out_in"):
    """The per-device body of :func:`ep_moe_layer`, to call inside a ``shard_map`` over ``axis``.

    Args:
        params: this device's {"router": (E, d), "gate_up_proj": (E_local, R, d), "down_proj": (E_local, d, h)}
            (in ``weight_layout``) and optionally the expert biases "gate_up_proj_bias" (E_local, R) and
            "down_proj_bias" (E_local, d).
        x: (L, d) this device's tokens (float32, float16 or bfloat16, the parameters' dtype).
        axis: the mesh axis name of the experts; num_experts: E (= E_local * axis size).
        expert_bias: optional (E,) selection-only bias (aux-loss-free balancing), the same on every device.
        exchange: "padded" (``all_to_all`` of L*K rows per destination), "ragged" (``ragged_all_to_all``, GPUs
            only: the rows sent and no padding, but much slower with today's XLA), "gather" (every device's
            tokens all-gathered, the local experts' partial sums sent back: ep * L rows each way) or None for the
            default ("gather").

    Returns:
        (y (L, d), aux) with aux {"load_balancing_loss", "z_loss" (of this device's tokens), "router_logits"
        (L, E), "tokens_per_expert" (E,) int32 of this device's tokens}.
    """
    exchange = exchange or _default_exchange()
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {', '.join(map(repr, EXCHANGES))}, got {exchange!r}")
    router, w13, w2 = (params[k] for k in _PARAMS)
    ep = jax.lax.axis_size(axis)
    E, El, K = int(num_experts), int(w13.shape[0]), int(top_k)
    if El * ep != E:
        raise ValueError(f"gate_up_proj holds {El} experts per device; with {ep} devices on axis {axis!r} that is "
                         f"{El * ep}, not num_experts = {E}")
    L, d = (int(s) for s in x.shape)
    n = L * K  # pairs sent; also the per-source capacity of the receive buffer
    cap = ep * n
    logits = x @ router.T
    gates, ids = ops.route_topk(logits, K, score=score, renormalize=renormalize, expert_bias=expert_bias)
    disp = ops.build_dispatch(ids, E, validate=False)
    counts = disp.counts()  # (E,) pairs per global expert, slot order
    aux = {
        "load_balancing_loss": ops.load_balancing_loss(logits, ids),
        "z_loss": ops.router_z_loss(logits),
        "router_logits": logits,
        "tokens_per_expert": counts,
    }
    b13, b2 = expert_biases(params)

    def local_experts(rows, row_gates, row_ids):
        """This device's experts on ``rows`` with local ids (-1: a pair that is not here), summed a row."""
        return ops.moe_ffn(rows, w13, w2, row_gates, row_ids, activation=activation, checkpoint=checkpoint,
                           dispatch=ops.build_dispatch(row_ids, El, validate=False), chunks=chunks, b13=b13, b2=b2,
                           weight_layout=weight_layout)

    if exchange == "gather":
        return _exchange_gather(x, gates, ids, local_experts, axis=axis, ep=ep, El=El), aux
    slot_token, slot_k, pair_slot = disp.slot_token, disp.slot_k, disp.pair_slot
    # count exchange: recv_counts[s, j] = pairs device s sends to local expert j
    recv_counts = jax.lax.all_to_all(counts.reshape(ep, El), axis, 0, 0, tiled=True)
    send_sizes = counts.reshape(ep, El).sum(1)
    recv_sizes = recv_counts.sum(1)
    # the send buffer, gathered from x in slot order; gates alongside
    send = jnp.take(x, slot_token, axis=0)
    send_gates = jnp.take(gates.reshape(-1), slot_token * K + slot_k, axis=0)
    send_start = _exclusive_cumsum(send_sizes)
    if exchange == "ragged":
        recv_start = _exclusive_cumsum(recv_sizes)
        # ragged_all_to_all's output_offsets are where the sent slices land on their receivers: going there, a
        # destination's recv_start[me]; coming back, a source's send_start[me]
        there_off = jax.lax.all_to_all(recv_start, axis, 0, 0, tiled=True)
        back_off = jax.lax.all_to_all(send_start, axis, 0, 0, tiled=True)

        def there(a, rows):
            return jax.lax.ragged_all_to_all(a, jnp.zeros((rows,) + a.shape[1:], a.dtype), send_start, send_sizes,
                                             there_off, recv_sizes, axis_name=axis)

        def back(a, rows):
            return jax.lax.ragged_all_to_all(a, jnp.zeros((rows,) + a.shape[1:], a.dtype), recv_start, recv_sizes,
                                             back_off, send_sizes, axis_name=axis)

        recv, recv_gates = there(send, cap), there(send_gates, cap)
        # received rows: sources in order, each source's rows by local expert; the rest is unused
        row = jnp.arange(cap)
        ends = jnp.cumsum(recv_counts.reshape(-1))
        seg = jnp.searchsorted(ends, row, side="right")
        valid = row < ends[-1]
        local_id = jnp.where(valid, seg % El, -1)
    else:
        # slot s goes to destination dst(s), row s - send_start[dst] of that destination's block of n rows
        slot = jnp.arange(n)
        dst = jnp.searchsorted(jnp.cumsum(send_sizes), slot, side="right")
        pos = dst * n + slot - send_start[jnp.minimum(dst, ep - 1)]

        def pad(a):
            return jnp.zeros((cap,) + a.shape[1:], a.dtype).at[pos].set(a, unique_indices=True)

        def swap(a):
            return jax.lax.all_to_all(a.reshape((ep, n) + a.shape[1:]), axis, 0, 0, tiled=True).reshape(a.shape)

        recv, recv_gates = swap(pad(send)), swap(pad(send_gates))
        # block s holds source s's rows by local expert in its first recv_sizes[s] rows
        row = jnp.arange(cap)
        src, off = row // max(n, 1), row % max(n, 1)
        ends = jnp.cumsum(recv_counts, axis=1)  # (ep, El)
        local_id = jax.vmap(lambda e, o: jnp.searchsorted(e, o, side="right"))(ends[src], off)
        valid = off < ends[src, -1]
        local_id = jnp.where(valid, local_id, -1)
    recv_gates = recv_gates.reshape(cap, 1)
    # the rows past what was received are dropped pairs (id -1): no expert computes them, their outputs are 0 and
    # none of them is sent back
    recv_ids = jax.lax.stop_gradient(local_id.astype(jnp.int32).reshape(cap, 1))
    out = local_experts(recv, recv_gates, recv_ids)
    if exchange == "ragged":
        back_rows = back(out, n)
    else:
        back_rows = jnp.take(swap(out), pos, axis=0)
    # the K rows of a token summed in float32 and rounded once, as the single-device combine does
    y = jnp.take(back_rows, pair_slot, axis=0).astype(jnp.float32).sum(axis=1).astype(x.dtype)
    return y, aux


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_rows(x, axis: str):
    """Every device's rows (ep * L, d), in device order: ``all_gather``. The backward sums each row's ep gradients
    in float32 in device order and rounds once (an ``all_to_all`` and a local sum), where the transpose JAX would
    take (a reduce-scatter) adds them in x's dtype."""
    return jax.lax.all_gather(x, axis, tiled=True)


def _gather_rows_fwd(x, axis):
    return _gather_rows(x, axis), None


def _gather_rows_bwd(axis, _, ct):
    ep = jax.lax.axis_size(axis)
    parts = jax.lax.all_to_all(ct.reshape((ep, -1) + ct.shape[1:]), axis, 0, 0, tiled=True)
    return (parts.astype(jnp.float32).sum(axis=0).astype(ct.dtype),)


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def _exchange_gather(x, gates, ids, local_experts, *, axis: str, ep: int, El: int):
    """``exchange="gather"``: every device runs its local experts on every device's tokens. x, the gates and the ids
    are all-gathered over ``axis`` (ep * L rows); a token's pairs whose experts live elsewhere get the id -1
    (dropped: no GPU kernel computes them), its local ones come first in each row, J = min(K, E_local) columns
    kept; ``local_experts`` sums each row's local experts; the (ep, L, d) results go back by ``all_to_all`` and
    each token's ep partial sums are added in float32 in device order and rounded once. Static shapes of ep * L
    rows, K times fewer than the pairs' buffers of "padded"."""
    K = int(ids.shape[1])
    J = min(K, El)
    me = jax.lax.axis_index(axis)
    rows = _gather_rows(x, axis)
    all_ids = jax.lax.all_gather(ids, axis, tiled=True)
    all_gates = jax.lax.all_gather(gates, axis, tiled=True)
    local = all_ids - me * El
    here = (local >= 0) & (local < El)
    order = jnp.argsort(jnp.where(here, 0, 1), axis=1, stable=True)[:, :J]  # the local pairs first, in k order
    local_ids = jnp.where(jnp.take_along_axis(here, order, axis=1), jnp.take_along_axis(local, order, axis=1), -1)
    local_ids = jax.lax.stop_gradient(local_ids.astype(jnp.int32))
    local_gates = jnp.take_along_axis(all_gates, order, axis=1)
    out = local_experts(rows, local_gates, local_ids)
    back = jax.lax.all_to_all(out.reshape((ep, -1) + out.shape[1:]), axis, 0, 0, tiled=True)
    return back.astype(jnp.float32).sum(axis=0).astype(x.dtype)


def ep_param_specs(axis: str = "ep", *, bias: bool = False) -> dict:
    """PartitionSpecs of :func:`ep_moe_layer`'s parameters: the router replicated, the experts (and with ``bias``
    their biases) split on ``axis``."""
    specs = {"router": P(), "gate_up_proj": P(axis), "down_proj": P(axis)}
    if bias:
        specs.update({k: P(axis) for k in _BIASES})
    return specs


def ep_moe_layer(params: dict, x, *, mesh: Mesh, top_k: int, axis: str = "ep", activation: str = "swiglu",
                 checkpoint: str = "ab", score: str = "softmax", renormalize: bool = True, expert_bias=None,
                 exchange: str | None = None, chunks: int = 1, weight_layout: str = "out_in"):
    """Mixture-of-Experts layer with the experts split over the mesh axis ``axis`` (``jax.shard_map``).

    Args:
        params: {"router": (E, d), "gate_up_proj": (E, R, d), "down_proj": (E, d, h)} and optionally the expert
            biases, as for :func:`blazecore_jax.moe_layer` (global arrays; shard them with :func:`ep_param_specs`
            to keep each device's experts on it).
        x: (..., d) tokens; the flattened token count must divide by the mesh's device count. The tokens are
            split over every mesh axis (data-parallel axes and ``axis``), the experts over ``axis`` only.
        mesh: a ``jax.sharding.Mesh`` with an axis named ``axis``.
        top_k, activation, checkpoint, score, renormalize, expert_bias, chunks, weight_layout: as for
            ``moe_layer``.
        exchange: "padded", "ragged", "gather" or None (see :func:`ep_moe_local`).

    Returns:
        (y, aux): y with x's shape and dtype; aux {"load_balancing_loss", "z_loss"} averaged over the devices,
        "tokens_per_expert" (E,) summed over them.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"the mesh has axes {tuple(mesh.axis_names)} and no axis named {axis!r} for the experts")
    missing = [k for k in _PARAMS if k not in params]
    if missing:
        raise KeyError(f"params lacks {', '.join(missing)} (expected keys {', '.join(_PARAMS)})")
    check_weight_layout(weight_layout)
    given = [k for k, b in zip(_BIASES, expert_biases(params), strict=True) if b is not None]
    router, w13, w2 = (params[k] for k in _PARAMS)
    E, d = (int(s) for s in router.shape)
    ep = int(mesh.shape[axis])
    if E % ep:
        raise ValueError(f"num_experts = {E} is not divisible by the size {ep} of mesh axis {axis!r}: every device "
                         "must hold the same number of experts")
    if int(w13.shape[0]) != E or int(w2.shape[0]) != E or any(int(params[k].shape[0]) != E for k in given):
        raise ValueError(f"router has {E} experts, gate_up_proj {int(w13.shape[0])}, down_proj {int(w2.shape[0])}"
                         + "".join(f", {k} {int(params[k].shape[0])}" for k in given))
    if not x.shape or int(x.shape[-1]) != d:
        raise ValueError(f"x: last dimension {x.shape[-1] if x.shape else None}, expected hidden size d = {d}")
    if x.dtype != w13.dtype or router.dtype != w13.dtype:
        raise TypeError(f"x ({x.dtype}), router ({router.dtype}) and gate_up_proj ({w13.dtype}) must share a dtype")
    if not 1 <= int(top_k) <= E:
        raise ValueError(f"top_k = {top_k} must be in [1, E = {E}]")
    mesh_devices = set(mesh.devices.flat)
    for name, a in (("x", x), ("router", router), ("gate_up_proj", w13), ("down_proj", w2),
                    *((k, params[k]) for k in given)):
        devs = _committed_devices(a)
        if devs is not None and not devs <= mesh_devices:
            raise ValueError(f"{name} lives on {sorted(str(v) for v in devs)}, outside the mesh's devices "
                             f"{sorted(str(v) for v in mesh_devices)}")
    shape = x.shape
    tokens = x.reshape(-1, d)
    n_dev = int(np.prod(list(mesh.shape.values())))
    if int(tokens.shape[0]) % n_dev:
        raise ValueError(f"{int(tokens.shape[0])} tokens do not split evenly over the mesh's {n_dev} devices")
    all_axes = tuple(mesh.axis_names)
    specs = ep_param_specs(axis, bias=bool(given))

    if expert_bias is not None and tuple(expert_bias.shape) != (E,):
        raise ValueError(f"expert_bias: expected shape {(E,)}, got {tuple(expert_bias.shape)}")
    bias = None if expert_bias is None else jax.lax.stop_gradient(jnp.asarray(expert_bias, jnp.float32))

    def body(p, t, b):
        y, aux = ep_moe_local(p, t, axis=axis, num_experts=E, top_k=int(top_k), activation=activation,
                              checkpoint=checkpoint, score=score, renormalize=renormalize, expert_bias=b,
                              exchange=exchange, chunks=chunks, weight_layout=weight_layout)
        mean = {k: jax.lax.pmean(aux[k], all_axes) for k in ("load_balancing_loss", "z_loss")}
        return y, mean, jax.lax.psum(aux["tokens_per_expert"], all_axes)

    # check_vma=False: the ops' buffer callbacks return arrays without varying-axis types (nothing to check them
    # against); the replicated outputs are made so by pmean / psum above
    fn = _shard_map()(body, mesh=mesh, in_specs=(specs, P(all_axes), P()), out_specs=(P(all_axes), P(), P()),
                      check_vma=False)
    y, aux, counts = fn({k: params[k] for k in specs}, tokens, bias)
    aux = dict(aux, tokens_per_expert=counts)
    return y.reshape(shape), aux


def _committed_devices(a):
    """The devices of a concrete array committed to them (None for tracers, NumPy and uncommitted arrays)."""
    if isinstance(a, jax.core.Tracer) or not isinstance(a, jax.Array) or not getattr(a, "committed", False):
        return None
    return set(a.sharding.device_set)
