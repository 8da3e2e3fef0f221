"""The expert-GEMM launchers and the CUDA sources agree on every number they share.

The launchers (blazecore/_moe_gpu.py) request the dynamic shared memory, threads and grids of kernels whose tile
sizes, stages and shared-memory layouts are compile-time constants of the CUDA sources; they pass enum values (GEMM
mode, epilogue, activation) as template arguments. A translation unit of ``static_assert``s over the sources' own
constants, written from the Python values, must compile with NVRTC for sm_80 and sm_90a: if either side changes
alone, it does not. Needs no GPU.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

import blazecore
from blazecore import _array, _compile, _moe_args, _moe_gpu

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
    for bn, a_tiles in itertools.product((128, 256), (1, 2)):
        cfg = f"blz::sm90::Cfg<{bn}, {a_tiles}, {G._stages90(bn, a_tiles)}>"
        out.append(f"{cfg}::SMEM_BYTES == {G._smem90(bn, a_tiles)}")
    out.append(f"blz::sm90::DhCfg<{G.STAGES_DH90}>::SMEM_BYTES == {G._smem_dh90()}")
    out.append(f"blz::sm90::DhCfg<{G.STAGES_DH90}>::BN == {G.BN90}")
    return out


def _helper_asserts() -> list[str]:
    return [f"blz::DGATES_SMALL_PARTS == {_moe_gpu.DGATES_SMALL_PARTS}"]


def _source(include: str, asserts: list[str]) -> str:
    body = "\n".join(f'static_assert({a}, "{a.replace(chr(34), "")}");' for a in asserts)
    return f'#include "{include}"\n{body}\n'


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("include, asserts", [("moe_gemm_sm80.cu", _sm80_asserts), ("sm90_common.cuh", _sm90_asserts),
                                             ("moe_helpers.cu", _helper_asserts)],
                         ids=["moe_gemm", "moe_sm90", "moe_helpers"])
def test_launcher_constants_match_the_kernels(include, asserts, arch):
    _compile.compile_source(_source(include, asserts()), "kernel_config_check.cu", (), arch)


def test_a_ring_too_deep_for_shared_memory_fails_to_compile():
    """The layout refuses a stage count whose ring does not fit a CTA's shared memory."""
    with pytest.raises(_compile.CompileError, match="fit a CTA"):
        _compile.compile_source(_source("sm90_common.cuh", ["blz::sm90::Cfg<256, 1, 5>::SMEM_BYTES > 0"]),
                                "kernel_config_check.cu", (), "sm_90a")


def test_a_drifted_constant_fails_to_compile():
    """The check can fail: one shared-memory figure off by 16 bytes is a compile error naming it."""
    bad = f"blz::sm90::Cfg<256, 1, 4>::SMEM_BYTES == {_moe_gpu._smem90(256, 1) + 16}"
    with pytest.raises(_compile.CompileError, match="SMEM_BYTES"):
        _compile.compile_source(_source("sm90_common.cuh", [bad]), "kernel_config_check.cu", (), "sm_90a")


def _c_layout(name: str, ct: str, fields) -> dict[str, tuple[int, int]]:
    """(offset, sizeof) of each named field of blz::<name><ct> as the CUDA compiler lays the struct out: one probe
    kernel a field writes its byte offset (a constant the compiler folds) and the struct's size; both are read back
    from the PTX (NVRTC has no offsetof). A field the header lacks is a compile error."""
    src = f'#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include "moe_args.cuh"\nusing S = blz::{name}<{ct}>;\n'
    src += "static_assert(S::FIELDS == %d, \"the mirror has S::FIELDS fields\");\n" % len(fields)
    for f in fields:
        src += (f'extern "C" __global__ void probe_{f}(long long* o) {{ S s{{}}; o[0] = '
                f"reinterpret_cast<const char*>(&s.{f}) - reinterpret_cast<const char*>(&s); o[1] = sizeof(S); }}\n")
    ptx, _, _ = _compile.compile_source(src, "args_layout_check.cu", (), "sm_80", ptx=True)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    out = {}
    for m in re.finditer(r"\.entry probe_(\w+)\((.*?)\n\}", ptx, re.S):
        consts = [int(v) for v in re.findall(r"mov\.[bu]64\s+%rd\d+,\s*(\d+);", m.group(2))]
        assert len(consts) == 2, m.group(0)
        out[m.group(1)] = (consts[0], consts[1])
    return out


@pytest.mark.parametrize("ct", list(_CT))
@pytest.mark.parametrize("name", list(_moe_args.STRUCTS))
def test_argument_structs_match_their_mirror(name, ct):
    """Every field of the argument structs (moe_args.cuh) sits at the offset its NumPy mirror gives it, the sizes
    agree and the header counts as many fields as the mirror has."""
    dt = _moe_args.STRUCTS[name]
    layout = _c_layout(name, ct, dt.names)
    assert {f: layout[f][0] for f in dt.names} == {f: dt.fields[f][1] for f in dt.names}
    assert {v[1] for v in layout.values()} == {dt.itemsize}


def test_a_drifted_argument_field_is_seen():
    """The layout check can fail: a mirror with two fields swapped reads different offsets from the header, and a
    field the header lacks does not compile."""
    dt = _moe_args.K_GROUPED
    layout = _c_layout("KGroupedArgs", "float", dt.names)
    assert layout["M"][0] != dt.fields["N"][1] and layout["N"][0] != dt.fields["M"][1]
    with pytest.raises(_compile.CompileError, match="flags"):
        _c_layout("KGroupedArgs", "float", (*dt.names[:-1], "flags"))


def test_argument_structs_take_every_field_by_name():
    """pack fills each field from its name (pointers from arrays' addresses, None as 0) and refuses a missing or an
    unknown one."""
    dt = _moe_args.K_GROUPED
    vals = {f: i + 1 for i, f in enumerate(dt.names)}
    vals["carry"] = None
    v = _moe_args.pack(dt, **vals)
    assert [int(v[f]) for f in dt.names] == [0 if f == "carry" else i + 1 for i, f in enumerate(dt.names)]
    assert v.dtype.itemsize == dt.itemsize
    missing = dict(vals)
    del missing["ldo"]
    with pytest.raises(TypeError, match="missing \\['ldo'\\]"):
        _moe_args.pack(dt, **missing)
    with pytest.raises(TypeError, match="unknown \\['flags'\\]"):
        _moe_args.pack(dt, **vals, flags=1)
    with pytest.raises(TypeError, match="pointer field"):
        _moe_args.pack(dt, **{**vals, "A": "not an array"})


def _activations():
    base = list(blazecore.ACTIVATIONS)
    return base + [f"{a}_interleaved" for a in sorted(_moe_gpu._GATED)]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_every_launchable_kernel_is_registered(arch, monkeypatch):
    """Every kernel a launcher can ask for (each dtype, activation, weight layout, GEMM path, GEMM role, carry,
    dense-operand load, the weight gradients' cluster form and dh's epilogue form) is registered in the file the
    launcher loads it from (so the CPU compile check covers it) and is among the names of the module the launcher
    builds for it."""
    seen = set()
    with _array.dry_run(arch):
        for dtype, act, layout, path, dh in itertools.product((np.float32, np.float16, blazecore.BF16), _activations(),
                                                              blazecore.WEIGHT_LAYOUTS, blazecore.GEMM_PATHS,
                                                              _moe_gpu.DHCUR_FORMS):
            monkeypatch.setenv("BLAZECORE_SM90_DHCUR", dh)
            kern = _moe_gpu._Kernels(dtype, act, weight_layout=layout, path=path)
            for which in kern.variants:
                if which in _moe_gpu._SM90_ONLY and not kern.sm90:
                    continue
                for carry_in, b_load, cluster in itertools.product((False, True), _moe_gpu.B_LOADS,
                                                                   _moe_gpu.WGRAD_CLUSTERS):
                    kv = kern.variant(which, carry_in, b_load, cluster)
                    assert kv.name in _compile.KERNELS[kv.file], (kv.file, kv.name)
                    assert kv.name in kern.module_names(kv), (kv.file, kv.name)  # the module it is loaded from
                    seen.add(kv.file)
            for name in _moe_gpu._helper_names(kern.ct):
                assert name in _compile.KERNELS[_moe_gpu._FILE_HELPERS], name
    want = {_moe_gpu._FILE, _moe_gpu._FILE90, _moe_gpu._FILE_WGRAD90, _moe_gpu._FILE_DH90} if arch == "sm_90a" \
        else {_moe_gpu._FILE}
    assert seen == want


def test_dh_epilogue_form_setting(monkeypatch):
    """BLAZECORE_SM90_DHCUR picks dh's kernel on sm_90a: "overlap" the producer-epilogue kernel (moe_dhcur_sm90, only
    with the weights by TMA: cp.async weights keep the fused kernel), "wide" its 512-thread form (likewise), "fused"
    moe_gemm_sm90's EPI_DHCUR; the other
    roles never change; anything else is a ValueError naming the variable before any kernel is chosen."""
    with _array.dry_run("sm_90a"):
        for form, b_load, want in (("overlap", "tma", _moe_gpu._FILE_DH90), ("overlap", "cp_async", _moe_gpu._FILE90),
                                   ("wide", "tma", _moe_gpu._FILE_DH90), ("wide", "cp_async", _moe_gpu._FILE90),
                                   ("fused", "tma", _moe_gpu._FILE90), ("fused", "cp_async", _moe_gpu._FILE90)):
            monkeypatch.setenv("BLAZECORE_SM90_DHCUR", form)
            kern = _moe_gpu._Kernels(blazecore.BF16, "swiglu")
            kv = kern.variant("dhcur", b_load=b_load)
            assert kv.file == want, (form, b_load)
            assert kern.variant("dx", b_load=b_load).file == _moe_gpu._FILE90
            if want == _moe_gpu._FILE_DH90:
                assert (kv.stages, kv.smem, kv.bn) == (_moe_gpu.STAGES_DH90, _moe_gpu._smem_dh90(), _moe_gpu.BN90)
                # the wide form: a fourth warpgroup, its own module (the kernels with six epilogue warps)
                wide = form == "wide"
                assert kv.threads == (512 if wide else 384) and kv.name.endswith(", 6>") == wide
                names = kern.module_names(kv)
                assert kv.name in names and all(n.endswith(", 6>") == wide for n in names), names
        monkeypatch.setenv("BLAZECORE_SM90_DHCUR", "async")
        with pytest.raises(ValueError, match="BLAZECORE_SM90_DHCUR"):
            _moe_gpu._Kernels(blazecore.BF16, "swiglu")


def test_in_out_weights_take_the_wgmma_kernels_on_sm90():
    """On sm_90a, 16-bit "in_out" weights (E, d, 2h) / (E, h, d) run the wgmma kernels with B of the other
    major-ness in every M-grouped GEMM (dh' on the producer-epilogue kernel with a K-major B), and the weight
    gradients' tiles stored the other way round (dw13 as computed, dw2 transposed), each a kernel that the compile
    check builds (no A_ACT second GEMM: "in_out" keeps hcur under act_in_operand); fp32 keeps the mma.sync kernels."""
    with _array.dry_run("sm_90a"):
        t = _moe_gpu._Kernels(blazecore.BF16, "swiglu", weight_layout="in_out")
        o = _moe_gpu._Kernels(blazecore.BF16, "swiglu")
        assert t.sm90 and o.sm90
        registered = {n for f in (_moe_gpu._FILE90, _moe_gpu._FILE_WGRAD90, _moe_gpu._FILE_DH90)
                      for n in _compile.KERNELS[f]}
        for which in ("gemm1", "gemm1s", "gemm2", "dhcur", "dx"):
            kv = t.variant(which)
            assert kv.file == (_moe_gpu._FILE_DH90 if which == "dhcur" else _moe_gpu._FILE90), which
            assert kv.name in registered and kv.name != o.variant(which).name, which
            assert t.variants[which].b_kmajor != o.variants[which].b_kmajor, which
        assert t.variant("dhcur", b_load="cp_async").file == _moe_gpu._FILE90  # the fused form, as for "out_in"
        assert "gemm2z" not in t.variants and "gemm2z" in o.variants
        for which, out_t in (("dw13", False), ("dw2", True)):
            kv, ko = t.variant(which), o.variant(which)
            assert kv.name in registered and ko.name in registered, which
            assert kv.name == _moe_gpu._wgrad90_name(t.ct, True, False, out_t=out_t, b_tma=t.b_load == "tma")
            assert ko.name == _moe_gpu._wgrad90_name(o.ct, True, False, out_t=not out_t, b_tma=o.b_load == "tma")
            assert _moe_gpu._wgrad_out_t(which, True) == out_t != _moe_gpu._wgrad_out_t(which, False)
        assert not _moe_gpu._Kernels(np.float32, "swiglu", weight_layout="in_out").sm90
        # the weight-gradient grids of the chunk carry follow the tiles the sm_90a kernels compute
        g13, g2 = _moe_gpu.wgrad_grids(True, True, 4, 300, 200, 400)
        assert (g13, g2) == _moe_gpu.wgrad_grids(True, False, 4, 300, 200, 400)


@pytest.mark.parametrize("layout", ["out_in", "in_out"])
def test_interleaved_rows_take_the_wgmma_kernels_on_sm90(layout):
    """On sm_90a, 16-bit interleaved gate/up rows run the wgmma kernels: gemm1 and dh' (both forms) are the [gate; up]
    kernels' instantiations for the interleaved Act id (ACT_INTERLEAVED or'ed in), registered, so the compile check
    builds them; B's tensor map of gemm1 is the plain one (a tile of consecutive rows or columns, no halves); the GEMMs
    without an activation are the [gate; up] layer's own kernels; there is no A_ACT second GEMM (act_in_operand keeps
    hcur). The mma.sync path stays for path="mma_sync" and fp32."""
    with _array.dry_run("sm_90a"):
        il = _moe_gpu._Kernels(blazecore.BF16, "swiglu_oai_interleaved", weight_layout=layout)
        gu = _moe_gpu._Kernels(blazecore.BF16, "swiglu_oai", weight_layout=layout)
        assert il.sm90 and il.interleaved and il.gated
        registered = {n for f in (_moe_gpu._FILE90, _moe_gpu._FILE_WGRAD90, _moe_gpu._FILE_DH90)
                      for n in _compile.KERNELS[f]}
        act = _moe_gpu._ACT_IDS["swiglu_oai"] | _moe_gpu.ACT_INTERLEAVED
        for which in ("gemm1", "gemm1s", "gemm2", "dx", "dw13", "dw2", "dhcur"):
            for b_load in _moe_gpu.B_LOADS:
                kv, kg = il.variant(which, b_load=b_load), gu.variant(which, b_load=b_load)
                assert kv.name in registered and kv.name in il.module_names(kv), (which, b_load)
                assert (kv.name == kg.name) == (which in ("gemm2", "dx", "dw13", "dw2")), (which, b_load)
                assert (kv.file, kv.smem, kv.stages) == (kg.file, kg.smem, kg.stages), (which, b_load)
                if kv.name != kg.name:
                    assert f", {act}," in kv.name, kv.name
        assert il.variant("dhcur").file == _moe_gpu._FILE_DH90
        assert "gemm2z" not in il.variants and ("gemm2z" in gu.variants) == (layout == "out_in")
        assert not _moe_gpu._Kernels(blazecore.BF16, "swiglu_interleaved", weight_layout=layout, path="mma_sync").sm90
        assert not _moe_gpu._Kernels(np.float32, "swiglu_interleaved", weight_layout=layout).sm90
        # the weight-gradient grids of the chunk carry: one dw13 launch over z's 2h columns either way
        assert _moe_gpu.wgrad_grids(True, layout == "in_out", 4, 300, 200, 400) == \
            _moe_gpu.wgrad_grids(True, layout == "in_out", 4, 300, 200, 400, None, True)


def test_layer_calls_share_their_kernel_lookups_until_a_setting_changes(monkeypatch):
    """_kernels gives the calls of one configuration one _Kernels (its lookups made once), and a fresh one, with the
    new choice, after anything its lookups read changes: a kernel setting in the environment, the NVRTC options, the
    module's tile constants, the arch of the run. A lookup repeated on one instance gives the same answer as a new
    instance's."""
    with _array.dry_run("sm_90a"):
        a = _moe_gpu._kernels(blazecore.BF16, "swiglu")
        assert _moe_gpu._kernels(blazecore.BF16, "swiglu") is a
        assert _moe_gpu._kernels(blazecore.BF16, "gelu") is not a
        assert a.variant("dhcur") is a.variant("dhcur")
        assert a.variant("dhcur") == _moe_gpu._Kernels(blazecore.BF16, "swiglu").variant("dhcur")
        assert a.variant("dhcur").file == _moe_gpu._FILE_DH90
        monkeypatch.setenv("BLAZECORE_SM90_DHCUR", "fused")
        b = _moe_gpu._kernels(blazecore.BF16, "swiglu")
        assert b is not a and b.variant("dhcur").file == _moe_gpu._FILE90
        monkeypatch.delenv("BLAZECORE_SM90_DHCUR")
        assert _moe_gpu._kernels(blazecore.BF16, "swiglu") is a
        monkeypatch.setenv("BLAZECORE_SM90_B_LOAD", "cp_async")
        assert _moe_gpu._kernels(blazecore.BF16, "swiglu").b_load == "cp_async"
        monkeypatch.delenv("BLAZECORE_SM90_B_LOAD")
        monkeypatch.setenv("BLAZECORE_NVRTC_OPTIONS", "-DBLZ_UNUSED=1")
        assert _moe_gpu._kernels(blazecore.BF16, "swiglu") is not a
        monkeypatch.delenv("BLAZECORE_NVRTC_OPTIONS")
        monkeypatch.setattr(_moe_gpu, "STAGES_DH90", _moe_gpu.STAGES_DH90 + 1)
        c = _moe_gpu._kernels(blazecore.BF16, "swiglu")
        assert c is not a and c.variant("dhcur").stages == _moe_gpu.STAGES_DH90
    with _array.dry_run("sm_80"):
        assert not _moe_gpu._kernels(blazecore.BF16, "swiglu").sm90


def test_argument_struct_values_out_of_range_are_refused():
    """A value that does not fit its field (a negative address, an int32 field past 2^31) is an OverflowError, not a
    silently wrapped field."""
    dt = _moe_args.K_GROUPED
    vals = {f: 1 for f in dt.names}
    with pytest.raises(OverflowError, match="out of range"):
        _moe_args.pack(dt, **{**vals, "A": -1})
    with pytest.raises(OverflowError, match="out of range"):
        _moe_args.pack(dt, **{**vals, "M": 2 ** 31})
    assert int(_moe_args.pack(dt, **{**vals, "lda": 2 ** 40})["lda"]) == 2 ** 40


def test_weight_gradient_addressing_width_follows_the_operand_extent():
    """The weight-gradient producer takes its 32-bit addressing only where every byte offset into the operand's rows
    (row count x row stride x element size, from its pointer) fits 32 bits; one byte more takes the 64-bit form."""
    def rows(n, ld, dt=np.float16):
        return _array.Placeholder((n, ld), dt)

    assert _moe_gpu._off32(rows(1024, 2048), 2048)
    assert _moe_gpu._off32(rows(2 ** 20, 2048), 2048)  # 2^32 bytes: the last copy starts at 2^32 - 16
    assert not _moe_gpu._off32(rows(2 ** 20 + 1, 2048), 2048)
    assert not _moe_gpu._off32(rows(2 ** 19, 2048, np.float32), 4096)  # a wider row stride than the view's width counts
    assert _moe_gpu._off32(rows(2 ** 18, 1024, np.float32), 4096)


def test_persistent_cluster_grid_takes_the_resident_clusters(monkeypatch):
    """The persistent 2-CTA weight gradients start as many clusters as the driver says are resident (never more than
    the tiles, at least one), and the full grid where it cannot say (0), so a cluster never waits for another wave."""
    monkeypatch.setattr(_array, "dry", lambda: None)
    kv = _moe_gpu.KernelVariant("f", "n", 384, 128, 256, 4, 230672)
    for resident, grid, want in ((66, 4096, 132), (66, 40, 40), (65, 4096, 130), (0, 4096, 4096), (66, 2, 2)):
        monkeypatch.setattr(_compile, "max_active_clusters", lambda fn, t, s, c, n=resident: n)
        assert _moe_gpu._persistent_cluster_grid(None, kv, grid, 2) == want, (resident, grid)


def test_cluster_occupancy_is_zero_without_a_driver(monkeypatch):
    """max_active_clusters answers 0 ("cannot say") where libcuda cannot be loaded, instead of raising."""
    def no_driver():
        raise OSError("libcuda.so.1: not found")

    monkeypatch.setattr(_compile, "libcuda", no_driver)
    monkeypatch.setattr(_compile, "_cluster_occupancy", {})

    class Fn:
        ptr = 12345

    assert _compile.max_active_clusters(Fn(), 384, 230672, 2) == 0


def test_tensor_maps_are_encoded_once_per_description(monkeypatch):
    """tiled_map asks the driver once per description: the same one again (NumPy integers for ints, lists for tuples)
    is a cache hit, another box a new map; a bad rank is a TmaError before the driver is asked."""
    from blazecore import _tma

    calls = []

    def encode(buf, dt, rank, addr, gdim, gstr, bdim, estr, interleave, swizzle, promo, fill):
        calls.append((addr.value, list(gdim), list(bdim)))
        return 0

    monkeypatch.setattr(_tma, "_encode", encode)
    monkeypatch.setattr(_tma, "_cache", type(_tma._cache)())
    a = _tma.tiled_map(4096, "bfloat16", (64, 128), (128,), (64, 16))
    b = _tma.tiled_map(np.uint64(4096), "bfloat16", [np.int64(64), 128], [128], (64, np.int32(16)))
    assert a is b and len(calls) == 1
    _tma.tiled_map(4096, "bfloat16", (64, 128), (128,), (64, 64))
    assert len(calls) == 2 and calls[1][2] == [64, 64]
    with pytest.raises(_tma.TmaError, match="rank"):
        _tma.tiled_map(4096, "bfloat16", (64, 128), (), (64, 16))
    assert len(calls) == 2
