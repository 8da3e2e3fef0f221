"""scripts/proto_cutlass_gather.py's parser of CUTLASS example 52's output (CPU)."""

import importlib.util
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "proto_cutlass_gather.py"
_spec = importlib.util.spec_from_file_location("proto_cutlass_gather", _SCRIPT)
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
parse_cutlass = _mod.parse_cutlass


def _log(verdict, times):
    blocks = "".join(f"{name}:\n  Runtime: {ms} ms\n   GFLOPs: 1\n" for name, ms in times)
    return f"Gather A,C + scatter D on M mode:\n{verdict}\n{blocks}"


def test_parse_cutlass_reads_each_kernel_and_the_verdict():
    out = parse_cutlass(_log("Passed validation", [("Fused", 8.5), ("Unfused default", 9.25),
                                                    ("Unfused optimized", 4.75)]))
    assert out == {"validation": "passed", "fused_ms": 8.5, "unfused_default_ms": 9.25, "unfused_optimized_ms": 4.75}


def test_parse_cutlass_failed_run_has_no_times():
    assert parse_cutlass(_log("Failed validation", [])) == {"validation": "failed"}
    assert parse_cutlass("CUDA error: out of memory\n") == {"validation": "none"}
