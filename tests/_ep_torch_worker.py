"""One rank of the multi-process expert-parallel tests (tests/test_ep_torch.py starts WORLD_SIZE of them).

Usage: RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/_ep_torch_worker.py SUITE

Suites: "layer" (ExpertParallelMoELayer against the single-process MoELayer: output and every gradient),
"fsdp" (FSDP2 on a (dp, ep) mesh against the single-process model after optimizer steps), "errors" (bad
input raises before any communication). Every rank computes the single-process reference itself on all
ranks' tokens (the same seed everywhere) and compares its own part. Prints "OK <case>" per case; a failure
raises (non-zero exit).
"""

from __future__ import annotations

import os
import sys

import blazecore_torch
import torch
import torch.distributed as dist
from blazecore_torch.parallel import (
    EXCHANGES,
    ExpertParallelMoELayer,
    all_reduce_gradients,
    clip_grad_norm_,
    expert_parallel_mesh,
    fully_shard_expert_parallel,
    to_expert_parallel,
)
from torch import nn

RTOL = 1e-10  # float64 reference path on both sides; only the summation order differs


def _close(name, got, want, rtol=RTOL):
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if want.numel() == 0:
        return
    err = (got - want).norm() / max(want.norm().item(), 1e-300)
    if not err <= rtol:
        i = int((got - want).abs().argmax())
        raise AssertionError(f"{name}: relative norm error {err:.3e} > {rtol:.1e}; max abs error "
                             f"{(got - want).abs().max():.3e} at flat index {i}")


def _routed_inputs(case, world, d, E):
    """All ranks' tokens (a list, one (L_r, d) tensor per rank) for a routing case. The router of the tests
    reads the first E columns as logits (router.weight = [I_E, 0]), so these columns pick the routing."""
    g = torch.Generator().manual_seed(1234 + world)
    counts = {"uneven": [5, 0, 9, 3], "empty_from_rank": [6, 7, 4, 5], "k_eq_e": [4, 3, 0, 6],
              "all_to_one": [5, 4, 6, 2], "none_ckpt": [7, 2, 5, 1], "expert_bias": [3, 8, 2, 6],
              "float32": [9, 4, 6, 3], "in_out_biases": [6, 3, 7, 4]}[case][:world]
    xs = []
    for r, n in enumerate(counts):
        x = torch.randn(n, d, generator=g, dtype=torch.float64)
        if case == "uneven":
            x[:, :E] += torch.linspace(2.0, -2.0, E, dtype=torch.float64)  # skewed towards low experts
        elif case == "empty_from_rank":
            x[:, r % E] -= 40.0  # rank r never picks expert r
            x[:, E - 1] -= 40.0  # and nobody picks the last expert: a rank's local expert gets no token at all
        elif case == "all_to_one":
            x[:, 0] += 40.0  # every token's first choice is expert 0 (rank 0): other ranks receive only k >= 1
        xs.append(x)
    return xs


def _full_layer(d, h, E, K, activation="swiglu", checkpoint="ab", bias=False, weight_layout="out_in",
                ffn_bias=False):
    torch.manual_seed(7)
    full = blazecore_torch.MoELayer(d, h, E, K, activation=activation, checkpoint=checkpoint, expert_bias=bias,
                                    weight_layout=weight_layout, bias=ffn_bias, dtype=torch.float64)
    with torch.no_grad():
        w = torch.zeros(E, d, dtype=torch.float64)
        w[:, :E] = torch.eye(E, dtype=torch.float64)
        full.router.weight.copy_(w)
        if bias:
            full.expert_bias.copy_(torch.linspace(-1.0, 1.0, E))
    return full


def suite_layer(rank, world):
    d, h = 12, 6
    cases = [("uneven", 8, 2, "swiglu", "ab"), ("empty_from_rank", 8, 3, "swiglu", "ab"),
             ("k_eq_e", 4, 4, "swiglu", "ab"), ("all_to_one", 4, 2, "gelu", "ab"),
             ("none_ckpt", 8, 2, "swiglu", "none"), ("expert_bias", 8, 2, "swiglu", "ab"),
             ("float32", 8, 2, "swiglu", "ab"), ("in_out_biases", 8, 2, "swiglu_interleaved", "ab")]
    for case, E, K, act, ck in cases:
        if E % world:
            continue
        gpt_oss = case == "in_out_biases"  # gpt-oss's experts: "in_out" weights, interleaved rows, biases
        full = _full_layer(d, h, E, K, act, ck, bias=case == "expert_bias",
                           weight_layout="in_out" if gpt_oss else "out_in", ffn_bias=gpt_oss)
        xs = _routed_inputs(case, world, d, E)
        gdy = torch.Generator().manual_seed(99)
        dys = [torch.randn(x.shape, generator=gdy, dtype=torch.float64) for x in xs]
        rtol = RTOL
        if case == "float32":  # the core's CPU path for float32 (gates float32), not the float64 reference
            full.float()
            xs, dys, rtol = [t.float() for t in xs], [t.float() for t in dys], 1e-5
        # the single-process layer on every rank's tokens at once
        x_all = torch.cat(xs).requires_grad_(True)
        y_all, aux_all = full(x_all)
        (y_all * torch.cat(dys)).sum().backward()
        for exchange in EXCHANGES:
            _check_ep_case(rank, world, case, exchange, full, xs, dys, x_all, y_all, aux_all, rtol, gpt_oss)


def _check_ep_case(rank, world, case, exchange, full, xs, dys, x_all, y_all, aux_all, rtol, gpt_oss):
    """This rank's part through the EP layer (``exchange``) against the single-process layer's results on every
    rank's tokens: output, every gradient, the counts."""
    E, d = full.num_experts, full.hidden_size
    ep = ExpertParallelMoELayer.from_layer(full, exchange=exchange)
    assert ep.exchange == exchange
    tag = f"{case} ({exchange})"
    x = xs[rank].clone().requires_grad_(True)
    y, aux = ep(x)
    (y * dys[rank]).sum().backward()
    # the rows sent: K a token, or one a token and destination rank (the ids from the router's logits, independently)
    K = full.top_k
    ids = aux["router_logits"].detach().topk(K, dim=1).indices
    if full.expert_bias is not None:  # the bias shifts the selection, not the gates
        ids = (aux["router_logits"].detach().softmax(1) + full.expert_bias).topk(K, dim=1).indices
    per_rank = E // world
    want = x.shape[0] * K if exchange == "pairs" else sum(len({int(i) // per_rank for i in row}) for row in ids)
    assert ep.last_rows_sent == want, (tag, ep.last_rows_sent, want)
    lo = sum(t.shape[0] for t in xs[:rank])
    rows = slice(lo, lo + xs[rank].shape[0])
    sl = slice(ep.local_expert_range.start, ep.local_expert_range.stop)
    _close(f"{tag}: y", y, y_all[rows], rtol)
    _close(f"{tag}: dx", x.grad, x_all.grad[rows], rtol)
    _close(f"{tag}: d gate_up_proj", ep.experts.gate_up_proj.grad, full.gate_up_proj.grad[sl], rtol)
    _close(f"{tag}: d down_proj", ep.experts.down_proj.grad, full.down_proj.grad[sl], rtol)
    if gpt_oss:
        assert ep.experts.weight_layout == "in_out" and ep.experts.gate_up_proj.shape[1] == d
        _close(f"{tag}: d gate_up_proj_bias", ep.experts.gate_up_proj_bias.grad, full.gate_up_proj_bias.grad[sl],
               rtol)
        _close(f"{tag}: d down_proj_bias", ep.experts.down_proj_bias.grad, full.down_proj_bias.grad[sl], rtol)
    drouter = ep.router.weight.grad.clone()
    dist.all_reduce(drouter)  # the router is replicated: its gradient sums over the ranks' tokens
    _close(f"{tag}: d router", drouter, full.router.weight.grad, rtol)
    counts = aux["tokens_per_expert"].to(torch.int64)
    dist.all_reduce(counts)
    assert counts.tolist() == aux_all["tokens_per_expert"].tolist(), (counts, aux_all["tokens_per_expert"])
    # every routing property the case promises held
    if case == "empty_from_rank":
        assert int(aux["tokens_per_expert"][rank % E]) == 0
    if case == "k_eq_e":
        assert int(aux["tokens_per_expert"].sum()) == xs[rank].shape[0] * E
    print(f"OK {case}/{exchange}", flush=True)


class _Model(nn.Module):
    """in-projection -> MoE -> residual -> out-projection: parameters inside and outside the experts."""

    def __init__(self, d, moe):
        super().__init__()
        self.inp = nn.Linear(d, d, dtype=torch.float64)
        self.moe = moe
        self.out = nn.Linear(d, d, dtype=torch.float64)

    def forward(self, x):
        hid = self.inp(x)
        y, _ = self.moe(hid)
        return self.out(hid + y)


def _batches(g, world, L, d):
    """Every rank's inputs and targets for one step, float64: (xs, ts), a list of world (L, d) tensors each."""
    xs = [torch.randn(L, d, generator=g, dtype=torch.float64) for _ in range(world)]
    ts = [torch.randn(L, d, generator=g, dtype=torch.float64) for _ in range(world)]
    return xs, ts


def _check_like_ref(tag, named_params, ref, sl):
    """Each parameter equals the single-process model's (the experts: this rank's slice ``sl`` of them)."""
    want = dict(ref.named_parameters())
    for n, p in named_params:
        key = n.replace("moe.experts.", "moe.")
        _close(f"{tag}: {n}", p, want[key][sl] if "experts" in n else want[key], rtol=1e-9)


def suite_fsdp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    # dp = 2 always: with a data-parallel dimension of size 1, torch 2.13's FSDP2 divides a float64 (or float16)
    # gradient twice by a custom divide factor (its pre-divide and its size-1 copy both apply it)
    dp, epn = 2, world // 2
    mesh = init_device_mesh("cpu", (dp, epn), mesh_dim_names=("dp", "ep"))
    d, h, E, K, L, steps = 8, 6, 4, 2, 6, 3
    torch.manual_seed(3)
    ref = _Model(d, blazecore_torch.MoELayer(d, h, E, K, dtype=torch.float64))
    torch.manual_seed(3)
    model = _Model(d, ExpertParallelMoELayer(d, h, E, K, group=mesh, ep_dim="ep", dtype=torch.float64))
    with torch.no_grad():
        model.inp.load_state_dict(ref.inp.state_dict())
        model.out.load_state_dict(ref.out.state_dict())
        model.moe.load_full_state_dict(ref.moe.state_dict())
    model.moe.always_exchange = True  # the all-to-all path even where ep = 1
    fully_shard_expert_parallel(model, mesh)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sl = slice(model.moe.local_expert_range.start, model.moe.local_expert_range.stop)
    g = torch.Generator().manual_seed(5)
    for step in range(steps):
        xs, ts = _batches(g, world, L, d)
        # single process: the mean loss over every rank's tokens
        opt_ref.zero_grad()
        ((ref(torch.cat(xs)) - torch.cat(ts)) ** 2).mean().backward()
        opt_ref.step()
        opt.zero_grad()
        ((model(xs[rank]) - ts[rank]) ** 2).mean().backward()
        opt.step()
        full = [(n, p.full_tensor() if isinstance(p, DTensor) else p) for n, p in model.named_parameters()]
        _check_like_ref(f"fsdp step {step}", full, ref, sl)
    print(f"OK fsdp dp={dp} ep={epn} steps={steps}", flush=True)
    _check_ddp(rank, world)


def _fsdp_mixed_precision(rank, world, device, reduce_dtype, dims, tag):
    """FSDP2 with bf16 parameters in the forward and ``reduce_dtype`` gradient reduction on a (2, world / 2) mesh
    against the single-process model in the same mixed precision (float32 master weights and Adam, each step's
    forward and backward on a bf16 copy of them over every rank's tokens, the gradients taken back in float32),
    after Adam steps: bf16 tolerance. The experts get the router's float32 gates (FSDP2's cast of forward inputs
    stays off for them). (Against a float32 forward instead, Adam's steps turn bf16's rounding of the router's
    gradient into a 1% difference of its weights after 3 steps.)"""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    d, h, E, K, L, steps = dims
    mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("dp", "ep"))
    torch.manual_seed(3)
    ref = _Model(d, blazecore_torch.MoELayer(d, h, E, K, dtype=torch.float64)).float().to(device)
    model = _Model(d, ExpertParallelMoELayer(d, h, E, K, group=mesh, ep_dim="ep", dtype=torch.float64))
    model = model.float().to(device)
    with torch.no_grad():
        model.inp.load_state_dict(ref.inp.state_dict())
        model.out.load_state_dict(ref.out.state_dict())
        model.moe.load_full_state_dict(ref.moe.state_dict())
    model.moe.always_exchange = True  # the all-to-all path even where ep = 1
    fully_shard_expert_parallel(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                             reduce_dtype=reduce_dtype))
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sl = slice(model.moe.local_expert_range.start, model.moe.local_expert_range.stop)
    g = torch.Generator(device=device).manual_seed(5)
    for _ in range(steps):
        xs = [torch.randn(L, d, generator=g, device=device) for _ in range(world)]
        ts = [torch.randn(L, d, generator=g, device=device) for _ in range(world)]
        opt_ref.zero_grad(set_to_none=True)
        work = copy.deepcopy(ref).to(torch.bfloat16)  # what FSDP2's bf16 all-gather computes with
        ((work(torch.cat(xs).bfloat16()).float() - torch.cat(ts)) ** 2).mean().backward()
        for p_ref, p_work in zip(ref.parameters(), work.parameters(), strict=True):
            p_ref.grad = p_work.grad.float()
        opt_ref.step()
        opt.zero_grad()
        ((model(xs[rank].bfloat16()).float() - ts[rank]) ** 2).mean().backward()
        opt.step()
    want = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        key = n.replace("moe.experts.", "moe.")
        w = want[key][sl] if "experts" in n else want[key]
        _close(f"{tag}: {n}", full, w, rtol=1e-2)
    print(f"OK {tag}", flush=True)


def suite_fsdp_mp(rank, world):
    """gloo: the mixed-precision check with a float64 reduction (gloo has no PREMUL_SUM for FSDP2's float32 divide;
    suite_gpu_fsdp runs the float32 reduction over NCCL)."""
    _fsdp_mixed_precision(rank, world, torch.device("cpu"), torch.float64, (16, 8, 4, 2, 12, 2), "fsdp_mp")


def _check_ddp(rank, world):
    """Without FSDP: to_expert_parallel + all_reduce_gradients on expert_parallel_mesh equal the single-process
    model after Adam steps."""
    epn = 2 if world >= 2 else 1
    mesh = expert_parallel_mesh(epn, "cpu")
    d, h, E, K, L, steps = 8, 6, 4, 2, 5, 2
    torch.manual_seed(11)
    ref = _Model(d, blazecore_torch.MoELayer(d, h, E, K, dtype=torch.float64))
    torch.manual_seed(11)
    model = to_expert_parallel(_Model(d, blazecore_torch.MoELayer(d, h, E, K, dtype=torch.float64)), mesh)
    assert isinstance(model.moe, ExpertParallelMoELayer)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sl = slice(model.moe.local_expert_range.start, model.moe.local_expert_range.stop)
    g = torch.Generator().manual_seed(6)
    for step in range(steps):
        xs, ts = _batches(g, world, L, d)
        opt_ref.zero_grad()
        ((ref(torch.cat(xs)) - torch.cat(ts)) ** 2).mean().backward()
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        opt_ref.step()
        opt.zero_grad()
        ((model(xs[rank]) - ts[rank]) ** 2).mean().backward()
        all_reduce_gradients(model, mesh)
        norm = clip_grad_norm_(model, 0.05, mesh)
        assert norm_ref > 0.05, "the clipping threshold must bite"
        _close(f"ddp step {step}: grad norm", norm, norm_ref, rtol=1e-6)
        opt.step()
        _check_like_ref(f"ddp step {step}", model.named_parameters(), ref, sl)
    print(f"OK ddp dp={world // epn} ep={epn}", flush=True)


def suite_titan(rank, world):
    """torchtitan's MoE under its own expert parallelism (AllToAllTokenDispatcher on an "ep" mesh, the
    "partial_dtensor" SPMD backend) with blazecore's experts, against the single-process torchtitan MoE with its
    grouped_mm experts (which compute in bf16: bf16 tolerance)."""
    from blazecore_torch.titan import use_blazecore_experts
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher

    set_spmd_backend("partial_dtensor")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    d, F, E, K, T = 16, 8, 4, 2, 6

    def config(local_experts, dispatcher):
        return MoE.Config(num_experts=E, router=TokenChoiceTopKRouter.Config(
            num_experts=E, top_k=K, gate=Linear.Config(in_features=d, out_features=E, bias=False)),
            routed_experts=RoutedExperts.Config(
                inner_experts=GroupedExperts.Config(dim=d, hidden_dim=F, num_experts=local_experts),
                token_dispatcher=dispatcher.Config(num_experts=E, top_k=K)))

    torch.manual_seed(0)
    full = config(E, LocalTokenDispatcher).build()
    for p in full.parameters():
        nn.init.normal_(p, std=0.3)
    ep = use_blazecore_experts(config(E // world, AllToAllTokenDispatcher)).build()
    sl = slice(rank * E // world, (rank + 1) * E // world)
    ep.load_state_dict({k: (v[sl] if "inner_experts" in k else v) for k, v in full.state_dict().items()})
    ep.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(1, T, d, generator=g) for _ in range(world)]
    x_all = torch.cat(xs, 1).requires_grad_(True)
    full(x_all).sum().backward()
    x = xs[rank].clone().requires_grad_(True)
    y = ep(x)
    y.sum().backward()
    rows = slice(rank * T, (rank + 1) * T)
    _close("titan: y", y, full(x_all.detach())[:, rows], rtol=2e-2)
    _close("titan: dx", x.grad, x_all.grad[:, rows], rtol=2e-2)
    mine, ref = ep.routed_experts.inner_experts, full.routed_experts.inner_experts
    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
        _close(f"titan: d {name}", getattr(mine, name).grad, getattr(ref, name).grad[sl], rtol=2e-2)
    assert type(mine).__name__ == "BlazecoreGroupedExperts"
    print("OK titan", flush=True)


def suite_gpu(rank, world):
    """NCCL, one GPU per rank, bf16 kernels: the EP layer (both exchanges) against the full MoELayer on every rank's
    tokens (run on each rank's own GPU), output and every gradient within bf16 tolerance, and the same bits when run
    again."""
    device = torch.device("cuda", rank)
    d, h, E, K = 256, 128, 8 * world, 4
    torch.manual_seed(7)
    full = blazecore_torch.MoELayer(d, h, E, K, device=device, dtype=torch.bfloat16)
    ep = ExpertParallelMoELayer.from_layer(full)
    g = torch.Generator(device=device).manual_seed(5)
    counts = [700 + 97 * r for r in range(world)]
    xs = [torch.randn(n, d, generator=g, device=device).bfloat16() for n in counts]
    dys = [torch.randn(n, d, generator=g, device=device).bfloat16() for n in counts]
    x_all = torch.cat(xs).requires_grad_(True)
    y_all, _ = full(x_all)
    (y_all.float() * torch.cat(dys).float()).sum().backward()
    lo = sum(counts[:rank])
    rows, sl = slice(lo, lo + counts[rank]), slice(ep.local_expert_range.start, ep.local_expert_range.stop)
    tol = 2e-2
    sent = {}

    def run():
        ep.zero_grad(set_to_none=True)
        x = xs[rank].clone().requires_grad_(True)
        y, _ = ep(x)
        (y.float() * dys[rank].float()).sum().backward()
        return {"y": y, "dx": x.grad, "d gate_up_proj": ep.experts.gate_up_proj.grad,
                "d down_proj": ep.experts.down_proj.grad, "d router": ep.router.weight.grad}

    for exchange in EXCHANGES:
        ep.exchange = exchange
        got, again = run(), run()
        for name, a in got.items():  # deterministic: the same bits run to run
            assert torch.equal(a, again[name]), f"gpu {exchange}: {name} differs between two identical runs"
        sent[exchange] = ep.last_rows_sent
        _close(f"gpu {exchange}: y", got["y"], y_all[rows], tol)
        _close(f"gpu {exchange}: dx", got["dx"], x_all.grad[rows], tol)
        _close(f"gpu {exchange}: d gate_up_proj", got["d gate_up_proj"], full.gate_up_proj.grad[sl], tol)
        _close(f"gpu {exchange}: d down_proj", got["d down_proj"], full.down_proj.grad[sl], tol)
        drouter = got["d router"].float()
        dist.all_reduce(drouter)
        _close(f"gpu {exchange}: d router", drouter, full.router.weight.grad, tol)
    assert sent["pairs"] == counts[rank] * K and counts[rank] <= sent["tokens"] < sent["pairs"], sent
    print("OK gpu", flush=True)


def suite_gpu_fsdp(rank, world):
    """NCCL, one GPU per rank: the mixed-precision check with a float32 reduction."""
    _fsdp_mixed_precision(rank, world, torch.device("cuda", rank), torch.float32, (256, 128, 8, 2, 512, 3),
                          "gpu_fsdp")


def suite_errors(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    def expect(exc, fn, text):
        try:
            fn()
        except exc as e:
            assert text in str(e), f"message {str(e)!r} lacks {text!r}"
        else:
            raise AssertionError(f"no {exc.__name__} ({text})")

    expect(ValueError, lambda: ExpertParallelMoELayer(8, 4, world + 1, 1, dtype=torch.float64), "not divisible")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    expect(ValueError, lambda: ExpertParallelMoELayer(8, 4, 2 * world, 1, group=mesh, ep_dim="ep"), "no dimension")
    expect(ValueError, lambda: ExpertParallelMoELayer(8, 4, 2 * world, 1, exchange="rows"), "exchange must be")
    expect(ValueError, lambda: to_expert_parallel(nn.Linear(2, 2), None, exchange="token"), "exchange must be")
    layer = ExpertParallelMoELayer(8, 4, 2 * world, 1, dtype=torch.float64)
    expect(ValueError, lambda: layer(torch.zeros(3, 8, dtype=torch.float64, device="meta")), "one device")
    expect(TypeError, lambda: layer(torch.zeros(3, 8)), "dtype")
    layer.exchange = "rows"
    expect(ValueError, lambda: layer(torch.zeros(3, 8, dtype=torch.float64)), "exchange must be")
    print("OK errors", flush=True)


def main():
    suite = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    if suite.startswith("gpu"):
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        suites = {"layer": suite_layer, "fsdp": suite_fsdp, "errors": suite_errors, "titan": suite_titan,
                  "gpu": suite_gpu, "gpu_fsdp": suite_gpu_fsdp, "fsdp_mp": suite_fsdp_mp}
        suites[suite](rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Every check passed. Leave without the interpreter's teardown: a c10d or autograd worker thread still joinable
    # when the static destructors run ends the process in std::terminate (status -6 after all the OK lines).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
