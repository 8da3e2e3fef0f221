"""The JAX adapter (adapters/blazecore_jax): custom_vjp ops over buffer_callback, the functional moe_layer and the
Flax NNX module.

CPU cases run the core's NumPy reference path through the callbacks and compare outputs and every gradient
with a pure jax.numpy MoE written here (float32), eagerly, under jax.jit and under jax.vmap. Bad shapes and
dtypes must fail at trace time. The JAX and PyTorch adapters must agree on the same weights (skipped
without torch); the NNX module must match moe_layer (skipped without flax). GPU cases carry
@pytest.mark.gpu: the same comparisons on CUDA buffers (float32 and bfloat16, both checkpoint policies, eager,
jit and vmap), and what the callbacks must not do there (write over XLA's input buffers, keep CuPy memory).
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import assert_close

# JAX shares the GPU with CuPy's (and torch's) memory pools in this process: no preallocation of most of it.
# Set before JAX initialises a backend (importing jax does not).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
pytest.importorskip("jax.experimental.buffer_callback")

_ROOT = pathlib.Path(__file__).resolve().parents[1]
import blazecore_jax  # noqa: E402
from blazecore_jax import ops  # noqa: E402

TOL = 1e-5  # float32 vs a float32 jax.numpy computation (relative norm error)
GATED = {"swiglu": True, "geglu": True, "gelu": False, "silu": False, "relu2": False}


# ---------------------------------------------------------------------------------------------
# Pure jax.numpy reference
# ---------------------------------------------------------------------------------------------


def _act(name, z):
    if name in ("swiglu", "silu"):
        return jax.nn.silu(z)
    if name in ("geglu", "gelu"):
        return jax.nn.gelu(z, approximate=True)
    if name == "relu2":
        return jnp.maximum(z, 0) ** 2
    raise ValueError(name)


def ref_ffn(x, w13, w2, gates, ids, activation, b13=None, b2=None):
    """Dense per-(token, k) gather: y[t] = sum_k gates[t,k] * (w2[e] @ hcur + b2[e])."""
    hp = jax.lax.Precision.HIGHEST
    z = jnp.einsum("lkrd,ld->lkr", w13[ids], x, precision=hp)
    if b13 is not None:
        z = z + b13[ids]
    h = w2.shape[2]
    hcur = _act(activation, z[..., :h]) * z[..., h:] if GATED[activation] else _act(activation, z)
    o = jnp.einsum("lkdh,lkh->lkd", w2[ids], hcur, precision=hp)
    if b2 is not None:
        o = o + b2[ids]
    return jnp.einsum("lk,lkd->ld", gates, o, precision=hp)


def ref_route(logits, K, score="softmax", renormalize=True):
    s = jax.nn.softmax(logits, axis=-1) if score == "softmax" else jax.nn.sigmoid(logits)
    vals, ids = jax.lax.top_k(s, K)
    if renormalize:
        vals = vals / vals.sum(-1, keepdims=True)
    return vals, ids.astype(jnp.int32)


def ref_lb(logits, ids):
    L, E = logits.shape
    f = jnp.zeros((E,)).at[ids.reshape(-1)].add(1.0) / ids.size
    return E * jnp.sum(f * jax.nn.softmax(logits, -1).mean(0))


def ref_z(logits):
    return jnp.mean(jax.nn.logsumexp(logits, -1) ** 2)


def ref_layer(params, x, top_k, activation="swiglu", ids=None, weight_layout="out_in"):
    """The layer in jax.numpy. ``ids`` imposes a selection (one a lower-precision run made: selection has no
    gradient); the gates still come from this computation's logits. Projections stored ``weight_layout``, the
    expert biases where ``params`` has them, interleaved gate/up rows with an "<gated>_interleaved" activation."""
    d = x.shape[-1]
    tokens = x.reshape(-1, d)
    logits = jnp.matmul(tokens, params["router"].T, precision=jax.lax.Precision.HIGHEST)
    gates, own_ids = ref_route(logits, top_k)
    if ids is None:
        ids = own_ids
    else:
        top = jnp.take_along_axis(jax.nn.softmax(logits, -1), ids, 1)
        gates = top / top.sum(-1, keepdims=True)
    w13, w2 = params["gate_up_proj"], params["down_proj"]
    if weight_layout == "in_out":
        w13, w2 = jnp.swapaxes(w13, 1, 2), jnp.swapaxes(w2, 1, 2)
    b13, b2 = params.get("gate_up_proj_bias"), params.get("down_proj_bias")
    if activation.endswith("_interleaved"):  # rows [g0, u0, g1, u1, ...] -> [gate rows; up rows]
        activation = activation.removesuffix("_interleaved")
        w13 = jnp.concatenate((w13[:, 0::2], w13[:, 1::2]), 1)
        b13 = None if b13 is None else jnp.concatenate((b13[:, 0::2], b13[:, 1::2]), 1)
    y = ref_ffn(tokens, w13, w2, gates, ids, activation, b13, b2)
    return y.reshape(x.shape), {"load_balancing_loss": ref_lb(logits, ids), "z_loss": ref_z(logits)}


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def _data(L=12, d=16, h=8, E=6, K=2, activation="swiglu", bias=False, seed=0):
    rng = np.random.default_rng(seed)
    R = 2 * h if GATED[activation] else h
    x = rng.standard_normal((L, d)).astype(np.float32)
    w13 = (rng.standard_normal((E, R, d)) / np.sqrt(d)).astype(np.float32)
    w2 = (rng.standard_normal((E, d, h)) / np.sqrt(h)).astype(np.float32)
    logits = rng.standard_normal((L, E)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(L)]).astype(np.int32)
    gates = rng.random((L, K)).astype(np.float32)
    b13 = (0.1 * rng.standard_normal((E, R))).astype(np.float32) if bias else None
    b2 = (0.1 * rng.standard_normal((E, d))).astype(np.float32) if bias else None
    j = lambda a: None if a is None else jnp.asarray(a)  # noqa: E731
    return {k: j(v) for k, v in dict(x=x, w13=w13, w2=w2, gates=gates, ids=ids, logits=logits, b13=b13,
                                      b2=b2).items()}


def _close(actual, expected, name, tol=TOL):
    assert_close(np.asarray(actual, np.float64), np.asarray(expected, np.float64), tol, name)


# ---------------------------------------------------------------------------------------------
# Expert FFN
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", ["ab", "none"])
@pytest.mark.parametrize("activation,bias", [("swiglu", False), ("geglu", True), ("gelu", False), ("silu", True),
                                             ("relu2", False)], ids=["swiglu", "geglu-bias", "gelu", "silu-bias",
                                                                     "relu2"])
def test_ffn_forward_and_grads(activation, bias, checkpoint):
    D = _data(activation=activation, bias=bias)
    args = (D["x"], D["w13"], D["w2"], D["gates"], D["b13"], D["b2"])
    dy = jnp.asarray(np.random.default_rng(1).standard_normal(D["x"].shape).astype(np.float32))

    def loss(fn):
        return lambda x, w13, w2, gates, b13, b2: jnp.sum(fn(x, w13, w2, gates, b13, b2) * dy)

    ours = lambda x, w13, w2, g, b13, b2: ops.moe_ffn(x, w13, w2, g, D["ids"], activation=activation,  # noqa: E731
                                                      checkpoint=checkpoint, b13=b13, b2=b2)
    ref = lambda x, w13, w2, g, b13, b2: ref_ffn(x, w13, w2, g, D["ids"], activation, b13, b2)  # noqa: E731
    _close(ours(*args), ref(*args), "y")
    argnums = (0, 1, 2, 3, 4, 5) if bias else (0, 1, 2, 3)
    got = jax.grad(loss(ours), argnums=argnums)(*args)
    want = jax.grad(loss(ref), argnums=argnums)(*args)
    for name, a, b in zip(("dx", "dw13", "dw2", "dgates", "db13", "db2"), got, want, strict=False):
        assert a.dtype == b.dtype, name
        _close(a, b, name)


def _stored(w13, w2, b13, layout: str, interleaved: bool):
    """The default layout's w13, w2, b13 as another library stores them: gate/up rows interleaved ([g0, u0, g1, u1,
    ...]) and / or the experts' matrices transposed ("in_out")."""
    if interleaved:
        h = w13.shape[1] // 2
        perm = np.stack((np.arange(h), np.arange(h, 2 * h)), 1).reshape(-1)
        w13, b13 = w13[:, perm], None if b13 is None else b13[:, perm]
    if layout == "in_out":
        w13, w2 = jnp.swapaxes(w13, 1, 2), jnp.swapaxes(w2, 1, 2)
    return w13, w2, b13


def _layout_run(D, layout, interleaved, checkpoint, dy, jit):
    """y and the gradients (x, w13, w2, gates, b13, b2) of sum(y * dy) through moe_ffn on the weights stored in
    ``layout`` / ``interleaved``; the weight and bias gradients as the default layout's run would give them."""
    s13, s2, sb13 = _stored(D["w13"], D["w2"], D["b13"], layout, interleaved)
    act = "swiglu" + ("_interleaved" if interleaved else "")

    def f(x, w13, w2, g, b13, b2):
        return ops.moe_ffn(x, w13, w2, g, D["ids"], activation=act, checkpoint=checkpoint, b13=b13, b2=b2,
                           weight_layout=layout)

    def run(*a):
        y, vjp = jax.vjp(f, *a)
        return y, vjp(dy)

    y, g = (jax.jit(run) if jit else run)(D["x"], s13, s2, D["gates"], sb13, D["b2"])
    for a, b in ((g[1], s13), (g[2], s2), (g[4], sb13)):
        assert a.shape == b.shape  # in the stored layout
    h = D["w2"].shape[2]
    inv = np.argsort(np.stack((np.arange(h), np.arange(h, 2 * h)), 1).reshape(-1))
    dw13, dw2, db13 = g[1], g[2], g[4]
    if layout == "in_out":
        dw13, dw2 = jnp.swapaxes(dw13, 1, 2), jnp.swapaxes(dw2, 1, 2)
    if interleaved:
        dw13, db13 = dw13[:, inv], db13[:, inv]
    return y, (g[0], dw13, dw2, g[3], db13, g[5])


@pytest.mark.parametrize("checkpoint", ["ab", "none"])
@pytest.mark.parametrize("layout,interleaved", [("in_out", False), ("out_in", True), ("in_out", True)],
                         ids=["in_out", "interleaved", "in_out-interleaved"])
def test_ffn_weight_layouts(layout, interleaved, checkpoint):
    """moe_ffn on weights stored "in_out" and / or with interleaved gate/up rows (gpt-oss's storage, read in place):
    y and every gradient of the jax.numpy reference on the default layout, the weight gradients in the stored layout,
    eager and under jit. A layout the core does not know, or weights that do not fit the one named, fail at trace
    time."""
    D = _data(activation="swiglu", bias=True)
    dy = jnp.asarray(np.random.default_rng(1).standard_normal(D["x"].shape).astype(np.float32))
    args = (D["x"], D["w13"], D["w2"], D["gates"], D["b13"], D["b2"])
    ry, rvjp = jax.vjp(lambda *a: ref_ffn(a[0], a[1], a[2], a[3], D["ids"], "swiglu", a[4], a[5]), *args)
    want = rvjp(dy)
    for jit in (False, True):
        y, got = _layout_run(D, layout, interleaved, checkpoint, dy, jit)
        _close(y, ry, f"y (jit={jit})")
        for name, a, b in zip(("dx", "dw13", "dw2", "dgates", "db13", "db2"), got, want, strict=True):
            _close(a, b, f"{name} (jit={jit})")
    with pytest.raises(ValueError, match="weight_layout must be one of"):
        ops.moe_ffn(D["x"], D["w13"], D["w2"], D["gates"], D["ids"], weight_layout="transposed")
    with pytest.raises(ValueError, match="weight_layout 'in_out'"):
        ops.moe_ffn(D["x"], D["w13"], D["w2"], D["gates"], D["ids"], weight_layout="in_out")


def test_forward_backward_ops_and_saved_ab():
    D = _data()
    disp = ops.build_dispatch(D["ids"], 6)
    L, K = D["ids"].shape
    assert np.asarray(disp.counts()).sum() == L * K
    y, ab = ops.moe_forward(D["x"], D["w13"], D["w2"], D["gates"], D["ids"], disp, checkpoint="ab")
    assert ab.shape == (L * K, D["w13"].shape[1]) and ab.dtype == jnp.float32
    # ab holds the pre-activations of the slots in expert-slot order
    z = jnp.einsum("lkrd,ld->lkr", D["w13"][D["ids"]], D["x"], precision="highest").reshape(L * K, -1)
    pair = np.asarray(disp.slot_token) * K + np.asarray(disp.slot_k)
    _close(ab, z[pair], "ab")
    _, ab_none = ops.moe_forward(D["x"], D["w13"], D["w2"], D["gates"], D["ids"], disp, checkpoint="none")
    assert ab_none.shape == (0, D["w13"].shape[1])
    dy = jnp.ones_like(y)
    g = ops.moe_backward(dy, D["x"], D["w13"], D["w2"], D["gates"], D["ids"], disp, ab)
    assert g.db13 is None and g.db2 is None
    want = jax.grad(lambda x: jnp.sum(ref_ffn(x, D["w13"], D["w2"], D["gates"], D["ids"], "swiglu")))(D["x"])
    _close(g.dx, want, "dx")
    # the backward may run twice on the same residuals (retain=True in the core)
    g2 = ops.moe_backward(dy, D["x"], D["w13"], D["w2"], D["gates"], D["ids"], disp, ab)
    np.testing.assert_array_equal(np.asarray(g.dw13), np.asarray(g2.dw13))


def test_forward_passes_the_act_in_operand_choice(monkeypatch):
    """The forward op hands the core blazecore.memory.act_in_operand_lowers_peak's choice for its shapes and policy."""
    from blazecore import memory

    seen = []
    orig = ops.blazecore.moe_forward

    def record(*a, **kw):
        seen.append(kw["act_in_operand"])
        return orig(*a, **kw)

    monkeypatch.setattr(ops.blazecore, "moe_forward", record)
    D = _data(L=64, d=16, h=64)
    disp = ops.build_dispatch(D["ids"], 6)
    L, K = D["ids"].shape
    d, h = D["x"].shape[1], D["w2"].shape[2]
    for dt in (jnp.float32, jnp.bfloat16):
        x, w13, w2 = (D[k].astype(dt) for k in ("x", "w13", "w2"))
        for checkpoint in ("ab", "none"):
            ops.moe_forward(x, w13, w2, D["gates"], D["ids"], disp, checkpoint=checkpoint)
            assert seen[-1] is memory.act_in_operand_lowers_peak(L, d, h, 6, K, dtype=np.dtype(dt).name,
                                                                 checkpoint=checkpoint)
    # float32 runs the mma.sync kernels (no act_in_operand there); bf16 "ab" with h >> d: the forward's activations
    # would set the peak
    assert seen == [False, False, True, False]


def test_ffn_under_jit():
    D = _data(bias=True)

    def f(x, w13, w2, gates, b13, b2):
        return jnp.sum(ops.moe_ffn(x, w13, w2, gates, D["ids"], b13=b13, b2=b2) ** 2)

    def r(x, w13, w2, gates, b13, b2):
        return jnp.sum(ref_ffn(x, w13, w2, gates, D["ids"], "swiglu", b13, b2) ** 2)

    args = (D["x"], D["w13"], D["w2"], D["gates"], D["b13"], D["b2"])
    v, g = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4, 5)))(*args)
    rv, rg = jax.value_and_grad(r, argnums=(0, 1, 2, 3, 4, 5))(*args)
    _close(v, rv, "loss")
    for i, (a, b) in enumerate(zip(g, rg, strict=True)):
        _close(a, b, f"grad {i}")


# ---------------------------------------------------------------------------------------------
# Router and aux losses
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("score,renormalize", [("softmax", True), ("softmax", False), ("sigmoid", True)],
                         ids=["softmax-renorm", "softmax", "sigmoid-renorm"])
def test_route_topk(score, renormalize):
    D = _data()
    logits = D["logits"]
    gates, ids = ops.route_topk(logits, 2, score=score, renormalize=renormalize)
    rg, rids = ref_route(logits, 2, score, renormalize)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(rids))
    assert gates.dtype == jnp.float32 and ids.dtype == jnp.int32
    _close(gates, rg, "gates")
    w = jnp.asarray(np.random.default_rng(3).standard_normal(gates.shape).astype(np.float32))
    got = jax.grad(lambda lg: jnp.sum(ops.route_topk(lg, 2, score=score, renormalize=renormalize)[0] * w))(logits)
    want = jax.grad(lambda lg: jnp.sum(ref_route(lg, 2, score, renormalize)[0] * w))(logits)
    _close(got, want, "dlogits")


def test_route_topk_expert_bias_selects_only():
    D = _data()
    bias = jnp.zeros((6,), jnp.float32).at[5].set(10.0)
    gates, ids = ops.route_topk(D["logits"], 2, expert_bias=bias)
    assert np.all(np.asarray(ids)[:, 0] == 5)
    p = jax.nn.softmax(D["logits"], -1)
    sel = jnp.take_along_axis(p, ids, 1)
    _close(gates, sel / sel.sum(-1, keepdims=True), "gates")


def test_aux_losses_and_grads():
    D = _data()
    logits, ids = D["logits"], D["ids"]
    _close(ops.load_balancing_loss(logits, ids), ref_lb(logits, ids), "lb")
    _close(ops.router_z_loss(logits), ref_z(logits), "z")
    _close(jax.grad(lambda lg: 3.0 * ops.load_balancing_loss(lg, ids))(logits),
           jax.grad(lambda lg: 3.0 * ref_lb(lg, ids))(logits), "dlb")
    _close(jax.jit(jax.grad(lambda lg: 0.5 * ops.router_z_loss(lg)))(logits),
           jax.grad(lambda lg: 0.5 * ref_z(lg))(logits), "dz")


# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------


def _layer_loss(layer_fn, top_k, activation="swiglu"):
    def loss(params, x):
        y, aux = layer_fn(params, x, top_k=top_k, activation=activation)
        y = y.astype(jnp.float32)
        return jnp.sum(y * y) + 0.01 * aux["load_balancing_loss"] + 0.001 * aux["z_loss"]

    return loss


def _ref_layer_kw(params, x, *, top_k, activation, ids=None):
    return ref_layer(params, x, top_k, activation, ids)


@pytest.mark.parametrize("activation,jit", [("swiglu", False), ("swiglu", True), ("gelu", True)],
                         ids=["swiglu-eager", "swiglu-jit", "gelu-jit"])
def test_layer_value_and_grad(activation, jit):
    params = blazecore_jax.init_moe_params(jax.random.key(0), 16, 8, 6, activation=activation)
    x = jax.random.normal(jax.random.key(1), (3, 5, 16), jnp.float32)
    vg = jax.value_and_grad(_layer_loss(blazecore_jax.moe_layer, 2, activation), argnums=(0, 1))
    if jit:
        vg = jax.jit(vg)
    (v, (gp, gx)) = vg(params, x)
    rv, (rgp, rgx) = jax.value_and_grad(_layer_loss(_ref_layer_kw, 2, activation), argnums=(0, 1))(params, x)
    _close(v, rv, "loss")
    _close(gx, rgx, "dx")
    for k in ("router", "gate_up_proj", "down_proj"):
        _close(gp[k], rgp[k], f"d{k}")
    y, aux = blazecore_jax.moe_layer(params, x, top_k=2, activation=activation)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert aux["tokens_per_expert"].shape == (6,) and int(aux["tokens_per_expert"].sum()) == 15 * 2
    assert aux["router_logits"].shape == (15, 6)


@pytest.mark.parametrize("activation", ("swiglu", "gelu", "swiglu_interleaved"))
@pytest.mark.parametrize("weight_layout,bias", [("out_in", True), ("in_out", False), ("in_out", True)],
                         ids=lambda v: str(v))
def test_layer_weight_layouts_and_biases(weight_layout, bias, activation):
    """moe_layer on projections stored "in_out" and / or with expert biases: the loss and the gradients of x and of
    every parameter (in the stored layout, the biases' included) against the jax.numpy layer; init_moe_params
    gives the same weights for a key in every layout, with or without biases."""
    d, h, E = 16, 8, 6
    params = blazecore_jax.init_moe_params(jax.random.key(0), d, h, E, activation=activation,
                                           weight_layout=weight_layout, bias=bias)
    plain = blazecore_jax.init_moe_params(jax.random.key(0), d, h, E, activation=activation)
    R = 2 * h if activation != "gelu" else h
    t = weight_layout == "in_out"
    want = {"router": (E, d), "gate_up_proj": (E, d, R) if t else (E, R, d), "down_proj": (E, h, d) if t else (E, d, h)}
    if bias:
        want.update(gate_up_proj_bias=(E, R), down_proj_bias=(E, d))
    assert {k: v.shape for k, v in params.items()} == want
    tr = (lambda w: jnp.swapaxes(w, 1, 2)) if t else (lambda w: w)
    for k in ("gate_up_proj", "down_proj"):
        np.testing.assert_array_equal(np.asarray(tr(params[k])), np.asarray(plain[k]))
    np.testing.assert_array_equal(np.asarray(params["router"]), np.asarray(plain["router"]))
    x = jax.random.normal(jax.random.key(1), (3, 5, d), jnp.float32)

    def layer(p, x, top_k, activation):
        return blazecore_jax.moe_layer(p, x, top_k=top_k, activation=activation, weight_layout=weight_layout)

    def ref(p, x, top_k, activation):
        return ref_layer(p, x, top_k, activation, weight_layout=weight_layout)

    v, (gp, gx) = jax.jit(jax.value_and_grad(_layer_loss(layer, 2, activation), argnums=(0, 1)))(params, x)
    rv, (rgp, rgx) = jax.value_and_grad(_layer_loss(ref, 2, activation), argnums=(0, 1))(params, x)
    _close(v, rv, "loss")
    _close(gx, rgx, "dx")
    assert set(gp) == set(want)
    for k in want:
        assert gp[k].shape == want[k], k
        _close(gp[k], rgp[k], f"d{k}")
    with pytest.raises(ValueError, match="both expert biases or neither"):
        blazecore_jax.moe_layer({**plain, "down_proj_bias": jnp.zeros((E, d))}, x, top_k=2, activation=activation)
    with pytest.raises(ValueError, match="weight_layout must be one of"):
        blazecore_jax.moe_layer(plain, x, top_k=2, activation=activation, weight_layout="transposed")


def test_layer_under_vmap():
    params = blazecore_jax.init_moe_params(jax.random.key(0), 16, 8, 6)
    xb = jax.random.normal(jax.random.key(2), (3, 7, 16), jnp.float32)  # batch of 3 independent (7, 16) inputs
    loss = _layer_loss(blazecore_jax.moe_layer, 2)
    rloss = _layer_loss(_ref_layer_kw, 2)
    per = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1)), in_axes=(None, 0)))(params, xb)
    rper = jax.vmap(jax.value_and_grad(rloss, argnums=(0, 1)), in_axes=(None, 0))(params, xb)
    _close(per[0], rper[0], "losses")
    _close(per[1][1], rper[1][1], "dx")
    for k in ("router", "gate_up_proj", "down_proj"):
        _close(per[1][0][k], rper[1][0][k], f"d{k}")
    # vmap over the weights too: every op sees its own experts
    pb = jax.tree.map(lambda p: jnp.stack([p, 0.5 * p, -p]), params)
    yb, _ = jax.vmap(lambda p, x: blazecore_jax.moe_layer(p, x, top_k=2))(pb, xb)
    for i in range(3):
        y_i, _ = ref_layer(jax.tree.map(lambda p, i=i: p[i], pb), xb[i], 2)
        _close(yb[i], y_i, f"y[{i}]")


# ---------------------------------------------------------------------------------------------
# Errors at trace time
# ---------------------------------------------------------------------------------------------


def _trace(fn, *args):
    """Trace only (no compile, no callback run): the checks must fire here."""
    jax.make_jaxpr(fn)(*args)


def test_errors_at_trace_time():
    D = _data()
    x, w13, w2, g, ids = D["x"], D["w13"], D["w2"], D["gates"], D["ids"]
    with pytest.raises(ValueError, match="do not match x's d"):
        _trace(lambda x: ops.moe_ffn(x, w13, w2, g, ids), x[:, :-1])
    with pytest.raises(TypeError, match="gates: dtype float16"):
        _trace(lambda g: ops.moe_ffn(x, w13, w2, g, ids), g.astype(jnp.float16))
    with pytest.raises(TypeError, match="w13: dtype bfloat16 differs"):
        _trace(lambda w: ops.moe_ffn(x, w, w2, g, ids), w13.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="expert_ids: dtype float32"):
        _trace(lambda i: ops.moe_ffn(x, w13, w2, g, i), ids.astype(jnp.float32))
    with pytest.raises(ValueError, match="needs"):
        _trace(lambda w: ops.moe_ffn(x, w, w2, g, ids, activation="gelu"), w13)
    with pytest.raises(ValueError, match="unknown activation"):
        _trace(lambda x: ops.moe_ffn(x, w13, w2, g, ids, activation="tanh"), x)
    with pytest.raises(ValueError, match="unknown checkpoint"):
        _trace(lambda x: ops.moe_ffn(x, w13, w2, g, ids, checkpoint="all"), x)
    with pytest.raises(ValueError, match=r"expert_ids shape \(12, 2\) differs from gates shape \(11, 2\)"):
        _trace(lambda g: ops.moe_ffn(x, w13, w2, g, ids), g[:-1])  # the core's shape rules (moe.ffn_shapes)
    with pytest.raises(ValueError, match="top_k = 7"):
        _trace(lambda lg: ops.route_topk(lg, 7), D["logits"])
    with pytest.raises(ValueError, match="2-D"):
        _trace(lambda lg: ops.router_z_loss(lg), D["logits"][0])
    with pytest.raises(TypeError, match="logits: dtype int32"):
        _trace(lambda lg: ops.route_topk(lg, 2), ids)
    with pytest.raises(ValueError, match="dispatch.slot_token"):  # a dispatch of other ids
        _trace(lambda x: ops.moe_ffn(x[:-1], w13, w2, g[:-1], ids[:-1], dispatch=ops.build_dispatch(ids, 6)), x)
    params = blazecore_jax.init_moe_params(jax.random.key(0), 16, 8, 6)
    with pytest.raises(ValueError, match="last dimension"):
        _trace(lambda x: blazecore_jax.moe_layer(params, x, top_k=2), jnp.zeros((4, 15)))
    with pytest.raises(TypeError, match="share a dtype"):
        _trace(lambda x: blazecore_jax.moe_layer(params, x, top_k=2), jnp.zeros((4, 16), jnp.bfloat16))


def test_bad_id_values_fail_when_run():
    D = _data()
    bad = D["ids"].at[0, 1].set(D["ids"][0, 0])  # a repeated expert in row 0
    # concrete ids: a ValueError whose message is the problem itself (checked before the callback)
    with pytest.raises(ValueError, match=r"^expert_ids\[0, 1\] = \d+ repeats expert_ids\[0, 0\]"):
        ops.moe_ffn(D["x"], D["w13"], D["w2"], D["gates"], bad)
    with pytest.raises(ValueError, match=r"^expert_ids\[1, 0\] = 9 is outside \[0, 6\)$"):
        ops.build_dispatch(D["ids"].at[1, 0].set(9), 6)
    with pytest.raises(ValueError, match="is outside"):  # under grad (no jit) the ids are still concrete
        jax.grad(lambda x: ops.moe_ffn(x, D["w13"], D["w2"], D["gates"], D["ids"].at[1, 0].set(-2)).sum())(D["x"])
    # inside jit the values exist only in the callback: JAX wraps its ValueError, whose message still shows
    with pytest.raises(Exception, match="expert_ids"):
        jax.block_until_ready(jax.jit(ops.moe_ffn)(D["x"], D["w13"], D["w2"], D["gates"], bad))


def test_bf16_cpu_forward():
    D = _data()
    bf = lambda a: a.astype(jnp.bfloat16)  # noqa: E731
    y = ops.moe_ffn(bf(D["x"]), bf(D["w13"]), bf(D["w2"]), D["gates"], D["ids"])
    assert y.dtype == jnp.bfloat16
    want = ref_ffn(bf(D["x"]).astype(jnp.float32), bf(D["w13"]).astype(jnp.float32),
                   bf(D["w2"]).astype(jnp.float32), D["gates"], D["ids"], "swiglu")
    _close(y.astype(jnp.float32), want, "y bf16", 1e-2)


# ---------------------------------------------------------------------------------------------
# Same outputs as the PyTorch adapter
# ---------------------------------------------------------------------------------------------


def test_matches_torch_adapter():
    torch = pytest.importorskip("torch")
    import blazecore_torch

    params = blazecore_jax.init_moe_params(jax.random.key(4), 16, 8, 6)
    x = jax.random.normal(jax.random.key(5), (10, 16), jnp.float32)
    y, aux = blazecore_jax.moe_layer(params, x, top_k=2)

    layer = blazecore_torch.MoELayer(16, 8, 6, 2)
    with torch.no_grad():
        layer.router.weight.copy_(torch.from_numpy(np.array(params["router"])))
        layer.gate_up_proj.copy_(torch.from_numpy(np.array(params["gate_up_proj"])))
        layer.down_proj.copy_(torch.from_numpy(np.array(params["down_proj"])))
    ty, taux = layer(torch.from_numpy(np.array(x)))
    _close(y, ty.detach().numpy(), "y vs torch")
    for k in ("load_balancing_loss", "z_loss"):
        _close(aux[k], taux[k].detach().numpy(), f"{k} vs torch")
    np.testing.assert_array_equal(np.asarray(aux["tokens_per_expert"]), taux["tokens_per_expert"].numpy())
    # the FFN op alone on identical routing: bit-for-bit the same core path on the CPU
    D = _data()
    jy = ops.moe_ffn(D["x"], D["w13"], D["w2"], D["gates"], D["ids"])
    t = lambda a: torch.from_numpy(np.array(a))  # noqa: E731
    tyy = blazecore_torch.moe_ffn(t(D["x"]), t(D["w13"]), t(D["w2"]), t(D["gates"]), t(D["ids"]))
    np.testing.assert_array_equal(np.asarray(jy), tyy.numpy())


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


def _jax_gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend")


@pytest.mark.gpu
def test_gpu_layer_matches_reference_bf16():
    dev = _jax_gpu()
    params = jax.device_put(blazecore_jax.init_moe_params(jax.random.key(0), 64, 32, 8, dtype=jnp.bfloat16), dev)
    x = jax.device_put(jax.random.normal(jax.random.key(1), (128, 64), jnp.bfloat16), dev)
    vg = jax.jit(jax.value_and_grad(_layer_loss(blazecore_jax.moe_layer, 2), argnums=(0, 1)))
    v, (gp, gx) = vg(params, x)
    # bf16 logits may order near ties differently from float32 ones: the reference takes the bf16 selection
    _, aux = blazecore_jax.moe_layer(params, x, top_k=2)
    _, ids = ops.route_topk(aux["router_logits"], 2)
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), (params, x))
    ref = functools.partial(_ref_layer_kw, ids=jax.device_get(ids))
    rv, (rgp, rgx) = jax.value_and_grad(_layer_loss(ref, 2), argnums=(0, 1))(*f32)
    _close(v, rv, "loss", 2e-2)
    _close(gx.astype(jnp.float32), rgx, "dx", 2e-2)
    for k in ("router", "gate_up_proj", "down_proj"):
        _close(gp[k].astype(jnp.float32), rgp[k], f"d{k}", 2e-2)


@pytest.mark.gpu
def test_gpu_ffn_ops_and_vmap():
    dev = _jax_gpu()
    D = jax.device_put(_data(L=64, d=64, h=32, E=8, K=2, bias=True), dev)
    args = (D["x"], D["w13"], D["w2"], D["gates"], D["b13"], D["b2"])

    def f(x, w13, w2, gates, b13, b2):
        return jnp.sum(ops.moe_ffn(x, w13, w2, gates, D["ids"], b13=b13, b2=b2) ** 2)

    def r(x, w13, w2, gates, b13, b2):
        return jnp.sum(ref_ffn(x, w13, w2, gates, D["ids"], "swiglu", b13, b2) ** 2)

    g = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4, 5)))(*args)
    rg = jax.grad(r, argnums=(0, 1, 2, 3, 4, 5))(*args)
    for i, (a, b) in enumerate(zip(g, rg, strict=True)):
        _close(a, b, f"grad {i}", 1e-4)
    xb = jnp.stack([D["x"], 2 * D["x"]])
    yb = jax.jit(jax.vmap(lambda x: ops.moe_ffn(x, D["w13"], D["w2"], D["gates"], D["ids"])))(xb)
    for i in range(2):
        _close(yb[i], ref_ffn(xb[i], D["w13"], D["w2"], D["gates"], D["ids"], "swiglu"), f"y[{i}]", 1e-4)


# relative norm error on the GPU against a float32 jax.numpy computation (HIGHEST precision) of the same,
# dtype-rounded inputs: float32 kernels accumulate in a different order, bf16 ones round their outputs
GPU_TOL = {"float32": 1e-4, "bfloat16": 2e-2}


def _gpu_data(dtype, activation="swiglu", bias=False, L=203, d=128, h=64, E=8, K=3, seed=0):
    """_data on the JAX GPU in ``dtype`` (gates, ids and logits keep theirs); L ragged, d and h multiples of 8."""
    dev = _jax_gpu()
    D = _data(L=L, d=d, h=h, E=E, K=K, activation=activation, bias=bias, seed=seed)
    keep = ("gates", "ids", "logits")
    return jax.device_put({k: v if v is None or k in keep else v.astype(dtype) for k, v in D.items()}, dev)


def _f32(a):
    return None if a is None else a.astype(jnp.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("checkpoint", ["ab", "none"])
@pytest.mark.parametrize("dtype,activation,bias", [("bfloat16", "swiglu", False), ("bfloat16", "gelu", True),
                                                   ("float32", "swiglu", True), ("float32", "geglu", False)],
                         ids=["bf16-swiglu", "bf16-gelu-bias", "f32-swiglu-bias", "f32-geglu"])
def test_gpu_ffn_output_and_every_grad(dtype, activation, bias, checkpoint, mode):
    """y and the gradients w.r.t. x, w13, w2, gates (and b13, b2) of sum(y * dy) against jax.numpy."""
    D = _gpu_data(jnp.dtype(dtype), activation, bias)
    names = ("x", "w13", "w2", "gates") + (("b13", "b2") if bias else ())
    args = tuple(D[n] for n in names)
    dy = jax.device_put(jnp.asarray(np.random.default_rng(1).standard_normal(D["x"].shape), dtype), _jax_gpu())

    def ours(*a):
        kw = dict(zip(names, a, strict=True))
        return ops.moe_ffn(kw["x"], kw["w13"], kw["w2"], kw["gates"], D["ids"], activation=activation,
                           checkpoint=checkpoint, b13=kw.get("b13"), b2=kw.get("b2"))

    def ref(*a):
        kw = dict(zip(names, a, strict=True))
        return ref_ffn(kw["x"], kw["w13"], kw["w2"], kw["gates"], D["ids"], activation, kw.get("b13"), kw.get("b2"))

    def fwd_bwd(f, cotangent):
        def run(*a):
            y, vjp = jax.vjp(f, *a)
            return y, vjp(cotangent)

        return run

    run = fwd_bwd(ours, dy)
    y, grads = (jax.jit(run) if mode == "jit" else run)(*args)
    ry, rgrads = fwd_bwd(ref, _f32(dy))(*(_f32(a) for a in args))
    assert y.dtype == jnp.dtype(dtype) and y.shape == D["x"].shape
    tol = GPU_TOL[dtype]
    _close(_f32(y), ry, "y", tol)
    for name, a, g, r in zip(("d" + n for n in names), args, grads, rgrads, strict=True):
        assert g.dtype == a.dtype and g.shape == a.shape, f"{name}: {g.dtype} {g.shape}"
        _close(_f32(g), r, name, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("layout,interleaved", [("in_out", False), ("in_out", True)], ids=["in_out", "gpt-oss"])
def test_gpu_ffn_weight_layouts(layout, interleaved):
    """On the GPU in bfloat16 (the wgmma kernels on Hopper): moe_ffn on weights stored "in_out" (with interleaved
    gate/up rows: gpt-oss's storage) gives the default layout's run's y and gradients, eager and under jit."""
    D = _gpu_data(jnp.bfloat16, "swiglu", True)
    dy = jax.device_put(jnp.asarray(np.random.default_rng(1).standard_normal(D["x"].shape), jnp.bfloat16), _jax_gpu())
    for jit in (False, True):
        y0, g0 = _layout_run(D, "out_in", False, "ab", dy, jit)
        y, g = _layout_run(D, layout, interleaved, "ab", dy, jit)
        _close(_f32(y), _f32(y0), f"y (jit={jit})", GPU_TOL["bfloat16"])
        for name, a, b in zip(("dx", "dw13", "dw2", "dgates", "db13", "db2"), g, g0, strict=True):
            _close(_f32(a), _f32(b), f"{name} (jit={jit})", GPU_TOL["bfloat16"])


@pytest.mark.gpu
def test_gpu_ops_keep_inputs_and_cupy_pool():
    """moe_forward / moe_backward on XLA buffers: ab holds the pre-activations in slot order, the backward leaves
    XLA's input buffers (ab included) untouched and gives the same bits twice, the dispatch matches the CPU's,
    and the callbacks keep no CuPy memory once their results are ready."""
    import cupy

    import blazecore

    D = _gpu_data(jnp.bfloat16)
    L, K = D["ids"].shape
    pool = cupy.get_default_memory_pool()
    disp = ops.build_dispatch(D["ids"], 8)
    want = blazecore.build_dispatch(np.asarray(D["ids"]), 8)
    for name in ("expert_offsets", "slot_token", "slot_k", "pair_slot"):
        np.testing.assert_array_equal(np.asarray(getattr(disp, name)), getattr(want, name), err_msg=name)
    jax.block_until_ready(disp)
    used = pool.used_bytes()
    y, ab = ops.moe_forward(D["x"], D["w13"], D["w2"], D["gates"], D["ids"], disp, checkpoint="ab")
    jax.block_until_ready((y, ab))
    assert pool.used_bytes() == used, "a forward callback kept CuPy memory"
    assert ab.shape == (L * K, D["w13"].shape[1]) and ab.dtype == jnp.bfloat16
    z = jnp.einsum("lkrd,ld->lkr", _f32(D["w13"])[D["ids"]], _f32(D["x"]), precision="highest").reshape(L * K, -1)
    pair = np.asarray(disp.slot_token) * K + np.asarray(disp.slot_k)
    _close(_f32(ab), z[pair], "ab", GPU_TOL["bfloat16"])
    y_none, ab_none = ops.moe_forward(D["x"], D["w13"], D["w2"], D["gates"], D["ids"], disp, checkpoint="none")
    assert ab_none.shape == (0, D["w13"].shape[1])
    np.testing.assert_array_equal(np.asarray(y_none), np.asarray(y))  # the policy changes what is kept, not y
    before = {n: np.asarray(a).copy() for n, a in (("x", D["x"]), ("w13", D["w13"]), ("ab", ab))}
    dy = jax.device_put(jnp.ones_like(y), _jax_gpu())
    g1 = ops.moe_backward(dy, D["x"], D["w13"], D["w2"], D["gates"], D["ids"], disp, ab)
    g2 = ops.moe_backward(dy, D["x"], D["w13"], D["w2"], D["gates"], D["ids"], disp, ab)
    jax.block_until_ready((g1, g2))
    assert pool.used_bytes() == used, "a backward callback kept CuPy memory"
    for name, a in (("x", D["x"]), ("w13", D["w13"]), ("ab", ab)):
        np.testing.assert_array_equal(np.asarray(a), before[name], err_msg=f"the backward wrote over {name}")
    for name in ("dx", "dw13", "dw2", "dgates"):
        np.testing.assert_array_equal(np.asarray(getattr(g1, name)), np.asarray(getattr(g2, name)), err_msg=name)
    rdx = jax.grad(lambda x: jnp.sum(ref_ffn(x, _f32(D["w13"]), _f32(D["w2"]), D["gates"], D["ids"], "swiglu")))(
        _f32(D["x"]))
    _close(_f32(g1.dx), rdx, "dx", GPU_TOL["bfloat16"])


@pytest.mark.gpu
@pytest.mark.parametrize("score,renormalize", [("softmax", True), ("sigmoid", False)], ids=["softmax", "sigmoid"])
def test_gpu_router_and_aux_losses(score, renormalize):
    D = _gpu_data(jnp.float32)
    logits, K = D["logits"], 3
    gates, ids = jax.jit(lambda lg: ops.route_topk(lg, K, score=score, renormalize=renormalize))(logits)
    rg, rids = ref_route(logits, K, score, renormalize)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(rids))
    _close(gates, rg, "gates")
    w = jax.device_put(jnp.asarray(np.random.default_rng(3).standard_normal(gates.shape), jnp.float32), _jax_gpu())
    got = jax.jit(jax.grad(lambda lg: jnp.sum(ops.route_topk(lg, K, score=score, renormalize=renormalize)[0] * w)))(
        logits)
    _close(got, jax.grad(lambda lg: jnp.sum(ref_route(lg, K, score, renormalize)[0] * w))(logits), "dlogits")
    _close(ops.load_balancing_loss(logits, ids), ref_lb(logits, ids), "lb")
    _close(ops.router_z_loss(logits), ref_z(logits), "z")
    aux = jax.jit(jax.grad(lambda lg: 3.0 * ops.load_balancing_loss(lg, ids) + 0.5 * ops.router_z_loss(lg)))(logits)
    _close(aux, jax.grad(lambda lg: 3.0 * ref_lb(lg, ids) + 0.5 * ref_z(lg))(logits), "daux")


@pytest.mark.gpu
def test_gpu_vmap_of_grad():
    """jax.vmap of jax.value_and_grad of the FFN (sequential vmap of the callbacks), batch of 3, under jit."""
    D = _gpu_data(jnp.float32, bias=True, L=40)
    xb = jnp.stack([D["x"], -0.5 * D["x"], 2.0 * D["x"]])

    def loss(fn):
        return lambda x, w13, w2: jnp.sum(fn(x, w13, w2) ** 2)

    ours = loss(lambda x, w13, w2: ops.moe_ffn(x, w13, w2, D["gates"], D["ids"], b13=D["b13"], b2=D["b2"]))
    ref = loss(lambda x, w13, w2: ref_ffn(x, w13, w2, D["gates"], D["ids"], "swiglu", D["b13"], D["b2"]))
    vg = jax.vmap(jax.value_and_grad(ours, argnums=(0, 1, 2)), in_axes=(0, None, None))
    rvg = jax.vmap(jax.value_and_grad(ref, argnums=(0, 1, 2)), in_axes=(0, None, None))
    (v, g), (rv, rg) = jax.jit(vg)(xb, D["w13"], D["w2"]), rvg(xb, D["w13"], D["w2"])
    _close(v, rv, "losses", GPU_TOL["float32"])
    for name, a, b in zip(("dx", "dw13", "dw2"), g, rg, strict=True):
        assert a.shape == b.shape, name
        _close(a, b, name, GPU_TOL["float32"])


# ---------------------------------------------------------------------------------------------
# Flax NNX module (blazecore_jax.nnx; skipped without flax)
# ---------------------------------------------------------------------------------------------


def test_import_does_not_need_flax():
    code = ("import sys, blazecore_jax; assert 'flax' not in sys.modules, 'flax imported'; "
            "print(hasattr(blazecore_jax, 'moe_layer'))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_ROOT), str(_ROOT / "adapters"),
                                                       os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=_ROOT, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stdout + out.stderr


def test_nnx_module_matches_functional_layer():
    nnx = pytest.importorskip("flax.nnx")
    from blazecore_jax.nnx import ExpertBias, MoE

    model = MoE(16, 8, 6, 2, activation="swiglu", checkpoint="none", rngs=nnx.Rngs(params=0))
    assert blazecore_jax.nnx.MoE is MoE  # the package attribute, loaded on first use
    params = model.param_dict()
    assert {k: v.shape for k, v in params.items()} == {"router": (6, 16), "gate_up_proj": (6, 16, 16),
                                                       "down_proj": (6, 16, 8)}
    x = jax.random.normal(jax.random.key(1), (3, 5, 16), jnp.float32)
    y, aux = model(x)
    fy, faux = blazecore_jax.moe_layer(params, x, top_k=2, checkpoint="none")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(fy))
    np.testing.assert_array_equal(np.asarray(aux["tokens_per_expert"]), np.asarray(faux["tokens_per_expert"]))

    def loss(m, x):
        y, aux = m(x)
        return jnp.sum(y * y) + 0.01 * aux["load_balancing_loss"] + 0.001 * aux["z_loss"]

    v, grads = nnx.jit(nnx.value_and_grad(loss))(model, x)
    rv, rg = jax.value_and_grad(_layer_loss(_ref_layer_kw, 2), argnums=0)(params, x)
    _close(v, rv, "loss")
    for k in ("router", "gate_up_proj", "down_proj"):
        _close(grads[k][...], rg[k], f"d{k}")
    # the expert bias is a variable, not a parameter: no gradient, and it selects experts
    bm = MoE(16, 8, 6, 2, expert_bias=True, rngs=nnx.Rngs(params=0))
    assert isinstance(bm.expert_bias, ExpertBias)
    assert "expert_bias" not in nnx.grad(loss)(bm, x)
    bm.expert_bias.set_value(jnp.zeros((6,), jnp.float32).at[4].set(10.0))
    _, baux = bm(x)
    assert int(baux["tokens_per_expert"][4]) == 15
    bm.update_expert_bias(baux["tokens_per_expert"], rate=0.5)
    assert float(bm.expert_bias[...][4]) == 9.5 and float(bm.expert_bias[...][0]) == 0.5
    with pytest.raises(RuntimeError, match="expert_bias"):
        model.update_expert_bias(aux["tokens_per_expert"])
    with pytest.raises(ValueError, match="top_k"):
        MoE(16, 8, 6, 7, rngs=nnx.Rngs(0))


def test_nnx_module_weight_layout_and_biases():
    nnx = pytest.importorskip("flax.nnx")
    from blazecore_jax.nnx import MoE

    model = MoE(16, 8, 6, 2, activation="swiglu_interleaved", weight_layout="in_out", bias=True,
                rngs=nnx.Rngs(params=0))
    params = model.param_dict()
    assert {k: v.shape for k, v in params.items()} == {
        "router": (6, 16), "gate_up_proj": (6, 16, 16), "down_proj": (6, 8, 16), "gate_up_proj_bias": (6, 16),
        "down_proj_bias": (6, 16)}
    x = jax.random.normal(jax.random.key(1), (3, 5, 16), jnp.float32)
    y, _ = model(x)
    fy, _ = blazecore_jax.moe_layer(params, x, top_k=2, activation="swiglu_interleaved", weight_layout="in_out")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(fy))

    def loss(m, x):
        y, aux = m(x)
        return jnp.sum(y * y) + 0.01 * aux["load_balancing_loss"] + 0.001 * aux["z_loss"]

    grads = nnx.grad(loss)(model, x)

    def ref(p, x, top_k, activation):
        return ref_layer(p, x, top_k, activation, weight_layout="in_out")

    rg = jax.grad(_layer_loss(ref, 2, "swiglu_interleaved"))(params, x)
    for k in params:
        _close(grads[k][...], rg[k], f"d{k}")


def test_nnx_module_trains():
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")
    from blazecore_jax.nnx import MoE

    model = MoE(16, 32, 8, 2, rngs=nnx.Rngs(params=0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(2), (64, 16), jnp.float32)
    target = jnp.tanh(x @ jax.random.normal(jax.random.key(3), (16, 16)) / 4)

    @nnx.jit
    def step(model, opt, x, t):
        def loss(m):
            y, aux = m(x)
            return jnp.mean((y - t) ** 2) + 1e-2 * aux["load_balancing_loss"]

        v, g = nnx.value_and_grad(loss)(model)
        opt.update(model, g)
        return v

    losses = [float(step(model, opt, x, target)) for _ in range(40)]
    assert losses[-1] < 0.5 * losses[0], f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
