"""Render the benchmark JSON in bench/results/ as markdown tables; --readme rewrites README's results section.

    python bench/report.py            # print the tables
    python bench/report.py --readme   # replace the block between the README's results markers
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BEGIN, END = "<!-- results:begin (bench/report.py) -->", "<!-- results:end -->"


def _header_line(h: dict) -> str:
    return f"{h.get('gpu')}, {h.get('date', '')[:10]}, commit {str(h.get('git_commit'))[:12]}, torch {h.get('torch')}"


def moe_table(doc: dict) -> str:
    rows = [r for r in doc["rows"] if r.get("status") == "ok"]
    gmm = {(r["shape"], r["tokens"]): r for r in rows if r["impl"] == "grouped_mm"}
    out = [f"MoE layer forward+backward, bf16 ({_header_line(doc['header'])}); held/peak relative to grouped_mm:", "",
           "| shape | tokens | impl | fwd+bwd ms | TFLOP/s | x vs grouped_mm | held MiB (%) | peak MiB (%) |",
           "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        g = gmm.get((r["shape"], r["tokens"]))
        held = f"{r['held_bytes'] / 2**20:.0f}" + (f" ({100 * r['held_bytes'] / g['held_bytes']:.1f}%)" if g else "")
        peak = f"{r['peak_bytes'] / 2**20:.0f}" + (f" ({100 * r['peak_bytes'] / g['peak_bytes']:.0f}%)" if g else "")
        sp = r.get("speedup_vs_grouped_mm")
        out.append(f"| {r['shape']} | {r['tokens'] // 1024}k | {r['impl_key']} | {r['fwd_bwd_ms']:.2f} | "
                   f"{r['fwd_bwd_tflops']:.0f} | {'' if sp is None else f'{sp:.2f}'} | {held} | {peak} |")
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
    h = doc["header"]
    out = [f"JAX adapter (jitted forward+backward of blazecore_jax.moe_ffn, routing given) vs the core on CuPy arrays, "
           f"bf16 ({_header_line(h)}, jax {h.get('jax')}):", "",
           "| shape | tokens | checkpoint | core ms | jax ms | ratio | jax TFLOP/s | outputs |",
           "|---|---:|---|---:|---:|---:|---:|---|"]
    for r in doc["rows"]:
        if r.get("status") != "ok":
            out.append(f"| {r['shape']} | {r['tokens'] // 1024}k | {r.get('checkpoint')} | {r.get('status')} | | | | |")
            continue
        same = "identical" if r.get("identical") else ("close" if r.get("check_ok") else "DIFFER")
        out.append(f"| {r['shape']} | {r['tokens'] // 1024}k | {r['checkpoint']} | {r['core_ms']:.2f} | "
                   f"{r['jax_ms']:.2f} | {r['ratio']:.3f} | {r['jax_tflops']:.0f} | {same} |")
    return "\n".join(out)


def render() -> str:
    parts = []
    for path in sorted(RESULTS.glob("*.json")):
        doc = json.loads(path.read_text())
        kind = doc.get("header", {}).get("bench") or path.stem.split("_")[0]
        table = {"moe": moe_table, "dispatch": dispatch_table, "hf": hf_table, "jax": jax_table}.get(kind)
        if table:
            parts.append(f"`{path.relative_to(ROOT)}`\n\n{table(doc)}")
    return "\n\n".join(parts) if parts else "No results yet."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--readme", action="store_true", help="rewrite the README's results block")
    args = ap.parse_args(argv)
    text = render()
    if not args.readme:
        print(text)
        return 0
    readme = ROOT / "README.md"
    s = readme.read_text()
    if BEGIN not in s or END not in s:
        print(f"README.md has no {BEGIN} ... {END} block", file=sys.stderr)
        return 1
    head, rest = s.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
