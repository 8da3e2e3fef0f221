"""The one timer of blazecore's command line and benchmarks: :func:`time_calls` (warm-up calls, then the median
of the repeats and their spread, on CUDA events of torch's or CuPy's stream, or on the wall clock)."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

__all__ = ["CLOCKS", "Timing", "cuda_time", "time_call", "time_calls", "wall_time"]


@dataclass
class Timing:
    """Milliseconds per call: the median of the repeats, with the spread around it and every sample.

    ``spread_ms`` is the interquartile range of the samples (half of them lie within it): a median with a
    spread of a few percent of itself is a figure to compare; a wider one says the machine was busy."""

    median_ms: float
    min_ms: float
    max_ms: float
    spread_ms: float = 0.0
    samples_ms: list = field(default_factory=list)

    @classmethod
    def of(cls, samples_ms) -> Timing:
        ms = [float(v) for v in samples_ms]
        if not ms:
            raise ValueError("no timed samples")
        q = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) > 1 else [ms[0]] * 3
        return cls(statistics.median(ms), min(ms), max(ms), q[2] - q[0], ms)

    def as_dict(self) -> dict:
        return asdict(self)


CLOCKS = ("torch", "cupy", "wall")


def time_calls(fns: dict, *, warmup: int = 3, repeats: int = 10, clock: str = "torch", setup=None, sync=None,
               stream=None, inner: int = 1) -> dict:
    """The benchmarks' one timer: ``{name: Timing}`` of each callable in ``fns`` (name -> fn()).

    Every callable is called ``warmup`` times, then ``repeats`` timed samples are taken, the callables in
    turn within each repeat (interleaved, so a drift of the machine's clock or temperature touches all of
    them alike). A sample covers ``inner`` back-to-back calls and is divided by ``inner``.

    clock:
        "torch": CUDA events on torch's current stream; "cupy": CUDA events on ``stream`` (a CuPy stream;
        default its current one). The events are read after one synchronisation at the end, so repeats run
        back to back; work that ``fn`` launches on other streams is not covered.
        "wall": ``time.perf_counter`` around the calls and ``sync(result)`` (e.g. ``jax.block_until_ready``
        or a stream's synchronize; nothing for CPU work).
    setup: ``setup()`` (untimed) runs before every sample, e.g. to reset the peak-memory counter.
    """
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
    if repeats < 1 or warmup < 0 or inner < 1:
        raise ValueError(f"repeats >= 1, warmup >= 0 and inner >= 1, got {repeats}, {warmup}, {inner}")

    def call(fn):
        out = None
        for _ in range(inner):
            out = fn()
        return out

    def prepare():
        if setup is not None:
            setup()

    if clock == "wall":
        def finish(out):
            if sync is not None:
                sync(out)
    elif clock == "torch":
        import torch

        def finish(out):
            torch.cuda.synchronize()

        def event():
            return torch.cuda.Event(enable_timing=True)

        def record(ev):
            ev.record()

        def elapsed(start, end):
            return start.elapsed_time(end)
    else:
        import cupy

        def finish(out):
            (stream or cupy.cuda.get_current_stream()).synchronize()

        def event():
            return cupy.cuda.Event()

        def record(ev):
            ev.record(stream)

        def elapsed(start, end):
            return cupy.cuda.get_elapsed_time(start, end)

    for _ in range(warmup):
        for fn in fns.values():
            prepare()
            finish(call(fn))
    samples: dict = {name: [] for name in fns}
    if clock == "wall":
        for _ in range(repeats):
            for name, fn in fns.items():
                prepare()
                t0 = time.perf_counter()
                finish(call(fn))
                samples[name].append((time.perf_counter() - t0) * 1e3 / inner)
    else:
        finish(None)
        events: dict = {name: [] for name in fns}
        for _ in range(repeats):
            for name, fn in fns.items():
                prepare()
                start, end = event(), event()
                record(start)
                call(fn)
                record(end)
                events[name].append((start, end))
        finish(None)
        for name, evs in events.items():
            samples[name] = [elapsed(s, e) / inner for s, e in evs]
    return {name: Timing.of(ms) for name, ms in samples.items()}


def time_call(fn, **kw) -> Timing:
    """:func:`time_calls` of one callable."""
    return time_calls({"fn": fn}, **kw)["fn"]


def cuda_time(fn, *, warmup: int = 3, repeats: int = 10, setup=None) -> Timing:
    """:func:`time_call` with CUDA events on torch's current stream."""
    return time_call(fn, warmup=warmup, repeats=repeats, setup=setup, clock="torch")


def wall_time(fn, *, warmup: int = 1, repeats: int = 10) -> Timing:
    """:func:`time_call` on the wall clock (CPU runs)."""
    return time_call(fn, warmup=warmup, repeats=repeats, clock="wall")
