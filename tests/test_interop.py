"""The core API called with torch tensors and JAX arrays on the CPU (blazecore._array.like_caller).

Every public function returns the caller's array type (the same values as with NumPy inputs, dtypes included),
an ``out=`` buffer comes back as the caller's own object, and a torch tensor that requires grad or a JAX tracer
is a one-line TypeError saying what to pass.
"""

from __future__ import annotations

import numpy as np
import pytest

import blazecore
from blazecore import BF16

L, d, h, E, K = 5, 8, 4, 4, 2


def _host(dtype=np.float32):
    r = np.random.default_rng(0)
    g = r.random((L, K)) + 0.1
    return {
        "x": r.standard_normal((L, d)).astype(dtype),
        "w13": r.standard_normal((E, 2 * h, d)).astype(dtype),
        "w2": r.standard_normal((E, d, h)).astype(dtype),
        "gates": (g / g.sum(axis=1, keepdims=True)).astype(np.float32),
        "ids": np.array([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]], np.int32),
        "dy": r.standard_normal((L, d)).astype(dtype),
        "logits": r.standard_normal((L, E)).astype(dtype),
    }


def _torch_in(a):
    torch = pytest.importorskip("torch")
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _jax_in(a):
    jnp = pytest.importorskip("jax.numpy")
    return jnp.asarray(a)


def _np(a):
    if type(a).__module__.split(".")[0] == "torch":
        import torch

        return a.view(torch.uint16).numpy().view(BF16) if a.dtype == torch.bfloat16 else a.numpy()
    return np.asarray(a)


def _calls(a):
    """name -> result of every public function on the arrays ``a``."""
    disp = blazecore.build_dispatch(a["ids"], E)
    y, saved = blazecore.moe_forward(a["x"], a["w13"], a["w2"], a["gates"], a["ids"], dispatch=disp)
    grads = blazecore.moe_backward(a["dy"], saved)
    gates, ids = blazecore.route_topk(a["logits"], K)
    out = {
        "dispatch.slot_token": disp.slot_token, "dispatch.pair_slot": disp.pair_slot, "y": y,
        "dx": grads.dx, "dw13": grads.dw13, "dw2": grads.dw2, "dgates": grads.dgates, "gates": gates, "ids": ids,
        "route_topk_backward": blazecore.route_topk_backward(a["gates"], a["logits"], ids),
        "load_balancing_loss": blazecore.load_balancing_loss(a["logits"], ids),
        "load_balancing_loss_backward": blazecore.load_balancing_loss_backward(1.0, a["logits"], ids),
        "router_z_loss": blazecore.router_z_loss(a["logits"]),
        "router_z_loss_backward": blazecore.router_z_loss_backward(1.0, a["logits"]),
    }
    return out


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_results_are_the_callers_type(framework, dtype):
    host = _host(dtype)
    to = _torch_in if framework == "torch" else _jax_in
    got = _calls({k: to(v) for k, v in host.items()})
    want = _calls(host)
    for name, w in want.items():
        g = got[name]
        assert type(g).__module__.split(".")[0] in (("torch",) if framework == "torch" else ("jax", "jaxlib")), name
        gn = _np(g)
        assert gn.dtype == w.dtype and gn.shape == w.shape, (name, gn.dtype, w.dtype)
        assert gn.tobytes() == np.ascontiguousarray(w).tobytes(), name


def test_out_buffer_is_returned_as_given():
    torch = pytest.importorskip("torch")
    host = _host()
    t = {k: torch.from_numpy(v) for k, v in host.items()}
    out = torch.empty(L, d)
    y, _ = blazecore.moe_forward(t["x"], t["w13"], t["w2"], t["gates"], t["ids"], out=out)
    assert y is out


def test_requires_grad_is_one_clear_line():
    torch = pytest.importorskip("torch")
    host = _host()
    t = {k: torch.from_numpy(v) for k, v in host.items()}
    x = t["x"].clone().requires_grad_()
    with pytest.raises(TypeError, match=r"^x: a torch tensor that requires grad .* pass x\.detach\(\)") as e:
        blazecore.moe_forward(x, t["w13"], t["w2"], t["gates"], t["ids"])
    assert "\n" not in str(e.value)
    with pytest.raises(TypeError, match=r"^logits: a torch tensor that requires grad"):
        blazecore.router_z_loss(t["logits"].clone().requires_grad_())
    y, _ = blazecore.moe_forward(x.detach(), t["w13"], t["w2"], t["gates"], t["ids"])  # what the message says
    assert isinstance(y, torch.Tensor)


def test_jax_tracer_is_one_clear_line():
    jax = pytest.importorskip("jax")
    logits = jax.numpy.asarray(_host()["logits"])
    with pytest.raises(TypeError, match=r"^logits: a JAX tracer .* pass a concrete array"):
        jax.jit(lambda v: blazecore.router_z_loss(v))(logits)


class _Wrapped:
    """Not an array to DLPack: only an intake hook can read it."""

    def __init__(self, a):
        self.a = a


def test_intake_hook_is_offered_first_and_may_decline():
    from blazecore import _array

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    seen = []

    def hook(obj):
        seen.append(type(obj).__name__)
        return obj.a if isinstance(obj, _Wrapped) else None

    with _array.intake(hook):
        assert blazecore.asarray(_Wrapped(a)) is a
        assert blazecore.asarray(a) is a  # NumPy arrays never reach the hook
        with pytest.raises(TypeError, match="expected a DLPack array"):
            blazecore.asarray(object())  # declined: the usual path and its error
    assert seen == ["_Wrapped", "object"]
    with pytest.raises(TypeError, match="expected a DLPack array"):
        blazecore.asarray(_Wrapped(a))  # outside the block: no hook
    with pytest.raises(TypeError, match="intake: expected a callable"):
        with _array.intake(42):
            pass


def test_an_allocators_own_view_is_taken_as_is_and_may_decline():
    """An allocator carrying ``blazecore_view`` (an adapter's) has its view of each allocation used as the kernels'
    buffer, unchecked; a view it declines (None) takes the checked path, whose errors still stand."""
    from blazecore import _array

    made, viewed = [], []

    def alloc(shape, dtype_name):
        a = np.zeros(shape, dtype_name)
        made.append(a)
        return a

    def view(a):
        viewed.append(a)
        return None if a.size == 0 else a[...]

    alloc.blazecore_view = view
    with _array.allocator(alloc):
        out = _array.empty_gpu((3, 4), np.float32)
        assert out.user is made[0] and out.view.base is made[0] and viewed == [made[0]]
        empty = _array.empty_gpu((0, 4), np.float32)  # declined: the checked path views it
        assert empty.view.shape == (0, 4) and viewed[-1] is made[-1]
    bad = lambda shape, dtype_name: np.zeros((1,), dtype_name)  # noqa: E731
    bad.blazecore_view = lambda a: None
    with _array.allocator(bad), pytest.raises(RuntimeError, match="allocator returned"):
        _array.empty_gpu((3, 4), np.float32)


@pytest.mark.gpu
def test_torch_cuda_views_equal_dlpack_views():
    """The torch adapter's direct CuPy views (no DLPack) of contiguous, strided, transposed, offset and bf16
    tensors read the same elements as DLPack's; tensors it does not take fall back (None)."""
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from blazecore_torch.ops import _cuda_view

    base = torch.randn(7, 12, device="cuda")
    cases = {"contiguous": base, "transposed": base.t(), "strided": base[1::2, ::3], "offset": base[3:, 5:],
             "bf16": base.bfloat16()[:, 2:], "bf16 contiguous": base.bfloat16(),
             "3-d": torch.randn(2, 3, 4, device="cuda"),
             "int32": torch.arange(10, device="cuda", dtype=torch.int32)[::2],
             "int64": torch.arange(10, device="cuda")}
    for name, t in cases.items():
        v = _cuda_view(t)
        assert v is not None, name
        want = cupy.asnumpy(blazecore.asarray(t.contiguous()))  # bf16 may come back as bf16 or its uint16 bits
        got = cupy.asnumpy(v)
        assert got.shape == want.shape and got.dtype.itemsize == want.dtype.itemsize, name
        assert got.tobytes() == want.tobytes(), name
        assert v.data.ptr == t.data_ptr(), name
    for t in (base.requires_grad_(), torch.empty(0, 3, device="cuda"), torch.randn(3),
              torch.randn(3, dtype=torch.complex64, device="cuda")):
        assert _cuda_view(t) is None


def _fake_cupy(stream_cls, external):
    from types import SimpleNamespace

    return SimpleNamespace(cuda=SimpleNamespace(Stream=stream_cls, ExternalStream=external))


def test_external_stream_goes_through_the_stream_protocol(monkeypatch):
    """Where CuPy has Stream.from_external, a foreign handle is wrapped through ``__cuda_stream__`` (version 0, the
    handle), never through the deprecated ExternalStream."""
    from blazecore import _array

    seen = []

    class Stream:
        @classmethod
        def from_external(cls, obj):
            seen.append(obj.__cuda_stream__())
            return ("wrapped", obj)

    def external(*args):
        raise AssertionError(f"ExternalStream{args} called where Stream.from_external exists")

    monkeypatch.setattr(_array, "_cupy", lambda: _fake_cupy(Stream, external))
    assert _array.external_stream(1234, 0)[0] == "wrapped"
    assert _array.current_stream(5678)[0] == "wrapped"  # a raw handle given to the core
    assert seen == [(0, 1234), (0, 5678)]


def test_external_stream_falls_back_to_external_stream(monkeypatch):
    """An older CuPy (no Stream.from_external) gets ExternalStream, with the device where one is named."""
    from blazecore import _array

    calls = []

    class Stream:
        pass

    monkeypatch.setattr(_array, "_cupy", lambda: _fake_cupy(Stream, lambda *a: calls.append(a) or "external"))
    assert _array.external_stream(77, 1) == "external"
    assert _array.external_stream(78) == "external"
    assert calls == [(77, 1), (78,)]
