"""Timers for kernels on a GPU: what `python -m nanovllm_final.tune` and the benchmarks measure with."""

import statistics
import time

import torch


def cuda_time_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median time of fn() in ms, each repetition timed with a pair of CUDA events.

    Includes the CPU cost of launching (Python wrapper + Triton launcher) when that is
    longer than the GPU work, as in an engine run without CUDA graphs.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_time_ms(fn, reps: int, inner: int = 10) -> float:
    """GPU time of fn() in ms: `inner` calls captured in a CUDA graph, replays timed.

    No launch overhead, as in an engine that captures its decode steps in CUDA graphs.
    """
    for _ in range(3):  # compile / warm up outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    return cuda_time_ms(graph.replay, reps, warmup=2) / inner


def wall_time_ms(fn, reps: int) -> float:
    """Median wall time of fn() in ms, after one warm-up call: a CPU's (the Triton interpreter's) timer."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
