"""NumPy reference of the MoE layer (expert FFN + gate-weighted combine), forward and backward.

Everything is computed in float64 with a plain loop over experts: each expert takes the (token, k)
pairs routed to it (``np.nonzero(expert_ids == e)``) and runs its FFN on those rows. No dispatch
structure is used, so this file checks the dispatch as well as the kernels.

For token t and k in range(K), with e = expert_ids[t, k]:

    z = w13[e] @ x[t] (+ b13[e])                      (2h,) gated, (h,) non-gated
    gated:      a, b = z[:h], z[h:]; hcur = act(a) * b
    non-gated:  hcur = act(z)
    o = w2[e] @ hcur (+ b2[e])                        (d,)
    y[t] += gates[t, k] * o

A pair with expert id -1 is dropped: it adds nothing to y and has no gradient (its dgates entry is 0).

Activations: "swiglu" silu(a)*b, "geglu" gelu_tanh(a)*b, "gelu" gelu_tanh(z), "silu" silu(z),
"relu2" max(z, 0)**2, with gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), and gpt-oss's
clamped SwiGLU "swiglu_oai": a' = min(a, 7), b' = clip(b, -7, 7), hcur = a' sigmoid(1.702 a') (b' + 1)
(the clamps pass the gradient where the value lies inside them, bounds included, as torch.clamp does).

A gated name with the suffix "_interleaved" (e.g. "swiglu_oai_interleaved") reads the 2h rows of w13 (and
b13, and the columns of z) as gate/up pairs: gate j at row 2j, up j at row 2j + 1 (gpt-oss's layout) instead
of [gate rows; up rows]. Weights may be any strided views (e.g. the transpose of an (E, in, out) array).
"""

from __future__ import annotations

import math

import numpy as np

_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


def _sigmoid(x):
    # tanh form: no overflow warning for large |x| (exp(-x) would overflow below x = -709)
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _silu(x):
    return x * _sigmoid(x)


def _silu_grad(x):
    s = _sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(_GELU_C * (x + _GELU_A * x**3)))


def _gelu_tanh_grad(x):
    t = np.tanh(_GELU_C * (x + _GELU_A * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_C * (1.0 + 3.0 * _GELU_A * x * x)


def _relu2(x):
    r = np.maximum(x, 0.0)
    return r * r


def _relu2_grad(x):
    return 2.0 * np.maximum(x, 0.0)


OAI_ALPHA, OAI_LIMIT = 1.702, 7.0  # gpt-oss's clamped SwiGLU


def _oai_gate(a):
    c = np.minimum(a, OAI_LIMIT)
    return c * _sigmoid(OAI_ALPHA * c)


def _oai_gate_grad(a):
    s = _sigmoid(OAI_ALPHA * a)
    return np.where(a <= OAI_LIMIT, s * (1.0 + OAI_ALPHA * a * (1.0 - s)), 0.0)


def _oai_up(b):
    return np.clip(b, -OAI_LIMIT, OAI_LIMIT) + 1.0


def _oai_up_grad(b):
    return ((b >= -OAI_LIMIT) & (b <= OAI_LIMIT)).astype(np.float64)


# name -> (gated, act, act')
ACTIVATIONS_REF = {
    "swiglu": (True, _silu, _silu_grad),
    "geglu": (True, _gelu_tanh, _gelu_tanh_grad),
    "gelu": (False, _gelu_tanh, _gelu_tanh_grad),
    "silu": (False, _silu, _silu_grad),
    "relu2": (False, _relu2, _relu2_grad),
    "swiglu_oai": (True, _oai_gate, _oai_gate_grad),
}
# gated activations whose up half is transformed before the product: name -> (up, up'); the others use b
UP_REF = {"swiglu_oai": (_oai_up, _oai_up_grad)}
INTERLEAVED = "_interleaved"


def split_activation(name: str) -> tuple[str, bool]:
    """(base name, interleaved) of an activation name; ValueError for an unknown one."""
    base = name[:-len(INTERLEAVED)] if isinstance(name, str) and name.endswith(INTERLEAVED) else name
    if base not in ACTIVATIONS_REF or (base != name and not ACTIVATIONS_REF[base][0]):
        raise ValueError(f"unknown activation {name!r} (expected one of {sorted(ACTIVATIONS_REF)}, or a gated one "
                         f"with the suffix {INTERLEAVED!r})")
    return base, base != name


def act_ref(name: str, x):
    """The activation ``name`` applied elementwise to x (float64; the gate part of a gated activation)."""
    return ACTIVATIONS_REF[name][1](np.asarray(x, dtype=np.float64))


def _up(name: str):
    return UP_REF.get(name, (lambda b: b, lambda b: np.ones_like(b)))


def _deinterleave(a, axis: int):
    """Rows (or columns) [g0, u0, g1, u1, ...] along ``axis`` reordered to [g0, g1, ...; u0, u1, ...]."""
    if a is None:
        return None
    return np.concatenate([np.take(a, np.arange(0, a.shape[axis], 2), axis=axis),
                           np.take(a, np.arange(1, a.shape[axis], 2), axis=axis)], axis=axis)


def _interleave(a, axis: int):
    """Inverse of :func:`_deinterleave`."""
    if a is None:
        return None
    n = a.shape[axis] // 2
    out = np.empty_like(a)
    idx = [slice(None)] * a.ndim
    idx[axis] = slice(0, None, 2)
    out[tuple(idx)] = np.take(a, np.arange(n), axis=axis)
    idx[axis] = slice(1, None, 2)
    out[tuple(idx)] = np.take(a, np.arange(n, 2 * n), axis=axis)
    return out


def _f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


def _ids(expert_ids, num_experts: int) -> np.ndarray:
    """The ids as int64: each in [0, E), or -1 for a dropped pair (no expert: it adds nothing to y and gets no
    gradient, dgates 0)."""
    ids = np.asarray(expert_ids).astype(np.int64)
    if ids.size and (ids.min() < -1 or ids.max() >= num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts}) or be -1 (a dropped pair)")
    return ids


def _unpack(x, w13, w2, gates, expert_ids, activation, b13, b2):
    activation, interleaved = split_activation(activation)
    gated = ACTIVATIONS_REF[activation][0]
    x, w13, w2, gates, b13, b2 = (_f64(a) for a in (x, w13, w2, gates, b13, b2))
    if interleaved:  # compute in the [gate; up] order; gradients are put back in the caller's order
        w13, b13 = _deinterleave(w13, 1), _deinterleave(b13, 1)
    ids = _ids(expert_ids, w13.shape[0])
    h = w2.shape[2]
    if w13.shape[1] != (2 * h if gated else h):
        raise ValueError(f"w13 has {w13.shape[1]} rows, expected {2 * h if gated else h} for {activation}")
    return gated, x, w13, w2, gates, ids, b13, b2, activation, interleaved


def _preact(x, w13, b13, e, t):
    """z of the rows x[t] through expert e: (n, R)."""
    z = x[t] @ w13[e].T
    if b13 is not None:
        z = z + b13[e]
    return z


def _hidden(z, gated, act, h, up=None):
    """hcur (n, h) from pre-activations z (n, R) ([gate | up] columns when gated)."""
    if gated:
        return act(z[:, :h]) * (up(z[:, h:]) if up else z[:, h:])
    return act(z)


def _expert_output(hcur, w2, b2, e):
    """o (n, d): expert e's output before the gate."""
    o = hcur @ w2[e].T
    if b2 is not None:
        o = o + b2[e]
    return o


def moe_preact_ref(x, w13, expert_ids, b13=None):
    """Pre-activations z[t, k] = w13[e] @ x[t] (+ b13[e]), e = expert_ids[t, k].

    x (L, d); w13 (E, R, d); expert_ids (L, K) int; b13 (E, R) or None. Returns float64 (L, K, R),
    columns in w13's row order ([a (gate rows) | b (up rows)], or interleaved pairs for interleaved weights).
    """
    x, w13, b13 = _f64(x), _f64(w13), _f64(b13)
    ids = _ids(expert_ids, w13.shape[0])
    L, K = ids.shape
    z = np.zeros((L, K, w13.shape[1]))
    for e in range(w13.shape[0]):
        t, k = np.nonzero(ids == e)  # the (token, k) pairs routed to expert e
        z[t, k] = _preact(x, w13, b13, e, t)
    return z


def moe_forward_ref(x, w13, w2, gates, expert_ids, activation, b13=None, b2=None):
    """The MoE layer's output y (L, d), float64.

    x (L, d); w13 (E, 2h, d) gated / (E, h, d) non-gated; w2 (E, d, h); gates (L, K);
    expert_ids (L, K) int in [0, E) or -1 (a dropped pair); b13 (E, 2h or h) or None; b2 (E, d) or None. Any float
    dtype.
    """
    gated, x, w13, w2, gates, ids, b13, b2, activation, _ = _unpack(x, w13, w2, gates, expert_ids, activation, b13,
                                                                     b2)
    act = ACTIVATIONS_REF[activation][1]
    up = _up(activation)[0]
    h = w2.shape[2]
    y = np.zeros_like(x)
    for e in range(w13.shape[0]):
        t, k = np.nonzero(ids == e)  # the (token, k) pairs routed to expert e
        hcur = _hidden(_preact(x, w13, b13, e, t), gated, act, h, up)
        o = _expert_output(hcur, w2, b2, e)
        np.add.at(y, t, gates[t, k][:, None] * o)
    return y


def moe_backward_ref(dy, x, w13, w2, gates, expert_ids, activation, b13=None, b2=None, preact_dtype=None):
    """Gradients of sum(dy * y) for the layer of :func:`moe_forward_ref`, float64.

    dy (L, d); the other arguments as in :func:`moe_forward_ref`. Returns a dict with dx (L, d),
    dw13 (E, R, d), dw2 (E, d, h), dgates (L, K) where dgates[t, k] = dy[t] . o[t, k] (o includes
    b2), db13 (E, R) or None, db2 (E, d) or None.

    preact_dtype: None (exact), or the dtype the backward reads the pre-activations z in: z is computed in
    float64, rounded to that dtype and widened again before the activation, its derivatives and hcur are
    evaluated (blazecore's backward reads z held in the input dtype, saved or recomputed). It matters where an
    activation is not smooth (the clamps of "swiglu_oai"): a z within one rounding step of a clamp passes or
    stops the gradient according to its stored value.
    """
    gated, x, w13, w2, gates, ids, b13, b2, activation, interleaved = _unpack(x, w13, w2, gates, expert_ids,
                                                                               activation, b13, b2)
    _, act, dact = ACTIVATIONS_REF[activation]
    up, dup = _up(activation)
    dy = _f64(dy)
    h = w2.shape[2]
    dx = np.zeros_like(x)
    dw13 = np.zeros_like(w13)
    dw2 = np.zeros_like(w2)
    dgates = np.zeros(ids.shape)
    db13 = None if b13 is None else np.zeros_like(b13)
    db2 = None if b2 is None else np.zeros_like(b2)
    for e in range(w13.shape[0]):
        t, k = np.nonzero(ids == e)  # the (token, k) pairs routed to expert e
        z = _preact(x, w13, b13, e, t)
        if preact_dtype is not None:
            z = z.astype(preact_dtype).astype(np.float64)
        hcur = _hidden(z, gated, act, h, up)
        o = _expert_output(hcur, w2, b2, e)
        dgates[t, k] = np.sum(dy[t] * o, axis=1)
        do = gates[t, k][:, None] * dy[t]  # (n, d): gradient of o
        dw2[e] = do.T @ hcur
        if db2 is not None:
            db2[e] = do.sum(axis=0)
        dhcur = do @ w2[e]  # (n, h)
        if gated:
            a, b = z[:, :h], z[:, h:]
            dz = np.concatenate([dhcur * up(b) * dact(a), dhcur * act(a) * dup(b)], axis=1)
        else:
            dz = dhcur * dact(z)
        dw13[e] = dz.T @ x[t]
        if db13 is not None:
            db13[e] = dz.sum(axis=0)
        np.add.at(dx, t, dz @ w13[e])
    if interleaved:
        dw13, db13 = _interleave(dw13, 1), _interleave(db13, 1)
    return {"dx": dx, "dw13": dw13, "dw2": dw2, "dgates": dgates, "db13": db13, "db2": db2}


def sum_rows_ref(rows, index):
    """out[i] = sum_j rows[index[i, j]] over the entries index[i, j] >= 0, in j order, accumulated in float32
    (float64 for float64 rows) and rounded once to the rows' dtype, as blazecore.sum_rows does."""
    rows, index = np.asarray(rows), np.asarray(index)
    acc_t = np.float64 if rows.dtype == np.float64 else np.float32
    acc = np.zeros((index.shape[0], rows.shape[1]), dtype=acc_t)
    for j in range(index.shape[1]):
        sel = index[:, j]
        keep = sel >= 0
        acc[keep] += rows[sel[keep]].astype(acc_t)
    return acc.astype(rows.dtype)
