"""Capture a callable in a CUDA graph and time its replays (shared by the GPU benchmarks)."""

from __future__ import annotations

import torch


@torch.no_grad()
def capture(fn, *args) -> torch.cuda.CUDAGraph:
    """Warm ``fn(*args)`` up on a side stream (compiles, autotunes), then capture it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, iters: int) -> float:
    """Mean milliseconds per replay over ``iters`` back-to-back replays."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters
