"""The PyTorch baselines (blazecore_app.baselines) against a float64 NumPy loop: y and every gradient.

CPU only (the benchmarks run them on the GPU). The conventional baseline runs in float64, float32 and
bf16; the torch._grouped_mm one in float32 and bf16 (its kernels take no float64), where this torch
build supports it.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from conftest import assert_close, make_routing

torch = pytest.importorskip("torch")

from blazecore_app import baselines  # noqa: E402

# Relative norm error against the float64 reference, per dtype (docs/conventions.md).
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2}


# ------------------------------------------------------------------------------------------------
# Reference: the obvious loop, written independently of the baselines.
# ------------------------------------------------------------------------------------------------


def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def moe_loop_ref(x, w13, w2, gates, expert_ids, dy):
    """float64 loop over (token, k): returns y, dx, dw13, dw2, dgates."""
    x, w13, w2, gates, dy = (np.asarray(v, dtype=np.float64) for v in (x, w13, w2, gates, dy))
    L, d = x.shape
    E, two_h, _ = w13.shape
    h = two_h // 2
    K = expert_ids.shape[1]
    y = np.zeros((L, d))
    dx = np.zeros((L, d))
    dw13 = np.zeros((E, two_h, d))
    dw2 = np.zeros((E, d, h))
    dgates = np.zeros((L, K))
    for t in range(L):
        for k in range(K):
            e = int(expert_ids[t, k])
            g = gates[t, k]
            w1, w3 = w13[e, :h], w13[e, h:]
            a, b = w1 @ x[t], w3 @ x[t]
            s = _sigmoid(a)
            act = a * s
            hcur = act * b
            o = w2[e] @ hcur
            y[t] += g * o
            dgates[t, k] = dy[t] @ o
            dhcur = g * (w2[e].T @ dy[t])
            dw2[e] += g * np.outer(dy[t], hcur)
            da = dhcur * b * (s + a * s * (1.0 - s))
            db = dhcur * act
            dw13[e, :h] += np.outer(da, x[t])
            dw13[e, h:] += np.outer(db, x[t])
            dx[t] += w1.T @ da + w3.T @ db
    return y, dx, dw13, dw2, dgates


# ------------------------------------------------------------------------------------------------
# Routings
# ------------------------------------------------------------------------------------------------


def _topk_ids(rng, L, E, K):
    """Distinct experts per token, as a top-k router gives."""
    return make_routing(rng, L, E, K, "uniform", dtype=np.int64)


def _case(name, rng):
    """(L, d, h, E, K, expert_ids) for a named routing; d and h are multiples of 8 (grouped_mm strides)."""
    if name == "ragged":
        L, d, h, E, K = 13, 8, 24, 5, 2
        ids = _topk_ids(rng, L, E, K)
    elif name == "ragged_63":
        L, d, h, E, K = 63, 16, 8, 7, 3
        ids = _topk_ids(rng, L, E, K)
    elif name == "empty_experts":
        L, d, h, E, K = 9, 8, 8, 6, 2
        ids = np.where(rng.random((L, 1)) < 0.5, [[1, 4]], [[4, 1]])  # experts 0, 2, 3, 5 get nothing
    elif name == "one_expert":
        L, d, h, E, K = 11, 8, 8, 4, 1
        ids = np.full((L, K), 2)
    elif name == "k_equals_e":
        L, d, h, E, K = 6, 8, 8, 3, 3
        ids = _topk_ids(rng, L, E, K)
    elif name == "single_token":
        L, d, h, E, K = 1, 8, 8, 4, 2
        ids = _topk_ids(rng, L, E, K)
    elif name == "zero_tokens":
        L, d, h, E, K = 0, 8, 8, 4, 2
        ids = np.zeros((0, K), dtype=np.int64)
    else:
        raise KeyError(name)
    return L, d, h, E, K, ids


CASES = ["ragged", "ragged_63", "empty_experts", "one_expert", "k_equals_e", "single_token", "zero_tokens"]


def _problem(name, seed=0):
    rng = np.random.default_rng(seed)
    L, d, h, E, K, ids = _case(name, rng)
    x = rng.standard_normal((L, d))
    w13 = rng.standard_normal((E, 2 * h, d)) / np.sqrt(d)
    w2 = rng.standard_normal((E, d, h)) / np.sqrt(h)
    logits = rng.standard_normal((L, K))
    gates = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True) if L else np.zeros((0, K))
    dy = rng.standard_normal((L, d))
    return x, w13, w2, gates, np.asarray(ids, dtype=np.int64), dy


def _run(fn, x, w13, w2, gates, ids, dy, dtype, ids_dtype=torch.int64):
    """Torch leaves in ``dtype`` (gates float32, or float64 for a float64 run); returns y and grads as float64."""
    leaves = [torch.tensor(v, dtype=dtype, requires_grad=True) for v in (x, w13, w2)]
    gdtype = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.tensor(gates, dtype=gdtype, requires_grad=True)
    y = fn(*leaves, g, torch.tensor(ids, dtype=ids_dtype))
    assert y.shape == (x.shape[0], x.shape[1]) and y.dtype == dtype
    grads = torch.autograd.grad(y, (*leaves, g), torch.tensor(dy, dtype=dtype))
    assert grads[3].dtype == gdtype
    return [t.detach().to(torch.float64).numpy() for t in (y, *grads)]


def _rounded(dtype, *arrays):
    """The float64 values the ``dtype`` inputs actually hold (so the reference sees the same inputs)."""
    return [torch.tensor(a, dtype=dtype).to(torch.float64).numpy() for a in arrays]


NAMES = ("y", "dx", "dw13", "dw2", "dgates")


def _check(fn, case, dtype, ids_dtype=torch.int64):
    x, w13, w2, gates, ids, dy = _problem(case)
    xr, w13r, w2r, dyr = _rounded(dtype, x, w13, w2, dy)
    gr = gates if dtype == torch.float64 else _rounded(torch.float32, gates)[0]
    got = _run(fn, x, w13, w2, gates, ids, dy, dtype, ids_dtype)
    want = moe_loop_ref(xr, w13r, w2r, gr, ids, dyr)
    for name, a, e in zip(NAMES, got, want, strict=True):
        assert_close(a, e, TOL[dtype], f"{fn.__name__} {case} {dtype} {name}")


DTYPE_IDS = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16"}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", CASES)
def test_conventional(case, dtype):
    _check(baselines.conventional_moe, case, dtype)


def _require_grouped_mm(dtype):
    probe = torch.zeros(1, 8, dtype=dtype)
    reason = baselines.grouped_mm_unsupported(
        probe, torch.zeros(1, 16, 8, dtype=dtype), torch.zeros(1, 8, 8, dtype=dtype)
    )
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", CASES)
def test_grouped_mm(case, dtype):
    _require_grouped_mm(dtype)
    _check(baselines.grouped_mm_moe, case, dtype)


@pytest.mark.parametrize("fn", ["conventional_moe", "grouped_mm_moe"])
def test_int32_expert_ids(fn):
    if fn == "grouped_mm_moe":
        _require_grouped_mm(torch.float32)
    _check(getattr(baselines, fn), "ragged_63", torch.float32, ids_dtype=torch.int32)


def test_baselines_agree_fp32():
    """Both baselines on the same inputs give the same y and gradients."""
    _require_grouped_mm(torch.float32)
    x, w13, w2, gates, ids, dy = _problem("ragged_63", seed=3)
    a = _run(baselines.conventional_moe, x, w13, w2, gates, ids, dy, torch.float32)
    b = _run(baselines.grouped_mm_moe, x, w13, w2, gates, ids, dy, torch.float32)
    for name, u, v in zip(NAMES, a, b, strict=True):
        assert_close(u, v, 1e-5, f"conventional vs grouped_mm {name}")


def test_empty_expert_weight_grads_are_zero():
    x, w13, w2, gates, ids, dy = _problem("empty_experts")
    _, _, dw13, dw2, _ = _run(baselines.conventional_moe, x, w13, w2, gates, ids, dy, torch.float64)
    idle = [0, 2, 3, 5]
    assert not dw13[idle].any() and not dw2[idle].any()
    assert dw13[[1, 4]].any() and dw2[[1, 4]].any()


def test_grouped_mm_rejects_float64():
    t = torch.zeros(2, 8, dtype=torch.float64)
    with pytest.raises(baselines.BaselineUnavailable):
        baselines.grouped_mm_moe(
            t,
            torch.zeros(2, 16, 8, dtype=torch.float64),
            torch.zeros(2, 8, 8, dtype=torch.float64),
            torch.ones(2, 1, dtype=torch.float64),
            torch.zeros(2, 1, dtype=torch.int64),
        )


def test_grouped_mm_rejects_unaligned_width():
    """d = 6 in float32 is a 24-byte row stride: torch._grouped_mm needs multiples of 16 bytes."""
    t = torch.zeros(2, 6)
    reason = baselines.grouped_mm_unsupported(t, torch.zeros(2, 16, 6), torch.zeros(2, 6, 8))
    assert reason is not None and "multiples of 4" in reason
    with pytest.raises(baselines.BaselineUnavailable, match="multiples"):
        baselines.grouped_mm_moe(
            t, torch.zeros(2, 16, 6), torch.zeros(2, 6, 8), torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int64)
        )


def test_supports_activation():
    assert all(baselines.supports_activation(a) for a in baselines.ACTIVATIONS)
    assert baselines.supports_activation("swiglu_oai_interleaved")
    assert baselines.supports_activation("geglu_interleaved")
    assert not baselines.supports_activation("gelu_interleaved") and not baselines.supports_activation("tanh")
    with pytest.raises(ValueError, match="not supported by the baselines"):
        baselines.BaselineMoELayer(8, 4, 4, 2, activation="relu2_interleaved")


def test_bad_arguments():
    x, w13, w2 = torch.zeros(3, 8), torch.zeros(2, 16, 8), torch.zeros(2, 8, 8)
    g, ids = torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="activation"):
        baselines.conventional_moe(x, w13, w2, g, ids, activation="relu")
    with pytest.raises(ValueError, match="w13"):  # w2's h = 4 disagrees with w13's 2h = 16
        baselines.conventional_moe(x, w13, torch.zeros(2, 8, 4), g, ids)
    with pytest.raises(ValueError, match="w2"):
        baselines.conventional_moe(x, w13, torch.zeros(2, 6, 8), g, ids)
    with pytest.raises(ValueError, match="gates"):
        baselines.conventional_moe(x, w13, w2, torch.ones(3, 1), ids)
    with pytest.raises(TypeError, match="integer"):
        baselines.conventional_moe(x, w13, w2, g, ids.float())


# ------------------------------------------------------------------------------------------------
# Every activation and the biases, against blazecore's own NumPy reference (when it is present).
# ------------------------------------------------------------------------------------------------


def _moe_ref_module():
    mod = pytest.importorskip("blazecore.reference.moe")
    if not all(hasattr(mod, n) for n in ("moe_forward_ref", "moe_backward_ref")):
        pytest.skip("blazecore.reference.moe has no moe_forward_ref / moe_backward_ref yet")
    return mod


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("activation", [*baselines.ACTIVATIONS, "swiglu_interleaved", "swiglu_oai_interleaved"])
@pytest.mark.parametrize(
    "fn, dtype",
    [("conventional_moe", torch.float64), ("grouped_mm_moe", torch.float32)],
    ids=["conventional-fp64", "grouped_mm-fp32"],
)
def test_activations_and_biases(fn, dtype, activation, bias):
    ref = _moe_ref_module()
    if fn == "grouped_mm_moe":
        _require_grouped_mm(dtype)
    rng = np.random.default_rng(7)
    L, d, h, E, K = 29, 16, 8, 5, 2
    R = 2 * h if activation.startswith(("swiglu", "geglu")) else h
    ids = _topk_ids(rng, L, E, K)
    x, dy = rng.standard_normal((L, d)), rng.standard_normal((L, d))
    # (swiglu_oai: pre-activations of spread 4, so that its clamps at +-7 are reached)
    w13 = rng.standard_normal((E, R, d)) / np.sqrt(d) * (4.0 if "oai" in activation else 1.0)
    w2 = rng.standard_normal((E, d, h)) / np.sqrt(h)
    gates = rng.random((L, K))
    b13 = rng.standard_normal((E, R)) if bias else None
    b2 = rng.standard_normal((E, d)) if bias else None

    gdtype = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = {n: torch.tensor(v, dtype=dtype, requires_grad=True) for n, v in [("x", x), ("w13", w13), ("w2", w2)]}
    leaves["gates"] = torch.tensor(gates, dtype=gdtype, requires_grad=True)
    if bias:
        leaves["b13"] = torch.tensor(b13, dtype=dtype, requires_grad=True)
        leaves["b2"] = torch.tensor(b2, dtype=dtype, requires_grad=True)
    y = getattr(baselines, fn)(
        leaves["x"],
        leaves["w13"],
        leaves["w2"],
        leaves["gates"],
        torch.tensor(ids),
        activation=activation,
        b13=leaves.get("b13"),
        b2=leaves.get("b2"),
    )
    grads = dict(
        zip(leaves, torch.autograd.grad(y, tuple(leaves.values()), torch.tensor(dy, dtype=dtype)), strict=True)
    )

    # The reference sees the values the torch inputs hold.
    held = {n: t.detach().to(torch.float64).numpy() for n, t in leaves.items()}
    dyr = torch.tensor(dy, dtype=dtype).to(torch.float64).numpy()
    args = (held["x"], held["w13"], held["w2"], held["gates"], ids, activation)
    kw = {"b13": held.get("b13"), "b2": held.get("b2")}
    want_y = ref.moe_forward_ref(*args, **kw)
    want = ref.moe_backward_ref(dyr, *args, **kw)
    tol = TOL[dtype]
    tag = f"{fn} {activation} bias={bias}"
    assert_close(y.detach().to(torch.float64).numpy(), want_y, tol, f"{tag} y")
    for name, g in grads.items():
        key = "d" + name
        assert_close(g.to(torch.float64).numpy(), want[key], tol, f"{tag} {key}")


# ------------------------------------------------------------------------------------------------
# The benchmark script's flow, on the CPU with a tiny shape (its GPU figures need the GPU machine).
# ------------------------------------------------------------------------------------------------


def _load_bench(monkeypatch, name):
    return importlib.import_module(f"blazecore_app.bench.{name}")


def test_bench_helpers(monkeypatch):
    common = _load_bench(monkeypatch, "_common")
    assert [common.parse_count(t) for t in ("8k", "128K", "1m", "300")] == [8192, 131072, 1 << 20, 300]
    assert common.format_count(32768) == "32k" and common.format_count(300) == "300"
    assert common.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert common.tflops(18e12, 1000.0) == pytest.approx(18.0) and common.tflops(1.0, None) is None
    table = common.format_table([{"a": "x", "b": 1.5}, {"a": "yy", "b": None}], [("A", "a", None), ("B", "b", ".2f")])
    assert table.splitlines()[2].split() == ["x", "1.50"] and table.splitlines()[3].split() == ["yy", "-"]
    args = common.probe_args("A probe.\n\nMore.", ["--tokens", "2k,1m", "--shape", "fine"], shape="olmoe",
                             tokens="32k", repeats=7)
    assert (args.shape, args.token_counts, args.repeats, args.json) == ("fine", [2048, 1 << 20], 7, None)
    common.write_probe_json(args, [{"a": 1}])  # no --json: nothing written, no GPU header asked for
    args = common.probe_args("A probe.", ["--interleaved"], shape="olmoe", tokens="32k", repeats=7,
                             extra=(("--interleaved", {"action": "store_true"}), ("--activation", {"default": "gelu"})))
    assert (args.interleaved, args.activation, args.token_counts) == (True, "gelu", [32768])
    with pytest.raises(SystemExit):
        common.probe_args("A probe.", ["--tokens", "2q"], shape="olmoe", tokens="32k", repeats=7)


def test_bench_timer(monkeypatch):
    """bench/_common.py's one timer: warm-up calls untimed, repeats interleaved, inner calls averaged, a spread."""
    common = _load_bench(monkeypatch, "_common")
    calls = []
    t = common.time_calls({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, warmup=2, repeats=3,
                          clock="wall", inner=2, setup=lambda: calls.append("setup"))
    assert calls == ["setup", "a", "a", "setup", "b", "b"] * 5
    assert set(t) == {"a", "b"} and len(t["a"].samples_ms) == 3
    timing = common.Timing.of([3.0, 1.0, 2.0, 10.0, 2.0])
    assert timing.median_ms == 2.0 and timing.min_ms == 1.0 and timing.max_ms == 10.0
    assert timing.spread_ms == pytest.approx(1.0)  # quartiles 2 and 3
    assert common.wall_time(lambda: None, repeats=4).as_dict()["samples_ms"].__len__() == 4
    with pytest.raises(ValueError, match="clock"):
        common.time_call(lambda: None, clock="tsc")


def test_bench_moe_cpu_smoke(monkeypatch, tmp_path, capsys):
    import json

    bench = _load_bench(monkeypatch, "bench_moe")
    argv = ["--device", "cpu", "--shape", "tiny=32,16,6,2", "--tokens", "40,64", "--check-tokens", "24"]
    argv += ["--repeats", "2", "--warmup", "1", "--checkpoint", "ab", "--results-dir", str(tmp_path)]
    assert bench.main(argv) == 0
    doc = json.loads((tmp_path / "moe_cpu.json").read_text())
    assert doc["header"]["device"] == "cpu" and doc["header"]["git_commit"]
    rows = {(r["tokens"], r["impl_key"]): r for r in doc["rows"]}
    assert set(rows) == {(L, k) for L in (40, 64) for k in ("blazecore[ab]", "moe_ffn[ab]", "conventional",
                                                            "grouped_mm")}
    for L in (40, 64):
        conv = rows[(L, "conventional")]
        assert conv["status"] == "ok" and conv["check_ok"] is True and conv["fwd_bwd_ms"] > 0
        assert conv["flops"] == 18 * L * 2 * 32 * 16
        gmm = rows[(L, "grouped_mm")]
        if gmm["status"] == "ok":
            assert gmm["speedup_vs_grouped_mm"] == pytest.approx(1.0)
            assert conv["speedup_vs_grouped_mm"] == pytest.approx(gmm["fwd_bwd_ms"] / conv["fwd_bwd_ms"])
        assert rows[(L, "blazecore[ab]")]["status"] in ("ok", "unavailable", "error")
        ffn = rows[(L, "moe_ffn[ab]")]  # the public adapter, checked against the float32 reference like the rest
        assert ffn["status"] == "ok" and ffn["check_ok"] is True, ffn.get("message")
    assert "## all rows" in capsys.readouterr().out


def test_bench_hf_cpu_smoke_gpt_oss_storage(monkeypatch, tmp_path):
    """bench_hf's flow on the CPU (float32) with gpt-oss's expert storage ((E, in, out), interleaved gate/up columns,
    biases): every implementation trains from the same weights and the blazecore ones pass the loss checks."""
    import json

    pytest.importorskip("transformers")
    bench = _load_bench(monkeypatch, "bench_hf")
    argv = ["--device", "cpu", "--families", "tiny_gpt_oss", "--steps", "2", "--impls", "blazecore,grouped_mm",
            "--results-dir", str(tmp_path)]
    assert bench.main(argv) == 0
    rows = {r["impl"]: r for r in json.loads(next(tmp_path.glob("hf_*.json")).read_text())["rows"]}
    assert set(rows) == {"blazecore", "grouped_mm"}
    assert all(r["family"] == "tiny_gpt_oss" and len(r["losses"]) == 2 for r in rows.values()), rows


def test_bench_moe_without_gpu_exits_cleanly(monkeypatch, capsys):
    bench = _load_bench(monkeypatch, "bench_moe")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert bench.main(["--quick"]) == 0
    assert "no GPU" in capsys.readouterr().out
