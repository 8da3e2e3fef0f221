"""Plots of a token-scaling run of the MoE layer benchmark (``python -m blazecore bench``), with matplotlib.

For each shape in the JSON, two PNGs in ``<results dir>/plots/``:

* ``<stem>_<shape>_time.png``: forward+backward ms against tokens, one line per implementation;
* ``<stem>_<shape>_memory.png``: peak memory against tokens (the timed counts and the memory-only counts
  of the out-of-memory search), with the GPU's memory as a dashed line.

Where an implementation ran out of memory, both plots mark the token count with an "x" labelled OOM
(on the time plot at the top edge, on the memory plot at the GPU's memory). Nothing is typed by hand:
every point comes from the JSON.

    python bench/plot.py bench/results/moe_scaling_h200.json     # needs matplotlib (pip install -e '.[plot]')
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

try:
    from . import _common as common
except ImportError:  # run as a script: python bench/plot.py
    import _common as common

COLORS = {"blazecore[ab]": "#d62728", "blazecore[none]": "#ff7f0e", "conventional": "#1f77b4",
          "grouped_mm": "#2ca02c"}
LABELS = {"blazecore[ab]": "blazecore (checkpoint ab)", "blazecore[none]": "blazecore (checkpoint none)",
          "conventional": "conventional PyTorch MoE", "grouped_mm": "torch._grouped_mm MoE"}
GIB = float(1 << 30)


def _series(doc: dict, shape: str) -> dict:
    """Per impl_key: {"time": [(L, ms)], "memory": [(L, bytes)], "oom": first L that did not fit or None}."""
    out: dict = {}

    def entry(key):
        return out.setdefault(key, {"time": {}, "memory": {}, "oom": None})

    for r in doc.get("rows", []):
        if r.get("shape") != shape:
            continue
        e = entry(r["impl_key"])
        if r.get("status") == "ok":
            if r.get("fwd_bwd_ms") is not None:
                e["time"][r["tokens"]] = r["fwd_bwd_ms"]
            if r.get("peak_bytes") is not None:
                e["memory"][r["tokens"]] = r["peak_bytes"]
        elif r.get("status") == "oom":
            e["oom"] = r["tokens"] if e["oom"] is None else min(e["oom"], r["tokens"])
    for r in doc.get("largest", []):
        if r.get("shape") == shape and r.get("status") == "ok" and r.get("peak_bytes") is not None:
            entry(r["impl_key"])["memory"].setdefault(r["tokens"], r["peak_bytes"])
    for r in doc.get("stopped", []):
        if r.get("shape") == shape and r.get("status") == "oom":
            e = entry(r["impl_key"])
            e["oom"] = r["tokens"] if e["oom"] is None else min(e["oom"], r["tokens"])
    return {k: {"time": sorted(v["time"].items()), "memory": sorted(v["memory"].items()), "oom": v["oom"]}
            for k, v in out.items()}


def _shapes(doc: dict) -> list:
    seen = []
    for r in doc.get("rows", []):
        if r.get("shape") not in seen:
            seen.append(r.get("shape"))
    return seen


def _shape_title(doc: dict, shape: str) -> str:
    r = next(r for r in doc["rows"] if r.get("shape") == shape)
    return f"{shape} (d={r['d']}, h={r['h']}, E={r['E']}, K={r['K']}), {r.get('dtype', 'bfloat16')}"


def _footer(header: dict) -> str:
    commit = str(header.get("git_commit"))[:10]
    return f"{header.get('gpu')}, {str(header.get('date', ''))[:10]}, commit {commit}, torch {header.get('torch')}"


def plot_doc(doc: dict, out_dir: pathlib.Path, stem: str) -> list:
    """Write the two PNGs of every shape in ``doc``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator
    from matplotlib.transforms import offset_copy

    out_dir.mkdir(parents=True, exist_ok=True)
    header = doc.get("header", {})
    capacity = header.get("gpu_memory_bytes")
    paths = []
    for shape in _shapes(doc):
        series = _series(doc, shape)
        order = [k for k in COLORS if k in series] + sorted(k for k in series if k not in COLORS)
        for kind in ("time", "memory"):
            fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=130)
            ticks = set()
            ooms = 0
            for key in order:
                pts = series[key][kind]
                color = COLORS.get(key)
                if pts:
                    xs = [p[0] for p in pts]
                    ys = [p[1] if kind == "time" else p[1] / GIB for p in pts]
                    ax.plot(xs, ys, marker="o", ms=4, lw=1.8, color=color, label=LABELS.get(key, key))
                    ticks.update(xs)
                oom = series[key]["oom"]
                if oom is not None:
                    ticks.add(oom)
                    if kind == "memory" and capacity:
                        y, transform = capacity / GIB, ax.transData
                    else:
                        y, transform = 0.96, ax.get_xaxis_transform()
                    # several implementations out of memory at one count: stacked 13 points apart
                    transform = offset_copy(transform, fig=fig, y=-13 * ooms, units="points")
                    ooms += 1
                    ax.plot([oom], [y], marker="X", ms=9, color=color, transform=transform, ls="none",
                            label=f"{LABELS.get(key, key)}: out of memory at {common.format_count(oom)}")
                    ax.annotate("OOM", (oom, y), xycoords=transform, textcoords="offset points", xytext=(7, -3),
                                color=color, fontsize=7)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            if kind == "memory" and capacity:
                ax.axhline(capacity / GIB, color="0.4", ls="--", lw=1)
                ax.annotate(f"GPU memory {capacity / GIB:.0f} GiB", (0.01, capacity / GIB),
                            xycoords=("axes fraction", "data"), textcoords="offset points", xytext=(0, 4),
                            fontsize=8, color="0.3")
                ax.set_ylim(top=capacity / GIB * 1.8)
            if ticks:
                # OOM markers are drawn through offset transforms, which do not widen the data limits
                ax.set_xlim(min(ticks) / 1.4, max(ticks) * 1.4)
                ax.xaxis.set_major_locator(FixedLocator(sorted(ticks)))
                ax.xaxis.set_minor_locator(NullLocator())
                ax.set_xticklabels([common.format_count(t) for t in sorted(ticks)])
            ax.set_xlabel("tokens (L)")
            ax.set_ylabel("forward + backward, ms" if kind == "time" else "peak memory, GiB")
            what = "time" if kind == "time" else "peak memory"
            ax.set_title(f"MoE layer forward+backward {what}: {_shape_title(doc, shape)}", fontsize=10)
            ax.grid(True, which="major", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, loc="lower right")
            fig.text(0.99, 0.01, _footer(header), ha="right", va="bottom", fontsize=7, color="0.4")
            fig.tight_layout(rect=(0, 0.03, 1, 1))
            path = out_dir / f"{stem}_{shape}_{kind}.png"
            fig.savefig(path)
            plt.close(fig)
            paths.append(path)
    return paths


def plot_dir(json_path: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(json_path).parent / "plots"


def plot_file(json_path) -> list:
    """Plots of one results JSON, written to ``plots/`` beside it; returns the PNG paths."""
    json_path = pathlib.Path(json_path)
    doc = json.loads(json_path.read_text())
    return plot_doc(doc, plot_dir(json_path), json_path.stem)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", help="results JSON of bench_moe.py (a --largest run shows the OOM points)")
    args = ap.parse_args(argv)
    for j in args.json:
        for p in plot_file(j):
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
