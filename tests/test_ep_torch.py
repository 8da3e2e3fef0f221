"""Expert parallelism over torch.distributed (blazecore_torch.parallel), multi-process on the CPU with gloo.

Each case starts WORLD_SIZE processes of tests/_ep_torch_worker.py (float64, the CPU reference path, tiny
shapes) that compare with the single-process layer: output and every gradient (dx, d gate_up_proj, d
down_proj, d router) under uneven token counts, a rank with no token, an expert that gets nothing from some
rank, everything on one expert and K == E; FSDP2 on a (dp, ep) mesh after Adam steps; bad input raising
before any communication. The GPU case checks that ep_size 1 over NCCL gives MoELayer's bits.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "_ep_torch_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, suite: str, timeout: float = 240) -> list[str]:
    env = dict(os.environ)
    env.update({"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                "OMP_NUM_THREADS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1", "PYTHONPATH": os.pathsep.join(
                    [str(ROOT), str(ROOT / "adapters"), env.get("PYTHONPATH", "")])})
    procs = [subprocess.Popen([sys.executable, str(WORKER), suite], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
             for r in range(world)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r} of {world} ({suite}) failed:\n{out[-4000:]}"
    return outs


@pytest.mark.parametrize("world", [2, 4])
def test_layer_matches_single_process(world):
    outs = _launch(world, "layer")
    cases = {"uneven", "empty_from_rank", "k_eq_e", "all_to_one", "none_ckpt", "expert_bias", "float32",
             "in_out_biases"}
    for out in outs:
        done = {line.split()[1] for line in out.splitlines() if line.startswith("OK ")}
        assert done == {f"{c}/{x}" for c in cases for x in ("tokens", "pairs")}, out


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_matches_single_process(world):
    for out in _launch(world, "fsdp"):
        assert "OK fsdp" in out and "OK ddp" in out, out


def test_fsdp2_mixed_precision_keeps_float32_gates():
    """FSDP2 with a bf16 parameter policy on 4 CPU ranks: the experts' forward inputs are not cast (the router's
    gates stay float32, as moe_ffn requires) and training matches the float32 model (suite "fsdp_mp")."""
    for out in _launch(4, "fsdp_mp"):
        assert "OK fsdp_mp" in out, out


def test_fsdp2_refuses_a_policy_that_is_not_one():
    """fully_shard_expert_parallel: an mp_policy that is not FSDP2's MixedPrecisionPolicy is a TypeError before the
    mesh is read or anything is sharded."""
    from blazecore_torch.parallel import fully_shard_expert_parallel

    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="mp_policy: expected a torch.distributed.fsdp.MixedPrecisionPolicy, got str"):
        fully_shard_expert_parallel(model, None, mp_policy="bf16")
    assert not hasattr(model, "_get_fsdp_state")  # nothing was sharded


def test_bad_input_raises_before_communication():
    for out in _launch(2, "errors", timeout=120):
        assert "OK errors" in out, out


@pytest.mark.gpu
def test_ep_on_every_gpu_matches_single_process():
    """With 2 or more GPUs: one process per GPU over NCCL (bf16), against the full MoELayer (suite "gpu")."""
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs 2 or more GPUs, found {n}")
    world = 4 if n >= 4 else 2
    for out in _launch(world, "gpu"):
        assert "OK gpu" in out, out


@pytest.mark.gpu
def test_fsdp2_mixed_precision_on_gpus():
    """With 2 or more GPUs: FSDP2 (bf16 compute, float32 reduction; NCCL's PREMUL_SUM, which gloo lacks) on a
    (2, n / 2) mesh against the single-process float32 model after Adam steps (suite "gpu_fsdp")."""
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs 2 or more GPUs, found {n}")
    for out in _launch(4 if n >= 4 else 2, "gpu_fsdp"):
        assert "OK gpu_fsdp" in out, out


@pytest.mark.gpu
def test_ep_size_one_nccl_gives_plain_layer_bits():
    """One process, NCCL, ep_size 1: the same bits as MoELayer (forward and every gradient), bf16; the all-to-all
    path against the group of one (``always_exchange``), both exchanges, agrees within bf16 tolerance."""
    import blazecore_torch
    import torch.distributed as dist
    from blazecore_torch.parallel import ExpertParallelMoELayer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(key, "0" if key == "NCCL_NVLS_ENABLE" else "1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        torch.manual_seed(0)
        d, h, E, K, L = 256, 128, 8, 2, 1000
        full = blazecore_torch.MoELayer(d, h, E, K, device="cuda", dtype=torch.bfloat16)
        ep = ExpertParallelMoELayer.from_layer(full)
        x = torch.randn(L, d, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(L, d, device="cuda", dtype=torch.bfloat16)

        def run(layer):
            xx = x.clone().requires_grad_(True)
            layer.zero_grad()
            y, _ = layer(xx)
            (y.float() * dy.float()).sum().backward()
            experts = getattr(layer, "experts", layer)
            return {"y": y, "dx": xx.grad, "d gate_up_proj": experts.gate_up_proj.grad,
                    "d down_proj": experts.down_proj.grad, "d router": layer.router.weight.grad}

        want = run(full)
        for name, a in run(ep).items():
            assert torch.equal(a, want[name]), f"{name}: not the plain layer's bits"
        ep.always_exchange = True
        for exchange in ("tokens", "pairs"):
            ep.exchange = exchange
            for name, a in run(ep).items():
                b = want[name].double()
                err = (a.double() - b).norm() / b.norm()
                assert err < 2e-2, f"{name} through the {exchange} all-to-all path: relative norm error {err:.2e}"
            assert ep.last_rows_sent == (L if exchange == "tokens" else L * K), (exchange, ep.last_rows_sent)
    finally:
        dist.destroy_process_group()


def _titan_moe(d, F, E, K, seed=0):
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    return MoE.Config(
        num_experts=E, router=TokenChoiceTopKRouter.Config(
            num_experts=E, top_k=K, gate=Linear.Config(in_features=d, out_features=E, bias=False)),
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=d, hidden_dim=F, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torchtitan_experts_backend(device):
    """torchtitan's MoE with blazecore's experts (blazecore_torch.titan) against its grouped_mm experts (which
    compute in bf16): output and every gradient, then a few optimizer steps. On the GPU the shapes are larger
    (d=256, F=128, E=8, K=2, 2 x 512 tokens) and the parameters float32 (blazecore's float32 kernels)."""
    pytest.importorskip("torchtitan")
    from blazecore_torch.titan import use_blazecore_experts

    d, F, E, K, B, T = (16, 8, 4, 2, 2, 7) if device == "cpu" else (256, 128, 8, 2, 2, 512)
    torch.manual_seed(0)
    stock = _titan_moe(d, F, E, K).build().to(device)
    for p in stock.parameters():
        torch.nn.init.normal_(p, std=d ** -0.5)
    ours = use_blazecore_experts(_titan_moe(d, F, E, K)).build().to(device)
    assert type(ours.routed_experts.inner_experts).__name__ == "BlazecoreGroupedExperts"
    ours.load_state_dict(stock.state_dict())
    x = torch.randn(B, T, d, device=device)
    outs = []
    for m in (stock, ours):
        xx = x.clone().requires_grad_(True)
        y = m(xx)
        (y * torch.linspace(-1, 1, d, device=device)).sum().backward()
        outs.append({"y": y, "dx": xx.grad, **{n: p.grad for n, p in m.named_parameters()}})
    for name, want in outs[0].items():
        got = outs[1][name]
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err < 2e-2, f"{name}: relative norm error {err:.2e} against torchtitan's bf16 grouped_mm experts"
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    target = torch.randn(B, T, d, device=device)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = ((ours(x) - target) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


@pytest.mark.gpu
def test_torchtitan_qwen3_moe_model_trains_with_blazecore_experts():
    """A whole torchtitan model (its Qwen3-MoE "debugmodel_moe": 8 layers, 64 experts, top 8, flex attention)
    trains with blazecore's experts: same initial weights and batches as with its grouped_mm experts, ten AdamW
    steps in float32; the losses track the stock model's and fall."""
    pytest.importorskip("torchtitan")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU (flex attention has no CPU backward)")
    from blazecore_torch.titan import use_blazecore_experts
    try:
        from torchtitan.models.qwen3 import qwen3_configs
    except ImportError as e:  # torchtitan 0.3's model packages import FSDP names that torch < 2.12 lacks
        pytest.skip(f"torchtitan's Qwen3 package does not import with torch {torch.__version__}: {e}")

    torch.manual_seed(0)
    stock = qwen3_configs["debugmodel_moe"](attn_backend="flex").build().to("cuda")
    for p in stock.parameters():
        torch.nn.init.normal_(p, std=0.02)
    ours = use_blazecore_experts(qwen3_configs["debugmodel_moe"](attn_backend="flex")).build().to("cuda")
    ours.load_state_dict(stock.state_dict())
    n_ours = sum(type(m).__name__ == "BlazecoreGroupedExperts" for m in ours.modules())
    assert n_ours == 8, n_ours
    B, T, V = 4, 256, 2048
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, V, (B, T + 1), device="cuda", generator=g) for _ in range(2)]
    pos = torch.arange(T, device="cuda").repeat(B, 1)
    losses = {}
    for name, m in (("grouped_mm", stock), ("blazecore", ours)):
        masks = m.get_attention_masks(pos)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        losses[name] = []
        for step in range(10):
            tok = batches[step % 2]
            logits = m(tok[:, :-1], pos, masks)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tok[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    print("torchtitan qwen3 debugmodel_moe losses:", losses)
    a, b = losses["grouped_mm"], losses["blazecore"]
    assert all(abs(x - y) <= 0.05 * abs(x) for x, y in zip(a, b, strict=True)), losses
    assert b[-1] < 0.8 * b[0], losses


def test_torchtitan_expert_parallel_with_blazecore_experts():
    """2 processes: torchtitan's own all-to-all token dispatcher with blazecore's experts equals the single-process
    torchtitan MoE (tests/_ep_torch_worker.py, suite "titan")."""
    pytest.importorskip("torchtitan")
    for out in _launch(2, "titan"):
        assert "OK titan" in out, out


def test_bench_ep_cpu_smoke(tmp_path):
    """bench/bench_ep.py's driver and torchrun worker on the CPU (gloo, 2 processes, tiny shape): it runs and its
    JSON has the weak-scaling rows (both exchanges) of blazecore's local experts, and of the grouped_mm MoE's where
    this torch's torch._grouped_mm runs on the CPU (the same tokens and exchange; no NCCL figures on the CPU)."""
    import json

    from blazecore_app import baselines

    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_ep.py"), "--device", "cpu", "--shape", "tiny",
                           "--tokens-per-gpu", "32", "--gpus", "2", "--warmup", "1", "--repeats", "2",
                           "--results-dir", str(tmp_path)], env=_cli_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "ep_cpu.json").read_text())
    by_run = {(r["impl"], r["exchange_mode"]): r for r in doc["rows"]}
    probe = torch.zeros(1, 64)
    gmm_runs = baselines.grouped_mm_unsupported(probe, torch.zeros(1, 64, 64), torch.zeros(1, 64, 32)) is None
    impls = ["blazecore", "grouped_mm"] if gmm_runs else ["blazecore"]
    assert sorted(by_run) == sorted((i, x) for i in impls for x in ("pairs", "tokens")), by_run
    assert len(doc["rows"]) == len(by_run)
    for (_, mode), row in by_run.items():
        assert row["gpus"] == 2 and row["global_tokens"] == 64 and row["exchange"] and row["tokens_per_s"] > 0
        assert row["nccl_ms_by_rank"] is None and row["nccl_share"] is None
        # tiny: K = 2 of E = 8 over 2 ranks; "tokens" sends 1 or 2 rows a token, "pairs" always 2
        assert (1.0 <= row["rows_sent_per_token"] < 2.0) if mode == "tokens" else row["rows_sent_per_token"] == 2.0


@pytest.mark.parametrize("argv", [["--impls", "cutlass"], ["--impls", ","], ["--profile-steps", "-1"],
                                  ["--exchanges", "rows"], ["--exchanges", ","]])
def test_bench_ep_refuses_bad_options(argv, capsys):
    """A bad --impls or --profile-steps is a usage error before any process starts."""
    from bench import bench_ep

    with pytest.raises(SystemExit) as exc:
        bench_ep.main(["--device", "cpu", "--gpus", "2", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert argv[0] in err, err


def _cli_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "adapters"), str(ROOT / "app"),
                                         env.get("PYTHONPATH", "")])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def test_train_ep_under_torchrun(tmp_path):
    """``train --ep 2`` on 2 CPU ranks (gloo): data + expert parallel training runs, rank 0 reports global tokens/s
    and writes the log (``--log-file``: torchrun's own parser takes ``--log`` for its ``--log-dir``)."""
    import json

    log = tmp_path / "ep.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "blazecore",
           "train", "--ep", "2", "--device", "cpu", "--steps", "3", "--layers", "1", "--batch", "2", "--seq-len", "16",
           "--corpus-tokens", "5000", "--eval-batches", "1", "--sample-tokens", "0", "--log-file", str(log)]
    proc = subprocess.run(cmd, env=_cli_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "parallel: 2 ranks: 1 data-parallel x 2 expert-parallel" in proc.stdout, proc.stdout
    assert proc.stdout.count("done: 3 steps") == 1, proc.stdout  # rank 0 prints, rank 1 does not
    assert proc.stdout.count(f"log: {log}") == 1, proc.stdout
    doc = json.loads(log.read_text())
    assert len(doc["history"]) >= 1 and sorted(p.name for p in tmp_path.iterdir()) == ["ep.json"], doc.keys()
    # the summary's tokens/s counts both ranks' tokens, as the progress entries do
    rates = [p["tokens_per_s"] for p in doc["progress"] if p["seconds"] > 0]
    assert doc["summary"]["ranks"] == 2
    assert min(rates[1:] or rates) * 0.999 <= doc["summary"]["tokens_per_s"] <= max(rates[1:] or rates) * 1.001, doc


def test_train_ep_without_torchrun_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "blazecore", "train", "--ep", "2", "--device", "cpu"], env=_cli_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "needs torchrun" in proc.stderr, proc.stderr


def test_report_tables_of_the_ep_results():
    """bench/report.py's tables of the committed expert-parallel results: one line per JSON row or log, the
    figures as the files hold them, the per-GPU rate against the same implementation's one-GPU run."""
    import json

    from bench import report

    for path in sorted(report.RESULTS.glob("ep_*.json")):
        doc = json.loads(path.read_text())
        if report._kind(doc, path) == "ep_jax":
            lines = [ln for ln in report.ep_jax_table(doc).splitlines() if ln.startswith("| ") and "shape" not in ln]
            assert len(lines) == len(doc["rows"]), path
            for ln, r in zip(lines, doc["rows"], strict=True):
                cells = [c.strip() for c in ln.strip("|").split("|")]
                assert cells[0] == r["shape"] and int(cells[2]) == r["gpus"]
                assert cells[3] == r["exchange"] and cells[6] == f"{r['one_ms'] / r['ep_ms']:.2f}"
            continue
        lines = [ln for ln in report.ep_table(doc).splitlines() if ln.startswith("| ") and not ln.startswith("| local")]
        assert len(lines) == len(doc["rows"]), path
        for ln, r in zip(lines, doc["rows"], strict=True):
            cells = [c.strip() for c in ln.strip("|").split("|")]
            assert cells[0] == r.get("impl", "blazecore") and int(cells[1]) == r["gpus"]
            assert cells[3] == (r.get("exchange_mode") or "pairs" if r["exchange"] else "no")
            assert cells[6] == f"{r['tokens_per_s']:,.0f}"
            if r["gpus"] == 1 and not r["exchange"]:
                assert cells[8] == "1.00" and cells[4] == ""
    folders = [p for p in report.RESULTS.glob("train_ep_*") if p.is_dir()]
    for folder in folders:
        logs = sorted(folder.glob("*.json"))
        table = report.train_ep_table(logs)
        lines = [ln for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| ranks")]
        assert len(lines) == len(logs)
        rates = sorted(f"{json.loads(p.read_text())['summary']['tokens_per_s']:,.0f}" for p in logs)
        assert sorted(ln.split("|")[5].strip() for ln in lines) == rates
        assert any(ln.split("|")[6].strip() == "1.00" for ln in lines)
