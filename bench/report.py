"""Render the benchmark JSON in bench/results/ as markdown tables; --readme rewrites README's results sections.

    python bench/report.py            # print the tables
    python bench/report.py --readme   # replace the blocks between the README's results markers

The README holds one block per section, each between ``<!-- results:begin (bench/report.py[ SECTION]) -->``
and the next ``<!-- results:end -->``:

* the main block (no section): every result file except the token-scaling ones (shape tables, dispatch);
* ``scaling``: the token-scaling runs of ``python -m blazecore bench`` (header "bench": "moe_scaling"), a
  table of time and peak memory per token count and the plots bench/plot.py wrote beside the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BEGIN, END = "<!-- results:begin (bench/report.py) -->", "<!-- results:end -->"
SCALING = "moe_scaling"


def begin_marker(section: str = "") -> str:
    return f"<!-- results:begin (bench/report.py{' ' + section if section else ''}) -->"


def _header_line(h: dict) -> str:
    return f"{h.get('gpu')}, {h.get('date', '')[:10]}, commit {str(h.get('git_commit'))[:12]}, torch {h.get('torch')}"


def _opt(v, fmt: str) -> str:
    """``v`` formatted, or an empty cell for None."""
    return "" if v is None else format(v, fmt)


def _ratio(v) -> str:
    return "" if v is None else f"{v:.3f}"


def moe_table(doc: dict) -> str:
    rows = [r for r in doc["rows"] if r.get("status") == "ok"]
    gmm = {(r["shape"], r["tokens"]): r for r in rows if r["impl"] == "grouped_mm"}
    out = [f"MoE layer forward+backward, bf16 ({_header_line(doc['header'])}); held/peak relative to grouped_mm "
           "(blazecore[...]: the core; moe_ffn[...]: the PyTorch adapter with autograd; peak - grads: the peak minus "
           "the returned dx, dw13, dw2, dgates" + ("; adapter / core: moe_ffn's fwd+bwd time over the core's, the two "
                                                   "timed in alternation" if any("adapter_over_core" in r for r in rows)
                                                   else "") + "):", "",
           "| shape | tokens | impl | fwd+bwd ms | TFLOP/s | x vs grouped_mm | held MiB (%) | peak MiB (%) | "
           "peak - grads MiB (%) | adapter / core |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        g = gmm.get((r["shape"], r["tokens"]))
        held = f"{r['held_bytes'] / 2**20:.0f}" + (f" ({100 * r['held_bytes'] / g['held_bytes']:.1f}%)" if g else "")
        peak = f"{r['peak_bytes'] / 2**20:.0f}" + (f" ({100 * r['peak_bytes'] / g['peak_bytes']:.0f}%)" if g else "")
        beyond = ""
        if r.get("peak_beyond_grads_bytes") is not None:
            beyond = f"{r['peak_beyond_grads_bytes'] / 2**20:.0f}"
            if g and g.get("peak_beyond_grads_bytes"):
                beyond += f" ({100 * r['peak_beyond_grads_bytes'] / g['peak_beyond_grads_bytes']:.1f}%)"
        sp = r.get("speedup_vs_grouped_mm")
        out.append(f"| {r['shape']} | {r['tokens'] // 1024}k | {r['impl_key']} | {r['fwd_bwd_ms']:.2f} | "
                   f"{r['fwd_bwd_tflops']:.0f} | {'' if sp is None else f'{sp:.2f}'} | {held} | {peak} | {beyond} | "
                   f"{_ratio(r.get('adapter_over_core'))} |")
    return "\n".join(out)


def _ms(v) -> str:
    return "-" if v is None else f"{v:.2f}"


_GEMM_ORDERS = {"interleaved": "each round: blazecore's step, then grouped_mm's six, repeated",
                "blocks": "each round: blazecore's steps, then each grouped_mm GEMM back to back"}


def gemm_table(doc: dict) -> str:
    """bench_gemm.py: each GEMM against torch._grouped_mm pre-gathered, then the layer."""
    rows = doc["rows"]
    h = doc["header"]
    how = ""
    if h.get("clock"):
        how = (f"; kernel time by {'CUPTI' if h['clock'] == 'cupti' else 'CUDA events'}"
               + (f", timed after {h['warm_seconds']:g} s of load, medians of {h['rounds']} rounds"
                  if h.get("rounds") else "")
               + (f" ({_GEMM_ORDERS.get(h['order'], h['order'])})" if h.get("order") else ""))
    out = [f"The six expert GEMMs against torch._grouped_mm on the pre-gathered problem, bf16 "
           f"({_header_line(h)}{how}); TFLOP/s, ratio = blazecore / grouped_mm:", "",
           "| shape | tokens | " + " | ".join(("gemm1", "gemm2", "dh'", "dx", "dw13", "dw2")) + " |",
           "|---|---:|" + "---:|" * 6]
    names = ("gemm1", "gemm2", "dhcur", "dx", "dw13", "dw2")
    for key in sorted({(r["shape"], r["tokens"]) for r in rows}, key=lambda k: (k[0], k[1])):
        g = {r["gemm"]: r for r in rows if r["kind"] == "gemm" and (r["shape"], r["tokens"]) == key}
        cells = []
        for n in names:
            r = g.get(n)
            if r is None or r.get("blazecore_ms") is None:
                cells.append("-")
                continue
            cells.append(f"{r['blazecore_tflops']:.0f} vs {r['grouped_mm_tflops']:.0f} ({r['ratio']:.2f})")
        out.append(f"| {key[0]} | {key[1] // 1024}k | " + " | ".join(cells) + " |")
    layer = [r for r in rows if r["kind"] == "layer"]
    if any(r.get("blazecore_beside_six_ms") is not None for r in layer):
        # interleaved (the caption names the two layer ratios; files from before the step's kernel time show "-"
        # for it); the MoE ratio from the layer timed beside the grouped_mm MoE
        out += ["", "The layer's forward+backward through blazecore_torch.moe_ffn (\"ab\"): layer / six is its "
                    "CUDA-event time beside the six over the six's kernel time; step's kernels / six is the summed "
                    "kernel time of its step (GEMMs, combines, helpers) over the six's, both from the same rounds:",
                "", "| shape | tokens | moe_ffn fwd+bwd ms beside the six | six grouped_mm ms | layer / six | "
                    "step's kernels / six | moe_ffn ms beside the MoE | grouped_mm MoE ms | grouped_mm MoE / layer |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in layer:
            kern = r.get("step_kernels_over_six")
            out.append(f"| {r['shape']} | {r['tokens'] // 1024}k | {_ms(r.get('blazecore_beside_six_ms'))} | "
                       f"{r['six_grouped_mm_ms']:.2f} | {r['layer_over_six']:.2f} | "
                       f"{'-' if kern is None else f'{kern:.2f}'} | {r['blazecore_moe_ffn_ms']:.2f} | "
                       f"{r['grouped_mm_moe_ms']:.2f} | {r['grouped_mm_moe_over_layer']:.2f} |")
        other = [f"{r['shape']} {r['tokens'] // 1024}k" for r in layer if r.get("order", h["order"]) != h["order"]]
        if other:
            out += ["", f"Timed in the blocks order (out of GPU memory in the interleaved one): {', '.join(other)}."]
        return "\n".join(out)
    out += ["", "| shape | tokens | moe_ffn fwd+bwd ms | six grouped_mm ms | layer / six | grouped_mm MoE ms | "
                "grouped_mm MoE / layer |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in layer:
        out.append(f"| {r['shape']} | {r['tokens'] // 1024}k | {r['blazecore_moe_ffn_ms']:.2f} | "
                   f"{r['six_grouped_mm_ms']:.2f} | {r['layer_over_six']:.2f} | {r['grouped_mm_moe_ms']:.2f} | "
                   f"{r['grouped_mm_moe_over_layer']:.2f} |")
    return "\n".join(out)


def dispatch_table(doc: dict) -> str:
    rows = doc["rows"]
    head = f"Dispatch build vs the sort-based build ({_header_line(doc['header'])})"
    out = [f"{head}, min / median speedup over E and K:", "",
           "| tokens | blazecore ms (E=256, K=8) | conventional ms | speedup min | speedup median | graph min |",
           "|---:|---:|---:|---:|---:|---:|"]
    for L in sorted({r["L"] for r in rows}):
        rs = [r for r in rows if r["L"] == L]
        sp = sorted(r["speedup"] for r in rs)
        ref = next((r for r in rs if r["E"] == 256 and r["K"] == 8), rs[-1])
        out.append(f"| {L // 1024}k | {ref['blazecore_ms']:.3f} | {ref['conventional_ms']:.3f} | {sp[0]:.2f} | "
                   f"{sp[len(sp) // 2]:.2f} | {min(r['graph_speedup'] for r in rs):.2f} |")
    return "\n".join(out)


def host_table(doc: dict) -> str:
    h = doc["header"]
    out = [f"Host time of one forward+backward through moe_ffn (\"ab\", bf16; scripts/probe_host.py; "
           f"{_header_line(h)}, CPU {h.get('cpu')}): the host's ms a step with the GPU kept busy (median of "
           f"{h.get('repeats')} timings of {h.get('steps')} steps), and the steps back to back and as replays of the "
           "step captured in a CUDA graph:",
           "", "| shape | tokens | host ms | back-to-back ms | graph replay ms |", "|---|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        out.append(f"| {r['shape']} | {r['tokens'] // 1024}k | {r['host_ms']:.2f} | {r['eager_ms']:.2f} | "
                   f"{r['graph_ms']:.2f} |")
    return "\n".join(out)


def hf_table(doc: dict) -> str:
    h = doc["header"]
    out = [f"transformers MoE training steps, {h.get('dtype')}, {h.get('batch')} x {h.get('seq')} tokens per step, "
           f"{h.get('steps')} AdamW steps ({_header_line(h)}, transformers {h.get('transformers')}); peak = "
           "torch.cuda.max_memory_allocated per step after the first:", "",
           "| model | experts | step ms | x vs grouped_mm | peak GiB | peak vs grouped_mm | loss first -> last | "
           "max rel loss diff |", "|---|---|---:|---:|---:|---:|---|---:|"]
    for r in doc["rows"]:
        if r.get("status") != "ok":
            out.append(f"| {r['family']} | {r['impl']} | {r.get('status')} | | | | | |")
            continue
        sp, pv, ld = r.get("speedup_vs_baseline"), r.get("peak_vs_baseline"), r.get("loss_rel_diff_max")
        peak = r.get("steady_peak_bytes")
        out.append(f"| {r['family']} | {r['impl']} | {r['step_ms_median']:.1f} | {'' if sp is None else f'{sp:.2f}'} | "
                   f"{'' if peak is None else f'{peak / 2**30:.2f}'} | {'' if pv is None else f'{100 * pv:.1f}%'} | "
                   f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} | {'' if ld is None else f'{ld:.1e}'} |")
    return "\n".join(out)


def jax_table(doc: dict) -> str:
    """bench_jax.py: time and peak memory beyond the gradients of the JAX layer against the core ('-' where a row
    has no such figure: a run without memory measurements, a memory-only run's times)."""
    h = doc["header"]

    def f(v, fmt, scale=1.0):
        return "-" if v is None else format(v / scale, fmt)

    out = [f"JAX adapter (jitted forward+backward of blazecore_jax.moe_ffn, routing given) vs the core on CuPy arrays, "
           f"bf16 ({_header_line(h)}, jax {h.get('jax')}); peak - grads: the peak over one call beyond its inputs "
           "minus the returned dx, dw13, dw2, dgates, each row in a fresh process" +
           (" (jax: XLA's program buffers plus the core's peak inside the callbacks; BFC: the same call as XLA's BFC "
            "allocator counts it, remainders of reused chunks included)"
            if any("jax_xla_program_bytes" in r for r in doc["rows"]) else " (as XLA's BFC allocator counts it)") +
           ":", "",
           "| shape | tokens | checkpoint | core ms | jax ms | ratio | jax TFLOP/s | core peak - grads MiB | "
           "jax peak - grads MiB | peak ratio | BFC peak ratio | outputs |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in doc["rows"]:
        if r.get("status") != "ok":
            out.append(f"| {r['shape']} | {r['tokens'] // 1024}k | {r.get('checkpoint')} | {r.get('status')} "
                       "| | | | | | | | |")
            continue
        same = ("-" if r.get("check_ok") is None else
                "identical" if r.get("identical") else ("close" if r.get("check_ok") else "DIFFER"))
        out.append(f"| {r['shape']} | {r['tokens'] // 1024}k | {r['checkpoint']} | {f(r.get('core_ms'), '.2f')} | "
                   f"{f(r.get('jax_ms'), '.2f')} | {f(r.get('ratio'), '.3f')} | {f(r.get('jax_tflops'), '.0f')} | "
                   f"{f(r.get('core_peak_beyond_grads_bytes'), '.0f', 2**20)} | "
                   f"{f(r.get('jax_peak_beyond_grads_bytes'), '.0f', 2**20)} | {f(r.get('peak_ratio'), '.3f')} | "
                   f"{f(r.get('bfc_peak_ratio'), '.3f')} | {same} |")
    return "\n".join(out)


def scale_table(doc: dict) -> str:
    """bench_scale: the token count doubling until out of memory, blazecore with the chunk planner."""
    h, summ = doc["header"], doc.get("summary", {})
    out = [f"Largest token count on one GPU, blazecore with the chunk planner (policy and chunks chosen per L for 0.9 "
           f"of the free memory) against the baselines ({_header_line(h)}); predicted = blazecore.moe_memory; "
           "MoELayer[...] rows: the PyTorch layer with chunks=\"auto\" (router, top-k and experts, autograd), "
           "predicted = blazecore.layer.layer_memory:", "",
           "| impl | tokens | status | policy | chunks | fwd+bwd ms | TFLOP/s | peak GiB | predicted GiB | pred/meas | "
           "throughput vs 1 chunk |",
           "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    f = _opt
    for r in doc["rows"] + doc.get("compare", []) + doc.get("layer_rows", []):
        pk, pp = r.get("peak_bytes"), r.get("predicted_peak_bytes")
        out.append(f"| {r['impl']} | {_count(r['tokens'])} | {r['status']} | {r.get('checkpoint') or ''} | "
                   f"{r.get('chunks') or ''} | {f(r.get('fwd_bwd_ms'), '.1f')} | {f(r.get('fwd_bwd_tflops'), '.0f')} | "
                   f"{f(pk and pk / 2**30, '.2f')} | {f(pp and pp / 2**30, '.2f')} | {f(r.get('peak_ratio'), '.3f')} | "
                   f"{f(r.get('throughput_vs_unchunked'), '.3f')} |")
    if summ:
        out += ["", "Summary: " + "; ".join(f"{k} = {v}" for k, v in summ.items())]
    return "\n".join(out)


def _exchange_mode(r: dict) -> str:
    """An ep row's exchange: "no", "tokens" or "pairs" (rows written before the layer had two exchanges sent pairs)."""
    if not r["exchange"]:
        return "no"
    return r.get("exchange_mode") or "pairs"


def _ep_input_grad(r: dict) -> bool:
    """Whether an ep row's step included the input's gradient: recorded since it does; the rows written before the
    field (those without ``exchange_mode``, from before the layer had two exchanges) were timed without it."""
    return r.get("input_grad", "exchange_mode" in r)


def ep_table(doc: dict) -> str:
    """bench_ep: weak scaling of the expert-parallel layer, the local experts on moe_ffn and on the grouped_mm MoE."""
    h, rows = doc["header"], doc["rows"]
    grads = {_ep_input_grad(r) for r in rows}
    grad = ("the input's gradient included" if grads == {True} else "without the input's gradient" if grads == {False}
            else "some rows with the input's gradient")
    shapes = ", ".join(dict.fromkeys(f"{r['shape']} (d={r['d']}, h={r['h']}, E={r['E']}, K={r['K']})" for r in rows))
    out = [f"Expert-parallel layer (`ExpertParallelMoELayer`: router, all-to-all of rows and gates, local experts, "
           f"return, combine), forward+backward ({grad}), bf16, {shapes}, tokens per GPU fixed "
           f"({_header_line(h)}); one torchrun per GPU count; exchange: \"no\" (one GPU, no all-to-all), "
           "\"tokens\" (each token sent once to every rank that holds one of its experts) or \"pairs\" (one row "
           "per (token, expert) pair), with one GPU against the group of one; rows/token: the rows a token sent; "
           "NCCL share: the largest rank's share of the step in NCCL's kernels (PyTorch profiler); per-GPU rate "
           "against the same implementation's one-GPU run "
           "without exchange:", "",
           "| local experts | GPUs | tokens/GPU | exchange | rows/token | step ms | tokens/s | tokens/s/GPU | "
           "vs 1 GPU | peak GiB/GPU | NCCL share |",
           "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    f = _opt
    base = {r.get("impl", "blazecore"): r["tokens_per_s_per_gpu"] for r in rows if r["gpus"] == 1 and not r["exchange"]}
    for r in rows:
        impl = r.get("impl", "blazecore")
        pk = r.get("peak_bytes_per_gpu")
        rel = r["tokens_per_s_per_gpu"] / base[impl] if impl in base else None
        per_token = r.get("rows_sent_per_token")
        if per_token is None and _exchange_mode(r) == "pairs":
            per_token = float(r["K"])
        out.append(f"| {impl} | {r['gpus']} | {_count(r['tokens_per_gpu'])} | {_exchange_mode(r)} | "
                   f"{f(per_token, '.2f')} | {r['step_ms']:.2f} | {r['tokens_per_s']:,.0f} | "
                   f"{r['tokens_per_s_per_gpu']:,.0f} | {f(rel, '.2f')} | {f(pk and pk / 2**30, '.2f')} | "
                   f"{f(r.get('nccl_share'), '.2f')} |")
    return "\n".join(out)


def ep_jax_table(doc: dict) -> str:
    """bench_ep_jax.py: the JAX expert-parallel layer on N GPUs against the one-GPU layer at the same tokens a GPU."""
    h = doc["header"]
    out = [f"JAX expert parallelism (`ep_moe_layer` over a ({h.get('gpus')},) \"ep\" mesh, jitted loss and gradients "
           f"of x and every parameter) against the one-GPU `moe_layer` at the same tokens a GPU, bf16 "
           f"({_header_line(h)}, jax {h.get('jax')}); medians of the wall clock; rows: the most pairs a GPU's experts "
           "receive against the rows of its static exchange buffer (padded: N * L * K pairs; gather: the N * L "
           "all-gathered tokens):", "",
           "| shape | tokens / GPU | GPUs | exchange | ep ms | one-GPU ms | per-GPU rate | rows received "
           "| buffer rows |",
           "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        out.append(f"| {r['shape']} | {_count(r['tokens_per_gpu'])} | {r['gpus']} | {r.get('exchange', 'ragged')} | "
                   f"{r['ep_ms']:.2f} | {r['one_ms']:.2f} | {r['per_gpu_rate']:.2f} | {r['routed_rows_per_gpu']} | "
                   f"{_ep_jax_buffer_rows(r)} |")
    return "\n".join(out)


def _ep_jax_buffer_rows(r: dict) -> int:
    """A row's exchange buffer: the gather exchange's is its N * L all-gathered tokens (files before the field
    followed the exchange recorded N * L * K for every row), the others' the recorded N * L * K pairs."""
    if r.get("exchange") == "gather":
        return r["gpus"] * r["tokens_per_gpu"]
    return r["buffer_rows_per_gpu"]


def train_ep_table(paths: list) -> str:
    """``train`` logs of one model on 1 GPU and under torchrun with expert parallelism (``--ep``), from one
    machine: global tokens/s against the one-rank run, losses and peak memory per rank."""
    docs = sorted((json.loads(p.read_text()) for p in paths),
                  key=lambda d: (d["summary"].get("ranks", 1), d["config"]["batch"]))
    first = docs[0]
    c = first["config"]
    model = (f"d={c['d_model']}, {c.get('n_layers', c.get('layers'))} layers, E={c['num_experts']}, "
             f"K={c['top_k']}, h={c['expert_hidden']}, {c['steps']} steps, seed {c['seed']}")
    one = next((d["summary"]["tokens_per_s"] for d in docs if d["summary"].get("ranks", 1) == 1), None)
    out = [f"`train` on one GPU and under torchrun with `--ep` ({first['device_name']}, "
           f"{str(first.get('date', ''))[:10]}, commit {str(first.get('git_commit'))[:12]}, torch {first['torch']}; "
           f"{model}; tokens/s counts every rank, without the first interval):", "",
           "| ranks | expert-parallel | batch a rank | tokens a step | tokens/s | vs 1 GPU | final train loss | "
           "final validation loss | peak GiB a rank |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for d in docs:
        cf, sm = d["config"], d["summary"]
        ranks = sm.get("ranks", 1)
        rate = sm["tokens_per_s"]
        rel = "" if one is None or rate is None else f"{rate / one:.2f}"
        out.append(f"| {ranks} | {cf['ep']} | {cf['batch']} | {cf['batch'] * cf['seq_len'] * ranks:,} | "
                   f"{rate:,.0f} | {rel} | {sm['final_loss']:.3f} | {sm['val_final']:.3f} | "
                   f"{sm['peak_memory_bytes'] / 2**30:.2f} |")
    return "\n".join(out)


def train_section() -> str:
    """The GPU train comparison (scripts/gpu_train_compare.py) under bench/results/train_*/."""
    parts = []
    for cmp_path in sorted(RESULTS.glob("train_*/compare.json")):
        doc = json.loads(cmp_path.read_text())
        rel = cmp_path.parent.relative_to(ROOT).as_posix()
        lines = [f"`{rel}/compare.json` (`python scripts/gpu_train_compare.py {rel}`)", "", "| check | result |",
                 "|---|---|"]
        for c in doc.get("checks", []):
            lines.append(f"| {c.get('check')} | {'ok' if c.get('ok') else 'FAIL'}: {c.get('detail', '')} |")
        png = cmp_path.parent / "loss_curves.png"
        if png.exists():
            lines += ["", f"![train loss curves, blazecore vs conventional MoE]({rel}/loss_curves.png)"]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def _mib_or_gib(n: float | None) -> str:
    if n is None:  # a CPU smoke run measures no memory
        return "-"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _count(n: int) -> str:
    return f"{n >> 20}m" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}k" if n % 1024 == 0 else str(n)


def scaling_table(doc: dict, path: Path) -> str:
    """Tokens down, implementations across: fwd+bwd ms and peak memory, OOM where it did not fit; the plots."""
    rows = doc["rows"]
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        srows = [r for r in rows if r["shape"] == shape]
        keys = list(dict.fromkeys(r["impl_key"] for r in srows))
        cells: dict = {}
        for r in srows:
            if r.get("status") == "ok":
                cells[(r["tokens"], r["impl_key"])] = f"{r['fwd_bwd_ms']:.2f} ms / {_mib_or_gib(r['peak_bytes'])}"
            elif r.get("status") == "oom":
                cells[(r["tokens"], r["impl_key"])] = "OOM"
        for r in doc.get("largest", []):
            if r["shape"] == shape and r.get("status") == "ok" and r.get("peak_bytes") is not None:
                cells.setdefault((r["tokens"], r["impl_key"]), f"- / {_mib_or_gib(r['peak_bytes'])}")
        for r in doc.get("stopped", []):
            if r["shape"] == shape:
                cells.setdefault((r["tokens"], r["impl_key"]), r["status"].upper())
        r0 = srows[0]
        out += [f"MoE layer forward+backward vs tokens, {shape} (d={r0['d']}, h={r0['h']}, E={r0['E']}, K={r0['K']}), "
                f"bf16 ({_header_line(doc['header'])}): median fwd+bwd ms / peak memory; '-' ms: memory-only run "
                "of the search for the largest count that fits, OOM: out of memory", "",
                "| tokens | " + " | ".join(keys) + " |", "|---:|" + "---:|" * len(keys)]
        for L in sorted({t for t, _ in cells}):
            out.append(f"| {_count(L)} | " + " | ".join(cells.get((L, k), "") for k in keys) + " |")
        plots = path.parent / "plots"
        for kind in ("time", "memory"):
            png = plots / f"{path.stem}_{shape}_{kind}.png"
            if png.exists():
                out += ["", f"![{shape}: forward+backward {kind} vs tokens]({png.relative_to(ROOT).as_posix()})"]
        out.append("")
    return "\n".join(out).rstrip()


def _kind(doc: dict, path: Path) -> str:
    return doc.get("header", {}).get("bench") or path.stem.split("_")[0]


def render(section: str = "") -> str:
    """Markdown of the result files of ``section`` ("" for the main block, "scaling")."""
    parts = []
    for path in sorted(RESULTS.glob("*.json")):
        doc = json.loads(path.read_text())
        kind = _kind(doc, path)
        if (kind == SCALING) != (section == "scaling"):
            continue
        table = {"moe": moe_table, "gemm": gemm_table, "dispatch": dispatch_table, "hf": hf_table, "jax": jax_table,
                 "scale": scale_table, "host": host_table, "ep": ep_table, "ep_jax": ep_jax_table}.get(kind)
        if kind == SCALING:
            parts.append(f"`{path.relative_to(ROOT)}`\n\n{scaling_table(doc, path)}")
        elif table:
            parts.append(f"`{path.relative_to(ROOT)}`\n\n{table(doc)}")
    if section != "scaling":
        for folder in sorted(p for p in RESULTS.glob("train_ep_*") if p.is_dir()):
            logs = sorted(folder.glob("*.json"))
            if logs:
                parts.append(f"`{folder.relative_to(ROOT).as_posix()}/`\n\n{train_ep_table(logs)}")
    if section == "scaling" and train_section():
        parts.append(train_section())
    if parts:
        return "\n\n".join(parts)
    if section == "scaling":
        return "No results yet: on a GPU, `python -m blazecore bench --readme` measures them and fills this section."
    return "No results yet."


SECTIONS = ("", "scaling")


def rewrite_readme(text: str) -> tuple[str, list]:
    """``text`` with every known block regenerated; returns (new text, sections found)."""
    found = []
    for section in SECTIONS:
        begin = begin_marker(section)
        if begin not in text:
            continue
        head, rest = text.split(begin, 1)
        if END not in rest:
            raise ValueError(f"README.md: {begin} has no {END}")
        _, tail = rest.split(END, 1)
        text = f"{head}{begin}\n{render(section)}\n{END}{tail}"
        found.append(section or "main")
    return text, found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--readme", action="store_true", help="rewrite the README's results blocks")
    args = ap.parse_args(argv)
    if not args.readme:
        print("\n\n".join(render(section) for section in SECTIONS))
        return 0
    readme = ROOT / "README.md"
    text, found = rewrite_readme(readme.read_text())
    if not found:
        print(f"README.md has no {BEGIN} ... {END} block", file=sys.stderr)
        return 1
    readme.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
