"""Benchmark route_topk (forward, backward, both) against a PyTorch reference on the same inputs.

The reference is what a PyTorch router does: scores = softmax(logits.float()) (or sigmoid), torch.topk on
scores (+ bias), gather, renormalise, and autograd for the backward. Both run on torch's current stream;
blazecore's outputs are allocated by torch (blazecore.allocator), so peak memory is comparable.

Timing: bench/_common.py's timer, CUDA events around `--iters` calls, median of `--repeats`, after a
warm-up. Rows (one per shape, mode and method) go to bench/results/router_<gpu>.json, each with the GPU, CUDA
and library versions, the git commit and the date. GB/s counts the bytes each kernel must move (logits read
once, outputs written once). A row's speedup is left out (null) when the two methods disagree on the ids or
gates.

    python bench/bench_router.py [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

try:
    from . import _common as common
except ImportError:  # run as a script from bench/
    import _common as common

ROOT = Path(__file__).resolve().parents[1]
SHAPES_EK = [(8, 2), (64, 8), (128, 8), (256, 8), (512, 8)]
TOKENS = [4096, 16384, 65536]
MODES = [("softmax", True, False), ("softmax", False, False), ("sigmoid", True, True)]  # (score, renorm, bias)


def _need_gpu():
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no cupy, ...
        sys.exit(f"bench_router: no CUDA GPU available ({type(e).__name__}: {e}); this benchmark needs one")
    if n == 0:
        sys.exit("bench_router: no CUDA GPU available; this benchmark needs one")
    try:
        import torch
    except ImportError:
        sys.exit("bench_router: needs PyTorch with CUDA for the reference (pip install torch)")
    if not torch.cuda.is_available():
        sys.exit("bench_router: torch.cuda.is_available() is False; this benchmark needs a CUDA GPU")
    return cupy, torch


def _time(fn, iters, repeats, warmup=5):
    """Median ms per call: samples of ``iters`` back-to-back calls (CUDA events on torch's stream)."""
    return common.time_call(fn, warmup=warmup, repeats=repeats, inner=iters, clock="torch").median_ms


def _peak(torch, fn) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _bench_case(torch, rt, header, L, E, K, score, renorm, use_bias, stream, iters, repeats):
    """Rows for one (L, E, K, mode): blazecore and torch, fwd / bwd / fwd+bwd."""
    rows = []
    g = torch.Generator(device="cuda").manual_seed(L + E)
    x = torch.randn(L, E, device="cuda", generator=g).to(torch.bfloat16)
    bias = (0.05 * torch.randn(E, device="cuda", generator=g)) if use_bias else None
    dg = torch.randn(L, K, device="cuda", generator=g)

    def ours_fwd():
        return rt.route_topk(x, K, score=score, renormalize=renorm, expert_bias=bias, stream=stream)

    gates, ids = ours_fwd()

    def ours_bwd():
        return rt.route_topk_backward(dg, x, ids, score=score, renormalize=renorm, stream=stream)

    def ours_both():
        _, i = ours_fwd()
        return rt.route_topk_backward(dg, x, i, score=score, renormalize=renorm, stream=stream)

    def torch_fwd(xr=x):
        s = torch.softmax(xr.float(), dim=-1) if score == "softmax" else torch.sigmoid(xr.float())
        _, idx = torch.topk(s + bias if use_bias else s, K, dim=-1)
        gt = s.gather(1, idx)
        return (gt / gt.sum(dim=-1, keepdim=True) if renorm else gt), idx

    def torch_both():
        xr = x.detach().requires_grad_()
        gt, _ = torch_fwd(xr)
        gt.backward(dg)
        return xr.grad

    def torch_dx_for(idx):  # autograd through the gates of given ids (tie policy aside)
        xr = x.detach().requires_grad_()
        s = torch.softmax(xr.float(), dim=-1) if score == "softmax" else torch.sigmoid(xr.float())
        gt = s.gather(1, idx.long())
        (gt / gt.sum(dim=-1, keepdim=True) if renorm else gt).backward(dg)
        return xr.grad

    # torch.topk may order equal values either way (bf16 logits repeat), so compare the selected
    # values position by position, then the gates and gradients for our ids.
    with torch.no_grad():
        tg, tidx = torch_fwd()
        s = torch.softmax(x.float(), dim=-1) if score == "softmax" else torch.sigmoid(x.float())
        sel = s + bias if use_bias else s
        sel_err = float((sel.gather(1, ids.long()) - sel.gather(1, tidx)).abs().max())
    same_ids = float((tidx.int() == ids).all(dim=1).float().mean())
    gate_err = float((tg - gates).abs().max())
    dx_err = float((torch_dx_for(ids).float() - ours_bwd().float()).abs().max())
    ok = sel_err < 1e-6 and gate_err < 1e-5 and dx_err < 1e-2
    isz = 2
    fwd_bytes = L * E * isz + L * K * 8 + (E * 4 if use_bias else 0)
    dense = score == "softmax" and not renorm
    bwd_bytes = L * K * 8 + (L * E * isz if dense else L * K * isz) + L * E * isz
    t = {
        ("blazecore", "fwd"): _time(ours_fwd, iters, repeats),
        ("blazecore", "bwd"): _time(ours_bwd, iters, repeats),
        ("blazecore", "fwd+bwd"): _time(ours_both, iters, repeats),
        ("torch", "fwd"): _time(lambda: torch_fwd(), iters, repeats),
        ("torch", "fwd+bwd"): _time(torch_both, iters, repeats),
    }
    t[("torch", "bwd")] = t[("torch", "fwd+bwd")] - t[("torch", "fwd")]
    peak = {"blazecore": _peak(torch, ours_both), "torch": _peak(torch, torch_both)}
    for (method, phase), ms in t.items():
        nbytes = {"fwd": fwd_bytes, "bwd": bwd_bytes, "fwd+bwd": fwd_bytes + bwd_bytes}[phase]
        ref_ms = t[("torch", phase)]
        rows.append({
            **header, "op": "route_topk", "method": method, "phase": phase, "L": L, "E": E, "K": K,
            "dtype": "bfloat16", "score": score, "renormalize": renorm, "bias": use_bias,
            "ms": round(ms, 5), "GB_per_s": round(nbytes / (ms * 1e-3) / 1e9, 1),
            "peak_fwd_bwd_MiB": round(peak[method] / 2**20, 2) if phase == "fwd+bwd" else None,
            "speedup_vs_torch": round(ref_ms / ms, 2) if (ok and method == "blazecore") else None,
            "agree": ok, "same_ids_frac": same_ids, "sel_max_err": sel_err, "gate_max_err": gate_err,
            "dx_max_err": dx_err,
        })
    print(f"L={L:6d} E={E:4d} K={K} {score:7s} renorm={int(renorm)} bias={int(use_bias)}  "
          f"ours fwd {t[('blazecore', 'fwd')] * 1e3:7.1f} us bwd {t[('blazecore', 'bwd')] * 1e3:7.1f} us"
          f" | torch fwd {t[('torch', 'fwd')] * 1e3:7.1f} us bwd {t[('torch', 'bwd')] * 1e3:7.1f} us"
          f"{'' if ok else '  DISAGREE'}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one token count, fewer repeats")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cupy, torch = _need_gpu()
    import blazecore
    from blazecore import router as rt

    tokens = TOKENS[1:2] if args.quick else TOKENS
    repeats = 5 if args.quick else args.repeats
    dev = torch.cuda.get_device_properties(0)
    commit, dirty = common.git_commit()
    header = {
        "gpu": dev.name,
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "torch": torch.__version__,
        "cupy": cupy.__version__,
        "blazecore": blazecore.__version__,
        "commit": commit + ("+dirty" if dirty else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int32": torch.int32,
           "int64": torch.int64, "uint8": torch.uint8}
    blazecore.set_allocator(lambda shape, dtype: torch.empty(shape, dtype=tdt[dtype], device="cuda"))
    stream = torch.cuda.current_stream().cuda_stream
    rows = []
    for L in tokens:
        for E, K in SHAPES_EK:
            for score, renorm, use_bias in MODES:
                rows += _bench_case(torch, rt, header, L, E, K, score, renorm, use_bias, stream, args.iters, repeats)
    blazecore.set_allocator(None)
    gpu_tag = re.sub(r"[^A-Za-z0-9]+", "_", dev.name).strip("_").lower()
    out = args.out or ROOT / "bench" / "results" / f"router_{gpu_tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
