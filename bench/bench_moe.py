"""Benchmark of the MoE layer: blazecore (checkpoint "ab" and "none") against the PyTorch baselines.

For each shape (d, h, E, K) and token count L, in bf16 with a fixed random routing (softmax over E of
random logits, top-k, renormalised), every implementation gets the same inputs and reports:

* fwd+bwd ms: forward + backward of the layer given the routing (CUDA events, warm-up, median of the
  repeats); blazecore's dispatch build and the baselines' argsort are part of the forward;
* fwd ms (training forward: autograd graph / saved tensors built) and bwd ms = fwd+bwd - fwd;
* effective TFLOP/s = 18 L K d h / time (fwd 6 L K d h, bwd 12 L K d h);
* held bytes: torch.cuda.memory_allocated after the forward minus before it, less y's bytes (what is
  kept for the backward). blazecore runs with torch as its allocator, so torch sees all its memory;
* peak bytes: torch.cuda.max_memory_allocated over forward + backward minus the memory allocated
  before the forward (inputs, weights), so gradients and transients count;
* speedup vs grouped_mm (and vs conventional in the JSON), only where the shape's correctness spot
  check passed for both.

Before timing a shape, a spot check on a small problem compares y and every gradient of each
implementation (and blazecore against grouped_mm) with a float32 evaluation of the conventional
baseline; relative norm error must stay under --check-tol (2e-2).

Rows that cannot be measured record a status instead: "oom", "unavailable" (blazecore's GPU path or
torch._grouped_mm missing), "error" (with the message). Results: bench/results/<name>_<gpu-slug>.json,
rewritten after every (shape, tokens) group, so an interrupted run keeps what it measured. With
--largest, the JSON's "largest" holds each implementation's largest fitting memory row and "stopped" the
row (status "oom") of the token count where it no longer fitted; ``python -m blazecore bench`` runs one
shape this way (--kind moe_scaling) and plots both (bench/plot.py).

Usage (from the repository root):
    python -m bench.bench_moe                         # all shapes, 8k/32k/128k tokens
    python -m bench.bench_moe --quick                 # all shapes at 8k tokens
    python -m bench.bench_moe --shapes fine --tokens 24k --checkpoint ab --impls blazecore,grouped_mm
    python -m bench.bench_moe --shapes olmoe --largest   # also find the largest L that fits, per impl
"""

from __future__ import annotations

import argparse
import gc
import sys
import traceback

try:
    from . import _common as common
except ImportError:  # run as a script: python bench/bench_moe.py
    import _common as common

SHAPES = {
    # name: (d, h, E, K)
    "olmoe": (2048, 1024, 64, 8),
    "qwen3": (2048, 768, 128, 8),
    "mixtral": (4096, 14336, 8, 2),
    "fine": (1536, 256, 128, 8),
}
DEFAULT_TOKENS = ("8k", "32k", "128k")
IMPLS = ("blazecore", "moe_ffn", "conventional", "grouped_mm")
POLICIES = ("ab", "none")
ACTIVATION = "swiglu"
# "cuda" for measurements; "cpu" (--device cpu) runs the whole flow as a smoke test of this script:
# wall-clock timings, no memory figures.
DEVICE = "cuda"


def _import_baselines():
    from blazecore_app import baselines

    return baselines


# ------------------------------------------------------------------------------------------------
# Implementations under test: forward -> (y, state), backward -> (dx, dw13, dw2, dgates)
# ------------------------------------------------------------------------------------------------


class Unavailable(RuntimeError):
    """The implementation cannot run here (missing code path or unsupported by this torch build)."""


class Problem:
    """One set of inputs shared by every implementation: bf16 leaves with requires_grad for the
    baselines, detached views of the same storage for blazecore (DLPack refuses tensors that require
    grad)."""

    def __init__(self, x, w13, w2, gates, expert_ids, dy):
        self.x, self.w13, self.w2, self.gates, self.expert_ids, self.dy = x, w13, w2, gates, expert_ids, dy
        self.leaves = (x, w13, w2, gates)
        self.detached = tuple(t.detach() for t in self.leaves)


class TorchImpl:
    def __init__(self, key, fn, unsupported=None):
        self.key, self.name, self.checkpoint = key, key, None
        self._fn, self._unsupported = fn, unsupported

    def availability(self, p):
        if self._unsupported is not None:
            reason = self._unsupported(p.x, p.w13, p.w2)
            if reason:
                return reason
        return None

    def forward(self, p):
        return self._fn(*p.leaves, p.expert_ids, activation=ACTIVATION), None

    def backward(self, p, y, state):
        import torch

        return torch.autograd.grad(y, p.leaves, p.dy)


class MissingImpl:
    """Stands in for an implementation that cannot be loaded: its rows say why."""

    def __init__(self, key, name, checkpoint):
        self.key, self.name, self.checkpoint = key, name, checkpoint


class BlazeImpl:
    def __init__(self, bc, policy):
        self.key, self.name, self.checkpoint = f"blazecore[{policy}]", "blazecore", policy
        self._bc, self._policy = bc, policy

    def availability(self, p):
        return None

    @staticmethod
    def _alloc(shape, dtype_name):
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype_name), device=DEVICE)

    @staticmethod
    def _stream():
        import torch

        return torch.cuda.current_stream().cuda_stream if DEVICE == "cuda" else None

    def _call(self, fn, *args, **kwargs):
        try:
            with self._bc.allocator(self._alloc):
                return fn(*args, stream=self._stream(), **kwargs)
        except NotImplementedError as exc:
            raise Unavailable(f"blazecore: {exc or 'not implemented'}") from exc

    def forward(self, p):
        x, w13, w2, gates = p.detached
        y, saved = self._call(
            self._bc.moe.moe_forward, x, w13, w2, gates, p.expert_ids, activation=ACTIVATION, checkpoint=self._policy
        )
        return _to_torch(y), saved

    def backward(self, p, y, saved):
        g = self._call(self._bc.moe.moe_backward, p.dy, saved)
        return tuple(_to_torch(getattr(g, n)) for n in ("dx", "dw13", "dw2", "dgates"))


class AdapterImpl:
    """blazecore as users call it: ``blazecore_torch.moe_ffn`` with autograd (the dispatch built inside)."""

    def __init__(self, ops, policy):
        self.key, self.name, self.checkpoint = f"moe_ffn[{policy}]", "moe_ffn", policy
        self._ops, self._policy = ops, policy

    def availability(self, p):
        return None

    def forward(self, p):
        return self._ops.moe_ffn(*p.leaves, p.expert_ids, activation=ACTIVATION, checkpoint=self._policy), None

    def backward(self, p, y, state):
        import torch

        return torch.autograd.grad(y, p.leaves, p.dy)


def _to_torch(a):
    """A blazecore output as a torch tensor (zero-copy): torch already, cupy, or numpy (CPU path)."""
    import numpy as np
    import torch

    if a is None or isinstance(a, torch.Tensor):
        return a
    if isinstance(a, np.ndarray):
        if a.dtype.name == "bfloat16":  # ml_dtypes bf16, which DLPack cannot name: pass the bits
            return torch.from_numpy(np.ascontiguousarray(a).view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(a))
    t = torch.from_dlpack(a)
    return t.view(torch.bfloat16) if t.dtype == torch.uint16 else t  # cupy holds bf16 as uint16


def load_blazecore():
    """(blazecore module, "") when it imports, else (None, why not)."""
    try:
        import blazecore
    except Exception as exc:
        return None, f"import blazecore failed: {type(exc).__name__}: {exc}"
    return blazecore, ""


def build_impls(args, baselines):
    """[(impl or None, unavailable reason)] in the order requested."""
    out = []
    for name in args.impls:
        if name == "blazecore":
            bc, reason = load_blazecore()
            for policy in args.policies:
                if bc is None:
                    out.append((MissingImpl(f"blazecore[{policy}]", "blazecore", policy), reason))
                else:
                    out.append((BlazeImpl(bc, policy), None))
        elif name == "moe_ffn":
            try:
                from blazecore_torch import ops
            except Exception as exc:  # the rows say why
                ops, reason = None, f"import blazecore_torch failed: {type(exc).__name__}: {exc}"
            for policy in args.policies:
                if ops is None:
                    out.append((MissingImpl(f"moe_ffn[{policy}]", "moe_ffn", policy), reason))
                else:
                    out.append((AdapterImpl(ops, policy), None))
        elif name == "conventional":
            out.append((TorchImpl("conventional", baselines.conventional_moe), None))
        elif name == "grouped_mm":
            out.append((TorchImpl("grouped_mm", baselines.grouped_mm_moe, baselines.grouped_mm_unsupported), None))
    return out


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


def make_weights(d, h, E, seed):
    import torch

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w13 = torch.randn(E, 2 * h, d, device=DEVICE, dtype=torch.bfloat16, generator=gen).mul_(d**-0.5)
    w2 = torch.randn(E, d, h, device=DEVICE, dtype=torch.bfloat16, generator=gen).mul_(h**-0.5)
    return w13.requires_grad_(), w2.requires_grad_()


def make_routing(L, E, K, seed):
    """Softmax over E of N(0, 1) logits, top-k, renormalised: gates (L, K) float32, ids (L, K) int32."""
    import torch

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = torch.randn(L, E, device=DEVICE, dtype=torch.float32, generator=gen)
    vals, ids = torch.topk(torch.softmax(logits, dim=-1), K, dim=-1)
    del logits
    gates = (vals / vals.sum(dim=-1, keepdim=True)).contiguous()
    return gates, ids.to(torch.int32).contiguous()


def make_problem(weights, L, E, K, seed):
    import torch

    w13, w2 = weights
    d = w13.shape[2]
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    x = torch.randn(L, d, device=DEVICE, dtype=torch.bfloat16, generator=gen).requires_grad_()
    dy = torch.randn(L, d, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    gates, ids = make_routing(L, E, K, seed + 2)
    return Problem(x, w13, w2, gates.requires_grad_(), ids, dy)


# ------------------------------------------------------------------------------------------------
# Measurement
# ------------------------------------------------------------------------------------------------


def _classify(exc, baselines):
    """(status, message) for an exception raised while running an implementation."""
    if common.is_oom(exc):
        return "oom", str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory"
    if isinstance(exc, (Unavailable, baselines.BaselineUnavailable)):
        return "unavailable", str(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return "error", " ".join(f"{type(exc).__name__}: {exc}{where}".split())


def _cleanup():
    import torch

    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _time(fn, args):
    if DEVICE == "cuda":
        return common.cuda_time(fn, warmup=args.warmup, repeats=args.repeats)
    return common.wall_time(fn, warmup=args.warmup, repeats=args.repeats)


def _cupy_pool_used():
    """Bytes in use in CuPy's default pool (memory torch does not see), or None without cupy."""
    if "cupy" not in sys.modules:
        return None
    try:
        return sys.modules["cupy"].get_default_memory_pool().used_bytes()
    except Exception:
        return None


def measure_memory(impl, p):
    """held_bytes, peak_bytes of one forward + backward, with two cross-checks: cupy_pool_held_bytes
    (memory blazecore took from CuPy's pool, which torch cannot see; should be 0) and
    saved_held_bytes (blazecore's own count of what its saved record keeps)."""
    import torch

    if DEVICE != "cuda":
        y, state = impl.forward(p)
        impl.backward(p, y, state)
        return {"held_bytes": None, "peak_bytes": None, "cupy_pool_held_bytes": None, "saved_held_bytes": None,
                "grad_bytes": None, "peak_beyond_grads_bytes": None}
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    cupy_base = _cupy_pool_used()
    torch.cuda.reset_peak_memory_stats()
    y, state = impl.forward(p)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base - y.numel() * y.element_size()
    cupy_now = _cupy_pool_used()
    saved_held = state.held_bytes() if hasattr(state, "held_bytes") else None
    grads = impl.backward(p, y, state)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    grad_bytes = sum(g.numel() * g.element_size() for g in grads if g is not None)
    del y, state, grads
    return {
        "held_bytes": held,
        "peak_bytes": peak,
        "grad_bytes": grad_bytes,  # the returned dx, dw13, dw2, dgates
        "peak_beyond_grads_bytes": peak - grad_bytes,
        "cupy_pool_held_bytes": None if cupy_base is None or cupy_now is None else cupy_now - cupy_base,
        "saved_held_bytes": saved_held,
    }


def _fwd_bwd(impl, p):
    """One forward + backward of ``impl`` on problem ``p``, as a callable."""

    def fn():
        y, state = impl.forward(p)
        impl.backward(p, y, state)

    return fn


def measure(impl, p, flops, args):
    """One row's figures: timings, TFLOP/s, held and peak bytes."""
    fwd_bwd = _fwd_bwd(impl, p)

    def fwd():
        impl.forward(p)

    fb = _time(fwd_bwd, args)
    f = _time(fwd, args)
    mem = measure_memory(impl, p)
    bwd_ms = fb.median_ms - f.median_ms
    return {
        **mem,
        "status": "ok",
        "fwd_bwd_ms": fb.median_ms,
        "fwd_ms": f.median_ms,
        "fwd_bwd_spread_ms": fb.spread_ms,  # interquartile range of the timed samples
        "bwd_ms": bwd_ms,
        "fwd_bwd_tflops": common.tflops(flops, fb.median_ms),
        "fwd_tflops": common.tflops(flops / 3, f.median_ms),
        "bwd_tflops": common.tflops(2 * flops / 3, bwd_ms),
        "fwd_bwd_samples_ms": fb.samples_ms,
        "fwd_samples_ms": f.samples_ms,
    }


def rel_err(a, ref) -> float:
    """||a - ref|| / ||ref|| in float64, in slices so a (E, 2h, d) gradient never needs 3 float64 copies."""
    a2, r2 = a.detach().reshape(a.shape[0], -1), ref.detach().reshape(ref.shape[0], -1)
    if a2.shape != r2.shape:
        return float("inf")
    num = den = 0.0
    step = max(1, (1 << 24) // max(1, a2.shape[1]))
    for i in range(0, a2.shape[0], step):
        x, r = a2[i : i + step].double(), r2[i : i + step].double()
        num += float((x - r).square().sum())
        den += float(r.square().sum())
    return (num**0.5) / (den**0.5 if den > 0 else 1.0)


OUTPUT_NAMES = ("y", "dx", "dw13", "dw2", "dgates")


def _outputs(impl, p):
    y, state = impl.forward(p)
    grads = impl.backward(p, y, state)
    del state
    return (y.detach(), *(g.detach() for g in grads))


def spot_check(impls, weights, shape, args, baselines):
    """Per impl key: {"status", "ok", "errors" (vs the float32 reference), "vs_grouped_mm", "message"}."""
    import torch

    d, h, E, K = shape
    try:
        p = make_problem(weights, args.check_tokens, E, K, args.seed + 100)
        leaves32 = [t.detach().float().requires_grad_() for t in (p.x, p.w13, p.w2, p.gates)]
        y_ref = baselines.conventional_moe(*leaves32, p.expert_ids, activation=ACTIVATION)
        ref = (y_ref.detach(), *torch.autograd.grad(y_ref, leaves32, p.dy.float()))
        del y_ref, leaves32
    except Exception as exc:  # no reference, no verdict: every row is timed, no speedup is reported
        status, message = _classify(exc, baselines)
        _cleanup()
        text = f"the float32 reference failed ({status}: {message})"
        return {
            impl.key: {"status": "ok", "ok": False, "errors": None, "vs_grouped_mm": None, "message": text}
            for impl, _ in impls
        }

    results, outs = {}, {}
    for impl, reason in impls:
        res = {"status": "ok", "ok": False, "errors": None, "vs_grouped_mm": None, "message": None}
        if reason is None:
            reason = impl.availability(p)
        if reason is not None:
            res.update(status="unavailable", message=reason)
            results[impl.key] = res
            continue
        try:
            outs[impl.key] = _outputs(impl, p)
        except Exception as exc:
            status, message = _classify(exc, baselines)
            res.update(status=status, message=message)
            results[impl.key] = res
            continue
        errs = {n: rel_err(o, r) for n, o, r in zip(OUTPUT_NAMES, outs[impl.key], ref, strict=True)}
        res["errors"] = errs
        res["ok"] = all(e < args.check_tol for e in errs.values())
        results[impl.key] = res
    gmm = outs.get("grouped_mm")
    for key, o in outs.items():
        if key.startswith("blazecore") and gmm is not None:
            vs = {n: rel_err(a, b) for n, a, b in zip(OUTPUT_NAMES, o, gmm, strict=True)}
            results[key]["vs_grouped_mm"] = vs
            results[key]["ok"] = results[key]["ok"] and all(e < args.check_tol for e in vs.values())
    for res in results.values():
        if res["status"] == "ok" and not res["ok"]:
            bad = [
                f"{prefix}{n} {e:.2e}"
                for prefix, part in (("", res["errors"] or {}), ("vs grouped_mm ", res["vs_grouped_mm"] or {}))
                for n, e in part.items()
                if not e < args.check_tol
            ]
            res["message"] = "spot check failed (rel. norm error): " + ", ".join(bad)
    del outs, ref, p
    _cleanup()
    return results


def _speedups(group):
    by_key = {r["impl_key"]: r for r in group}

    def usable(r):
        return r is not None and r["status"] == "ok" and r.get("check_ok") is True

    for r in group:
        for base_key, field in (("grouped_mm", "speedup_vs_grouped_mm"), ("conventional", "speedup_vs_conventional")):
            base = by_key.get(base_key)
            r[field] = base["fwd_bwd_ms"] / r["fwd_bwd_ms"] if usable(r) and usable(base) else None
        base = by_key.get("grouped_mm")
        ok = usable(r) and usable(base) and r.get("peak_beyond_grads_bytes") and base.get("peak_beyond_grads_bytes")
        # peak minus the returned gradients, as a share of grouped_mm's
        r["peak_beyond_grads_vs_grouped_mm"] = (r["peak_beyond_grads_bytes"] / base["peak_beyond_grads_bytes"]
                                                if ok else None)


def _base_row(shape_name, shape, L, impl, args):
    d, h, E, K = shape
    return {
        "shape": shape_name,
        "d": d,
        "h": h,
        "E": E,
        "K": K,
        "tokens": L,
        "impl": impl.name,
        "impl_key": impl.key,
        "checkpoint": impl.checkpoint,
        "dtype": "bfloat16",
        "activation": ACTIVATION,
        "routing": f"softmax-topk-renorm seed={args.seed}",
        "flops": 18 * L * K * d * h,
        "repeats": args.repeats,
        "warmup": args.warmup,
    }


def run_group(shape_name, shape, L, impls, checks, weights, args, baselines):
    """Rows for one (shape, tokens): every implementation on the same inputs."""
    d, h, E, K = shape
    rows = [_base_row(shape_name, shape, L, impl, args) for impl, _ in impls]
    try:
        p = make_problem(weights, L, E, K, args.seed)
    except Exception as exc:
        status, message = _classify(exc, baselines)
        for r in rows:
            r.update(status=status, message=f"making the inputs: {message}", check_ok=None)
        _cleanup()
        return rows
    for row, (impl, _) in zip(rows, impls, strict=True):
        chk = checks[impl.key]
        row["check_ok"] = chk["ok"] if chk["status"] == "ok" else None
        row["check"] = chk
        if chk["status"] in ("unavailable", "error"):
            row.update(status=chk["status"], message=chk["message"])
            continue
        try:
            row.update(measure(impl, p, row["flops"], args))
            if not chk["ok"]:
                row["message"] = chk["message"]
        except Exception as exc:
            status, message = _classify(exc, baselines)
            row.update(status=status, message=message)
        _cleanup()
    _adapter_over_core(rows, impls, p, args)
    del p
    _cleanup()
    _speedups(rows)
    return rows


def _adapter_over_core(rows, impls, p, args):
    """Per policy with both rows measured: the PyTorch adapter's forward+backward time over the core's, timed in
    alternation (core, adapter, core, ... in one sequence, at least 20 samples each), so the machine's drift between
    two blocks of repeats does not enter the ratio. Recorded on the moe_ffn row: adapter_over_core and the two
    medians of that paired sequence."""
    by_key = {impl.key: (impl, row) for (impl, _), row in zip(impls, rows, strict=True)}
    for policy in POLICIES:
        core, adapter = by_key.get(f"blazecore[{policy}]"), by_key.get(f"moe_ffn[{policy}]")
        if core is None or adapter is None or core[1].get("status") != "ok" or adapter[1].get("status") != "ok":
            continue

        try:
            t = common.time_calls({"core": _fwd_bwd(core[0], p), "adapter": _fwd_bwd(adapter[0], p)},
                                  warmup=args.warmup, repeats=max(args.repeats, 20),
                                  clock="torch" if DEVICE == "cuda" else "wall")
        except Exception as exc:  # the rows keep their own figures; only the paired ratio is missing
            adapter[1]["adapter_over_core_message"] = f"{type(exc).__name__}: {exc}"
            _cleanup()
            continue
        c, a = t["core"], t["adapter"]
        adapter[1].update(paired_core_fwd_bwd_ms=c.median_ms, paired_adapter_fwd_bwd_ms=a.median_ms,
                          adapter_over_core=a.median_ms / c.median_ms, paired_core_samples_ms=c.samples_ms,
                          paired_adapter_samples_ms=a.samples_ms)
        _cleanup()


def find_largest(shape_name, shape, impls, grid_rows, weights, args, baselines):
    """Per implementation, the largest L (doubling from the largest --tokens) at which one forward +
    backward still fits: ``(largest, stopped)``. ``largest[key]`` is its memory row, or None when even the
    largest --tokens did not fit; ``stopped`` lists a row (status "oom" or "error") for each implementation
    at the L where it failed, or at the first L whose inputs did not fit. Below --largest-cap an
    implementation that never fails has no row in ``stopped``."""
    d, h, E, K = shape
    start = max(args.tokens)
    largest = {impl.key: None for impl, _ in impls}
    stopped = []
    alive = []
    for impl, _ in impls:
        row = next((r for r in grid_rows if r["impl_key"] == impl.key and r["tokens"] == start), None)
        if row is not None and row["status"] == "ok":
            largest[impl.key] = row
            alive.append(impl)
    L = 2 * start
    while alive and L <= args.largest_cap:
        try:
            p = make_problem(weights, L, E, K, args.seed)
        except Exception as exc:
            if not common.is_oom(exc):
                raise
            for impl in alive:
                stopped.append({**_base_row(shape_name, shape, L, impl, args), "status": "oom",
                                "message": "the inputs do not fit"})
            break
        for impl in list(alive):
            row = _base_row(shape_name, shape, L, impl, args)
            try:
                row.update(status="ok", **measure_memory(impl, p))
                largest[impl.key] = row
            except Exception as exc:
                status, message = _classify(exc, baselines)
                if status != "oom":
                    print(f"  {impl.key} at L={L}: {status}: {message}", flush=True)
                stopped.append({**row, "status": status, "message": message})
                alive.remove(impl)
            _cleanup()
        del p
        _cleanup()
        L *= 2
    return largest, stopped


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------


def _note(r):
    if r["status"] != "ok":
        text = f"{r['status'].upper()}: {r.get('message') or ''}"
    elif r.get("check_ok") is False:
        text = "CHECK FAILED, no speedup: " + (r.get("message") or "")
    else:
        return ""
    text = " ".join(text.split())
    return text if len(text) <= 100 else text[:97] + "..."


def _mib(key):
    return lambda r: None if r.get(key) is None else r[key] / common.MIB


TABLE = [
    ("shape", "shape", None),
    ("tokens", lambda r: common.format_count(r["tokens"]), None),
    ("impl", "impl_key", None),
    ("fwd+bwd ms", "fwd_bwd_ms", ".3f"),
    ("fwd ms", "fwd_ms", ".3f"),
    ("bwd ms", "bwd_ms", ".3f"),
    ("TFLOP/s", "fwd_bwd_tflops", ".1f"),
    ("held MiB", _mib("held_bytes"), ".0f"),
    ("peak MiB", _mib("peak_bytes"), ".0f"),
    ("peak-grads MiB", _mib("peak_beyond_grads_bytes"), ".0f"),
    ("% of gmm", lambda r: None if r.get("peak_beyond_grads_vs_grouped_mm") is None
     else 100 * r["peak_beyond_grads_vs_grouped_mm"], ".1f"),
    ("x vs gmm", "speedup_vs_grouped_mm", ".2f"),
    ("adapter/core", "adapter_over_core", ".3f"),
    ("note", _note, None),
]

LARGEST_TABLE = [
    ("shape", "shape", None),
    ("impl", "impl_key", None),
    ("largest tokens", lambda r: common.format_count(r["tokens"]), None),
    ("held MiB", _mib("held_bytes"), ".0f"),
    ("peak MiB", _mib("peak_bytes"), ".0f"),
]


def dense_ceiling_tflops(n=8192, repeats=10):
    """bf16 n x n x n torch.mm TFLOP/s on this GPU: the ceiling the layer's TFLOP/s compare with."""
    import torch

    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    t = common.cuda_time(lambda: torch.mm(a, b), warmup=3, repeats=repeats)
    return common.tflops(2.0 * n**3, t.median_ms)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


def _csv(text):
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", default=None, help=f"comma list of {', '.join(SHAPES)} (default: all)")
    ap.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME=d,h,E,K",
        help="an extra shape (repeatable); with --shape and no --shapes only the extra shapes run",
    )
    ap.add_argument("--tokens", default=None, help="comma list of token counts, e.g. 8k,32k,128k (default)")
    ap.add_argument("--quick", action="store_true", help="8k tokens only, 2 warm-up calls (default name moe_quick)")
    ap.add_argument("--checkpoint", choices=("ab", "none", "both"), default="both", help="blazecore policies")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {', '.join(IMPLS)}")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls per figure (median; at least 10)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls before timing (default 3, quick 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-tokens", type=int, default=384, help="tokens of the correctness spot check")
    ap.add_argument("--check-tol", type=float, default=2e-2, help="relative norm error allowed by the spot check")
    ap.add_argument("--largest", action="store_true", help="also double L past the largest --tokens until OOM")
    ap.add_argument("--largest-cap", default="1m", help="stop the --largest search at this many tokens")
    ap.add_argument("--no-ceiling", action="store_true", help="skip the dense bf16 GEMM ceiling measurement")
    ap.add_argument("--name", default=None, help="results file stem (default moe, or moe_quick with --quick)")
    ap.add_argument("--results-dir", default=None, help="default bench/results")
    ap.add_argument("--no-json", action="store_true", help="print only")
    ap.add_argument("--kind", default="moe",
                    help="the JSON header's 'bench' field, which bench/report.py renders by: moe (the table of "
                         "shapes) or moe_scaling (tokens across, with plots; python -m blazecore bench)")
    ap.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: smoke-test this script's flow with small --shape's (wall-clock times, no memory figures)",
    )
    args = ap.parse_args(argv)

    args.shape_table = dict(SHAPES)
    extra = []
    for spec in args.shape:
        name, _, dims = spec.partition("=")
        try:
            d, h, E, K = (int(v) for v in dims.split(","))
        except ValueError:
            ap.error(f"--shape {spec!r}: expected NAME=d,h,E,K")
        if not (name and min(d, h, E, K) >= 1 and K <= E):
            ap.error(f"--shape {spec!r}: need a name, positive sizes and K <= E")
        args.shape_table[name] = (d, h, E, K)
        extra.append(name)
    if args.shapes is None:
        args.shapes = extra or list(SHAPES)
    else:
        args.shapes = _csv(args.shapes) + [n for n in extra if n not in args.shapes]
    unknown = [s for s in args.shapes if s not in args.shape_table]
    if unknown:
        ap.error(f"unknown shapes {unknown}; known: {list(SHAPES)}")
    args.impls = _csv(args.impls)
    unknown = [s for s in args.impls if s not in IMPLS]
    if unknown:
        ap.error(f"unknown impls {unknown}; known: {list(IMPLS)}")
    tokens = args.tokens or ("8k" if args.quick else ",".join(DEFAULT_TOKENS))
    try:
        args.tokens = [common.parse_count(t) for t in _csv(tokens)]
        args.largest_cap = common.parse_count(args.largest_cap)
    except ValueError as exc:
        ap.error(f"bad token count: {exc}")
    if not args.tokens or min(args.tokens) < 1:
        ap.error("--tokens needs positive counts")
    if args.repeats < 1:
        ap.error("--repeats must be positive")
    if args.warmup is None:
        args.warmup = 2 if args.quick else 3
    args.policies = list(POLICIES) if args.checkpoint == "both" else [args.checkpoint]
    args.name = args.name or ("moe_quick" if args.quick else "moe")
    return args


def main(argv=None) -> int:
    run(parse_args(argv))
    return 0


def run(args):
    """Measure what ``args`` (from :func:`parse_args`) asks; returns the JSON path written, or None (no GPU,
    no torch, or --no-json)."""
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda":
        ok, why = common.cuda_gpu_available()
        if not ok:
            print(f"bench_moe: no GPU to measure on: {why}. Nothing measured; exiting.")
            return None
    else:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("bench_moe: torch is not installed; nothing to run.")
            return None
    if args.repeats < 10:
        print(f"bench_moe: warning: --repeats {args.repeats} < 10; medians are noisy", flush=True)
    baselines = _import_baselines()
    header = common.gpu_header() if DEVICE == "cuda" else common.cpu_header()
    header["bench"] = args.kind
    common.print_header(header)
    if DEVICE == "cuda" and not args.no_ceiling:
        header["dense_bf16_tflops"] = dense_ceiling_tflops()
        _cleanup()
        print(f"# dense bf16 GEMM ceiling (8192^3 torch.mm): {header['dense_bf16_tflops']:.0f} TFLOP/s", flush=True)

    impls = build_impls(args, baselines)
    for impl, reason in impls:
        if reason:
            print(f"# {impl.key}: unavailable: {reason}", flush=True)

    rows, checks_by_shape, largest_rows, stopped_rows = [], {}, [], []

    def save():
        if args.no_json:
            return None
        return common.write_json(
            args.name, header, rows, args.results_dir, checks=checks_by_shape, largest=largest_rows,
            stopped=stopped_rows,
        )

    for shape_name in args.shapes:
        shape = args.shape_table[shape_name]
        d, h, E, K = shape
        print(f"\n## {shape_name}: d={d} h={h} E={E} K={K}", flush=True)
        try:
            weights = make_weights(d, h, E, args.seed)
        except Exception as exc:
            status, message = _classify(exc, baselines)
            print(f"  weights: {status}: {message}", flush=True)
            for L in args.tokens:
                for impl, _ in impls:
                    rows.append({**_base_row(shape_name, shape, L, impl, args), "status": status, "message": message})
            _cleanup()
            save()
            continue
        checks = spot_check(impls, weights, shape, args, baselines)
        checks_by_shape[shape_name] = checks
        for key, c in checks.items():
            worst = max((c["errors"] or {}).values(), default=None)
            verdict = "pass" if c["ok"] else ("FAIL" if c["status"] == "ok" else c["status"])
            worst_text = f" (worst rel err {worst:.2e})" if worst is not None else ""
            extra = f": {c['message']}" if c["message"] else ""
            print(f"  check {key}: {verdict}{worst_text}{extra}", flush=True)
        for L in args.tokens:
            group = run_group(shape_name, shape, L, impls, checks, weights, args, baselines)
            rows.extend(group)
            common.print_table(group, TABLE)
            save()
        if args.largest:
            grid = [r for r in rows if r["shape"] == shape_name]
            found, stopped = find_largest(shape_name, shape, impls, grid, weights, args, baselines)
            stopped_rows.extend(stopped)
            for r in found.values():
                if r is not None:
                    largest_rows.append(r)
            done = [r for r in found.values() if r is not None]
            if done:
                print(f"  largest L that fits (doubling from {common.format_count(max(args.tokens))}):")
                common.print_table(done, LARGEST_TABLE)
            for r in stopped:
                print(f"  {r['impl_key']}: {r['status']} at L={common.format_count(r['tokens'])}", flush=True)
            save()
        del weights
        _cleanup()

    print("\n## all rows")
    common.print_table(rows, TABLE)
    path = save()
    if path is not None:
        print(f"\nwrote {path}")
    return path


if __name__ == "__main__":
    sys.exit(main())
