"""Train a small MoE transformer language model on blazecore's layers: ``blazecore train``.

The model: token and position embeddings, ``n_layers`` pre-norm blocks of causal self-attention
(``F.scaled_dot_product_attention``) and a Mixture-of-Experts feed-forward layer
(:class:`blazecore_torch.MoELayer`, or with ``impl="conventional"`` / ``"grouped_mm"`` the plain PyTorch
:class:`blazecore_app.baselines.BaselineMoELayer` with the same parameters), a final RMSNorm and an
output head tied to the token embedding. The loss is next-token cross-entropy plus
``aux_loss_coef`` x the load-balancing loss and ``z_loss_coef`` x the router z-loss (means over layers).

Data: :class:`blazecore_app.corpus.SyntheticLanguage` (generated, nothing downloaded); the last 10%
is held out for the validation loss. Batches are random windows drawn from a generator seeded with
(seed, step), so the data order needs no state and a resumed run reads the same batches.

Same seed, same start: parameters are initialised from a CPU generator seeded with ``seed``, in the
order of their names, whatever the MoE implementation and device; ``--baseline`` runs therefore start
from the same weights as blazecore runs (the log records a checksum of the initial weights).

bfloat16 runs keep bfloat16 parameters (what the MoE kernels take) and float32 master weights in the
optimizer (AdamW). Checkpoints hold the model, the optimizer (masters included), the step and the loss
history; resuming continues exactly where the run stopped.

Defaults: ``PRESETS["cuda"]`` on a GPU (bf16), ``PRESETS["cpu"]`` without one (float32, a tiny model
on blazecore's NumPy reference path).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime as _dt
import functools
import hashlib
import json
import math
import os
import pathlib
import platform
import resource
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from blazecore_torch import MoELayer
from torch import nn

import blazecore
from blazecore.layer import check_weight_layout

from . import baselines as _baseline
from . import distributed, info
from .corpus import SyntheticLanguage

__all__ = ["PRESETS", "ConfigError", "MoETransformer", "TrainConfig", "resolve", "run"]

CHECKPOINT_FILE = "checkpoint.pt"
LOG_FORMAT = "blazecore-train-log/1"
CKPT_FORMAT = "blazecore-train-checkpoint/1"
IMPLS = ("blazecore", "conventional", "grouped_mm")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
# fields that fix the model's parameters: a checkpoint resumes only with the same values
MODEL_FIELDS = ("seq_len", "d_model", "n_layers", "n_heads", "num_experts", "top_k", "expert_hidden", "activation",
                "corpus_seed", "weight_layout", "ffn_bias")
# fields of one invocation that a resumed run does not take from the checkpoint
TRANSIENT_FIELDS = ("device", "resume", "stop_at")

PRESETS = {
    # CPU: blazecore's NumPy reference path; 1024 tokens per step, ~1 min on two cores
    "cpu": {"steps": 150, "batch": 16, "seq_len": 64, "d_model": 64, "n_layers": 2, "n_heads": 4, "num_experts": 8,
            "top_k": 2, "expert_hidden": 64, "lr": 5e-3, "warmup": 10, "eval_batches": 4, "corpus_tokens": 300_000,
            "log_every": 1},
    # GPU (bf16): 16k tokens per step through 4 MoE layers of E=16 experts, K=4, d=h=1024
    "cuda": {"steps": 600, "batch": 32, "seq_len": 512, "d_model": 1024, "n_layers": 4, "n_heads": 16,
             "num_experts": 16, "top_k": 4, "expert_hidden": 1024, "lr": 1e-3, "warmup": 30, "eval_batches": 8,
             "corpus_tokens": 4_000_000, "log_every": 10},
}


@dataclasses.dataclass
class TrainConfig:
    """Everything a run depends on. ``run`` fills it from a preset, a checkpoint and the caller's options."""

    steps: int
    batch: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    num_experts: int
    top_k: int
    expert_hidden: int
    lr: float
    warmup: int
    eval_batches: int
    corpus_tokens: int
    log_every: int  # steps between reads of the loss (a device synchronisation) and progress updates
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    activation: str = "swiglu"
    weight_layout: str = "out_in"  # how the experts' projections are stored ("in_out": transposed, as gpt-oss)
    ffn_bias: bool = False  # expert biases (gpt-oss's experts have them)
    checkpoint_policy: str = "ab"
    chunks: int | str = 1  # token chunks of the blazecore layers (an int, or "auto": the memory planner)
    impl: str = "blazecore"
    seed: int = 0
    corpus_seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    ckpt_dir: str | None = None
    ckpt_every: int = 200
    resume: bool = False
    log: str | None = None
    sample_tokens: int = 32
    cpu_threads: int = 1  # CPU runs: threads of torch and of NumPy's OpenBLAS (0: leave them as they are)
    stop_at: int | None = None  # end this invocation after that step (with a checkpoint); --resume continues
    ep: int = 1  # expert-parallel size under torchrun (blazecore_app.distributed)

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len


# the model fields' defaults, for checkpoints written before a field existed
_MODEL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)
                   if f.name in MODEL_FIELDS and f.default is not dataclasses.MISSING}


class ConfigError(ValueError):
    """A bad option or an incompatible checkpoint; the message is for the user."""


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, n_heads: int, *, device=None, dtype=None):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d, 3 * d, bias=False, device=device, dtype=dtype)
        self.proj = nn.Linear(d, d, bias=False, device=device, dtype=dtype)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, d/H)
        return self.proj(o.transpose(1, 2).reshape(B, T, d))


class Block(nn.Module):
    def __init__(self, cfg: TrainConfig, *, device=None, dtype=None):
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        d = cfg.d_model
        self.norm1 = nn.RMSNorm(d, eps=1e-6, **fk)
        self.attn = CausalSelfAttention(d, cfg.n_heads, **fk)
        self.norm2 = nn.RMSNorm(d, eps=1e-6, **fk)
        if cfg.impl == "blazecore":
            self.moe = MoELayer(d, cfg.expert_hidden, cfg.num_experts, cfg.top_k, activation=cfg.activation,
                                checkpoint=cfg.checkpoint_policy, chunks=cfg.chunks, weight_layout=cfg.weight_layout,
                                bias=cfg.ffn_bias, **fk)
        else:
            self.moe = _baseline.BaselineMoELayer(d, cfg.expert_hidden, cfg.num_experts, cfg.top_k,
                                                  activation=cfg.activation, implementation=cfg.impl,
                                                  weight_layout=cfg.weight_layout, bias=cfg.ffn_bias, **fk)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        y, aux = self.moe(self.norm2(x))
        return x + y, aux


class MoETransformer(nn.Module):
    """Decoder-only language model with MoE feed-forward layers.

    ``forward(idx)`` takes token ids (B, T) int64 and returns (logits (B, T, V) in the parameters' dtype,
    aux) with aux = {"load_balancing_loss", "z_loss"}: means over the layers, 0-d tensors.
    """

    def __init__(self, cfg: TrainConfig, vocab_size: int, *, device=None, dtype=None):
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ConfigError(f"d_model = {cfg.d_model} is not a multiple of n_heads = {cfg.n_heads}")
        fk = {"device": device, "dtype": dtype}
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, cfg.d_model, **fk)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model, **fk)
        self.blocks = nn.ModuleList(Block(cfg, **fk) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=1e-6, **fk)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.embed(idx) + self.pos(torch.arange(T, device=idx.device))
        lb, z = [], []
        for block in self.blocks:
            x, aux = block(x)
            lb.append(aux["load_balancing_loss"])
            z.append(aux["z_loss"])
        logits = F.linear(self.norm(x), self.embed.weight)  # tied head
        return logits, {"load_balancing_loss": torch.stack(lb).mean(), "z_loss": torch.stack(z).mean()}


def init_parameters(model: nn.Module, cfg: TrainConfig) -> str:
    """GPT-2 style initialisation from a CPU generator seeded with ``cfg.seed``, parameters in name order.

    Norm weights 1; output projections (attention ``proj``, expert ``down_proj``) N(0, 0.02 / sqrt(2 n_layers));
    everything else N(0, 0.02). The values are drawn in float32 on the CPU and copied in, so they depend
    on neither the device nor the MoE implementation. Returns the SHA-256 of the drawn values.
    """
    gen = torch.Generator().manual_seed(cfg.seed)
    out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or ".norm1." in name or ".norm2." in name:
                value = torch.ones(p.shape)
            else:
                std = out_std if name.endswith(("attn.proj.weight", "moe.down_proj")) else 0.02
                value = torch.randn(p.shape, generator=gen) * std
            digest.update(name.encode())
            digest.update(value.numpy())
            p.copy_(value)
    return digest.hexdigest()


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(all parameters, expert parameters)."""
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj")))
    return total, experts


# ---------------------------------------------------------------------------------------------
# Optimizer: AdamW, over float32 masters for low-precision parameters
# ---------------------------------------------------------------------------------------------


class MasterAdamW:
    """AdamW whose state and master weights are float32 when the parameters are bfloat16 (float32 and
    float64 parameters are updated in place); gradients are clipped by their global norm first."""

    def __init__(self, params, *, lr: float, weight_decay: float, betas=(0.9, 0.95)):
        self.params = list(params)
        self.low = any(p.dtype in (torch.bfloat16, torch.float16) for p in self.params)
        if self.low:
            self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        else:
            self.masters = self.params
        fused = all(m.is_cuda for m in self.masters) and all(m.dtype == torch.float32 for m in self.masters)
        self.opt = torch.optim.AdamW(self.masters, lr=lr, betas=betas, weight_decay=weight_decay,
                                     **({"fused": True} if fused else {}))

    def step(self, lr: float, clip: float) -> torch.Tensor:
        if self.low:
            for p, m in zip(self.params, self.masters, strict=True):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        norm = torch.nn.utils.clip_grad_norm_(self.masters, clip) if clip > 0 else torch.zeros(())
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.low:
            with torch.no_grad():
                for p, m in zip(self.params, self.masters, strict=True):
                    p.copy_(m)
        return norm

    def state_dict(self) -> dict:
        return {"opt": self.opt.state_dict(), "masters": [m.detach() for m in self.masters] if self.low else None}

    def load_state_dict(self, state: dict) -> None:
        if self.low:
            if state.get("masters") is None:  # a float32 checkpoint resumed in bf16: masters from the weights
                state = {**state, "masters": [p.detach().float() for p in self.params]}
            with torch.no_grad():
                for m, s in zip(self.masters, state["masters"], strict=True):
                    m.copy_(s)
        self.opt.load_state_dict(state["opt"])


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_lr_ratio * lr`` at ``steps``."""
    if cfg.warmup > 0 and step <= cfg.warmup:
        return cfg.lr * step / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    t = min(1.0, (step - cfg.warmup) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _corpus(seed: int, n_tokens: int) -> tuple:
    lang = SyntheticLanguage(seed)
    return lang, lang.generate(n_tokens)


class Data:
    """Train/validation splits of the corpus and the batches of each step."""

    def __init__(self, cfg: TrainConfig):
        self.lang, ids = _corpus(cfg.corpus_seed, cfg.corpus_tokens)
        n_val = len(ids) // 10
        self.train, self.val = ids[:-n_val], ids[-n_val:]
        if len(self.val) <= cfg.seq_len + 1:
            raise ConfigError(f"corpus_tokens = {cfg.corpus_tokens} is too small for seq_len = {cfg.seq_len}")
        self.batch, self.seq_len, self.seed = cfg.batch, cfg.seq_len, cfg.seed

    def _windows(self, ids: np.ndarray, rng: np.random.Generator, device) -> tuple:
        starts = rng.integers(0, len(ids) - self.seq_len - 1, size=self.batch)
        idx = starts[:, None] + np.arange(self.seq_len + 1)
        w = torch.from_numpy(ids[idx].astype(np.int64))
        if torch.device(device).type == "cuda":
            # pinned and asynchronous: a pageable copy would wait for the previous step's kernels
            w = w.pin_memory().to(device, non_blocking=True)
        return w[:, :-1], w[:, 1:]

    def train_batch(self, step: int, device) -> tuple:
        """(inputs, targets) (batch, seq_len) int64 of ``step``: a function of (seed, step) only."""
        return self._windows(self.train, np.random.default_rng([self.seed, step]), device)

    def val_batches(self, n: int, device):
        """The same ``n`` validation batches for every run and seed."""
        rng = np.random.default_rng(12345)
        return [self._windows(self.val, rng, device) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# Progress, memory
# ---------------------------------------------------------------------------------------------


class ProgressBar:
    """One line per update on a terminal (rewritten in place), otherwise a line every ``every`` steps."""

    def __init__(self, total: int, stream=None, every: int = 1, width: int = 20):
        self.total, self.every, self.width = total, max(1, every), width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self.first = None
        self._last_len = 0

    @staticmethod
    def _clock(s: float) -> str:
        s = int(max(0, s))
        return f"{s // 60}:{s % 60:02d}"

    def update(self, step: int, fields: str) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = (step, now)
        done = step / self.total if self.total else 1.0
        fill = int(self.width * done)
        s0, t0 = self.first
        eta = (now - t0) / (step - s0) * (self.total - step) if step > s0 else None
        text = (f"step {step:>{len(str(self.total))}}/{self.total} [{'#' * fill}{'.' * (self.width - fill)}] "
                f"{fields} | {self._clock(now - self.t0)}" + (f" < {self._clock(eta)}" if eta is not None else ""))
        if self.tty:
            pad = max(0, self._last_len - len(text))
            self.stream.write("\r" + text + " " * pad)
            self._last_len = len(text)
            self.stream.flush()
        elif step % self.every == 0 or step == self.total:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty and self._last_len:
            self.stream.write("\n")
            self.stream.flush()


def _peak_memory(device) -> tuple[int, str]:
    """(bytes, what they are): torch's peak allocation on CUDA, the process's peak RSS on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "torch.cuda.max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "peak process RSS"


def _openblas_threads():
    """(get, set) functions of the OpenBLAS that NumPy loaded (found through /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in ("scipy_openblas", "openblas"):
            for suffix in ("64_", "_64_", ""):
                get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                put = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                if get is not None and put is not None:
                    return get, put
    return None


@contextlib.contextmanager
def cpu_threads(n: int):
    """Run with ``n`` torch threads and ``n`` OpenBLAS threads (NumPy's), restoring both afterwards.

    blazecore's CPU reference path alternates NumPy (OpenBLAS thread pool) and torch (OpenMP pool) in
    every layer; the two pools' waiting threads compete for the cores. Measured on a 2-core machine: 0.23 s
    per step of the CPU preset with one thread each, 2.1 s with the defaults.
    """
    if n < 1:
        yield
        return
    prev_torch = torch.get_num_threads()
    blas = _openblas_threads()
    prev_blas = blas[0]() if blas else None
    torch.set_num_threads(n)
    if blas:
        blas[1](n)
    try:
        yield
    finally:
        torch.set_num_threads(prev_torch)
        if blas:
            blas[1](prev_blas)


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _fmt_rate(r: float | None) -> str:
    if r is None:
        return "- tok/s"
    return f"{r / 1e6:.2f}M tok/s" if r >= 1e6 else f"{r / 1e3:.1f}k tok/s"


def _fmt_count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"--device {name}: expected auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: torch {torch.__version__} sees no CUDA GPU")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name}: only cpu and cuda are supported")
    return dev


def _checkpoint_path(cfg_dir: str | None) -> pathlib.Path | None:
    return None if not cfg_dir else pathlib.Path(cfg_dir) / CHECKPOINT_FILE


def make_config(options: dict, device: torch.device, checkpoint: dict | None = None) -> TrainConfig:
    """Preset for the device, then the checkpoint's configuration (when resuming), then ``options``."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"unknown training options: {', '.join(unknown)}")
    values = dict(PRESETS[device.type])
    if checkpoint is not None:
        saved = checkpoint["config"]
        saved = {**_MODEL_DEFAULTS, **saved}  # (fields added since the checkpoint was written: their defaults)
        clash = [k for k in MODEL_FIELDS if k in options and options[k] != saved[k]]
        if clash:
            raise ConfigError("the checkpoint's model differs: " + ", ".join(f"{k} {saved[k]} (asked {options[k]})"
                                                                            for k in clash))
        values.update({k: v for k, v in saved.items() if k in known and k not in TRANSIENT_FIELDS})
    values.update(options)
    values["device"] = str(device)
    cfg = TrainConfig(**values)
    if cfg.dtype == "auto":
        cfg.dtype = "bfloat16" if device.type == "cuda" else "float32"
    _check_config(cfg, device)
    return cfg


def _check_config(cfg: TrainConfig, device: torch.device) -> None:
    positive = ("steps", "batch", "seq_len", "d_model", "n_layers", "n_heads", "num_experts", "top_k", "expert_hidden",
                "corpus_tokens", "log_every")
    bad = [f"{k} = {getattr(cfg, k)}" for k in positive if getattr(cfg, k) < 1]
    if bad:
        raise ConfigError("must be >= 1: " + ", ".join(bad))
    if not 1 <= cfg.top_k <= cfg.num_experts:
        raise ConfigError(f"top_k = {cfg.top_k} must be in [1, num_experts = {cfg.num_experts}]")
    if cfg.dtype not in DTYPES:
        raise ConfigError(f"dtype {cfg.dtype!r}: expected one of {', '.join(DTYPES)}")
    if cfg.dtype == "float64" and device.type != "cpu":
        raise ConfigError("float64 runs only on the CPU (blazecore's float64 path is its NumPy reference)")
    if cfg.impl not in IMPLS:
        raise ConfigError(f"impl {cfg.impl!r}: expected one of {', '.join(IMPLS)}")
    try:
        blazecore.activation_info(cfg.activation)  # the names of ACTIVATIONS, and the gated ones + "_interleaved"
        check_weight_layout(cfg.weight_layout)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.impl != "blazecore" and not _baseline.supports_activation(cfg.activation):
        raise ConfigError(f"activation {cfg.activation!r}: the baselines take {', '.join(_baseline.ACTIVATIONS)} "
                          "and the gated ones + _interleaved")
    if cfg.checkpoint_policy not in blazecore.CHECKPOINTS:
        raise ConfigError(f"checkpoint policy {cfg.checkpoint_policy!r}: expected one of "
                          f"{', '.join(blazecore.CHECKPOINTS)}")
    if cfg.d_model % cfg.n_heads:
        raise ConfigError(f"d_model = {cfg.d_model} is not a multiple of n_heads = {cfg.n_heads}")
    if cfg.resume and not cfg.ckpt_dir:
        raise ConfigError("--resume needs --ckpt DIR")
    if not cfg.lr > 0:
        raise ConfigError(f"lr = {cfg.lr:g} must be > 0")
    non_negative = ("warmup", "weight_decay", "grad_clip", "aux_loss_coef", "z_loss_coef", "eval_batches",
                    "sample_tokens", "cpu_threads")
    bad = [f"{k} = {getattr(cfg, k)}" for k in non_negative if not getattr(cfg, k) >= 0]
    if bad:
        raise ConfigError("must be >= 0: " + ", ".join(bad))
    if cfg.ckpt_every < 1:
        raise ConfigError(f"ckpt_every = {cfg.ckpt_every} must be >= 1")
    if cfg.stop_at is not None and cfg.stop_at < 0:
        raise ConfigError(f"stop_at = {cfg.stop_at} must be >= 0")
    if not (cfg.chunks == "auto" or (isinstance(cfg.chunks, int) and not isinstance(cfg.chunks, bool)
                                     and cfg.chunks >= 1)):
        raise ConfigError(f"chunks = {cfg.chunks!r} must be an int >= 1 or auto")
    if cfg.ep < 1 or cfg.num_experts % cfg.ep or (cfg.ep > 1 and cfg.impl != "blazecore"):
        raise ConfigError(f"--ep {cfg.ep} needs blazecore's layers and must divide num_experts = {cfg.num_experts}")
    if cfg.impl == "grouped_mm":
        why = _grouped_mm_unavailable(cfg, device)
        if why is not None:
            raise ConfigError(f"--baseline grouped_mm: {why}")


def _grouped_mm_unavailable(cfg: TrainConfig, device: torch.device) -> str | None:
    """Why the grouped_mm baseline cannot run this configuration here (a cached probe on the device), or None."""
    dtype = DTYPES[cfg.dtype]
    rows = 2 * cfg.expert_hidden if blazecore.activation_info(cfg.activation) else cfg.expert_hidden
    x = torch.empty(1, cfg.d_model, device=device, dtype=dtype)
    w13 = torch.empty(1, rows, cfg.d_model, device=device, dtype=dtype)
    w2 = torch.empty(1, cfg.d_model, cfg.expert_hidden, device=device, dtype=dtype)
    return _baseline.grouped_mm_unsupported(x, w13, w2)


# ---------------------------------------------------------------------------------------------
# Checkpoints and the log
# ---------------------------------------------------------------------------------------------


def _atomic_save(obj, path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: pathlib.Path) -> dict:
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if ckpt.get("format") != CKPT_FORMAT:
        raise ConfigError(f"{path} is not a blazecore training checkpoint (format {ckpt.get('format')!r})")
    return ckpt


def _write_json(path: str, doc: dict) -> None:
    p = pathlib.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, p)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def _describe_impl(cfg: TrainConfig) -> str:
    if cfg.impl == "blazecore":
        return f"blazecore MoELayer (checkpoint policy {cfg.checkpoint_policy})"
    if cfg.impl == "conventional":
        return ("baseline: conventional PyTorch MoE (argsort, gathered copy, per-expert loop, unfused activation, "
                "index_add)")
    return "baseline: PyTorch MoE on torch._grouped_mm (argsort, gathered copy, unfused activation, index_add)"


@torch.no_grad()
def evaluate(model: nn.Module, batches: list) -> float:
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        logits, _ = model(x)
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(_loss_dtype(logits)), y.reshape(-1)))
    model.train(was_training)
    return total / max(1, len(batches))


def _loss_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


@torch.no_grad()
def sample(model: nn.Module, lang: SyntheticLanguage, n_tokens: int, seq_len: int, device, seed: int) -> str:
    """``n_tokens`` words sampled (temperature 0.8) after an ``<eos>``, decoded."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    ids = [0]
    for _ in range(n_tokens):
        ctx = torch.tensor([ids[-seq_len:]], dtype=torch.int64, device=device)
        logits, _ = model(ctx)
        probs = torch.softmax(logits[0, -1].double().cpu() / 0.8, dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=gen)))
    model.train(was_training)
    return lang.decode(ids[1:])


def resolve(options: dict) -> tuple:
    """(config, device, checkpoint or None, checkpoint path or None) of a run with ``options``."""
    device = resolve_device(options.get("device", "auto"))
    ckpt_path = _checkpoint_path(options.get("ckpt_dir"))
    checkpoint = None
    if options.get("resume"):
        if ckpt_path is None:
            raise ConfigError("--resume needs --ckpt DIR")
        if ckpt_path.exists():
            checkpoint = load_checkpoint(ckpt_path)
    return make_config(options, device, checkpoint), device, checkpoint, ckpt_path


def run(options: dict, *, out=None, err=None) -> dict:
    """Train with ``options`` (``TrainConfig`` field names; missing ones come from the preset of the device,
    or from the checkpoint when resuming). Prints a banner and a summary on ``out`` and the progress bar on
    ``err``; returns the log document (also written to ``cfg.log`` when set).

    Raises:
        ConfigError: bad options or an incompatible checkpoint.
    """
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    par = distributed.setup(options.get("ep", 1), options.get("device", "auto"), ConfigError)  # None without torchrun
    try:
        if par is not None and par.rank != 0:
            out = err = open(os.devnull, "w")  # noqa: SIM115  (rank 0 prints)
        cfg, device, checkpoint, ckpt_path = resolve(options)
        if par is not None and ckpt_path is not None:
            raise ConfigError("--ckpt is not supported under torchrun (each rank holds its own experts)")
        threads = cpu_threads(cfg.cpu_threads) if device.type == "cpu" else contextlib.nullcontext()
        with threads:
            return _train(cfg, device, checkpoint, ckpt_path, out, err, par)
    finally:
        if par is not None:
            par.close()


def _train(cfg: TrainConfig, device: torch.device, checkpoint: dict | None, ckpt_path, out, err, par=None) -> dict:
    def say(text=""):
        print(text, file=out, flush=True)

    dtype = DTYPES[cfg.dtype]
    data = Data(cfg)
    log_path = cfg.log if par is None or par.rank == 0 else None  # under torchrun rank 0 writes the log

    model = MoETransformer(cfg, data.lang.vocab_size, device=device, dtype=dtype)
    init_hash = init_parameters(model, cfg)
    n_params, n_expert = count_parameters(model)
    if par is not None:
        model = par.convert(model)  # every rank built the same weights; each keeps its experts
    opt = MasterAdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    history, val_history, progress_log = [], [], []
    start, wall_before = 0, 0.0
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        start = int(checkpoint["step"])
        history, val_history = list(checkpoint["history"]), list(checkpoint["val"])
        progress_log = list(checkpoint.get("progress", []))
        init_hash = checkpoint.get("init_sha256", init_hash)
        wall_before = float(checkpoint.get("wall_s", 0.0))

    # -- banner ----------------------------------------------------------------------------------
    corpus = data.lang.describe()
    say(f"blazecore train: a MoE transformer language model on the synthetic corpus "
        f"({corpus['vocab_size']} words, {_fmt_count(cfg.corpus_tokens)} tokens, 10% held out)")
    say(f"model: {cfg.n_layers} layers, d={cfg.d_model}, {cfg.n_heads} heads, MoE E={cfg.num_experts} "
        f"K={cfg.top_k} h={cfg.expert_hidden} ({cfg.activation}"
        f"{'' if cfg.weight_layout == 'out_in' else ', weights ' + cfg.weight_layout}"
        f"{', expert biases' if cfg.ffn_bias else ''}); {_fmt_count(n_params)} parameters "
        f"({_fmt_count(n_expert)} in experts), {cfg.dtype}")
    say(f"MoE: {_describe_impl(cfg)}")
    if par is not None:
        say(f"parallel: {par.describe} (torchrun); tokens/s counts every rank")
    say(f"run: {cfg.steps} steps of {cfg.batch} x {cfg.seq_len} = {cfg.tokens_per_step} tokens, AdamW lr {cfg.lr:g} "
        f"(warm-up {cfg.warmup}, cosine), seed {cfg.seed}")
    if device.type == "cuda":
        say(f"device: {torch.cuda.get_device_name(device)} (CUDA)")
        if cfg.impl == "blazecore":
            from blazecore import _compile

            say(f"        the first step compiles blazecore's CUDA kernels with NVRTC (cached in "
                f"{_compile.cache_dir()})")
    else:
        why = "no CUDA GPU found" if not torch.cuda.is_available() else "--device cpu"
        gpu = PRESETS["cuda"]
        path = "blazecore's NumPy reference path" if cfg.impl == "blazecore" else "PyTorch on the CPU"
        say(f"device: CPU ({why}): a tiny configuration on {path}, for checking, not speed. "
            f"On a GPU the default is d={gpu['d_model']}, {gpu['n_layers']} layers, E={gpu['num_experts']}, "
            f"K={gpu['top_k']}, bf16.")
    if checkpoint is not None:
        say(f"resumed from {ckpt_path} at step {start}")
    elif cfg.resume:
        say(f"no checkpoint in {cfg.ckpt_dir}: starting at step 0")

    # -- training --------------------------------------------------------------------------------
    val_set = data.val_batches(cfg.eval_batches, device)
    if not val_history:
        val_history.append({"step": 0, "loss": evaluate(model, val_set)})
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    bar = ProgressBar(cfg.steps, stream=err, every=max(cfg.log_every, cfg.steps // 20))
    model.train()
    pending: list = []
    t_run = time.perf_counter()
    t_mark, step_mark = t_run, start
    resident = None

    def flush(step: int) -> None:
        nonlocal t_mark, step_mark
        if not pending:
            return
        values = torch.stack(pending).tolist()  # one synchronisation per flush
        first = step - len(pending) + 1
        for i, (loss, lm, lb, z) in enumerate(values):
            s = first + i
            history.append({"step": s, "loss": loss, "lm_loss": lm, "lb_loss": lb, "z_loss": z, "lr": lr_at(s, cfg)})
        pending.clear()
        now = time.perf_counter()
        steps, seconds = step - step_mark, now - t_mark
        world = 1 if par is None else par.world
        rate = steps * cfg.tokens_per_step * world / seconds if seconds > 0 else None
        t_mark, step_mark = now, step
        peak, _ = _peak_memory(device)
        progress_log.append({"step": step, "steps": steps, "seconds": seconds, "tokens_per_s": rate,
                             "peak_memory_bytes": peak, "elapsed_s": wall_before + now - t_run})
        bar.update(step, f"loss {history[-1]['lm_loss']:.3f} | {_fmt_rate(rate)} | peak {_fmt_bytes(peak)}")

    def document(status: str) -> dict:
        return _log_document(cfg, status, device, history, val_history, progress_log, init_hash, corpus,
                             n_params, n_expert, start, wall_before + time.perf_counter() - t_run, resident,
                             1 if par is None else par.world)

    def save_checkpoint(step: int) -> None:
        _atomic_save({"format": CKPT_FORMAT, "config": dataclasses.asdict(cfg), "step": step,
                      "model": model.state_dict(), "optimizer": opt.state_dict(), "history": history,
                      "val": val_history, "progress": progress_log, "init_sha256": init_hash,
                      "wall_s": wall_before + time.perf_counter() - t_run}, ckpt_path)
        if log_path:
            _write_json(log_path, document("running"))

    last = cfg.steps if cfg.stop_at is None else max(start, min(cfg.steps, cfg.stop_at))
    for step in range(start + 1, last + 1):
        x, y = data.train_batch(step if par is None else par.batch_step(step), device)
        logits, aux = model(x)
        lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(_loss_dtype(logits)), y.reshape(-1))
        lb, z = aux["load_balancing_loss"], aux["z_loss"]
        loss = lm + cfg.aux_loss_coef * lb.to(lm.dtype) + cfg.z_loss_coef * z.to(lm.dtype)
        loss.backward()
        if par is not None:
            par.reduce_and_clip(model, cfg.grad_clip)  # averaged over the ranks, clipped by the global norm
        opt.step(lr_at(step, cfg), cfg.grad_clip if par is None else 0.0)
        pending.append(torch.stack([t.detach().double() for t in (loss, lm, lb, z)]))
        if resident is None and device.type == "cuda":
            resident = int(torch.cuda.memory_allocated(device))  # weights, masters, optimizer state
        if step % cfg.log_every == 0 or step == last:
            flush(step)
        if ckpt_path is not None and (step % cfg.ckpt_every == 0 or step == last):
            flush(step)
            save_checkpoint(step)
    flush(last)
    bar.close()
    if start >= last:
        say(f"the checkpoint is at step {start}, --steps {cfg.steps}" +
            (f", --stop-at {cfg.stop_at}" if cfg.stop_at is not None else "") + ": nothing to train")
    elif last < cfg.steps:
        say(f"stopped after step {last} of {cfg.steps}" + ("; --resume continues" if ckpt_path else ""))

    # -- summary ---------------------------------------------------------------------------------
    if not val_history or val_history[-1]["step"] != last:
        val_history.append({"step": last, "loss": evaluate(model, val_set)})
    doc = document("done" if last >= cfg.steps else "stopped")
    s = doc["summary"]
    if s["first_loss"] is not None:
        say(f"done: {last} steps; train loss {s['first_loss']:.3f} -> {s['final_loss']:.3f} (mean of the last "
            f"{s['final_window']} steps); validation loss {s['val_first']:.3f} -> {s['val_final']:.3f}")
    say(f"      {_fmt_rate(s['tokens_per_s'])}, peak memory {_fmt_bytes(s['peak_memory_bytes'])} "
        f"({s['memory_kind']}), {s['wall_s']:.1f} s")
    if cfg.sample_tokens > 0:
        text = sample(model, data.lang, cfg.sample_tokens, cfg.seq_len, device, cfg.seed)
        say("sample: " + text.replace("\n", " / "))
    if log_path:
        _write_json(log_path, doc)
        say(f"log: {log_path}")
    if ckpt_path is not None:
        say(f"checkpoint: {ckpt_path}")
    return doc


def _log_document(cfg, status, device, history, val_history, progress_log, init_hash, corpus, n_params, n_expert,
                  resumed_from, wall_s, resident, ranks: int = 1) -> dict:
    """The log (``--log``). ``ranks``: the processes of a torchrun job; tokens/s counts every rank's tokens, as the
    progress bar does."""
    losses = [h["lm_loss"] for h in history]
    window = max(1, min(10, len(losses) // 10)) if losses else 0
    timed = [p for p in progress_log if p["seconds"] > 0]
    # throughput without the first interval (kernel compilation, allocator warm-up) when there are others
    steady = timed[1:] if len(timed) > 1 else timed
    seconds = sum(p["seconds"] for p in steady)
    peak, kind = _peak_memory(device)
    return {
        "format": LOG_FORMAT,
        "status": status,
        "config": dataclasses.asdict(cfg),
        "impl": cfg.impl,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "blazecore": blazecore.__version__,
        "git_commit": info.source_commit()[0],
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "corpus": corpus,
        "parameters": n_params,
        "expert_parameters": n_expert,
        "init_sha256": init_hash,
        "history": history,
        "val": val_history,
        "progress": progress_log,
        "summary": {
            "steps": len(history),
            "resumed_from": resumed_from,
            "first_loss": losses[0] if losses else None,
            "final_loss": sum(losses[-window:]) / window if losses else None,
            "final_window": window,
            "val_first": val_history[0]["loss"] if val_history else None,
            "val_final": val_history[-1]["loss"] if val_history else None,
            "tokens_per_s": (sum(p["steps"] for p in steady) * cfg.tokens_per_step * ranks / seconds
                             if seconds > 0 else None),
            "ranks": ranks,
            "peak_memory_bytes": max([peak] + [p["peak_memory_bytes"] for p in progress_log]),
            "resident_memory_bytes": resident,
            "memory_kind": kind,
            "wall_s": wall_s,
        },
    }
