"""Each GEMM's CUPTI kernel ms in the layer with its weights stored "out_in" and "in_out" (the same values), and
with the output stores by TMA (the default) or by threads (``BLAZECORE_SM90_OUT_STORE=st_global``): one
forward+backward through ``blazecore_torch.moe_ffn`` ("ab", bf16, bench_gemm's problem, swiglu) at gpt-oss's shapes
and olmoe's, the four runs in turn in each of 3 rounds (``bench_gemm.launcher_kernel_ms``, medians of 3 calls; "layer"
the step's CUDA-event ms).

``--interleaved``: instead, gpt-oss's activation (swiglu_oai) on "in_out" weights with w13's 2h columns as [gate; up]
and as gpt-oss stores them, interleaved gate/up pairs (``swiglu_oai_interleaved``), output stores by TMA, at
gpt-oss's shapes; the same tensors either way (the timing does not depend on which pairing the values mean).

Usage (repository root, GPU): PYTHONPATH=.:adapters:app python scripts/probe_layout_gemms.py OUT.json [--interleaved]
"""
from __future__ import annotations

import json
import sys

from ab_inprocess import _Applied, layer_measure, time_in_rounds

SHAPES = {"gpt_oss_20b": (2880, 2880, 32, 4), "gpt_oss_120b": (2880, 2880, 128, 4), "olmoe": (2048, 1024, 64, 8)}
CASES = (("gpt_oss_20b", 32768), ("gpt_oss_120b", 16384), ("olmoe", 32768))
ENV_SETS = {"tma": {}, "stg": {"BLAZECORE_SM90_OUT_STORE": "st_global"}}


def _step(torch, ops, x, w13, w2, gates, ids, dy, disp, layout, activation="swiglu"):
    xs, ws1, ws2, gs = (t.detach().requires_grad_() for t in (x, w13, w2, gates))

    def step():
        y = ops.moe_ffn(xs, ws1, ws2, gs, ids, activation=activation, checkpoint="ab", dispatch=disp,
                        weight_layout=layout)
        return torch.autograd.grad(y, (xs, ws1, ws2, gs), dy)

    return step


def main(out: str, interleaved: bool = False) -> int:
    import torch
    from blazecore_torch import ops

    import bench.bench_gemm as bg
    from bench import _common as common

    res: dict = {}
    env_sets = {"tma": ENV_SETS["tma"]} if interleaved else ENV_SETS
    for shape, L in CASES[:2] if interleaved else CASES:
        d, h, E, K = SHAPES[shape]
        x, w13, w2, gates, ids, dy = bg._problem(torch, d, h, E, K, L)
        w13t, w2t = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
        disp = ops.build_dispatch(ids, E, validate=False)
        if interleaved:
            steps = {"gate_up": _step(torch, ops, x, w13t, w2t, gates, ids, dy, disp, "in_out", "swiglu_oai"),
                     "interleaved": _step(torch, ops, x, w13t, w2t, gates, ids, dy, disp, "in_out",
                                          "swiglu_oai_interleaved")}
        else:
            steps = {"out_in": _step(torch, ops, x, w13, w2, gates, ids, dy, disp, "out_in"),
                     "in_out": _step(torch, ops, x, w13t, w2t, gates, ids, dy, disp, "in_out")}
        runs = {f"{lay}/{lab}": (s, lambda env=env: _Applied("", env))
                for lab, env in env_sets.items() for lay, s in steps.items()}
        res[shape] = time_in_rounds(runs, rounds=3, calls=3, warm_seconds=3.0, measure=layer_measure(torch),
                                    sync=torch.cuda.synchronize)
        print(shape, json.dumps(res[shape]), flush=True)
        del steps, runs
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump({"header": common.gpu_header(), "ms": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--interleaved"]
    if len(args) != 1:
        sys.exit(__doc__)
    sys.exit(main(args[0], interleaved="--interleaved" in sys.argv[1:]))
