"""The six expert GEMMs of the layer, each against torch._grouped_mm on the same problem pre-gathered.

For each shape and token count (bf16, uniform random top-k routing), one run measures:

* blazecore's six GEMMs as the layer runs them (gathered operands, fused epilogues, every column slice):
  forward+backward through the public PyTorch API (``blazecore_torch.moe_ffn``, checkpoint "ab"), each GEMM's
  kernel time summed per GEMM per call (median over the calls);
* the same six GEMMs by ``torch._grouped_mm`` (CUTLASS's grouped GEMM) on operands already gathered into expert
  order: gemm1 x_g w13^T, gemm2 hcur w2^T, dh' dy_g w2, dx dz w13 (M-grouped, 2-D x 3-D with ``offs``), dw13
  dz^T x_g and dw2 dy_g^T (g hcur) (K-grouped, the 2-D x 2-D ``offs`` form), each in the operand layout that
  runs fastest; no gather, no activation, no combine;
* the layer's forward+backward through ``moe_ffn`` ("ab") and the grouped_mm MoE (sort + gather + grouped_mm +
  index_add, autograd), and the sum of the six grouped_mm GEMMs.

Kernel time (``--clock``): "cupti" (the default) reads every kernel's own start and end from the PyTorch profiler
(CUPTI records CuPy's launches too), both sides alike: blazecore's launches in the layer matched in order with the
launcher calls (a staging copy counts with the GEMM it feeds), grouped_mm's launches of each call summed. "events"
puts CUDA events around every blazecore launch and every grouped_mm call instead (an interval then also holds
whatever the GPU waits for between the two records).
The layer's and the grouped_mm MoE's times are CUDA events around whole forward+backward steps either way, the two
interleaved.

Clock state: the H200 and H100 run these GEMMs at their power limit, so the SM clock falls from about 1.95 GHz on a
cool GPU to 1.5-1.6 GHz after a few seconds of load, and every kernel's time with it (10-15%). Each problem is
therefore timed after ``--warm-seconds`` of load (both layers in turn), in ``--rounds`` rounds (medians over the
rounds), so both sides are timed hot; the layer row records the GPU's clock, power and temperature before the load and
after the timing. ``--order`` sets what a round is. "interleaved" (the default): ``--repeats`` repetitions of one
blazecore forward+backward followed by grouped_mm's six GEMMs in the layer's launch order (gemm1, gemm2, dh', dw2,
dw13, dx; the intermediates of one shape shared), all under one profile, so each GEMM of either side runs within one
step of its counterpart and both see the same clock. "blocks": blazecore's six GEMMs in the layer over the repeats,
then each grouped_mm GEMM ``--repeats`` times back to back (the two sides seconds apart, and grouped_mm's GEMMs never
beside the layer's memory-bound kernels). A problem whose interleaved rounds run out of GPU memory (the six's
operands are held beside the layer's) is timed in the blocks order, and its rows say so (``order``). Each GEMM row
keeps the ratio of every round (``round_ratios``; the table's "rounds" column gives their range): a miss that holds in
every round is the kernel's.

FLOPs per GEMM: gemm1, dx, dw13 4 L K d h (gated); gemm2, dh', dw2 2 L K d h; 18 L K d h in all.
Writes bench/results/gemm_<gpu>.json (or --results-dir) and prints the tables.

Usage (repository root, GPU): python -m bench.bench_gemm [--shapes olmoe,qwen3,fine,mixtral] [--tokens 32k,128k]
"""

from __future__ import annotations

import argparse
import gc
import sys

try:
    from . import _common as common
except ImportError:  # run as a script from bench/
    import _common as common

SHAPES = {"olmoe": (2048, 1024, 64, 8), "qwen3": (2048, 768, 128, 8), "fine": (1536, 256, 128, 8),
          "mixtral": (4096, 14336, 8, 2)}
GEMMS = ("gemm1", "gemm2", "dhcur", "dx", "dw13", "dw2")
# FLOPs of each GEMM in units of L K d h (gated activation: R = 2h)
FLOP_UNITS = {"gemm1": 4, "gemm2": 2, "dhcur": 2, "dx": 4, "dw13": 4, "dw2": 2}


def _grouped_mm_moe():
    from blazecore_app.baselines import grouped_mm_moe

    return grouped_mm_moe


class _PatchedLaunchers:
    """Inside the ``with`` block, every GEMM launcher of blazecore (``_moe_gpu.GEMM_LAUNCHERS``) runs through
    ``self._wrap(orig)``; the originals are back after it."""

    def __init__(self):
        from blazecore import _moe_gpu

        self._mod = _moe_gpu
        self._origs = {n: getattr(_moe_gpu, n) for n in _moe_gpu.GEMM_LAUNCHERS}

    def _wrap(self, orig):
        raise NotImplementedError

    def __enter__(self):
        for n, o in self._origs.items():
            setattr(self._mod, n, self._wrap(o))
        return self

    def __exit__(self, *exc):
        for n, o in self._origs.items():
            setattr(self._mod, n, o)
        return False


def _role_key(which: str) -> str:
    """The GEMM a launcher role stands for (dh' under one name, a staged role as the GEMM it computes, its staging
    included)."""
    from blazecore import _moe_gpu

    return "dhcur" if which in ("dhcur", "dh") else _moe_gpu._STAGED.get(which, which)


class GemmTimer(_PatchedLaunchers):
    """CUDA events around every GEMM launch of blazecore's launchers, on the stream the launch runs on;
    ``per_call()`` gives each GEMM's summed milliseconds per recorded call."""

    def __init__(self):
        super().__init__()
        self.events: list = []  # (call index, which, start, end)
        self.call = -1
        self.on = False

    def _wrap(self, orig):
        def timed(kern, which, grid, stream, *args, **kw):
            if not self.on:
                return orig(kern, which, grid, stream, *args, **kw)
            import cupy

            if stream is None:
                s = cupy.cuda.get_current_stream()
            elif isinstance(stream, int):  # a raw cudaStream_t handle
                s = cupy.cuda.ExternalStream(stream)
            else:
                s = stream
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            e0.record(s)
            out = orig(kern, which, grid, stream, *args, **kw)
            e1.record(s)
            self.events.append((self.call, which, e0, e1))
            return out

        return timed

    def per_call(self) -> dict:
        import statistics

        import cupy

        cupy.cuda.runtime.deviceSynchronize()
        sums: dict = {}
        for call, which, e0, e1 in self.events:
            sums.setdefault(_role_key(which), {}).setdefault(call, 0.0)
            sums[_role_key(which)][call] += cupy.cuda.get_elapsed_time(e0, e1)
        return {k: statistics.median(v.values()) for k, v in sums.items()}


def cuda_kernels(torch, run) -> list:
    """[(start_ns, ms, name)] of every kernel (and memset / copy) the GPU ran during ``run()``, in start order: the
    PyTorch profiler's device records (CUPTI sees CuPy's launches too)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sorted((ev.start_ns(), ev.duration_ns() / 1e6, ev.name()) for ev in prof.profiler.kineto_results.events()
                  if ev.device_type().name == "CUDA")


_GEMM_KERNELS = ("moe_gemm_sm90", "moe_wgrad_sm90", "moe_dhcur_sm90", "moe_gemm<")  # blazecore's expert GEMM kernels
_STAGING_KERNEL = "moe_gather_rows"  # a launcher's staging copy, launched right before its GEMM


class _LauncherLog(_PatchedLaunchers):
    """The roles of blazecore's GEMM launcher calls, in call order, while in the ``with`` block (``.log``)."""

    def __init__(self):
        super().__init__()
        self.log: list = []

    def _wrap(self, orig):
        def logged(kern, which, *a, **kw):
            self.log.append(which)
            return orig(kern, which, *a, **kw)

        return logged


def launcher_kernel_ms(torch, step, calls: int) -> dict:
    """{gemm: median over ``calls`` calls of ``step()`` of its kernels' summed ms}: the launchers' calls are logged in
    order and matched, on the one stream, with blazecore's GEMM kernels in start order; a staging copy goes with the
    GEMM after it (the launcher that stages launches it first)."""

    def run():
        for _ in range(calls):
            step()

    with _LauncherLog() as ll:
        recs = cuda_kernels(torch, run)
    return attribute_kernels(ll.log, recs, calls, key=_role_key)


def attribute_kernels(log: list, recs: list, calls: int, key=lambda w: w) -> dict:
    """{key(role): median over the calls of its kernels' summed ms}, from the launcher calls' roles ``log`` (in
    call order, ``calls`` equal calls) and the device records ``recs`` [(start_ns, ms, name)] in start order: the
    j-th GEMM kernel belongs to the j-th launcher call, a staging copy to the GEMM after it, anything else to none."""
    import statistics

    gemms = [(ms, name) for _, ms, name in recs if any(k in name for k in (*_GEMM_KERNELS, _STAGING_KERNEL))]
    n_gemm = sum(1 for _, name in gemms if _STAGING_KERNEL not in name)
    if calls < 1 or n_gemm != len(log) or len(log) % calls:
        raise RuntimeError(f"{len(log)} launcher calls in {calls} calls but {n_gemm} GEMM kernels recorded")
    per_call = len(log) // calls
    sums: dict = {}
    pending, j = 0.0, 0
    for ms, name in gemms:
        if _STAGING_KERNEL in name:
            pending += ms
            continue
        sums.setdefault(key(log[j]), [0.0] * calls)[j // per_call] += ms + pending
        pending, j = 0.0, j + 1
    return {k: statistics.median(v) for k, v in sums.items()}


def call_kernel_timing(torch, fn, *, warmup: int, repeats: int):
    """Timing of the kernels one ``fn()`` launches (their summed ms a call), from ``repeats`` calls back to back."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()

    def run():
        for _ in range(repeats):
            fn()

    ms = [m for _, m, _ in cuda_kernels(torch, run)]
    if not ms or len(ms) % repeats:
        raise RuntimeError(f"{len(ms)} kernels recorded for {repeats} calls")
    k = len(ms) // repeats
    return common.Timing.of([sum(ms[i * k:(i + 1) * k]) for i in range(repeats)])


def split_interleaved(recs: list, ours_names: list, gmm: list, repeats: int) -> tuple:
    """Split the device records of ``repeats`` repetitions of [blazecore's step, then grouped_mm's GEMMs in turn]
    (one stream, start order) into (blazecore's records, {gemm: [ms of each repetition]}). ``ours_names``: the kernel
    names one step launches, in order; ``gmm``: [(gemm, [kernel names one call launches])] in the order they run.
    Every repetition must show exactly these names in this order: anything else is an error, not a guess."""
    seg = [*ours_names, *(n for _, names in gmm for n in names)]
    if len(recs) != repeats * len(seg):
        raise RuntimeError(f"{len(recs)} kernels recorded for {repeats} repetitions of {len(seg)}")
    ours, theirs = [], {name: [] for name, _ in gmm}
    for r in range(repeats):
        part = recs[r * len(seg):(r + 1) * len(seg)]
        got = [name for _, _, name in part]
        if got != seg:
            i = next(i for i, (a, b) in enumerate(zip(got, seg, strict=True)) if a != b)
            raise RuntimeError(f"repetition {r}: kernel {i} is {got[i][:80]!r}, expected {seg[i][:80]!r}")
        ours += part[:len(ours_names)]
        j = len(ours_names)
        for name, names in gmm:
            theirs[name].append(sum(ms for _, ms, _ in part[j:j + len(names)]))
            j += len(names)
    return ours, theirs


def step_kernel_ms(ours: list, per_step: int, repeats: int) -> list:
    """The summed ms of every kernel of each of ``repeats`` steps, from blazecore's records of them in start order
    (``per_step`` records a step, as :func:`split_interleaved` returns them)."""
    if len(ours) != per_step * repeats:
        raise RuntimeError(f"{len(ours)} kernels recorded for {repeats} steps of {per_step}")
    return [sum(ms for _, ms, _ in ours[r * per_step:(r + 1) * per_step]) for r in range(repeats)]


def interleaved_round(torch, step, gmm_fns: list, repeats: int) -> tuple:
    """One round of the interleaved protocol: ``repeats`` repetitions of blazecore's forward+backward ``step`` and then
    grouped_mm's GEMMs ``gmm_fns`` [(gemm, fn)] one after the other, all under one profile, so that each of
    blazecore's GEMMs and grouped_mm's run within one step of each other, at one clock. Returns ({gemm: blazecore's
    median ms}, {gemm: grouped_mm's median ms}, the median over the repetitions of the summed ms of every kernel of
    blazecore's step: its GEMMs, combines and helper kernels, at the clock of grouped_mm's six)."""
    import statistics

    ours_names = [name for _, _, name in cuda_kernels(torch, step)]  # also a warm call of each side
    gmm = [(name, [n for _, _, n in cuda_kernels(torch, fn)]) for name, fn in gmm_fns]

    def run():
        for _ in range(repeats):
            step()
            for _, fn in gmm_fns:
                fn()

    with _LauncherLog() as ll:
        recs = cuda_kernels(torch, run)
    ours, theirs = split_interleaved(recs, ours_names, gmm, repeats)
    return (attribute_kernels(ll.log, ours, repeats, key=_role_key),
            {name: statistics.median(v) for name, v in theirs.items()},
            statistics.median(step_kernel_ms(ours, len(ours_names), repeats)))


def _problem(torch, d, h, E, K, L, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf = "cuda", torch.bfloat16
    x = (torch.randn(L, d, device=dev, generator=g) * 0.5).to(bf)
    w13 = (torch.randn(E, 2 * h, d, device=dev, generator=g) / d ** 0.5).to(bf)
    w2 = (torch.randn(E, d, h, device=dev, generator=g) / h ** 0.5).to(bf)
    ids = torch.rand(L, E, device=dev, generator=g).topk(K, dim=1).indices.to(torch.int32)
    gates = torch.softmax(torch.randn(L, K, device=dev, generator=g), dim=1)
    dy = (torch.randn(L, d, device=dev, generator=g) * 0.5).to(bf)
    return x, w13, w2, gates, ids, dy


def _pick_layout(torch, gmm, candidates: dict, offs):
    """The fastest (a, b) layout that grouped_mm accepts: {name: (a, b)} -> (name, fn)."""
    best = None
    for name, (a, b) in candidates.items():
        fn = lambda a=a, b=b: gmm(a, b, offs=offs)  # noqa: E731
        try:
            fn()
            torch.cuda.synchronize()
        except (RuntimeError, ValueError, TypeError):
            continue
        t = common.time_call(fn, warmup=1, repeats=3, clock="torch").median_ms
        if best is None or t < best[0]:
            best = (t, name, fn)
    if best is None:
        raise RuntimeError("torch._grouped_mm accepted none of the operand layouts")
    return best[1], best[2]


def pregathered(torch, x, dy, ids, E):
    """(offs, x rows, dy rows) in expert order: grouped_mm's group ends and the operands gathered by slot."""
    K = ids.shape[1]
    flat = ids.reshape(-1).long()
    tok = torch.argsort(flat, stable=True) // K
    offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
    return offs, x[tok].contiguous(), dy[tok].contiguous()


def grouped_mm_cases(torch, x, w13, w2, gates, ids, dy, shared: bool = False) -> dict:
    """{gemm: build()}: each GEMM by torch._grouped_mm on the pre-gathered problem; ``build()`` makes its operands
    (random where the layer's are intermediate) and returns (fn, layout), fn in the operand layout that runs fastest.
    The operands are made per call and dropped with fn, so no more than one GEMM's are held at a time; ``shared``:
    the GEMMs that read an intermediate of one shape share one (gemm2 and dw2 an (L*K, h), dx and dw13 an (L*K, 2h)),
    made once and kept while any fn is, for protocols that hold all six at once."""
    L, d = x.shape
    E, R, _ = w13.shape
    h = R // 2
    K = ids.shape[1]
    gmm = torch._grouped_mm
    offs, xg, dyg = pregathered(torch, x, dy, ids, E)
    gen = torch.Generator(device="cuda").manual_seed(1)

    kept: dict = {}

    def rnd(*shape):
        if shared and shape in kept:
            return kept[shape]
        t = (torch.randn(*shape, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        if shared:
            kept[shape] = t
        return t

    # weight gradients, (L*K, M) and (L*K, N): out[e] = a[e rows]^T b[e rows]; the token dimension must not be the
    # contiguous one: the experts' slot counts are not multiples of 16 bytes, which grouped_mm's TMA operands need
    # along a contiguous grouped dimension (a device assert)
    cases = {
        "gemm1": lambda: {"w^T view": (xg, w13.transpose(-2, -1))},
        "gemm2": lambda: {"w^T view": (rnd(L * K, h), w2.transpose(-2, -1))},
        "dhcur": lambda: {"w": (dyg, w2)},
        "dx": lambda: {"w": (rnd(L * K, R), w13)},
        "dw13": lambda: {"a^T view, b": (rnd(L * K, R).t(), xg)},
        "dw2": lambda: {"a^T view, b": (dyg.t(), rnd(L * K, h))},
    }
    return {name: (lambda make=make: _pick_layout(torch, gmm, make(), offs)[::-1]) for name, make in cases.items()}


def blazecore_step(torch, ops, x, w13, w2, gates, ids, dy):
    """One forward+backward of blazecore through ``moe_ffn`` ("ab"), as a callable."""
    xs, w13s, w2s, gs = (t.detach().requires_grad_() for t in (x, w13, w2, gates))
    disp = ops.build_dispatch(ids, w13.shape[0], validate=False)

    def step():
        y = ops.moe_ffn(xs, w13s, w2s, gs, ids, checkpoint="ab", dispatch=disp)
        return torch.autograd.grad(y, (xs, w13s, w2s, gs), dy)

    return step


def shape_step(torch, ops, shape, L, warm=3):
    """blazecore's forward+backward (:func:`blazecore_step`) on this benchmark's problem of ``shape`` at ``L`` tokens,
    run ``warm`` times first (kernels compiled and loaded)."""
    d, h, E, K = SHAPES[shape]
    step = blazecore_step(torch, ops, *_problem(torch, d, h, E, K, L))
    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    return step


def grouped_mm_step(torch, x, w13, w2, gates, ids, dy):
    """One forward+backward of the grouped_mm MoE (autograd), as a callable."""
    gmm_moe = _grouped_mm_moe()
    xs, w13s, w2s, gs = (t.detach().requires_grad_() for t in (x, w13, w2, gates))

    def step():
        y = gmm_moe(xs, w13s, w2s, gs, ids)
        return torch.autograd.grad(y, (xs, w13s, w2s, gs), dy)

    return step


def blazecore_gemm_ms(torch, step, *, repeats, clock="cupti") -> dict:
    """{gemm: ms per forward+backward} of blazecore's GEMM launches in ``step`` (median over ``repeats`` calls)."""
    step()  # warm
    torch.cuda.synchronize()
    if clock == "cupti":
        return launcher_kernel_ms(torch, step, repeats)
    with GemmTimer() as timer:
        timer.on = True
        for i in range(repeats):
            timer.call = i
            step()
        return timer.per_call()


def heat(torch, fns, seconds: float) -> None:
    """Run the callables in turn for ``seconds``: the GPU reaches the clock its power limit holds under this load
    before anything is timed (on an H200 the SM clock falls from about 1.95 to 1.5-1.6 GHz over the first seconds of
    load, and every kernel with it)."""
    import time

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for fn in fns:
            fn()
        torch.cuda.synchronize()


def round_ratios(ours: list | None, theirs: list) -> list | None:
    """blazecore's time over grouped_mm's, round by round (each round times blazecore's GEMM, then grouped_mm's, close
    together): a miss that holds in every round is the kernel's; one that comes and goes is the clock's drift under the
    power cap. None where the rounds do not pair up (a GEMM missing from some of blazecore's rounds)."""
    if ours is None or len(ours) != len(theirs):
        return None
    return [b / g for b, g in zip(ours, theirs, strict=True)]


LAYER_ORDER = ("gemm1", "gemm2", "dhcur", "dw2", "dw13", "dx")  # the order the layer launches its GEMMs in
ORDERS = ("interleaved", "blocks")


def measure(torch, ops, shape, L, *, warmup, repeats, clock="cupti", warm_s=10.0, rounds=3,
            order="interleaved") -> list:
    """The rows of one (shape, token count): after ``warm_s`` seconds of load, ``rounds`` rounds of timing (medians
    over the rounds), then the two layers' forward+backward interleaved. A round, ``order`` "interleaved" (cupti
    only): ``repeats`` repetitions of blazecore's step followed by grouped_mm's six in the layer's order, under one
    profile (:func:`interleaved_round`); "blocks": blazecore's six GEMMs in the layer over ``repeats`` steps, then
    each of grouped_mm's six ``repeats`` times back to back."""
    import statistics

    if order not in ORDERS or (order == "interleaved" and clock != "cupti"):
        raise ValueError(f"order {order!r} with clock {clock!r}: interleaved needs cupti; orders: {ORDERS}")
    d, h, E, K = SHAPES[shape]
    x, w13, w2, gates, ids, dy = _problem(torch, d, h, E, K, L)
    unit = L * K * d * h
    ours = blazecore_step(torch, ops, x, w13, w2, gates, ids, dy)
    theirs = grouped_mm_step(torch, x, w13, w2, gates, ids, dy)
    cases = grouped_mm_cases(torch, x, w13, w2, gates, ids, dy, shared=order == "interleaved")
    layouts: dict = {}
    fns = []
    if order == "interleaved":
        for name in LAYER_ORDER:
            fn, layouts[name] = cases[name]()
            fns.append((name, fn))
    state0 = common.gpu_state()
    heat(torch, [ours, theirs], warm_s)
    per_r: dict = {}
    ref_r: dict = {}
    step_r: list = []  # interleaved: each round's summed kernel ms of blazecore's step
    for _ in range(rounds):
        if order == "interleaved":
            b_ms, g_ms, step_ms = interleaved_round(torch, ours, fns, repeats)
            step_r.append(step_ms)
            for name, ms in b_ms.items():
                per_r.setdefault(name, []).append(ms)
            for name, ms in g_ms.items():
                ref_r.setdefault(name, []).append(ms)
            continue
        for name, ms in blazecore_gemm_ms(torch, ours, repeats=repeats, clock=clock).items():
            per_r.setdefault(name, []).append(ms)
        for name, build in cases.items():
            fn, layouts[name] = build()
            if clock == "cupti":
                t = call_kernel_timing(torch, fn, warmup=warmup, repeats=repeats)
            else:
                t = common.time_call(fn, warmup=warmup, repeats=repeats, clock="torch")
            ref_r.setdefault(name, []).append(t.median_ms)
            del fn
        gc.collect()
        torch.cuda.empty_cache()
    beside = None
    if order == "interleaved":  # the layer at the clock of the rounds: its steps alternating with grouped_mm's six
        def six_calls(fns=fns):
            for _, fn in fns:
                fn()

        beside = common.time_calls({"blazecore": ours, "six": six_calls}, warmup=warmup, repeats=repeats,
                                   clock="torch")
        del six_calls
    del fns, cases  # (the shared operands too) before the layers are timed against each other
    gc.collect()
    torch.cuda.empty_cache()
    lay = common.time_calls({"blazecore": ours, "grouped_mm_moe": theirs}, warmup=warmup, repeats=repeats,
                            clock="torch")
    state1 = common.gpu_state()
    rows = []
    six = 0.0
    for name in GEMMS:
        flops = FLOP_UNITS[name] * unit
        t_ref = common.Timing.of(ref_r[name])
        six += t_ref.median_ms
        b = statistics.median(per_r[name]) if name in per_r else None
        rows.append({"shape": shape, "tokens": L, "kind": "gemm", "gemm": name, "flops": flops, "clock": clock,
                     "order": order,
                     "blazecore_ms": b, "blazecore_rounds_ms": per_r.get(name),
                     "blazecore_tflops": common.tflops(flops, b),
                     "grouped_mm_ms": t_ref.median_ms, "grouped_mm_spread_ms": t_ref.spread_ms,
                     "grouped_mm_rounds_ms": ref_r[name],
                     "grouped_mm_tflops": common.tflops(flops, t_ref.median_ms), "grouped_mm_layout": layouts[name],
                     "ratio": None if b is None else b / t_ref.median_ms,
                     "round_ratios": round_ratios(per_r.get(name), ref_r[name])})
    layer, t_gmm = lay["blazecore"], lay["grouped_mm_moe"]
    # layer / six: the layer timed in the context its GEMMs were (interleaved: beside grouped_mm's six, against the
    # six's kernel time; blocks: beside the grouped_mm MoE)
    near = layer if beside is None else beside["blazecore"]
    # and like for like: the step's kernels (CUPTI) against the six's, in the same rounds
    step_kernels = statistics.median(step_r) if step_r else None
    flops = 18 * unit
    rows.append({"shape": shape, "tokens": L, "kind": "layer", "flops": flops, "order": order,
                 "blazecore_moe_ffn_ms": layer.median_ms, "blazecore_moe_ffn_spread_ms": layer.spread_ms,
                 "blazecore_moe_ffn_tflops": common.tflops(flops, layer.median_ms),
                 "blazecore_beside_six_ms": None if beside is None else beside["blazecore"].median_ms,
                 "blazecore_beside_six_spread_ms": None if beside is None else beside["blazecore"].spread_ms,
                 # every event-timed sample, so a spread can be read as a drift or as a few slow steps
                 "blazecore_beside_six_samples_ms": None if beside is None else beside["blazecore"].samples_ms,
                 "six_grouped_mm_events_ms": None if beside is None else beside["six"].median_ms,
                 "six_grouped_mm_events_samples_ms": None if beside is None else beside["six"].samples_ms,
                 "six_grouped_mm_ms": six, "six_grouped_mm_tflops": common.tflops(flops, six),
                 "grouped_mm_moe_ms": t_gmm.median_ms, "grouped_mm_moe_spread_ms": t_gmm.spread_ms,
                 "layer_over_six": near.median_ms / six,
                 "blazecore_step_kernels_ms": step_kernels, "blazecore_step_kernels_rounds_ms": step_r or None,
                 "step_kernels_over_six": None if step_kernels is None else step_kernels / six,
                 "grouped_mm_moe_over_layer": t_gmm.median_ms / layer.median_ms,
                 "blazecore_gemms_sum_ms": sum(statistics.median(v) for v in per_r.values()),
                 "gpu_state_before_heat": state0, "gpu_state_after": state1})
    del x, w13, w2, gates, ids, dy, ours, theirs
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def measure_problem(torch, ops, shape, L, *, order, measure_fn=None, **kw) -> list:
    """:func:`measure` in ``order``; where the interleaved order runs out of GPU memory (it holds grouped_mm's six
    GEMMs' operands beside the layer's, about 27 GB more at mixtral 128k), the same problem in the blocks order,
    which holds one GEMM's at a time: its rows say so (``order``)."""
    measure_fn = measure_fn or measure
    try:
        return measure_fn(torch, ops, shape, L, order=order, **kw)
    except Exception as exc:
        if order != "interleaved" or not common.is_oom(exc):
            raise
    gc.collect()
    torch.cuda.empty_cache()
    print(f"{shape} {L}: out of GPU memory in the interleaved order; timed in the blocks order", flush=True)
    return measure_fn(torch, ops, shape, L, order="blocks", **kw)


def _round_range(row) -> str:
    """The lowest and highest per-round ratio of a GEMM row ("-" without them)."""
    rr = row.get("round_ratios")
    return f"{min(rr):.2f}-{max(rr):.2f}" if rr else "-"


def tables(rows) -> str:
    g = [r for r in rows if r["kind"] == "gemm"]
    cols = [("shape", "shape", None), ("tokens", lambda r: common.format_count(r["tokens"]), None),
            ("gemm", "gemm", None), ("blazecore ms", "blazecore_ms", ".3f"), ("TF/s", "blazecore_tflops", ".0f"),
            ("grouped_mm ms", "grouped_mm_ms", ".3f"), ("TF/s ", "grouped_mm_tflops", ".0f"),
            ("ratio", "ratio", ".2f"), ("rounds", _round_range, None)]
    lay = [r for r in rows if r["kind"] == "layer"]
    cols2 = [("shape", "shape", None), ("tokens", lambda r: common.format_count(r["tokens"]), None),
             ("moe_ffn ms beside six", "blazecore_beside_six_ms", ".2f"),
             ("six grouped_mm ms", "six_grouped_mm_ms", ".2f"), ("layer / six", "layer_over_six", ".2f"),
             ("moe_ffn ms beside MoE", "blazecore_moe_ffn_ms", ".2f"),
             ("grouped_mm MoE ms", "grouped_mm_moe_ms", ".2f"),
             ("grouped_mm MoE / layer", "grouped_mm_moe_over_layer", ".2f")]
    return common.format_table(g, cols) + "\n\n" + common.format_table(lay, cols2)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ", ".join(SHAPES))
    ap.add_argument("--tokens", default="32k,128k", help="comma-separated token counts (k = 1024)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--results-dir", default=None, help="where the JSON goes (default bench/results)")
    ap.add_argument("--clock", choices=("cupti", "events"), default="cupti",
                    help="per-GEMM kernel time: the kernels' own durations (cupti) or CUDA events around the launches")
    ap.add_argument("--warm-seconds", type=float, default=10.0,
                    help="seconds of load (both layers in turn) before each problem is timed")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of blazecore's and grouped_mm's GEMMs")
    ap.add_argument("--order", choices=ORDERS, default="interleaved",
                    help="a round: each blazecore step followed by grouped_mm's six, under one profile (interleaved, "
                         "cupti only), or blazecore's steps then each grouped_mm GEMM back to back (blocks)")
    args = ap.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        ap.error(f"--shapes: unknown {', '.join(bad)} (choose from {', '.join(SHAPES)})")
    try:
        args.token_counts = [common.parse_count(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError as exc:
        ap.error(f"--tokens: {exc}")
    if any(n < 1 for n in args.token_counts) or args.warmup < 0 or args.repeats < 1:
        ap.error("--tokens must be >= 1, --warmup >= 0, --repeats >= 1")
    if args.warm_seconds < 0 or args.rounds < 1:
        ap.error("--warm-seconds must be >= 0 and --rounds >= 1")
    if args.order == "interleaved" and args.clock != "cupti":
        ap.error("--order interleaved times the kernels by cupti: use --clock cupti or --order blocks")
    args.shape_list = shapes
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    ok, why = common.cuda_gpu_available()
    if not ok:
        print(f"bench_gemm needs a CUDA GPU: {why}", file=sys.stderr)
        return 1
    import pathlib

    import torch
    from blazecore_torch import ops

    header = common.gpu_header()
    header["bench"] = "gemm"
    header["clock"] = args.clock
    header["warm_seconds"] = args.warm_seconds
    header["rounds"] = args.rounds
    header["order"] = args.order
    common.print_header(header)
    rows = []
    failed = 0
    for shape in args.shape_list:
        for L in args.token_counts:
            try:
                rows += measure_problem(torch, ops, shape, L, warmup=args.warmup, repeats=args.repeats,
                                        clock=args.clock, warm_s=args.warm_seconds, rounds=args.rounds,
                                        order=args.order)
                print(f"{shape} {L}: done", flush=True)
            except Exception as exc:  # the row says what went wrong; the other problems still run
                import traceback

                traceback.print_exc()
                failed += 1
                rows.append({"shape": shape, "tokens": L, "kind": "error",
                             "message": " ".join(f"{type(exc).__name__}: {exc}".split())[:500]})
                gc.collect()
                torch.cuda.empty_cache()
    out_dir = pathlib.Path(args.results_dir) if args.results_dir else None
    path = common.write_json("gemm", header, rows, out_dir)
    print(tables(rows))
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
