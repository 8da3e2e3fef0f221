"""NumPy reference for the router (``blazecore.router``): the obvious per-row loop in float64.

Inputs may be any float dtype (bfloat16 through ml_dtypes included); everything is computed in float64.
Ids come back as int64, gates and gradients as float64.

Selection: the K largest of score + bias (score alone without a bias), in descending order, ties to the
lower expert index (a lexicographic sort on (-value, index)); NaN values rank last.
"""

from __future__ import annotations

import numpy as np


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def _check_score(score: str) -> None:
    if score not in ("softmax", "sigmoid"):
        raise ValueError(f"score must be 'softmax' or 'sigmoid', got {score!r}")


def row_scores(x_row: np.ndarray, score: str) -> np.ndarray:
    """Scores of one row of logits (E,): softmax over the row or elementwise sigmoid, float64."""
    _check_score(score)
    x_row = _f64(x_row)
    if score == "softmax":
        e = np.exp(x_row - x_row.max())
        return e / e.sum()
    return 1.0 / (1.0 + np.exp(-x_row))


def select_row(values: np.ndarray, top_k: int) -> np.ndarray:
    """Indices of the top_k largest values, in descending order, ties to the lower index."""
    values = _f64(values)
    keys = np.where(np.isnan(values), -np.inf, values)
    order = np.lexsort((np.arange(values.shape[0]), -keys))  # last key is the primary one
    return order[:top_k]


def selection_values(logits, score: str, expert_bias=None) -> np.ndarray:
    """(L, E) float64 values the selection ranks: score + bias, or the score alone."""
    x = _f64(logits)
    out = np.empty_like(x)
    for t in range(x.shape[0]):
        out[t] = row_scores(x[t], score)
        if expert_bias is not None:
            out[t] += _f64(expert_bias)
    return out


def gates_for_ids(logits, ids, score: str = "softmax", renormalize: bool = True) -> np.ndarray:
    """(L, K) float64 gates of the given (L, K) ids: the selected scores, renormalised to sum 1 if asked."""
    x = _f64(logits)
    ids = np.asarray(ids)
    L, K = ids.shape
    gates = np.empty((L, K), dtype=np.float64)
    for t in range(L):
        s = row_scores(x[t], score)[ids[t]]
        gates[t] = s / s.sum() if renormalize else s
    return gates


def route_topk_forward(logits, top_k: int, score: str = "softmax", renormalize: bool = True, expert_bias=None):
    """(gates (L, K) float64, ids (L, K) int64) for logits (L, E) and an optional (E,) selection bias."""
    x = _f64(logits)
    L, E = x.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k = {top_k} must be in [1, {E}]")
    sel = selection_values(x, score, expert_bias)
    ids = np.empty((L, top_k), dtype=np.int64)
    for t in range(L):
        ids[t] = select_row(sel[t], top_k)
    return gates_for_ids(x, ids, score, renormalize), ids


def route_topk_backward(dgates, logits, ids, score: str = "softmax", renormalize: bool = True) -> np.ndarray:
    """(L, E) float64 gradient of sum(dgates * gates) with respect to the logits, ids held fixed.

    Chain rule per row, written with the full Jacobians' vector products:
      gates -> selected scores q:  renormalised g = q / S (S = sum q):  dq = (dg - <dg, g>) / S;  else dq = dg
      selected scores -> all scores: scatter-add dq into ds (E,) at the ids
      scores -> logits: softmax  dx = p * (ds - <p, ds>);  sigmoid  dx = ds * s * (1 - s)
    """
    _check_score(score)
    x = _f64(logits)
    dg_all = _f64(dgates)
    ids = np.asarray(ids)
    L, E = x.shape
    dx = np.zeros((L, E), dtype=np.float64)
    for t in range(L):
        s = row_scores(x[t], score)
        q = s[ids[t]]
        dg = dg_all[t]
        if renormalize:
            S = q.sum()
            g = q / S
            dq = (dg - np.dot(dg, g)) / S
        else:
            dq = dg
        ds = np.zeros(E)
        np.add.at(ds, ids[t], dq)
        if score == "softmax":
            dx[t] = s * (ds - np.dot(s, ds))
        else:
            dx[t] = ds * s * (1.0 - s)
    return dx


def expert_fractions(ids, E: int) -> np.ndarray:
    """f_e = (number of (token, k) with ids = e) / (L K), float64 (E,)."""
    ids = np.asarray(ids)
    L, K = ids.shape
    counts = np.zeros(E, dtype=np.float64)
    for t in range(L):
        np.add.at(counts, ids[t], 1.0)
    return counts / (L * K) if L * K else counts


def load_balancing_loss(logits, ids) -> float:
    """aux = E * sum_e f_e P_e,  P_e = (1/L) sum_t softmax(logits_t)_e;  0 for L = 0."""
    x = _f64(logits)
    L, E = x.shape
    if L == 0:
        return 0.0
    f = expert_fractions(ids, E)
    P = np.zeros(E)
    for t in range(L):
        P += row_scores(x[t], "softmax")
    P /= L
    return float(E * np.dot(f, P))


def load_balancing_loss_backward(dloss: float, logits, ids) -> np.ndarray:
    """(L, E): dloss * d aux / d logits; f is a count and passes no gradient:
    d aux / d x_t = (E / L) * J_softmax(x_t)^T f = (E / L) * p_t * (f - <p_t, f>)."""
    x = _f64(logits)
    L, E = x.shape
    dx = np.zeros((L, E))
    if L == 0:
        return dx
    f = expert_fractions(ids, E)
    for t in range(L):
        p = row_scores(x[t], "softmax")
        dx[t] = float(dloss) * (E / L) * p * (f - np.dot(p, f))
    return dx


def _logsumexp(x_row: np.ndarray) -> float:
    m = x_row.max()
    return float(m + np.log(np.exp(x_row - m).sum()))


def router_z_loss(logits) -> float:
    """z = (1/L) sum_t logsumexp(logits_t)^2;  0 for L = 0."""
    x = _f64(logits)
    L = x.shape[0]
    if L == 0:
        return 0.0
    return float(sum(_logsumexp(x[t]) ** 2 for t in range(L)) / L)


def router_z_loss_backward(dloss: float, logits) -> np.ndarray:
    """(L, E): dloss * d z / d logits = dloss * (2 / L) * lse_t * softmax(logits_t)."""
    x = _f64(logits)
    L, E = x.shape
    dx = np.zeros((L, E))
    for t in range(L):
        dx[t] = float(dloss) * (2.0 / L) * _logsumexp(x[t]) * row_scores(x[t], "softmax")
    return dx
