"""In-process A/B of kernel build options (GPU): one process, the option sets taken in turn, interleaved in rounds.

Each problem is the layer's forward+backward through ``blazecore_torch.moe_ffn`` ("ab", bf16, bench_gemm's problem of
a shape at a token count). After every set has run it twice (its kernels compiled: the on-disk cache keys on the
options) and ``--warm-seconds`` of load, each round times every set in turn: per GEMM the CUPTI kernel ms (median of
``--calls`` steps, ``bench_gemm.launcher_kernel_ms``) and the step's CUDA-event ms ("layer", median of ``--calls``). The
sets share one warm GPU and alternate within each round, so the power cap's drift moves them together; compare within
a round. Sets are ``LABEL:NVRTC options[:VAR=VALUE ...]`` as for scripts/ab_options.sh (``-`` for no options where an
environment field follows; the environment is set for the set's calls and restored after). A field whose name has a
dot, ``module.ATTR=INT`` (e.g. ``blazecore._moe_gpu.O_SLICE_COLS=2048``), sets that module attribute to the integer
for the set's calls instead, and restores it after; ``module.FUNCTION(KEYWORD)=INT`` (e.g.
``blazecore.moe.moe_forward(block_tokens)=16384``) sets the default of that keyword-only parameter the same way.

Usage (repository root): PYTHONPATH=.:adapters:app python scripts/ab_inprocess.py OUT.json \\
    --set base: --set probe:-DBLZ_PROBE_HALF_B=1 [--shapes olmoe,fine] [--tokens 32k] [--rounds 3]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time


def parse_set(spec: str) -> tuple[str, str, dict]:
    """'LABEL:opts[:VAR=VALUE ...]' -> (label, NVRTC options, {VAR: VALUE})."""
    label, sep, rest = spec.partition(":")
    if not label or not sep:
        raise ValueError(f"option set {spec!r}: want LABEL:NVRTC options[:VAR=VALUE ...]")
    opts, _, envs = rest.partition(":")
    env = {}
    for word in envs.split():
        var, eq, value = word.partition("=")
        if not var or not eq:
            raise ValueError(f"option set {spec!r}: environment field {word!r} is not VAR=VALUE")
        if "." in var:  # module.ATTR=INT
            try:
                int(value)
            except ValueError:
                raise ValueError(f"option set {spec!r}: attribute field {word!r} takes an integer") from None
        env[var] = value
    return label, "" if opts.strip() == "-" else opts.strip(), env


def _attribute(field: str):
    """(holder, key) of a ``module.ATTR`` field (the module and the attribute's name) or of a
    ``module.FUNCTION(KEYWORD)`` field (the function's keyword-only defaults and the keyword); AttributeError if the
    module has no such attribute or the function no such keyword-only parameter with a default."""
    path, paren, kw = field.partition("(")
    mod_name, _, attr = path.rpartition(".")
    mod = importlib.import_module(mod_name)
    if not hasattr(mod, attr):
        raise AttributeError(f"option set field {field!r}: {mod_name} has no attribute {attr!r}")
    if not paren:
        return mod, attr
    kw = kw.removesuffix(")")
    defaults = getattr(getattr(mod, attr), "__kwdefaults__", None) or {}
    if kw not in defaults:
        raise AttributeError(f"option set field {field!r}: {path} has no keyword-only parameter {kw!r} with a default")
    return defaults, kw


def _get(holder, key):
    return holder[key] if isinstance(holder, dict) else getattr(holder, key)


def _put(holder, key, value) -> None:
    if isinstance(holder, dict):
        holder[key] = value
    else:
        setattr(holder, key, value)


class _Applied:
    """The set's NVRTC options, environment and module attributes (``module.ATTR`` fields) for the calls inside the
    block."""

    def __init__(self, opts: str, env: dict):
        self.opts, self.saved, self.saved_attrs = opts, {}, []
        self.env = {k: v for k, v in env.items() if "." not in k}
        self.attrs = {k: v for k, v in env.items() if "." in k}

    def __enter__(self):
        for var in ("BLAZECORE_NVRTC_OPTIONS", *self.env):
            self.saved[var] = os.environ.get(var)
        os.environ["BLAZECORE_NVRTC_OPTIONS"] = self.opts
        os.environ.update(self.env)
        try:
            for field, value in self.attrs.items():
                holder, key = _attribute(field)
                self.saved_attrs.append((holder, key, _get(holder, key)))
                _put(holder, key, int(value))
        except BaseException:  # a bad field: what was already set goes back, as if the block had run
            self.__exit__()
            raise

    def __exit__(self, *exc):
        for var, value in self.saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        for holder, key, value in reversed(self.saved_attrs):
            _put(holder, key, value)
        self.saved_attrs = []


def layer_measure(torch):
    """measure(step, calls) for :func:`time_in_rounds`: each GEMM launcher's CUPTI kernel ms in ``step``
    (``bench_gemm.launcher_kernel_ms``, median of ``calls``) and "layer", the step's CUDA-event ms (median of
    ``calls``)."""
    import bench.bench_gemm as bg
    from bench import _common as common

    def measure(step, calls):
        got = bg.launcher_kernel_ms(torch, step, calls)
        got["layer"] = common.cuda_time(step, warmup=0, repeats=calls).median_ms
        return got

    return measure


def time_in_rounds(runs: dict, *, rounds: int, calls: int, warm_seconds: float, measure, sync) -> dict:
    """{name: {label: [figure of each round]}} of ``runs``, {label: (step, context)}, ``context()`` a context manager
    that sets up the label's build options / settings for its calls. Every run's step is called twice under its
    context first (its kernels compiled and loaded), then the first run's for ``warm_seconds`` (the GPU at its loaded
    clock); then each of ``rounds`` rounds takes the runs in their order, ``measure(step, calls)`` -> {name: figure}
    under the run's context. ``sync()`` waits for the device."""
    for step, context in runs.values():
        with context():
            step()
            step()
    sync()
    first_step, first_context = next(iter(runs.values()))
    t0 = time.time()
    with first_context():
        while time.time() - t0 < warm_seconds:
            first_step()
    sync()
    out: dict = {}
    for _ in range(rounds):
        for label, (step, context) in runs.items():
            with context():
                got = measure(step, calls)
            for name, v in got.items():
                out.setdefault(name, {}).setdefault(label, []).append(round(v, 4))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the JSON file to write")
    ap.add_argument("--set", dest="sets", action="append", required=True, help="LABEL:NVRTC options[:VAR=VALUE ...]")
    ap.add_argument("--shapes", default="olmoe,qwen3,fine,mixtral")
    ap.add_argument("--tokens", default="32k")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--warm-seconds", type=float, default=4.0)
    args = ap.parse_args(argv)
    try:
        sets = [parse_set(s) for s in args.sets]
    except ValueError as exc:
        ap.error(str(exc))
    if len({s[0] for s in sets}) != len(sets):
        ap.error("--set: labels must differ")
    try:  # every attribute field names an attribute that exists, before any GPU work
        for _, _, env in sets:
            for field in env:
                if "." in field:
                    _attribute(field)
    except (ImportError, AttributeError) as exc:
        ap.error(str(exc))

    import torch
    from blazecore_torch import ops

    import bench.bench_gemm as bg
    from bench import _common as common

    shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in shapes if s not in bg.SHAPES]
    if bad:
        ap.error(f"--shapes: unknown {', '.join(bad)}")
    L = common.parse_count(args.tokens)
    ms: dict = {}
    for shape in shapes:
        d, h, E, K = bg.SHAPES[shape]
        step = bg.blazecore_step(torch, ops, *bg._problem(torch, d, h, E, K, L))
        runs = {label: (step, lambda opts=opts, env=env: _Applied(opts, env)) for label, opts, env in sets}
        ms[shape] = time_in_rounds(runs, rounds=args.rounds, calls=args.calls, warm_seconds=args.warm_seconds,
                                   measure=layer_measure(torch), sync=torch.cuda.synchronize)
        print(shape, json.dumps(ms[shape]), flush=True)
    header = {**common.gpu_header(), "bench": "ab_inprocess", "tokens": L, "rounds": args.rounds,
              "calls": args.calls, "warm_seconds": args.warm_seconds,
              "sets": {label: {"nvrtc_options": opts, "env": env} for label, opts, env in sets}}
    with open(args.out, "w") as f:
        json.dump({"header": header, "ms": ms}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
