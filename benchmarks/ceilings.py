"""Measured device ceilings: copy bandwidth and bf16 matmul rate (the denominators of every ratio).

Datasheet numbers are leads; the benchmark divides by what this device does in the same run
(METHOD.md): a large device-to-device copy (bytes read + written per second) and a large bf16
matmul on random data (never zeros: they run faster). Times are the median of CUDA-event timed
repetitions after warm-up.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def time_cuda(fn: Callable[[], object], iters: int = 20, warmup: int = 3,
              stream: torch.cuda.Stream | None = None, hold_cycles: int = 0) -> float:
    """Median seconds of `fn` on `stream` (default: current), timed with CUDA events.

    `hold_cycles` > 0: before each start event a spin kernel holds the stream for that many GPU
    cycles, so that the host has enqueued `fn`'s work by the time the start event runs: the
    events then time the device alone, not the host's time to its first launch (which must fit in
    the hold)."""
    stream = stream or torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        stream.synchronize()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if hold_cycles:
                torch.cuda._sleep(hold_cycles)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device | str = "cuda", nbytes: int = 4 << 30) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = time_cuda(lambda: dst.copy_(src), iters=20)
    return 2 * nbytes / seconds


def matmul_rate(device: torch.device | str = "cuda", n: int = 8192) -> float:
    """FLOP/s of an n x n x n bf16 matmul on random data."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    seconds = time_cuda(lambda: torch.matmul(a, b, out=out), iters=10)
    return 2 * n ** 3 / seconds
