"""gemm1 built on CUTLASS beside blazecore's, on one gather-on-M problem (GPU).

CUTLASS's own gathered GEMM is its example 52 (``examples/52_hopper_gather_scatter_fusion`` of the nvidia-cutlass
wheel): A's rows gathered by an index list inside the kernel, through the ``KernelCpAsyncWarpSpecialized`` mainloop
(both operands by cp.async; the tensor-copy engine cannot gather rows on sm_90), C gathered and D scattered by the
same list. ``scripts/proto_cutlass_gather.sh`` builds and runs it; this script parses its log and times blazecore's
gemm1 (``moe_ffn``'s first GEMM, with its activation epilogue) and torch._grouped_mm's on the same sizes:
L tokens, each routed to one of E experts (so the slots gather every token once, in random order, as the example's
shuffled index list does), d = K of the GEMM, 2h = N.

Usage (repository root): PYTHONPATH=.:adapters:app python scripts/proto_cutlass_gather.py OUT.json [CUTLASS_LOG ...]
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

SIZES = {"tokens": 262144, "d": 2048, "h": 768, "experts": 128}  # gemm1: M = tokens, N = 2h = 1536, K = d = 2048


def parse_cutlass(text: str) -> dict:
    """{kernel: ms} from example 52's output ('Fused:' / 'Unfused default:' / 'Unfused optimized:' blocks, each
    followed by its 'Runtime: X ms'), with the validation verdict."""
    out: dict = {"validation": "passed" if "Passed validation" in text else
                 "failed" if "Failed validation" in text else "none"}
    for name, ms in re.findall(r"^(Fused|Unfused default|Unfused optimized):\s*\n\s*Runtime:\s*([0-9.]+) ms", text,
                               re.M):
        out[name.lower().replace(" ", "_") + "_ms"] = float(ms)
    return out


def measure_ours(rounds: int = 2) -> dict:
    import torch
    from blazecore_torch import ops

    import bench.bench_gemm as bg

    name = "gather_top1"
    bg.SHAPES[name] = (SIZES["d"], SIZES["h"], SIZES["experts"], 1)
    rows = bg.measure(torch, ops, name, SIZES["tokens"], warmup=2, repeats=5, clock="cupti", warm_s=3, rounds=rounds)
    return next(r for r in rows if r.get("gemm") == "gemm1")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    from bench import _common as common

    doc = {"header": {**common.gpu_header(), "bench": "proto_cutlass_gather", "sizes": SIZES,
                      "cutlass": "example 52, fp16, 128 x 128 x 64 tile, KernelCpAsyncWarpSpecialized, built with "
                                 "-O3 -DNDEBUG for sm_90a"},
           "cutlass": {Path(p).name: parse_cutlass(Path(p).read_text()) for p in argv[1:]},
           "blazecore_gemm1": measure_ours()}
    Path(argv[0]).write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: v for k, v in doc.items() if k != "header"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
