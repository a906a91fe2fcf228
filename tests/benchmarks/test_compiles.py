"""CompileCounter: counts Triton compilations through triton.knobs.runtime.jit_post_compile_hook
(a stand-in `triton` module plays Triton's part: the CPU machine has none), chains and restores
an existing hook, falls back to kernel-cache sizes without the knob, and counts dynamo frames."""
from __future__ import annotations

import sys
import types
from collections import defaultdict

import pytest

from benchmarks.compiles import CompileCounter


def _fake_triton(monkeypatch, with_knob: bool = True):
    triton = types.ModuleType("triton")
    knobs = types.ModuleType("triton.knobs")
    knobs.runtime = types.SimpleNamespace(**({"jit_post_compile_hook": None} if with_knob else {}))
    triton.knobs = knobs
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setitem(sys.modules, "triton.knobs", knobs)
    return knobs.runtime


def _compile(runtime, name):
    """What JITFunction._do_compile does after compiling: call the post-compile hook."""
    hook = runtime.jit_post_compile_hook
    if hook is not None:
        hook(key="k", repr=name, fn=types.SimpleNamespace(name=name), compile={}, is_manual_warmup=False,
             already_compiled=False)


def test_counts_triton_compilations_through_the_hook_and_restores_it(monkeypatch):
    runtime = _fake_triton(monkeypatch)
    seen = []
    runtime.jit_post_compile_hook = previous = lambda **kw: seen.append(kw["repr"])
    _compile(runtime, "before")
    with CompileCounter() as outer:
        _compile(runtime, "_decode_partial_kernel")
        with CompileCounter() as inner:
            _compile(runtime, "_prefill_kernel")
        _compile(runtime, "_store_kv_kernel")
    _compile(runtime, "after")
    assert inner.counts.triton == 1 and inner.counts.kernels == ("_prefill_kernel",)
    assert outer.counts.triton == 3 and outer.counts.triton_source == "hook"
    assert seen == ["before", "_decode_partial_kernel", "_prefill_kernel", "_store_kv_kernel", "after"]
    assert runtime.jit_post_compile_hook is previous
    assert outer.counts.to_dict()["total"] == 3


def test_falls_back_to_kernel_cache_sizes_without_the_knob(monkeypatch):
    _fake_triton(monkeypatch, with_knob=False)
    kernels = types.ModuleType("megatron_rollout.kernels.moe_triton")
    kernel = types.SimpleNamespace(device_caches={0: ({"a": 1}, None, None, None)})
    kernels._fc1 = kernel
    monkeypatch.setitem(sys.modules, "megatron_rollout.kernels.moe_triton", kernels)
    with CompileCounter() as counter:
        kernel.device_caches[0][0]["b"] = 2
        kernel.device_caches[1] = ({"c": 3}, None, None, None)
    assert counter.counts.triton == 2 and counter.counts.triton_source == "caches"


def test_no_triton_counts_zero(monkeypatch):
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    with CompileCounter() as counter:
        pass
    assert counter.counts.triton == 0 and counter.counts.triton_source == "none"


def test_counts_dynamo_frames(monkeypatch):
    dynamo = pytest.importorskip("torch._dynamo.utils")
    counters = defaultdict(lambda: defaultdict(int))
    monkeypatch.setattr(dynamo, "counters", counters)
    with CompileCounter() as counter:
        counters["frames"]["ok"] += 2
        counters["stats"]["unique_graphs"] += 1
    assert (counter.counts.dynamo_frames, counter.counts.dynamo_graphs, counter.counts.total) == (2, 1, 2)


@pytest.mark.timeout(60)
def test_micro_timed_counts_only_the_timed_calls(monkeypatch):
    """`benchmarks.micro.timed` runs its warm-up before the counted region: a kernel that compiles on
    its first call reports 0, one that compiles on every call reports one per timed call."""
    from benchmarks import micro

    runtime = _fake_triton(monkeypatch)

    def fake_time_cuda(fn, iters=20, warmup=3, stream=None, hold_cycles=0):  # the CUDA-event timer, no CUDA
        for _ in range(warmup + iters):
            fn()
        return 0.001

    monkeypatch.setattr(micro, "time_cuda", fake_time_cuda)
    calls = []

    def first_call_compiles():
        if not calls:
            _compile(runtime, "_prefill_kernel")
        calls.append(1)

    assert micro.timed(first_call_compiles, iters=5) == (0.001, 0)
    assert micro.timed(lambda: _compile(runtime, "_recompiled"), iters=4, warmup=2) == (0.001, 4)
    calls.clear()
    assert micro.timed(first_call_compiles, iters=3, warmup=0) == (0.001, 1)  # no warm-up: counted
