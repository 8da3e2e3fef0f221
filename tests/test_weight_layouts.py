"""Weights stored as other libraries store them: "in_out" (E, in, out) expert weights and interleaved gate/up rows.

The same layer as the default "out_in" [gate; up] layout: every case builds the default layout's inputs, computes
the float64 reference on them, then hands the layer the same weights stored transposed and / or interleaved and
expects the reference's results in that storage (dw13, dw2, db13 permuted and transposed alike). CPU (the
reference path) everywhere; the kernels where a GPU exists.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close, backends, to_numpy
from test_moe import CASES, DTYPES, GRAD_KEYS, TOL, _bytes, _inputs, _on, _reference

from blazecore import BF16, _moe_gpu, moe

# (activation, interleaved, weight layout)
CONFIGS = [
    ("swiglu", True, "out_in"),
    ("swiglu_oai", True, "out_in"),
    ("swiglu_oai", True, "in_out"),  # gpt-oss
    ("swiglu", False, "in_out"),  # Llama 4
    ("geglu", True, "in_out"),
    ("gelu", False, "in_out"),
    ("relu2", False, "in_out"),
]
CONFIG_PARAMS = [pytest.param(c, id=f"{c[0]}{'-il' if c[1] else ''}-{c[2]}") for c in CONFIGS]
LAYOUT_CASES = [pytest.param(c, id=c.name) for c in CASES
                if c.name in ("L63", "odd", "empty_experts", "tiles", "wide_h", "L0")]


def _perm(h: int) -> np.ndarray:
    """Interleaved row r holds row perm[r] of the [gate; up] order."""
    p = np.empty(2 * h, np.int64)
    p[0::2], p[1::2] = np.arange(h), np.arange(h, 2 * h)
    return p


def _store(inp: dict, interleaved: bool, layout: str) -> dict:
    """The default layout's inputs with w13 / b13 interleaved and the weights stored in ``layout``."""
    out = dict(inp)
    w13, b13 = inp["w13"], inp["b13"]
    if interleaved:
        p = _perm(w13.shape[1] // 2)
        w13, b13 = w13[:, p], None if b13 is None else b13[:, p]
    w2 = inp["w2"]
    if layout == "in_out":
        w13, w2 = w13.transpose(0, 2, 1), w2.transpose(0, 2, 1)
    out["w13"], out["w2"] = np.ascontiguousarray(w13), np.ascontiguousarray(w2)
    out["b13"] = None if b13 is None else np.ascontiguousarray(b13)
    return out


def _expected(inp: dict, activation: str, interleaved: bool, layout: str, backend: str):
    y, g = _reference(inp, activation, backend)
    g = dict(g)
    if interleaved:
        p = _perm(inp["w13"].shape[1] // 2)
        g["dw13"] = g["dw13"][:, p]
        if g["db13"] is not None:
            g["db13"] = g["db13"][:, p]
    if layout == "in_out":
        g["dw13"], g["dw2"] = g["dw13"].transpose(0, 2, 1), g["dw2"].transpose(0, 2, 1)
    return y, g


def _run(dev: dict, activation: str, layout: str, checkpoint: str, **kw):
    y, saved = moe.moe_forward(dev["x"], dev["w13"], dev["w2"], dev["gates"], dev["ids"], activation=activation,
                               checkpoint=checkpoint, b13=dev["b13"], b2=dev["b2"], weight_layout=layout, **kw)
    return y, saved, moe.moe_backward(dev["dy"], saved)


@pytest.mark.parametrize("checkpoint", ["ab", "none"])
@pytest.mark.parametrize("config", CONFIG_PARAMS)
@pytest.mark.parametrize("dname", [pytest.param(k, id=k) for k in ("f32", "bf16")])
@pytest.mark.parametrize("case", LAYOUT_CASES)
@pytest.mark.parametrize("backend", backends())
def test_layouts_vs_reference(backend, case, dname, config, checkpoint):
    base, interleaved, layout = config
    inp = _inputs(case, dname, base, True)
    stored = _store(inp, interleaved, layout)
    name = base + ("_interleaved" if interleaved else "")
    y, saved, grads = _run(_on(stored, backend), name, layout, checkpoint)
    y_ref, g_ref = _expected(inp, base, interleaved, layout, backend)
    rtol = TOL[DTYPES[dname]]
    assert_close(y, y_ref, rtol, "y")
    for key in GRAD_KEYS:
        got, want = getattr(grads, key), g_ref[key]
        assert tuple(to_numpy(got).shape) == tuple(want.shape), f"{key}: shape (the weights' stored layout)"
        assert_close(got, want, rtol, key)
    if checkpoint == "ab" and case.L:  # the saved pre-activations' columns follow w13's row order
        z = np.asarray(to_numpy(saved.ab), np.float64)
        assert z.shape == (case.L * case.K, stored["w13"].shape[2 if layout == "in_out" else 1])


@pytest.mark.parametrize("config", [pytest.param(c, id=i.id) for c, i in zip(CONFIGS, CONFIG_PARAMS, strict=True)
                                    if c[1] or c[0] == "swiglu"])
@pytest.mark.parametrize("backend", backends())
def test_layouts_deterministic_and_chunked(backend, config):
    """Twice the same bytes, and 3 chunks give the unchunked run's bytes (both policies)."""
    base, interleaved, layout = config
    case = next(c for c in CASES if c.name == "tiles")
    stored = _store(_inputs(case, "bf16", base, True), interleaved, layout)
    dev = _on(stored, backend)
    name = base + ("_interleaved" if interleaved else "")
    for checkpoint in ("ab", "none"):
        runs = [_run(dev, name, layout, checkpoint, block_tokens=128, chunks=c) for c in (1, 1, 3)]
        for y, _, g in runs[1:]:
            assert _bytes(y) == _bytes(runs[0][0]), f"{checkpoint}: y bits"
            for key in GRAD_KEYS:
                assert _bytes(getattr(g, key)) == _bytes(getattr(runs[0][2], key)), f"{checkpoint}: {key} bits"


@pytest.mark.parametrize("config", [*CONFIG_PARAMS, pytest.param(("swiglu", False, "out_in"), id="swiglu-out_in"),
                                    pytest.param(("gelu", False, "out_in"), id="gelu-out_in")])
@pytest.mark.parametrize("dname", [pytest.param(k, id=k) for k in ("f32", "bf16")])
@pytest.mark.parametrize("backend", backends())
def test_z_sliced_backward(backend, dname, config):
    """Checkpoint "none" with h > d recomputes z and runs the whole backward per column slice of h (GPU:
    _moe_gpu._backward_z_sliced, three slices here), summing dx over the slices in fp32; its forward runs per
    column slice of h as well, summing y in fp32 (_forward_h_sliced). Against the reference; dw13, dw2, db13, db2
    and dgates with the bits of policy "ab" (the same dz, reduced in the same order), y and dx as close to "ab"'s
    as to the reference; bit-identical run to run and with 3 chunks as unchunked."""
    base, interleaved, layout = config
    case = next(c for c in CASES if c.name == "wide_h")
    assert case.h > case.d
    inp = _inputs(case, dname, base, True)
    stored = _store(inp, interleaved, layout)
    dev = _on(stored, backend)
    name = base + ("_interleaved" if interleaved else "")
    rtol = TOL[DTYPES[dname]]
    y_ref, g_ref = _expected(inp, base, interleaved, layout, backend)
    runs = [_run(dev, name, layout, "none", block_tokens=32, chunks=c) for c in (1, 1, 3)]
    y_ab, _, ab = _run(dev, name, layout, "ab", block_tokens=32)
    y, _, g = runs[0]
    assert_close(y, y_ref, rtol, "y")
    assert_close(y, np.asarray(to_numpy(y_ab), np.float64), rtol, "y vs ab")
    for key in GRAD_KEYS:
        assert_close(getattr(g, key), g_ref[key], rtol, key)
        if key == "dx":
            assert_close(g.dx, np.asarray(to_numpy(ab.dx), np.float64), rtol, "dx vs ab")
        else:
            assert _bytes(getattr(g, key)) == _bytes(getattr(ab, key)), f"{key}: bits of policy ab"
    for y2, _, g2 in runs[1:]:
        assert _bytes(y2) == _bytes(y), "y bits"
        for key in GRAD_KEYS:
            assert _bytes(getattr(g2, key)) == _bytes(getattr(g, key)), f"{key} bits (run to run, chunked)"


def test_weight_layout_validation():
    case = next(c for c in CASES if c.name == "L63")
    inp = _inputs(case, "f32", "swiglu", False)
    args = (inp["x"], inp["w13"], inp["w2"], inp["gates"], inp["ids"])
    with pytest.raises(ValueError, match="weight_layout must be one of 'out_in', 'in_out'"):
        moe.moe_forward(*args, weight_layout="transposed")
    # (E, 2h, d) weights read as "in_out" do not fit: the message names the layout and the shapes it read
    with pytest.raises(ValueError, match="weight_layout 'in_out'"):
        moe.moe_forward(*args, weight_layout="in_out")
    with pytest.raises(ValueError, match="unknown activation 'gelu_interleaved'"):
        moe.moe_forward(inp["x"], inp["w13"][:, :case.h], inp["w2"], inp["gates"], inp["ids"],
                        activation="gelu_interleaved")
    assert moe.activation_info("swiglu_oai_interleaved") is True
    assert moe.WEIGHT_LAYOUTS == ("out_in", "in_out")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torch_moe_ffn_in_out_interleaved(device):
    """blazecore_torch.moe_ffn on gpt-oss's storage ((E, in, out), interleaved, biases): the same outputs and, mapped
    back, the same gradients as on the default layout; the gradients land on the stored parameters."""
    torch = pytest.importorskip("torch")
    ops = pytest.importorskip("blazecore_torch.ops")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    case = next(c for c in CASES if c.name == "tiles")
    inp = _inputs(case, "f32", "swiglu_oai", True)
    stored = _store(inp, True, "in_out")
    t = {k: torch.tensor(np.asarray(v), device=device) for k, v in inp.items() if v is not None}
    s = {k: torch.tensor(np.asarray(v), device=device) for k, v in stored.items() if v is not None}
    params = ("w13", "w2", "b13", "b2")
    for d in (t, s):
        for k in ("x", "gates", *params):
            d[k].requires_grad_(True)
    y = ops.moe_ffn(t["x"], t["w13"], t["w2"], t["gates"], t["ids"], activation="swiglu_oai", b13=t["b13"],
                    b2=t["b2"])
    y_s = ops.moe_ffn(s["x"], s["w13"], s["w2"], s["gates"], s["ids"], activation="swiglu_oai_interleaved",
                      b13=s["b13"], b2=s["b2"], weight_layout="in_out")
    (y * t["dy"]).sum().backward()
    (y_s * s["dy"]).sum().backward()
    f = lambda a: a.detach().double().cpu().numpy()  # noqa: E731
    rtol = TOL[DTYPES["f32"]]
    assert_close(f(y_s), f(y), rtol, "y")
    p = _perm(case.h)
    want = {"x": f(t["x"].grad), "gates": f(t["gates"].grad), "w13": f(t["w13"].grad)[:, p].transpose(0, 2, 1),
            "w2": f(t["w2"].grad).transpose(0, 2, 1), "b13": f(t["b13"].grad)[:, p], "b2": f(t["b2"].grad)}
    for k, w in want.items():
        assert s[k].grad.shape == s[k].shape, k
        assert_close(f(s[k].grad), w, rtol, f"d{k}")


@pytest.mark.gpu
@pytest.mark.parametrize("base", ["swiglu", "gelu"])
def test_in_out_sm90_forms_bit_identical_gpu(base, monkeypatch):
    """"in_out" weights on each form of the sm_90a kernels: the weights by TMA or by cp.async (BLAZECORE_SM90_B_LOAD),
    the gathered rows staged in slot order first or not (BLAZECORE_STAGE_ROWS "always" / "never"), dh' with its
    epilogue in the consumers (DHCUR "fused", the form both loads have): every run matches the reference (both
    policies) and has the first run's bits. The default form (dh' on the producer-epilogue kernel, which rounds dh'
    before the activation backward, so its bits may differ from the fused form's) matches the reference and repeats
    its bits. (On other GPUs the mma.sync kernels run, and the runs agree trivially.)"""
    case = next(c for c in CASES if c.name == "tiles")
    inp = _inputs(case, "bf16", base, True)
    stored = _store(inp, False, "in_out")
    dev = _on(stored, "gpu")
    y_ref, g_ref = _expected(inp, base, False, "in_out", "gpu")
    rtol = TOL[DTYPES["bf16"]]

    def run(label, checkpoint):
        y, _, g = _run(dev, base, "in_out", checkpoint)
        assert_close(y, y_ref, rtol, f"{label} {checkpoint} y")
        for key in GRAD_KEYS:
            assert_close(getattr(g, key), g_ref[key], rtol, f"{label} {checkpoint} {key}")
        return y, g

    def same_bits(a, b, label):
        assert _bytes(a[0]) == _bytes(b[0]), f"{label} y bits"
        for key in GRAD_KEYS:
            assert _bytes(getattr(a[1], key)) == _bytes(getattr(b[1], key)), f"{label} {key} bits"

    forms = [("tma", "never"), ("tma", "always"), ("cp_async", "never"), ("cp_async", "always")]
    for checkpoint in ("ab", "none"):
        monkeypatch.setenv("BLAZECORE_SM90_DHCUR", "fused")
        runs = []
        for b_load, stage in forms:
            monkeypatch.setenv("BLAZECORE_SM90_B_LOAD", b_load)
            monkeypatch.setenv("BLAZECORE_STAGE_ROWS", stage)
            runs.append(run(f"{b_load} {stage}", checkpoint))
        for (b_load, stage), r in zip(forms[1:], runs[1:], strict=True):
            same_bits(r, runs[0], f"{b_load} {stage} {checkpoint}")
        for var in ("BLAZECORE_SM90_DHCUR", "BLAZECORE_SM90_B_LOAD", "BLAZECORE_STAGE_ROWS"):
            monkeypatch.delenv(var)
        same_bits(run("default", checkpoint), run("default", checkpoint), f"default {checkpoint} rerun")


@pytest.mark.gpu
@pytest.mark.parametrize("case_name", ["tiles", "wide_h"])
@pytest.mark.parametrize("layout", ["out_in", "in_out"])
@pytest.mark.parametrize("base", ["swiglu", "swiglu_oai", "geglu"])
def test_interleaved_matches_the_gate_up_order_gpu(base, layout, case_name, monkeypatch):
    """Interleaved gate/up rows on each form of the kernels (weights by TMA or by cp.async, the gathered rows staged
    or not, dh' on the producer-epilogue kernel or fused into the GEMM), both policies: the layer matches the
    reference, and on the sm_90a kernels it has the bits of the [gate; up] layer on the same weights in y, dgates,
    dw2, db2 and (permuted back) dw13 and db13: each of those elements is the same sum in the same order. (dx sums
    over z's columns, whose order differs, so only its closeness is asked.)"""
    case = next(c for c in CASES if c.name == case_name)
    inp = _inputs(case, "bf16", base, True)
    rtol = TOL[DTYPES["bf16"]]
    p = _perm(case.h)
    gate_up, inter = _on(_store(inp, False, layout), "gpu"), _on(_store(inp, True, layout), "gpu")
    y_ref, g_ref = _expected(inp, base, True, layout, "gpu")
    axis = 2 if layout == "in_out" else 1  # w13's 2h axis
    sm90 = _moe_gpu._Kernels(BF16, base + "_interleaved", weight_layout=layout).sm90

    def unperm(a, ax):
        return np.ascontiguousarray(np.take(to_numpy(a), p, axis=ax)).tobytes()

    forms = [{}, {"BLAZECORE_SM90_DHCUR": "fused"}, {"BLAZECORE_SM90_B_LOAD": "cp_async"},
             {"BLAZECORE_STAGE_ROWS": "always"}, {"BLAZECORE_STAGE_ROWS": "never"}]
    for checkpoint in ("ab", "none"):
        for env in forms:
            label = f"{checkpoint} {env or 'default'}"
            for k, v in env.items():
                monkeypatch.setenv(k, v)
            y, _, g = _run(inter, base + "_interleaved", layout, checkpoint)
            y_gu, _, g_gu = _run(gate_up, base, layout, checkpoint)
            for k in env:
                monkeypatch.delenv(k)
            assert_close(y, y_ref, rtol, f"{label} y")
            for key in GRAD_KEYS:
                assert_close(getattr(g, key), g_ref[key], rtol, f"{label} {key}")
            if not sm90:
                continue
            assert _bytes(y) == _bytes(y_gu), f"{label} y bits"
            for key in ("dgates", "dw2", "db2"):
                assert _bytes(getattr(g, key)) == _bytes(getattr(g_gu, key)), f"{label} {key} bits"
            assert _bytes(g.dw13) == unperm(g_gu.dw13, axis), f"{label} dw13 bits"
            assert _bytes(g.db13) == unperm(g_gu.db13, 1), f"{label} db13 bits"
            assert_close(g.dx, np.asarray(to_numpy(g_gu.dx), np.float64), rtol, f"{label} dx vs [gate; up]")
