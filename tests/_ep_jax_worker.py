"""The JAX expert-parallel checks on 4 host devices (tests/test_ep_jax.py runs this file in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=4, which must be set before JAX starts).

ep_moe_layer under jit and grad against the single-device moe_layer on the same tokens: output and every
gradient (x, router, gate_up_proj, down_proj, and the expert biases where given), over a 1-D ("ep",) mesh and
a 2-D ("dp", "ep") mesh, for skewed routings, gpt-oss's storage ("in_out", interleaved rows, expert biases), an
expert that gets nothing from some device, a device whose tokens all stay on its own experts (it sends nothing
to the others), everything on one expert and K == E; bad input raising before anything runs. XLA:CPU has no
ragged-all-to-all: on the CPU the "ragged" exchange runs on an emulation of it (all_gather and scatters, as its
docstring specifies), which checks the offsets the exchange computes. Prints
"OK <case>" per case; a failure raises.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from blazecore_jax import moe_layer
from blazecore_jax.parallel import ep_moe_layer
from jax.sharding import Mesh

RTOL = 2e-5  # float32 reference path on both sides; the combine's summation order differs


def _close(name, got, want, rtol=RTOL):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    if not err <= rtol:
        raise AssertionError(f"{name}: relative norm error {err:.3e} > {rtol:.1e}; max abs error "
                             f"{np.abs(got - want).max():.3e}")


def _params(d, h, E, seed=0):
    """Random experts; the router reads the first E columns of x as the logits (router = [I_E, 0])."""
    rng = np.random.default_rng(seed)
    router = np.zeros((E, d), np.float32)
    router[:, :E] = np.eye(E)
    return {"router": jnp.asarray(router),
            "gate_up_proj": jnp.asarray(rng.standard_normal((E, 2 * h, d)) * d ** -0.5, jnp.float32),
            "down_proj": jnp.asarray(rng.standard_normal((E, d, h)) * h ** -0.5, jnp.float32)}


def _tokens(case, n_dev, per_dev, d, E, ep, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_dev, per_dev, d)).astype(np.float32)
    El = E // ep
    for dev in range(n_dev):
        r = dev % ep  # the device's position on the ep axis (the ep axis is the last mesh axis)
        if case == "skewed":
            x[dev, :, :E] += np.linspace(2.0, -2.0, E)
        elif case == "empty_from_rank":
            x[dev, :, r % E] -= 40.0  # device never picks expert r
            x[dev, :, E - 1] -= 40.0  # and nobody picks the last expert
        elif case == "stays_local":
            if r == 0:
                x[dev, :, :El] += 40.0  # ep rank 0's tokens all go to its own experts: it sends nothing away
        elif case == "all_to_one":
            x[dev, :, 0] += 40.0
    return jnp.asarray(x.reshape(n_dev * per_dev, d))


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name, axis_index_groups=None):
    """``jax.lax.ragged_all_to_all`` as its docstring specifies it, built from all_gather (XLA:CPU has no
    ragged-all-to-all): lets the CPU check the offsets the "ragged" exchange passes. One slice per device."""
    del recv_sizes, axis_index_groups  # implied by the senders' sizes
    ops = jax.lax.all_gather(operand, axis_name)  # (ep, n, ...)
    starts, sizes, dests = (jax.lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes, output_offsets))
    me = jax.lax.axis_index(axis_name)
    rows, n = output.shape[0], operand.shape[0]
    idx = jnp.arange(n)
    result = output
    for src in range(ops.shape[0]):
        start, size, dest = starts[src, me], sizes[src, me], dests[src, me]
        inside = (idx >= start) & (idx < start + size)
        result = result.at[jnp.where(inside, dest + idx - start, rows)].set(ops[src], mode="drop")
    return result


def _gpt_oss_params(d, h, E):
    """gpt-oss's storage of the same kind of experts: "in_out" projections, interleaved gate/up rows, biases."""
    p = _params(d, h, E)
    rng = np.random.default_rng(5)
    return {"router": p["router"], "gate_up_proj": jnp.swapaxes(p["gate_up_proj"], 1, 2),
            "down_proj": jnp.swapaxes(p["down_proj"], 1, 2),
            "gate_up_proj_bias": jnp.asarray(rng.standard_normal((E, 2 * h)) * 0.1, jnp.float32),
            "down_proj_bias": jnp.asarray(rng.standard_normal((E, d)) * 0.1, jnp.float32)}


def check_case(mesh, case, E, K, exchange, d=12, h=6, per_dev=5):
    ep = int(mesh.shape["ep"])
    n_dev = mesh.devices.size
    gpt_oss = case == "in_out_biases"
    params = _gpt_oss_params(d, h, E) if gpt_oss else _params(d, h, E)
    kw = {"weight_layout": "in_out", "activation": "swiglu_interleaved"} if gpt_oss else {}
    x = _tokens(case, n_dev, per_dev, d, E, ep)
    dy = jnp.asarray(np.random.default_rng(2).standard_normal(x.shape), jnp.float32)
    bias = jnp.linspace(-1.0, 1.0, E) if case == "expert_bias" else None

    def loss_single(p, xx):
        y, _ = moe_layer(p, xx, top_k=K, expert_bias=bias, **kw)
        return jnp.sum(y * dy), y

    def loss_ep(p, xx):
        y, _ = ep_moe_layer(p, xx, mesh=mesh, top_k=K, expert_bias=bias, exchange=exchange, **kw)
        return jnp.sum(y * dy), y

    (_, y_want), g_want = jax.jit(jax.value_and_grad(loss_single, argnums=(0, 1), has_aux=True))(params, x)
    (_, y_got), g_got = jax.jit(jax.value_and_grad(loss_ep, argnums=(0, 1), has_aux=True))(params, x)
    tag = f"{case} E={E} K={K} mesh={dict(mesh.shape)} {exchange}"
    _close(f"{tag}: y", y_got, y_want)
    _close(f"{tag}: dx", g_got[1], g_want[1])
    assert set(g_got[0]) == set(params)
    for k in params:
        _close(f"{tag}: d {k}", g_got[0][k], g_want[0][k])
    _, aux = jax.jit(lambda p, xx: ep_moe_layer(p, xx, mesh=mesh, top_k=K, expert_bias=bias,
                                                exchange=exchange, **kw))(params, x)
    _, aux_want = moe_layer(params, x, top_k=K, expert_bias=bias, **kw)
    assert np.array_equal(np.asarray(aux["tokens_per_expert"]), np.asarray(aux_want["tokens_per_expert"]))
    print(f"OK {tag}", flush=True)


def check_errors(mesh):
    params = _params(12, 6, 4)
    x = jnp.zeros((8, 12), jnp.float32)

    def expect(exc, fn, text):
        try:
            fn()
        except exc as e:
            assert text in str(e), f"message {str(e)!r} lacks {text!r}"
        else:
            raise AssertionError(f"no {exc.__name__} ({text})")

    expect(ValueError, lambda: ep_moe_layer(_params(12, 6, 6), x, mesh=mesh, top_k=2), "not divisible")
    expect(ValueError, lambda: ep_moe_layer(params, x, mesh=mesh, top_k=2, axis="experts"), "no axis named")
    expect(ValueError, lambda: ep_moe_layer(params, x[:6], mesh=mesh, top_k=2), "split evenly")
    two = Mesh(np.array(jax.devices()[:2]), ("ep",))
    elsewhere = jax.device_put(x, jax.devices()[3])
    expect(ValueError, lambda: ep_moe_layer(params, elsewhere, mesh=two, top_k=2), "outside the mesh")
    one_bias = {**params, "down_proj_bias": jnp.zeros((4, 12), jnp.float32)}
    expect(ValueError, lambda: ep_moe_layer(one_bias, x, mesh=mesh, top_k=2), "both expert biases or neither")
    expect(ValueError, lambda: ep_moe_layer(params, x, mesh=mesh, top_k=2, weight_layout="t"), "weight_layout")
    expect(ValueError, lambda: ep_moe_layer(params, x, mesh=mesh, top_k=2, exchange="tokens"), "exchange must be")
    print("OK errors", flush=True)


def main():
    devs = jax.devices()
    assert len(devs) == 4, f"expected 4 host devices, got {len(devs)} (set XLA_FLAGS before starting)"
    exchanges = sys.argv[1:] or ["padded", "ragged", "gather"]
    if "ragged" in exchanges and jax.default_backend() == "cpu":
        jax.lax.ragged_all_to_all = emulated_ragged_all_to_all
    mesh1 = Mesh(np.array(devs), ("ep",))
    mesh2 = Mesh(np.array(devs).reshape(2, 2), ("dp", "ep"))
    for exchange in exchanges:
        check_case(mesh1, "skewed", 8, 2, exchange)
        check_case(mesh1, "empty_from_rank", 8, 3, exchange)
        check_case(mesh2, "skewed", 4, 2, exchange)
        check_case(mesh1, "in_out_biases", 8, 2, exchange)
        if exchange != "ragged":  # the routing cases; the ragged offsets are checked by the four above
            check_case(mesh1, "stays_local", 8, 2, exchange)
            check_case(mesh1, "k_eq_e", 4, 4, exchange)
            check_case(mesh1, "all_to_one", 4, 2, exchange)
            check_case(mesh1, "expert_bias", 8, 2, exchange)
    check_errors(mesh1)


if __name__ == "__main__":
    main()
