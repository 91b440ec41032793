"""The timers of the tune command and of the benchmark (``python -m bench``): GPU time, per-call latency.

Three ways to time a call ``fn``, each giving milliseconds:
- :func:`time_quantiles` / :func:`time_ms`: CUDA events around each call, L2 flushed between calls
  (``triton.testing.do_bench``); a host clock on a CPU;
- :func:`time_graph`: ``fn`` captured once as a CUDA graph and replayed: the GPU time of its kernels alone,
  whatever the host work of a call;
- :func:`time_per_call`: calls back to back between two synchronizations: max(host work, GPU time), what a caller
  waits for.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def time_quantiles(
    fn: Callable[[], object], device: torch.device, warmup_ms: float = 25, rep_ms: float = 100
) -> tuple[float, float, float]:
    """(median, p20, p80) milliseconds of ``fn``: CUDA events with L2 flushed between runs (do_bench), or a host
    clock on CPU."""
    if device.type == "cuda":
        import triton.testing

        med, p20, p80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        return float(med), float(p20), float(p80)
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[2], times[1], times[3]


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median milliseconds of ``fn`` (:func:`time_quantiles`)."""
    return time_quantiles(fn, device)[0]


def time_per_call(
    fn: Callable[[], object],
    device: torch.device,
    loop_ms: float = 50.0,
    min_calls: int = 20,
    max_calls: int = 2000,
    loops: int = 5,
) -> tuple[float, float, float]:
    """(median, p20, p80) milliseconds per call of ``fn`` called back to back, over ``loops`` loops of N calls.

    N makes a loop last about ``loop_ms`` (within [min_calls, max_calls]). Each loop is timed on the host clock
    between two synchronizations, so a call costs max(its host work, its GPU time): the steady-state latency a
    caller sees. Timing each call with CUDA events instead (do_bench) flushes L2 between calls, which hides the
    host work of the next call behind the flush, so it is neither the GPU time nor the latency. The same inputs
    every call: no fresh tensors, which would time the allocator too.
    """
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def loop(n: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        return (time.perf_counter() - t0) * 1e3

    # Warm-up that also finds the cost of a call: batches growing 4x until one lasts a tenth of a loop.
    n = 1
    while (elapsed := loop(n)) < loop_ms / 10 and n < max_calls:
        n *= 4
    calls = max(min_calls, min(max_calls, round(loop_ms * n / max(elapsed, 1e-6))))
    times = sorted(loop(calls) / calls for _ in range(loops))
    return times[len(times) // 2], times[round(0.2 * (len(times) - 1))], times[round(0.8 * (len(times) - 1))]


def capture_graph(fn: Callable[[], object], device: torch.device) -> torch.cuda.CUDAGraph:
    """``fn`` captured as a CUDA graph, after a warm-up on a side stream (as graph capture of autograd requires)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_graph(fn: Callable[[], object], device: torch.device) -> tuple[float, float, float]:
    """(median, p20, p80) milliseconds of ``fn`` captured once as a CUDA graph and replayed (L2 flushed between
    replays).

    This is the GPU time of the kernels alone. Launched from Python, a call whose host work (argument checks,
    dispatch, autograd bookkeeping) takes longer than its kernels leaves the GPU idle, and per-call timing then
    measures the host.
    """
    graph = capture_graph(fn, device)
    # do_bench spends its 25 + 100 ms whatever a replay costs. A replay under 0.2 ms gets 5 + 20 ms: still hundreds
    # of samples (each also zeroes do_bench's 256 MB L2-flush buffer).
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize(device)
    tiny = (time.perf_counter() - t0) * 1e3 / 10 < 0.2
    return time_quantiles(graph.replay, device, *((5, 20) if tiny else (25, 100)))


def gpu_time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """GPU time of ``fn`` in ms: replayed as a CUDA graph (the benchmark's ms column), so that a call's host work
    does not hide its kernels'; do_bench where capture fails; a host clock on a CPU."""
    if device.type == "cuda":
        try:
            return time_graph(fn, device)[0]
        except Exception:
            pass
    return time_ms(fn, device)
