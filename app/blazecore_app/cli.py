"""The ``blazecore`` command (also ``python -m blazecore``): the application's command line.

Commands:
    train   train a small MoE transformer language model on blazecore's MoE layers (PyTorch) on a generated
            corpus; ``--baseline`` runs the same model on a conventional PyTorch MoE. GPU: a bf16 model of
            d=1024, 4 layers, E=16, K=4; CPU: a tiny model on the NumPy reference.
    bench   the MoE layer against the PyTorch baselines over token counts (GPU only): JSON, a table and PNG plots
            in the directory given by --results-dir (default: the current directory).
    info    GPU, CUDA driver and runtime, CuPy, NVRTC, torch / jax / transformers versions, kernel cache.
    demo    build the dispatch of a random top-k routing with blazecore and with a sort-based build, check
            that they agree, print what was built and the times (GPU kernels, or the CPU reference).

Without a command it prints this overview. A command is a subparser plus a ``_cmd_<name>(args) -> int``
function registered in ``_COMMANDS``; nothing heavy (torch, cupy) is imported before a command runs.

Errors: a bad option value prints one line (``blazecore <command>: error: ...``) and exits with status 2, as
argparse does; a failure inside a run prints one line and the path of a log file holding the traceback, and
exits with status 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
import traceback

import numpy as np

import blazecore

from .timing import time_calls

# ---------------------------------------------------------------------------------------------
# Parsing: one line per bad value, status 2
# ---------------------------------------------------------------------------------------------


class UsageError(Exception):
    """A bad option value or combination found after parsing; the message names the option."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but an error is one line: ``prog: error: message (see prog --help)``, status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(kind, lo, inclusive=True):
    """An argparse type: ``kind`` (int or float) >= lo (> lo when not inclusive)."""
    def convert(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
                                             ) from None
        if not (value >= lo if inclusive else value > lo):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {lo}, got {text}")
        return value

    convert.__name__ = kind.__name__
    return convert


POSITIVE_INT = _number(int, 1)
NON_NEGATIVE_INT = _number(int, 0)
POSITIVE_FLOAT = _number(float, 0.0, inclusive=False)
NON_NEGATIVE_FLOAT = _number(float, 0.0)


def _chunks(text):
    if text == "auto":
        return text
    try:
        return POSITIVE_INT(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or auto, got {text!r}") from None


def _failure(command: str, exc: BaseException) -> int:
    """A run failed: one line for the user, the traceback in a log file. Returns the exit status 1."""
    fd, path = tempfile.mkstemp(prefix=f"blazecore-{command}-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write(f"blazecore {blazecore.__version__}, {time.strftime('%Y-%m-%d %H:%M:%S')}, argv {sys.argv}\n")
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=f)
    text = " ".join(str(exc).split()) or type(exc).__name__
    print(f"blazecore {command}: failed: {type(exc).__name__}: {text[:300]} (traceback in {path})", file=sys.stderr)
    return 1


# ---------------------------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------------------------


def _torch_sort_build(torch, ids, num_experts: int):
    """The conventional build in PyTorch: torch.sort(stable), bincount, cumsum, scatter."""
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    _, order = torch.sort(flat, stable=True)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    offsets[1:] = torch.cumsum(torch.bincount(flat, minlength=num_experts), 0)
    pair_slot = torch.empty(flat.numel(), dtype=torch.int32, device=flat.device)
    pair_slot[order] = torch.arange(flat.numel(), dtype=torch.int32, device=flat.device)
    return (offsets, torch.div(order, top_k, rounding_mode="floor").to(torch.int32),
            (order % top_k).to(torch.int32), pair_slot.view(num_tokens, top_k))


def _gpu_name() -> str | None:
    """The current CUDA device's name, or None where CuPy or a GPU is missing."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return None


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _print_dispatch(d, ids: np.ndarray, host: tuple) -> None:
    offsets, slot_token, slot_k, pair_slot = host
    counts = np.diff(offsets)
    print(f"built {slot_token.size} slots; pairs per expert: min {counts.min()}, mean {counts.mean():.1f}, "
          f"max {counts.max()}; {int((counts == 0).sum())} empty expert(s)")
    print(f"{d!r}")
    for e in sorted({0, d.num_experts - 1}):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        first = " ".join(f"({int(t)},{int(k)})" for t, k in zip(slot_token[lo : lo + 6], slot_k[lo : lo + 6],
                                                               strict=True))
        print(f"expert {e}: slots [{lo}, {hi}); first (token, k): {first}{' ...' if hi - lo > 6 else ''}")
    print(f"token 0 picks experts {ids[0].tolist()} -> slots {pair_slot[0].tolist()}")


def _check_demo(args) -> None:
    if not 1 <= args.top_k <= args.experts:
        raise UsageError(f"argument --top-k: must be in [1, --experts = {args.experts}], got {args.top_k}")
    try:
        blazecore.dispatch.check_sizes(args.tokens, args.top_k, args.experts)
    except ValueError as exc:
        raise UsageError(f"--tokens {args.tokens}, --experts {args.experts}, --top-k {args.top_k}: {exc}") from None


def _cmd_demo(args) -> int:
    from blazecore import dispatch as D
    from blazecore.testing import argsort_dispatch, make_routing

    _check_demo(args)
    L, E, K = args.tokens, args.experts, args.top_k
    gpu = _gpu_name() if args.device in ("auto", "gpu") else None
    if args.device == "gpu" and gpu is None:
        raise UsageError("argument --device: gpu, but no CUDA GPU is usable (cupy with a GPU is needed)")
    print(f"blazecore dispatch demo: L={L} tokens, E={E} experts, top-{K} (uniform random routing, seed {args.seed})")
    ids = make_routing(np.random.default_rng(args.seed), L, E, K, "uniform")

    if gpu is None:
        repeats = args.repeats or 3
        print("device: CPU (no CUDA GPU found): blazecore runs its NumPy reference (three phases, token "
              "tiles; written to be read, not to be fast); the conventional build is a NumPy stable argsort")
        d = D.build_dispatch(ids, E)
        conv = argsort_dispatch(ids, E)
        ours = (d.expert_offsets, d.slot_token, d.slot_k, d.pair_slot)
        timing = time_calls({
            "ours": lambda: D.build_dispatch(ids, E, validate=False),
            "check": lambda: D.build_dispatch(ids, E),
            "conv": lambda: argsort_dispatch(ids, E),
        }, warmup=1, repeats=repeats, clock="wall")
        conv_name = "NumPy argsort"
        timer = "wall clock"
    else:
        import cupy

        repeats = args.repeats or 20
        torch = _torch_cuda()
        ids_gpu = cupy.asarray(ids)
        d = D.build_dispatch(ids_gpu, E)
        if torch is not None:
            ids_t = torch.from_dlpack(ids_gpu)
            conv_name = "torch.sort"

            def conv_fn():
                return _torch_sort_build(torch, ids_t, E)
        else:
            conv_name = "cupy.argsort"

            def conv_fn():
                return argsort_dispatch(ids_gpu, E, xp=cupy)

        print(f"device: {gpu} (CUDA kernels); the conventional build uses {conv_name}")
        conv = tuple(cupy.asnumpy(cupy.from_dlpack(a)) for a in conv_fn())
        ours = tuple(cupy.asnumpy(a) for a in (d.expert_offsets, d.slot_token, d.slot_k, d.pair_slot))
        # torch's current stream is CuPy's too (the default stream) unless a caller changed one of them
        timing = time_calls({
            "ours": lambda: D.build_dispatch(ids_gpu, E, validate=False),
            "check": lambda: D.build_dispatch(ids_gpu, E),
            "conv": conv_fn,
        }, warmup=1, repeats=repeats, clock="cupy")
        timer = "CUDA events"

    names = ("expert_offsets", "slot_token", "slot_k", "pair_slot")
    differ = [n for n, a, b in zip(names, ours, conv, strict=True) if not np.array_equal(np.asarray(a), np.asarray(b))]
    _print_dispatch(d, ids, tuple(np.asarray(a) for a in ours))
    if differ:
        print(f"DISAGREES with the {conv_name} build in: {', '.join(differ)}")
    else:
        print(f"agrees with the {conv_name} build: all four arrays identical")
    t_ours, t_check, t_conv = (timing[k] for k in ("ours", "check", "conv"))
    print(f"time per build ({timer}, median of {repeats}): blazecore {t_ours.median_ms:.3f} ms "
          f"(spread {t_ours.spread_ms:.3f}; {t_check.median_ms:.3f} ms with the value check), {conv_name} build "
          f"{t_conv.median_ms:.3f} ms -> {t_conv.median_ms / t_ours.median_ms:.1f}x")
    return 1 if differ else 0


# ---------------------------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------------------------

# --activation's choices: blazecore's activations and the interleaved form of each gated one
_ACTIVATION_NAMES = blazecore.ACTIVATIONS + tuple(f"{a}_interleaved" for a in blazecore.ACTIVATIONS
                                                  if blazecore.activation_info(a))

# command-line option -> training option (blazecore_app.train.TrainConfig field)
_TRAIN_OPTIONS = {
    "steps": "steps", "batch": "batch", "seq_len": "seq_len", "d_model": "d_model", "layers": "n_layers",
    "heads": "n_heads", "experts": "num_experts", "top_k": "top_k", "expert_hidden": "expert_hidden", "lr": "lr",
    "warmup": "warmup", "weight_decay": "weight_decay", "grad_clip": "grad_clip", "aux_loss_coef": "aux_loss_coef",
    "z_loss_coef": "z_loss_coef", "activation": "activation", "weight_layout": "weight_layout",
    "checkpoint_policy": "checkpoint_policy",
    "chunks": "chunks", "seed": "seed", "device": "device", "dtype": "dtype", "ckpt": "ckpt_dir",
    "ckpt_every": "ckpt_every",
    "log": "log", "log_every": "log_every", "eval_batches": "eval_batches", "corpus_tokens": "corpus_tokens",
    "sample_tokens": "sample_tokens", "cpu_threads": "cpu_threads", "stop_at": "stop_at", "ep": "ep",
}


def _import_train():
    """``blazecore_app.train`` (imports torch); ImportError with a message for the user when torch is missing."""
    if importlib.util.find_spec("torch") is None:
        raise ImportError("PyTorch is not installed: " + _install_hint("torch") + " (or any torch >= 2.5)")
    from . import train

    return train


def _install_hint(extra: str) -> str:
    from .info import install_hint

    return install_hint(extra)


def _train_options(args) -> dict:
    options = {field: getattr(args, opt) for opt, field in _TRAIN_OPTIONS.items() if getattr(args, opt) is not None}
    if args.baseline is not None:
        options["impl"] = args.baseline
    if args.resume:
        options["resume"] = True
    if args.ffn_bias:
        options["ffn_bias"] = True
    return options


def _cmd_train(args) -> int:
    try:
        train = _import_train()
    except ImportError as exc:
        print(f"blazecore train: {exc}", file=sys.stderr)
        return 2
    options = _train_options(args)
    try:
        if args.print_config:
            import dataclasses
            import json

            cfg = train.resolve(options)[0]
            print(json.dumps(dataclasses.asdict(cfg), indent=1))
            return 0
        train.run(options)
    except train.ConfigError as exc:
        raise UsageError(str(exc)) from None
    except KeyboardInterrupt:
        print("\nblazecore train: interrupted" + (f"; resume with --ckpt {args.ckpt} --resume" if args.ckpt else ""),
              file=sys.stderr)
        return 130
    return 0


def _add_train_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="train a small MoE transformer LM on blazecore's layers (the main job)",
        description="Train a small MoE transformer language model (causal attention + blazecore MoE layers, "
                    "PyTorch) on a generated corpus, with a progress bar, checkpoints and a JSON loss log. Options "
                    "left out take the device's preset (GPU: bf16, d=1024, 4 layers, E=16, K=4, 600 steps; CPU: "
                    "a tiny float32 model on blazecore's NumPy reference); --print-config shows the result.")
    m = p.add_argument_group("model")
    m.add_argument("--d-model", type=POSITIVE_INT, help="model width d")
    m.add_argument("--layers", type=POSITIVE_INT, help="transformer blocks")
    m.add_argument("--heads", type=POSITIVE_INT, help="attention heads")
    m.add_argument("--experts", type=POSITIVE_INT, help="E, experts per MoE layer")
    m.add_argument("--top-k", type=POSITIVE_INT, help="K, experts per token")
    m.add_argument("--expert-hidden", type=POSITIVE_INT, help="h, each expert's hidden width")
    m.add_argument("--activation", choices=_ACTIVATION_NAMES,
                   help="expert activation (default swiglu; a gated one + _interleaved: gate/up rows in pairs)")
    m.add_argument("--weight-layout", choices=blazecore.WEIGHT_LAYOUTS,
                   help="how the experts' projections are stored: out_in (default) or in_out (transposed, as gpt-oss)")
    m.add_argument("--ffn-bias", action="store_true", help="give the experts biases (as gpt-oss's)")
    m.add_argument("--checkpoint-policy", choices=("ab", "none"),
                   help="blazecore: keep the pre-activations for the backward (ab, default) or recompute them (none)")
    m.add_argument("--chunks", type=_chunks,
                   help="blazecore: token chunks of each MoE layer (transient memory scales with tokens / chunks, same "
                        "results), or auto: the smallest count the memory planner fits in 0.9 of the free memory")
    m.add_argument("--baseline", nargs="?", const="conventional", choices=("conventional", "grouped_mm"),
                   help="run the same model on a PyTorch MoE instead of blazecore: conventional (argsort, gathered "
                        "copy, per-expert loop, unfused SwiGLU, index_add; the default) or grouped_mm")
    r = p.add_argument_group("run")
    r.add_argument("--steps", type=POSITIVE_INT, help="optimizer steps (the total, also when resuming)")
    r.add_argument("--batch", type=POSITIVE_INT, help="sequences per step")
    r.add_argument("--seq-len", type=POSITIVE_INT, help="tokens per sequence")
    r.add_argument("--lr", type=POSITIVE_FLOAT, help="peak learning rate (AdamW, linear warm-up, cosine decay to 10%%)")
    r.add_argument("--warmup", type=NON_NEGATIVE_INT, help="warm-up steps")
    r.add_argument("--weight-decay", type=NON_NEGATIVE_FLOAT)
    r.add_argument("--grad-clip", type=NON_NEGATIVE_FLOAT, help="global gradient-norm clip (0: none)")
    r.add_argument("--aux-loss-coef", type=NON_NEGATIVE_FLOAT, help="load-balancing loss weight (0.01)")
    r.add_argument("--z-loss-coef", type=NON_NEGATIVE_FLOAT, help="router z-loss weight (0.001)")
    r.add_argument("--seed", type=int, help="initialisation and batch order (same seed: same start, same batches)")
    r.add_argument("--device", help="auto (default: cuda if available), cpu, cuda, cuda:N")
    r.add_argument("--dtype", choices=("auto", "bfloat16", "float32", "float64"),
                   help="parameter dtype (auto: bfloat16 on GPU with float32 master weights, float32 on CPU; "
                        "float64 only on the CPU)")
    r.add_argument("--corpus-tokens", type=POSITIVE_INT, help="size of the generated corpus")
    r.add_argument("--eval-batches", type=NON_NEGATIVE_INT, help="validation batches at the start and the end")
    r.add_argument("--sample-tokens", type=NON_NEGATIVE_INT, help="words to sample from the model at the end (0: none)")
    r.add_argument("--cpu-threads", type=NON_NEGATIVE_INT,
                   help="CPU runs: torch and OpenBLAS threads (1; 0 leaves them)")
    r.add_argument("--ep", type=POSITIVE_INT, metavar="N",
                   help="under torchrun: split each MoE layer's experts over groups of N ranks (expert parallel), "
                        "data parallel across the groups; tokens/s counts every rank")
    o = p.add_argument_group("output")
    o.add_argument("--ckpt", metavar="DIR", help="save DIR/checkpoint.pt every --ckpt-every steps and at the end")
    o.add_argument("--ckpt-every", type=POSITIVE_INT, metavar="N", help="steps between checkpoints (200)")
    o.add_argument("--resume", action="store_true",
                   help="continue from DIR/checkpoint.pt (same batches and state: the same continuation); its "
                        "settings apply unless given again")
    o.add_argument("--stop-at", type=NON_NEGATIVE_INT, metavar="STEP",
                   help="end after this step with a checkpoint, e.g. to split a run; --resume continues it")
    o.add_argument("--log", "--log-file", dest="log", metavar="FILE",
                   help="write the loss curve and the run's figures as JSON (under torchrun spell it --log-file: "
                        "torchrun's own parser takes --log as an abbreviation of its --log-dir and stops)")
    o.add_argument("--log-every", type=POSITIVE_INT, metavar="N",
                   help="steps between loss reads and progress updates (GPU 10, CPU 1)")
    o.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")


# ---------------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------------


def _torch_gpu() -> tuple[bool, str]:
    if importlib.util.find_spec("torch") is None:
        return False, f"PyTorch is not installed ({_install_hint('torch')})"
    import torch

    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} sees no CUDA GPU"
    return True, ""


def _bench_modules():
    """(bench_moe, plot, report) of the benchmark harness: the installed ``blazecore_app.bench``, or, where the
    package runs from a source checkout that is on the path but not installed (``PYTHONPATH=...:app``), the
    checkout's own ``bench/`` package, loaded under that name (its modules import each other relatively)."""
    try:
        from .bench import bench_moe, plot, report
    except ModuleNotFoundError as exc:
        name = f"{__package__}.bench"
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        init = os.path.join(root, "bench", "__init__.py")
        if exc.name != name or not os.path.isfile(init):
            raise
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[os.path.dirname(init)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        from .bench import bench_moe, plot, report
    return bench_moe, plot, report


def _cmd_bench(args) -> int:
    ok, why = _torch_gpu()
    if not ok:
        print(f"blazecore bench: needs a CUDA GPU, and {why}. Nothing was measured. (On a CPU machine, "
              "`blazecore train` runs the layer on the reference path.)", file=sys.stderr)
        return 1
    bench_moe, plot, report = _bench_modules()

    if args.readme and not (report.ROOT / "README.md").is_file():
        raise UsageError("--readme regenerates the README of a source checkout; this blazecore is installed from "
                         "a wheel (run it from a checkout installed with pip install -e)")
    if args.results_dir is not None:
        results_dir = os.path.abspath(args.results_dir)
    else:  # the README's tables are made from the checkout's bench/results
        results_dir = str(report.RESULTS) if args.readme else os.getcwd()
    bench_argv = ["--shapes", args.shape, "--tokens", args.tokens, "--checkpoint", args.checkpoint,
                  "--impls", args.impls, "--repeats", str(args.repeats), "--seed", str(args.seed),
                  "--name", args.name, "--kind", "moe_scaling", "--results-dir", results_dir]
    if args.largest_cap:
        bench_argv += ["--largest", "--largest-cap", args.largest_cap]
    for spec in args.define_shape:
        bench_argv += ["--shape", spec]
    path = bench_moe.run(bench_moe.parse_args(bench_argv))
    if path is None:
        return 1
    if not args.no_plots:
        try:
            for p in plot.plot_file(path):
                print(f"wrote {p}")
        except ImportError:
            print(f"blazecore bench: matplotlib is not installed ({_install_hint('plot')}): no plots", file=sys.stderr)
    if args.readme:
        rc = report.main(["--readme"])
        print("README.md: results tables regenerated" if rc == 0 else "README.md: not updated", flush=True)
    return 0


def _add_bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench", help="MoE layer vs the PyTorch baselines over token counts (GPU): JSON, table, PNG plots",
        description="Forward+backward time and peak memory of blazecore's MoE layer (checkpoint ab and none) and "
                    "the PyTorch baselines (conventional, torch._grouped_mm) for one shape over token counts, then "
                    "memory alone at doubling counts until each runs out of memory. Writes "
                    "<results-dir>/<name>_<gpu>.json and the plots in <results-dir>/plots/. Needs a CUDA GPU.")
    p.add_argument("--shape", default="olmoe",
                   help="olmoe (d=2048, h=1024, E=64, K=8; default), qwen3, mixtral, fine, or a --define-shape name")
    p.add_argument("--define-shape", action="append", default=[], metavar="NAME=d,h,E,K",
                   help="an extra shape for --shape (repeatable)")
    p.add_argument("--tokens", default="4k,8k,16k,32k,64k,128k", help="timed token counts (default 4k..128k)")
    p.add_argument("--largest-cap", default="2m",
                   help="after the timed counts, double the tokens up to this many until each implementation runs "
                        "out of memory (memory only; '' to skip; default 2m)")
    p.add_argument("--impls", default="blazecore,conventional,grouped_mm")
    p.add_argument("--checkpoint", choices=("ab", "none", "both"), default="both", help="blazecore policies")
    p.add_argument("--repeats", type=POSITIVE_INT, default=10, help="timed calls per figure (median)")
    p.add_argument("--seed", type=NON_NEGATIVE_INT, default=0)
    p.add_argument("--name", default="moe_scaling", help="results file stem (default moe_scaling)")
    p.add_argument("--results-dir", default=None, metavar="DIR",
                   help="where the JSON and the plots go (default: the current directory; bench/results with --readme)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--readme", action="store_true",
                   help="in a source checkout: regenerate the README's results tables (bench/report.py)")


# ---------------------------------------------------------------------------------------------
# info
# ---------------------------------------------------------------------------------------------


def _cmd_info(args) -> int:
    from . import info

    return info.main(as_json=args.json)


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------

_COMMANDS = {"train": _cmd_train, "bench": _cmd_bench, "info": _cmd_info, "demo": _cmd_demo}


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="blazecore", description="blazecore: memory-efficient MoE training kernels",
                     epilog="Start with: blazecore train  (or python -m blazecore train)")
    parser.add_argument("--version", action="version", version=f"blazecore {blazecore.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="command", parser_class=_Parser)
    _add_train_parser(sub)
    _add_bench_parser(sub)
    info = sub.add_parser("info", help="GPU, CUDA, CuPy, NVRTC, torch/jax versions and the kernel cache")
    info.add_argument("--json", action="store_true", help="print JSON")
    demo = sub.add_parser("demo", help="dispatch demo: blazecore vs a sort-based build on a random routing")
    demo.add_argument("--tokens", type=POSITIVE_INT, default=65536, help="L, tokens (default 65536)")
    demo.add_argument("--experts", type=POSITIVE_INT, default=64, help="E, experts (default 64)")
    demo.add_argument("--top-k", type=POSITIVE_INT, default=8, help="K, experts per token (default 8)")
    demo.add_argument("--seed", type=NON_NEGATIVE_INT, default=0)
    demo.add_argument("--repeats", type=POSITIVE_INT, default=None,
                      help="timed builds per method (median; 3 on CPU, 20 on GPU)")
    demo.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return _COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"blazecore {args.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nblazecore {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (blazecore info | head): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:  # a failure inside a run: one line here, the traceback in a log file
        return _failure(args.command, exc)


if __name__ == "__main__":
    sys.exit(main())
