"""Expert parallelism over ``torch.distributed``: ``ExpertParallelMoELayer`` and FSDP2 composition.

The E experts are split over the ranks of an expert-parallel (EP) process group: rank r holds experts
[r * E_local, (r + 1) * E_local), E_local = E / ep_size. Every rank routes its own tokens and the routed
rows travel to the ranks that hold their experts and back. ``exchange="tokens"`` (the default) sends each
token once to every rank that holds one of its experts:

    1. route locally: gates, ids (L, K) = route_topk(x @ router^T); dispatch = build_dispatch(ids, E), the
       sort-free build, whose slots are ordered by expert, hence by destination rank.
    2. counts: per destination rank, the pair counts of its E_local experts and the number of rows (tokens
       with at least one expert there), all-gathered, so that every rank places its rows and pairs in every
       destination's receive buffers itself.
    3. indices, on the device, by scatters to distinct targets (no sort, no atomics): the rows in send order
       (rank-major, tokens ascending), each pair's row at its destination (in slot order, i.e. expert order),
       each row's pairs (-1 padded to min(K, E_local)) and each token's rows (-1 padded to min(K, ep_size)),
       into buffers of ep_size * L rows, queued before the host read that follows. The four split lists (rows
       and pairs, sent and received) are read to the host in ONE transfer: the layer's only host
       synchronisation (``all_to_all_single`` takes its splits as Python lists; a buffer's size is a shape).
    4. pack and exchange: ``x.index_select`` writes the send buffer straight from x, one row per (token,
       destination); ``all_to_all_single`` of the rows, the pairs' gates and rows, and the rows' pairs.
    5. local experts: the received rows are gathered once per pair (a local copy in expert order), run by
       ``moe_ffn`` as tokens with K = 1 and their own gate (ids built on the device from the received
       counts), and each row's pairs summed.
    6. return exchange: the per-row sums go back with the splits swapped.
    7. combine: y[t] = the sum of t's returned rows in rank order.

Every row sum is ``ops.sum_rows`` (``blazecore.sum_rows``): one pass over a -1 padded index on the layer's
deterministic combine kernel, float32 sums in index order rounded once, no atomics.

With uniform routing a token has ep * (1 - C(E - E_local, K) / C(E, K)) distinct destination ranks on average,
e.g. 2.0 for olmoe (E = 64, K = 8) over 2 ranks and 3.66 over 4, against K rows a token with
``exchange="pairs"``, which sends one row per (token, expert) pair: the (L*K, d) send buffer x[slot_token],
the (N, d) results back in slot order, combined by y[t] = sum_k back[pair_slot[t, k]].

The backward is the mirror image, through autograd: the all-to-alls are autograd Functions whose backward
is the all-to-all with swapped splits; every gather's backward is the matching row sum (by the -1 padded
inverse index the forward built) and every row sum's backward is a gather; ``moe_ffn``'s own backward
gives the local experts' dw13, dw2, the rows' dx and their dgates.

With ep_size 1 no exchange is needed and the layer runs the plain layer's ops on x directly (the same
bits as ``MoELayer``), unless ``always_exchange`` is set (the full path against a group of one, e.g. to
measure its cost).

FSDP2 (:func:`fully_shard_expert_parallel`): on a 2-D DeviceMesh (dp, ep) the expert weights are sharded
over dp (every dp row holds all E experts, split over its ep ranks) and everything else over the whole
mesh, as torchtitan does; the experts' gradient is divided by the whole mesh's size like the others, since
each expert's gradient already sums the tokens of its whole ep row.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from blazecore.layer import resolve_plan

from . import ops
from .layer import MoELayer, add_expert_parameters, check_layer_options, reset_expert_biases, reset_expert_weights

EXCHANGES = ("tokens", "pairs")

__all__ = [
    "EXCHANGES",
    "ExpertParallelMoELayer",
    "LocalExperts",
    "all_reduce_gradients",
    "clip_grad_norm_",
    "expert_parallel_mesh",
    "expert_parameters",
    "fully_shard_expert_parallel",
    "resolve_ep_group",
    "to_expert_parallel",
]


# ---------------------------------------------------------------------------------------------
# Groups and meshes
# ---------------------------------------------------------------------------------------------


def resolve_ep_group(group=None, *, ep_dim: str = "ep"):
    """The expert-parallel process group from ``group``: None (the default, WORLD) group, a ProcessGroup, or a
    DeviceMesh (1-D, or with a dimension named ``ep_dim``). Raises before any communication."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("expert parallelism needs torch.distributed initialised (dist.init_process_group, "
                           "or torchrun and init_device_mesh)")
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        names = group.mesh_dim_names
        if names is not None and ep_dim in names:
            return group.get_group(ep_dim)
        if group.ndim == 1 and names is None:
            return group.get_group()
        raise ValueError(f"the DeviceMesh has dimensions {names} (shape {tuple(group.shape)}) and no dimension "
                         f"named {ep_dim!r} for expert parallelism")
    if group is None:
        return dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be None, a ProcessGroup or a DeviceMesh, got {type(group).__name__}")
    return group


def _check_backend(group, device: torch.device) -> None:
    """Tensors must live where the group's backend communicates (NCCL: CUDA tensors on the current device; gloo: CPU
    tensors; a "cpu:gloo,cuda:nccl" group either)."""
    backend = str(dist.get_backend(group)).lower()
    if device.type == "cpu" and "gloo" not in backend:
        raise ValueError(f"the expert-parallel group's backend is {backend!r}, which does not exchange CPU tensors; "
                         "move the layer to this rank's GPU (or use a gloo group on the CPU)")
    if device.type == "cuda":
        if "nccl" not in backend:
            raise ValueError(f"the expert-parallel group's backend is {backend!r}; CUDA tensors need an NCCL group")
        if device.index is not None and device.index != torch.cuda.current_device():
            raise ValueError(f"the layer's tensors are on {device} but this rank's current CUDA device is "
                             f"cuda:{torch.cuda.current_device()}; call torch.cuda.set_device(local_rank) first")
    elif device.type != "cpu":
        raise ValueError(f"expert parallelism runs on CUDA (NCCL) or CPU (gloo) tensors, not on {device}")


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter as a plain tensor: FSDP2 may hand the unsharded experts over as replicated DTensors (its
    sub-mesh's placement); the routed rows are plain tensors of a data-dependent size that no DTensor placement
    describes, so the local tensor (differentiable) is what the ops take."""
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


# ---------------------------------------------------------------------------------------------
# Autograd pieces: the exchange, the pack and the combine
# ---------------------------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` to the ranks of ``group``: ``in_splits[r]`` rows to rank r, ``out_splits[r]`` from it.
    The backward sends the gradient back the same way with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


def _sum_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """y[i] = sum_j rows[index[i, j]] over the entries >= 0 (index (n, J) int32, -1 padded), in j order, in one
    pass (``ops.sum_rows``: the layer's deterministic combine kernel on CUDA; float32 sums of 16-bit rows, rounded
    once). The indices are built in range by the layer: no validation read."""
    return ops.sum_rows(rows.contiguous(), index, validate=False)


class _Gather(torch.autograd.Function):
    """rows[i] = x[index[i]]. ``inverse`` (x's rows, J) int32 lists, for every row of x, the i that read it (-1
    padded); the backward is dx[t] = sum_j drows[inverse[t, j]]."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, drows):
        (inverse,) = ctx.saved_tensors
        return _sum_rows(drows, inverse), None, None


class _SumRows(torch.autograd.Function):
    """y[t] = sum_j rows[index[t, j]] (index (T, J) int32, -1 padded); ``inverse`` (rows,) names each row's t.
    Backward: the gather drows = dy[inverse]."""

    @staticmethod
    def forward(ctx, rows, index, inverse):
        ctx.save_for_backward(inverse)
        return _sum_rows(rows, index)

    @staticmethod
    def backward(ctx, dy):
        (inverse,) = ctx.saved_tensors
        return dy.contiguous().index_select(0, inverse), None, None


def _check_exchange(exchange) -> None:
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {', '.join(map(repr, EXCHANGES))}, got {exchange!r}")


def _exclusive_cumsum(a: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(a, 0) - a


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


class LocalExperts(nn.Module):
    """This rank's experts: ``gate_up_proj`` (E_local, R, d) and ``down_proj`` (E_local, d, h), blazecore's w13
    and w2 ((E_local, d, R) and (E_local, h, d) with ``weight_layout="in_out"``), and with ``bias`` their biases
    ``gate_up_proj_bias`` (E_local, R) and ``down_proj_bias`` (E_local, d) (a submodule of its own so that FSDP2
    can shard it over another mesh than the rest)."""

    def __init__(self, num_local_experts: int, hidden_size: int, intermediate_size: int, rows: int, *, device=None,
                 dtype=None, weight_layout: str = "out_in", bias: bool = False):
        super().__init__()
        add_expert_parameters(self, num_local_experts, hidden_size, intermediate_size, rows,
                              weight_layout=weight_layout, bias=bias, device=device, dtype=dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default bounds, like MoELayer
        reset_expert_weights(self)
        reset_expert_biases(self)

    def forward(self, x: torch.Tensor, gates: torch.Tensor, expert_ids: torch.Tensor, dispatch: ops.TorchDispatch, *,
                activation: str, checkpoint: str, chunks: int = 1, retain_saved: bool = False) -> torch.Tensor:
        """``ops.moe_ffn`` of x (n, d) with gates (n, K) and local expert ids (n, K) int32 in [0, E_local).

        A module call, not a parameter read, so that FSDP2's hooks gather the sharded weights around it."""
        b13 = None if self.gate_up_proj_bias is None else _local(self.gate_up_proj_bias)
        b2 = None if self.down_proj_bias is None else _local(self.down_proj_bias)
        return ops.moe_ffn(x, _local(self.gate_up_proj), _local(self.down_proj), gates, expert_ids,
                           activation=activation, checkpoint=checkpoint, dispatch=dispatch, chunks=chunks,
                           retain_saved=retain_saved, b13=b13, b2=b2, weight_layout=self.weight_layout)


class ExpertParallelMoELayer(nn.Module):
    """``MoELayer`` with its experts split over an expert-parallel process group.

    Args:
        hidden_size, intermediate_size, num_experts, top_k, activation, score, renormalize, expert_bias,
            checkpoint, chunks, memory_budget, retain_saved, weight_layout, bias: as for
            :class:`blazecore_torch.MoELayer`. With
            ``chunks="auto"`` the local experts' call is planned from the rows this rank actually received
            (known on the host after the count exchange), as tokens with K = 1 over E_local experts.
        group: the expert-parallel group: None (WORLD), a ProcessGroup, or a DeviceMesh (1-D, or one with
            a dimension named ``ep_dim``). torch.distributed must be initialised; the backend must fit the
            device (NCCL: CUDA tensors on the current device, gloo: CPU tensors).
        ep_dim: the mesh dimension of the experts when ``group`` is a multi-dimensional DeviceMesh.
        exchange: ``"tokens"`` (the default): each token travels once to every rank that holds one of its
            experts, and that rank sums the token's local experts before the row comes back (each token sends
            as many rows as it has distinct destination ranks, at most min(K, ep_size)); ``"pairs"``: one row
            per (token, expert) pair each way, K rows a token. Both give the same result up to the summation
            order (with "tokens" a rank's partial sum is rounded once to the compute dtype before it returns).
        device, dtype: of the parameters.

    Parameters: ``router`` (nn.Linear d -> E, no bias; replicated: identical on every rank) and ``experts``
    (:class:`LocalExperts`, this rank's E / ep_size experts). Ranks must start from the same router weights:
    seed every rank alike, or load a full layer with :meth:`load_full_state_dict` / :meth:`from_layer`.

    ``forward(x)`` takes this rank's tokens x (..., d) (any count, 0 included; ranks may differ) and returns
    ``(y, aux)`` like ``MoELayer``: aux's ``load_balancing_loss``, ``z_loss``, ``router_logits`` and
    ``tokens_per_expert`` (E,) are of this rank's tokens. The forward synchronises the host once, for the
    count exchange (see the module's docstring). ``last_rows_sent`` then holds the number of rows of d values
    this rank sent out in that forward (as many come back, and the backward moves the same counts); 0 where no
    exchange ran.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *, group=None,
                 ep_dim: str = "ep", activation: str = "swiglu", score: str = "softmax", renormalize: bool = True,
                 expert_bias: bool = False, checkpoint: str = "ab", chunks=1, memory_budget=None,
                 retain_saved: bool = False, weight_layout: str = "out_in", bias: bool = False,
                 exchange: str = "tokens", device=None, dtype=None):
        super().__init__()
        _check_exchange(exchange)
        gated = check_layer_options(hidden_size, intermediate_size, num_experts, top_k, activation=activation,
                                    score=score, checkpoint=checkpoint, chunks=chunks, weight_layout=weight_layout)
        self.group = resolve_ep_group(group, ep_dim=ep_dim)
        self.ep_size = dist.get_world_size(self.group)
        self.ep_rank = dist.get_rank(self.group)
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts = {num_experts} is not divisible by the expert-parallel size "
                             f"{self.ep_size}: every rank must hold the same number of experts")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.num_local_experts = num_experts // self.ep_size
        self.activation, self.score, self.renormalize, self.checkpoint = activation, score, renormalize, checkpoint
        self.chunks, self.memory_budget, self.retain_saved = chunks, memory_budget, bool(retain_saved)
        self.always_exchange = False
        self.exchange = exchange
        self.last_rows_sent = None
        fk = {"device": device, "dtype": dtype}
        self.router = nn.Linear(hidden_size, num_experts, bias=False, **fk)
        R = 2 * intermediate_size if gated else intermediate_size
        self.experts = LocalExperts(self.num_local_experts, hidden_size, intermediate_size, R, **fk,
                                    weight_layout=weight_layout, bias=bias)
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))
        else:
            self.expert_bias = None

    @property
    def local_expert_range(self) -> range:
        """The global ids of this rank's experts."""
        return range(self.ep_rank * self.num_local_experts, (self.ep_rank + 1) * self.num_local_experts)

    def extra_repr(self) -> str:
        return (f"d={self.hidden_size}, h={self.intermediate_size}, experts={self.num_experts} "
                f"({self.num_local_experts} local of ep_size {self.ep_size}), top_k={self.top_k}, "
                f"activation={self.activation}, score={self.score}, checkpoint={self.checkpoint}, "
                f"weight_layout={self.experts.weight_layout}, bias={self.experts.gate_up_proj_bias is not None}, "
                f"exchange={self.exchange}")

    @torch.no_grad()
    def load_full_state_dict(self, state: dict) -> None:
        """Copy a full layer's weights (``MoELayer``'s names: ``router.weight`` (E, d), ``gate_up_proj`` (E, R, d),
        ``down_proj`` (E, d, h), in this layer's weight layout, and its expert biases if this layer has them) into
        this rank's router and expert slice."""
        rng = self.local_expert_range
        sl = slice(rng.start, rng.stop)
        self.router.weight.copy_(state["router.weight"])
        if self.expert_bias is not None and "expert_bias" in state:
            self.expert_bias.copy_(state["expert_bias"])
        self.experts.gate_up_proj.copy_(state["gate_up_proj"][sl])
        self.experts.down_proj.copy_(state["down_proj"][sl])
        if self.experts.gate_up_proj_bias is not None:
            self.experts.gate_up_proj_bias.copy_(state["gate_up_proj_bias"][sl])
            self.experts.down_proj_bias.copy_(state["down_proj_bias"][sl])

    @classmethod
    def from_layer(cls, layer: nn.Module, *, group=None, ep_dim: str = "ep",
                   exchange: str = "tokens") -> ExpertParallelMoELayer:
        """An EP layer with a full ``MoELayer``'s configuration and weights (this rank's experts sliced out)."""
        w = layer.gate_up_proj
        ep = cls(layer.hidden_size, layer.intermediate_size, layer.num_experts, layer.top_k, group=group,
                 ep_dim=ep_dim, activation=layer.activation, score=layer.score, renormalize=layer.renormalize,
                 expert_bias=layer.expert_bias is not None, checkpoint=layer.checkpoint, chunks=layer.chunks,
                 memory_budget=layer.memory_budget, retain_saved=getattr(layer, "retain_saved", False),
                 weight_layout=getattr(layer, "weight_layout", "out_in"),
                 bias=getattr(layer, "gate_up_proj_bias", None) is not None, exchange=exchange, device=w.device,
                 dtype=w.dtype)
        ep.load_full_state_dict(layer.state_dict())
        return ep

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        # the router's weight has the compute dtype here (FSDP2 may keep the experts sharded in another dtype until
        # their own call); the experts' dtype is checked by moe_ffn
        w13, router = self.experts.gate_up_proj, self.router.weight
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: last dimension {x.shape[-1]}, expected hidden_size = {self.hidden_size}")
        _check_exchange(self.exchange)  # (an attribute: it may have been set after construction)
        if x.dtype != router.dtype:
            raise TypeError(f"x: dtype {x.dtype} differs from the layer's parameters ({router.dtype})")
        if x.device != w13.device or router.device != w13.device:
            raise ValueError(f"x is on {x.device}, the router on {router.device} and the experts on "
                             f"{w13.device}: all must be on one device")
        _check_backend(self.group, x.device)
        shape = x.shape
        tokens = x.reshape(-1, self.hidden_size).contiguous()
        logits = self.router(tokens)
        gates, ids = ops.route_topk(logits, self.top_k, score=self.score, renormalize=self.renormalize,
                                    expert_bias=self.expert_bias)
        # ids from route_topk are in range and distinct: no validation read
        dispatch = ops.build_dispatch(ids, self.num_experts, validate=False)
        if self.ep_size == 1 and not self.always_exchange:
            self.last_rows_sent = 0
            y = self._experts(tokens, gates, ids, dispatch, self.top_k, self.num_experts)
        else:
            y = self._exchange_and_run(tokens, gates, ids, dispatch)
        aux = {
            "load_balancing_loss": ops.load_balancing_loss(logits, ids),
            "z_loss": ops.router_z_loss(logits),
            "router_logits": logits,
            "tokens_per_expert": dispatch.counts(),
        }
        return y.reshape(shape), aux

    def _experts(self, x, gates, ids, dispatch, K: int, E: int) -> torch.Tensor:
        """The local experts on x (n, d) routed K ways over E experts, with the chunks and policy planned for n."""
        chunks, checkpoint = resolve_plan(self.chunks, self.checkpoint, x.shape[0], self.hidden_size,
                                          self.intermediate_size, E, K, dtype=str(x.dtype).removeprefix("torch."),
                                          activation=self.activation, budget=self.memory_budget,
                                          free_bytes=MoELayer._free_bytes(x), retain=self.retain_saved,
                                          bias=(self.experts.gate_up_proj_bias is not None,) * 2,
                                          weight_layout=self.experts.weight_layout)
        return self.experts(x, gates, ids, dispatch, activation=self.activation, checkpoint=checkpoint, chunks=chunks,
                            retain_saved=self.retain_saved)

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing step, as ``MoELayer.update_expert_bias``. Pass the counts summed over the
        ranks (``dist.all_reduce`` of ``aux["tokens_per_expert"]``) so that every rank's bias stays the same."""
        if self.expert_bias is None:
            raise RuntimeError("this ExpertParallelMoELayer was built without expert_bias=True")
        counts = tokens_per_expert.to(self.expert_bias.device, torch.float32)
        self.expert_bias.add_(rate * torch.sign(counts.mean() - counts))

    def _exchange_and_run(self, tokens, gates, ids, dispatch) -> torch.Tensor:
        if self.exchange == "pairs":
            return self._exchange_pairs(tokens, gates, dispatch)
        return self._exchange_tokens(tokens, gates, ids, dispatch)

    def _local_run(self, rows, row_gates, recv_counts, n_recv: int) -> torch.Tensor:
        """The local experts on the received rows (n_recv, d), each one a token with K = 1 and its own gate; the
        rows of every source arrive in expert order, ``recv_counts`` (ep, E_local) of them an expert. The ids are
        built on the device (no host read)."""
        ep, El = self.ep_size, self.num_local_experts
        local = torch.arange(El, device=rows.device, dtype=torch.int32).repeat(ep)
        recv_ids = torch.repeat_interleave(local, recv_counts.reshape(-1).to(torch.int64),
                                           output_size=n_recv).view(n_recv, 1)
        local_dispatch = ops.build_dispatch(recv_ids, El, validate=False)
        return self._experts(rows, row_gates.view(n_recv, 1), recv_ids, local_dispatch, 1, El)

    def _exchange_pairs(self, tokens, gates, dispatch) -> torch.Tensor:
        """One row per (token, expert) pair each way."""
        ep, El, K = self.ep_size, self.num_local_experts, self.top_k
        counts = dispatch.counts()  # (E,) int32, pairs per global expert in slot order
        # 1. count exchange: recv_counts[s, j] = rows rank s sends to local expert j
        recv_counts = counts.new_empty((self.num_experts,))
        dist.all_to_all_single(recv_counts, counts.contiguous(), group=self.group)
        # the one host synchronisation: both split lists in a single device-to-host transfer
        host = torch.cat([counts.view(ep, El).sum(1, dtype=torch.int64),
                          recv_counts.view(ep, El).sum(1, dtype=torch.int64)]).tolist()
        send_splits, recv_splits = host[:ep], host[ep:]
        self.last_rows_sent = sum(send_splits)
        # 2. pack: the send buffer gathered straight from x; gates in slot order alongside
        slot_token, slot_k = dispatch.slot_token, dispatch.slot_k
        pair_slot = dispatch.pair_slot.to(torch.int32).contiguous()
        send = _Gather.apply(tokens, slot_token, pair_slot)
        pair = slot_token.to(torch.int64) * K + slot_k
        send_gates = gates.reshape(-1).index_select(0, pair)
        # 3. token exchange; 4. local experts
        recv = _AllToAll.apply(send, recv_splits, send_splits, self.group)
        recv_gates = _AllToAll.apply(send_gates, recv_splits, send_splits, self.group)
        out = self._local_run(recv, recv_gates, recv_counts.view(ep, El), sum(recv_splits))
        # 5. results back, in slot order; 6. combine over k
        back = _AllToAll.apply(out, send_splits, recv_splits, self.group)
        return _SumRows.apply(back, pair_slot, slot_token)

    def _exchange_tokens(self, tokens, gates, ids, dispatch) -> torch.Tensor:
        """Each token once to every rank that holds one of its experts; that rank sums the token's local experts
        before the row comes back (see the module's docstring). Every index is built before the host reads the
        splits, into buffers of the largest size (ep * L rows), so that the GPU has them queued when the host
        waits, and only the exchange and the experts follow the read."""
        ep, El, K, me = self.ep_size, self.num_local_experts, self.top_k, self.ep_rank
        dev, L = tokens.device, tokens.shape[0]
        i64 = torch.int64
        dest = ids.to(i64) // El  # (L, K) the rank of each pair's expert
        sent = (dest.unsqueeze(2) == torch.arange(ep, device=dev)).any(1)  # (L, ep): t has a row for rank r
        # 1. counts, every rank's to every rank: [s, r] = the pairs of each of r's experts from s, and the rows
        mine = torch.cat([dispatch.counts().to(i64).view(ep, El), sent.sum(0, dtype=i64).view(ep, 1)], 1)
        every = [torch.empty_like(mine) for _ in range(ep)]
        dist.all_gather(every, mine, group=self.group)
        meta = torch.stack(every)  # (ep source, ep destination, El + 1)
        rows_to, pairs_to = meta[:, :, El], meta[:, :, :El].sum(2)  # (source, destination)
        # where this rank's rows and pairs start in each destination's receive buffers
        row_base = (torch.cumsum(rows_to, 0) - rows_to)[me]
        pair_base = (torch.cumsum(pairs_to, 0) - pairs_to)[me]
        row_start, pair_start = _exclusive_cumsum(rows_to[me]), _exclusive_cumsum(pairs_to[me])
        # 2. this rank's rows in send order (rank-major, tokens ascending): row_pos[r, t] the row of (t, r) where
        #    sent; row_src[row] = r * L + t. Scatters with distinct targets (the unsent to one spare entry); the
        #    buffers hold ep * L rows and are cut to the row count after the host read.
        cap = ep * L
        flat = sent.t().reshape(-1)
        row_pos = torch.cumsum(flat, 0) - 1
        row_src = torch.zeros(cap + 1, dtype=i64, device=dev)
        row_src.scatter_(0, torch.where(flat, row_pos, cap), torch.arange(cap, device=dev))
        row_src = row_src[:cap]
        row_token = row_src.remainder(max(L, 1))
        row_pos = row_pos.view(ep, L)
        t_of = torch.arange(L, device=dev).unsqueeze(1).expand(L, K)
        # each pair's row in its destination's receive buffer, in slot order (the pairs' send order)
        pair_row = (row_pos[dest, t_of] - row_start[dest] + row_base[dest]).reshape(-1)
        slot_pair = dispatch.slot_token.to(i64) * K + dispatch.slot_k
        slot_row = pair_row.index_select(0, slot_pair)
        # each row's pairs in k order, named by their places in the destination's receive buffer, -1 padded
        J = min(K, El)
        earlier = torch.ones(K, K, dtype=torch.bool, device=dev).tril(-1)  # [k, k'] = k' < k
        within = ((dest.unsqueeze(2) == dest.unsqueeze(1)) & earlier).sum(2)  # (L, K) same-rank pairs before k
        named = dispatch.pair_slot.to(i64) - pair_start[dest] + pair_base[dest]
        table = torch.full((cap * J,), -1, dtype=torch.int32, device=dev)
        table.scatter_(0, ((dest * L + t_of) * J + within).reshape(-1), named.to(torch.int32).reshape(-1))
        row_pairs = table.view(cap, J).index_select(0, row_src)
        # this rank's combine: token t's rows in rank order, -1 padded
        R = min(K, ep)
        nth = sent.t().cumsum(0).t() - 1  # (L, ep) t's rows before rank r
        spot = torch.where(sent, torch.arange(L, device=dev).unsqueeze(1) * ep + nth, cap)
        combine = torch.full((cap + 1,), -1, dtype=torch.int32, device=dev)
        combine.scatter_(0, spot.reshape(-1), row_pos.t().reshape(-1).to(torch.int32))
        combine = combine[:cap].view(L, ep)[:, :R].contiguous()
        send_gates = gates.reshape(-1).index_select(0, slot_pair)
        # the one host synchronisation: the four split lists in a single device-to-host transfer
        host = torch.cat([pairs_to[me], rows_to[me], pairs_to[:, me], rows_to[:, me]]).tolist()
        send_pairs, send_rows = host[:ep], host[ep:2 * ep]
        recv_pairs, recv_rows = host[2 * ep:3 * ep], host[3 * ep:]
        n_rows, n_pairs_in = sum(send_rows), sum(recv_pairs)
        self.last_rows_sent = n_rows
        row_token, row_pairs = row_token[:n_rows], row_pairs[:n_rows]
        # 3. exchange: the rows and their pairs; each pair's gate and row
        send = _Gather.apply(tokens, row_token, combine)
        recv = _AllToAll.apply(send, recv_rows, send_rows, self.group)
        recv_gates = _AllToAll.apply(send_gates, recv_pairs, send_pairs, self.group)
        in_row = _all_to_all(slot_row, recv_pairs, send_pairs, self.group)
        in_pairs = _all_to_all(row_pairs, recv_rows, send_rows, self.group)
        # 4. on this rank: one row per pair (a local gather), the local experts, each row's pairs summed
        rows = _Gather.apply(recv, in_row, in_pairs)
        out = self._local_run(rows, recv_gates, meta[:, me, :El], n_pairs_in)
        summed = _SumRows.apply(out, in_pairs, in_row)
        # 5. the sums back, in send order; 6. each token's rows summed in rank order
        back = _AllToAll.apply(summed, send_rows, recv_rows, self.group)
        return _SumRows.apply(back, combine, row_token)


# ---------------------------------------------------------------------------------------------
# FSDP2
# ---------------------------------------------------------------------------------------------


def fully_shard_expert_parallel(model: nn.Module, mesh, *, dp_dim: str = "dp", ep_dim: str = "ep", **fsdp_kwargs):
    """FSDP2 on a 2-D DeviceMesh (``dp_dim`` x ``ep_dim``), as torchtitan shards its MoE models.

    Every :class:`ExpertParallelMoELayer` in ``model`` must have been built with ``group`` = the mesh's
    ``ep_dim`` group. Its ``experts`` are ``fully_shard``-ed over the ``dp_dim`` sub-mesh (each ep rank's
    slice sharded over its dp column) with the gradient divided by the whole mesh's size; then ``model``
    itself over the flattened (dp x ep) mesh, which takes every other parameter (routers included).
    Gradients then equal those of the same model on one process run on all ranks' tokens, with the loss
    averaged over ranks. ``fsdp_kwargs`` go to both ``fully_shard`` calls (e.g. ``mp_policy``), except that
    the experts' copy of an ``mp_policy`` has ``cast_forward_inputs=False``: their inputs (the received rows,
    already in the compute dtype, and the router's gates, which ``moe_ffn`` takes in float32) pass as they are.

    Returns the flattened mesh. Raises TypeError for an ``mp_policy`` that is not a ``MixedPrecisionPolicy`` and
    ValueError for a mesh without the two named dimensions, before anything is sharded.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = fsdp_kwargs.get("mp_policy")
    if mp is not None and not isinstance(mp, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy: expected a torch.distributed.fsdp.MixedPrecisionPolicy, got {type(mp).__name__}")
    names = mesh.mesh_dim_names or ()
    for dim in (dp_dim, ep_dim):
        if dim not in names:
            raise ValueError(f"the DeviceMesh has dimensions {names or None} and no dimension named {dim!r}")
    if mesh.ndim != 2:
        raise ValueError(f"expected a 2-D ({dp_dim}, {ep_dim}) mesh, got {mesh.ndim}-D {names}")
    ep_group, world = mesh.get_group(ep_dim), mesh.size()
    layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoELayer)]
    for layer in layers:
        if dist.get_world_size(layer.group) != dist.get_world_size(ep_group) or \
                dist.get_process_group_ranks(layer.group) != dist.get_process_group_ranks(ep_group):
            raise ValueError("an ExpertParallelMoELayer's group is not the mesh's "
                             f"{ep_dim!r} group: build it with group=mesh (ep_dim={ep_dim!r})")
    flat = mesh[dp_dim, ep_dim]._flatten(f"{dp_dim}_{ep_dim}")
    expert_kwargs = dict(fsdp_kwargs)
    if mp is not None:
        expert_kwargs["mp_policy"] = dataclasses.replace(mp, cast_forward_inputs=False)
    for layer in layers:
        fully_shard(layer.experts, mesh=mesh[dp_dim], **expert_kwargs)
        # each expert's gradient sums its whole ep row's tokens: average over every rank, not over dp only
        layer.experts.set_gradient_divide_factor(float(world))
    fully_shard(model, mesh=flat, **fsdp_kwargs)
    return flat


# ---------------------------------------------------------------------------------------------
# Without FSDP: a (dp, ep) mesh, layer conversion and data-parallel gradient averaging
# ---------------------------------------------------------------------------------------------


def expert_parallel_mesh(ep_size: int, device_type: str = "cuda", *, dp_dim: str = "dp", ep_dim: str = "ep"):
    """The 2-D (dp, ep) DeviceMesh of all ranks, dp = world size / ``ep_size`` (ranks r and r + 1 share a dp row's
    ep group). torch.distributed must be initialised (torchrun + ``init_process_group``)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("expert parallelism needs torch.distributed initialised (torchrun, then "
                           "dist.init_process_group)")
    world = dist.get_world_size()
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1 or world % ep_size:
        raise ValueError(f"the expert-parallel size {ep_size!r} must be a positive divisor of the world size {world}")
    return init_device_mesh(device_type, (world // ep_size, ep_size), mesh_dim_names=(dp_dim, ep_dim))


def to_expert_parallel(model: nn.Module, mesh, *, ep_dim: str = "ep", exchange: str = "tokens") -> nn.Module:
    """Replace every ``MoELayer`` in ``model`` by an :class:`ExpertParallelMoELayer` on ``mesh``'s ``ep_dim`` group
    with the same configuration and weights (this rank's experts sliced out; ``exchange`` as the layer's). Every rank
    must hold the same full weights beforehand (the same seed). Returns ``model`` (changed in place)."""
    _check_exchange(exchange)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, MoELayer):
                setattr(parent, name, ExpertParallelMoELayer.from_layer(child, group=mesh, ep_dim=ep_dim,
                                                                        exchange=exchange))
    return model


def expert_parameters(model: nn.Module) -> set:
    """The parameters of the :class:`ExpertParallelMoELayer` experts in ``model`` (each rank's own)."""
    return {p for m in model.modules() if isinstance(m, ExpertParallelMoELayer) for p in m.experts.parameters()}


@torch.no_grad()
def all_reduce_gradients(model: nn.Module, mesh, *, dp_dim: str = "dp") -> None:
    """Average the gradients of an expert-parallel model over the ranks, as DDP would (call after ``backward``).

    Every parameter outside the experts is replicated on all ranks: its gradient is summed over all of them and
    divided by the world size. An expert's gradient already sums the tokens of its whole ep group (the all-to-all
    brought them); it is summed over the ``dp_dim`` group (the ranks holding the same experts) and divided by the
    world size as well. The result equals the gradient of the mean loss over all ranks' tokens.
    """
    world = dist.get_world_size()
    experts = expert_parameters(model)
    dp_group = mesh.get_group(dp_dim)
    for p in model.parameters():
        if p.grad is None:
            continue
        dist.all_reduce(p.grad, group=dp_group if p in experts else None)
        p.grad.div_(world)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, mesh, *, ep_dim: str = "ep") -> torch.Tensor:
    """Clip the gradients of an expert-parallel model by their global norm, as ``torch.nn.utils.clip_grad_norm_``
    does on the single-process model; call after :func:`all_reduce_gradients`. Returns the norm (0-d float32, float64
    for float64 gradients).

    Each expert's gradient lives on one rank of the ``ep_dim`` group (the same on every dp row) and every other
    gradient is the same on all ranks, so the squared norm is the local non-expert part plus the expert part summed
    over the ep group. Every rank scales by the same factor, so replicated parameters stay equal.
    """
    experts = expert_parameters(model)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    device = grads[0].device
    acc = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    shared = torch.zeros((), device=device, dtype=acc)
    owned = torch.zeros((), device=device, dtype=acc)
    for p in model.parameters():
        if p.grad is not None:
            sq = p.grad.detach().to(acc).square().sum()
            if p in experts:
                owned += sq
            else:
                shared += sq
    dist.all_reduce(owned, group=mesh.get_group(ep_dim))
    norm = (shared + owned).sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return norm
