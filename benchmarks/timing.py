"""Timing: eager calls from Python and CUDA-graph replays, each after an L2 flush, as medians of CUDA events.

:func:`time_eager` and :func:`time_graph` are steps 3 and 4 of the method in :mod:`benchmarks.harness`
(:func:`time_queued` replaces step 4 for a call no graph can capture); their
callers have already checked the output (:mod:`benchmarks.correctness`) and flush the L2 by zeroing a buffer of
:data:`FLUSH_BYTES`.
"""

from __future__ import annotations

import numpy as np

from benchmarks.correctness import fill_nan

FLUSH_BYTES = 256 << 20


def stats(times_us) -> dict:
    """Median and spread of a list of samples in µs.

    >>> stats([3.0, 1.0, 2.0])["median_us"]
    2.0
    """
    t = np.asarray(times_us, dtype=np.float64)
    return {"median_us": float(np.median(t)), "p10_us": float(np.percentile(t, 10)),
            "p90_us": float(np.percentile(t, 90)), "min_us": float(t.min()), "samples": int(t.size)}


def synchronize():
    import torch

    torch.cuda.synchronize()


def time_eager(fn, *, flush, warmup: int, samples: int) -> dict:
    """Stats of ``samples`` timed calls of ``fn`` from Python, after ``warmup``: each after zeroing ``flush`` (the
    L2) and a synchronize, timed by CUDA events (the interval includes the host's launch cost)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    for i in range(samples):
        flush.zero_()
        # The GPU is idle when the start event is recorded, so the interval includes the Python call.
        torch.cuda.synchronize()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return stats([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)])


def time_host_loop(fn, *, sync, warmup: int, samples: int, calls: int = 20) -> dict:
    """Stats of the host time per call: each sample is ``calls`` back-to-back calls of ``fn`` timed by the host
    clock, divided by ``calls``, with no flush and no synchronize between them (``sync()`` after each sample).
    What a loop of calls costs the CPU, the GPU queue absorbing the kernels; a call that waits for the GPU
    shows it here."""
    import time

    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(samples):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter_ns() - t0) / 1e3 / calls)
        sync()
    return stats(times)


SPIN_CYCLES_PER_US = 2000
"""GPU clock cycles per µs at most (the H200 boosts to 1.98 GHz): a spin of ``n`` µs waits this many per µs."""


def time_queued(fn, *, flush, warmup: int, samples: int, host_us: float) -> dict:
    """Stats of the GPU time of ``samples`` calls of ``fn`` made from Python, each queued behind a spin kernel.

    For a call no CUDA graph can capture (the numba tier launches on the legacy default stream, outside
    torch's capture). Each sample queues a spin of three times ``host_us`` (the call's eager time, which
    bounds its host cost), then the L2 flush and the start event, then makes the call: the host has queued
    every launch of the call before the GPU reaches the start event, so the events time the GPU work alone,
    as a graph replay's do.
    """
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    spin = int(3 * max(host_us, 50.0) * SPIN_CYCLES_PER_US)
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(samples):
        torch.cuda._sleep(spin)
        flush.zero_()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return stats(times)


def time_graph(fn, check, *, flush, warmup: int, samples: int) -> dict:
    """Stats of ``samples`` replays of ``fn`` captured in a CUDA graph, each after an L2 flush queued ahead of it
    (GPU time: the launch is hidden behind the flush). One replay is checked first, its output filled with NaN
    before it: ``check(y) -> bool``; a replay that fails it is not timed."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fn()
    fill_nan(y)
    graph.replay()
    torch.cuda.synchronize()
    if not check(y):
        return {"error": "replay output differs from the reference"}
    for _ in range(warmup):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    for i in range(samples):
        flush.zero_()
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    del graph, y
    return stats(times)
