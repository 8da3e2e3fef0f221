"""The expert-GEMM launchers and the CUDA sources agree on every number they share.

The launchers (blazecore/_moe_gpu.py) request the dynamic shared memory, threads and grids of kernels whose tile
sizes, stages and shared-memory layouts are compile-time constants of the CUDA sources; they pass enum values (GEMM
mode, epilogue, activation) as template arguments. A translation unit of ``static_assert``s over the sources' own
constants, written from the Python values, must compile with NVRTC for sm_80 and sm_90a: if either side changes
alone, it does not. Needs no GPU.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import blazecore
from blazecore import _array, _compile, _moe_gpu

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="needs cupy (extra cuda12 or cuda13)")

_CT = {"float": 4, "__half": 2, "__nv_bfloat16": 2}


def _sm80_asserts() -> list[str]:
    G = _moe_gpu
    out = [f"blz::BM == {G.BM}", f"blz::BN == {G.BN}", f"blz::STAGES == {G.STAGES}", f"blz::NTHREADS == {G.NTHREADS}",
           f"blz::MODE_M == {G.MODE_M}", f"blz::MODE_K == {G.MODE_K}", f"blz::EPI_ACT == {G.EPI_ACT}",
           f"blz::EPI_ROWSCALE == {G.EPI_ROWSCALE}", f"blz::EPI_DHCUR == {G.EPI_DHCUR}",
           f"blz::EPI_WGRAD == {G.EPI_WGRAD}", f"blz::ACT_INTERLEAVED == {G.ACT_INTERLEAVED}"]
    out += [f"blz::{name.upper()} == {v}" for name, v in G._ACT_IDS.items()]
    # moe_gemm's dynamic shared memory: STAGES A tiles then STAGES B tiles of T
    for (ct, size), a_k, b_k in itertools.product(_CT.items(), (False, True), (False, True)):
        a, b = ("true" if a_k else "false"), ("true" if b_k else "false")
        out.append(f"blz::STAGES * (blz::tile_elems<{ct}, {a}, blz::BM>() + blz::tile_elems<{ct}, {b}, blz::BN>()) "
                   f"* (int)sizeof({ct}) == {G._smem_bytes(size, a_k, b_k)}")
    return out


def _sm90_asserts() -> list[str]:
    G = _moe_gpu
    out = [f"blz::sm90::THREADS == {G.NTHREADS90}", f"blz::sm90::BM == {G.BM}"]
    for bn, staging, a_tiles in itertools.product((128, 256), (False, True), (1, 2)):
        cfg = f"blz::sm90::Cfg<{bn}, {'true' if staging else 'false'}, {a_tiles}>"
        out.append(f"{cfg}::SMEM_BYTES == {G._smem90(bn, staging, a_tiles)}")
        out.append(f"{cfg}::STAGES == {G._stages90(bn, a_tiles)}")
    return out


def _source(include: str, asserts: list[str]) -> str:
    body = "\n".join(f'static_assert({a}, "{a.replace(chr(34), "")}");' for a in asserts)
    return f'#include "{include}"\n{body}\n'


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("include, asserts", [("moe_gemm_sm80.cu", _sm80_asserts), ("sm90_common.cuh", _sm90_asserts)],
                         ids=["moe_gemm", "moe_sm90"])
def test_launcher_constants_match_the_kernels(include, asserts, arch):
    _compile.compile_source(_source(include, asserts()), "kernel_config_check.cu", (), arch)


def test_a_drifted_constant_fails_to_compile():
    """The check can fail: one shared-memory figure off by 16 bytes is a compile error naming it."""
    bad = f"blz::sm90::Cfg<256, true, 1>::SMEM_BYTES == {_moe_gpu._smem90(256, True, 1) + 16}"
    with pytest.raises(_compile.CompileError, match="SMEM_BYTES"):
        _compile.compile_source(_source("sm90_common.cuh", [bad]), "kernel_config_check.cu", (), "sm_90a")


def _activations():
    base = list(blazecore.ACTIVATIONS)
    return base + [f"{a}_interleaved" for a in sorted(_moe_gpu._GATED)]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_every_launchable_kernel_is_registered(arch):
    """Every kernel a launcher can ask for (each dtype, activation, weight layout, GEMM path, GEMM role, carry and
    dense-operand load) is registered in the file the launcher loads it from (so the CPU compile check covers it)
    and is among the names of the module the launcher builds for it."""
    seen = set()
    with _array.dry_run(arch):
        for dtype, act, layout, path in itertools.product((np.float32, np.float16, blazecore.BF16), _activations(),
                                                          blazecore.WEIGHT_LAYOUTS, blazecore.GEMM_PATHS):
            kern = _moe_gpu._Kernels(dtype, act, weight_layout=layout, path=path)
            for which in kern.variants:
                if which in _moe_gpu._SM90_ONLY and not kern.sm90:
                    continue
                for carry_in, b_load in itertools.product((False, True), _moe_gpu.B_LOADS):
                    kv = kern.variant(which, carry_in, b_load)
                    assert kv.name in _compile.KERNELS[kv.file], (kv.file, kv.name)
                    assert kv.name in kern.module_names(kv), (kv.file, kv.name)  # the module it is loaded from
                    seen.add(kv.file)
            for name in _moe_gpu._helper_names(kern.ct):
                assert name in _compile.KERNELS[_moe_gpu._FILE_HELPERS], name
    want = {_moe_gpu._FILE, _moe_gpu._FILE90, _moe_gpu._FILE_WGRAD90} if arch == "sm_90a" else {_moe_gpu._FILE}
    assert seen == want
