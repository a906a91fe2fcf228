"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step; on where the device has it.

Why: a batch-1 decode graph of `qwen3-30b-a3b-12l` replayed back to back idles 8.7-8.8% of its
span (`bench.profile`, docs/kernels.md): about 160 kernels a step, each waiting for the one before
it to finish, drain and flush before its own blocks are scheduled. With PDL
(`CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`, sm_90 and later, kept by CUDA-graph
capture as programmatic edges) a kernel's blocks may be scheduled while the kernel before it is
still finishing.

The protocol here is the safe one: every kernel launched with PDL first waits for its predecessor
to complete with its memory visible (`griddepcontrol.wait`), then lets its own successor launch
(`griddepcontrol.launch_dependents`). Nothing reads or writes global memory before the wait, so
no kernel sees a partial result of another, transitively (a kernel starts only after its
predecessor's wait, which followed the kernel before that). What overlaps is a launch and its
blocks' scheduling with the predecessor's tail. Kernels of other libraries (cuBLAS) keep ordinary
stream order on both sides.

On by default since 2026-12-06, for kernels launched (and graphs captured) on devices of compute
capability 9.0 or more, never under Triton's interpreter; `MEGATRON_ROLLOUT_PDL=0` in the
environment when this module is imported (or `ENABLED = False` later) turns it off. A launch asks
`options`: a few attribute tests and one cached lookup per device, no environment read. On the H200
it took the batch-1 decode graph from 1.212 to 1.150 ms per replay (idle 9.1% to 4.9%). Whole
rollouts on an H100 (the seed-1 64-conversation `prefill` trace, 3 interleaved repeats each,
docs/benchmarks.md) took 0.983 and 0.994 of the makespan without it at temperature 1 and 0.994
greedy with n-gram drafts; the GPU tests of the kernels, runner and engine pass with it on.
"""
from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU without Triton: no kernel calls `entry`
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without the grid-dependency intrinsics: launches stay ordinary
    gdc_wait = gdc_launch_dependents = None

ENV = "MEGATRON_ROLLOUT_PDL"
ENABLED = os.environ.get(ENV, "1") != "0"
"""The switch, read from `ENV` once, at import (launches are on the eager hot path)."""
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter, read once at import too (Triton reads it when a kernel is defined)."""
_OFF = {"PDL": False}
_ON = {"PDL": True, "launch_pdl": True}


def enabled(device: torch.device) -> bool:
    """PDL for kernels launched on `device` now."""
    return options(device) is _ON


def options(device: torch.device) -> dict:
    """Launch keywords for a kernel that calls `entry(PDL)` first: its `PDL` constexpr and, when on,
    Triton's `launch_pdl` option. Called at every launch: the device's answer is cached."""
    return _on_device(ENABLED and not INTERPRETING and gdc_wait is not None, device)


@functools.lru_cache(maxsize=None)
def _on_device(allowed: bool, device: torch.device) -> dict:
    """`options` where the switches allow PDL: a CUDA device of compute capability 9.0 or more (`cuda`
    without an index: the device current at the first ask)."""
    if not allowed or device.type != "cuda":
        return _OFF
    index = torch.cuda.current_device() if device.index is None else device.index
    return _ON if torch.cuda.get_device_capability(index)[0] >= 9 else _OFF


if triton is not None and gdc_wait is None:
    @triton.jit
    def entry(PDL: tl.constexpr):
        """Without the intrinsics `options` never asks for PDL: nothing to wait for."""
        pass
elif triton is not None:
    @triton.jit
    def entry(PDL: tl.constexpr):
        """The first statement of a kernel launched with `options`: wait for the kernel before, then
        let the kernel after launch."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
