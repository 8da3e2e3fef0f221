"""The JAX adapter (adapters/blazecore_jax): custom_vjp ops over buffer_callback and the functional moe_layer.

CPU cases run the core's NumPy reference path through the callbacks and compare outputs and every gradient
with a pure jax.numpy MoE written here (float32), eagerly, under jax.jit and under jax.vmap. Bad shapes and
dtypes must fail at trace time. The JAX and PyTorch adapters must agree on the same weights (skipped
without torch). GPU cases carry @pytest.mark.gpu.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest
from conftest import assert_close

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
pytest.importorskip("jax.experimental.buffer_callback")

_ROOT = pathlib.Path(__file__).resolve().parents[1]
try:
    import blazecore_jax
except ImportError:  # not installed (pip install -e .): use the source tree
    sys.path.insert(0, str(_ROOT / "adapters"))
    import blazecore_jax

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


def ref_layer(params, x, top_k, activation="swiglu"):
    d = x.shape[-1]
    tokens = x.reshape(-1, d)
    logits = jnp.matmul(tokens, params["router"].T, precision=jax.lax.Precision.HIGHEST)
    gates, ids = ref_route(logits, top_k)
    y = ref_ffn(tokens, params["gate_up_proj"], params["down_proj"], gates, ids, activation)
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
        return jnp.sum(y * y) + 0.01 * aux["load_balancing_loss"] + 0.001 * aux["z_loss"]

    return loss


def _ref_layer_kw(params, x, *, top_k, activation):
    return ref_layer(params, x, top_k, activation)


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
    with pytest.raises(ValueError, match="gates has"):
        _trace(lambda g: ops.moe_ffn(x, w13, w2, g, ids), g[:-1])
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
    with pytest.raises(Exception, match="expert_ids"):
        jax.block_until_ready(ops.moe_ffn(D["x"], D["w13"], D["w2"], D["gates"], bad))


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
    try:
        import blazecore_torch
    except ImportError:
        sys.path.insert(0, str(_ROOT / "adapters"))
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
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), (params, x))
    rv, (rgp, rgx) = jax.value_and_grad(_layer_loss(_ref_layer_kw, 2), argnums=(0, 1))(*f32)
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
