"""scripts/ncu_sass_regions.py on a small hand-made SASS page (CPU): regions, shares, top instructions."""

import importlib.util
import json
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ncu_sass_regions.py"
_spec = importlib.util.spec_from_file_location("ncu_sass_regions", _SCRIPT)
nsr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nsr)

_HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
           "stall_long_sb (Not Issued)", "stall_barrier", "stall_wait"]
# (address, SASS, samples, executed, long_sb, long_sb not issued, barrier, wait)
_ROWS = [
    ("0x100", "HGMMA.64x256x16.F32.BF16 R24, gdesc[UR4], R24", "10", "800", "0", "0", "0", "10"),
    ("0x110", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "30", "800", "0", "0", "30", "0"),
    ("0x120", "LDG.E.CONSTANT R5, desc[UR20][R8.64]", "0", "200", "0", "0", "0", "0"),
    ("0x130", "FMUL R20, R24, R5", "20", "200", "20", "15", "0", "0"),
    ("0x140", "EXIT", "0", "8", "0", "0", "0", "0"),
    ("0x150", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8+0x38020], R2", "1,000", "400", "0", "0", "0", "0"),
    ("0x160", "@!P0 BRA 0x190", "40", "400", "40", "30", "0", "0"),
    ("0x170", "EXIT", "0", "4", "0", "0", "0", "0"),
    ("0x180", "BRA 0x180", "0", "0", "0", "0", "0", "0"),
]


def _page(tmp_path, header=_HEADER, rows=_ROWS):
    path = tmp_path / "sass.csv"
    lines = ['"==PROF== a line ncu prints before the page"', ",".join(f'"{h}"' for h in header)]
    lines += [",".join(f'"{v}"' for v in r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_regions_end_at_exits_and_cuts(tmp_path):
    rows = nsr.read_page(_page(tmp_path))
    got = nsr.summarize(rows, top=3, cuts=["0x110"])
    assert got["samples"] == 1100
    # cut after 0x110, EXIT at 0x140 and 0x170; the sample-free tail region is left out
    assert [(r["first"], r["last"], r["pct"], r["warps_exiting"]) for r in got["regions"]] == [
        ("0x100", "0x110", round(100 * 40 / 1100, 1), 0),
        ("0x120", "0x140", round(100 * 20 / 1100, 1), 8),
        ("0x150", "0x170", round(100 * 1040 / 1100, 1), 4),
    ]
    assert got["regions"][0]["stalls"] == [["barrier", 2.7], ["wait", 0.9]]
    # the not-issued columns are a subset of their reason's samples: not counted again
    assert got["stalls"] == [["long_sb", 5.5], ["barrier", 2.7], ["wait", 0.9]]
    assert [t["address"] for t in got["top"]] == ["0x150", "0x160", "0x110"]
    assert got["top"][0]["pct"] == round(100 * 1000 / 1100, 1)


def test_main_prints_json(tmp_path, capsys):
    assert nsr.main([_page(tmp_path), "--top", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["top"]) == 1 and len(out["regions"]) == 2


@pytest.mark.parametrize("header,rows,msg", [
    (["Address", "Source"], [("0x100", "EXIT")], "no SASS page header"),
    (_HEADER, [r[:2] + ("0",) + r[3:] for r in _ROWS], "no warp-state samples"),
])
def test_bad_pages_fail_clearly(tmp_path, capsys, header, rows, msg):
    assert nsr.main([_page(tmp_path, header, rows)]) == 2
    assert msg in capsys.readouterr().err
