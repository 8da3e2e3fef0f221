"""The PyTorch adapter (adapters/blazecore_torch): custom ops, autograd, torch.compile and MoELayer.

CPU cases run the core's reference path (float64 as well, through the same core functions, for
gradcheck); GPU cases (@pytest.mark.gpu) check the same on CUDA in bf16 and that torch's allocator owns the
memory. The layer is compared with the conventional PyTorch MoE of blazecore_app.baselines on the same weights
and the same routing, computed independently in torch. The transformers backend "blazecore" is compared
with transformers' "eager" experts on tiny random Mixtral, Qwen3-MoE and OLMoE models (skipped without
transformers).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from conftest import assert_close

torch = pytest.importorskip("torch")

_ROOT = pathlib.Path(__file__).resolve().parents[1]
import blazecore_torch  # noqa: E402
from blazecore_app import baselines  # noqa: E402
from blazecore_torch import MoELayer, ops  # noqa: E402

OPS = torch.ops.blazecore
# relative norm error against a float64 computation, per dtype (docs/conventions.md)
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}
GATED = {"swiglu": True, "geglu": True, "gelu": False, "silu": False, "relu2": False}


def _close(actual, expected, dtype, name):
    assert actual.dtype == expected.dtype or dtype == torch.bfloat16, f"{name}: dtype {actual.dtype}"
    assert_close(actual.detach().double().cpu().numpy(), expected.detach().double().cpu().numpy(), TOL[dtype], name)


def _inputs(L, d, h, E, K, dtype, device="cpu", activation="swiglu", bias=False, seed=0, requires_grad=True):
    """x, w13, w2, gates, ids, logits, b13, b2 for one layer call; routing by route_topk on random logits."""
    g = torch.Generator().manual_seed(seed)
    R = 2 * h if GATED[activation] else h

    def rnd(*shape, scale=1.0):
        t = (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)
        return t.requires_grad_(requires_grad)

    x = rnd(L, d)
    w13 = rnd(E, R, d, scale=d ** -0.5)
    w2 = rnd(E, d, h, scale=h ** -0.5)
    logits = rnd(L, E)
    b13 = rnd(E, R, scale=0.1) if bias else None
    b2 = rnd(E, d, scale=0.1) if bias else None
    gates, ids = ops.route_topk(logits.detach(), K)
    gates = gates.detach().requires_grad_(requires_grad)
    return x, w13, w2, gates, ids, logits, b13, b2


def _detached(*args):
    return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)


# ------------------------------------------------------------------------------------------------
# opcheck: schema, autograd registration, fake kernels, AOT dispatch (dynamic shapes)
# ------------------------------------------------------------------------------------------------


def _opcheck_cases(device, dtype):
    """(id, op, args) for every op: forward ops with differentiable inputs, backward ops without."""
    L, d, h, E, K = 13, 16, 8, 6, 2
    cases = []
    for act, bias, ck in (("swiglu", False, "ab"), ("swiglu", True, "none"), ("gelu", True, "ab")):
        x, w13, w2, gates, ids, logits, b13, b2 = _inputs(L, d, h, E, K, dtype, device, act, bias)
        disp = ops.build_dispatch(ids, E)
        fwd = (x, w13, w2, gates, ids, *disp, b13, b2, act, ck)
        if device == "cuda" and ck == "ab":
            # opcheck's AOT check compares the forward's outputs after running the backward: on the GPU the backward
            # writes dz over the returned ab unless retain_saved (the default, ab overwritten, is compiled and
            # checked by test_gpu_compile_fullgraph)
            fwd = (*fwd, 1, True)
        cases.append((f"moe_forward-{act}-bias{int(bias)}-{ck}", OPS.moe_forward, fwd))
        y, ab = OPS.moe_forward(*_detached(*fwd))
        dy = torch.randn_like(y)
        bwd = _detached(dy, x, w13, w2, gates, ids, *disp, ab, b13, b2, act, ck)
        cases.append((f"moe_backward-{act}-bias{int(bias)}-{ck}", OPS.moe_backward, bwd))
    x, w13, w2, gates, ids, logits, b13, b2 = _inputs(L, d, h, E, K, dtype, device)
    gdt = gates.dtype
    bias = torch.linspace(-0.1, 0.1, E, dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                          device=device)
    for score in ("softmax", "sigmoid"):
        cases.append((f"route_topk-{score}", OPS.route_topk, (logits, K, score, True, None)))
        cases.append((f"route_topk_backward-{score}", OPS.route_topk_backward,
                      _detached(torch.randn(L, K, dtype=gdt, device=device), logits, ids, score, score == "softmax")))
    cases.append(("route_topk-bias", OPS.route_topk, (logits, K, "sigmoid", False, bias)))
    cases.append(("build_dispatch", OPS.build_dispatch, (ids, E, True)))
    cases.append(("build_dispatch-int64", OPS.build_dispatch, (ids.long(), E, False)))
    cases.append(("load_balancing_loss", OPS.load_balancing_loss, (logits, ids)))
    cases.append(("router_z_loss", OPS.router_z_loss, (logits,)))
    dloss = torch.tensor(1.5, dtype=gdt, device=device)
    cases.append(("load_balancing_loss_backward", OPS.load_balancing_loss_backward, _detached(dloss, logits, ids)))
    cases.append(("router_z_loss_backward", OPS.router_z_loss_backward, _detached(dloss, logits)))
    return cases


_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _opcheck(name, op, args):
    tests = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if op is OPS.moe_backward and args[1].is_cuda:
        # On the GPU the backward op writes dz over its ab argument (declared mutated). opcheck's AOT check calls
        # the op eagerly and then compiled on the same copy of the inputs, so the compiled call would read dz as
        # ab: it is left out here. The backward op's compiled form is checked inside moe_forward's AOT check
        # (the joint graph) and by the torch.compile tests.
        tests = tests[:3]
    try:
        torch.library.opcheck(op, args, test_utils=tests)
    except Exception as exc:
        raise AssertionError(f"opcheck of case {name}: {exc}") from exc


@pytest.mark.parametrize("dtype", _CPU_DTYPES, ids=str)
def test_opcheck_cpu(dtype):
    for name, op, args in _opcheck_cases("cpu", dtype):
        _opcheck(name, op, args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_opcheck_gpu(dtype):
    for name, op, args in _opcheck_cases("cuda", dtype):
        _opcheck(name, op, args)


# ------------------------------------------------------------------------------------------------
# gradcheck (float64, CPU reference path)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation,bias,checkpoint", [
    ("swiglu", False, "ab"), ("swiglu", True, "none"), ("geglu", True, "ab"), ("gelu", False, "ab"),
    ("relu2", True, "none"),
], ids=lambda v: str(v))
def test_gradcheck_moe_ffn(activation, bias, checkpoint):
    L, d, h, E, K = 7, 5, 3, 4, 2
    x, w13, w2, gates, ids, _, b13, b2 = _inputs(L, d, h, E, K, torch.float64, activation=activation, bias=bias)
    disp = ops.build_dispatch(ids, E)

    def f(x, w13, w2, gates, *b):
        bb = b if bias else (None, None)
        # gradcheck backpropagates through one graph once per output element: the saved pre-activations must
        # survive each backward
        return ops.moe_ffn(x, w13, w2, gates, ids, activation=activation, checkpoint=checkpoint, b13=bb[0],
                           b2=bb[1], dispatch=disp, retain_saved=True)

    args = (x, w13, w2, gates, *((b13, b2) if bias else ()))
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("score,renormalize", [("softmax", True), ("softmax", False), ("sigmoid", True),
                                               ("sigmoid", False)], ids=lambda v: str(v))
def test_gradcheck_router(score, renormalize):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 6, generator=g, dtype=torch.float64).requires_grad_()
    bias = torch.linspace(-0.2, 0.2, 6, dtype=torch.float64)

    def f(logits):
        gates, _ = ops.route_topk(logits, 3, score=score, renormalize=renormalize, expert_bias=bias)
        return gates

    assert torch.autograd.gradcheck(f, (logits,), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_gradcheck_aux_losses():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(9, 6, generator=g, dtype=torch.float64).requires_grad_()
    _, ids = ops.route_topk(logits.detach(), 2)
    assert torch.autograd.gradcheck(lambda t: ops.load_balancing_loss(t, ids), (logits,), eps=1e-6, atol=1e-8)
    assert torch.autograd.gradcheck(ops.router_z_loss, (logits,), eps=1e-6, atol=1e-8)


# ------------------------------------------------------------------------------------------------
# MoELayer against blazecore_app.baselines.conventional_moe
# ------------------------------------------------------------------------------------------------


def _torch_route(logits, K, score, renormalize):
    """Top-k routing written in plain torch: the independent check of the router op."""
    s = torch.softmax(logits.double(), -1) if score == "softmax" else torch.sigmoid(logits.double())
    top, ids = torch.topk(s, K, dim=-1)
    gates = top / top.sum(-1, keepdim=True) if renormalize else top
    return gates.to(torch.float64 if logits.dtype == torch.float64 else torch.float32), ids


def _reference_layer(layer: MoELayer, x, ids=None):
    """y, lb, z of the layer computed with torch ops and conventional_moe, on the layer's own parameters.

    ``ids`` (L, K) imposes a selection (the one a lower-precision run made; selection passes no gradient),
    the gates still come from this computation's logits.
    """
    tokens = x.reshape(-1, layer.hidden_size)
    logits = tokens @ layer.router.weight.T
    gates, own_ids = _torch_route(logits, layer.top_k, layer.score, layer.renormalize)
    if ids is not None:
        s = torch.softmax(logits.double(), -1) if layer.score == "softmax" else torch.sigmoid(logits.double())
        top = s.gather(1, ids.long())
        gates = (top / top.sum(-1, keepdim=True) if layer.renormalize else top).to(gates.dtype)
    else:
        ids = own_ids
    w13, w2 = layer.gate_up_proj, layer.down_proj
    if getattr(layer, "weight_layout", "out_in") == "in_out":  # the reference takes (E, R, d) and (E, d, h)
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    act, b13 = layer.activation, getattr(layer, "gate_up_proj_bias", None)
    if act.endswith("_interleaved"):  # interleaved gate/up rows [g0, u0, g1, u1, ...] -> [gate rows; up rows]
        act = act.removesuffix("_interleaved")
        w13 = torch.cat((w13[:, 0::2], w13[:, 1::2]), 1)
        b13 = None if b13 is None else torch.cat((b13[:, 0::2], b13[:, 1::2]), 1)
    y = baselines.conventional_moe(tokens, w13, w2, gates, ids, activation=act, b13=b13,
                                   b2=getattr(layer, "down_proj_bias", None))
    p = torch.softmax(logits.double(), -1)
    f = torch.bincount(ids.reshape(-1), minlength=layer.num_experts).double() / ids.numel()
    lb = layer.num_experts * (f * p.mean(0)).sum()
    z = (torch.logsumexp(logits.double(), -1) ** 2).mean()
    return y.reshape(x.shape), lb, z


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
@pytest.mark.parametrize("activation,score,renormalize,checkpoint", [
    ("swiglu", "softmax", True, "ab"), ("swiglu", "softmax", False, "none"), ("geglu", "sigmoid", True, "ab"),
    ("gelu", "sigmoid", False, "none"), ("silu", "softmax", True, "ab"),
], ids=lambda v: str(v))
def test_layer_matches_conventional(dtype, activation, score, renormalize, checkpoint):
    torch.manual_seed(0)
    d, h, E, K = 16, 12, 6, 2
    layer = MoELayer(d, h, E, K, activation=activation, score=score, renormalize=renormalize,
                     checkpoint=checkpoint, dtype=dtype)
    x = torch.randn(3, 21, d, dtype=dtype)  # 63 tokens, leading dims
    dy = torch.randn(3, 21, d, dtype=dtype)
    a_lb, a_z = 0.3, 0.05

    def run(fn):
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        y, lb, z = fn(xx)
        ((y * dy).sum() + a_lb * lb + a_z * z).backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        return y.detach(), lb.detach(), z.detach(), xx.grad, grads

    def ours(xx):
        y, aux = layer(xx)
        return y, aux["load_balancing_loss"], aux["z_loss"]

    y, lb, z, dx, grads = run(ours)
    ry, rlb, rz, rdx, rgrads = run(lambda xx: _reference_layer(layer, xx))
    assert y.shape == x.shape and y.dtype == dtype
    _close(y, ry, dtype, "y")
    _close(dx, rdx, dtype, "dx")
    for n in grads:
        _close(grads[n], rgrads[n], dtype, f"d{n}")
    assert_close(lb.double().numpy(), rlb.double().numpy(), TOL[dtype], "load_balancing_loss")
    assert_close(z.double().numpy(), rz.double().numpy(), TOL[dtype], "z_loss")


@pytest.mark.parametrize("activation", ("swiglu", "gelu", "swiglu_interleaved"))
@pytest.mark.parametrize("weight_layout,bias", [("out_in", True), ("in_out", False), ("in_out", True)],
                         ids=lambda v: str(v))
def test_layer_weight_layouts_and_biases(weight_layout, bias, activation):
    """MoELayer with its projections stored "in_out" and / or expert biases: y, dx and every parameter's gradient
    (the biases' included, in the stored layout) against the conventional layer on the same parameters; and the
    same seed gives the same weights in every layout, with or without biases."""
    dtype = torch.float64
    d, h, E, K = 16, 12, 6, 2
    torch.manual_seed(3)
    layer = MoELayer(d, h, E, K, activation=activation, weight_layout=weight_layout, bias=bias, dtype=dtype)
    R = 2 * h if activation != "gelu" else h
    t = weight_layout == "in_out"
    assert layer.gate_up_proj.shape == ((E, d, R) if t else (E, R, d))
    assert layer.down_proj.shape == ((E, h, d) if t else (E, d, h))
    assert (layer.gate_up_proj_bias is not None) == bias and (layer.down_proj_bias is not None) == bias
    if bias:
        assert layer.gate_up_proj_bias.shape == (E, R) and layer.down_proj_bias.shape == (E, d)
    torch.manual_seed(3)
    plain = MoELayer(d, h, E, K, activation=activation, dtype=dtype)
    tr = (lambda w: w.transpose(1, 2)) if t else (lambda w: w)
    assert torch.equal(tr(layer.gate_up_proj), plain.gate_up_proj)
    assert torch.equal(tr(layer.down_proj), plain.down_proj)
    assert torch.equal(layer.router.weight, plain.router.weight)
    x = torch.randn(3, 21, d, dtype=dtype)
    dy = torch.randn(3, 21, d, dtype=dtype)

    def run(fn):
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        y = fn(xx)
        (y * dy).sum().backward()
        return y.detach(), xx.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}

    y, dx, grads = run(lambda xx: layer(xx)[0])
    ry, rdx, rgrads = run(lambda xx: _reference_layer(layer, xx)[0])
    _close(y, ry, dtype, "y")
    _close(dx, rdx, dtype, "dx")
    assert set(grads) == set(rgrads) == {n for n, _ in layer.named_parameters()}
    params = dict(layer.named_parameters())
    for n in grads:
        assert grads[n].shape == params[n].shape, n
        _close(grads[n], rgrads[n], dtype, f"d{n}")
    if bias:  # the biases take part: zeroing them changes y
        with torch.no_grad():
            layer.down_proj_bias.zero_()
        assert not torch.allclose(layer(x)[0], y)


def test_layer_bad_weight_layout():
    with pytest.raises(ValueError, match="weight_layout must be one of"):
        MoELayer(8, 4, 4, 2, weight_layout="transposed")


def test_layer_aux_and_expert_bias():
    torch.manual_seed(0)
    d, h, E, K = 8, 4, 4, 2
    layer = MoELayer(d, h, E, K, expert_bias=True)
    x = torch.randn(32, d)
    _, aux = layer(x)
    counts = aux["tokens_per_expert"]
    assert counts.dtype == torch.int32 and counts.shape == (E,) and int(counts.sum()) == 32 * K
    assert aux["router_logits"].shape == (32, E)
    assert aux["load_balancing_loss"].shape == () and aux["z_loss"].shape == ()
    # a large bias on one expert puts every token on it (selection only; gates still from the logits)
    layer.expert_bias.copy_(torch.tensor([0.0, 0.0, 10.0, 0.0]))
    _, aux = layer(x)
    assert int(aux["tokens_per_expert"][2]) == 32
    before = layer.expert_bias.clone()
    layer.update_expert_bias(aux["tokens_per_expert"], rate=0.5)
    assert layer.expert_bias[2] == before[2] - 0.5 and (layer.expert_bias[[0, 1, 3]] == 0.5).all()
    # .double() converts the buffer; the op casts it back as needed
    _, aux = layer.double()(x.double())
    assert aux["load_balancing_loss"].dtype == torch.float64


def test_layer_bf16_cpu_close_to_fp32():
    torch.manual_seed(0)
    layer = MoELayer(16, 8, 4, 2)
    x = torch.randn(40, 16)
    y32, _ = layer(x)
    layer16 = MoELayer(16, 8, 4, 2, dtype=torch.bfloat16)
    layer16.load_state_dict({k: v.bfloat16() for k, v in layer.state_dict().items()})
    xb = x.bfloat16().requires_grad_()
    y16, aux = layer16(xb)
    y16.float().sum().backward()
    assert y16.dtype == torch.bfloat16 and xb.grad.dtype == torch.bfloat16
    assert aux["load_balancing_loss"].dtype == torch.float32
    # bf16 logits may order near ties differently: the reference takes the bf16 layer's selection
    _, ids = torch.topk(aux["router_logits"].detach().float(), 2, dim=-1)
    ref = MoELayer(16, 8, 4, 2, dtype=torch.float64)
    ref.load_state_dict({k: v.double() for k, v in layer16.state_dict().items()})
    ry, _, _ = _reference_layer(ref, xb.detach().double(), ids)
    assert_close(y16.detach().float().numpy(), ry.detach().numpy(), TOL[torch.bfloat16], "y bf16")
    assert y32.shape == y16.shape


def test_layer_empty_input():
    layer = MoELayer(8, 4, 4, 2)
    x = torch.zeros(0, 8, requires_grad=True)
    y, aux = layer(x)
    y.sum().backward()
    assert y.shape == (0, 8) and x.grad.shape == (0, 8)
    assert (layer.gate_up_proj.grad == 0).all() and (layer.down_proj.grad == 0).all()


def test_layer_training_lowers_loss():
    torch.manual_seed(0)
    d = 16
    layer = MoELayer(d, 32, 8, 2)
    target = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh())
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    x = torch.randn(256, d)
    with torch.no_grad():
        t = target(x)
    losses = []
    for _ in range(60):
        y, aux = layer(x)
        loss = torch.nn.functional.mse_loss(y, t) + 1e-2 * aux["load_balancing_loss"] + 1e-3 * aux["z_loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"


# ------------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True)
# ------------------------------------------------------------------------------------------------


def _inductor_unavailable() -> str | None:
    """Why the CPU inductor backend cannot compile here (no C++ toolchain ...), or None."""
    try:
        torch.compile(lambda t: t * 2 + 1, fullgraph=True)(torch.ones(3))
    except Exception as exc:  # any failure of the toolchain itself, not of blazecore
        return f"torch.compile (inductor, CPU) does not work on this machine: {type(exc).__name__}: {exc}"[:300]
    return None


class _TinyModel(torch.nn.Module):
    def __init__(self, d=16, checkpoint="ab"):
        super().__init__()
        self.inp = torch.nn.Linear(d, d)
        self.moe = MoELayer(d, 16, 4, 2, checkpoint=checkpoint)  # h = 16: the GPU kernels need multiples of 8
        self.out = torch.nn.Linear(d, 1)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        y, aux = self.moe(h)
        return self.out(h + y).pow(2).mean() + 0.01 * aux["load_balancing_loss"] + 0.001 * aux["z_loss"]


@pytest.mark.parametrize("checkpoint", ("ab", "none"))
def test_compile_fullgraph_matches_eager(checkpoint):
    reason = _inductor_unavailable()
    if reason:
        pytest.skip(reason)
    torch.manual_seed(0)
    model = _TinyModel(checkpoint=checkpoint)
    compiled = torch.compile(model, fullgraph=True)
    for L in (24, 37):  # a second size exercises the dynamic-shape path of the fake kernels
        x = torch.randn(L, 16)
        model.zero_grad(set_to_none=True)
        loss = model(x)
        loss.backward()
        eager = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        closs = compiled(x)
        closs.backward()
        assert_close(closs.detach().numpy(), loss.detach().numpy(), 1e-5, "loss")
        for n, p in model.named_parameters():
            assert_close(p.grad.numpy(), eager[n].numpy(), 1e-5, f"grad {n}")


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    L, d, h, E, K = 6, 8, 4, 4, 2
    x, w13, w2, gates, ids, logits, _, _ = _inputs(L, d, h, E, K, torch.float32, requires_grad=False)
    with pytest.raises(ValueError, match="w13"):
        ops.moe_ffn(x, w13[:, :-1].contiguous(), w2, gates, ids)
    with pytest.raises(ValueError, match="in-features"):
        ops.moe_ffn(x[:, :-1].contiguous(), w13, w2, gates, ids)
    with pytest.raises(TypeError, match="w2"):
        ops.moe_ffn(x, w13, w2.double(), gates, ids)
    with pytest.raises(TypeError, match="gates"):
        ops.moe_ffn(x, w13, w2, gates.double(), ids)
    with pytest.raises(TypeError, match="float64"):
        ops.moe_ffn(x.double(), w13, w2, gates, ids)
    with pytest.raises(ValueError, match="gates"):
        ops.moe_ffn(x, w13, w2, gates[:-1], ids)
    with pytest.raises(ValueError, match="one device"):
        ops.moe_ffn(x, w13.to("meta"), w2, gates, ids)
    bad = ids.clone()
    bad[3, 1] = E
    with pytest.raises(ValueError, match=r"expert_ids\[3, 1\] = 4 is outside"):
        ops.moe_ffn(x, w13, w2, gates, bad)
    bad = ids.clone()
    bad[2, 1] = bad[2, 0]
    with pytest.raises(ValueError, match="distinct"):
        ops.build_dispatch(bad, E)
    with pytest.raises(TypeError, match="expert_ids"):
        ops.moe_ffn(x, w13, w2, gates, ids.float())
    with pytest.raises(ValueError, match="unknown activation"):
        ops.moe_ffn(x, w13, w2, gates, ids, activation="tanh")
    with pytest.raises(ValueError, match="checkpoint"):
        ops.moe_ffn(x, w13, w2, gates, ids, checkpoint="all")
    with pytest.raises(ValueError, match="top_k"):
        ops.route_topk(logits, E + 1)
    with pytest.raises(ValueError, match="score"):
        ops.route_topk(logits, K, score="relu")
    with pytest.raises(TypeError, match="logits"):
        ops.route_topk(logits.long(), K)
    with pytest.raises(ValueError, match="expert_bias"):
        ops.route_topk(logits, K, expert_bias=torch.zeros(E + 1))
    layer = MoELayer(d, h, E, K)
    with pytest.raises(ValueError, match="hidden_size"):
        layer(torch.randn(3, d + 1))
    with pytest.raises(TypeError, match="dtype"):
        layer(torch.randn(3, d, dtype=torch.float64))
    with pytest.raises(ValueError, match="activation"):
        MoELayer(d, h, E, K, activation="tanh")
    with pytest.raises(ValueError, match="top_k"):
        MoELayer(d, h, E, E + 1)


def test_second_backward_raises_unless_retain_saved():
    """The backward writes dz over the saved pre-activations (ab declared mutated): a second backward through the
    same graph raises PyTorch's in-place error naming retain_saved; with retain_saved=True both backwards agree."""
    x, w13, w2, gates, ids, _, _, _ = _inputs(9, 8, 4, 4, 2, torch.float32)
    y = ops.moe_ffn(x, w13, w2, gates, ids, checkpoint="ab")
    torch.autograd.grad(y.sum(), (x, w13, w2, gates), retain_graph=True)
    with pytest.raises(RuntimeError, match=r"(?s)modified by an inplace operation.*retain_saved=True"):
        torch.autograd.grad(y.sum(), (x, w13, w2, gates))
    y = ops.moe_ffn(x, w13, w2, gates, ids, checkpoint="ab", retain_saved=True)
    first = torch.autograd.grad(y.sum(), (x, w13, w2, gates), retain_graph=True)
    second = torch.autograd.grad(y.sum(), (x, w13, w2, gates))
    for a, b, n in zip(first, second, ("dx", "dw13", "dw2", "dgates"), strict=True):
        assert torch.equal(a, b), n
    # "none" keeps nothing to overwrite: two backwards work without the option
    y = ops.moe_ffn(x, w13, w2, gates, ids, checkpoint="none")
    first = torch.autograd.grad(y.sum(), (x, w13, w2, gates), retain_graph=True)
    second = torch.autograd.grad(y.sum(), (x, w13, w2, gates))
    for a, b, n in zip(first, second, ("dx", "dw13", "dw2", "dgates"), strict=True):
        assert torch.equal(a, b), n


def test_layer_retain_saved_and_auto_policy():
    """MoELayer passes retain_saved through; checkpoint="auto" runs "ab" where the planner is off (CPU)."""
    torch.manual_seed(0)
    layer = MoELayer(8, 4, 4, 2, chunks="auto", checkpoint="auto", retain_saved=True)
    x = torch.randn(9, 8, requires_grad=True)
    y, _ = layer(x)
    first = torch.autograd.grad(y.sum(), (x, layer.gate_up_proj), retain_graph=True)
    second = torch.autograd.grad(y.sum(), (x, layer.gate_up_proj))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    with pytest.raises(ValueError, match="checkpoint"):
        MoELayer(8, 4, 4, 2, checkpoint="some")


def test_backward_op_checks_saved_preactivations():
    x, w13, w2, gates, ids, _, _, _ = _inputs(9, 8, 4, 4, 2, torch.float32, requires_grad=False)
    disp = ops.build_dispatch(ids, 4)
    y, ab = OPS.moe_forward(x, w13, w2, gates, ids, *disp, None, None, "swiglu", "ab")
    with pytest.raises(ValueError, match="pre-activations"):
        OPS.moe_backward(y, x, w13, w2, gates, ids, *disp, ab[:-1], None, None, "swiglu", "ab")


def test_import_blazecore_imports_no_framework():
    code = "import sys, blazecore; bad = [m for m in ('torch', 'jax', 'cupy') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=_ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("checkpoint", ("ab", "none"))
@pytest.mark.parametrize("storage", [("swiglu", "out_in", False), ("swiglu_interleaved", "in_out", True)],
                         ids=("plain", "gpt_oss"))
def test_layer_gpu_matches_conventional(dtype, checkpoint, storage):
    """MoELayer on CUDA against the float64 conventional layer on the same parameters; "gpt_oss": the projections
    "in_out" with interleaved gate/up rows and expert biases."""
    torch.manual_seed(0)
    d, h, E, K = 128, 256, 8, 2  # row lengths the sm90 / sm80 kernels take (multiples of 8 elements)
    activation, weight_layout, bias = storage
    cfg = {"activation": activation, "weight_layout": weight_layout, "bias": bias}
    layer = MoELayer(d, h, E, K, checkpoint=checkpoint, device="cuda", dtype=dtype, **cfg)
    x = torch.randn(4, 63, d, device="cuda", dtype=dtype)
    dy = torch.randn_like(x)

    def run(fn):
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        y, lb, z = fn(xx)
        ((y.float() * dy.float()).sum() + 0.1 * lb + 0.01 * z).backward()
        return y.detach(), xx.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}

    def ours(xx):
        y, aux = layer(xx)
        return y, aux["load_balancing_loss"], aux["z_loss"]

    y, dx, grads = run(ours)
    _, aux = layer(x)
    # float64 reference on the same parameters, with the selection the layer made (softmax is monotone,
    # so the top-k of the logits is the top-k of the scores)
    _, ids = torch.topk(aux["router_logits"].detach().float(), K, dim=-1)
    layer_ref = MoELayer(d, h, E, K, device="cuda", dtype=torch.float64, **cfg)
    layer_ref.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    xr = x.double().clone().requires_grad_()
    ry, rlb, rz = _reference_layer(layer_ref, xr, ids)
    ((ry * dy.double()).sum() + 0.1 * rlb + 0.01 * rz).backward()
    tol = TOL[dtype] if dtype == torch.bfloat16 else 1e-4
    assert_close(y.double().cpu().numpy(), ry.detach().cpu().numpy(), tol, "y")
    assert_close(dx.double().cpu().numpy(), xr.grad.cpu().numpy(), tol, "dx")
    for n, p in layer_ref.named_parameters():
        assert_close(grads[n].double().cpu().numpy(), p.grad.cpu().numpy(), tol, f"d{n}")


@pytest.mark.gpu
@pytest.mark.parametrize("checkpoint", ("ab", "none"))
def test_gpu_moe_ffn_builds_dispatch_in_forward(checkpoint):
    """Eager moe_ffn on CUDA without a dispatch builds and checks it inside the forward's own core call: y and every
    gradient have the bits of the two-op path (an explicit, validated dispatch); a second backward still raises
    under "ab"; bad ids are a ValueError before anything is returned."""
    L, d, h, E, K = 300, 128, 256, 8, 2
    x, w13, w2, gates, ids, _, b13, b2 = _inputs(L, d, h, E, K, torch.bfloat16, "cuda", bias=True)
    dy = torch.randn(L, d, device="cuda", dtype=torch.bfloat16)
    leaves = (x, w13, w2, gates, b13, b2)
    runs = []
    for disp in (None, ops.build_dispatch(ids, E)):
        y = ops.moe_ffn(x, w13, w2, gates, ids, checkpoint=checkpoint, b13=b13, b2=b2, dispatch=disp)
        runs.append((y.detach(), *torch.autograd.grad(y, leaves, dy, retain_graph=True)))
        if checkpoint == "ab":
            with pytest.raises(RuntimeError, match="retain_saved=True"):
                torch.autograd.grad(y, leaves, dy)
    for a, b, n in zip(*runs, ("y", "dx", "dw13", "dw2", "dgates", "db13", "db2"), strict=True):
        assert torch.equal(a, b), n
    with torch.no_grad():
        assert torch.equal(ops.moe_ffn(x, w13, w2, gates, ids, checkpoint=checkpoint, b13=b13, b2=b2), runs[0][0])
    bad = ids.clone()
    bad[5, 1] = E
    with pytest.raises(ValueError):
        ops.moe_ffn(x, w13, w2, gates, bad, checkpoint=checkpoint)


@pytest.mark.gpu
def test_gpu_memory_is_torch_owned():
    """Outputs and the saved pre-activations come from torch's caching allocator."""
    L, d, h, E, K = 4096, 256, 512, 8, 2
    x, w13, w2, gates, ids, _, _, _ = _inputs(L, d, h, E, K, torch.bfloat16, "cuda")
    disp = ops.build_dispatch(ids, E)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    y = ops.moe_ffn(x, w13, w2, gates, ids, checkpoint="ab", dispatch=disp)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    ab_bytes = L * K * 2 * h * 2
    y_bytes = L * d * 2
    # y and the (L*K, 2h) bf16 pre-activations saved for the backward are torch tensors
    assert held >= ab_bytes + y_bytes, f"held {held} bytes, expected >= {ab_bytes + y_bytes}"
    # transient workspaces (hcur (L*K, h), o (L*K, d)) show in the peak
    assert torch.cuda.max_memory_allocated() - before >= held + L * K * h * 2
    y.float().sum().backward()
    assert x.grad is not None and w13.grad is not None


def _cupy_pool_used() -> int:
    import cupy

    return cupy.get_default_memory_pool().used_bytes()


@pytest.mark.gpu
@pytest.mark.parametrize("checkpoint", ("ab", "none"))
def test_gpu_layer_memory_counted_by_torch(checkpoint):
    """MoELayer forward + backward on CUDA: torch's counters see y, the saved (L*K, 2h) pre-activations (policy
    "ab") and the transients, and CuPy's own pool is never used (torch owns every byte blazecore allocates)."""
    torch.manual_seed(0)
    L, d, h, E, K = 4096, 256, 512, 8, 2
    layer = MoELayer(d, h, E, K, checkpoint=checkpoint, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(L, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    pool_before = _cupy_pool_used()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y, aux = layer(x)
    held = torch.cuda.memory_allocated() - before
    fwd_peak = torch.cuda.max_memory_allocated() - before
    y_bytes, ab_bytes = L * d * 2, (L * K * 2 * h * 2 if checkpoint == "ab" else 0)
    slot_h, slot_d = L * K * h * 2, L * K * d * 2  # bf16 (L*K, h) and (L*K, d) transients of the forward
    assert held >= y_bytes + ab_bytes, f"held {held} B after the forward, expected >= y + ab = {y_bytes + ab_bytes}"
    assert fwd_peak >= held + slot_h, f"forward peak {fwd_peak} B does not show the (L*K, h) transient"
    (y.float().square().sum() + aux["load_balancing_loss"] + aux["z_loss"]).backward()
    torch.cuda.synchronize()
    # the backward's transients are torch allocations too: the per-slot dx rows (L*K, d), and under "none" the
    # recomputed (L*K, 2h) pre-activations (under "ab" dz is written over the saved ones)
    z_bytes = L * K * 2 * h * 2 if checkpoint == "none" else 0
    assert torch.cuda.max_memory_allocated() - before >= held + z_bytes + slot_d
    assert _cupy_pool_used() == pool_before, "blazecore allocated from CuPy's pool, which torch cannot see"
    assert x.grad is not None and layer.gate_up_proj.grad is not None and layer.router.weight.grad is not None


@pytest.mark.gpu
def test_gpu_hf_backend_memory_counted_by_torch():
    """The transformers experts backend on CUDA: the experts' forward raises torch's counters by y and the
    saved pre-activations, and nothing comes from CuPy's pool."""
    transformers = pytest.importorskip("transformers")
    hf = pytest.importorskip("blazecore_torch.hf")
    L, d, h, E, K = 4096, 256, 512, 8, 2
    cfg = transformers.OlmoeConfig(vocab_size=64, hidden_size=d, intermediate_size=h, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4, num_experts=E, num_experts_per_tok=K,
                                   max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg.blazecore_checkpoint = "ab"  # the policy that keeps the pre-activations (the default is "none")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation=hf.BACKEND_NAME)
    model = model.to("cuda", torch.bfloat16)
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "has_gate"))
    hidden = torch.randn(L, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weights, idx = torch.topk(torch.randn(L, E, device="cuda").softmax(-1), K, dim=-1)
    torch.cuda.synchronize()
    pool_before = _cupy_pool_used()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = experts(hidden, idx, weights)
    held = torch.cuda.memory_allocated() - before
    assert y.shape == (L, d) and y.dtype == torch.bfloat16
    ab_bytes, y_bytes = L * K * 2 * h * 2, L * d * 2
    assert held >= ab_bytes + y_bytes, f"held {held} B after the experts' forward, expected >= {ab_bytes + y_bytes}"
    assert torch.cuda.max_memory_allocated() - before >= held + L * K * h * 2
    y.float().sum().backward()
    torch.cuda.synchronize()
    assert _cupy_pool_used() == pool_before, "blazecore allocated from CuPy's pool, which torch cannot see"
    assert hidden.grad is not None and experts.gate_up_proj.grad is not None


@pytest.mark.gpu
def test_gpu_runs_on_current_stream():
    """A layer call on a side stream gives the same result as on the default stream."""
    torch.manual_seed(0)
    layer = MoELayer(128, 256, 8, 2, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(512, 128, device="cuda", dtype=torch.bfloat16)
    y0, _ = layer(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y1, _ = layer(x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(y0, y1)


@pytest.mark.gpu
def test_gpu_stream_wrapper_leaves_the_torch_stream_alone():
    """The CuPy stream made for torch's current stream runs CuPy work there, raises no deprecation warning, and
    leaves the stream to torch: torch keeps using it after the wrapper is collected."""
    import gc
    import warnings

    import cupy

    from blazecore import _array

    side = torch.cuda.Stream()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        s = _array.external_stream(side.cuda_stream, torch.cuda.current_device())
    assert s.ptr == side.cuda_stream
    with s:
        a = cupy.arange(8, dtype=cupy.int32) * 2
    s.synchronize()
    del s
    gc.collect()
    with torch.cuda.stream(side):
        t = torch.ones(1000, device="cuda") * 3
    side.synchronize()
    assert float(t.sum()) == 3000.0 and int(a.sum()) == 56
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    layer = MoELayer(128, 256, 4, 2, device="cuda", dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(x)[0].float().sum().backward()
    assert not [w for w in caught if "ExternalStream" in str(w.message)]


@pytest.mark.gpu
def test_gpu_bad_device_errors():
    x, w13, w2, gates, ids, logits, _, _ = _inputs(8, 128, 256, 4, 2, torch.bfloat16, "cuda", requires_grad=False)
    with pytest.raises(ValueError, match="one device"):
        ops.moe_ffn(x.cpu(), w13, w2, gates, ids)
    with pytest.raises(TypeError, match="float64 not supported on the GPU"):
        ops.route_topk(logits.double(), 2)
    layer = MoELayer(128, 256, 4, 2, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="parameters"):
        layer(x.cpu())


@pytest.mark.gpu
def test_gpu_compile_fullgraph():
    torch.manual_seed(0)
    model = _TinyModel(d=128).cuda()
    x = torch.randn(200, 128, device="cuda")
    loss = model(x)
    loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    closs = torch.compile(model, fullgraph=True)(x)
    closs.backward()
    assert_close(closs.detach().cpu().numpy(), loss.detach().cpu().numpy(), 1e-4, "loss")
    for n, p in model.named_parameters():
        assert_close(p.grad.cpu().numpy(), eager[n].cpu().numpy(), 1e-4, f"grad {n}")


def test_package_exports():
    assert set(blazecore_torch.__all__) >= {"MoELayer", "moe_ffn", "route_topk", "build_dispatch"}


# ------------------------------------------------------------------------------------------------
# transformers experts backend "blazecore" (adapters/blazecore_torch/hf.py)
# ------------------------------------------------------------------------------------------------


def _hf_config(family: str):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, **common)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(moe_intermediate_size=24, intermediate_size=48, num_experts=6,
                                           num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                                           head_dim=8, **common)
    return transformers.OlmoeConfig(intermediate_size=24, num_experts=6, num_experts_per_tok=3, **common)


def _hf_pair(family, dtype, checkpoint=None):
    """(eager model, blazecore model) with the same random weights."""
    import copy

    transformers = pytest.importorskip("transformers")
    hf = pytest.importorskip("blazecore_torch.hf")
    cfg = _hf_config(family)
    if checkpoint is not None:
        cfg.blazecore_checkpoint = checkpoint
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").to(dtype)
    ours = copy.deepcopy(eager)
    ours.set_experts_implementation(hf.BACKEND_NAME)
    assert ours.config._experts_implementation == "blazecore" and eager.config._experts_implementation == "eager"
    return eager, ours


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
@pytest.mark.parametrize("family,checkpoint", [("mixtral", None), ("qwen3_moe", "none"), ("olmoe", "ab")],
                         ids=lambda v: str(v))
def test_hf_backend_matches_eager(family, checkpoint, dtype, monkeypatch):
    eager, ours = _hf_pair(family, dtype, checkpoint)
    calls = []
    real = ops.moe_ffn

    def counting(*args, **kwargs):
        calls.append(kwargs.get("checkpoint"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "moe_ffn", counting)
    tokens = torch.randint(3, 64, (2, 13), generator=torch.Generator().manual_seed(1))
    out_e = eager(tokens, labels=tokens)
    out_b = ours(tokens, labels=tokens)
    out_e.loss.backward()
    out_b.loss.backward()
    # every MoE block ran on blazecore, with the backend's default policy unless the config sets one
    default = pytest.importorskip("blazecore_torch.hf").DEFAULT_CHECKPOINT
    assert calls == [checkpoint or default] * eager.config.num_hidden_layers
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    assert_close(out_b.logits.detach().numpy(), out_e.logits.detach().numpy(), tol, "logits")
    grads_e = dict(eager.named_parameters())
    for n, p in ours.named_parameters():
        if grads_e[n].grad is None:
            assert p.grad is None, n
            continue
        assert_close(p.grad.numpy(), grads_e[n].grad.numpy(), tol, f"grad {n}")


def test_hf_backend_rejects_unsupported_activation():
    transformers = pytest.importorskip("transformers")
    hf = pytest.importorskip("blazecore_torch.hf")
    cfg = _hf_config("mixtral")
    cfg.hidden_act = "relu"
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation=hf.BACKEND_NAME)
    with pytest.raises(NotImplementedError, match="hidden_act 'relu'"):
        model(torch.randint(3, 64, (1, 5)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_eager_calls_equal_the_dispatched_ops(device):
    """In eager mode the public functions run the ops' implementations through one autograd.Function (no
    dispatcher); the same computation through torch.ops.blazecore.* and their registered autograd gives the same
    bits: router, losses, expert FFN, every gradient; and the saved pre-activations' version is bumped alike."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    x, w13, w2, _, _, logits, b13, b2 = _inputs(37, 16, 8, 6, 2, dt, device=device, bias=True)
    logits = logits.detach().float().requires_grad_(True)
    tb = torch.ops.blazecore

    def run(eager):
        inputs = [t.detach().clone().requires_grad_(True) for t in (x, w13, w2, logits, b13, b2)]
        xx, a, b, lg, c13, c2 = inputs
        if eager:
            gates, ids = ops.route_topk(lg, 2)
            disp = ops.build_dispatch(ids, 6, validate=False)
            y = ops.moe_ffn(xx, a, b, gates, ids, b13=c13, b2=c2, dispatch=disp)
            aux = ops.load_balancing_loss(lg, ids) + ops.router_z_loss(lg)
        else:
            gates, ids = tb.route_topk(lg, 2, "softmax", True, None)
            disp = tb.build_dispatch(ids, 6, False)
            y, _ = tb.moe_forward(xx, a, b, gates, ids, *disp, c13, c2, "swiglu", "ab", 1, False)
            aux = tb.load_balancing_loss(lg, ids) + tb.router_z_loss(lg)
        loss = (y.float() * torch.linspace(-1, 1, y.shape[1], device=device)).sum() + aux
        grads = torch.autograd.grad(loss, inputs)
        return [y, gates, ids, aux, *grads]

    names = ("y", "gates", "ids", "aux", "dx", "dw13", "dw2", "dlogits", "db13", "db2")
    for name, a, b in zip(names, run(True), run(False), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("checkpoint", ("ab", "none"))
def test_gpu_moe_ffn_step_captured_in_a_cuda_graph(checkpoint):
    """A whole forward+backward through the public API (dispatch with validate=False, moe_ffn, autograd.grad) captured
    in one torch.cuda.CUDAGraph: nothing in it synchronises with the host, and each replay on new inputs (a new routing
    included) gives the bits of the eager step on the same inputs."""
    L, d, h, E, K = 700, 128, 256, 8, 2
    static = list(_inputs(L, d, h, E, K, torch.bfloat16, "cuda", requires_grad=False, seed=1)[:5])
    static.append(torch.randn(L, d, device="cuda", dtype=torch.bfloat16))  # dy

    def step(x, w13, w2, gates, ids, dy):
        leaves = [t.detach().requires_grad_() for t in (x, w13, w2, gates)]
        disp = ops.build_dispatch(ids, E, validate=False)
        y = ops.moe_ffn(*leaves, ids, checkpoint=checkpoint, dispatch=disp)
        return (y.detach(), *torch.autograd.grad(y, leaves, dy))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up outside the capture (kernels compiled and loaded, allocator pools filled)
            step(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(*static)
    for seed in (2, 3):
        new = list(_inputs(L, d, h, E, K, torch.bfloat16, "cuda", requires_grad=False, seed=seed)[:5])
        new.append(torch.randn(L, d, device="cuda", dtype=torch.bfloat16))
        assert not torch.equal(new[4], static[4])  # the routing changes between replays
        for s, n in zip(static, new, strict=True):
            s.copy_(n)
        graph.replay()
        want = step(*new)
        torch.cuda.synchronize()
        for a, b, name in zip(outs, want, ("y", "dx", "dw13", "dw2", "dgates"), strict=True):
            assert torch.equal(a, b), name
