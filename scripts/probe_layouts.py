"""The layer with its weights stored "in_out" ((E, d, 2h), (E, h, d), as gpt-oss and Llama 4 keep them) beside the
default "out_in": one forward+backward through ``blazecore_torch.moe_ffn`` ("ab", bf16, bench_gemm's problem) with
the weights of each layout on the wgmma kernels, and "in_out" on the mma.sync kernels (``BLAZECORE_SM90=0``, the
only path those weights had on Hopper before), timed in alternation by CUDA events; the outputs and gradients of each
"in_out" run against the "out_in" run's (transposed), as relative norm errors.

``--interleaved``: the "in_out" runs' gate/up rows interleaved ([g0, u0, g1, u1, ...], gpt-oss's storage, activation
"<activation>_interleaved"; their dw13 mapped back to the [gate; up] order for the errors). ``--activation`` (default
swiglu; gpt-oss: swiglu_oai) and ``--bias`` (b13 and b2, as gpt-oss has) apply to every run. Shapes: bench_gemm's and
gpt_oss_20b / gpt_oss_120b (d = h = 2880, E = 32 / 128, K = 4).

Usage (repository root, GPU): PYTHONPATH=.:adapters:app python scripts/probe_layouts.py \
    [--shape olmoe,qwen3,fine] [--tokens 32k] [--interleaved] [--activation swiglu] [--bias] [--json probe_layouts]
    [--results-dir DIR]
"""

from __future__ import annotations

import contextlib
import os

RUNS = ("out_in", "in_out", "in_out_mma_sync")
EXTRA_SHAPES = {"gpt_oss_20b": (2880, 2880, 32, 4), "gpt_oss_120b": (2880, 2880, 128, 4)}


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


def _steps(torch, ops, x, w13, w2, gates, ids, dy, activation="swiglu", interleaved=False, biases=None):
    """({run: step() -> (y, dx, dw13, dw2, dgates) as the run's layout stores them}, {run: those as "out_in" stores
    them ([gate; up] rows)}): the timed steps, and the mapping the error check applies outside them; ``interleaved``:
    the "in_out" runs' w13 (and b13) rows interleaved."""
    E, h = w13.shape[0], w13.shape[1] // 2
    disp = ops.build_dispatch(ids, E, validate=False)
    b13, b2 = biases or (None, None)
    perm = torch.stack((torch.arange(h), torch.arange(h, 2 * h)), 1).reshape(-1).to(w13.device)  # row r: perm[r]
    w13_t, b13_t = (w13[:, perm], None if b13 is None else b13[:, perm]) if interleaved else (w13, b13)
    stored = {"out_in": (w13, w2, b13), "in_out": (w13_t.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous(),
                                                   b13_t)}
    inv = torch.argsort(perm)

    def make(layout, sm90):
        a, b, bias13 = stored[layout]
        act = activation + ("_interleaved" if interleaved and layout == "in_out" else "")
        xs, ws13, ws2, gs = (t.detach().requires_grad_() for t in (x, a, b, gates))

        def step():
            with _env("BLAZECORE_SM90", None if sm90 else "0"):
                y = ops.moe_ffn(xs, ws13, ws2, gs, ids, activation=act, checkpoint="ab", dispatch=disp,
                                weight_layout=layout, b13=bias13, b2=b2)
                g = torch.autograd.grad(y, (xs, ws13, ws2, gs), dy)
            return (y, *g)

        return step

    def canon(out):  # an "in_out" run's results as "out_in" stores them
        y, dx, g13, g2, dg = out
        g13 = g13.transpose(1, 2)
        return y, dx, g13[:, inv] if interleaved else g13, g2.transpose(1, 2), dg

    steps = {"out_in": make("out_in", True), "in_out": make("in_out", True), "in_out_mma_sync": make("in_out", False)}
    return steps, {"out_in": lambda out: out, "in_out": canon, "in_out_mma_sync": canon}


def _rel(torch, a, b) -> float:
    a, b = a.double(), b.double()
    return float(torch.linalg.vector_norm(a - b) / max(float(torch.linalg.vector_norm(b)), 1e-30))


def main(argv=None) -> int:
    from bench._common import probe_args, time_calls, write_probe_json

    a = probe_args(__doc__, argv, shape="olmoe,qwen3,fine", tokens="32k", repeats=10,
                   extra=(("--interleaved", {"action": "store_true"}), ("--activation", {"default": "swiglu"}),
                          ("--bias", {"action": "store_true"})))
    import blazecore_torch as ops
    import torch

    from bench.bench_gemm import SHAPES, _problem

    shapes = {**SHAPES, **EXTRA_SHAPES}
    rows, ok = [], True
    for shape in a.shape.split(","):
        d, h, E, K = shapes[shape]
        for L in a.token_counts:
            x, w13, w2, gates, ids, dy = _problem(torch, d, h, E, K, L)
            g = torch.Generator(device="cuda").manual_seed(1)
            biases = tuple((torch.randn(E, n, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
                           for n in (2 * h, d)) if a.bias else None
            steps, canon = _steps(torch, ops, x, w13, w2, gates, ids, dy, a.activation, a.interleaved, biases)
            ref = steps["out_in"]()
            errs = {}
            for run in RUNS[1:]:
                got = canon[run](steps[run]())
                errs[run] = dict(zip(("y", "dx", "dw13", "dw2", "dgates"),
                                     (_rel(torch, g, r) for g, r in zip(got, ref, strict=True)), strict=True))
                del got
            del ref
            t = time_calls(steps, warmup=2, repeats=a.repeats, clock="torch")
            row = {"shape": shape, "tokens": L, "activation": a.activation, "interleaved": a.interleaved,
                   "bias": a.bias, **{f"{r}_ms": t[r].median_ms for r in RUNS}, "errors_vs_out_in": errs}
            ok &= all(v < 2e-2 for e in errs.values() for v in e.values())
            rows.append(row)
            print(f"{shape} {L // 1024}k: " + ", ".join(f"{r} {t[r].median_ms:.3f} ms" for r in RUNS)
                  + f"; largest error vs out_in {max(v for e in errs.values() for v in e.values()):.2e}", flush=True)
            del x, w13, w2, gates, ids, dy, steps, canon
            torch.cuda.empty_cache()
    write_probe_json(a, rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
