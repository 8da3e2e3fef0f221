"""PyTorch baselines of the blazecore MoE layer, differentiable with torch autograd.

The layer (DESIGN.md, "The layer"): x (L, d), w13 (E, 2h, d) = [gate rows; up rows], w2 (E, d, h),
gates (L, K) float32, expert_ids (L, K) integer. For every (token t, k) with e = expert_ids[t, k]:

    a = x_t w1[e]^T,  b = x_t w3[e]^T,  hcur = silu(a) * b,  y_t += gates[t, k] * (hcur w2[e]^T)

Two implementations, the comparison points of every blazecore benchmark and of
``blazecore train --baseline``:

* :func:`conventional_moe`: stable argsort of the flattened expert ids, a gathered copy of x in expert
  order, a Python loop over experts of ``F.linear`` -> unfused activation -> ``F.linear``, gate scaling
  and ``index_add_`` into y. Reads the per-expert counts on the host (one synchronisation per call).
* :func:`grouped_mm_moe`: the same sort and gather, then ``torch._grouped_mm`` for both expert GEMMs
  (no host synchronisation), unfused activation, gate scaling and ``index_add_``.

Both return y (L, d) in x's dtype; ``torch.autograd.grad(y, (x, w13, w2, gates), dy)`` gives dx, dw13,
dw2 and dgates. Gates are cast to x's dtype before scaling (their gradient comes back in the gates'
own dtype). Activations and optional biases b13 (E, 2h or h) and b2 (E, d) follow
``blazecore.reference.moe``: o = hcur w2[e]^T + b2[e] is scaled by the gate as a whole.

:class:`BaselineMoELayer` is a drop-in for ``blazecore_torch.MoELayer`` (same parameters, same
``forward(x) -> (y, aux)``) whose router (:func:`route_topk`, :func:`load_balancing_loss`,
:func:`router_z_loss`) and experts are these plain torch functions; its parameters are set up by
``blazecore_torch.layer.add_moe_parameters``, the set-up of ``MoELayer`` itself. Everything else is plain torch.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from blazecore_torch.layer import add_moe_parameters, reset_moe_parameters
from torch import nn

__all__ = [
    "ACTIVATIONS",
    "BaselineMoELayer",
    "BaselineUnavailable",
    "IMPLEMENTATIONS",
    "conventional_moe",
    "grouped_mm_moe",
    "grouped_mm_unsupported",
    "load_balancing_loss",
    "route_topk",
    "router_z_loss",
    "supports_activation",
]


def _gelu_tanh(v):
    return F.gelu(v, approximate="tanh")


def _relu2(v):
    return F.relu(v).square()


_OAI_ALPHA, _OAI_LIMIT = 1.702, 7.0  # gpt-oss's clamped SwiGLU


def _oai_gate(a):
    a = a.clamp(max=_OAI_LIMIT)
    return a * torch.sigmoid(_OAI_ALPHA * a)


def _oai_up(b):
    return b.clamp(-_OAI_LIMIT, _OAI_LIMIT) + 1


# name -> (gated, act). Gated: w13 (E, 2h, d) = [gate rows; up rows], hcur = act(a) * b ("swiglu_oai": act(a) *
# up(b), _UP). Non-gated: w13 (E, h, d), hcur = act(z). A gated name + "_interleaved" takes the rows as
# [g0, u0, g1, u1, ...] pairs (gpt-oss's storage).
_ACTIVATIONS = {
    "swiglu": (True, F.silu),
    "geglu": (True, _gelu_tanh),
    "gelu": (False, _gelu_tanh),
    "silu": (False, F.silu),
    "relu2": (False, _relu2),
    "swiglu_oai": (True, _oai_gate),
}
_UP = {"swiglu_oai": _oai_up}
ACTIVATIONS = tuple(_ACTIVATIONS)
_INTERLEAVED = "_interleaved"


def _activation(name: str) -> tuple[bool, object, object, bool]:
    """(gated, act, up, interleaved) of an activation name; ValueError for one the baselines lack."""
    base = name.removesuffix(_INTERLEAVED)
    if base not in _ACTIVATIONS or (base != name and not _ACTIVATIONS[base][0]):
        raise ValueError(f"activation {name!r} is not supported by the baselines (supported: {ACTIVATIONS}, and "
                         f"a gated one + {_INTERLEAVED!r})")
    gated, act = _ACTIVATIONS[base]
    return gated, act, _UP.get(base, lambda b: b), base != name


def supports_activation(name: str) -> bool:
    """Whether the baselines run the activation ``name``."""
    try:
        _activation(name)
    except ValueError:
        return False
    return True


class BaselineUnavailable(RuntimeError):
    """A baseline cannot run for these inputs on this torch build or device (the message says why)."""


def _shapes(x, w13, w2, gates, expert_ids, activation, b13, b2):
    """Validate the layer's operands; returns (L, d, E, h, K)."""
    gated = _activation(activation)[0]
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
    gated, act, up, interleaved = _activation(activation)
    if gated:
        a, b = (z[..., 0::2], z[..., 1::2]) if interleaved else z.chunk(2, dim=-1)
        return act(a) * up(b)
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
        activation: one of ACTIVATIONS: "swiglu", "geglu", "swiglu_oai" (gated); "gelu", "silu", "relu2"; or a
            gated one + "_interleaved" (w13's rows and b13 as [gate, up] pairs).
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
    """Run a tiny grouped_mm forward and backward on (device, dtype); None if it works, else why not.

    The probe builds its own autograd graph, so it runs (and its cached answer holds) whatever the caller's
    grad mode: the first call may come from inside ``torch.no_grad()`` (an evaluation pass)."""
    try:
        with torch.enable_grad():
            return _run_probe(device, dtype)
    except BaselineUnavailable as exc:
        return str(exc)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        return f"torch._grouped_mm does not run on {device} {dtype} (torch {torch.__version__}): {first}"


def _run_probe(device: str, dtype: torch.dtype) -> None:
    gmm = _grouped_mm_fn()
    dev = torch.device(device)
    a = torch.ones(24, 16, device=dev, dtype=dtype, requires_grad=True)
    w = torch.ones(3, 32, 16, device=dev, dtype=dtype, requires_grad=True)
    offs = torch.tensor([8, 8, 24], device=dev, dtype=torch.int32)  # an empty group in the middle
    out = gmm(a, w.transpose(-2, -1), offs=offs)
    torch.autograd.grad(out, (a, w), torch.ones_like(out))


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


# ------------------------------------------------------------------------------------------------
# Router and layer
# ------------------------------------------------------------------------------------------------


def _router_dtype(logits):
    """Router math runs in float32 (float64 for float64 logits), as blazecore's router does."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def route_topk(logits, top_k, *, score="softmax", renormalize=True):
    """Top-k routing in plain torch: softmax (or sigmoid) over E, ``torch.topk``, optional renormalisation.

    Args:
        logits: (L, E) floating tensor.
        top_k: K in [1, E].
        score: "softmax" or "sigmoid".
        renormalize: divide the K selected scores by their sum.

    Returns:
        (gates (L, K) float32 (float64 for float64 logits), differentiable w.r.t. the logits;
        expert_ids (L, K) int64, in descending score order).
    """
    if score not in ("softmax", "sigmoid"):
        raise ValueError(f"score must be 'softmax' or 'sigmoid', got {score!r}")
    z = logits.to(_router_dtype(logits))
    s = torch.softmax(z, dim=-1) if score == "softmax" else torch.sigmoid(z)
    gates, ids = torch.topk(s, top_k, dim=-1)
    if renormalize:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return gates, ids


def load_balancing_loss(logits, expert_ids):
    """Switch load-balancing loss E * sum_e f_e P_e, 0-d float32 (float64), differentiable w.r.t. logits.

    f_e: the fraction of the L*K (token, k) pairs routed to e (a count, no gradient); P_e: the mean over
    tokens of softmax(logits)_e.
    """
    E = logits.shape[-1]
    dt = _router_dtype(logits)
    if logits.shape[0] == 0:
        return logits.new_zeros((), dtype=dt)
    p = torch.softmax(logits.to(dt), dim=-1).mean(dim=0)
    f = torch.bincount(expert_ids.reshape(-1).long(), minlength=E).to(dt) / expert_ids.numel()
    return E * (f * p).sum()


def router_z_loss(logits):
    """Router z-loss mean_t logsumexp(logits_t)^2, 0-d float32 (float64), differentiable."""
    dt = _router_dtype(logits)
    if logits.shape[0] == 0:
        return logits.new_zeros((), dtype=dt)
    return torch.logsumexp(logits.to(dt), dim=-1).square().mean()


class BaselineMoELayer(nn.Module):
    """``blazecore_torch.MoELayer``'s interface on the baselines: router -> top-k -> experts -> combine.

    Parameters are those of ``MoELayer`` (same names, shapes and default initialisation): ``router.weight``
    (E, d), ``gate_up_proj`` (E, 2h, d) (or (E, h, d) for non-gated activations), ``down_proj`` (E, d, h)
    (transposed with ``weight_layout="in_out"``) and with ``bias`` the expert biases ``gate_up_proj_bias`` and
    ``down_proj_bias``, so a state dict moves between the two unchanged.

    Args:
        hidden_size, intermediate_size, num_experts, top_k, activation, score, renormalize, weight_layout, bias,
            device, dtype: as for ``MoELayer``.
        implementation: "conventional" (:func:`conventional_moe`) or "grouped_mm" (:func:`grouped_mm_moe`).

    ``forward(x)`` takes x (..., d) and returns ``(y, aux)`` with y shaped like x and aux the dict of
    ``MoELayer``: ``load_balancing_loss``, ``z_loss``, ``router_logits`` (L, E), ``tokens_per_expert`` (E,)
    int32.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 activation: str = "swiglu", score: str = "softmax", renormalize: bool = True,
                 implementation: str = "conventional", weight_layout: str = "out_in", bias: bool = False,
                 device=None, dtype=None):
        super().__init__()
        gated = _activation(activation)[0]
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {tuple(IMPLEMENTATIONS)}, got {implementation!r}")
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"score must be 'softmax' or 'sigmoid', got {score!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k = {top_k} must be in [1, num_experts = {num_experts}]")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.activation, self.score, self.renormalize = activation, score, renormalize
        self.implementation = implementation
        self._moe = IMPLEMENTATIONS[implementation]
        R = 2 * intermediate_size if gated else intermediate_size
        add_moe_parameters(self, hidden_size, intermediate_size, num_experts, R, device=device, dtype=dtype,
                           weight_layout=weight_layout, bias=bias)

    def reset_parameters(self) -> None:
        reset_moe_parameters(self)

    def extra_repr(self) -> str:
        return (f"d={self.hidden_size}, h={self.intermediate_size}, experts={self.num_experts}, top_k={self.top_k}, "
                f"activation={self.activation}, score={self.score}, implementation={self.implementation}")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: last dimension {x.shape[-1]}, expected hidden_size = {self.hidden_size}")
        shape = x.shape
        tokens = x.reshape(-1, self.hidden_size)
        logits = self.router(tokens)
        gates, ids = route_topk(logits, self.top_k, score=self.score, renormalize=self.renormalize)
        w13, w2 = self.gate_up_proj, self.down_proj
        if self.weight_layout == "in_out":  # the baselines take (E, R, d) and (E, d, h): transposed views
            w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
        y = self._moe(tokens, w13, w2, gates, ids, activation=self.activation, b13=self.gate_up_proj_bias,
                      b2=self.down_proj_bias)
        aux = {
            "load_balancing_loss": load_balancing_loss(logits, ids),
            "z_loss": router_z_loss(logits),
            "router_logits": logits,
            "tokens_per_expert": torch.bincount(ids.reshape(-1), minlength=self.num_experts).to(torch.int32),
        }
        return y.reshape(shape), aux
