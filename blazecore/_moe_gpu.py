"""GPU launchers for the expert FFN (``cuda/moe_gemm_sm80.cu``, ``moe_gemm_sm90.cu``, ``moe_wgrad_sm90.cu``,
``moe_helpers.cu``), called by :mod:`blazecore.moe`, and the layer's GPU
path (:func:`layer_forward`, :func:`layer_backward`: outputs, dispatch, launchers), which the memory model
(:mod:`blazecore.memory`) runs dry to count its allocations.

Every function here takes validated CuPy views (bf16 as uint16 storage), launches on ``stream`` and never
synchronises with the host: tile counts per expert live on the device (``moe_tile_offsets``), grids are
sized by the upper bound ``ceil(L*K / BM) + E`` and surplus tiles exit at once (the persistent sm_90a M-grouped
kernels get one CTA per SM and read the tile count on the device), so forward and backward can be captured in a
CUDA graph.

Buffers of one forward (L*K = number of (token, expert) slots, H2 = 2h gated or h):
  held for the backward:  checkpoint "ab": z (L*K, H2)       checkpoint "none": nothing
  transient:              hcur (L*K, h), o = g * (hcur w2^T) (L*K, w), w the widest column slice of y (o_slices)
and of one backward (all transient): z (policy "none"), dz (L*K, H2), g*hcur (L*K, h),
dgates partials (L*K, ceil(h/BN)) fp32, per-slot dx rows (L*K, w), w the widest column slice of dx (the whole d
unless d > 2 * dz's row width: see dx_slices). Policy "none" with h > d never has z or dz whole: its backward
runs per column slice of h (_backward_z_sliced), with the slice's z / dz (L*K, H2 * width / h), its g*hcur rows
and an fp32 (L, d) sum of dx.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np

from . import _array, _compile, _moe_args, _tma, _validate
from ._array import BF16, logical_dtype
from ._moe_common import (
    MoEGrads,
    MoESaved,
    Sizes,
    check_dispatch,
    check_gemm_path,
    check_gpu_device,
    chunk_bounds,
    grad_outs,
    split_activation,
    user,
)
from .dispatch import _validate_gpu, build_dispatch

_FILE = "moe_gemm_sm80.cu"  # the mma.sync GEMMs (every arch and dtype)
_FILE_HELPERS = "moe_helpers.cu"  # tile offsets, combine, dgates, bias gradients, token blocks, seen experts
_FILE90 = "moe_gemm_sm90.cu"  # the sm_90a M-grouped GEMMs
_FILE_WGRAD90 = "moe_wgrad_sm90.cu"  # the sm_90a weight-gradient GEMMs
_FILE_DH90 = "moe_dhcur_sm90.cu"  # the sm_90a dh' with its epilogue on the producer warpgroup
BN90 = 256  # sm_90a tiles: 128 x 256 (two consumer warpgroups of 64 rows), 384 threads, 1 CTA per SM
NTHREADS90 = 384
_ACT_IDS = {"swiglu": 0, "geglu": 1, "gelu": 2, "silu": 3, "relu2": 4, "swiglu_oai": 5}  # moe_common.cuh's Act
_GATED = {"swiglu", "geglu", "swiglu_oai"}
_GATED_IDS = {_ACT_IDS[a] for a in _GATED}
ACT_INTERLEAVED = 8  # moe_common.cuh's ACT_INTERLEAVED: or'ed into a gated Act id for interleaved gate/up rows


def act_base_id(act: int) -> int:
    """An Act id without ACT_INTERLEAVED (moe_common.cuh's act_base)."""
    return act & (ACT_INTERLEAVED - 1)

_CTYPES = {np.dtype(np.float32): "float", np.dtype(np.float16): "__half", BF16: "__nv_bfloat16"}
BM = BN = 128
STAGES = 4
NTHREADS = 256
MODE_M, MODE_K = 0, 1
EPI_ACT, EPI_ROWSCALE, EPI_DHCUR, EPI_WGRAD = 0, 1, 2, 3
_NULL = np.uint64(0)
# How the sm_90a M-grouped kernels load the weight operand B: "tma" (cp.async.bulk.tensor with a tensor map, one
# issuing thread per stage) or "cp_async" (16-byte copies by the 128 producer threads). The gathered A rows always
# come by cp.async. BLAZECORE_SM90_B_LOAD overrides the default for the layer; _Kernels takes it as an argument.
B_LOADS = ("tma", "cp_async")
B_LOAD = "tma"
# How the sm_90a EPI_ROWSCALE epilogues (gemm2, gemm2z, dx) and the weight gradients store the output tiles: "tma" (a
# TMA store a warp's 16 x 64 box, asynchronous) or "st_global" (16-byte stores by the warp's lanes); rows past an
# expert's slots of the M-grouped kernels always take the latter. BLAZECORE_SM90_OUT_STORE overrides it.
OUT_STORES = ("tma", "st_global")
OUT_STORE = "tma"
# The sm_90a weight gradients in 2-CTA clusters (moe_wgrad_sm90_x2): the CTAs of two m-tiles of one (expert, n-tile)
# each load half of the slot-indexed B tile by TMA and multicast it to both, halving the B bytes each SM reads from
# L2 (the m-tile count must be even, and the gathered rows not staged; else single CTAs). Both forms are persistent
# (one CTA per SM, or as many clusters as are resident, walk the tiles). BLAZECORE_SM90_CLUSTER ("1" or "2") overrides
# it.
WGRAD_CLUSTERS = (1, 2)
WGRAD_CLUSTER = 2


# Staging of gathered rows (sm_90a, weights by TMA): a GEMM whose gathered A rows (gemm1's x, the weight gradients'
# x and dy) are read by many n-tiles has them copied into slot order once (moe_gather_rows, an (L*K, d) transient)
# and then reads them by TMA like the slot-ordered A of gemm2 and dx; the copies of the in-kernel gather cost more
# than the staging once STAGE_MIN_TILES or more n-tiles read the rows (docs/sm90_kernels.md, "Staged rows").
# BLAZECORE_STAGE_ROWS = "auto" (that rule), "always" or "never" overrides STAGE_ROWS; the results have the same bits
# either way.
# How the sm_90a dh' runs its epilogue (activation backward, dz, g * hcur, dgates partials): "wide"
# (moe_dhcur_sm90 with six epilogue warps: the consumers leave dh' in shared memory and go on with the next tile while
# the other warps do the epilogue; 512 threads, two copy warps, the consumers' A from registers; weights by TMA only),
# "overlap" (the same kernel with three epilogue warps and one copy warp, 384 threads; same bits as "wide") or "fused"
# (moe_gemm_sm90's EPI_DHCUR: the consumers do it after their mainloop). "wide" is the default: on an H200 its dh' is
# 7-9% faster than "overlap" on olmoe, qwen3 and fine and the same on mixtral; on an H100 the two were within 0-2%
# (docs/sm90_kernels.md, "dh' with six epilogue warps"). BLAZECORE_SM90_DHCUR overrides DHCUR.
DHCUR_FORMS = ("overlap", "fused", "wide")
DHCUR = "wide"
DGATES_SMALL_PARTS = 8  # moe_dgates_small's most partials a slot (its DGATES_SMALL_PARTS)
STAGES_DH90 = 3  # moe_dhcur_sm90's ring: 3 stages of 48 KB beside dh' and the z rows, see sm90::DhCfg
DH_EPI_WARPS = {"overlap": 3, "wide": 6}  # moe_dhcur_sm90's EW: its epilogue warps (384 / 512 threads)
STAGE_ROWS_MODES = ("auto", "always", "never")
STAGE_ROWS = "auto"
STAGE_MIN_TILES = 32


def settings() -> dict:
    """The sm_90a kernel settings the environment gives (each the module default where unset), validated:
    b_load (BLAZECORE_SM90_B_LOAD, B_LOADS), out_store (BLAZECORE_SM90_OUT_STORE, OUT_STORES), stage_rows
    (BLAZECORE_STAGE_ROWS, STAGE_ROWS_MODES), wgrad_cluster (BLAZECORE_SM90_CLUSTER, WGRAD_CLUSTERS) and dhcur
    (BLAZECORE_SM90_DHCUR, DHCUR_FORMS). A value
    outside its list is a ValueError naming the variable and the list; the layer's entry points ask for them before
    any kernel runs."""

    def pick(var, default, allowed):
        v = os.environ.get(var) or str(default)
        if v not in allowed:
            raise ValueError(f"{var} must be one of {allowed}, got {v!r}")
        return v

    return {"b_load": pick("BLAZECORE_SM90_B_LOAD", B_LOAD, B_LOADS),
            "out_store": pick("BLAZECORE_SM90_OUT_STORE", OUT_STORE, OUT_STORES),
            "stage_rows": pick("BLAZECORE_STAGE_ROWS", STAGE_ROWS, STAGE_ROWS_MODES),
            "wgrad_cluster": int(pick("BLAZECORE_SM90_CLUSTER", WGRAD_CLUSTER, tuple(map(str, WGRAD_CLUSTERS)))),
            "dhcur": pick("BLAZECORE_SM90_DHCUR", DHCUR, DHCUR_FORMS)}


@dataclass(frozen=True)
class GemmSpec:
    """What one expert GEMM computes, as the kernels' template arguments: ``mode`` MODE_M (M-grouped: gathered or
    slot rows per expert) or MODE_K (K-grouped weight gradients); whether A and B are K-major; the epilogue (EPI_*)
    and its activation id; whether A's and B's rows are gathered through slot_token."""

    mode: int
    a_kmajor: bool
    b_kmajor: bool
    epi: int
    act: int
    a_gather: bool
    b_gather: bool


@dataclass(frozen=True)
class KernelVariant:
    """One compiled kernel and what its launch must match: the name expression (in ``file``), threads per CTA, the
    output tile (bm x bn), pipeline stages and dynamic shared memory. tests/test_kernel_config.py checks the sizes
    against the CUDA sources' constants."""

    file: str
    name: str
    threads: int
    bm: int
    bn: int
    stages: int
    smem: int


def _gemm_name(ct, v: GemmSpec):
    b = lambda x: "true" if x else "false"  # noqa: E731
    return (f"blz::moe_gemm<{ct}, {v.mode}, {b(v.a_kmajor)}, {b(v.b_kmajor)}, {v.epi}, {v.act}, {b(v.a_gather)}, "
            f"{b(v.b_gather)}>")


def _variants(act, t=False) -> dict[str, GemmSpec]:
    """The GEMMs of one (activation, weight layout) by role; ``t``: weights stored "in_out" (w13 (E, d, R), w2 (E, h,
    d)), which flips B's major-ness of the M-grouped GEMMs and swaps the operands of the weight gradients (dw13^T =
    x_g^T dz, dw2^T = (g hcur)^T dy_g); "in_out" and interleaved gate/up rows have no A_ACT second GEMM (gemm2z:
    act_in_operand keeps hcur)."""
    v = {
        "gemm1": GemmSpec(MODE_M, True, not t, EPI_ACT, act, True, False),  # z = x_g w13^T, act in epilogue
        "gemm2": GemmSpec(MODE_M, True, not t, EPI_ROWSCALE, 0, False, False),  # o = g (hcur w2^T + b2)
        "gemm2z": GemmSpec(MODE_M, True, not t, EPI_ROWSCALE, act, False, False),  # the same from z (sm_90a: A_ACT)
        "dhcur": GemmSpec(MODE_M, True, t, EPI_DHCUR, act, True, False),  # dh' = dy_g w2; act backward
        "dx": GemmSpec(MODE_M, True, t, EPI_ROWSCALE, 0, False, False),  # dx_s = dz w13
        "dw2": GemmSpec(MODE_K, False, False, EPI_WGRAD, 0, not t, t),  # dw2 = dy_g^T (g hcur)
        "dw13": GemmSpec(MODE_K, False, False, EPI_WGRAD, 0, t, not t),  # dw13 = dz^T x_g
        # sm_90a, with the gathered rows staged in slot order beforehand (_stage_rows): A read by TMA, not gathered
        "gemm1s": GemmSpec(MODE_M, True, not t, EPI_ACT, act, False, False),  # z = x_s w13^T
        "dw2s": GemmSpec(MODE_K, False, False, EPI_WGRAD, 0, False, False),  # dw2 = dy_s^T (g hcur)
        "dw13s": GemmSpec(MODE_K, False, False, EPI_WGRAD, 0, False, False),  # dw13 = dz^T x_s
    }
    if t or act & ACT_INTERLEAVED:
        del v["gemm2z"]
    return v


def _module_names(ct, act, t=False):
    return [_gemm_name(ct, v) for k, v in _variants(act, t).items() if k not in _SM90_ONLY]


def _helper_names(ct):
    staged = [f"blz::moe_gather_rows<{ct}, {v}>" for v in (8, 1)] if ct != "float" else []  # 16-bit: sm_90a only
    return ["blz::moe_tile_offsets", f"blz::moe_combine<{ct}>", f"blz::moe_dgates<{ct}>", f"blz::moe_bias_grad<{ct}>",
            "blz::moe_dgates_small", "blz::moe_block_starts", "blz::moe_mark_seen", *staged]


def _a_tiles90(act, a_act):
    """A tiles a stage of an sm_90a M-grouped kernel: 2 for a gated A_ACT GEMM (z's gate and up columns), else 1."""
    return 2 if a_act and act_base_id(act) in _GATED_IDS else 1


def _gemm90_name(ct, b_kmajor, epi, act, a_gather, b_tma=False, a_act=False, a_tma=False):
    b = lambda v: "true" if v else "false"  # noqa: E731
    stages = _stages90(BN90, _a_tiles90(act, a_act))
    return (f"blz::moe_gemm_sm90<{ct}, {b(b_kmajor)}, {epi}, {act}, {b(a_gather)}, {BN90}, {b(b_tma)}, {b(a_act)}, "
            f"{b(a_tma)}, {stages}>")


def _wgrad90_name(ct, a_gather, b_gather, out_t=False, carry_in=False, a_tma=False, b_tma=False, cluster=1):
    b = lambda v: "true" if v else "false"  # noqa: E731
    kernel = "moe_wgrad_sm90_x2" if cluster == 2 else "moe_wgrad_sm90"
    return (f"blz::{kernel}<{ct}, {b(a_gather)}, {b(b_gather)}, {BN90}, {b(out_t)}, {b(carry_in)}, "
            f"{b(a_tma)}, {b(b_tma)}, {_stages90(BN90)}>")


def _name90(ct, which, v, carry_in=False, b_load="cp_async", cluster=1, t=False):
    """The sm_90a kernel of one GEMM variant; ``carry_in``: the weight-gradient instantiation that continues
    the fp32 partial sums of an earlier chunk (its accumulator loads serialize wgmma, so it is kept apart);
    ``b_load``: how the dense operand is loaded (one of B_LOADS): B of an M-grouped kernel, the slot-indexed B of
    a weight-gradient kernel; ``cluster``: 2 for the weight gradients' 2-CTA cluster form (B by TMA, multicast);
    ``t``: weights stored "in_out" (the M-grouped GEMMs' B of the other major-ness, ``v``'s; the weight gradients'
    tiles stored the other way round, see _wgrad_out_t)."""
    b_kmajor, epi, act, a_gather = v.b_kmajor, v.epi, v.act, v.a_gather
    tma = b_load == "tma"
    if which == "gemm2z":
        return _gemm90_name(ct, b_kmajor, epi, act, a_gather, b_tma=tma, a_act=True)
    if which in _WGRAD:
        # the gathered rows (dy, x) are A, on the tile's 128-column side, by cp.async (staged in slot order: by TMA);
        # the slot-indexed operand (g * hcur, dz) is B, on the 256-column side, by TMA (b_load "tma"); dw13 = dz^T x_g
        # is computed as transposed tiles (x_g^T dz, stored as out[e][n][m])
        staged = which in _STAGED
        return _wgrad90_name(ct, not staged, False, out_t=_wgrad_out_t(which, t), carry_in=carry_in, a_tma=staged,
                             b_tma=tma, cluster=cluster if tma else 1)
    # a slot-ordered A beside a TMA B (the second GEMM's hcur, dx's dz) comes by TMA too
    return _gemm90_name(ct, b_kmajor, epi, act, a_gather, b_tma=tma, a_tma=tma and which in _A_TMA)


def _wgrad_out_t(which: str, t: bool) -> bool:
    """Whether an sm_90a weight-gradient launch stores its tiles transposed (out[e][n][m]): its tiles are x_g^T dz
    (dw13) and dy_g^T (g hcur) (dw2), so dw13 stored "out_in" (E, 2h, d) and dw2 stored "in_out" (E, h, d) are."""
    return which.startswith("dw13") != t


@functools.lru_cache(maxsize=None)  # asked for at every launch (and every launch of a dry run)
def _module_names90(ct, act, t=False):
    """The sm_90a M-grouped kernels of one (dtype, activation, weight layout; ``t``: "in_out"): one module of
    _FILE90."""
    variants = _variants(act, t)
    return tuple(dict.fromkeys(_name90(ct, k, v, b_load=b_load) for k, v in variants.items() if k in _M_GROUPED
                               for b_load in B_LOADS))


@functools.lru_cache(maxsize=None)
def _wgrad_names90(ct):
    """The sm_90a weight-gradient kernels of one dtype (activation-independent): one module of _FILE_WGRAD90."""
    variants = _variants(0)
    return tuple(dict.fromkeys(_name90(ct, k, variants[k], carry_in=carry_in, b_load=b_load, cluster=cluster)
                               for k in _WGRAD for carry_in in (False, True) for b_load in B_LOADS
                               for cluster in WGRAD_CLUSTERS))


def _dh90_name(ct, act, t=False, ew=3):
    """The sm_90a dh' kernel with the epilogue on the producer warpgroup; ``t``: w2 stored "in_out" (B K-major);
    ``ew``: its epilogue warps (3, or 6 for the "wide" form)."""
    if ew == 3:
        return f"blz::moe_dhcur_sm90<{ct}, {act}, {STAGES_DH90}{', true' if t else ''}>"
    return f"blz::moe_dhcur_sm90<{ct}, {act}, {STAGES_DH90}, {'true' if t else 'false'}, {ew}>"


def _dh_names90(ct, ew=3):
    """The sm_90a dh' kernels with the epilogue on the producer warpgroup (one per activation, each gated one also
    interleaved, and weight layout) of one form (``ew`` epilogue warps): one module of _FILE_DH90."""
    return tuple(_dh90_name(ct, a, t, ew) for a in _act_codes() for t in (False, True))


def _smem_dh90(stages=STAGES_DH90):
    """sm90::DhCfg<stages>::SMEM_BYTES: alignment slack, the ring (48 KB stages), dh' (128 rows of 512 bytes), the
    producer warps' z rows (4 warps x 4 rows x 1 KB), the mbarriers (2 per stage, dh-full, dh-empty, 16 z-row, 8
    tile-descriptor ones; the end rounded to 16 bytes) and 8 tile descriptors of 16 bytes."""
    nbar = 2 * stages + 2 + 16 + 8
    return 1024 + stages * 48 * 1024 + 128 * 512 + 4 * 4 * 1024 + -(-8 * nbar // 16) * 16 + 16 * 8


def _stages90(bn=BN90, a_tiles=1):
    """The stage ring's depth of an sm_90a kernel (its STAGES template argument): as many stages of a_tiles A tiles
    and one B tile of bn rows as fit beside the epilogue staging: 3 with two A tiles, else 4 at bn 256 and 6 at
    128."""
    return 3 if a_tiles == 2 else 4 if bn == 256 else 6


def _smem90(bn=BN90, a_tiles=1):
    """sm90::Cfg<bn, a_tiles, _stages90(bn, a_tiles)>::SMEM_BYTES: alignment slack, the stage ring (a_tiles A tiles of
    128 rows and one B tile of bn rows a stage, 128 bytes a row; 3 stages with two A tiles, else 4 at bn 256 and 6 at
    128), the 8 consumer warps' epilogue staging (4 KB each), the mbarriers (2 per stage, 1 epilogue-done, 8
    tile-descriptor ones; the end rounded to 16 bytes) and 8 tile descriptors of 16 bytes. Every sm_90a kernel has
    this layout (the weight gradients leave the epilogue-done barrier and the descriptors unused)."""
    stages = _stages90(bn, a_tiles)
    nbar = 2 * stages + 9
    return 1024 + stages * (128 * a_tiles + bn) * 128 + 8 * 4096 + -(-8 * nbar // 16) * 16 + 16 * 8


# The sm_90a M-grouped kernels: shared memory with the epilogue staging area, launched persistent (one CTA per SM).
# EPI_ACT and EPI_ROWSCALE stage their epilogue outside the stage ring, so the producer fills the next tile's
# stages during it; dh' (EPI_DHCUR) stages it in the ring and gains only the tile decode and the CTA launch.
_M_GROUPED = {"gemm1", "gemm2", "gemm2z", "dhcur", "dx", "gemm1s"}
_A_TMA = {"gemm2", "dx", "gemm1s"}  # M-grouped GEMMs whose A is in slot order (not gathered, not activated in the load)
_ROWSCALE = {"gemm2", "gemm2z", "dx"}  # the M-grouped GEMMs with the EPI_ROWSCALE epilogue (out by TMA stores)
_WGRAD = ("dw2", "dw13", "dw2s", "dw13s")  # the sm_90a weight-gradient kernels' roles
_STAGED = {"gemm1s": "gemm1", "dw2s": "dw2", "dw13s": "dw13"}  # roles on staged rows, and the role they stand for
_SM90_ONLY = {"gemm2z", *_STAGED}  # variants only the sm_90a kernels have
_SM_COUNT: dict[int, int] = {}


def _persistent_grid(grid):
    """At most one CTA per SM of the current device: each walks the device-side tile list of the sm_90a M-grouped
    kernel with a stride of the grid (any grid is correct; the full one gives each CTA one tile)."""
    if _array.dry() is not None:
        return int(grid)
    dev = _compile.current_device()
    n = _SM_COUNT.get(dev)
    if n is None:
        import cupy as cp

        n = _SM_COUNT[dev] = int(cp.cuda.Device(dev).attributes["MultiProcessorCount"])
    return max(1, min(int(grid), n))


def _persistent_cluster_grid(fn, kv, grid, cluster):
    """The persistent grid of a kernel in clusters of ``cluster`` CTAs: as many clusters as the device holds at once
    (a cluster past those would run its whole share after the others); the full grid (one tile a CTA) where the driver
    cannot say."""
    if _array.dry() is not None:
        return int(grid)
    n = _compile.max_active_clusters(fn, kv.threads, kv.smem, cluster)
    return int(grid) if n <= 0 else cluster * max(1, min(int(grid) // cluster, n))


def _act_codes():
    """Every Act id the kernels take: each activation, and each gated one interleaved."""
    return [*_ACT_IDS.values(), *(_ACT_IDS[a] | ACT_INTERLEAVED for a in sorted(_GATED))]


_compile.register_kernels(
    _FILE90, [n for ct in ("__nv_bfloat16", "__half") for a in _act_codes() for t in (False, True)
              for n in _module_names90(ct, a, t)]
)
_compile.register_kernels(_FILE_WGRAD90, [n for ct in ("__nv_bfloat16", "__half") for n in _wgrad_names90(ct)])
_compile.register_kernels(_FILE_DH90, [n for ct in ("__nv_bfloat16", "__half") for ew in DH_EPI_WARPS.values()
                                      for n in _dh_names90(ct, ew)])
_compile.register_kernels(_FILE_HELPERS, list(dict.fromkeys(n for ct in _CTYPES.values() for n in _helper_names(ct))))

_compile.register_kernels(
    _FILE, list(dict.fromkeys(n for ct in _CTYPES.values() for a in _act_codes() for t in (False, True)
                              for n in _module_names(ct, a, t)))
)


def _smem_bytes(itemsize, a_kmajor, b_kmajor):
    bk, pad = 64 // itemsize, 16 // itemsize
    a = BM * (bk + pad) if a_kmajor else bk * (BM + pad)
    b = BN * (bk + pad) if b_kmajor else bk * (BN + pad)
    return STAGES * (a + b) * itemsize


def wgmma_asked(path=None) -> bool:
    """Whether a call with ``gemm_path=path`` asks for the wgmma kernels (they run where the GPU is a Hopper and the
    dtype and weight layout allow): "wgmma", or None unless the environment sets BLAZECORE_SM90=0."""
    check_gemm_path(path)
    return path == "wgmma" if path is not None else os.environ.get("BLAZECORE_SM90", "1") != "0"


class _Kernels:
    """The compiled functions for one (dtype, activation, weight layout)."""

    def __init__(self, dtype, activation, b_load=None, weight_layout="out_in", path=None):
        base, self.interleaved = split_activation(activation)
        self.t = weight_layout == "in_out"  # weights stored (E, in, out)
        self.ct = _CTYPES[np.dtype(dtype)]
        self.act = _ACT_IDS[base] | (ACT_INTERLEAVED if self.interleaved else 0)
        self.itemsize = np.dtype(dtype).itemsize
        self.names = _module_names(self.ct, self.act, self.t)
        self.variants = _variants(self.act, self.t)
        self.gated = base in _GATED
        st = settings()
        self.b_load = b_load or st["b_load"]
        if self.b_load not in B_LOADS:
            raise ValueError(f"b_load must be one of {B_LOADS}, got {self.b_load!r}")
        self.out_store, self.stage_rows, self.wgrad_cluster = st["out_store"], st["stage_rows"], st["wgrad_cluster"]
        self.dhcur = st["dhcur"]
        # path (GEMM_PATHS): wgmma kernels on Hopper for 16-bit types unless "mma_sync"; None: BLAZECORE_SM90=0
        # selects the mma.sync kernels (a dry run follows its own arch only: the memory model is a function of its
        # arguments) (the wgmma kernels read every weight layout: "out_in" or "in_out", [gate; up] or interleaved rows)
        if path is None and _array.dry() is not None:
            wgmma = True  # a dry run follows its own arch only
        else:
            wgmma = wgmma_asked(path)
        self.sm90 = self.itemsize == 2 and _compile.device_arch() == "sm_90a" and wgmma
        self._memo: dict = {}  # variant / gemm / fn lookups by their arguments

    def fn(self, name):
        """One of the small kernels (moe_helpers.cu) for this dtype."""
        f = self._memo.get(name)
        if f is None:
            f = self._memo[name] = _compile.get_function(_FILE_HELPERS, name, module_names=_helper_names(self.ct))
        return f

    def variant(self, which, carry_in=False, b_load=None, cluster=1) -> KernelVariant:
        """The kernel of one GEMM role on this device's path; ``b_load`` overrides the kernels' dense-operand load
        for this launch and ``cluster`` picks the weight gradients' 2-CTA form (sm_90a)."""
        key = ("variant", which, carry_in, b_load, cluster)
        kv = self._memo.get(key)
        if kv is None:
            kv = self._memo[key] = self._variant(which, carry_in, b_load, cluster)
        return kv

    def _variant(self, which, carry_in, b_load, cluster) -> KernelVariant:
        v = self.variants[which]
        if self.sm90 and which == "dhcur" and (b_load or self.b_load) == "tma" and self.dhcur in DH_EPI_WARPS:
            ew = DH_EPI_WARPS[self.dhcur]
            return KernelVariant(_FILE_DH90, _dh90_name(self.ct, self.act, self.t, ew),
                                 NTHREADS90 if ew == 3 else NTHREADS90 + 128, BM, BN90, STAGES_DH90, _smem_dh90())
        if self.sm90:
            a_tiles = _a_tiles90(self.act, which == "gemm2z")
            file = _FILE90 if which in _M_GROUPED else _FILE_WGRAD90
            name = _name90(self.ct, which, v, carry_in, b_load or self.b_load, cluster, self.t)
            return KernelVariant(file, name, NTHREADS90, BM, BN90, _stages90(BN90, a_tiles), _smem90(BN90, a_tiles))
        return KernelVariant(_FILE, _gemm_name(self.ct, v), NTHREADS, BM, BN, STAGES,
                             _smem_bytes(self.itemsize, v.a_kmajor, v.b_kmajor))

    def module_names(self, kv: KernelVariant):
        """The name expressions of the module (one NVRTC program of ``kv.file``) that holds ``kv``'s kernel."""
        if kv.file == _FILE90:
            return _module_names90(self.ct, self.act, self.t)
        if kv.file == _FILE_WGRAD90:
            return _wgrad_names90(self.ct)
        if kv.file == _FILE_DH90:
            return _dh_names90(self.ct, DH_EPI_WARPS[self.dhcur])
        return self.names

    def gemm(self, which, carry_in=False, b_load=None, cluster=1):
        """(compiled function, :class:`KernelVariant`) of one GEMM role (see :meth:`variant`)."""
        key = ("gemm", which, carry_in, b_load, cluster)
        got = self._memo.get(key)
        if got is None:
            kv = self.variant(which, carry_in, b_load, cluster)
            got = self._memo[key] = (_compile.get_function(kv.file, kv.name, module_names=self.module_names(kv),
                                                           max_dynamic_smem=kv.smem), kv)
        return got

    def tiles_n(self, which, n, gated=False):
        bn = self.variant(which).bn
        return -(-n // (bn // 2)) if gated else -(-n // bn)


_KERNELS: dict = {}  # _kernels' instances
_KERNELS_MAX = 64


def _kernels(dtype, activation, b_load=None, weight_layout="out_in", path=None) -> _Kernels:
    """The :class:`_Kernels` of a layer call: one instance (and its looked-up kernels) shared by every call that
    agrees on all that its lookups read: the arguments, the kernel settings and BLAZECORE_SM90 /
    BLAZECORE_NVRTC_OPTIONS in the environment, the current device (or the dry run's arch) and the module's tile
    constants."""
    run = _array.dry()
    key = (np.dtype(dtype), activation, b_load, weight_layout, path, tuple(settings().values()),
           os.environ.get("BLAZECORE_SM90"), os.environ.get("BLAZECORE_NVRTC_OPTIONS"),
           ("dry", run.arch) if run is not None else _compile.current_device(),
           BM, BN, STAGES, NTHREADS, BN90, NTHREADS90, STAGES_DH90, _smem_dh90, _stages90, _smem90, _smem_bytes)
    k = _KERNELS.get(key)
    if k is None:
        k = _Kernels(dtype, activation, b_load, weight_layout, path)
        if len(_KERNELS) >= _KERNELS_MAX:
            _KERNELS.clear()
        _KERNELS[key] = k
    return k


def _ptr(a):
    return _NULL if a is None else a


def _stage_rows(kern, n_tiles: int) -> bool:
    """Whether the gathered rows that ``n_tiles`` output n-tiles read (over every launch that shares them) are staged
    in slot order first (see STAGE_ROWS; ``kern.stage_rows``). A function of the shapes and the settings only, so a dry
    run (the memory model) allocates what the real call does."""
    mode = kern.stage_rows
    if not (kern.sm90 and kern.b_load == "tma") or mode == "never":
        return False
    return mode == "always" or n_tiles >= STAGE_MIN_TILES


class _Staged:
    """A gathered operand's rows in slot order, (L*K, width): filled by the first launch that reads them (so a
    benchmark timing the launchers counts the staging with that GEMM), then read by every launch given it."""

    def __init__(self, LK: int, width: int, dtype):
        self.rows = _array.empty_gpu((LK, width), dtype).view
        self.filled = False

    def fill(self, kern, src, ld_src, disp, stream):
        if self.filled:
            return self.rows
        LK, width = self.rows.shape
        if LK and _array.dry() is None:
            vec = 8 if src.data.ptr % 16 == 0 and ld_src % 8 == 0 and width % 8 == 0 else 1
            kern.fn(f"blz::moe_gather_rows<{kern.ct}, {vec}>")(
                (-(-LK // 8),), (256,), (src, np.int64(ld_src), disp.slot_token, np.int64(LK), np.int32(width),
                                         self.rows), stream=stream)
        self.filled = True
        return self.rows


def _b_map(kern, which, B, ldb, b_estride, E, N, Kd, up=0):
    """The tensor map of an M-grouped kernel's B operand (see moe_gemm_sm90's tmap_b), or a null map when B comes
    by cp.async. K-major B (E, [2,] N, Kd): 4-D (Kd, N, halves, E), box (64, BN/2), the halves ``up`` rows apart
    (0: N; a gated launch over a column slice of h passes h); N-major (E, Kd, N): 3-D (N, Kd, E), box (64, 64), or
    gated ("in_out" w13) 4-D (N, halves, Kd, E), box (64, 1, 64), the halves ``up`` columns apart. Interleaved
    gate/up rows take the plain maps over their 2w rows (columns), the caller's N. Encoded on the host (no device
    work) and cached per pointer and shape."""
    if kern.b_load != "tma" or getattr(_array, "dry", lambda: None)() is not None:
        return _tma.null_map()
    dt = "bfloat16" if kern.ct == "__nv_bfloat16" else "float16"
    es = kern.itemsize
    halves = 2 if _STAGED.get(which, which) == "gemm1" and kern.gated and not kern.interleaved else 1
    if kern.variants[which].b_kmajor:
        return _tma.tiled_map(B.data.ptr, dt, (Kd, N, halves, E), (ldb * es, (up or N) * ldb * es, b_estride * es),
                              (64, BN90 // 2, 1, 1))
    if halves == 2:
        return _tma.tiled_map(B.data.ptr, dt, (N, 2, Kd, E), ((up or N) * es, ldb * es, b_estride * es), (64, 1, 64, 1))
    return _tma.tiled_map(B.data.ptr, dt, (N, Kd, E), (ldb * es, b_estride * es), (64, 64, 1))


def _rows_map(kern, X, ldx, cols, box_rows):
    """The tensor map of an operand X read in slot order, rows by rows (the M-grouped kernels' A, moe_gemm_sm90's
    tmap_a, box (64, 128); the weight-gradient kernels' slot-indexed B and staged A, moe_wgrad_sm90's tmap_b / tmap_a,
    box (64, 64)), or of an output the epilogue stores by TMA (box (64, 16), see _out_map): 2-D (cols, rows of X),
    128-byte swizzle; None where X cannot go by TMA (a dry run, cp.async loads asked for, an address or row stride the
    copy engine cannot take, no rows), and the launch uses the copies by threads instead."""
    es = kern.itemsize
    if kern.b_load != "tma" or _array.dry() is not None or X.data.ptr % 16 or (ldx * es) % 16 or X.shape[0] == 0:
        return None
    dt = "bfloat16" if kern.ct == "__nv_bfloat16" else "float16"
    return _tma.tiled_map(X.data.ptr, dt, (cols, X.shape[0]), (ldx * es,), (64, box_rows))


def _out_map(kern, role, out, ldo, N):
    """tmap_o of an M-grouped launch: the tensor map the EPI_ROWSCALE epilogue (gemm2, gemm2z, dx) stores ``out`` by
    (OUT_STORE "tma"), boxes of 64 columns x 16 rows, 128-byte swizzle; a null map where it cannot be made (the kernel
    then stores with 16-byte copies) and for the other epilogues."""
    if kern.out_store != "tma" or role not in _ROWSCALE:
        return _tma.null_map()
    m = _rows_map(kern, out, ldo, N, 16)
    return _tma.null_map() if m is None else m


def _wgrad_out_map(kern, which, out, ldo, o_estride, E, M, N):
    """tmap_o of a weight-gradient launch: out (E, M, N) with row stride ``ldo`` and expert stride ``o_estride``, as
    3-D (N, M, E), box (64, 16, 1), 128-byte swizzle, or for transposed tiles (out[e][n][m], _wgrad_out_t) (M, N, E),
    box (16, 64, 1), no swizzle (32-byte rows). A null map (the kernel then stores by threads) where the copy engine
    cannot take it: stores by threads asked for (OUT_STORE "st_global"), a dry run, or an address or stride that is
    not 16-byte aligned."""
    es = kern.itemsize
    if (kern.out_store != "tma" or _array.dry() is not None or out.data.ptr % 16 or (ldo * es) % 16
            or (o_estride * es) % 16 or min(M, N, E) <= 0):
        return _tma.null_map()
    dt = "bfloat16" if kern.ct == "__nv_bfloat16" else "float16"
    if _wgrad_out_t(which, kern.t):
        dims, box, swizzle = (M, N, E), (16, 64, 1), _tma.SWIZZLE_NONE
    else:
        dims, box, swizzle = (N, M, E), (64, 16, 1), _tma.SWIZZLE_128B
    try:
        return _tma.tiled_map(out.data.ptr, dt, dims, (ldo * es, max(o_estride, 1) * es), box, swizzle)
    except _tma.TmaError:
        return _tma.null_map()


GEMM_LAUNCHERS = ("_launch_m", "_launch_k")  # the launchers of every expert GEMM (the benchmarks time them)


def _launch_m(kern, which, grid, stream, *, A, lda, B, ldb, b_estride, disp, tile_offsets, E, N, Kd, out, ldo,
              up=0, out2=None, ldo2=0, aux=None, ldaux=0, bias=None, bias_estride=0, gates=None, topk=1, part=None,
              part_ld=0, store_h=False, store_z=False, stage=None):
    """One M-grouped GEMM (gemm1, gemm2, gemm2z, dhcur, dx; gemm1s with ``stage``, a :class:`_Staged` that A's
    gathered rows are staged into first): its MGroupedArgs (moe_args.cuh; ``up`` and ``store_h`` / ``store_z`` as
    documented there) and, on sm_90a, its tensor maps."""
    if stage is not None:
        A = stage.fill(kern, A, lda, disp, stream)
        lda = A.shape[1]
    args = _moe_args.pack(
        _moe_args.M_GROUPED, A=A, B=B, slot_token=disp.slot_token, slot_k=disp.slot_k, offsets=disp.expert_offsets,
        tile_offsets=tile_offsets, out=out, out2=out2, aux=aux, bias=bias, gates=gates, part=part, lda=lda, ldb=ldb,
        b_estride=b_estride, ldo=ldo, ldo2=ldo2, ldaux=ldaux, bias_estride=bias_estride, up=up, num_experts=E, N=N,
        Kd=Kd, topk=topk, part_ld=part_ld, store_h=store_h, store_z=store_z)
    extra, b_load = (), None
    if kern.sm90 and kern.variant(which).file == _FILE_DH90:  # dh' with its epilogue on the producer: B's map only
        # z's rows go by 16-byte cp.async copies: the layer's z (and its 256-column slices) always is 16-byte aligned
        if _array.dry() is None and (aux.data.ptr % 16 or (ldaux * kern.itemsize) % 16):
            raise RuntimeError("dh': z's rows are not 16-byte aligned")
        grid = _persistent_grid(grid)
        extra = (_b_map(kern, which, B, ldb, b_estride, E, N, Kd),)
    elif kern.sm90:
        grid = _persistent_grid(grid)
        amap = _rows_map(kern, A, lda, Kd, BM) if which in _A_TMA else None
        if which in _A_TMA and amap is None:
            b_load = "cp_async"  # the A_TMA kernels take B by TMA too: both by cp.async
        # gemm1: B's up half ``up`` rows after the gate rows (0: N); interleaved gate/up rows: one part of 2 N rows
        g1 = _STAGED.get(which, which) == "gemm1"
        bmap = _b_map(kern, which, B, ldb, b_estride, E, 2 * N if g1 and kern.interleaved else N, Kd,
                      up if g1 else 0) if b_load is None else _tma.null_map()
        # EPI_ROWSCALE (gemm2, gemm2z, dx): out by TMA stores, box (64, 16), where out can go so
        omap = _out_map(kern, _STAGED.get(which, which), out, ldo, N)
        extra = (bmap, _tma.null_map() if amap is None else amap, omap)  # the kernel's tmap_b, tmap_a, tmap_o
    fn, kv = kern.gemm(which, b_load=b_load)
    fn((int(grid),), (kv.threads,), (args, *extra), shared_mem=kv.smem, stream=stream)


def _off32(a, ld) -> bool:
    """Whether every byte offset into the rows of ``a`` (row stride ``ld`` elements) from its pointer fits 32 bits:
    the weight-gradient producer then addresses a copy's source with one 32-bit multiply-add. (A 16-byte copy of the
    last row starts at most rows * ld bytes - 16 in.)"""
    return a.shape[0] * int(ld) * a.dtype.itemsize <= 2 ** 32


def _launch_k(kern, which, grid, stream, *, A, lda, B, ldb, disp, E, M, N, out, ldo, o_estride, kblocks,
              num_kblocks, carry=None, carry_seen=None, flags=0, stage=None):
    """One K-grouped GEMM (dw13, dw2; dw13s, dw2s with ``stage``, a :class:`_Staged` that A's gathered rows are
    staged into first, or were by an earlier launch): its KGroupedArgs (moe_args.cuh) and, on sm_90a, its tensor
    maps. With a ``carry``, ``flags`` is the chunk's position in the backward: 1 continues an earlier chunk's sums, 2
    keeps them for a later one."""
    if stage is not None:
        A = stage.fill(kern, A, lda, disp, stream)
        lda = A.shape[1]
    carry_in = carry is not None and bool(flags & 1)
    carry_out = carry is not None and bool(flags & 2)
    args = _moe_args.pack(
        _moe_args.K_GROUPED, A=A, B=B, slot_token=disp.slot_token, offsets=disp.expert_offsets, kblocks=kblocks,
        out=out, carry=carry, carry_seen=carry_seen, lda=lda, ldb=ldb, ldo=ldo, o_estride=o_estride, num_experts=E,
        M=M, N=N, num_kblocks=num_kblocks, carry_in=carry_in, carry_out=carry_out, a_off32=_off32(A, lda),
        b_off32=_off32(B, ldb))
    extra, b_load, cluster = (), None, 1
    if kern.sm90:  # B (by slot) by TMA where it can go so; staged A rows by TMA
        bmap = _rows_map(kern, B, ldb, N, 64)
        b_load = "tma" if bmap is not None else "cp_async"
        amap = _rows_map(kern, A, lda, M, 64) if which in _STAGED else None
        if which in _STAGED and amap is None and _array.dry() is None:
            raise RuntimeError(f"{which}: the staged rows cannot be read by TMA")  # a fresh buffer always can
        # out by TMA stores, the warp's 16 rows x 64 columns a box, where out can go so (tmap_o)
        omap = _wgrad_out_map(kern, which, out, ldo, o_estride, E, M, N)
        extra = (_tma.null_map() if amap is None else amap, _tma.null_map() if bmap is None else bmap, omap)
        # 2-CTA clusters multicasting B: the CTAs of m-tiles 2j and 2j + 1 pair up where every expert has an even
        # number of m-tiles (the grid's grouped order then puts them side by side)
        # (the staged-row roles, A by TMA too, measured 2-3% slower so: single CTAs)
        cluster = kern.wgrad_cluster if b_load == "tma" and which not in _STAGED and (-(-M // BM)) % 2 == 0 else 1
    fn, kv = kern.gemm(which, carry_in=carry_in, b_load=b_load, cluster=cluster)
    # persistent: at most one CTA per SM (or as many clusters as are resident at once) walk the tiles; a launch that
    # continues an earlier chunk's sums runs one CTA a tile (it loads them before its tile loop, see moe_wgrad_sm90)
    if kern.sm90 and not carry_in:
        grid = _persistent_grid(grid) if cluster == 1 else _persistent_cluster_grid(fn, kv, grid, cluster)
    fn((int(grid),), (kv.threads,), (args, *extra), shared_mem=kv.smem, stream=stream)


def _acc_mode(i: int, n: int) -> int:
    """moe_combine's acc_mode for part i of n summed into one fp32 buffer: 1 the first, 3 the last (rounded into
    the output), else 2; 0 when there is a single part (it goes straight to the output)."""
    return 0 if n == 1 else 1 if i == 0 else 3 if i == n - 1 else 2


def _combine(kern, rows, disp, K, out, d, stream, acc=None, mode=0):
    """out[t] (+)= sum_k rows[pair_slot[t, k]] in a fixed order (moe_combine): rows (L*K, w) per-slot rows, out an
    (L, >= w) view with row stride d; with ``acc`` an fp32 (L, >= w) view summed into as ``mode`` says
    (_acc_mode)."""
    w = rows.shape[1]
    kern.fn(f"blz::moe_combine<{kern.ct}>")((out.shape[0],), (128,),
                                            (rows, np.int64(rows.shape[0]), disp.pair_slot, np.int32(K), np.int32(w),
                                             out, np.int64(d), _NULL if acc is None else acc, np.int32(mode)),
                                            stream=stream)


def sum_rows(rows, index, out, stream):
    """out[i] = sum_j rows[index[i, j]] over the entries in [0, n) (blazecore.sum_rows; moe_combine, one block a
    row): rows (n, w) C-contiguous, index (m, J) int32, out (m, w) C-contiguous, m > 0."""
    ct = _CTYPES[np.dtype(_array.logical_dtype(rows))]
    fn = _compile.get_function(_FILE_HELPERS, f"blz::moe_combine<{ct}>", module_names=_helper_names(ct))
    with _array.device_scope(rows.device.id):
        fn((out.shape[0],), (128,), (rows, np.int64(rows.shape[0]), index, np.int32(index.shape[1]),
                                     np.int32(rows.shape[1]), out, np.int64(rows.shape[1]), _NULL, np.int32(0)),
           stream=stream)


def _tile_offsets(kern, disp, E, stream):
    t = _array.empty_gpu((E + 1,), np.int32).view
    kern.fn("blz::moe_tile_offsets")((1,), (1024,), (disp.expert_offsets, np.int32(E), np.int32(BM), t), stream=stream)
    return t


def _m_grid(LK, E, tiles_n):
    return (-(-LK // BM) + E) * tiles_n


def check_shapes(x, w2):
    """GPU-path constraints beyond the public checks: 16-byte aligned rows."""
    d, h = x.shape[1], w2.shape[2]
    if d % 8 or h % 8:
        raise ValueError(f"the GPU kernels need d and h to be multiples of 8 (16-byte rows); got d={d}, h={h}")


def check_aligned(rows: dict, pairs: dict | None = None) -> None:
    """GPU-path constraints on where operands start: ``rows`` (the matrices the kernels copy 16 bytes at a time and
    read by tensor maps) on a 16-byte boundary, ``pairs`` (the biases, read two elements at a time) on a boundary of
    two elements."""
    _validate.check_aligned(rows, 16)
    for name, b in (pairs or {}).items():
        if b is not None:
            _validate.check_aligned({name: b}, 2 * b.dtype.itemsize)


def _gemm1(kern, x, w13, b13, disp, tile_offsets, E, LK, h, hbuf, zbuf, stream, c0=0, w=None):
    """hcur (into hbuf, (L*K, h)) and / or z (into zbuf, (L*K, H2)); with ``w``, only the columns [c0, c0 + w) of h:
    zbuf is then (L*K, w * (2 if gated else 1)) in z's column order (gate then up, or interleaved pairs)."""
    w = h if w is None else w
    d = x.shape[1]
    H2 = w13.shape[2 if kern.t else 1]
    r0 = 2 * c0 if kern.interleaved else c0  # the slice's first row of w13 (first column "in_out") and of b13
    up = h if kern.gated and not kern.interleaved and w != h else 0  # its up half's rows: h after the gate rows
    ldh = h if hbuf is None else hbuf.shape[1]
    tiles_n = kern.tiles_n("gemm1", w, gated=kern.gated)
    stage = _Staged(LK, d, logical_dtype(x)) if _stage_rows(kern, tiles_n) else None  # x's rows in slot order
    # w13 (E, H2, d): K-major rows of d; "in_out" (E, d, H2): N-major, k-rows of H2
    _launch_m(kern, "gemm1" if stage is None else "gemm1s", _m_grid(LK, E, tiles_n), stream, A=x, lda=d, stage=stage,
              B=w13[:, :, r0:] if kern.t else w13[:, r0:], ldb=H2 if kern.t else d, b_estride=H2 * d,
              disp=disp, tile_offsets=tile_offsets, E=E, N=w, Kd=d,
              out=hbuf if hbuf is not None else zbuf, ldo=ldh, up=up, out2=zbuf,
              ldo2=H2 if zbuf is None else zbuf.shape[1], bias=None if b13 is None else b13[:, r0:],
              bias_estride=H2, store_h=hbuf is not None, store_z=zbuf is not None)


def _dims(x, w13, w2, gates, t=False):
    """(L, d, E, h, K, L*K, H2, dtype) of one layer call (``t``: weights stored "in_out")."""
    L, d = x.shape
    E, h = w2.shape[0], w2.shape[1 if t else 2]
    K = gates.shape[1]
    return L, d, E, h, K, L * K, w13.shape[2 if t else 1], logical_dtype(x)


def forward(x, w13, w2, gates, chunks, activation, checkpoint, b13, b2, y, stream, weight_layout="out_in",
            act_in_operand=False, gemm_path=None):
    """y = combine_k g * expert(x), chunk by chunk; returns (z_user or None, extra).

    ``chunks`` lists (t0, t1, dispatch of expert_ids[t0:t1]) covering [0, L) in order. The transients (hcur and
    o, (Lc*K, h) and (Lc*K, d)) are allocated per chunk and freed before the next one, so the forward's peak
    scales with the largest chunk. z (checkpoint "ab") is one (L*K, H2) buffer: rows [t0*K, t1*K) hold chunk
    (t0, t1)'s pre-activations in that chunk's expert-slot order.
    """
    stream = _array.current_stream(stream)
    t = weight_layout == "in_out"
    L, d, E, h, K, LK, H2, dt = _dims(x, w13, w2, gates, t)
    z = _array.empty_gpu((LK, H2), dt) if checkpoint == "ab" else None
    if L == 0:
        return (z.user if z is not None else None), {}
    kern = _kernels(dt, activation, weight_layout=weight_layout, path=gemm_path)
    for t0, t1, disp in chunks:
        zc = _rows(z.view, t0, t1, L, K) if z is not None else None
        _forward_chunk(kern, _rows(x, t0, t1, L), w13, w2, _rows(gates, t0, t1, L), disp, b13, b2,
                       _rows(y, t0, t1, L), zc, stream, act_in_operand)
    return (z.user if z is not None else None), {"z_view": z.view if z is not None else None}


def _rows(a, t0: int, t1: int, L: int, per: int = 1):
    """The rows [t0 * per, t1 * per) of ``a``: ``a`` itself when the chunk is all L tokens (no view to make)."""
    return a if t0 == 0 and t1 == L else a[t0 * per:t1 * per]


def _forward_chunk(kern, x, w13, w2, gates, disp, b13, b2, y, z, stream, act_in_operand=False):
    L, d, E, h, K, LK, H2, dt = _dims(x, w13, w2, gates, kern.t)
    tile_offsets = _tile_offsets(kern, disp, E, stream)
    if z is None and h > d:
        _forward_h_sliced(kern, x, w13, w2, gates, disp, tile_offsets, b13, b2, y, stream)
        return
    # (moe_forward's act_in_operand; the A_ACT second GEMM reads "out_in" [gate; up] weights: the others keep hcur)
    fused = act_in_operand and kern.sm90 and z is not None and "gemm2z" in kern.variants
    if fused:  # z only; the second GEMM activates its A tiles (z) in registers
        _gemm1(kern, x, w13, b13, disp, tile_offsets, E, LK, h, None, z, stream)
        a, lda = z, H2
    else:
        a = _array.empty_gpu((LK, h), dt).view
        _gemm1(kern, x, w13, b13, disp, tile_offsets, E, LK, h, a, z, stream)
        lda = h
    # o = g * (hcur w2^T) per slot, then the deterministic combine into y, in column slices of d (o_slices): each
    # element is computed as in one slice, and the per-slot rows take (L*K, width) beside hcur (or z)
    sl = o_slices(d)
    obuf = _array.empty_gpu((LK * max(c1 - c0 for c0, c1 in sl),), dt).view
    for i, (c0, c1) in enumerate(sl):
        w = c1 - c0
        rows = obuf[:LK * w].reshape(LK, w)
        # w2 (E, d, h): rows c0.. of d, K-major; "in_out" (E, h, d): columns c0.., N-major
        _launch_m(kern, "gemm2z" if fused else "gemm2", _m_grid(LK, E, kern.tiles_n("gemm2", w)), stream, A=a,
                  lda=lda, B=w2[:, :, c0:] if kern.t else w2[:, c0:], ldb=d if kern.t else h, b_estride=d * h,
                  disp=disp, tile_offsets=tile_offsets, E=E, N=w, Kd=h, out=rows, ldo=w,
                  bias=None if b2 is None else b2[:, c0:], bias_estride=d, gates=gates, topk=K)
        if i == len(sl) - 1:
            del a
        _combine(kern, rows, disp, K, y[:, c0:], d, stream)


def _forward_h_sliced(kern, x, w13, w2, gates, disp, tile_offsets, b13, b2, y, stream):
    """Checkpoint "none" where h > d: the forward per column slice [c0, c1) of h (h_slices, lean), so hcur (L*K, h)
    never exists, only the slice's (L*K, width): hcur's slice (gemm1 on the slice's rows of w13), then its share
    g * (hcur_s w2_s^T) of each slot's output row (the bias b2 with the first slice), combined into an fp32 (L, d)
    sum in a fixed order (slice by slice) and rounded once. y is as accurate as the unsliced forward's and
    bit-identical run to run and chunked as unchunked, but may differ from it (and from checkpoint "ab") in the last
    bit, as dx of the z-sliced backward does."""
    L, d, E, h, K, LK, H2, dt = _dims(x, w13, w2, gates, kern.t)
    slices = h_slices(h, d, lean=True)
    hbuf = _array.empty_gpu((LK * max(c1 - c0 for c0, c1 in slices),), dt).view
    sl = o_slices(d)
    obuf = _array.empty_gpu((LK * max(e1 - e0 for e0, e1 in sl),), dt).view
    acc = _array.empty_gpu((L, d), np.float32).view
    for si, (c0, c1) in enumerate(slices):
        w = c1 - c0
        hs = hbuf[:LK * w].reshape(LK, w)
        _gemm1(kern, x, w13, b13, disp, tile_offsets, E, LK, h, hs, None, stream, c0=c0, w=w)
        mode = _acc_mode(si, len(slices))
        for e0, e1 in sl:
            we = e1 - e0
            rows = obuf[:LK * we].reshape(LK, we)
            # w2 (E, d, h): rows e0.. of d, columns c0.. of h, K-major; "in_out" (E, h, d): N-major
            _launch_m(kern, "gemm2", _m_grid(LK, E, kern.tiles_n("gemm2", we)), stream, A=hs, lda=w,
                      B=w2[:, c0:, e0:] if kern.t else w2[:, e0:, c0:], ldb=d if kern.t else h, b_estride=d * h,
                      disp=disp, tile_offsets=tile_offsets, E=E, N=we, Kd=w, out=rows, ldo=we,
                      bias=None if b2 is None or si > 0 else b2[:, e0:], bias_estride=d, gates=gates, topk=K)
            _combine(kern, rows, disp, K, y[:, e0:], d, stream, acc[:, e0:], mode)
    del hbuf, obuf, acc


class _Carry:
    """fp32 partial sums of the weight and bias gradients between the chunks of one backward.

    Each K-grouped CTA owns a private (128 x BN) slice of its gradient's carry (each launch of a gradient its own
    run of slices: ``dw13_at(i)``, ``dw2_at(i)``, launch i of :func:`wgrad_grids`' order); ``seen[e]`` records
    whether expert e had a slot in an earlier chunk (so its carried sums hold a value; an expert's first slots
    start a fresh sum, as in the unchunked run).
    """

    def __init__(self, kern, E, d, h, H2, db13, db2, slices=None):
        bn = kern.variant("dw13").bn
        g13, g2 = wgrad_grids(kern.sm90, kern.t, E, d, h, H2, slices, kern.interleaved)
        self.off13 = [BM * bn * sum(g13[:i]) for i in range(len(g13))]
        self.off2 = [BM * bn * sum(g2[:i]) for i in range(len(g2))]
        self.dw13 = _array.empty_gpu((sum(g13) * BM * bn,), np.float32).view
        self.dw2 = _array.empty_gpu((sum(g2) * BM * bn,), np.float32).view
        # flat: launch i of a z-sliced backward keeps its (E, width) sums at element E * (its first row of db13)
        self.db13 = None if db13 is None else _array.empty_gpu((int(np.prod(db13.shape)),), np.float32).view
        self.db2 = None if db2 is None else _array.empty_gpu(db2.shape, np.float32).view
        self.seen = _array.empty_gpu((E,), np.int32).view
        self.seen.fill(0)

    def dw13_at(self, i):
        return self.dw13[self.off13[i]:]

    def dw2_at(self, i):
        return self.dw2[self.off2[i]:]


def _z_parts(c0: int, w: int, h: int, gated: bool, interleaved: bool) -> list[tuple[int, int, int]]:
    """The parts of z's column slice [c0, c0 + w) of h, as (first column in the slice's z rows, first row of w13 and
    element of b13, width): gated, the gate and up halves (h rows apart in w13); interleaved or plain, one part."""
    if not gated:
        return [(0, c0, w)]
    if interleaved:
        return [(0, 2 * c0, 2 * w)]
    return [(0, c0, w), (w, h + c0, w)]


def wgrad_grids(sm90: bool, t: bool, E: int, d: int, h: int, H2: int, slices=None,
                interleaved: bool = False) -> tuple[list[int], list[int]]:
    """CTAs of each dw13 launch and of each dw2 launch of one backward chunk, in launch order: one launch each, or
    with ``slices`` (the z-sliced backward's column slices of h) one per slice (dw13: per part, see _z_parts).
    ``sm90``: the sm_90a kernels (256-column tiles, dy_g^T (g hcur) and x_g^T dz tiles whatever the layout); ``t``:
    weights stored "in_out"."""
    bn = BN90 if sm90 else BN
    cd = lambda n, m: -(-n // m)  # noqa: E731
    g13 = lambda m: E * (cd(d, BM) * cd(m, bn) if t or sm90 else cd(m, BM) * cd(d, bn))  # noqa: E731
    g2 = lambda w: E * (cd(w, BM) * cd(d, bn) if t and not sm90 else cd(d, BM) * cd(w, bn))  # noqa: E731
    if slices is None:
        return [g13(H2)], [g2(h)]
    gated = H2 != h
    return ([g13(pw) for c0, c1 in slices for _, _, pw in _z_parts(c0, c1 - c0, h, gated, interleaved)],
            [g2(c1 - c0) for c0, c1 in slices])


def backward(dy, saved, chunks, block_tokens, dx, dw13, dw2, dgates, db13, db2, stream, *, reuse_saved=False):
    """Fill dx (L, d), dw13 (E, H2, d), dw2 (E, d, h), dgates (L, K) and the bias grads from dy (L, d).

    ``chunks`` as in :func:`forward` (the same chunks). dz is written over z (each element is read by the thread
    that then overwrites it): always when z is recomputed (checkpoint "none"), and over the saved pre-activations
    when ``reuse_saved`` (which leaves ``saved.ab`` holding dz afterwards). That saves one (L*K, H2) buffer at the
    backward's peak. With several chunks the weight and bias gradients carry fp32 partial sums from chunk to
    chunk (see :class:`_Carry` and KTileWalk in moe_common.cuh): the result has the unchunked run's bits.
    """
    stream = _array.current_stream(stream)
    x, w13, w2, gates = saved.x, saved.w13, saved.w2, saved.gates
    L, d, E, h, K, LK, H2, dt = _dims(x, w13, w2, gates, saved.weight_layout == "in_out")
    if L == 0:
        dw13.fill(0)
        dw2.fill(0)
        for b in (db13, db2):
            if b is not None:
                b.fill(0)
        return
    kern = _kernels(dt, saved.activation, weight_layout=saved.weight_layout, path=saved.gemm_path)
    z = saved.extra.get("z_view") if saved.extra else None
    if z is None and saved.ab is not None:
        z = _array.asarray(saved.ab)
    zsl = h_slices(h, d, lean=True) if z is None and h > d else None  # the z-sliced backward's slices
    carry = _Carry(kern, E, d, h, H2, db13, db2, zsl) if len(chunks) > 1 else None
    for i, (t0, t1, disp) in enumerate(chunks):
        zc = _rows(z, t0, t1, L, K) if z is not None else None
        flags = (1 if i > 0 else 0) | (2 if i + 1 < len(chunks) else 0)
        _backward_chunk(kern, saved, _rows(dy, t0, t1, L), _rows(x, t0, t1, L), _rows(gates, t0, t1, L), disp, zc,
                        reuse_saved, block_tokens, _rows(dx, t0, t1, L), dw13, dw2, _rows(dgates, t0, t1, L), db13,
                        db2, carry, flags, stream)


def _block_starts(kern, disp, E, L, block_tokens, stream):
    """(table, nb) for KTileWalk: the first slot of each (expert, token block); (None, 0) for one block."""
    nb = -(-L // block_tokens)
    if nb <= 1:
        return None, 0
    blk = _array.empty_gpu((E * nb,), np.int32).view
    kern.fn("blz::moe_block_starts")((-(-(E * nb) // 256),), (256,),
                                     (disp.expert_offsets, disp.slot_token, np.int32(E), np.int32(nb),
                                      np.int32(block_tokens), blk), stream=stream)
    return blk, nb


def _backward_chunk(kern, saved, dy, x, gates, disp, z, reuse_saved, block_tokens, dx, dw13, dw2, dgates, db13,
                    db2, carry, flags, stream):
    w13, w2 = saved.w13, saved.w2
    L, d, E, h, K, LK, H2, dt = _dims(x, w13, w2, gates, kern.t)
    tile_offsets = _tile_offsets(kern, disp, E, stream)
    in_place = reuse_saved
    recomputed = z is None  # checkpoint "none"
    # the transients are sliced narrower (h_slices, dx_slices: lean) where the smallest peak is the point (policy
    # "none") or where z is wide beside them (h > d); "none" on such a shape never has all of z at once
    lean = recomputed or h > d
    if recomputed and h > d:
        _backward_z_sliced(kern, saved, dy, x, gates, disp, tile_offsets, block_tokens, dx, dw13, dw2, dgates, db13,
                           db2, carry, flags, stream)
        return
    if recomputed:  # recompute the first GEMM's pre-activations into a transient
        z = _array.empty_gpu((LK, H2), dt).view
        _gemm1(kern, x, w13, saved.b13, disp, tile_offsets, E, LK, h, None, z, stream)
        in_place = True
    ck = {} if carry is None else {"flags": flags, "carry_seen": carry.seen}

    # dh' = dy_g w2_e; recompute hcur from z; dgates partials; dz = act backward (g folded in); hg = g * hcur;
    # then dw2_e = dy_g^T (g hcur), reducing over the expert's slots in order. Both run per column slice of h when
    # h is much wider than d (h_slices; not with a chunk carry, whose layout assumes one launch): the slice's
    # (L*K, width) g * hcur rows are all the backward keeps of it, and every element has the same bits.
    tiles_nh = kern.tiles_n("dhcur", h)
    bn_h = kern.variant("dhcur").bn
    dz = z if in_place else _array.empty_gpu((LK, H2), dt).view
    part = _array.empty_gpu((LK, tiles_nh), np.float32).view
    blk, nb = _block_starts(kern, disp, E, L, block_tokens, stream)
    gated = H2 != h
    slices = h_slices(h, d, lean=lean) if carry is None else [(0, h)]
    dys = None if recomputed else _dy_stage(kern, slices, LK, d, dt)  # ("none" keeps its transients narrow)
    hgbuf = _array.empty_gpu((LK * max(c1 - c0 for c0, c1 in slices),), dt).view
    for c0, c1 in slices:
        w = c1 - c0
        hg = hgbuf[:LK * w].reshape(LK, w)
        zc0 = 2 * c0 if kern.interleaved else c0  # the slice's first column of z / dz
        # w2 (E, d, h): columns c0.. of h, N-major; "in_out" (E, h, d): rows c0.., K-major
        _launch_m(kern, "dhcur", _m_grid(LK, E, kern.tiles_n("dhcur", w)), stream, A=dy, lda=d,
                  B=w2[:, c0:] if kern.t else w2[:, :, c0:], ldb=d if kern.t else h, b_estride=d * h, disp=disp,
                  tile_offsets=tile_offsets, E=E, N=w, Kd=d, out=dz[:, zc0:], ldo=H2,
                  up=h if gated and not kern.interleaved else 0, out2=hg, ldo2=w, aux=z[:, zc0:],
                  ldaux=H2, gates=gates, topk=K, part=part[:, c0 // bn_h:], part_ld=tiles_nh)
        _dw2_slice(kern, hg, dy, dw2, disp, c0, E, d, h, blk, nb, stream, carry=carry and carry.dw2_at(0),
                   stage=dys, **ck)
    del z, hg, hgbuf, dys
    _dgates(kern, part, tiles_nh, disp, E, LK, dy, saved.b2, K, d, dgates, stream)
    del part
    # dw13_e = dz^T x_g; stored "in_out" (E, d, H2): dw13_e^T = x_g^T dz
    _dw13_part(kern, dz, x, dw13, db13, disp, 0, 0, H2, E, d, K, blk, nb, stream, carry, 0, flags)
    if db2 is not None:
        _db2(kern, dy, db2, disp, gates, E, K, d, stream, carry, flags)
    _mark_seen(kern, disp, E, carry, flags, stream)
    # dx_t = sum_k dz_s w13_e: per-slot rows, then the deterministic combine, in column slices of dx when d is
    # much wider than dz (dx_slices): each element's sum is the same, and the per-slot rows take (L*K, width)
    dxs = None
    for c0, c1 in dx_slices(d, H2, lean=lean):
        w = c1 - c0
        if dxs is None:
            dxs = _array.empty_gpu((LK * w,), dt).view
        rows = dxs[:LK * w].reshape(LK, w)
        # w13 (E, H2, d): columns c0.. of d, N-major; "in_out" (E, d, H2): rows c0.., K-major
        _launch_m(kern, "dx", _m_grid(LK, E, kern.tiles_n("dx", w)), stream, A=dz, lda=H2,
                  B=w13[:, c0:] if kern.t else w13[:, :, c0:], ldb=H2 if kern.t else d, b_estride=H2 * d,
                  disp=disp, tile_offsets=tile_offsets, E=E, N=w, Kd=H2, out=rows, ldo=w)
        _combine(kern, rows, disp, K, dx[:, c0:], d, stream)
    del dz, dxs


def _dw2_slice(kern, hg, dy, dw2, disp, c0, E, d, h, blk, nb, stream, carry=None, stage=None, **ck):
    """dw2's columns [c0, c0 + w) of h (stored "in_out": rows) from the slice's g * hcur rows hg (L*K, w); ``stage``:
    dy's rows staged in slot order (a :class:`_Staged` shared by the slices, see :func:`_dy_stage`)."""
    w = hg.shape[1]
    if kern.t and not kern.sm90:  # dw2 stored (E, h, d): dw2^T = (g hcur)^T dy_g, rows c0.. of h
        _launch_k(kern, "dw2", E * -(-w // BM) * kern.tiles_n("dw2", d), stream, A=hg, lda=w, B=dy, ldb=d,
                  disp=disp, E=E, M=w, N=d, out=dw2[:, c0:], ldo=d,
                  o_estride=d * h, kblocks=blk, num_kblocks=nb, carry=carry, **ck)
    else:  # dy_g^T (g hcur) tiles; "in_out" on sm_90a: stored transposed, rows c0.. of h
        out, ldo = (dw2[:, c0:], d) if kern.t else (dw2[:, :, c0:], h)
        _launch_k(kern, "dw2" if stage is None else "dw2s", E * -(-d // BM) * kern.tiles_n("dw2", w), stream, A=dy,
                  lda=d, B=hg, ldb=w, disp=disp, E=E, M=d, N=w, out=out, ldo=ldo,
                  o_estride=d * h, kblocks=blk, num_kblocks=nb, carry=carry, stage=stage, **ck)


def _dy_stage(kern, slices, LK, d, dt):
    """dy's rows staged in slot order for dw2's launches over ``slices`` of h (a :class:`_Staged`), or None."""
    if not _stage_rows(kern, sum(kern.tiles_n("dw2", c1 - c0) for c0, c1 in slices)):
        return None
    return _Staged(LK, d, dt)


def _dw13_part(kern, dz, x, dw13, db13, disp, zc, row0, pw, E, d, K, blk, nb, stream, carry, i, flags):
    """dw13's rows [row0, row0 + pw) (stored "in_out": columns) and db13's elements from dz's columns [zc, zc + pw):
    dw13_e = dz^T x_g ("in_out": dw13_e^T = x_g^T dz). ``carry``: a chunked backward's sums (launch i of
    wgrad_grids' order; db13's at elements E * row0.., each launch's (E, pw) apart)."""
    H2 = dw13.shape[2 if kern.t else 1]
    ldz = dz.shape[1]
    dzp = dz[:, zc:]
    ck = {} if carry is None else {"flags": flags, "carry_seen": carry.seen, "carry": carry.dw13_at(i)}
    if kern.t or kern.sm90:  # "in_out": W^T = x_g^T dz, stored as is; sm_90a: the same tiles stored transposed
        out, ldo = (dw13[:, :, row0:], H2) if kern.t else (dw13[:, row0:], d)
        tiles_n = kern.tiles_n("dw13", pw)
        stage = _Staged(dz.shape[0], d, logical_dtype(x)) if _stage_rows(kern, tiles_n) else None
        _launch_k(kern, "dw13" if stage is None else "dw13s", E * -(-d // BM) * tiles_n, stream, A=x, lda=d, B=dzp,
                  ldb=ldz, disp=disp, E=E, M=d, N=pw, out=out, ldo=ldo,
                  o_estride=H2 * d, kblocks=blk, num_kblocks=nb, stage=stage, **ck)
        del stage
    else:
        _launch_k(kern, "dw13", E * -(-pw // BM) * kern.tiles_n("dw13", d), stream, A=dzp, lda=ldz, B=x, ldb=d,
                  disp=disp, E=E, M=pw, N=d, out=dw13[:, row0:], ldo=d,
                  o_estride=H2 * d, kblocks=blk, num_kblocks=nb, **ck)
    if db13 is not None:
        cb = None if carry is None else carry.db13[E * row0:]
        kern.fn(f"blz::moe_bias_grad<{kern.ct}>")(
            (-(-pw // 128), E), (128,),
            (dzp, np.int64(ldz), np.int32(pw), disp.expert_offsets, disp.slot_token, disp.slot_k, _NULL,
             np.int32(K), np.int32(0), db13[:, row0:], np.int64(H2), _ptr(cb), *_carry_flags(carry, flags)),
            stream=stream)


def _carry_flags(carry, flags):
    """moe_bias_grad's (carry_in, carry_out): continue an earlier chunk's sums / keep them for a later one."""
    if carry is None:
        return np.int32(0), np.int32(0)
    return np.int32(flags & 1), np.int32((flags >> 1) & 1)


def _db2(kern, dy, db2, disp, gates, E, K, d, stream, carry=None, flags=0):
    """db2_e = sum over expert e's slots of g * dy_t (a chunk carry continues / keeps fp32 sums)."""
    kern.fn(f"blz::moe_bias_grad<{kern.ct}>")(
        (-(-d // 128), E), (128,),
        (dy, np.int64(d), np.int32(d), disp.expert_offsets, disp.slot_token, disp.slot_k, gates,
         np.int32(K), np.int32(1), db2, np.int64(d), _ptr(carry and carry.db2), *_carry_flags(carry, flags)),
        stream=stream)


def _mark_seen(kern, disp, E, carry, flags, stream):
    """A later chunk continues the sums of this chunk's experts."""
    if carry is not None and flags & 2:
        kern.fn("blz::moe_mark_seen")((-(-E // 256),), (256,), (disp.expert_offsets, np.int32(E), carry.seen),
                                      stream=stream)


def _dgates(kern, part, tiles_nh, disp, E, LK, dy, b2, K, d, dgates, stream):
    """dgates from the dh' epilogue's per-(slot, n-tile) partial sums (+ dy . b2 with a bias): a thread a pair
    without a bias and with few partials (moe_dgates_small), else a warp a pair; the bits are the same."""
    if b2 is None and tiles_nh <= DGATES_SMALL_PARTS:
        kern.fn("blz::moe_dgates_small")((-(-LK // 256),), (256,),
                                         (part, np.int32(tiles_nh), disp.pair_slot, np.int64(LK), dgates),
                                         stream=stream)
        return
    warps = 8
    kern.fn(f"blz::moe_dgates<{kern.ct}>")(
        (-(-LK // warps),), (32 * warps,),
        (part, np.int32(tiles_nh), disp.pair_slot, disp.expert_offsets, np.int32(E), np.int64(LK), dy, _ptr(b2),
         np.int32(K), np.int32(d), dgates),
        stream=stream,
    )


def _backward_z_sliced(kern, saved, dy, x, gates, disp, tile_offsets, block_tokens, dx, dw13, dw2, dgates, db13,
                       db2, carry, flags, stream):
    """Checkpoint "none" where h > d (one chunk): the whole backward runs per column slice [c0, c1) of h
    (h_slices, lean), so neither z nor dz (L*K, H2) exists, only the slice's (L*K, R*w) (R = 2 gated):

      recompute z's slice (gemm1 on the slice's rows of w13) -> dh' and the activation backward (dz over it,
      g * hcur, dgates partials) -> dw2's, dw13's and db13's columns of the slice -> the slice's share of dx.

    dx_t = sum over slices of sum_k dz_s w13_e: the per-slot rows of each slice (and, gated, of its gate and up
    halves, whose w13 rows are h apart) are combined into an fp32 (L, d) sum in a fixed order, rounded once at the
    end. dw13, dw2, db13, db2 and dgates have the bits of the unsliced backward; dx is as accurate but may differ
    from it in the last bit. Bit-identical run to run, and chunked (``carry``: each launch its own fp32 sums) as
    unchunked."""
    w13, w2 = saved.w13, saved.w2
    L, d, E, h, K, LK, H2, dt = _dims(x, w13, w2, gates, kern.t)
    gated = H2 != h
    r = 2 if gated else 1
    slices = h_slices(h, d, lean=True)
    wmax = max(c1 - c0 for c0, c1 in slices)
    tiles_nh = kern.tiles_n("dhcur", h)
    bn_h = kern.variant("dhcur").bn
    part = _array.empty_gpu((LK, tiles_nh), np.float32).view
    blk, nb = _block_starts(kern, disp, E, L, block_tokens, stream)
    zbuf = _array.empty_gpu((LK * r * wmax,), dt).view
    hgbuf = _array.empty_gpu((LK * wmax,), dt).view
    acc = _array.empty_gpu((L, d), np.float32).view  # dx's fp32 sum over the slices
    dxl = dx_slices(d, wmax, lean=True)
    dxs = _array.empty_gpu((LK * max(e1 - e0 for e0, e1 in dxl),), dt).view
    # each (slice, part) adds its per-slot rows to acc (_acc_mode), the last one rounded into dx
    steps = [(c0, c1, p) for c0, c1 in slices for p in range(len(_z_parts(c0, c1 - c0, h, gated, kern.interleaved)))]
    for si, (c0, c1) in enumerate(slices):
        w = c1 - c0
        z = zbuf[:LK * r * w].reshape(LK, r * w)
        _gemm1(kern, x, w13, saved.b13, disp, tile_offsets, E, LK, h, None, z, stream, c0=c0, w=w)
        hg = hgbuf[:LK * w].reshape(LK, w)
        # w2 (E, d, h): columns c0.. of h, N-major; "in_out" (E, h, d): rows c0.., K-major. dz over z.
        _launch_m(kern, "dhcur", _m_grid(LK, E, kern.tiles_n("dhcur", w)), stream, A=dy, lda=d,
                  B=w2[:, c0:] if kern.t else w2[:, :, c0:], ldb=d if kern.t else h, b_estride=d * h, disp=disp,
                  tile_offsets=tile_offsets, E=E, N=w, Kd=d, out=z, ldo=r * w, out2=hg, ldo2=w, aux=z,
                  ldaux=r * w, gates=gates, topk=K, part=part[:, c0 // bn_h:], part_ld=tiles_nh)
        ck = {} if carry is None else {"flags": flags, "carry_seen": carry.seen, "carry": carry.dw2_at(si)}
        _dw2_slice(kern, hg, dy, dw2, disp, c0, E, d, h, blk, nb, stream, **ck)
        for p, (zc, row0, pw) in enumerate(_z_parts(c0, w, h, gated, kern.interleaved)):
            step = steps.index((c0, c1, p))
            _dw13_part(kern, z, x, dw13, db13, disp, zc, row0, pw, E, d, K, blk, nb, stream, carry, step, flags)
            dzp = z[:, zc:]
            mode = _acc_mode(step, len(steps))
            for e0, e1 in dxl:
                we = e1 - e0
                rows = dxs[:LK * we].reshape(LK, we)
                # w13 (E, H2, d): rows row0.., columns e0.. of d, N-major; "in_out" (E, d, H2): K-major
                _launch_m(kern, "dx", _m_grid(LK, E, kern.tiles_n("dx", we)), stream, A=dzp, lda=r * w,
                          B=w13[:, e0:, row0:] if kern.t else w13[:, row0:, e0:], ldb=H2 if kern.t else d,
                          b_estride=H2 * d, disp=disp, tile_offsets=tile_offsets, E=E, N=we, Kd=pw,
                          out=rows, ldo=we)
                _combine(kern, rows, disp, K, dx[:, e0:], d, stream, acc[:, e0:], mode)
    del zbuf, hgbuf, acc, dxs
    _dgates(kern, part, tiles_nh, disp, E, LK, dy, saved.b2, K, d, dgates, stream)
    del part
    if db2 is not None:
        _db2(kern, dy, db2, disp, gates, E, K, d, stream, carry, flags)
    _mark_seen(kern, disp, E, carry, flags, stream)


def _col_slices(n: int, max_width: int, align: int = 256) -> list[tuple[int, int]]:
    """[c0, c1) covering [0, n): as few slices as keep each at most max(max_width, align) wide, widths a multiple of
    ``align`` (whole 256-column tiles) but the last."""
    k = max(1, -(-n // max(max_width, 1)))
    per = -(-n // k)
    w = -(-per // align) * align
    return [(c, min(n, c + w)) for c in range(0, n, w)]


O_SLICE_COLS = 1024  # widest column slice of the forward's per-slot output rows o


def o_slices(d: int) -> list[tuple[int, int]]:
    """Column slices of y for the forward's per-slot output rows o = g * (hcur w2^T) (L*K, width): at most
    O_SLICE_COLS wide, so o beside hcur (L*K, h) stays small when d is wide. Each slice reads the hcur rows once
    more; the w2 GEMM already reads them once per 256-column tile, so the cost is a launch and a tile tail."""
    return _col_slices(d, O_SLICE_COLS)


DX_SLICE_FACTOR = 2  # widest column slice of the backward's per-slot dx rows, in reduction widths kd


def dx_slices(d: int, kd: int, lean: bool = False) -> list[tuple[int, int]]:
    """Column slices of dx for the per-slot dx rows (L*K, width) of the backward: one slice unless d is more than
    DX_SLICE_FACTOR (2) times the reduction width kd (= dz's row, 2h gated); then slices at most that wide. The
    extra cost is one more pass over dz per slice, small exactly when dz is narrow. ``lean`` (checkpoint "none",
    whose point is the smallest peak): slices of about a quarter of d as well (rounded up to whole 256-column
    tiles)."""
    w = DX_SLICE_FACTOR * kd
    return _col_slices(d, min(w, -(-d // 4)) if lean else w)


def h_slices(h: int, d: int, lean: bool = False) -> list[tuple[int, int]]:
    """Column slices of h for the backward's dh' GEMM and dw2 (the g * hcur rows (L*K, width)): one slice unless h
    is wider than d; then slices at most d wide. Each extra slice gathers the dy rows (width d) once more.
    ``lean`` (checkpoint "none", or h > d): at most half of h and half of d (rounded up to whole 256-column
    tiles); checkpoint "none" with h > d runs its whole backward in these slices (_backward_z_sliced)."""
    return _col_slices(h, min(-(-d // 2), -(-h // 2)) if lean else d)


# ---------------------------------------------------------------------------------------------
# The layer's GPU path: every allocation of a forward and a backward, in order (blazecore.memory runs it dry)
# ---------------------------------------------------------------------------------------------


def chunk_dispatches(ids, E, bounds, s, validate: bool) -> tuple:
    """The dispatch of each chunk's ids (GPU; the ids were validated already unless ``validate``)."""
    if validate and bounds:
        _validate_gpu(ids.device.id, ids, E, s)
    return tuple(build_dispatch(ids[t0:t1], E, validate=False, stream=s) for t0, t1 in bounds)


def layer_forward(x, w13, w2, gates, ids, b13, b2, sz: Sizes, activation, checkpoint, dispatch, out, stream,
                  chunking, weight_layout="out_in", act_in_operand=False, gemm_path=None):
    """:func:`blazecore.moe.moe_forward` on validated CuPy views on the current device: y, the dispatch (or one
    per chunk), then :func:`forward`. Returns (y as the allocator gave it, :class:`MoESaved`)."""
    dev = x.device.id
    settings()  # a bad setting is an error before any kernel runs (the dispatch build included)
    s = _array.current_stream(stream)
    with s:  # allocations (and their poison fills in tests) belong to the stream the kernels use
        y = _array.out_or_empty(out, (sz.L, sz.d), sz.dtype, True, "out")
        check_gpu_device({"out": y.view}, dev)
        if _array.dry() is None:  # the model sizes any shape; moe_forward refuses those the kernels cannot run
            check_shapes(x, w2)  # the kernels' own limits (row alignment)
            check_aligned({"x": x, "w13": w13, "w2": w2, "out": y.view}, {"b13": b13, "b2": b2})
        bounds = chunk_bounds(sz.L, *chunking)
        if dispatch is not None:
            check_dispatch(dispatch, sz.L, sz.K, sz.E, True, dev)
        if len(bounds) > 1:
            chunk_disp = chunk_dispatches(ids, sz.E, bounds, s, validate=dispatch is None)
        else:
            if dispatch is None:
                dispatch = build_dispatch(ids, sz.E, stream=s)
            chunk_disp = (dispatch,)
        if sz.L == 0:
            # nothing to compute; a zero-sized grid would be a launch error
            ab = _array.empty_gpu((0, sz.R), sz.dtype).user if checkpoint == "ab" else None
            extra = {}
        else:
            chunk_list = [(t0, t1, dp) for (t0, t1), dp in zip(bounds, chunk_disp, strict=True)]
            ab, extra = forward(x, w13, w2, gates, chunk_list, activation, checkpoint, b13, b2, y.view, s,
                                weight_layout, act_in_operand, gemm_path)
    saved = MoESaved(x, w13, w2, gates, ids, dispatch, activation, checkpoint, b13, b2, ab, dict(extra or {}),
                     chunks=chunking[0], block_tokens=chunking[1], weight_layout=weight_layout,
                     chunk_dispatches=chunk_disp if len(bounds) > 1 else (), gemm_path=gemm_path)
    return y.user, saved


def layer_backward(dy, saved: MoESaved, out_dx, out_dw13, out_dw2, out_dgates, stream, retain) -> MoEGrads:
    """:func:`blazecore.moe.moe_backward` on a validated dy on the current device: the gradient buffers, then
    :func:`backward` over the forward's chunks."""
    settings()  # a bad setting is an error before any kernel runs
    s = _array.current_stream(stream)
    with s:
        outs = grad_outs(saved, True, out_dx, out_dw13, out_dw2, out_dgates)
        dx, dw13, dw2, dgates, db13, db2 = outs
        if _array.dry() is None:
            check_aligned({"dy": dy, "out_dx": dx.view, "out_dw13": dw13.view, "out_dw2": dw2.view})
        if int(saved.x.shape[0]) == 0:
            # no slot: weight gradients are zero, dx and dgates are empty
            for o in (dw13, dw2, db13, db2):
                if o is not None:
                    o.view.fill(0)
        else:
            reuse = not retain and saved.ab is not None
            bounds = chunk_bounds(int(saved.x.shape[0]), saved.chunks, saved.block_tokens)
            disps = saved.chunk_dispatches
            if len(bounds) == 1 and saved.dispatch is not None:
                disps = (saved.dispatch,)
            if len(disps) != len(bounds):  # e.g. a MoESaved rebuilt by an adapter from the full dispatch
                disps = chunk_dispatches(saved.expert_ids, int(saved.w13.shape[0]), bounds, s, validate=False)
            chunk_list = [(t0, t1, dp) for (t0, t1), dp in zip(bounds, disps, strict=True)]
            backward(dy, saved, chunk_list, saved.block_tokens, dx.view, dw13.view, dw2.view, dgates.view,
                     None if db13 is None else db13.view, None if db2 is None else db2.view, s, reuse_saved=reuse)
            saved.consumed = reuse
    return MoEGrads(*(user(o) for o in outs))
