"""The layer with its weights stored "in_out" ((E, d, 2h), (E, h, d), as gpt-oss and Llama 4 keep them) beside the
default "out_in": one forward+backward through ``blazecore_torch.moe_ffn`` ("ab", bf16, bench_gemm's problem) with
the weights of each layout on the wgmma kernels, and "in_out" on the mma.sync kernels (``BLAZECORE_SM90=0``, the
only path those weights had on Hopper before), timed in alternation by CUDA events; the outputs and gradients of each
"in_out" run against the "out_in" run's (transposed), as relative norm errors.

Usage (repository root, GPU): PYTHONPATH=.:adapters:app python scripts/probe_layouts.py \
    [--shape olmoe,qwen3,fine] [--tokens 32k] [--json probe_layouts] [--results-dir DIR]
"""

from __future__ import annotations

import contextlib
import os

RUNS = ("out_in", "in_out", "in_out_mma_sync")


@contextlib.contextmanager
def _env(var, value):
    old = os.environ.get(var)
    if value is None:
        os.environ.pop(var, None)
    else:
        os.environ[var] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = old


def _steps(torch, ops, x, w13, w2, gates, ids, dy):
    """{run: step() -> (y, dx, dw13, dw2, dgates) as "out_in" stores them}."""
    E = w13.shape[0]
    disp = ops.build_dispatch(ids, E, validate=False)
    stored = {"out_in": (w13, w2), "in_out": (w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous())}

    def make(layout, sm90):
        a, b = stored[layout]
        xs, ws13, ws2, gs = (t.detach().requires_grad_() for t in (x, a, b, gates))

        def step():
            with _env("BLAZECORE_SM90", None if sm90 else "0"):
                y = ops.moe_ffn(xs, ws13, ws2, gs, ids, checkpoint="ab", dispatch=disp, weight_layout=layout)
                g = torch.autograd.grad(y, (xs, ws13, ws2, gs), dy)
            if layout == "in_out":
                g = (g[0], g[1].transpose(1, 2), g[2].transpose(1, 2), g[3])
            return (y, *g)

        return step

    return {"out_in": make("out_in", True), "in_out": make("in_out", True), "in_out_mma_sync": make("in_out", False)}


def _rel(torch, a, b) -> float:
    a, b = a.double(), b.double()
    return float(torch.linalg.vector_norm(a - b) / max(float(torch.linalg.vector_norm(b)), 1e-30))


def main(argv=None) -> int:
    from bench._common import probe_args, time_calls, write_probe_json

    a = probe_args(__doc__, argv, shape="olmoe,qwen3,fine", tokens="32k", repeats=10)
    import blazecore_torch as ops
    import torch

    from bench.bench_gemm import SHAPES, _problem

    rows, ok = [], True
    for shape in a.shape.split(","):
        d, h, E, K = SHAPES[shape]
        for L in a.token_counts:
            x, w13, w2, gates, ids, dy = _problem(torch, d, h, E, K, L)
            steps = _steps(torch, ops, x, w13, w2, gates, ids, dy)
            ref = steps["out_in"]()
            errs = {}
            for run in RUNS[1:]:
                got = steps[run]()
                errs[run] = dict(zip(("y", "dx", "dw13", "dw2", "dgates"),
                                     (_rel(torch, g, r) for g, r in zip(got, ref, strict=True)), strict=True))
                del got
            del ref
            t = time_calls(steps, warmup=2, repeats=a.repeats, clock="torch")
            row = {"shape": shape, "tokens": L, **{f"{r}_ms": t[r].median_ms for r in RUNS},
                   "errors_vs_out_in": errs}
            ok &= all(v < 2e-2 for e in errs.values() for v in e.values())
            rows.append(row)
            print(f"{shape} {L // 1024}k: " + ", ".join(f"{r} {t[r].median_ms:.3f} ms" for r in RUNS)
                  + f"; largest error vs out_in {max(v for e in errs.values() for v in e.values()):.2e}", flush=True)
            del x, w13, w2, gates, ids, dy, steps
            torch.cuda.empty_cache()
    write_probe_json(a, rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
