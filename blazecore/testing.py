"""Helpers shared by blazecore's tests and benchmarks (and usable by anyone testing code built on blazecore).

    make_routing       (L, K) expert ids of a named routing kind (uniform, skewed, all on one expert, ...)
    argsort_dispatch   the conventional dispatch build (stable argsort), the oracle of ``build_dispatch``
    to_numpy           any array the library returns (NumPy, CuPy, DLPack) as a NumPy array
    rel_norm_error     ||actual - expected|| / ||expected||
    assert_close       the named comparison: relative norm error under a tolerance, or an AssertionError that
                       gives the max-abs error and the first bad index

NumPy only (CuPy where the arrays already are); importing it does no work. Not imported by ``import blazecore``.
"""

from __future__ import annotations

import numpy as np

from . import _array

__all__ = ["ROUTINGS", "argsort_dispatch", "assert_close", "make_routing", "rel_norm_error", "to_numpy"]

# Routing kinds of make_routing
ROUTINGS = ("uniform", "zipf", "skewed", "all_to_one", "empty_experts", "same", "late", "k_eq_e")


def make_routing(rng: np.random.Generator, L: int, E: int, K: int, kind: str = "uniform",
                 dtype=np.int32) -> np.ndarray:
    """(L, K) expert ids, K distinct experts in [0, E) per row, in random column order.

    Args:
        rng: the NumPy generator the routing is drawn from.
        L, E, K: tokens, experts, experts per token (0 <= K <= E).
        kind: one of ROUTINGS:
            uniform: every expert equally likely.
            zipf: expert weights (rank + 1)**-1.5 over a random ranking (a few hot experts, a long cold tail).
            skewed: the same weights with expert 0 the hottest, expert E-1 the coldest.
            all_to_one: one expert (random) in every row, the other K - 1 uniform (K = 1: every token on it).
            empty_experts: only max(K, E // 4) experts (random) are used; the rest get no token.
            same: every row holds the same K experts (random), in its own order.
            late: the first half of the rows use only experts [0, K), the rest are uniform (the experts >= K
                get their first slot in a later token chunk).
            k_eq_e: every row a permutation of all experts (needs K == E).
        dtype: integer dtype of the result.
    """
    if kind not in ROUTINGS:
        raise ValueError(f"unknown routing kind {kind!r} (expected one of {ROUTINGS})")
    if not 0 <= K <= E:
        raise ValueError(f"K = {K} must be in [0, E = {E}]")
    if kind == "k_eq_e" and K != E:
        raise ValueError(f"k_eq_e needs K == E, got K={K}, E={E}")
    if L == 0 or K == 0:
        return np.zeros((L, K), dtype=dtype)
    logw = np.zeros(E)
    with np.errstate(divide="ignore"):
        if kind == "zipf":
            logw = -1.5 * np.log1p(rng.permutation(E).astype(np.float64))
        elif kind == "skewed":
            logw = -1.5 * np.log1p(np.arange(E, dtype=np.float64))
        elif kind == "empty_experts":
            logw = np.full(E, -np.inf)
            logw[rng.permutation(E)[: max(K, E // 4)]] = 0.0
        elif kind == "same":
            logw = np.full(E, -np.inf)
            logw[rng.permutation(E)[:K]] = 0.0
    keys = logw[None, :] + rng.gumbel(size=(L, E))  # Gumbel top-k: K distinct draws without replacement
    if kind == "all_to_one":
        keys[:, rng.integers(E)] = np.inf
    elif kind == "late":
        keys[: L // 2, K:] = -np.inf
    ids = np.argpartition(-keys, K - 1, axis=1)[:, :K]
    return np.ascontiguousarray(rng.permuted(ids, axis=1).astype(dtype))


def argsort_dispatch(ids, num_experts: int, xp=np):
    """The conventional dispatch build: stable argsort of the flat ids, bincount, cumsum, inverse permutation.

    Args:
        ids: (L, K) integer expert ids in [0, E) (NumPy, or CuPy with ``xp=cupy``).
        num_experts: E.
        xp: the array module of ``ids``.

    Returns:
        (expert_offsets (E+1,), slot_token (L*K,), slot_k (L*K,), pair_slot (L, K)), int64: what
        ``blazecore.build_dispatch`` must return (within an expert, slots in (token, k) order).
    """
    L, K = ids.shape
    flat = ids.reshape(-1).astype(xp.int64)
    order = xp.argsort(flat, kind="stable") if xp is np else xp.argsort(flat)  # CuPy's argsort is stable
    offsets = xp.zeros(num_experts + 1, dtype=xp.int64)
    offsets[1:] = xp.cumsum(xp.bincount(flat, minlength=num_experts))
    pair_slot = xp.empty(flat.size, dtype=xp.int64)
    pair_slot[order] = xp.arange(flat.size, dtype=xp.int64)
    return offsets, order // max(K, 1), order % max(K, 1), pair_slot.reshape(L, K)


def to_numpy(a) -> np.ndarray:
    """A NumPy array of ``a`` (NumPy, CuPy or any DLPack array); bf16 held as uint16 bits comes back as bf16."""
    if isinstance(a, np.ndarray):
        return a
    v = _array.asarray(a)
    if isinstance(v, np.ndarray):
        return v
    h = v.get()
    return h.view(_array.BF16) if _array.logical_dtype(v) == _array.BF16 else h


def rel_norm_error(actual, expected) -> float:
    """||actual - expected|| / ||expected|| in float64 (the plain norm of the difference when expected is 0)."""
    a = np.asarray(to_numpy(actual), dtype=np.float64)
    e = np.asarray(to_numpy(expected), dtype=np.float64)
    denom = np.linalg.norm(e)
    return float(np.linalg.norm(a - e) / (denom if denom > 0 else 1.0))


def assert_close(actual, expected, rtol_norm: float, name: str = "output") -> None:
    """Relative norm error ``||a - e|| / ||e||`` under ``rtol_norm``, else an AssertionError naming ``name`` with
    the error, the max-abs error and its index (or the first non-finite value where ``expected`` is finite).

    Args:
        actual: any array (NumPy, CuPy, DLPack; bf16 included).
        expected: a NumPy array of the same shape (float64 references).
        rtol_norm: the tolerance (1e-2 for bf16 against float64, 1e-5 for float32).
        name: what is compared, for the message.
    """
    a = np.asarray(to_numpy(actual), dtype=np.float64)
    e = np.asarray(to_numpy(expected), dtype=np.float64)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != expected {e.shape}"
    if a.size == 0:
        return
    nonfinite = ~np.isfinite(a) & np.isfinite(e)
    if nonfinite.any():
        idx = tuple(int(i) for i in np.argwhere(nonfinite)[0])
        raise AssertionError(f"{name}: non-finite value {a[idx]} at {idx} (expected {e[idx]})")
    diff = np.abs(a - e)
    rel = rel_norm_error(a, e)
    if not rel <= rtol_norm:
        idx = tuple(int(i) for i in np.unravel_index(np.argmax(diff), diff.shape))
        raise AssertionError(
            f"{name}: relative norm error {rel:.3e} > {rtol_norm:.1e}; max abs error {diff.max():.3e} at {idx} "
            f"(got {a[idx]}, expected {e[idx]})"
        )
