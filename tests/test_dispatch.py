"""build_dispatch: invariants fuzzed with hypothesis, an argsort oracle, every GPU plan, bad inputs.

Two independent oracles: blazecore/reference/dispatch.py (the three phases, used by the CPU backend)
and ``blazecore.testing.argsort_dispatch`` (a stable argsort of the flattened ids).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import backends, gpu_available, to_backend, to_numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blazecore import _array
from blazecore import dispatch as D
from blazecore.dispatch import Dispatch, build_dispatch
from blazecore.reference import dispatch as ref
from blazecore.testing import argsort_dispatch, make_routing

FUZZ = settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.function_scoped_fixture])
KINDS = ("uniform", "skewed", "all_to_one", "same", "empty_experts")


# ---------------------------------------------------------------------------------------------
# Oracle, routings, checks
# ---------------------------------------------------------------------------------------------


def assert_int_equal(actual, expected, name: str) -> None:
    """Exact equality of integer arrays, reporting the first differing index."""
    a, e = np.asarray(to_numpy(actual)), np.asarray(expected)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != expected {e.shape}"
    bad = np.argwhere(a != e)
    if bad.size:
        idx = tuple(int(i) for i in bad[0])
        raise AssertionError(f"{name}: {len(bad)} of {a.size} entries differ; first at {idx}: "
                             f"got {a[idx]}, expected {e[idx]}")


DISPATCH_FIELDS = ("expert_offsets", "slot_token", "slot_k", "pair_slot")


def dispatch_fields(d: Dispatch, L: int, K: int, E: int, backend: str) -> tuple:
    """The sizes, backend, shapes and dtypes of a dispatch checked; its four arrays as int64 NumPy."""
    n = L * K
    assert (d.num_tokens, d.top_k, d.num_experts) == (L, K, E)
    for name, shape in zip(DISPATCH_FIELDS, ((E + 1,), (n,), (n,), (L, K)), strict=True):
        arr = getattr(d, name)
        assert isinstance(arr, np.ndarray) == (backend == "cpu"), f"{name}: wrong backend {type(arr)}"
        assert tuple(arr.shape) == shape, f"{name}: shape {tuple(arr.shape)}, expected {shape}"
        assert np.dtype(arr.dtype) == np.int32, f"{name}: dtype {arr.dtype}"
    return tuple(np.asarray(to_numpy(getattr(d, f)), dtype=np.int64) for f in DISPATCH_FIELDS)


def check_dispatch(d: Dispatch, ids: np.ndarray, num_experts: int, backend: str) -> None:
    """Every invariant of a dispatch, then equality with the argsort oracle."""
    L, K = ids.shape
    n, E = L * K, num_experts
    off, st_, sk, ps = dispatch_fields(d, L, K, E, backend)

    # expert_offsets: exclusive scan of the per-expert counts
    assert off[0] == 0 and off[-1] == n
    assert_int_equal(np.diff(off), np.bincount(ids.reshape(-1), minlength=E), "expert counts")
    # (slot_token, slot_k) is a permutation of all pairs
    assert ((0 <= st_) & (st_ < L)).all() and ((0 <= sk) & (sk < K)).all(), "slot_token/slot_k out of range"
    flat = st_ * K + sk
    assert_int_equal(np.sort(flat), np.arange(n), "pairs covered by slots")
    # each slot sits in the range of its pair's expert
    slot_expert = np.repeat(np.arange(E), np.diff(off))
    assert_int_equal(ids.reshape(-1)[flat] if n else flat, slot_expert, "expert of each slot")
    # pair_slot inverts (slot_token, slot_k)
    assert_int_equal(ps.reshape(-1)[flat] if n else flat, np.arange(n), "pair_slot[slot_token, slot_k]")
    # within an expert, slots follow (token, k) order: flat pair index increases inside each segment
    if n > 1:
        rising = np.diff(flat) > 0
        same_expert = slot_expert[1:] == slot_expert[:-1]
        assert (rising | ~same_expert).all(), "an expert's slots are not in (token, k) order"
    # the independent oracle
    for name, got, want in zip(DISPATCH_FIELDS, (off, st_, sk, ps), argsort_dispatch(ids, E), strict=True):
        assert_int_equal(got, want, name)


# ---------------------------------------------------------------------------------------------
# Fuzzing (every backend)
# ---------------------------------------------------------------------------------------------


@st.composite
def routings(draw):
    E = draw(st.one_of(st.integers(1, 16), st.sampled_from([8, 64, 128, 256, 1024]), st.integers(17, 1024)))
    K = draw(st.one_of(st.integers(1, min(E, 8)), st.just(E) if E <= 64 else st.integers(1, min(E, 40))))
    max_tokens = max(1, min(3000, 2_000_000 // (E * max(K, 1))))
    L = draw(st.one_of(st.sampled_from([0, 1, 2, 63]), st.integers(0, max_tokens)))
    kind = draw(st.sampled_from(KINDS))
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    seed = draw(st.integers(0, 2**32 - 1))
    return make_routing(np.random.default_rng(seed), L, E, K, kind, dtype), E


@pytest.mark.parametrize("backend", backends())
@FUZZ
@given(case=routings())
def test_fuzz_invariants(backend, case):
    ids, E = case
    d = build_dispatch(to_backend(ids, backend), E)
    check_dispatch(d, ids, E, backend)


@FUZZ
@given(case=routings(), tile_tokens=st.integers(1, 300))
def test_reference_tiles_match_oracle(case, tile_tokens):
    """The reference's tile-level scan agrees with the oracle for any tile size."""
    ids, E = case
    got = ref.build_dispatch(ids, E, tile_tokens=tile_tokens)
    names = ("expert_offsets", "slot_token", "slot_k", "pair_slot")
    for name, g, w in zip(names, got, argsort_dispatch(ids, E), strict=True):
        assert_int_equal(g, w, name)


CASES = [
    pytest.param(0, 4, 8, "uniform", id="L0"),
    pytest.param(1, 1, 1, "uniform", id="L1-E1"),
    pytest.param(1, 8, 64, "uniform", id="L1-K8"),
    pytest.param(63, 2, 8, "uniform", id="L63"),
    pytest.param(100, 8, 8, "uniform", id="K_eq_E"),
    pytest.param(64, 64, 64, "uniform", id="K_eq_E_64"),
    pytest.param(5000, 1, 16, "all_to_one", id="all_on_one_expert"),
    pytest.param(3000, 2, 32, "same", id="all_on_the_same_K"),
    pytest.param(3000, 4, 100, "empty_experts", id="empty_experts"),
    pytest.param(4000, 8, 256, "skewed", id="skewed"),
    pytest.param(1500, 8, 1024, "uniform", id="E1024"),
    pytest.param(2049, 1, 3, "uniform", id="tile_plus_one"),
    pytest.param(300, 40, 64, "uniform", id="K40"),
]


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", [np.int32, np.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("L,K,E,kind", CASES)
def test_degenerate_routings(backend, dtype, L, K, E, kind):
    ids = make_routing(np.random.default_rng(L * 7 + K * 3 + E), L, E, K, kind, dtype)
    check_dispatch(build_dispatch(to_backend(ids, backend), E), ids, E, backend)


@pytest.mark.parametrize("backend", backends())
def test_empty(backend):
    for shape in [(0, 4), (0, 1), (5, 0)]:
        d = build_dispatch(to_backend(np.zeros(shape, np.int32), backend), 8)
        assert_int_equal(d.expert_offsets, np.zeros(9, np.int32), f"expert_offsets {shape}")
        assert d.slot_token.shape == (0,) and d.slot_k.shape == (0,) and tuple(d.pair_slot.shape) == shape


@pytest.mark.parametrize("backend", backends())
def test_dispatch_helpers(backend):
    ids = make_routing(np.random.default_rng(0), 50, 6, 2, "uniform")
    d = build_dispatch(to_backend(ids, backend), 6)
    assert_int_equal(d.counts(), np.bincount(ids.reshape(-1), minlength=6), "counts()")
    r = repr(d)
    assert "num_tokens=50" in r and "pair_slot(50, 2)" in r and ("cpu" if backend == "cpu" else "gpu") in r


# ---------------------------------------------------------------------------------------------
# Bad inputs (every backend)
# ---------------------------------------------------------------------------------------------


def _valid(L=8, K=3, E=8, dtype=np.int32):
    return make_routing(np.random.default_rng(1), L, E, K, "uniform", dtype)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", [np.int32, np.int64], ids=["i32", "i64"])
@pytest.mark.parametrize(
    "t,k,value,match",
    [
        pytest.param(3, 1, -2, r"expert_ids\[3, 1\] = -2 is outside \[0, 8\) and is not -1", id="negative"),
        pytest.param(0, 0, 8, r"expert_ids\[0, 0\] = 8 is outside \[0, 8\)", id="eq_E"),
        pytest.param(7, 2, 1000, r"expert_ids\[7, 2\] = 1000 is outside", id="large"),
        pytest.param(5, 2, "dup0", r"expert_ids\[5, 2\] = \d+ repeats expert_ids\[5, 0\]", id="duplicate"),
        pytest.param(2, 1, "dup0", r"expert_ids\[2, 1\] = \d+ repeats expert_ids\[2, 0\]", id="duplicate_adjacent"),
    ],
)
def test_bad_values(backend, dtype, t, k, value, match):
    ids = _valid(dtype=dtype)
    ids[t, k] = ids[t, 0] if value == "dup0" else value
    with pytest.raises(ValueError, match=match):
        build_dispatch(to_backend(ids, backend), 8)


@pytest.mark.parametrize("backend", backends())
def test_bad_values_int64_beyond_int32(backend):
    ids = _valid(dtype=np.int64)
    ids[4, 1] = 2**32 + 1  # would wrap to 1 if truncated to int32
    with pytest.raises(ValueError, match=r"expert_ids\[4, 1\] = 4294967297 is outside"):
        build_dispatch(to_backend(ids, backend), 8)


@pytest.mark.parametrize("backend", backends())
def test_first_bad_is_reported(backend):
    """Several bad pairs: the smallest (token, k) is named, whichever kind of error it is."""
    ids = _valid(L=2000, K=3, E=8)
    ids[1500, 0] = -3
    ids[1200, 2] = ids[1200, 1]
    ids[1900, 1] = 99
    with pytest.raises(ValueError, match=r"expert_ids\[1200, 2\] = \d+ repeats expert_ids\[1200, 1\]"):
        build_dispatch(to_backend(ids, backend), 8)


@pytest.mark.parametrize("backend", backends())
def test_bad_values_large_k(backend):
    """K > 32 (a warp per row on the GPU, 32 ids at a time): a repeat across 32-id chunks is found."""
    ids = _valid(L=20, K=40, E=64)
    ids[11, 37] = ids[11, 5]
    with pytest.raises(ValueError, match=r"expert_ids\[11, 37\] = \d+ repeats expert_ids\[11, 5\]"):
        build_dispatch(to_backend(ids, backend), 64)
    ids = _valid(L=20, K=40, E=64)
    ids[19, 39] = 64
    with pytest.raises(ValueError, match=r"expert_ids\[19, 39\] = 64 is outside"):
        build_dispatch(to_backend(ids, backend), 64)


@pytest.mark.parametrize("backend", backends())
def test_bad_dtype_and_shape(backend):
    ids = _valid()
    with pytest.raises(TypeError, match="integer"):
        build_dispatch(to_backend(ids.astype(np.float32), backend), 8)
    with pytest.raises(TypeError, match="integer"):
        build_dispatch(to_backend(ids > 3, backend), 8)
    with pytest.raises(TypeError, match="int32 or int64"):
        build_dispatch(to_backend(ids.astype(np.uint8), backend), 8)
    with pytest.raises(ValueError, match="2-D"):
        build_dispatch(to_backend(ids.reshape(-1), backend), 8)
    with pytest.raises(ValueError, match="2-D"):
        build_dispatch(to_backend(ids.reshape(2, 4, 3), backend), 8)
    with pytest.raises(ValueError, match="top_k = 3 exceeds num_experts = 2"):
        build_dispatch(to_backend(ids % 2, backend), 2)
    with pytest.raises(ValueError, match="num_experts must be >= 1"):
        build_dispatch(to_backend(ids, backend), 0)
    with pytest.raises(TypeError, match="num_experts must be an integer"):
        build_dispatch(to_backend(ids, backend), 8.0)
    wide = to_backend(np.concatenate([ids, ids], axis=1), backend)
    with pytest.raises(ValueError, match="C-contiguous"):
        build_dispatch(wide[:, ::2], 8)
    with pytest.raises(ValueError, match="C-contiguous"):
        build_dispatch(to_backend(_valid(L=3, K=3), backend).T, 8)


def test_check_sizes_int32_limit():
    D.check_sizes(2**30, 1, 8)
    D.check_sizes(2**31 - 1, 1, 1)
    with pytest.raises(ValueError, match="int32"):
        D.check_sizes(2**30, 2, 8)
    with pytest.raises(ValueError, match="int32"):
        D.check_sizes(2**28 + 1, 8, 64)


@pytest.mark.parametrize("backend", backends())
def test_pairs_beyond_int32_rejected_without_allocating(backend):
    """A zero-stride view with 2**31 pairs: the size check fires before contiguity or any allocation."""
    if backend == "cpu":
        huge = np.lib.stride_tricks.as_strided(np.zeros(1, np.int32), shape=(2**30, 2), strides=(0, 0))
    else:
        import cupy

        huge = cupy.lib.stride_tricks.as_strided(cupy.zeros(1, cupy.int32), shape=(2**30, 2), strides=(0, 0))
    with pytest.raises(ValueError, match=r"num_tokens \* top_k .* exceeds the int32 range"):
        build_dispatch(huge, 8)


def test_stream_with_cpu_ids_is_rejected():
    with pytest.raises(ValueError, match="CPU array"):
        build_dispatch(_valid(), 8, stream=0)


def test_first_bad_cpu_matches_brute_force():
    rng = np.random.default_rng(7)
    for _ in range(200):
        L, E = int(rng.integers(1, 20)), int(rng.integers(1, 12))
        K = int(rng.integers(1, E + 1))
        ids = rng.integers(-3, E + 2, size=(L, K))
        want = -1
        for t in range(L):
            for k in range(K):
                if ids[t, k] == -1:  # a dropped pair, any number of them a row
                    continue
                if not 0 <= ids[t, k] < E or ids[t, k] in ids[t, :k]:
                    want = t * K + k
                    break
            if want >= 0:
                break
        assert D._first_bad_cpu(ids, E) == want


def test_validate_false_cpu_is_memory_safe():
    """Bad ids without validation: clamped, no exception, outputs of the right shapes."""
    ids = _valid(L=30, K=3, E=8)
    ids[0, 0], ids[1, 1] = -5, 100
    d = build_dispatch(ids, 8, validate=False)
    assert d.slot_token.shape == (90,) and d.pair_slot.shape == (30, 3)
    assert d.expert_offsets[0] == 0 and (np.diff(d.expert_offsets) >= 0).all()


def test_plan_choices():
    assert D.plan(100, 8) == D.Plan(256, 8, 1, D.MODE_SINGLE_TILE)
    assert D.plan(8192, 64).mode == D.MODE_SINGLE_TILE
    assert D.plan(32768, 8).mode == D.MODE_DIRECT_SUM
    assert D.plan(32768 * 8, 256).mode == D.MODE_SCANNED
    assert D.plan(2**24, 64).tile == 8192
    assert D.plan(2**24, 2048).block == 256  # large E: the 256-thread tile keeps shared memory small
    for n in [1, 2048, 2049, 10**5, 10**6, 2**24, 2**31 - 1]:
        for E in [1, 8, 256, 1024, 4096]:
            p = D.plan(n, E)
            assert p.num_tiles == -(-n // p.tile) and (p.mode == D.MODE_SINGLE_TILE) == (p.num_tiles == 1)
            assert D.scatter_smem(p, E) <= 48 * 1024 or E > 1024  # E <= 1024 needs no shared-memory opt-in
    with pytest.raises(ValueError):
        D.plan(5000, 8, tile=(256, 8), mode=D.MODE_SINGLE_TILE)


def test_kernels_are_atomic_free():
    """The build is atomic-free by design: no atom./red. instruction in the PTX of any dispatch kernel
    (and warp match.any is really used). Compiles with NVRTC, no GPU needed."""
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="needs cupy's NVRTC bindings")
    from blazecore import _compile

    source, _ = _compile._read_with_headers("dispatch.cu")
    names = _compile.KERNELS["dispatch.cu"]
    assert set(names) == set(D._KERNEL_NAMES)
    opts = [*_compile._cupy_include_options(), f"-I{_compile.CUDA_DIR}", "-arch=compute_90a", *_compile._BASE_OPTIONS]
    prog = nvrtc.createProgram(source, "dispatch.cu", [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        nvrtc.compileProgram(prog, opts)
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    atomics = re.findall(r"^\s*(?:@!?%p\d+\s+)?((?:atom|red)\.\S+)", ptx, re.M)
    assert not atomics, f"atomic instructions in dispatch.cu: {sorted(set(atomics))}"
    assert "match.any" in ptx


# ---------------------------------------------------------------------------------------------
# GPU only
# ---------------------------------------------------------------------------------------------

ALL_PLANS = [
    pytest.param(tile, mode, id=f"{tile[0]}x{tile[1]}-mode{mode}")
    for tile in D._TILES
    for mode in (D.MODE_SINGLE_TILE, D.MODE_DIRECT_SUM, D.MODE_SCANNED)
]
PLAN_SHAPES = [(1, 1, 1), (63, 1, 8), (700, 3, 5), (1000, 8, 64), (3000, 2, 256), (517, 4, 1024), (300, 33, 40),
               (2500, 1, 3), (9000, 2, 9), (640, 64, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("tile,mode", ALL_PLANS)
@pytest.mark.parametrize("dtype", [np.int32, np.int64], ids=["i32", "i64"])
def test_gpu_every_plan(tile, mode, dtype):
    """Each (tile, mode) the planner can pick, forced on small inputs, against the oracle."""
    import cupy

    rng = np.random.default_rng(11)
    for L, K, E in PLAN_SHAPES:
        n = L * K
        if mode == D.MODE_SINGLE_TILE and n > tile[0] * tile[1]:
            continue
        for kind in ("uniform", "skewed", "all_to_one"):
            ids = make_routing(rng, L, E, K, kind, dtype)
            d = D._build_gpu(cupy.asarray(ids), E, L, K, cupy.cuda.get_current_stream(), True, tile, mode)
            check_dispatch(d, ids, E, "gpu")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "L,K,E,dtype",
    [
        pytest.param(1 << 15, 8, 256, np.int32, id="32k-K8-E256"),
        pytest.param(1 << 17, 1, 8, np.int64, id="128k-K1-E8-i64"),
        pytest.param(500_000, 2, 128, np.int32, id="500k-K2-E128"),
        pytest.param(30_000, 8, 1024, np.int32, id="30k-K8-E1024"),
        pytest.param(5_000, 6, 4096, np.int32, id="5k-K6-E4096"),
    ],
)
def test_gpu_medium(L, K, E, dtype):
    ids = make_routing(np.random.default_rng(L + E), L, E, K, "skewed", dtype)
    check_dispatch(build_dispatch(to_backend(ids, "gpu"), E), ids, E, "gpu")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize(
    "L,K,E,dtype",
    [
        pytest.param(2_097_152, 8, 64, np.int32, id="2M-K8-E64"),
        pytest.param(3_000_001, 2, 256, np.int64, id="3M-K2-E256-i64"),
        pytest.param(4_194_304, 1, 8, np.int32, id="4M-K1-E8"),
    ],
)
def test_gpu_millions_of_tokens(L, K, E, dtype):
    import cupy

    rng = np.random.default_rng(L)
    ids = rng.integers(0, E, size=(L, K), dtype=np.int64)
    if K > 1:  # make rows distinct: shift repeats to the next free expert (K << E keeps this cheap)
        for k in range(1, K):
            for _ in range(K):
                clash = (ids[:, :k] == ids[:, k : k + 1]).any(axis=1)
                ids[clash, k] = (ids[clash, k] + 1) % E
    ids = ids.astype(dtype)
    d = build_dispatch(cupy.asarray(ids), E)
    check_dispatch(d, ids, E, "gpu")


@pytest.mark.gpu
def test_gpu_validate_false_clamps_and_stays_in_bounds():
    """validate=False with ids outside [0, E): a negative id drops its pair (listed after the experts' pairs,
    pair_slot -1), one >= E is clamped to E - 1 (no fault, no write outside the outputs); repeated ids within a
    row: placed like any other pair (a stable sort of the flat ids)."""
    import cupy

    rng = np.random.default_rng(3)
    for dtype in (np.int32, np.int64):
        ids = rng.integers(-5, 13, size=(3000, 4)).astype(dtype)
        if dtype == np.int64:
            ids[0, 0], ids[1, 1], ids[2, 2] = 2**40, -(2**40), 2**32 + 1
        d = build_dispatch(cupy.asarray(ids), 8, validate=False)
        bucket = np.where(ids < 0, 8, np.minimum(ids, 7))  # the dropped pairs as a ninth expert, listed last
        offsets, slot_token, slot_k, pair_slot = argsort_dispatch(bucket, 9)
        pair_slot = np.where(ids < 0, -1, pair_slot)
        names = ("expert_offsets", "slot_token", "slot_k", "pair_slot")
        for name, want in zip(names, (offsets[:9], slot_token, slot_k, pair_slot), strict=True):
            assert_int_equal(getattr(d, name), want, name)


@pytest.mark.gpu
def test_gpu_validation_agrees_with_cpu():
    """The check kernel names the same first bad (token, k) as the NumPy check, for many corruptions."""
    import cupy

    rng = np.random.default_rng(5)
    for trial in range(40):
        L, E = int(rng.integers(1, 3000)), int(rng.choice([4, 8, 64, 100]))
        K = int(rng.integers(1, min(E, 48) + 1))
        ids = make_routing(rng, L, E, K, "uniform", np.int64 if trial % 2 else np.int32)
        for _ in range(int(rng.integers(1, 4))):
            t, k = int(rng.integers(L)), int(rng.integers(K))
            ids[t, k] = rng.choice([-1, E, ids[t, (k + 1) % K]])
        msgs = []
        for arr in (ids, cupy.asarray(ids)):
            try:
                build_dispatch(arr, E)
                msgs.append(None)
            except ValueError as e:
                msgs.append(str(e))
        assert msgs[0] == msgs[1]


@pytest.mark.gpu
def test_gpu_graph_capture_and_replay():
    """validate=False builds without a host sync: captured once, replayed on new ids in the same buffer."""
    import cupy

    rng = np.random.default_rng(9)
    L, K, E = 100_000, 4, 128  # three launches: count, scan over tiles, scatter
    assert D.plan(L * K, E).mode == D.MODE_SCANNED
    ids = cupy.asarray(make_routing(rng, L, E, K, "uniform"))
    cupy.cuda.get_current_stream().synchronize()  # the upload ran on another stream
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        build_dispatch(ids, E, validate=False, stream=s)  # warm-up: compile, fill the memory pool
        s.synchronize()
        s.begin_capture()
        d = build_dispatch(ids, E, validate=False, stream=s)
        graph = s.end_capture()
        for kind in ("skewed", "all_to_one"):
            new = make_routing(rng, L, E, K, kind)
            ids.set(new, stream=s)
            graph.launch(stream=s)
            s.synchronize()
            check_dispatch(d, new, E, "gpu")


@pytest.mark.gpu
def test_gpu_side_stream_and_allocator():
    """Outputs and workspace come from the pluggable allocator; kernels run on the given stream."""
    import cupy

    calls = []

    def alloc(shape, dtype_name):
        calls.append((shape, dtype_name))
        return cupy.full(shape, -1, dtype=dtype_name)

    L, K, E = 50_000, 2, 256
    ids = make_routing(np.random.default_rng(4), L, E, K, "skewed")
    ids_gpu = cupy.asarray(ids)
    cupy.cuda.get_current_stream().synchronize()  # the upload ran on another stream
    s = cupy.cuda.Stream(non_blocking=True)
    with _array.allocator(alloc):
        d = build_dispatch(ids_gpu, E, stream=s, validate=False)
    s.synchronize()
    p = D.plan(L * K, E)
    assert sorted(calls) == sorted([((E + 1,), "int32"), ((L * K,), "int32"), ((L * K,), "int32"),
                                    ((L, K), "int32"), (((p.num_tiles + 1) * (E + 1),), "int32")])
    check_dispatch(d, ids, E, "gpu")


@pytest.mark.gpu
def test_gpu_raw_stream_handle():
    """``stream`` may be a raw cudaStream_t (what a framework adapter passes)."""
    import cupy

    ids = make_routing(np.random.default_rng(6), 20_000, 64, 8, "uniform")
    ids_gpu = cupy.asarray(ids)
    cupy.cuda.get_current_stream().synchronize()  # the upload ran on another stream
    s = cupy.cuda.Stream(non_blocking=True)
    d = build_dispatch(ids_gpu, 64, stream=s.ptr)
    s.synchronize()
    check_dispatch(d, ids, 64, "gpu")


@pytest.mark.gpu
def test_gpu_torch_tensor_input():
    torch = pytest.importorskip("torch")
    ids = make_routing(np.random.default_rng(8), 1000, 16, 2, "uniform", np.int64)
    d = build_dispatch(torch.from_numpy(ids).cuda(), 16)
    check_dispatch(d, ids, 16, "gpu")


@pytest.mark.gpu
def test_gpu_too_many_experts_for_shared_memory():
    import cupy

    ids = cupy.zeros((4, 1), cupy.int32)
    with pytest.raises(ValueError, match="shared memory"):
        build_dispatch(ids, 1 << 16, validate=False)


@pytest.mark.gpu
def test_gpu_launcher_checks():
    """The launchers validate shapes, dtypes and devices before launching."""
    import cupy

    ids = cupy.asarray(_valid(L=100, K=2, E=8))
    p = D.plan(200, 8)
    outs = dict(expert_offsets=cupy.empty(9, cupy.int32), slot_token=cupy.empty(200, cupy.int32),
                slot_k=cupy.empty(200, cupy.int32), pair_slot=cupy.empty((100, 2), cupy.int32))
    D.launch_build(ids, 8, p, None, **outs)
    check_dispatch(Dispatch(**outs, num_tokens=100, top_k=2, num_experts=8), cupy.asnumpy(ids), 8, "gpu")
    with pytest.raises(ValueError, match="slot_token"):
        D.launch_build(ids, 8, p, None, **{**outs, "slot_token": cupy.empty(199, cupy.int32)})
    with pytest.raises(TypeError, match="slot_k"):
        D.launch_build(ids, 8, p, None, **{**outs, "slot_k": cupy.empty(200, cupy.int64)})
    with pytest.raises(ValueError, match="same device"):  # a CPU output among GPU arrays
        D.launch_build(ids, 8, p, None, **{**outs, "pair_slot": np.empty((100, 2), np.int32)})
    with pytest.raises(ValueError, match="workspace"):
        D.launch_build(ids, 8, D.plan(200, 8, (256, 8), D.MODE_SCANNED), cupy.empty(3, cupy.int32), **outs)
    with pytest.raises(ValueError, match="plan"):
        D.launch_build(ids, 8, D.plan(100_000, 8), None, **outs)  # 49 tiles planned for 200 pairs
    buf = cupy.empty(D.check_blocks(100, 2), cupy.int32)
    D.launch_check(ids, 8, buf)
    assert int(buf.min()) == 2**31 - 1
    with pytest.raises(ValueError, match="CUDA arrays"):
        D.launch_check(cupy.asnumpy(ids), 8, buf)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available() or _array._cupy().cuda.runtime.getDeviceCount() < 2, reason="needs 2 GPUs")
def test_gpu_ids_on_another_device():
    import cupy

    with cupy.cuda.Device(1):
        ids = cupy.asarray(_valid())
    with cupy.cuda.Device(0), pytest.raises(ValueError, match="GPU 1 but the current device is 0"):
        build_dispatch(ids, 8)
