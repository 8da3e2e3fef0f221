"""Every CUDA kernel compiles with NVRTC for sm_80 and sm_90a, without errors, ptxas warnings, a wgmma pipeline that
ptxas serializes ("Potential Performance Loss") or a warpgroup.arrive that it injects (C7519).

Needs no GPU. Each (file, arch) compiles in a subprocess because NVRTC can crash the process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import blazecore  # noqa: F401  (registers every kernel)
from blazecore import _compile

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="needs cupy (extra cuda12 or cuda13)")

ARCHS = ["sm_80", "sm_90a"]
FILES = sorted(p.name for p in _compile.CUDA_DIR.glob("*.cu"))

_SCRIPT = """
import json, sys
from blazecore import _compile
fname, arch, names = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
options = tuple(json.loads(sys.argv[4])) if len(sys.argv) > 4 else ()
cubin, lowered, log = _compile.compile_cubin(fname, names, arch, options)
print(json.dumps({"log": log, "bytes": len(cubin), "lowered": lowered}))
"""


def test_every_source_registers_kernels():
    missing = [f for f in FILES if f not in _compile.KERNELS]
    assert not missing, f"no launcher registers kernels from {missing}"


def _compile_clean(fname, arch, options=()):
    names = list(_compile.KERNELS.get(fname, ()))
    assert names, f"{fname}: nothing registered"
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, fname, arch, json.dumps(names), json.dumps(list(options))],
        capture_output=True, text=True, timeout=900,
    )
    what = f"{fname} [{arch}{', ' if options else ''}{' '.join(options)}]"
    assert proc.returncode == 0, f"{what} failed:\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    log = result["log"]
    # ptxas reports a serialized wgmma pipeline (C7515 and kin) and a warpgroup.arrive it injects between a k-tile's
    # wgmmas and their commit (C7519: a wait for the wgmmas in flight) as "info", not as warnings: fail on them too
    bad = [ln for ln in log.splitlines()
           if any(w in ln.lower() for w in ("warning", "error", "performance loss", "(c75"))]
    assert not bad, f"{what} compiler warnings:\n" + "\n".join(bad)
    assert result["bytes"] > 0
    assert set(result["lowered"]) == set(names)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fname", FILES)
def test_kernels_compile(fname, arch):
    _compile_clean(fname, arch)


# build switches of the sources that select another form of a kernel (not the timing probes, whose results are wrong)
SWITCHES = [("moe_wgrad_sm90.cu", "-DBLZ_SM90_PRODUCER_FENCE=1")]


@pytest.mark.parametrize(("fname", "option"), SWITCHES)
def test_kernel_switches_compile(fname, option):
    _compile_clean(fname, "sm_90a", (option,))
