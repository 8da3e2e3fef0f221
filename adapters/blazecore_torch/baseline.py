"""PyTorch baselines of the blazecore MoE layer, differentiable with torch autograd.

The layer (DESIGN.md, "The layer"): x (L, d), w13 (E, 2h, d) = [gate rows; up rows], w2 (E, d, h),
gates (L, K) float32, expert_ids (L, K) integer. For every (token t, k) with e = expert_ids[t, k]:

    a = x_t w1[e]^T,  b = x_t w3[e]^T,  hcur = silu(a) * b,  y_t += gates[t, k] * (hcur w2[e]^T)

Two implementations, the comparison points of every blazecore benchmark:

* :func:`conventional_moe`: stable argsort of the flattened expert ids, a gathered copy of x in expert
  order, a Python loop over experts of ``F.linear`` -> unfused activation -> ``F.linear``, gate scaling
  and ``index_add_`` into y. Reads the per-expert counts on the host (one synchronisation per call).
* :func:`grouped_mm_moe`: the same sort and gather, then ``torch._grouped_mm`` for both expert GEMMs
  (no host synchronisation), unfused activation, gate scaling and ``index_add_``.

Both return y (L, d) in x's dtype; ``torch.autograd.grad(y, (x, w13, w2, gates), dy)`` gives dx, dw13,
dw2 and dgates. Gates are cast to x's dtype before scaling (their gradient comes back in the gates'
own dtype). Activations and optional biases b13 (E, 2h or h) and b2 (E, d) follow
``blazecore.reference.moe``: o = hcur w2[e]^T + b2[e] is scaled by the gate as a whole. This module
imports only torch, never blazecore.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = [
    "ACTIVATIONS",
    "BaselineUnavailable",
    "IMPLEMENTATIONS",
    "conventional_moe",
    "grouped_mm_moe",
    "grouped_mm_unsupported",
]


def _gelu_tanh(v):
    return F.gelu(v, approximate="tanh")


def _relu2(v):
    return F.relu(v).square()


# name -> (gated, act). Gated: w13 (E, 2h, d) = [gate rows; up rows], hcur = act(a) * b.
# Non-gated: w13 (E, h, d), hcur = act(z).
_ACTIVATIONS = {
    "swiglu": (True, F.silu),
    "geglu": (True, _gelu_tanh),
    "gelu": (False, _gelu_tanh),
    "silu": (False, F.silu),
    "relu2": (False, _relu2),
}
ACTIVATIONS = tuple(_ACTIVATIONS)


class BaselineUnavailable(RuntimeError):
    """A baseline cannot run for these inputs on this torch build or device (the message says why)."""


def _shapes(x, w13, w2, gates, expert_ids, activation, b13, b2):
    """Validate the layer's operands; returns (L, d, E, h, K)."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not supported by the baselines (supported: {ACTIVATIONS})")
    gated = _ACTIVATIONS[activation][0]
    if x.dim() != 2:
        raise ValueError(f"x: expected (L, d), got {tuple(x.shape)}")
    L, d = x.shape
    if w2.dim() != 3 or w2.shape[1] != d:
        raise ValueError(f"w2: expected (E, {d}, h), got {tuple(w2.shape)}")
    E, h = w2.shape[0], w2.shape[2]
    R = 2 * h if gated else h
    if tuple(w13.shape) != (E, R, d):
        raise ValueError(f"w13: expected {(E, R, d)} for {activation}, got {tuple(w13.shape)}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != L:
        raise ValueError(f"expert_ids: expected ({L}, K), got {tuple(expert_ids.shape)}")
    if expert_ids.dtype.is_floating_point or expert_ids.dtype.is_complex or expert_ids.dtype == torch.bool:
        raise TypeError(f"expert_ids: expected an integer tensor, got {expert_ids.dtype}")
    K = expert_ids.shape[1]
    if tuple(gates.shape) != (L, K):
        raise ValueError(f"gates: expected {(L, K)}, got {tuple(gates.shape)}")
    if x.dtype != w13.dtype or x.dtype != w2.dtype:
        raise TypeError(f"x, w13, w2 must share a dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    if b13 is not None and tuple(b13.shape) != (E, R):
        raise ValueError(f"b13: expected {(E, R)}, got {tuple(b13.shape)}")
    if b2 is not None and tuple(b2.shape) != (E, d):
        raise ValueError(f"b2: expected {(E, d)}, got {tuple(b2.shape)}")
    return L, d, E, h, K


def _hidden(z, activation):
    """hcur from the pre-activations z (n, R), unfused: every step is its own kernel and saved tensor."""
    gated, act = _ACTIVATIONS[activation]
    if gated:
        a, b = z.chunk(2, dim=-1)
        return act(a) * b
    return act(z)


def _sort_slots(expert_ids, E, K):
    """Slots (flat index t*K + k) in expert order, with their tokens and experts, and per-expert counts.

    The stable sort keeps the slots of one expert ordered by token then k, the order of blazecore's
    dispatch. Returns order, sorted_token, sorted_expert (each (L*K,) int64) and counts (E,) int64,
    all on the inputs' device.
    """
    flat = expert_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    sorted_token = torch.div(order, K, rounding_mode="floor")
    counts = torch.bincount(flat, minlength=E)
    return order, sorted_token, flat[order], counts


def conventional_moe(x, w13, w2, gates, expert_ids, *, activation="swiglu", b13=None, b2=None):
    """Conventional PyTorch MoE layer: argsort, gathered copy of x, per-expert loop, index_add_ combine.

    Args:
        x: (L, d) float tensor (bf16, fp16, fp32 or fp64).
        w13: (E, 2h, d) for gated activations (rows [0, h) the gate projection w1, rows [h, 2h) the up
            projection w3), (E, h, d) for non-gated ones; x's dtype.
        w2: (E, d, h), x's dtype.
        gates: (L, K) floating tensor (float32 in training), the router weight of each (token, k).
        expert_ids: (L, K) integer tensor (int32 or int64), values in [0, E).
        activation: one of ACTIVATIONS: "swiglu", "geglu" (gated); "gelu", "silu", "relu2".
        b13: optional (E, 2h or h) bias of the first projection, x's dtype.
        b2: optional (E, d) bias of the second projection, x's dtype (scaled by the gate with the rest of o).

    Returns:
        y: (L, d) in x's dtype, part of the autograd graph of x, w13, w2, gates, b13 and b2.
    """
    L, d, E, h, K = _shapes(x, w13, w2, gates, expert_ids, activation, b13, b2)
    order, sorted_token, _, counts = _sort_slots(expert_ids, E, K)
    n_slots = L * K
    x_sorted = x[sorted_token]  # (L*K, d): the gathered copy blazecore never makes
    g_sorted = gates.reshape(-1)[order].to(x.dtype)
    # Per-expert views; each parameter's gradient is stacked once, as for an nn.ModuleList of experts.
    w13_e, w2_e = w13.unbind(0), w2.unbind(0)
    b13_e = [None] * E if b13 is None else b13.unbind(0)
    b2_e = [None] * E if b2 is None else b2.unbind(0)
    y = x.new_zeros(L, d)
    start = 0
    for e, n in enumerate(counts.tolist()):  # host synchronisation: the loop needs the counts
        # Idle experts are skipped; with no slots at all every expert runs on an empty slice so that y
        # still belongs to the autograd graph.
        if n == 0 and n_slots > 0:
            continue
        rows = slice(start, start + n)
        start += n
        z = F.linear(x_sorted[rows], w13_e[e], b13_e[e])  # (n, R)
        out = F.linear(_hidden(z, activation), w2_e[e], b2_e[e])  # (n, d)
        y.index_add_(0, sorted_token[rows], out * g_sorted[rows, None])
    return y


def _grouped_mm_fn():
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        fn = getattr(F, "grouped_mm", None)
    if fn is None:
        raise BaselineUnavailable(f"torch {torch.__version__} has no torch._grouped_mm (added in 2.8; CPU in 2.9)")
    return fn


@functools.lru_cache(maxsize=None)
def _probe_grouped_mm(device: str, dtype: torch.dtype) -> str | None:
    """Run a tiny grouped_mm forward and backward on (device, dtype); None if it works, else why not."""
    try:
        gmm = _grouped_mm_fn()
        dev = torch.device(device)
        a = torch.ones(24, 16, device=dev, dtype=dtype, requires_grad=True)
        w = torch.ones(3, 32, 16, device=dev, dtype=dtype, requires_grad=True)
        offs = torch.tensor([8, 8, 24], device=dev, dtype=torch.int32)  # an empty group in the middle
        out = gmm(a, w.transpose(-2, -1), offs=offs)
        torch.autograd.grad(out, (a, w), torch.ones_like(out))
    except BaselineUnavailable as exc:
        return str(exc)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        return f"torch._grouped_mm does not run on {device} {dtype} (torch {torch.__version__}): {first}"
    return None


def grouped_mm_unsupported(x, w13, w2) -> str | None:
    """Why :func:`grouped_mm_moe` cannot run on these operands, or None if it can.

    torch._grouped_mm needs a dtype its kernels take (bf16 on CUDA; fp32 and bf16 on the CPU since
    torch 2.9; found by a cached probe run on x's device) and every matrix stride a multiple of 16 bytes
    (TMA loads on Hopper): d and h times the element size. The weights are read through
    ``transpose(-2, -1)`` views (column-major (E, d, R) and (E, h, d), no copy), so w13 and w2 must be
    contiguous.
    """
    try:
        _grouped_mm_fn()
    except BaselineUnavailable as exc:
        return str(exc)
    d, h, es = x.shape[-1], w2.shape[-1], x.element_size()
    if (d * es) % 16 or (h * es) % 16:
        return f"torch._grouped_mm needs d and h to be multiples of {16 // es} for {x.dtype}, got d={d}, h={h}"
    if not (w13.is_contiguous() and w2.is_contiguous()):
        return "the torch._grouped_mm baseline needs contiguous w13 and w2"
    return _probe_grouped_mm(str(x.device), x.dtype)


def grouped_mm_moe(x, w13, w2, gates, expert_ids, *, activation="swiglu", b13=None, b2=None):
    """MoE layer on torch._grouped_mm: argsort, gathered copy of x, two grouped GEMMs, index_add_ combine.

    ``offs`` for torch._grouped_mm is the int32 inclusive cumulative count (offs[e] = end row of expert
    e, offs[-1] = L*K; an empty expert repeats the previous end), computed on the device, so the call
    never synchronises with the host. torch._grouped_mm takes no bias: b13 and b2, when given, are
    added as gathered (L*K, R) and (L*K, d) copies.

    Args and result: as :func:`conventional_moe`.

    Raises:
        BaselineUnavailable: torch._grouped_mm is missing, or rejects this device, dtype or shape
            (see :func:`grouped_mm_unsupported`).
    """
    L, d, E, h, K = _shapes(x, w13, w2, gates, expert_ids, activation, b13, b2)
    reason = grouped_mm_unsupported(x, w13, w2)
    if reason is not None:
        raise BaselineUnavailable(reason)
    gmm = _grouped_mm_fn()
    order, sorted_token, sorted_expert, counts = _sort_slots(expert_ids, E, K)
    offs = counts.cumsum(0).to(torch.int32)
    x_sorted = x[sorted_token]  # (L*K, d)
    g_sorted = gates.reshape(-1)[order].to(x.dtype)
    z = gmm(x_sorted, w13.transpose(-2, -1), offs=offs)  # (L*K, R)
    if b13 is not None:
        z = z + b13.index_select(0, sorted_expert)
    out = gmm(_hidden(z, activation), w2.transpose(-2, -1), offs=offs)  # (L*K, d)
    if b2 is not None:
        out = out + b2.index_select(0, sorted_expert)
    return x.new_zeros(L, d).index_add_(0, sorted_token, out * g_sorted[:, None])


IMPLEMENTATIONS = {"conventional": conventional_moe, "grouped_mm": grouped_mm_moe}
