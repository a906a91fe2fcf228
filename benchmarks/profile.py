"""Where a forward's time goes on the GPU (issue 14), from the torch profiler.

Per forward shape (eager P, eager D, the decode graph):
- `host_ms`: wall time the host spends enqueuing the forward (until every kernel is launched, i.e.
  until an asynchronous P forward first yields its completion poll), against `device_ms`, the
  CUDA-event time from its first to its last kernel. host >= device means the GPU waits for the
  host: the forward is launch-bound, and only fewer launches (fusion, graphs) shorten it.
  The modes of one shape (eager, and piecewise where a bucket holds it) are timed interleaved:
  medians of 3 forwards each, in turn (`forward_profiles`).
- `launches`: kernel launches per forward, and the profiler's op table (count, host time, device
  time per op), top entries by host and by device time.
- `sections`: the forward driven segment by segment (between the boundaries the model yields),
  each segment a `record_function` range: host and device time per layer and site.

`decode_idle`: the GPU's idle share of a decode-only engine replay (issue 14 wants < 5%): the
union of kernel intervals over the window of N engine steps, all requests already decoding;
`--idle-repeats` windows per setting, with and without decode ahead interleaved, summarised by
median, min and max (`summarize_idle`). Split in two: `graph_only`, the same decode graph
replayed back to back with no host between replays (`graph_idle`: the gaps between a graph's own
kernels), and `host_idle_share`, the rest: the time the GPU waits for the host between steps,
idle_share - graph_only's idle share x busy / (1 - graph_only's idle share) / wall (the
in-graph gaps scale with the kernels' busy time).

Run: `python -m benchmarks.profile --out $OUT/profile.json` (GPU only).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.micro import random_inputs
from megatron_rollout.runner.base import SpanInput
from megatron_rollout.runner.cuda import COMPLETION, CudaRunner
from megatron_rollout.types import Phase

log = logging.getLogger(__name__)

LAUNCH_OPS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")


def _device_us(evt, total: bool = False) -> float:
    """An op's device time (its own, or with its children), under either torch's name for it."""
    for name in (("device_time_total", "cuda_time_total") if total else ("self_device_time_total",
                                                                          "self_cuda_time_total")):
        if hasattr(evt, name):
            return float(getattr(evt, name))
    return 0.0


BLOCK = 16
"""The KV cache's block size (tokens)."""
SHAPES = ("P 1x(0+256)", "P 1x(0+1024)", "P 1x(0+2048)", "P 1x(0+4096)", "P 8x(2048+512)",
          "mixed 16x(2047+1) + 1x(0+512)", "D eager 64x(2047+1)")
"""The forwards profiled by default: prefill alone, a mixed step, a decode step run eagerly."""


def parse_shape(text: str) -> tuple[Phase, list[tuple[int, int]]]:
    """'P 8x(2048+512)' or 'mixed 16x(2047+1) + 1x(0+512)' -> the phase the forward runs in (P for a
    name starting 'P', else D: a mixed step travels with the decode rows) and its (past, new) spans,
    each group as `benchmarks.attention` reads one."""
    from benchmarks.attention import parse_shape as group_spans

    label, _, groups = text.strip().partition(" ")
    words = groups.split()
    if words and words[0].isalpha():  # a second word of the name ('D eager 64x(...)')
        groups = groups.split(None, 1)[1] if len(words) > 1 else ""
    try:
        if not label or not groups.strip():
            raise ValueError("no groups")
        spans = [span for group in groups.split("+ ") for span in group_spans(group.replace(" ", ""))]
    except ValueError as exc:
        raise SystemExit(f"shape {text!r}: write 'P|mixed|D [word] Ax(past+new) + Bx(past+new) ...', "
                         f"e.g. 'mixed 16x(2047+1) + 1x(0+512)' ({exc})") from None
    return (Phase.P if label == "P" else Phase.D), spans


def drive(runner: CudaRunner, inputs: list[SpanInput], phase: Phase, label: bool = False) -> tuple[float, float]:
    """One eager forward; returns (host seconds to enqueue it, device seconds). With `label`, each
    segment between two yielded boundaries runs inside a `record_function` range."""
    stream = runner.p_stream if phase is Phase.P else runner.d_stream
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    t0 = time.perf_counter()
    host = None
    gen, at, i = runner.forward_eager(inputs, phase), "embed", 0
    while True:
        ctx = record_function(f"seg{i:02d} {at}") if label and host is None else None
        try:
            if ctx is not None:
                with ctx:
                    point = next(gen)
            else:
                point = next(gen)
        except StopIteration:
            break
        if point == COMPLETION and host is None:
            host = time.perf_counter() - t0
        at, i = f"L{point.layer}.{point.site.value}", i + 1
    host = host if host is not None else time.perf_counter() - t0
    end.record(stream)
    end.synchronize()
    return host, start.elapsed_time(end) / 1e3


def op_table(prof, calls: int, top: int = 25) -> dict[str, Any]:
    """The profiler's ops over `calls` profiled calls: launches per call, the top ops by host and by
    device time, and the `seg*` ranges `drive` labels (totals over the calls)."""
    events = prof.key_averages()
    rows = [{"name": e.key, "count": e.count, "host_us": float(e.self_cpu_time_total), "device_us": _device_us(e)}
            for e in events]
    sections = [{"name": e.key, "count": e.count, "host_us": float(e.cpu_time_total),
                 "device_us": _device_us(e, total=True)} for e in events if e.key.startswith("seg")]
    return {"launches": sum(r["count"] for r in rows if r["name"] in LAUNCH_OPS) / calls,
            "by_host": sorted(rows, key=lambda r: -r["host_us"])[:top],
            "by_device": sorted(rows, key=lambda r: -r["device_us"])[:top],
            "sections": sorted(sections, key=lambda r: r["name"])}


def forward_profiles(runner: CudaRunner, inputs: list[SpanInput], phase: Phase, configs: dict[str, Any],
                     reps: int = 3) -> dict[str, dict[str, Any]]:
    """Per mode (`configs`: name -> RunnerConfig): host and device time, median of `reps` forwards
    with the modes interleaved (after 2 warm-up forwards each), then the profiler's op table."""
    def run(name: str, label: bool = False) -> tuple[float, float]:
        with runner.configured(configs[name]):
            return drive(runner, inputs, phase, label=label)

    for name in configs:  # warm: Triton kernels compiled, cuBLAS heuristics cached, graphs captured
        run(name), run(name)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    for _ in range(reps):
        for name in configs:
            times[name].append(run(name))
    out = {}
    for name in configs:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                run(name, label=True)
        host, device = (statistics.median(t[k] for t in times[name]) for k in (0, 1))
        out[name] = {"host_ms": host * 1e3, "device_ms": device * 1e3, "reps": reps, **op_table(prof, reps)}
    return out


def graph_profile(runner: CudaRunner, rows: int, context: int, rng: np.random.Generator) -> dict[str, Any]:
    cache = runner.cache
    inputs = random_inputs([(context - 1, 1)] * rows, cache.block_size, cache.num_blocks, runner.cfg.vocab_size, rng)
    graph = runner.decode_graph(rows)
    graph.static.fill([i.span for i in inputs], [i.token_ids[0] for i in inputs])
    for _ in range(3):
        graph.graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.graph.replay()
        torch.cuda.synchronize()
    return {"rows": rows, "context": context, **op_table(prof, 5)}


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    busy, last = 0.0, -float("inf")
    for s, e in sorted(intervals):
        if e <= last:
            continue
        busy += e - max(s, last)
        last = e
    return busy


class PhaseClock:
    """Host seconds spent inside chosen callables, by name: each is wrapped on its owner (an
    instance or a module) for the duration of a `with` block, then restored."""

    def __init__(self, targets: dict[str, tuple[object, str]]) -> None:
        self.targets, self.seconds = targets, {name: 0.0 for name in targets}
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> "PhaseClock":
        for name, (owner, attr) in self.targets.items():
            fn = getattr(owner, attr)
            self._saved.append((owner, attr, fn))
            setattr(owner, attr, self._wrap(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, fn in reversed(self._saved):
            setattr(owner, attr, fn)
        self._saved.clear()

    def _wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
        return timed


def _steps(engine, steps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def decode_phases(engine) -> dict[str, tuple[object, str]]:
    """The host phases of an engine step, as `PhaseClock` targets. `runner.forward` only builds
    the generator; `run_to_end` runs it (a graph's refill and launch). With decode ahead the next
    step's refill and launch run in `issue`. The wait for the GPU falls inside `complete`, when it
    reads the draw (`draw` only issues it)."""
    from megatron_rollout.engine import execution

    ex = engine.executor
    phases = {"plan": (engine.coordinator, "plan"), "inputs": (ex, "inputs"),
              "forward (refill + launch)": (execution, "run_to_end"), "draw (issue)": (ex, "draw"),
              "complete (wait + bookkeeping)": (ex, "complete"), "step": (engine, "_step")}
    if ex.ahead is not None:
        phases["issue ahead (refill + launch)"] = (ex.ahead, "issue")
    return phases


def decode_idle(model, rows: int = 64, prompt: int = 512, steps: int = 40, seed: int = 0,
                ahead: str = "auto") -> dict[str, Any]:
    """A decode-only engine window of `steps` steps (every request decoding): wall time per step
    without the profiler, the host's time per phase, and the GPU's busy time from the profiler.
    `ahead`: the engine's `decode_ahead` (auto: the next forward is issued before the host reads
    this one's tokens, in the `issue ahead` phase instead of `forward`)."""
    from megatron_rollout.engine import (
        EngineConfig,
        KVConfig,
        RolloutEngine,
        RunnerConfig,
        SamplingParams,
        SchedulerConfig,
    )

    rng = np.random.default_rng(seed)
    engine = RolloutEngine(model, EngineConfig(
        scheduler=SchedulerConfig("off", max_batch_tokens=rows * prompt, max_decode_rows=rows),
        kv=KVConfig(num_blocks=rows * (prompt // 16 + 32) + 64), runner=RunnerConfig(decode_ahead=ahead), seed=seed))
    engine.runner.capture([engine.runner.bucket(rows)])
    params = SamplingParams(temperature=0.0, max_new_tokens=4 * steps + 16, ignore_stop=True)
    engine.generate([rng.integers(0, model.cfg.vocab_size, prompt).tolist() for _ in range(4)],
                    SamplingParams(temperature=0.0, max_new_tokens=8, ignore_stop=True))  # warm
    for _ in range(rows):
        engine.add_request(rng.integers(0, model.cfg.vocab_size, prompt).tolist(), params)
    for _ in range(8):  # past the prefill: every row decodes
        engine.step()
    clock = PhaseClock(decode_phases(engine))
    plain_s = _steps(engine, steps)
    with clock:
        clocked_s = _steps(engine, steps)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _steps(engine, steps)
    kernels = [(e.time_range.start, e.time_range.end) for e in prof.events()
               if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    busy_ms = _busy_us(kernels) / steps / 1e3
    wall_ms = plain_s / steps * 1e3
    floor = graph_idle(engine.runner, rows, steps)
    return {"rows": rows, "steps": steps, "decode_ahead": ahead, "ahead_taken": engine.stats.ahead_taken,
            "wall_ms_per_step": wall_ms, "graph_only": floor,
            "host_idle_share": host_idle_share(wall_ms, busy_ms, floor["idle_share"]), "clocked_wall_ms_per_step":
            clocked_s / steps * 1e3, "host_ms_per_step": {k: v / steps * 1e3 for k, v in clock.seconds.items()},
            "device_busy_ms_per_step": busy_ms, "idle_share": 1 - busy_ms / wall_ms,
            "top_host_ops_per_step (profiled)": [{"name": r["name"], "host_us": r["host_us"] / steps}
                                                 for r in op_table(prof, steps, top=12)["by_host"]]}


def graph_idle(runner: CudaRunner, rows: int, replays: int) -> dict[str, float]:
    """The idle share no host can remove: the decode graph of `rows` replayed `replays` times back
    to back (no host work between them), the span from its first kernel's start to its last's end
    against the union of its kernels. What is idle there is the gaps between a graph's own kernels;
    an engine window's idle beyond that share is the host's."""
    graph = runner.decode_graph(rows)
    for _ in range(3):
        graph.graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.graph.replay()
        torch.cuda.synchronize()
    kernels = [(e.time_range.start, e.time_range.end) for e in prof.events()
               if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    span = max(e for _, e in kernels) - min(s for s, _ in kernels)
    busy = _busy_us(kernels)
    return {"replays": replays, "span_ms_per_replay": span / replays / 1e3, "busy_ms_per_replay": busy / replays / 1e3,
            "idle_share": 1 - busy / span}


def host_idle_share(wall: float, busy: float, graph_idle_share: float) -> float:
    """The share of `wall` the GPU waits for the host: its idle time less the gaps inside the
    graphs, which come at `graph_idle_share` of a graph's span, i.e. busy x f / (1 - f)."""
    in_graph = busy * graph_idle_share / (1 - graph_idle_share)
    return (wall - busy - in_graph) / wall


IDLE_FIGURES = ("wall_ms_per_step", "device_busy_ms_per_step", "idle_share", "host_idle_share")


def summarize_idle(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """Windows of one setting: each in `repeats`, and the median, min and max of its figures."""
    pick = lambda f: {k: f([r[k] for r in repeats]) for k in IDLE_FIGURES}  # noqa: E731
    return {"n": len(repeats), "median": pick(statistics.median), "min": pick(min), "max": pick(max),
            "repeats": repeats}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.rollout import random_model
    from megatron_rollout.engine.config import RunnerConfig
    from megatron_rollout.kv.paged import PagedKVCache
    from megatron_rollout.model.config import PRESETS

    ap = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b-12l", choices=sorted(PRESETS))
    ap.add_argument("--fused-ops", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--idle-rows", type=lambda v: [int(x) for x in v.split(",")], default=[64, 16, 1])
    ap.add_argument("--idle-repeats", type=int, default=3, help="decode-only windows per setting, interleaved")
    ap.add_argument("--forwards", action=argparse.BooleanOptionalAction, default=True,
                    help="profile the eager and piecewise P, mixed and D forwards")
    ap.add_argument("--shapes", default=";".join(SHAPES),
                    help="the forwards profiled, ';'-separated: 'P Ax(past+new) + ...' (a prefill forward) or "
                         "'mixed ...' / 'D ...' (a decode-phase forward), e.g. 'mixed 48x(20000+1) + 1x(30000+16336)'")
    ap.add_argument("--attention", default="auto", help="the runner's attention: auto | triton | varlen | flash")
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="profile the decode graphs (64 x 2,048 and 1 x 2,048)")
    ap.add_argument("--out", default="runs/profile.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.profile needs a CUDA device")
    cfg, device = PRESETS[args.model], torch.device("cuda")
    model = random_model(cfg, device, seed=0)
    shapes = {name: parse_shape(name) for name in args.shapes.split(";") if name.strip()}
    blocks = max([20_000] + [sum(-(-(p + n) // BLOCK) for p, n in spec) + 16 for _, spec in shapes.values()])
    cache = PagedKVCache(cfg, blocks, BLOCK, cfg.num_query_groups, device=device)
    runner = CudaRunner(model, cache, RunnerConfig(fused_ops=args.fused_ops, attention=args.attention))
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"model": args.model, "fused_ops": runner.fused, "torch": torch.__version__,
                           "device": torch.cuda.get_device_name()}
    piecewise, eager = runner.config, dataclasses.replace(runner.config, prefill_graph_tokens=())
    for name, (phase, spec) in shapes.items() if args.forwards else ():
        inputs = random_inputs(spec, cache.block_size, cache.num_blocks, cfg.vocab_size, rng)
        configs = {"eager": eager, **({"piecewise": piecewise} if runner.prefill_bucket(inputs) is not None else {})}
        for mode, res in forward_profiles(runner, inputs, phase, configs).items():
            out[f"{name} {mode}"] = res
            log.info("%s %s: host %.2f ms, device %.2f ms, %.0f launches", name, mode, res["host_ms"],
                     res["device_ms"], res["launches"])
    if args.graphs:
        out["D graph 64x2048"] = graph_profile(runner, 64, 2048, rng)
        out["D graph 1x2048"] = graph_profile(runner, 1, 2048, rng)
    del runner, cache
    torch.cuda.empty_cache()
    for rows in args.idle_rows:
        runs: dict[str, list[dict[str, Any]]] = {"_no_ahead": [], "": []}
        for _ in range(args.idle_repeats):  # interleaved: without, then with decode ahead (`engine.ahead`)
            for suffix, ahead in (("_no_ahead", "off"), ("", "auto")):
                runs[suffix].append(decode_idle(model, rows=rows, ahead=ahead))
        for suffix, reps in runs.items():
            out[f"decode_idle_{rows}{suffix}"] = idle = summarize_idle(reps)
            log.info("decode-only window, %d rows%s: %s", rows, suffix, {k: idle[k] for k in ("median", "min", "max")})
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
