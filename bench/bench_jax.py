"""Benchmark of the JAX adapter: a jitted forward+backward of ``blazecore_jax.moe_ffn`` against the core it wraps.

For each shape (d, h, E, K), token count L and checkpoint policy, in bf16 with a fixed random routing (softmax
over E of random logits, top-k, renormalised), the same inputs run two ways:

* core: ``blazecore.build_dispatch(ids, E, validate=False)``, ``blazecore.moe_forward`` and
  ``blazecore.moe_backward`` on CuPy arrays, on one CuPy stream, every allocation from CuPy's pool;
* jax: one ``jax.jit`` function: ``blazecore_jax.build_dispatch(ids, E, validate=False)``, then
  ``jax.vjp`` of ``blazecore_jax.moe_ffn`` (routing given, that dispatch) applied to dy; it returns y, dx,
  dw13, dw2 and dgates, in buffers XLA allocates.

Same kernels, same routing, same dispatch build, same checkpoint policy: what differs is the adapter (buffer
callbacks on XLA's stream, XLA-owned outputs, the copy of the saved pre-activations into XLA's buffer under
"ab", a backward that leaves those pre-activations intact). Each call is timed on the wall clock up to a
device synchronisation (``block_until_ready`` / ``Stream.synchronize``), core and jax calls alternating after
warm-up calls; a figure is the median of the repeats. The core's CUDA-event time is recorded beside it.

    ratio = jax median / core median      acceptance: ratio <= --max-ratio (1.10) at --gate-tokens (32k)

Before timing, the outputs of both are compared (relative norm error under 1e-2 for each of y, dx, dw13, dw2,
dgates; they are expected to be identical, which the JSON records). The script exits 1 when a check or a gated
ratio fails, 0 otherwise (also when there is no GPU: nothing is measured then).

XLA_PYTHON_CLIENT_PREALLOCATE is set to false before jax is imported: JAX shares the GPU with CuPy's pool.

Usage (from the repository root, with the project installed: pip install -e .):
    python -m bench.bench_jax                                   # olmoe, 8k and 32k tokens, policy "ab"
    python -m bench.bench_jax --tokens 32k --checkpoint both --results-dir /tmp/out
    python -m bench.bench_jax --device cpu --shape tiny=64,32,8,2 --tokens 96   # CPU smoke test of the flow
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

try:
    from . import _common as common
except ImportError:  # run as a script: python bench/bench_jax.py
    import _common as common

SHAPES = {
    # name: (d, h, E, K)
    "olmoe": (2048, 1024, 64, 8),
    "qwen3": (2048, 768, 128, 8),
    "mixtral": (4096, 14336, 8, 2),
    "fine": (1536, 256, 128, 8),
}
ACTIVATION = "swiglu"
OUTPUTS = ("y", "dx", "dw13", "dw2", "dgates")
CHECK_TOL = 1e-2


# ------------------------------------------------------------------------------------------------
# Environment
# ------------------------------------------------------------------------------------------------


def jax_gpu(device: str):
    """(jax module, jax device, "") or (None, None, why not)."""
    try:
        import jax
    except ImportError:
        return None, None, "jax is not installed"
    if device == "cpu":
        return jax, jax.devices("cpu")[0], ""
    try:
        return jax, jax.devices("gpu")[0], ""
    except RuntimeError as exc:
        return None, None, f"JAX has no GPU backend ({' '.join(str(exc).split())[:200]})"


def header_for(device: str, jdev) -> dict:
    if device == "cpu":
        header = common.cpu_header()
    else:
        ok, _ = common.cuda_gpu_available()
        if ok:  # torch sees the GPU: the common header (GPU name, driver, CUDA, versions)
            header = common.gpu_header()
        else:  # no torch: name the GPU from JAX
            name = getattr(jdev, "device_kind", "gpu")
            header = {"device": "cuda", "gpu": name, "gpu_slug": common.gpu_slug(name), **common._software()}
    import jax

    header["jax"] = jax.__version__
    try:
        import jaxlib

        header["jaxlib"] = jaxlib.__version__
    except Exception:
        header["jaxlib"] = None
    header["jax_device"] = str(jdev)
    header["jax_device_kind"] = getattr(jdev, "device_kind", None)
    header["xla_python_client_preallocate"] = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")
    header["bench"] = "jax"
    return header


def print_header(header: dict) -> None:
    if header.get("gpu") is None or "sm_count" not in header:
        print(f"# {header.get('gpu') or 'CPU smoke run'}, commit {str(header.get('git_commit'))[:12]}, "
              f"{header.get('date')}", flush=True)
    else:
        common.print_header(header)
    print(f"# jax {header.get('jax')} ({header.get('jax_device')}), cupy {header.get('cupy')}", flush=True)


# ------------------------------------------------------------------------------------------------
# Inputs: NumPy on the host, the same bits to CuPy (bf16 as uint16) and to JAX
# ------------------------------------------------------------------------------------------------


def host_inputs(d, h, E, K, L, seed):
    """bf16 x, w13, w2, dy (ml_dtypes), gates (L, K) float32 and ids (L, K) int32 from one seed."""
    import numpy as np

    from blazecore import BF16

    rng = np.random.default_rng(seed)

    def bf(shape, scale):
        a = rng.standard_normal(shape, dtype=np.float32)
        a *= scale
        return a.astype(BF16)

    w13 = bf((E, 2 * h, d), d**-0.5)
    w2 = bf((E, d, h), h**-0.5)
    x = bf((L, d), 1.0)
    dy = bf((L, d), 1.0)
    logits = rng.standard_normal((L, E), dtype=np.float32)
    ids = np.argpartition(-logits, K - 1, axis=1)[:, :K].astype(np.int32)
    top = np.take_along_axis(logits, ids, 1)
    p = np.exp(top - logits.max(axis=1, keepdims=True))  # softmax restricted to the top-k, renormalised
    gates = (p / p.sum(axis=1, keepdims=True)).astype(np.float32)
    return {"x": x, "w13": w13, "w2": w2, "gates": gates, "ids": np.ascontiguousarray(ids), "dy": dy}


def to_core(host: dict, device: str) -> dict:
    """The core's arrays: NumPy on the CPU; CuPy on the GPU (bf16 as its uint16 bits)."""
    import numpy as np

    from blazecore import BF16

    if device == "cpu":
        return dict(host)
    import cupy

    return {k: cupy.asarray(v.view(np.uint16) if v.dtype == BF16 else v) for k, v in host.items()}


def to_jax(host: dict, jdev) -> dict:
    import jax

    return {k: jax.device_put(v, jdev) for k, v in host.items()}


# ------------------------------------------------------------------------------------------------
# The two runs
# ------------------------------------------------------------------------------------------------


class CoreRun:
    """build_dispatch + moe_forward + moe_backward on the core's arrays, on one stream (None on the CPU)."""

    def __init__(self, bc, arrays, E, checkpoint, retain, device):
        self.bc, self.a, self.E, self.checkpoint, self.retain = bc, arrays, E, checkpoint, retain
        self.gpu = device != "cpu"
        if self.gpu:
            import cupy

            self.stream = cupy.cuda.Stream(non_blocking=True)
        else:
            self.stream = None

    def __call__(self):
        bc, a, s = self.bc, self.a, self.stream
        disp = bc.build_dispatch(a["ids"], self.E, validate=False, stream=s)
        y, saved = bc.moe_forward(a["x"], a["w13"], a["w2"], a["gates"], a["ids"], activation=ACTIVATION,
                                  checkpoint=self.checkpoint, dispatch=disp, stream=s)
        g = bc.moe_backward(a["dy"], saved, stream=s, retain=self.retain)
        return {"y": y, "dx": g.dx, "dw13": g.dw13, "dw2": g.dw2, "dgates": g.dgates}

    def sync(self):
        if self.gpu:
            self.stream.synchronize()


class JaxRun:
    """jax.jit of build_dispatch + vjp(moe_ffn) applied to dy."""

    def __init__(self, jax, bj, arrays, E, checkpoint):
        self.jax, self.a = jax, arrays

        def step(x, w13, w2, gates, ids, dy):
            disp = bj.build_dispatch(ids, E, validate=False)

            def ffn(x, w13, w2, gates):
                return bj.moe_ffn(x, w13, w2, gates, ids, activation=ACTIVATION, checkpoint=checkpoint,
                                  dispatch=disp)

            y, vjp = jax.vjp(ffn, x, w13, w2, gates)
            dx, dw13, dw2, dgates = vjp(dy)
            return {"y": y, "dx": dx, "dw13": dw13, "dw2": dw2, "dgates": dgates}

        self.fn = jax.jit(step)

    def __call__(self):
        a = self.a
        return self.fn(a["x"], a["w13"], a["w2"], a["gates"], a["ids"], a["dy"])


# ------------------------------------------------------------------------------------------------
# Output comparison (on the device where possible)
# ------------------------------------------------------------------------------------------------


def _as_core_array(a, device):
    """A JAX result as the core holds arrays (CuPy, bf16 as uint16; NumPy on the CPU)."""
    import numpy as np

    from blazecore import BF16, asarray

    if device == "cpu":
        return np.asarray(a)
    try:
        return asarray(a, "jax output")  # zero-copy through DLPack
    except Exception:  # a host round trip if this JAX build exports no DLPack for it
        import cupy

        h = np.asarray(a)
        return cupy.asarray(h.view(np.uint16) if h.dtype == BF16 else h)


def _float32(a):
    """float32 copy of a core array (uint16 bf16 bits on the GPU, ml_dtypes bf16 on the CPU)."""
    import numpy as np

    mod = type(a).__module__.split(".")[0]
    if mod == "cupy":
        import cupy

        if a.dtype == cupy.uint16:
            return (a.astype(cupy.uint32) << 16).view(cupy.float32)
        return a.astype(cupy.float32)
    return np.asarray(a).astype(np.float32)


def compare(core_out: dict, jax_out: dict, device: str) -> dict:
    """Per output: relative norm error of jax against core, and whether the bits are identical."""
    res = {}
    for name in OUTPUTS:
        c = core_out[name]
        j = _as_core_array(jax_out[name], device)
        if tuple(c.shape) != tuple(j.shape):
            res[name] = {"rel_err": float("inf"), "identical": False, "message": f"shape {j.shape} != {c.shape}"}
            continue
        xp = sys.modules["cupy"] if type(c).__module__.split(".")[0] == "cupy" else sys.modules["numpy"]
        identical = bool(xp.array_equal(c.view(xp.uint16) if c.dtype.itemsize == 2 else c,
                                        j.view(xp.uint16) if j.dtype.itemsize == 2 else j))
        c32, j32 = _float32(c), _float32(j)
        den = float(xp.linalg.norm(c32.ravel()))
        num = float(xp.linalg.norm((j32 - c32).ravel()))
        res[name] = {"rel_err": num / (den if den > 0 else 1.0), "identical": identical}
        del c32, j32
    return res


# ------------------------------------------------------------------------------------------------
# One (shape, tokens, policy)
# ------------------------------------------------------------------------------------------------


def measure(core, jx, args):
    """Core and jax calls interleaved after warm-up (bench/_common.py's timer, wall clock up to a device
    synchronisation): medians, spreads and samples of both, and the ratio; on a GPU also the core's CUDA-event time."""

    def core_call():
        core()
        core.sync()

    def jax_call():
        jx.jax.block_until_ready(jx())

    t = common.time_calls({"core": core_call, "jax": jax_call}, warmup=args.warmup, repeats=args.repeats,
                          clock="wall")
    c, j = t["core"], t["jax"]
    event = (common.time_call(core, warmup=1, repeats=args.repeats, clock="cupy", stream=core.stream)
             if core.gpu else None)
    return {
        "core_ms": c.median_ms,
        "jax_ms": j.median_ms,
        "ratio": j.median_ms / c.median_ms,
        "core_event_ms": event.median_ms if event else None,
        "core_min_ms": c.min_ms,
        "jax_min_ms": j.min_ms,
        "core_spread_ms": c.spread_ms,
        "jax_spread_ms": j.spread_ms,
        "core_samples_ms": c.samples_ms,
        "jax_samples_ms": j.samples_ms,
        "core_event_samples_ms": event.samples_ms if event else [],
    }


def _jax_peak(jdev):
    try:
        stats = jdev.memory_stats() or {}
    except Exception:
        return None
    return stats.get("peak_bytes_in_use")


def run_case(bc, bj, jax, jdev, shape_name, shape, L, policy, host, args):
    d, h, E, K = shape
    flops = bc.moe_flops(L, d, h, K, ACTIVATION)
    row = {
        "shape": shape_name, "d": d, "h": h, "E": E, "K": K, "tokens": L, "checkpoint": policy,
        "dtype": "bfloat16", "activation": ACTIVATION, "routing": f"softmax-topk-renorm seed={args.seed}",
        "flops": flops, "repeats": args.repeats, "warmup": args.warmup, "core_retain": args.core_retain,
        "gated": args.device != "cpu" and L in args.gate_tokens, "max_ratio": args.max_ratio,
    }
    core_arrays, jax_arrays = to_core(host, args.device), to_jax(host, jdev)
    core = CoreRun(bc, core_arrays, E, policy, args.core_retain, args.device)
    jx = JaxRun(jax, bj, jax_arrays, E, policy)
    t0 = time.perf_counter()
    jax_out = jx()
    jax.block_until_ready(jax_out)
    row["jax_first_call_s"] = time.perf_counter() - t0  # trace + XLA compile + first run
    core_out = core()
    core.sync()
    cmp_ = compare(core_out, jax_out, args.device)
    del core_out, jax_out
    row["check"] = cmp_
    row["check_ok"] = all(c["rel_err"] < CHECK_TOL for c in cmp_.values())
    row["identical"] = all(c["identical"] for c in cmp_.values())
    row.update(measure(core, jx, args))
    row["core_tflops"] = common.tflops(flops, row["core_ms"])
    row["jax_tflops"] = common.tflops(flops, row["jax_ms"])
    row["jax_peak_bytes"] = _jax_peak(jdev) if args.device != "cpu" else None
    row["ratio_ok"] = row["ratio"] <= args.max_ratio
    row["status"] = "ok"
    return row


TABLE = [
    ("shape", "shape", None),
    ("tokens", lambda r: common.format_count(r["tokens"]), None),
    ("ckpt", "checkpoint", None),
    ("core ms", "core_ms", ".3f"),
    ("core event ms", "core_event_ms", ".3f"),
    ("jax ms", "jax_ms", ".3f"),
    ("ratio", "ratio", ".3f"),
    ("jax TFLOP/s", "jax_tflops", ".1f"),
    ("check", lambda r: None if r.get("check_ok") is None else
     ("identical" if r.get("identical") else ("ok" if r["check_ok"] else "FAIL")), None),
    ("verdict", lambda r: _verdict(r), None),
]


def _verdict(r):
    if r.get("status") != "ok":
        return f"{r.get('status', '?').upper()}: {' '.join(str(r.get('message', '')).split())[:80]}"
    if not r["check_ok"]:
        return "FAIL (outputs differ)"
    if not r["gated"]:
        return "(not gated)"
    return "pass" if r["ratio_ok"] else f"FAIL (ratio > {r['max_ratio']:.2f})"


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


def _csv(text):
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", default=None, help=f"comma list of {', '.join(SHAPES)} (default: olmoe)")
    ap.add_argument("--shape", action="append", default=[], metavar="NAME=d,h,E,K",
                    help="an extra shape (repeatable); with --shape and no --shapes only the extra shapes run")
    ap.add_argument("--tokens", default="8k,32k", help="comma list of token counts (default 8k,32k)")
    ap.add_argument("--gate-tokens", default="32k",
                    help="token counts whose ratio must be <= --max-ratio (default 32k; 'all' for every count)")
    ap.add_argument("--max-ratio", type=float, default=1.10, help="acceptance: jax time / core time (default 1.10)")
    ap.add_argument("--checkpoint", choices=("ab", "none", "both"), default="ab", help="checkpoint policy")
    ap.add_argument("--core-retain", action="store_true",
                    help="the core's backward keeps the saved pre-activations (retain=True), as the adapter's does")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls of each (median)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls of each before timing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="jax", help="results file stem (default jax)")
    ap.add_argument("--results-dir", default=None, help="default bench/results")
    ap.add_argument("--no-json", action="store_true", help="print only")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: smoke-test this script's flow on the NumPy reference path (tiny --shape)")
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
        args.shapes = extra or ["olmoe"]
    else:
        args.shapes = _csv(args.shapes) + [n for n in extra if n not in args.shapes]
    unknown = [s for s in args.shapes if s not in args.shape_table]
    if unknown:
        ap.error(f"unknown shapes {unknown}; known: {list(args.shape_table)}")
    try:
        args.tokens = [common.parse_count(t) for t in _csv(args.tokens)]
        args.gate_tokens = (set(args.tokens) if args.gate_tokens.strip().lower() == "all"
                            else {common.parse_count(t) for t in _csv(args.gate_tokens)})
    except ValueError as exc:
        ap.error(f"bad token count: {exc}")
    if not args.tokens or min(args.tokens) < 1:
        ap.error("--tokens needs positive counts")
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be positive and --warmup not negative")
    args.policies = ["ab", "none"] if args.checkpoint == "both" else [args.checkpoint]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    jax, jdev, why = jax_gpu(args.device)
    if jax is None:
        print(f"bench_jax: nothing measured: {why}", flush=True)
        return 0
    if args.device == "cuda":
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() < 1:
                raise RuntimeError("no CUDA device")
        except Exception as exc:
            print(f"bench_jax: nothing measured: CuPy sees no GPU ({type(exc).__name__}: {exc})", flush=True)
            return 0
    import blazecore_jax as bj

    import blazecore as bc

    header = header_for(args.device, jdev)
    print_header(header)
    rows = []

    def save():
        if args.no_json:
            return None
        return common.write_json(args.name, header, rows, args.results_dir)

    for shape_name in args.shapes:
        shape = args.shape_table[shape_name]
        d, h, E, K = shape
        print(f"\n## {shape_name}: d={d} h={h} E={E} K={K}, bf16, {ACTIVATION}", flush=True)
        for L in args.tokens:
            host = host_inputs(d, h, E, K, L, args.seed)
            for policy in args.policies:
                try:
                    row = run_case(bc, bj, jax, jdev, shape_name, shape, L, policy, host, args)
                except Exception as exc:
                    msg = " ".join(f"{type(exc).__name__}: {exc}".split())
                    row = {"shape": shape_name, "d": d, "h": h, "E": E, "K": K, "tokens": L, "checkpoint": policy,
                           "status": "error", "message": msg[:2000]}
                    print(f"  {common.format_count(L)} {policy}: ERROR {msg[:500]}", flush=True)
                rows.append(row)
                common.print_table([row], TABLE)
                save()
            del host

    print("\n## all rows")
    common.print_table(rows, TABLE)
    failed = [r for r in rows if r.get("status") != "ok" or not r.get("check_ok")
              or (r.get("gated") and not r.get("ratio_ok"))]
    path = save()
    if path is not None:
        print(f"\nwrote {path}")
    if failed:
        print(f"\nbench_jax: FAILED: {len(failed)} of {len(rows)} rows (see the verdict column)", flush=True)
        return 1
    print(f"\nbench_jax: pass ({len(rows)} rows; ratio <= {args.max_ratio:.2f} at "
          f"{', '.join(common.format_count(t) for t in sorted(args.gate_tokens))} tokens)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
