#!/usr/bin/env python3
"""Train the same model with blazecore's MoE layers and with the conventional PyTorch MoE, and compare.

    python scripts/gpu_train_compare.py OUT_DIR [options] [-- train options]

Runs ``python -m blazecore train`` twice on the GPU with the same seed (same initial weights, same
batches), once as is and once with ``--baseline`` (the conventional MoE; ``--baseline grouped_mm`` for torch's
grouped GEMM MoE), each in its own process (so each peak-memory figure
is its own), and writes to OUT_DIR:

    blazecore.json, baseline.json    the two loss logs (``train --log``)
    blazecore.out, baseline.out      their console output
    compare.json                     the figures below and every check with its verdict
    loss_curves.png                  both loss curves and their difference (needs matplotlib)

Checks (the exit status is 1 if any fails, 2 if a run fails; nothing passes by default):
    same setup       the two logs have the same configuration but for the MoE implementation, and the
                     same initial-weights checksum;
    on a GPU         both ran on CUDA (--allow-cpu turns this and the memory check into notes, for trying
                     the script on a CPU machine: such a run is never a GPU verdict);
    first step       the first losses agree within --start-rtol (same weights, same batch: only rounding);
    curves           moving means (window --window) agree within --curve-rtol at every step after the
                     first window, and the means of the last 10% of steps within --final-rtol;
    trained          both final losses are below --max-final-ratio x the first loss;
    memory           blazecore's peak (torch.cuda.max_memory_allocated) is below the baseline's times
                     --max-memory-ratio (default 1: strictly lower).
Tokens/s of each run and the ratio are reported; --min-speedup makes the ratio a check too.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNS = {"blazecore": [], "baseline": ["--baseline"]}


def _env() -> dict:
    """The caller's environment, with this checkout (its library, adapters and application) importable."""
    env = dict(os.environ)
    parts = [str(ROOT), str(ROOT / "adapters"), str(ROOT / "app")]
    parts += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_training(name: str, out_dir: pathlib.Path, common: list, baseline: str = "conventional"
                 ) -> tuple[int, pathlib.Path]:
    """Run one training, its output shown and saved to <name>.out; returns (exit status, log path)."""
    log = out_dir / f"{name}.json"
    if log.exists():
        log.unlink()
    impl = [*RUNS[name], baseline] if name == "baseline" else RUNS[name]
    cmd = [sys.executable, "-m", "blazecore", "train", "--log", str(log), *impl, *common]
    print(f"\n$ {' '.join(cmd)}", flush=True)
    with open(out_dir / f"{name}.out", "w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                                cwd=ROOT)
        for line in proc.stdout:
            sys.stdout.write(line)
            out.write(line)
        rc = proc.wait()
    return rc, log


# ---------------------------------------------------------------------------------------------
# The comparison (pure functions of the two logs)
# ---------------------------------------------------------------------------------------------


def moving_mean(values: list, window: int) -> list:
    """Trailing mean over ``window`` values (fewer at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _setup(doc: dict) -> dict:
    ignore = {"impl", "log", "ckpt_dir", "resume", "stop_at", "checkpoint_policy"}
    return {k: v for k, v in doc["config"].items() if k not in ignore}


def compare(ours: dict, base: dict, *, start_rtol: float = 0.01, curve_rtol: float = 0.08, final_rtol: float = 0.03,
            max_final_ratio: float = 0.7, max_memory_ratio: float = 1.0, min_speedup: float | None = None,
            window: int | None = None, allow_cpu: bool = False) -> dict:
    """Figures and checks of a blazecore log ``ours`` against a baseline log ``base`` (``train --log``)."""
    checks = []

    def check(name: str, ok: bool | None, detail: str) -> None:
        checks.append({"check": name, "ok": ok, "detail": detail})  # ok None: a note, not a verdict

    a = [h["lm_loss"] for h in ours.get("history", [])]
    b = [h["lm_loss"] for h in base.get("history", [])]
    n = min(len(a), len(b))
    diff_setup = sorted(k for k in set(_setup(ours)) | set(_setup(base)) if _setup(ours).get(k) != _setup(base).get(k))
    check("same setup", not diff_setup and len(a) == len(b) and n > 0,
          f"{n} steps each" if not diff_setup else f"configurations differ in {', '.join(diff_setup)}")
    check("same initial weights", ours.get("init_sha256") == base.get("init_sha256"),
          f"init sha256 {str(ours.get('init_sha256'))[:12]} vs {str(base.get('init_sha256'))[:12]}")
    check("implementations", ours.get("impl") == "blazecore" and base.get("impl") != "blazecore",
          f"{ours.get('impl')} vs {base.get('impl')}")
    on_gpu = ours.get("device", "").startswith("cuda") and base.get("device", "").startswith("cuda")
    check("on a GPU", True if on_gpu else (None if allow_cpu else False),
          f"{ours.get('device_name')} / {base.get('device_name')}" + ("" if on_gpu else " (not CUDA)"))

    figures: dict = {"steps": n}
    if n:
        w = window or max(5, n // 20)
        sa, sb = moving_mean(a[:n], w), moving_mean(b[:n], w)
        rel = [abs(x - y) / abs(y) for x, y in zip(sa, sb, strict=True)][w:]
        tail = max(1, n // 10)
        fa, fb = sum(a[n - tail : n]) / tail, sum(b[n - tail : n]) / tail
        noise = [abs(x - s) for x, s in zip(b[:n], sb, strict=True)][w:]
        figures.update({
            "window": w, "first_loss_blazecore": a[0], "first_loss_baseline": b[0],
            "first_loss_rel_diff": abs(a[0] - b[0]) / abs(b[0]),
            "final_loss_blazecore": fa, "final_loss_baseline": fb, "final_window": tail,
            "final_loss_diff": fa - fb, "final_loss_rel_diff": abs(fa - fb) / abs(fb),
            "mean_loss_blazecore": sum(a[:n]) / n, "mean_loss_baseline": sum(b[:n]) / n,
            "mean_loss_diff": (sum(a[:n]) - sum(b[:n])) / n,
            "max_smoothed_rel_diff": max(rel) if rel else 0.0,
            "baseline_step_noise": sum(noise) / len(noise) if noise else None,
            "val_final_blazecore": ours.get("summary", {}).get("val_final"),
            "val_final_baseline": base.get("summary", {}).get("val_final"),
        })
        check("first step", figures["first_loss_rel_diff"] <= start_rtol,
              f"{a[0]:.4f} vs {b[0]:.4f} (rel {figures['first_loss_rel_diff']:.1e}, limit {start_rtol:g})")
        check("curves", figures["max_smoothed_rel_diff"] <= curve_rtol,
              f"max rel difference of the {w}-step moving means {figures['max_smoothed_rel_diff']:.3f} "
              f"(limit {curve_rtol:g})")
        check("final loss", figures["final_loss_rel_diff"] <= final_rtol,
              f"{fa:.4f} vs {fb:.4f} over the last {tail} steps (rel {figures['final_loss_rel_diff']:.3f}, "
              f"limit {final_rtol:g})")
        check("trained", fa < max_final_ratio * a[0] and fb < max_final_ratio * b[0],
              f"final / first: {fa / a[0]:.2f} and {fb / b[0]:.2f} (limit {max_final_ratio:g})")

    sa_, sb_ = ours.get("summary", {}), base.get("summary", {})
    ma, mb = sa_.get("peak_memory_bytes"), sb_.get("peak_memory_bytes")
    figures.update({"peak_memory_bytes_blazecore": ma, "peak_memory_bytes_baseline": mb,
                    "resident_memory_bytes_blazecore": sa_.get("resident_memory_bytes"),
                    "resident_memory_bytes_baseline": sb_.get("resident_memory_bytes"),
                    "memory_kind": sa_.get("memory_kind")})
    if ma and mb:
        figures["peak_memory_ratio"] = ma / mb
        ok = ma < mb * max_memory_ratio
        check("memory", ok if on_gpu else None,
              f"peak {ma / 2**30:.2f} GiB vs {mb / 2**30:.2f} GiB (ratio {ma / mb:.2f}, limit < {max_memory_ratio:g})"
              + ("" if on_gpu else "; process RSS on the CPU, not a verdict"))
    else:
        check("memory", None if allow_cpu and not on_gpu else False, "peak memory missing from a log")
    ta, tb = sa_.get("tokens_per_s"), sb_.get("tokens_per_s")
    figures.update({"tokens_per_s_blazecore": ta, "tokens_per_s_baseline": tb,
                    "speedup": ta / tb if ta and tb else None,
                    "wall_s_blazecore": sa_.get("wall_s"), "wall_s_baseline": sb_.get("wall_s")})
    if min_speedup is not None:
        check("speed", bool(figures["speedup"]) and figures["speedup"] >= min_speedup,
              f"tokens/s ratio {figures['speedup']} (limit >= {min_speedup:g})")
    failed = [c["check"] for c in checks if c["ok"] is False]
    return {"ok": not failed, "failed": failed, "gpu_verdict": on_gpu, "figures": figures, "checks": checks}


def plot(ours: dict, base: dict, result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = [h["lm_loss"] for h in ours["history"]]
    b = [h["lm_loss"] for h in base["history"]]
    n = min(len(a), len(b))
    f = result["figures"]
    w = f.get("window", 5)
    steps = [h["step"] for h in ours["history"][:n]]
    sa, sb = moving_mean(a[:n], w), moving_mean(b[:n], w)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), dpi=130, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    # the baseline first, blazecore dashed on top: where the curves coincide both stay visible
    for vals, smooth, label, color, ls in ((b, sb, f"baseline ({base['impl']})", "#1f77b4", "-"),
                                           (a, sa, "blazecore", "#d62728", "--")):
        ax.plot(steps, vals[:n], color=color, alpha=0.25, lw=0.8)
        ax.plot(steps, smooth, color=color, lw=1.8, ls=ls, label=f"{label} ({w}-step mean)")
    ax.set_ylabel("training loss (cross-entropy, nats)")
    mem = ""
    if f.get("peak_memory_bytes_blazecore") and f.get("peak_memory_bytes_baseline"):
        mem = (f"peak memory {f['peak_memory_bytes_blazecore'] / 2**30:.2f} vs "
               f"{f['peak_memory_bytes_baseline'] / 2**30:.2f} GiB")
    speed = ""
    if f.get("tokens_per_s_blazecore") and f.get("tokens_per_s_baseline"):
        speed = f"; {f['tokens_per_s_blazecore'] / 1e3:.0f}k vs {f['tokens_per_s_baseline'] / 1e3:.0f}k tokens/s"
    ax.set_title(f"{ours.get('device_name')}: blazecore vs {base['impl']} MoE, same seed\n{mem}{speed}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax2.plot(steps, [x - y for x, y in zip(sa, sb, strict=True)], color="0.2", lw=1.2)
    ax2.axhline(0, color="0.5", lw=0.8)
    ax2.set_ylabel("difference")
    ax2.set_xlabel("step")
    ax2.grid(alpha=0.3)
    verdict = "all checks pass" if result["ok"] else "FAILED: " + ", ".join(result["failed"])
    fig.text(0.99, 0.005, verdict, ha="right", va="bottom", fontsize=7, color="0.3" if result["ok"] else "red")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, train_args = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Options after -- go to both `blazecore train` runs.")
    ap.add_argument("out_dir", type=pathlib.Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", choices=("conventional", "grouped_mm"), default="conventional",
                    help="the PyTorch MoE to compare with (train --baseline ...)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: the GPU preset)")
    ap.add_argument("--start-rtol", type=float, default=0.01)
    ap.add_argument("--curve-rtol", type=float, default=0.08)
    ap.add_argument("--final-rtol", type=float, default=0.03)
    ap.add_argument("--max-final-ratio", type=float, default=0.7)
    ap.add_argument("--max-memory-ratio", type=float, default=1.0)
    ap.add_argument("--min-speedup", type=float, default=None)
    ap.add_argument("--window", type=int, default=None, help="moving-mean window (default max(5, steps / 20))")
    ap.add_argument("--allow-cpu", action="store_true",
                    help="run without a GPU (to try the script): GPU and memory checks become notes")
    ap.add_argument("--compare-only", action="store_true", help="reuse the logs already in OUT_DIR")
    args = ap.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    if not args.allow_cpu:
        try:
            import torch

            gpu = torch.cuda.is_available()
        except ImportError:
            gpu = False
        if not gpu and not args.compare_only:
            print("gpu_train_compare: no CUDA GPU (torch.cuda.is_available() is False); use --allow-cpu to try "
                  "the script on a CPU", file=sys.stderr)
            return 2
    common = ["--seed", str(args.seed)] + (["--steps", str(args.steps)] if args.steps else []) + train_args
    logs = {name: args.out_dir / f"{name}.json" for name in RUNS}
    if not args.compare_only:
        for name in RUNS:
            rc, _ = run_training(name, args.out_dir, common, args.baseline)
            if rc != 0:
                print(f"gpu_train_compare: the {name} run failed (exit status {rc}); see {args.out_dir / name}.out",
                      file=sys.stderr)
                return 2
    missing = [str(p) for p in logs.values() if not p.exists()]
    if missing:
        print(f"gpu_train_compare: missing logs: {', '.join(missing)}", file=sys.stderr)
        return 2
    ours, base = (json.loads(logs[name].read_text()) for name in RUNS)
    result = compare(ours, base, start_rtol=args.start_rtol, curve_rtol=args.curve_rtol, final_rtol=args.final_rtol,
                     max_final_ratio=args.max_final_ratio, max_memory_ratio=args.max_memory_ratio,
                     min_speedup=args.min_speedup, window=args.window, allow_cpu=args.allow_cpu)
    result["logs"] = {name: str(p) for name, p in logs.items()}
    result["command"] = [sys.executable, *sys.argv]
    png = args.out_dir / "loss_curves.png"
    try:
        plot(ours, base, result, png)
        result["plot"] = str(png)
    except ImportError:
        print("gpu_train_compare: matplotlib is not installed: no loss_curves.png", file=sys.stderr)
    (args.out_dir / "compare.json").write_text(json.dumps(result, indent=1) + "\n")

    print("\n== blazecore vs baseline ==")
    for c in result["checks"]:
        mark = "ok  " if c["ok"] else ("note" if c["ok"] is None else "FAIL")
        print(f"  [{mark}] {c['check']}: {c['detail']}")
    f = result["figures"]
    if f.get("speedup"):
        print(f"  tokens/s: {f['tokens_per_s_blazecore']:.0f} vs {f['tokens_per_s_baseline']:.0f} "
              f"({f['speedup']:.2f}x)")
    print(f"  wrote {args.out_dir / 'compare.json'}" + (f" and {png}" if "plot" in result else ""))
    if not result["gpu_verdict"]:
        print("  (CPU run: a trial of the script, not a GPU comparison)")
    print("PASS" if result["ok"] else f"FAIL: {', '.join(result['failed'])}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
