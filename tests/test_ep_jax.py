"""Expert parallelism in JAX (blazecore_jax.parallel): shard_map over a mesh axis of experts.

The CPU checks run tests/_ep_jax_worker.py in a subprocess with 4 host devices
(``--xla_force_host_platform_device_count=4`` must be set before JAX starts): ep_moe_layer under jit and grad
equals the single-device moe_layer (output and every gradient) on 1-D and 2-D meshes, for skewed routings,
gpt-oss's storage ("in_out" projections, interleaved rows, expert biases), an
expert that gets nothing from some device, a device that sends nothing away, everything on one expert and
K == E; bad input raises before anything runs. XLA:CPU has no ragged-all-to-all, so the CPU runs the padded and
gather exchanges, and the ragged one over an emulation of ragged_all_to_all (its offsets checked); the GPU case runs
the three exchanges on a one-device mesh.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ep_on_four_host_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "adapters"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_ep_jax_worker.py"), "padded", "ragged", "gather"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    done = [line for line in proc.stdout.splitlines() if line.startswith("OK ")]
    assert len(done) == 21, proc.stdout
    assert sum("ragged" in line for line in done) == 4 and sum("gather" in line for line in done) == 8, proc.stdout


def _check_matches_moe_layer(devices, exchange: str, L: int) -> None:
    """ep_moe_layer over an ("ep",) mesh of ``devices`` against moe_layer, float32: y and every gradient."""
    import jax.numpy as jnp
    from blazecore_jax import init_moe_params, moe_layer
    from blazecore_jax.parallel import ep_moe_layer
    from jax.sharding import Mesh

    d, h, E, K = 128, 64, 8, 2
    params = init_moe_params(jax.random.key(0), d, h, E)
    x = jax.random.normal(jax.random.key(1), (L, d), jnp.float32)
    dy = jax.random.normal(jax.random.key(2), (L, d), jnp.float32)
    mesh = Mesh(np.array(devices), ("ep",))

    def run(fn):
        def loss(p, xx):
            y, _ = fn(p, xx)
            return jnp.sum(y * dy), y

        (_, y), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
        return {"y": y, "dx": g[1], **{f"d {k}": v for k, v in g[0].items()}}

    want = run(lambda p, xx: moe_layer(p, xx, top_k=K))
    got = run(lambda p, xx: ep_moe_layer(p, xx, mesh=mesh, top_k=K, exchange=exchange))
    for name, w in want.items():
        a, b = np.asarray(got[name], np.float64), np.asarray(w, np.float64)
        err = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert err < 1e-5, f"{name} over {len(devices)} device(s): relative norm error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("exchange", ["ragged", "padded", "gather"])
def test_ep_one_gpu_matches_moe_layer(exchange):
    """A one-device ("ep",) mesh on the GPU: both exchanges (ragged_all_to_all runs only on GPUs) against moe_layer,
    float32, output and every gradient."""
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    _check_matches_moe_layer(jax.devices()[:1], exchange, 300)


@pytest.mark.gpu
@pytest.mark.parametrize("exchange", ["ragged", "padded", "gather"])
def test_ep_all_gpus_matches_moe_layer(exchange):
    """With 2 or more GPUs: the experts over all of them (up to 8), both exchanges, float32, against moe_layer."""
    if jax.default_backend() != "gpu" or len(jax.devices()) < 2:
        pytest.skip("needs JAX with 2 or more GPUs")
    n = min(8, 1 << (len(jax.devices()).bit_length() - 1))
    _check_matches_moe_layer(jax.devices()[:n], exchange, 96 * n)


def test_bench_ep_jax_without_a_gpu(capsys):
    """bench/bench_ep_jax.py: without a CUDA GPU it says so, times nothing and exits 0; its table reads the rows."""
    from bench import bench_ep_jax, report

    if bench_ep_jax.common.cuda_gpu_available()[0]:
        pytest.skip("a GPU is present: the benchmark would run")
    assert bench_ep_jax.main([]) == 0
    assert "nothing to time" in capsys.readouterr().out
    row = {"shape": "olmoe", "tokens_per_gpu": 8192, "gpus": 2, "exchange": "padded", "ep_ms": 10.0, "one_ms": 4.0,
           "per_gpu_rate": 0.4, "routed_rows_per_gpu": 65000, "buffer_rows_per_gpu": 131072}
    # a gather row as files before the field followed the exchange recorded it: the table shows its N * L tokens
    gather = dict(row, exchange="gather", ep_ms=5.0, per_gpu_rate=0.8)
    doc = {"header": {"gpu": "G", "date": "2026-01-01T00:00:00", "git_commit": "c", "gpus": 2, "jax": "0"},
           "rows": [row, gather]}
    lines = [ln for ln in report.ep_jax_table(doc).splitlines() if ln.startswith("| olmoe")]
    assert lines == ["| olmoe | 8k | 2 | padded | 10.00 | 4.00 | 0.40 | 65000 | 131072 |",
                     "| olmoe | 8k | 2 | gather | 5.00 | 4.00 | 0.80 | 65000 | 16384 |"]
    assert [bench_ep_jax.buffer_rows(x, 2, 8192, 8) for x in ("padded", "ragged", "gather")] == [131072, 131072, 16384]
