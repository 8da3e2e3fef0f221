"""The router: top-k expert selection with softmax or sigmoid scores, its backward, and the auxiliary losses.

Forward (``route_topk``), for every token row t of the logits x (L, E):

    s_e   = softmax(x_t)_e            (score="softmax", over the E experts, in fp32)
          = sigmoid(x_te)             (score="sigmoid")
    ids   = the K experts with the largest  s_e + expert_bias_e  (or s_e without a bias), in descending
            order, ties to the lower expert index
    gates = s_{ids_k} / sum_k s_{ids_k}   (renormalize=True)   or   s_{ids_k}   (renormalize=False)

The bias (aux-loss-free balancing) only changes which experts are selected; the gates use the unbiased
score. The backward (``route_topk_backward``) recomputes the scores from the logits, so nothing but the
(L, K) ids has to be kept between forward and backward; selection is piecewise constant and passes no
gradient (none to the bias either).

Auxiliary losses (p_t = softmax(x_t), lse_t = logsumexp(x_t)):

    load_balancing_loss  aux = E * sum_e f_e P_e,  f_e = #{(t, k): ids_tk = e} / (L K),  P_e = mean_t p_te
    router_z_loss        z   = mean_t lse_t^2

Both are 0 for L = 0. Only P carries a gradient in aux (f is a count).

GPU inputs run the kernels of ``cuda/router.cu`` (one fused kernel for the forward, one for the
backward; see that file for the layout); CPU inputs run ``blazecore.reference.router``. Neither path
synchronises with the host unless ``validate=True`` is asked for. On the CPU the logits may also be float64
(the reference's own precision, e.g. for gradcheck): then the float32 results and operands (gates, dgates,
the losses, expert_bias) are float64 as well; float64 on the GPU is a TypeError.

On ties. Without a bias the GPU ranks experts by the logit itself (the score is increasing in it, so the
order is the same and exact: only equal logits tie); with a bias it ranks the fp32 value s_e + bias_e. The
CPU reference ranks the float64 score. Both break exact ties by the lower index, so inputs with equal
logits give the same ids on both; values that differ by an fp32 rounding may order differently.
"""

from __future__ import annotations

import numpy as np

from . import _array, _compile, _validate
from ._array import BF16, like_caller, logical_dtype
from .reference import router as _ref

__all__ = [
    "MAX_EXPERTS",
    "route_topk",
    "route_topk_backward",
    "load_balancing_loss",
    "load_balancing_loss_backward",
    "router_z_loss",
    "router_z_loss_backward",
]

_FILE = "router.cu"
_CTYPES = {np.dtype(np.float32): "float", np.dtype(np.float16): "__half", BF16: "__nv_bfloat16"}
_LOGIT_DTYPES = tuple(_CTYPES)
_F64 = np.dtype(np.float64)  # CPU only: the NumPy reference's own precision (gradcheck)
_SCORES = {"softmax": 0, "sigmoid": 1}
_NULL = np.uint64(0)

# (warps per row, values per thread): a row group of 32*warps threads holds up to 32*warps*vpt experts in
# registers. One warp per row up to E = 1024 (shuffle reductions only), a 256-thread block above.
_ROW_CONFIGS = ((1, 4), (1, 8), (1, 16), (1, 32), (8, 16), (8, 32))
MAX_EXPERTS = max(32 * w * v for w, v in _ROW_CONFIGS)  # 8192
_ROW_KERNELS = ("route_topk_fwd", "route_topk_bwd", "router_aux_partial", "router_aux_bwd")
_FINALIZE = "blz::router_aux_finalize"
# router_aux_partial: partial sums per block are kept to at most this many floats, so the single-block
# finalize reads at most 1 MiB; a block covers at least 32 rows.
_PARTIAL_ELEMS = 1 << 18
_MIN_ROWS_PER_BLOCK = 32


def _name(kernel: str, ct: str, warps: int, vpt: int) -> str:
    return f"blz::{kernel}<{ct}, {warps}, {vpt}>"


_compile.register_kernels(
    _FILE,
    [_name(k, ct, w, v) for k in _ROW_KERNELS for ct in _CTYPES.values() for w, v in _ROW_CONFIGS] + [_FINALIZE],
)


def _row_config(E: int) -> tuple[int, int]:
    for warps, vpt in _ROW_CONFIGS:
        if 32 * warps * vpt >= E:
            return warps, vpt
    raise ValueError(f"E = {E} experts exceeds the supported maximum {MAX_EXPERTS}")


def _groups(warps: int) -> int:
    return 4 if warps == 1 else 1  # rows per block, as router_groups() in the .cu


def _threads(warps: int) -> int:
    return 32 * warps * _groups(warps)


def _vec_ok(E: int, dtype, vpt: int, *arrays) -> np.int32:
    """1 if rows can be read (and written) with V-element vector accesses: E % V == 0, aligned bases."""
    itemsize = np.dtype(dtype).itemsize
    v = min(16 // itemsize, vpt)
    if v * itemsize < 4 or E % v:
        return np.int32(0)
    return np.int32(all(a.data.ptr % (v * itemsize) == 0 for a in arrays))


def _fn(name: str):
    return _compile.get_function(_FILE, name)


def _row_grid(L: int, warps: int) -> tuple:
    g = _groups(warps)
    return ((L + g - 1) // g,)


# ---------------------------------------------------------------------------------------------------------
# Input checks (all before any launch)
# ---------------------------------------------------------------------------------------------------------


def _check_logits(x, name="logits") -> tuple[int, int]:
    _validate.check_ndim(x, name, 2, "(L, E) router logits")
    _validate.check_dtype(x, name, (*_LOGIT_DTYPES, _F64))
    _validate.check_contiguous(x, name)
    L, E = (int(s) for s in x.shape)
    if E < 1:
        raise ValueError(f"{name}: need at least one expert, got shape {(L, E)}")
    if E > MAX_EXPERTS:
        raise ValueError(f"{name}: E = {E} experts exceeds the supported maximum {MAX_EXPERTS}")
    _validate.check_int32_range(L, f"{name}: L")
    return L, E


def _f64_cpu(x, gpu: bool, name="logits") -> bool:
    """Whether ``x`` is float64, which runs on the CPU only (TypeError for a GPU array)."""
    if logical_dtype(x) != _F64:
        return False
    if gpu:
        raise TypeError(f"{name}: dtype float64 not supported on the GPU (float64 runs on the CPU, in the NumPy "
                        f"reference; pass float32, float16 or bfloat16)")
    return True


def _float_out(f64: bool):
    """The dtype of the router's float32 results (gates, losses, their gradients' inputs): float64 for float64
    logits."""
    return _F64 if f64 else np.dtype(np.float32)


def _check_top_k(top_k, E: int) -> int:
    if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, (int, np.integer)):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    K = int(top_k)
    if not 1 <= K <= E:
        raise ValueError(f"top_k = {K} must be in [1, E] with E = {E} experts")
    return K


def _check_score(score) -> int:
    if score not in _SCORES:
        raise ValueError(f"score must be one of {sorted(_SCORES)}, got {score!r}")
    return _SCORES[score]


def _check_ids(ids, name: str, L: int, E: int) -> int:
    """(L, K) int32 ids with 1 <= K <= E; returns K."""
    _validate.check_ndim(ids, name, 2, "(L, K) expert ids")
    _validate.check_integer(ids, name)
    if np.dtype(ids.dtype) != np.int32:
        raise TypeError(f"{name}: expected int32 expert ids (as route_topk returns), got {ids.dtype}")
    _validate.check_contiguous(ids, name)
    if int(ids.shape[0]) != L:
        raise ValueError(f"{name}: {ids.shape[0]} rows, logits have L = {L}")
    K = int(ids.shape[1])
    if not 1 <= K <= E:
        raise ValueError(f"{name}: K = {K} must be in [1, E] with E = {E} experts")
    _validate.check_int32_range(L * K, f"{name}: L*K")
    return K


def _check_id_values(ids, E: int, name: str, distinct: bool) -> None:
    """Value checks that read the ids (a host synchronisation on the GPU)."""
    if ids.size == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= E:
        raise ValueError(f"{name}: expert ids must be in [0, {E}), found values in [{lo}, {hi}]")
    if distinct and ids.shape[1] > 1:
        srt = ids.copy()
        srt.sort(axis=1)
        dup = (srt[:, 1:] == srt[:, :-1]).any(axis=1)
        if bool(dup.any()):
            row = int(dup.nonzero()[0][0])
            raise ValueError(f"{name}: expert ids must be distinct within a row; row {row} repeats one")


def _check_bias(bias, E: int, f64: bool = False):
    b = _array.asarray(bias, "expert_bias")
    _validate.check_array(b, "expert_bias", (np.float32, np.float64) if f64 else (np.float32,), (E,))
    return b


def _check_dloss(dloss, gpu: bool, name: str):
    """(device pointer array or None, host value) for an upstream loss gradient."""
    if isinstance(dloss, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a number or a one-element float32 array, got bool")
    if isinstance(dloss, (int, float, np.integer, np.floating)):
        return None, float(dloss)
    d = _array.asarray(dloss, name)
    if d.size != 1:
        raise ValueError(f"{name}: expected a scalar (one element), got shape {tuple(d.shape)}")
    if not _array.is_gpu(d):
        return None, float(np.asarray(d, dtype=np.float64).reshape(()))
    if not gpu:
        raise ValueError(f"{name}: on the GPU, logits are on the CPU")
    _validate.check_dtype(d, name, (np.float32,))
    return d, 0.0


def _check_stream(stream, gpu: bool) -> None:
    if stream is not None and not gpu:
        raise ValueError("stream given, but the logits are a CPU array (streams apply to CUDA arrays)")


def _check_out_device(arrays: dict) -> None:
    _validate.same_device(arrays)


# ---------------------------------------------------------------------------------------------------------
# Launchers: validated CuPy views in, nothing out. Signatures mirror the kernels.
# ---------------------------------------------------------------------------------------------------------


def launch_route_topk_fwd(logits, bias, gates, ids, top_k: int, score: int, renormalize: bool, stream=None) -> None:
    """logits (L, E) fp32/fp16/bf16, bias (E,) fp32 or None -> gates (L, K) fp32, ids (L, K) int32."""
    L, E = _check_logits(logits)
    K = _check_top_k(top_k, E)
    dt = logical_dtype(logits)
    _validate.check_shape(gates, "gates", (L, K))
    _validate.check_dtype(gates, "gates", (np.float32,))
    _validate.check_contiguous(gates, "gates")
    _validate.check_shape(ids, "ids", (L, K))
    if np.dtype(ids.dtype) != np.int32:
        raise TypeError(f"ids: expected int32, got {ids.dtype}")
    _validate.check_contiguous(ids, "ids")
    if bias is not None:
        _validate.check_array(bias, "expert_bias", (np.float32,), (E,))
    if L == 0:
        return
    warps, vpt = _row_config(E)
    fn = _fn(_name("route_topk_fwd", _CTYPES[dt], warps, vpt))
    fn(_row_grid(L, warps), (_threads(warps),),
       (logits, _NULL if bias is None else bias, gates, ids, np.int32(L), np.int32(E), np.int32(K),
        np.int32(score), np.int32(bool(renormalize)), _vec_ok(E, dt, vpt, logits)),
       stream=_array.current_stream(stream))


def launch_route_topk_bwd(dgates, logits, ids, dlogits, score: int, renormalize: bool, stream=None) -> None:
    """dgates (L, K) fp32, logits (L, E), ids (L, K) int32 -> dlogits (L, E) in the logits' dtype."""
    L, E = _check_logits(logits)
    K = _check_ids(ids, "expert_ids", L, E)
    dt = logical_dtype(logits)
    _validate.check_array(dgates, "dgates", (np.float32,), (L, K))
    _validate.check_array(dlogits, "dlogits", (dt,), (L, E))
    if L == 0:
        return
    warps, vpt = _row_config(E)
    fn = _fn(_name("route_topk_bwd", _CTYPES[dt], warps, vpt))
    fn(_row_grid(L, warps), (_threads(warps),),
       (dgates, logits, ids, dlogits, np.int32(L), np.int32(E), np.int32(K), np.int32(score),
        np.int32(bool(renormalize)), _vec_ok(E, dt, vpt, logits, dlogits)),
       stream=_array.current_stream(stream))


def aux_partial_blocks(L: int, E: int) -> tuple[int, int]:
    """(rows per block R, blocks G) of router_aux_partial; a function of (L, E) only, so the losses are
    reduced in the same order on every run and every GPU."""
    R = max(_MIN_ROWS_PER_BLOCK, -(-L * E // _PARTIAL_ELEMS))
    return R, -(-L // R)


def launch_router_aux_partial(logits, ids, part_p, part_z, part_count, rows_per_block: int, stream=None) -> None:
    """Per-block partial sums: part_p (G, E) fp32 column sums of softmax(logits), part_z (G,) fp32 sums of
    logsumexp^2, part_count (G, E) int32 expert counts of ids (L, K) int32; any output may be None."""
    L, E = _check_logits(logits)
    dt = logical_dtype(logits)
    R = int(rows_per_block)
    if R < 1:
        raise ValueError(f"rows_per_block = {R} must be positive")
    G = -(-L // R)
    K = 1
    if part_count is not None:
        if ids is None:
            raise ValueError("part_count needs the expert ids")
        K = _check_ids(ids, "expert_ids", L, E)
        _validate.check_shape(part_count, "part_count", (G, E))
        if np.dtype(part_count.dtype) != np.int32:
            raise TypeError(f"part_count: expected int32, got {part_count.dtype}")
        _validate.check_contiguous(part_count, "part_count")
    if part_p is not None:
        _validate.check_array(part_p, "part_p", (np.float32,), (G, E))
    if part_z is not None:
        _validate.check_dtype(part_z, "part_z", (np.float32,))
        _validate.check_shape(part_z, "part_z", (G,))
    if G == 0 or (part_p is None and part_z is None and part_count is None):
        return
    warps, vpt = _row_config(E)
    groups = _groups(warps)
    smem = 4 * E * ((groups if (groups > 1 and part_p is not None) else 0) + (1 if part_count is not None else 0))
    fn = _fn(_name("router_aux_partial", _CTYPES[dt], warps, vpt))
    fn((G,), (_threads(warps),),
       (logits, _NULL if part_count is None else ids, np.int32(L), np.int32(E), np.int32(K), np.int32(R),
        _vec_ok(E, dt, vpt, logits), _NULL if part_p is None else part_p, _NULL if part_z is None else part_z,
        _NULL if part_count is None else part_count),
       shared_mem=smem, stream=_array.current_stream(stream))


def launch_router_aux_finalize(part_p, part_count, part_z, L: int, K: int, E: int, lb, z, f, stream=None) -> None:
    """Reduce the partials: lb () fp32 load-balancing loss, z () fp32 z-loss, f (E,) fp32 = counts / (L K);
    any output may be None (lb needs part_p and part_count, z needs part_z, f needs part_count)."""
    G = None
    for name, a, dt in (("part_p", part_p, np.float32), ("part_count", part_count, np.int32)):
        if a is not None:
            _validate.check_ndim(a, name, 2, "(G, E) partials")
            if np.dtype(a.dtype) != dt or int(a.shape[1]) != E:
                raise ValueError(f"{name}: expected (G, {E}) {np.dtype(dt).name}, got {tuple(a.shape)} {a.dtype}")
            _validate.check_contiguous(a, name)
            G = int(a.shape[0]) if G is None else G
            if int(a.shape[0]) != G:
                raise ValueError(f"{name}: {a.shape[0]} partial rows, expected {G}")
    if part_z is not None:
        _validate.check_dtype(part_z, "part_z", (np.float32,))
        G = int(part_z.shape[0]) if G is None else G
        _validate.check_shape(part_z, "part_z", (G,))
    if lb is not None and (part_p is None or part_count is None):
        raise ValueError("the load-balancing loss needs part_p and part_count")
    if z is not None and part_z is None:
        raise ValueError("the z-loss needs part_z")
    if f is not None and part_count is None:
        raise ValueError("f needs part_count")
    for name, a, shape in (("lb", lb, ()), ("z", z, ()), ("f", f, (E,))):
        if a is not None:
            _validate.check_array(a, name, (np.float32,), shape)
    _validate.check_int32_range(L * K, "L*K")
    _fn(_FINALIZE)((1,), (1024,),
                   (_NULL if part_p is None else part_p, _NULL if part_count is None else part_count,
                    _NULL if part_z is None else part_z, np.int32(G or 0), np.int32(L), np.int32(K), np.int32(E),
                    _NULL if lb is None else lb, _NULL if z is None else z, _NULL if f is None else f),
                   stream=_array.current_stream(stream))


def launch_router_aux_bwd(logits, f, d_lb, d_lb_value: float, d_z, d_z_value: float, dlogits, stream=None) -> None:
    """dlogits (L, E) = gradient of d_lb * aux + d_z * z; f (E,) fp32 or None (no aux term); d_lb / d_z are
    one-element fp32 device arrays or None (then the host values are used)."""
    L, E = _check_logits(logits)
    dt = logical_dtype(logits)
    if f is not None:
        _validate.check_dtype(f, "f", (np.float32,))
        _validate.check_shape(f, "f", (E,))
    for name, d in (("d_lb", d_lb), ("d_z", d_z)):
        if d is not None:
            _validate.check_dtype(d, name, (np.float32,))
            if d.size != 1:
                raise ValueError(f"{name}: expected one element, got shape {tuple(d.shape)}")
    _validate.check_array(dlogits, "dlogits", (dt,), (L, E))
    if L == 0:
        return
    warps, vpt = _row_config(E)
    fn = _fn(_name("router_aux_bwd", _CTYPES[dt], warps, vpt))
    fn(_row_grid(L, warps), (_threads(warps),),
       (logits, _NULL if f is None else f, _NULL if d_lb is None else d_lb, np.float32(d_lb_value),
        _NULL if d_z is None else d_z, np.float32(d_z_value), np.int32(L), np.int32(E),
        _vec_ok(E, dt, vpt, logits, dlogits), dlogits),
       stream=_array.current_stream(stream))


# ---------------------------------------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------------------------------------


def route_topk(logits, top_k, *, score="softmax", renormalize=True, expert_bias=None, out_gates=None,
               out_ids=None, stream=None, check_finite: bool = False):
    """Top-k routing of L tokens over E experts, fused in one kernel.

    Args:
        logits: (L, E) float32, float16 or bfloat16, C-contiguous, any DLPack array; L >= 0,
            1 <= E <= MAX_EXPERTS (8192).
        top_k: K, 1 <= K <= E.
        score: "softmax" (over the E experts, in fp32) or "sigmoid".
        renormalize: divide the selected scores by their sum (both scores).
        expert_bias: optional (E,) float32 added to the scores for the selection only (the gates use the
            unbiased scores), on the same device as the logits.
        out_gates, out_ids: optional (L, K) float32 / int32 C-contiguous buffers to write.
        stream: CuPy stream or raw handle for the GPU path (default: CuPy's current stream); must be None
            for CPU logits (ValueError), as in every op of the router.
        check_finite: first count the NaN / inf values of the logits (and the bias) and raise
            FloatingPointError naming the array and the count, before anything is written. Off by default:
            on the GPU it is one reduction and one host read, which synchronises the stream.

    Returns:
        (gates, expert_ids): (L, K) float32 and (L, K) int32 on the logits' device; row t lists its experts
        by descending selection value (ties to the lower index). Keep the ids for the backward.
    """
    x = _array.asarray(logits, "logits")
    L, E = _check_logits(x)
    K = _check_top_k(top_k, E)
    score_id = _check_score(score)
    arrays = {"logits": x}
    bias = None
    if expert_bias is not None:
        bias = _check_bias(expert_bias, E, logical_dtype(x) == _F64)
        arrays["expert_bias"] = bias
    gpu = _validate.same_device(arrays)
    f64 = _f64_cpu(x, gpu)
    _check_stream(stream, gpu)
    with _array.stream_scope(stream, gpu):  # outputs and their fills in order with the kernels
        gates = _array.out_or_empty(out_gates, (L, K), _float_out(f64), gpu, "out_gates")
        ids = _array.out_or_empty(out_ids, (L, K), np.int32, gpu, "out_ids")
        _check_out_device({**arrays, "out_gates": gates.view, "out_ids": ids.view})
        if check_finite:
            _validate.check_finite_arrays(arrays, stream)
        if gpu:
            launch_route_topk_fwd(x, bias, gates.view, ids.view, K, score_id, renormalize, stream)
        else:
            g, i = _ref.route_topk_forward(x, K, score=score, renormalize=renormalize, expert_bias=bias)
            gates.view[...] = g
            ids.view[...] = i
        return like_caller(gates.user, logits), like_caller(ids.user, logits)


def route_topk_backward(dgates, logits, expert_ids, *, score="softmax", renormalize=True, out=None, stream=None,
                        validate=False):
    """Gradient of the gates with respect to the logits; the scores are recomputed from the logits.

    Args:
        dgates: (L, K) float32, the gradient of the loss with respect to the gates.
        logits: (L, E) float32, float16 or bfloat16, the forward's logits.
        expert_ids: (L, K) int32, the forward's ids (distinct within a row).
        score, renormalize: as in the forward (the expert bias plays no part: it only moved the selection).
        out: optional (L, E) buffer in the logits' dtype.
        stream: as in :func:`route_topk`.
        validate: on the GPU, also check that the ids are in [0, E) and distinct per row (a host sync).
            Without it the kernel skips out-of-range ids and never accesses memory out of bounds. The CPU
            path always checks.

    Returns:
        dlogits: (L, E) in the logits' dtype. With renormalize=True (both scores) or score="sigmoid" it is
        zero outside the selected experts.
    """
    x = _array.asarray(logits, "logits")
    dg = _array.asarray(dgates, "dgates")
    ids = _array.asarray(expert_ids, "expert_ids")
    L, E = _check_logits(x)
    K = _check_ids(ids, "expert_ids", L, E)
    score_id = _check_score(score)
    _validate.check_array(dg, "dgates", (_float_out(logical_dtype(x) == _F64),), (L, K))
    gpu = _validate.same_device({"dgates": dg, "logits": x, "expert_ids": ids})
    _f64_cpu(x, gpu)
    _check_stream(stream, gpu)
    with _array.stream_scope(stream, gpu):  # outputs and their fills in order with the kernels
        dt = logical_dtype(x)
        dx = _array.out_or_empty(out, (L, E), dt, gpu, "out")
        _check_out_device({"logits": x, "out": dx.view})
        if gpu:
            if validate:
                _check_id_values(ids, E, "expert_ids", distinct=True)
            launch_route_topk_bwd(dg, x, ids, dx.view, score_id, renormalize, stream)
        else:
            _check_id_values(ids, E, "expert_ids", distinct=True)
            dx.view[...] = _ref.route_topk_backward(dg, x, ids, score=score, renormalize=renormalize).astype(dt)
        return like_caller(dx.user, logits)


def _aux_forward(x, ids, want_lb: bool, want_z: bool, out, stream):
    L, E = (int(s) for s in x.shape)
    K = int(ids.shape[1]) if ids is not None else 1
    res = _array.out_or_empty(out, (), np.float32, True, "out")
    _check_out_device({"logits": x, "out": res.view})
    R, G = aux_partial_blocks(L, E)
    part_p = _array.empty_gpu((G, E), np.float32) if want_lb else None
    part_count = _array.empty_gpu((G, E), np.int32) if want_lb else None
    part_z = _array.empty_gpu((G,), np.float32) if want_z else None
    v = lambda o: None if o is None else o.view  # noqa: E731
    launch_router_aux_partial(x, ids, v(part_p), v(part_z), v(part_count), R, stream)
    launch_router_aux_finalize(v(part_p), v(part_count), v(part_z), L, K, E,
                               res.view if want_lb else None, res.view if want_z else None, None, stream)
    return res.user


def load_balancing_loss(logits, expert_ids, *, out=None, stream=None, validate=False):
    """Switch / GShard load-balancing loss  aux = E * sum_e f_e * P_e.

    f_e = (number of (token, k) assignments to expert e) / (L K) and P_e = (1/L) sum_t softmax(logits_t)_e
    (the softmax of the full logits, in fp32, whatever score the router uses). 0 for L = 0.

    Args:
        logits: (L, E) float32, float16 or bfloat16.
        expert_ids: (L, K) int32 selected experts (route_topk's ids).
        out: optional 0-d float32 buffer.
        validate: on the GPU, check that ids are in [0, E) (a host sync); otherwise ids outside are not
            counted. The CPU path always checks.

    Returns:
        A 0-d float32 array on the logits' device.
    """
    x = _array.asarray(logits, "logits")
    ids = _array.asarray(expert_ids, "expert_ids")
    L, E = _check_logits(x)
    _check_ids(ids, "expert_ids", L, E)
    gpu = _validate.same_device({"logits": x, "expert_ids": ids})
    f64 = _f64_cpu(x, gpu)
    _check_stream(stream, gpu)
    with _array.stream_scope(stream, gpu):  # outputs and their fills in order with the kernels
        if gpu:
            if validate:
                _check_id_values(ids, E, "expert_ids", distinct=False)
            return _aux_forward(x, ids, True, False, out, stream)
        _check_id_values(ids, E, "expert_ids", distinct=False)
        res = _array.out_or_empty(out, (), _float_out(f64), False, "out")
        res.view[...] = _ref.load_balancing_loss(x, ids)
        return like_caller(res.user, logits)


def router_z_loss(logits, *, out=None, stream=None):
    """Router z-loss  z = (1/L) sum_t logsumexp(logits_t)^2  (fp32); 0 for L = 0.

    Args:
        logits: (L, E) float32, float16 or bfloat16.
        out: optional 0-d float32 buffer.

    Returns:
        A 0-d float32 array on the logits' device.
    """
    x = _array.asarray(logits, "logits")
    _check_logits(x)
    gpu = _validate.same_device({"logits": x})
    f64 = _f64_cpu(x, gpu)
    _check_stream(stream, gpu)
    with _array.stream_scope(stream, gpu):  # outputs and their fills in order with the kernels
        if gpu:
            return _aux_forward(x, None, False, True, out, stream)
        res = _array.out_or_empty(out, (), _float_out(f64), False, "out")
        res.view[...] = _ref.router_z_loss(x)
        return like_caller(res.user, logits)


def load_balancing_loss_backward(dloss, logits, expert_ids, *, out=None, stream=None, validate=False):
    """Gradient of  dloss * load_balancing_loss(logits, expert_ids)  with respect to the logits:

        dlogits_tj = dloss * (E / L) * p_tj * (f_j - sum_e f_e p_te),   p_t = softmax(logits_t)

    Args:
        dloss: the upstream gradient: a Python number, or a one-element float32 array (on the GPU it is
            read by the kernel, so a device-side loss scale needs no host round trip).
        logits: (L, E) float32, float16 or bfloat16.
        expert_ids: (L, K) int32.
        out: optional (L, E) buffer in the logits' dtype.
        validate: as in :func:`load_balancing_loss`.

    Returns:
        dlogits: (L, E) in the logits' dtype.
    """
    x = _array.asarray(logits, "logits")
    ids = _array.asarray(expert_ids, "expert_ids")
    L, E = _check_logits(x)
    K = _check_ids(ids, "expert_ids", L, E)
    gpu = _validate.same_device({"logits": x, "expert_ids": ids})
    _f64_cpu(x, gpu)
    _check_stream(stream, gpu)
    with _array.stream_scope(stream, gpu):  # outputs and their fills in order with the kernels
        d_ptr, d_val = _check_dloss(dloss, gpu, "dloss")
        dt = logical_dtype(x)
        dx = _array.out_or_empty(out, (L, E), dt, gpu, "out")
        _check_out_device({"logits": x, "out": dx.view})
        if not gpu:
            _check_id_values(ids, E, "expert_ids", distinct=False)
            dx.view[...] = _ref.load_balancing_loss_backward(d_val, x, ids).astype(dt)
            return like_caller(dx.user, logits)
        if validate:
            _check_id_values(ids, E, "expert_ids", distinct=False)
        if L == 0:
            return like_caller(dx.user, logits)
        R, G = aux_partial_blocks(L, E)
        part_count = _array.empty_gpu((G, E), np.int32)
        f = _array.empty_gpu((E,), np.float32)
        launch_router_aux_partial(x, ids, None, None, part_count.view, R, stream)
        launch_router_aux_finalize(None, part_count.view, None, L, K, E, None, None, f.view, stream)
        launch_router_aux_bwd(x, f.view, d_ptr, d_val, None, 0.0, dx.view, stream)
        return like_caller(dx.user, logits)


def router_z_loss_backward(dloss, logits, *, out=None, stream=None):
    """Gradient of  dloss * router_z_loss(logits)  with respect to the logits:

        dlogits_tj = dloss * (2 / L) * logsumexp(logits_t) * softmax(logits_t)_j

    Args:
        dloss: a Python number or a one-element float32 array (see load_balancing_loss_backward).
        logits: (L, E) float32, float16 or bfloat16.
        out: optional (L, E) buffer in the logits' dtype.

    Returns:
        dlogits: (L, E) in the logits' dtype.
    """
    x = _array.asarray(logits, "logits")
    L, E = _check_logits(x)
    gpu = _validate.same_device({"logits": x})
    _f64_cpu(x, gpu)
    _check_stream(stream, gpu)
    with _array.stream_scope(stream, gpu):  # outputs and their fills in order with the kernels
        d_ptr, d_val = _check_dloss(dloss, gpu, "dloss")
        dt = logical_dtype(x)
        dx = _array.out_or_empty(out, (L, E), dt, gpu, "out")
        _check_out_device({"logits": x, "out": dx.view})
        if gpu:
            launch_router_aux_bwd(x, None, None, 0.0, d_ptr, d_val, dx.view, stream)
        else:
            dx.view[...] = _ref.router_z_loss_backward(d_val, x).astype(dt)
        return like_caller(dx.user, logits)
