"""Micro-benchmarks of the CUDA runner's parts, each against its roofline (GPU only).

- `decode_steps`: one decode iteration (graph replay) at several batch sizes and context lengths,
  against the memory roofline (bytes it must read / measured copy bandwidth), and the same step
  run eagerly (what the graph saves).
- `prefill`: one prefill forward, FLOP/s against the measured matmul rate.
- `segment_gap`: one prefill forward as piecewise graphs, eager, and as one whole CUDA graph: the
  launch cost left per forward and per P segment (issue 14's "eager-vs-graph P segment gap").
- `attention`: the paged decode and prefill kernels alone (achieved bandwidth; Triton vs varlen).
- `experts`: grouped-GEMM experts vs the per-expert loop at decode and prefill sizes.
- `overlap`: a decode replay while a long prefill runs on the other stream, with the D stream at
  high priority, at equal priority, and on disjoint green-context SM partitions (`sm_partition`).

Inputs are random (token ids, block tables as a shuffled permutation, KV filled with noise).
`decode_steps` and `prefill` count the compilations during their timed calls (`timed`; warm-up
calls run before the counted region) and report them per row (`compiles`). Left out: anything
multi-rank, and compile counts for the other parts.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks.bounds import ModelCosts, decode_roofline_s, prefill_flops
from benchmarks.ceilings import time_cuda
from benchmarks.compiles import CompileCounter
from benchmarks.sm_partition import Split, partitions
from megatron_rollout.kernels.layout import KernelPagedBatch, build_layout
from megatron_rollout.kv.paged import SeqSpan
from megatron_rollout.model.layers import run_to_end
from megatron_rollout.runner.base import SpanInput
from megatron_rollout.runner.cuda import CudaRunner
from megatron_rollout.types import Phase

log = logging.getLogger(__name__)


def random_inputs(spec: list[tuple[int, int]], block_size: int, num_blocks: int, vocab: int,
                  rng: np.random.Generator) -> list[SpanInput]:
    """SpanInputs for (past, new) pairs with disjoint random block tables."""
    need = [math.ceil((p + n) / block_size) for p, n in spec]
    if sum(need) > num_blocks:
        raise ValueError(f"{sum(need)} blocks needed, cache has {num_blocks}")
    perm = rng.permutation(num_blocks)
    inputs, at = [], 0
    for (past, new), k in zip(spec, need):
        table = tuple(int(b) for b in perm[at:at + k])
        at += k
        inputs.append(SpanInput(SeqSpan(table, past, new), rng.integers(0, vocab, new).tolist(), sample=True))
    return inputs


def timed(fn, iters: int, warmup: int = 1, stream: torch.cuda.Stream | None = None,
          hold_cycles: int = 0) -> tuple[float, int]:
    """`time_cuda` with its warm-up calls outside the counted region: (median seconds, Triton and
    torch compilations during the timed calls, which must be 0)."""
    if warmup:
        time_cuda(fn, iters=1, warmup=warmup - 1, stream=stream)
    with CompileCounter() as counter:
        seconds = time_cuda(fn, iters=iters, warmup=0, stream=stream, hold_cycles=hold_cycles)
    return seconds, counter.counts.total


def buckets_off(runner: CudaRunner):
    """Inside the block the runner's P and mixed forwards run eagerly (no piecewise graphs)."""
    return runner.configured(dataclasses.replace(runner.config, prefill_graph_tokens=()))


PREFILL_HOLD_CYCLES = 60_000_000
"""GPU cycles (~30 ms at the H200's 1.98 GHz) a spin kernel holds the stream before each held
prefill timing: longer than the host takes to enqueue an eager 4,096-token forward (12.6 ms,
`benchmarks.profile`, 2026-12-02), so the held figure is the GPU's time alone."""


def decode_steps(runner: CudaRunner, costs: ModelCosts, bandwidth: float, points: list[tuple[int, int]],
                 rng: np.random.Generator, iters: int = 30) -> list[dict[str, Any]]:
    """Graph-replayed (and eager) decode step time for each (rows, context) point."""
    out = []
    cache = runner.cache
    for rows, context in points:
        inputs = random_inputs([(context - 1, 1)] * rows, cache.block_size, cache.num_blocks,
                               runner.cfg.vocab_size, rng)
        graph = runner.decode_graph(rows)
        graph.static.fill([i.span for i in inputs], [i.token_ids[0] for i in inputs])
        graph_s, graph_compiles = timed(graph.graph.replay, iters=iters, warmup=3, stream=runner.d_stream)
        with buckets_off(runner):  # else a bucket's piecewise graphs would serve the "eager" step
            eager_s, eager_compiles = timed(lambda: run_to_end(runner.forward_eager(inputs, Phase.D)), iters=5)
        roof = decode_roofline_s(costs, rows, rows * context, bandwidth)
        out.append({"rows": rows, "bucket": graph.rows, "context": context, "graph_ms": graph_s * 1e3,
                    "eager_ms": eager_s * 1e3, "roofline_ms": roof * 1e3, "graph_over_roofline": graph_s / roof,
                    "bytes": costs.decode_bytes(rows, rows * context), "compiles": graph_compiles + eager_compiles})
        log.info("decode rows=%d ctx=%d: %.2f ms (roofline %.2f ms)", rows, context, graph_s * 1e3, roof * 1e3)
    return out


def interleaved(variants: dict[str, Callable[[], tuple[float, int]]], rounds: int) -> tuple[dict, int]:
    """Run each variant's timing (seconds, compilations) once per round, the variants in turn:
    {name: (median, min, max) seconds over the rounds} and the compilations over all of them."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    compiles = 0
    for _ in range(rounds):
        for name, run in variants.items():
            seconds, count = run()
            samples[name].append(seconds)
            compiles += count
    return {name: (statistics.median(v), min(v), max(v)) for name, v in samples.items()}, compiles


def _forward_variants(runner: CudaRunner, inputs: list[SpanInput], iters: int,
                      free: bool) -> dict[str, Callable[[], tuple[float, int]]]:
    """The P forward's timings, each warmed first (compilation and capture outside them): `device`
    as the runner runs it, held; `eager`, the buckets off, held where the runner would take a
    bucket; `free` (if asked), as run and not held."""
    call = lambda: run_to_end(runner.forward(inputs, Phase.P))  # noqa: E731

    def eager_call():
        with buckets_off(runner):
            return call()

    variants = {"device": lambda: timed(call, iters, warmup=0, hold_cycles=PREFILL_HOLD_CYCLES)}
    if free:
        variants["free"] = lambda: timed(call, iters, warmup=0)
    if runner.prefill_bucket(inputs) is not None:
        variants["eager"] = lambda: timed(eager_call, iters, warmup=0, hold_cycles=PREFILL_HOLD_CYCLES)
    for fn in (call, eager_call) if "eager" in variants else (call,):
        fn(), fn()
    return variants


def prefill(runner: CudaRunner, costs: ModelCosts, peak: float, specs: list[list[tuple[int, int]]],
            rng: np.random.Generator, iters: int = 4, rounds: int = 3) -> list[dict[str, Any]]:
    """Time of one P forward for each batch spec [(past, new), ...], as the runner runs it
    (`mode`: piecewise graphs where a bucket holds the tokens, else eager).

    Three figures per spec, timed in `rounds` interleaved rounds of `iters` forwards each (median of
    the rounds' medians, `*_range` their min and max): `ms` from the call's start (the host's layout
    and first launches included, as an engine step pays them when nothing runs before it);
    `device_ms`, the GPU's time alone (`PREFILL_HOLD_CYCLES`: the host has enqueued the forward
    before the start event runs); where the runner runs piecewise graphs, `eager_ms`, the same
    forward with the buckets switched off (held like `device_ms`). Rates are given for each."""
    out = []
    cache = runner.cache
    for spec in specs:
        inputs = random_inputs(spec, cache.block_size, cache.num_blocks, runner.cfg.vocab_size, rng)
        mode = "piecewise" if runner.prefill_bucket(inputs) is not None else "eager"
        times, compiles = interleaved(_forward_variants(runner, inputs, iters, free=True), rounds)
        flops = prefill_flops(costs, spec)
        tokens = sum(n for _, n in spec)
        row: dict[str, Any] = {"spans": spec, "tokens": tokens, "mode": mode, "rounds": rounds, "compiles": compiles}
        for key, name in (("free", "ms"), ("device", "device_ms"), ("eager", "eager_ms")):
            if key in times:
                med, lo, hi = times[key]
                frac = "fraction_of_matmul_peak" if key == "free" else name.replace("_ms", "_fraction_of_matmul_peak")
                row.update({name: med * 1e3, f"{name}_range": [lo * 1e3, hi * 1e3], frac: flops / med / peak})
        seconds = times["free"][0]
        row.update(tokens_per_s=tokens / seconds, tflops=flops / seconds / 1e12)
        out.append(row)
        log.info("prefill %d tokens (%s): %.2f ms, device %.2f ms (%.1f%% of the matmul rate)%s", tokens, mode,
                 row["ms"], row["device_ms"], 100 * row["device_fraction_of_matmul_peak"],
                 f"; eager device {row['eager_ms']:.2f} ms" if "eager_ms" in row else "")
    return out


def segment_gap(runner: CudaRunner, rng: np.random.Generator, token_counts: tuple[int, ...] = (256, 1024, 2048),
                iters: int = 4, rounds: int = 3) -> list[dict[str, Any]]:
    """What launches still cost a P forward: the same one-sequence prefill as the runner runs it
    (piecewise graphs), eagerly (buckets off), and captured whole as one CUDA graph on its fixed
    layout (attention included: no launch between kernels is left to pay). All three held
    (`PREFILL_HOLD_CYCLES`, device time) and interleaved over `rounds`. `gap_ms` = piecewise -
    whole graph, per forward and per P segment (between two boundaries, what a `mux` round
    resumes)."""
    out = []
    cache, stream = runner.cache, runner.p_stream
    for n in token_counts:
        inputs = random_inputs([(0, n)], cache.block_size, cache.num_blocks, runner.cfg.vocab_size, rng)
        variants = _forward_variants(runner, inputs, iters, free=False)
        layout = build_layout([i.span for i in inputs], [i.token_ids for i in inputs], [True], cache.block_size,
                              runner.kernels, runner.q_heads, runner.kv_heads, runner.cfg.kv_channels, runner.device,
                              runner.num_sms)
        attn = KernelPagedBatch(cache, layout, runner.kernels)
        step = lambda: runner.model.step(layout.tokens, layout.positions, attn, Phase.P,  # noqa: E731
                                         logits_index=layout.logits_rows)
        segments = 1
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.stream(stream):
            for _ in step():  # warm on this layout; count the boundaries the forward yields
                segments += 1
            stream.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                run_to_end(step())
        graph.replay()
        variants["whole"] = lambda replay=graph.replay: timed(replay, iters, warmup=0, stream=stream,
                                                               hold_cycles=PREFILL_HOLD_CYCLES)
        times, compiles = interleaved(variants, rounds)
        variants.clear()  # the graph and its pool go with the last reference
        piece, whole = times["device"][0], times["whole"][0]
        row = {"tokens": n, "segments": segments, "rounds": rounds,
               **{f"{k}_ms": v[0] * 1e3 for k, v in (("piecewise", times["device"]), ("whole_graph", times["whole"]),
                                                     ("eager", times.get("eager", (float("nan"),))))},
               **{f"{k}_ms_range": [v[1] * 1e3, v[2] * 1e3] for k, v in (("piecewise", times["device"]),
                                                                         ("whole_graph", times["whole"]))},
               "gap_ms": (piece - whole) * 1e3, "gap_ms_per_segment": (piece - whole) * 1e3 / segments,
               "compiles": compiles}
        if "eager" in times:
            row["eager_gap_ms"] = (times["eager"][0] - whole) * 1e3
        out.append(row)
        log.info("P %d tokens: piecewise %.2f, eager %.2f, whole graph %.2f ms (gap %.2f ms, %.3f per segment)", n,
                 row["piecewise_ms"], row["eager_ms"], row["whole_graph_ms"], row["gap_ms"], row["gap_ms_per_segment"])
    torch.cuda.empty_cache()
    return out


def attention(runner: CudaRunner, rng: np.random.Generator) -> dict[str, Any]:
    """The attention kernels alone on layer 0 of the runner's cache."""
    from megatron_rollout.kernels.registry import resolve_attention

    cache, cfg = runner.cache, runner.cfg
    dev, dt = runner.device, cfg.torch_dtype
    hq, hkv, d = runner.q_heads, runner.kv_heads, cfg.kv_channels
    result: dict[str, Any] = {}

    def run(kernels, inputs):
        layout = build_layout([i.span for i in inputs], [i.token_ids for i in inputs], [True] * len(inputs),
                              cache.block_size, kernels, hq, hkv, d, dev, runner.num_sms)
        n = sum(i.span.new for i in inputs)
        gen = torch.Generator(device=dev).manual_seed(n)  # the same q, k, v for every backend
        q = torch.randn(n, hq, d, device=dev, dtype=dt, generator=gen)
        k = torch.randn(n, hkv, d, device=dev, dtype=dt, generator=gen)
        v = torch.randn(n, hkv, d, device=dev, dtype=dt, generator=gen)
        batch = KernelPagedBatch(cache, layout, kernels)
        seconds = time_cuda(lambda: batch.attend(0, q, k, v), iters=20)
        return seconds, batch.attend(0, q, k, v)

    dec = random_inputs([(2047, 1)] * 64, cache.block_size, cache.num_blocks, cfg.vocab_size, rng)
    seconds, _ = run(runner.kernels, dec)
    kv_bytes = 64 * 2048 * hkv * d * 2 * cache.k.element_size()
    result["decode_64x2048"] = {"ms": seconds * 1e3, "kv_bytes": kv_bytes, "gb_per_s": kv_bytes / seconds / 1e9}
    pre = random_inputs([(2048, 1024)] * 4, cache.block_size, cache.num_blocks, cfg.vocab_size, rng)
    pairs = sum(n * p + n * (n + 1) / 2 for p, n in [(2048, 1024)] * 4)
    flops = 4 * pairs * hq * d
    t_triton, o_triton = run(runner.kernels, pre)
    result["prefill_4x(2048+1024)"] = {"triton_ms": t_triton * 1e3, "triton_tflops": flops / t_triton / 1e12}
    try:
        varlen = resolve_attention("varlen", dev)
        t_var, o_var = run(varlen, pre)
        rel = float((o_var.float() - o_triton.float()).norm() / o_triton.float().norm())
        result["prefill_4x(2048+1024)"].update(varlen_ms=t_var * 1e3, varlen_tflops=flops / t_var / 1e12,
                                               varlen_vs_triton_rel_err=rel)
    except Exception as exc:  # recorded, not fatal: varlen is an alternative
        result["prefill_4x(2048+1024)"]["varlen_error"] = f"{type(exc).__name__}: {exc}"
    return result


def per_expert_loop(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts) -> torch.Tensor:
    """`comm.exchange.compute_local` with one matmul pair per expert instead of the grouped GEMM
    (what the grouped GEMM replaces): x [N, H]; ids, weights [N, k]. Returns [N, H]."""
    from megatron_rollout.comm.exchange import sort_by_expert

    local = ids - experts.first
    mine = (local >= 0) & (local < experts.num_local)
    order, token, counts = sort_by_expert(torch.where(mine, local, experts.num_local), experts.num_local + 1)
    n_mine = sum(counts[:-1])
    if n_mine == 0:
        return torch.zeros_like(x)
    order, token = order[:n_mine], token[:n_mine]
    parts = x[token].split(counts[:-1])
    y = torch.cat([experts.local_experts[k](part) for k, part in enumerate(parts) if counts[k]])
    return torch.zeros_like(x).index_add_(0, token, y * weights.reshape(-1)[order, None])


def experts(runner: CudaRunner, rng: np.random.Generator) -> dict[str, Any]:
    """Grouped-GEMM experts vs the per-expert loop (first MoE layer)."""
    from megatron_rollout.comm.exchange import compute_local
    from megatron_rollout.kernels.moe import routed_experts
    from megatron_rollout.model.layers import MoELayer

    layer = next(m for m in runner.model.modules() if isinstance(m, MoELayer))
    cfg, dev = runner.cfg, runner.device
    out = {}
    for tokens in (64, 8192):
        x = torch.randn(tokens, cfg.hidden_size, device=dev, dtype=cfg.torch_dtype)
        with torch.no_grad():
            w, ids = layer.router(x)
            grouped = time_cuda(lambda: routed_experts(x, ids, w, layer.experts), iters=10)
            try:
                tri = time_cuda(lambda: routed_experts(x, ids, w, layer.experts, "triton", 1 << 30), iters=10) * 1e3
            except Exception as exc:
                tri = f"{type(exc).__name__}: {exc}"
            synced = time_cuda(lambda: compute_local(x, ids, w, layer.experts), iters=5, warmup=1)
            loop = time_cuda(lambda: per_expert_loop(x, ids, w, layer.experts), iters=3, warmup=1)
        out[f"{tokens}_tokens"] = {"grouped_sync_free_ms": grouped * 1e3, "triton_ms": tri,
                                   "grouped_after_host_sort_ms": synced * 1e3, "per_expert_loop_ms": loop * 1e3,
                                   "expert_weight_bytes": layer.experts.stacked()[0].numel() * 3 // 2 * 2}
    return out


def overlap(runner: CudaRunner, rng: np.random.Generator, rows: int = 64, context: int = 2048,
            prefill_spec: list[tuple[int, int]] | None = None, green_sms: tuple[int, ...] = (16, 32)) -> dict:
    """Decode replay latency while a prefill forward runs on the other stream."""
    cache = runner.cache
    spec = prefill_spec or [(0, 4096)] * 4
    p_inputs = random_inputs(spec, cache.block_size, cache.num_blocks // 2, runner.cfg.vocab_size, rng)
    d_inputs = random_inputs([(context - 1, 1)] * rows, cache.block_size, cache.num_blocks // 2,
                             runner.cfg.vocab_size, rng)
    d_inputs = [SpanInput(SeqSpan(tuple(b + cache.num_blocks // 2 for b in i.span.table), i.span.past, 1),
                          i.token_ids, True) for i in d_inputs]
    graph = runner.decode_graph(rows)
    graph.static.fill([i.span for i in d_inputs], [i.token_ids[0] for i in d_inputs])

    def p_forward(stream):
        with torch.cuda.stream(stream):
            return run_to_end(runner.forward_eager(p_inputs, Phase.P))

    def trial(d_stream, p_stream, replays: int = 8) -> dict:
        torch.cuda.synchronize()
        p_start, p_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        p_start.record(p_stream)
        saved = runner.p_stream
        runner.p_stream = p_stream
        try:
            gen = runner.forward_eager(p_inputs, Phase.P)  # the runner's P forward, enqueued without waiting
            while True:
                try:
                    point = next(gen)
                except StopIteration:
                    break
                if point is not None and point.layer == -1:  # completion polls: P is fully enqueued
                    break
        finally:
            runner.p_stream = saved
        p_end.record(p_stream)
        times = []
        for _ in range(replays):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(d_stream)
            with torch.cuda.stream(d_stream):
                graph.graph.replay()
            e.record(d_stream)
            times.append((s, e))
        torch.cuda.synchronize()
        return {"d_ms": [a.elapsed_time(b) for a, b in times], "p_ms": p_start.elapsed_time(p_end)}

    result: dict[str, Any] = {}
    result["d_alone_ms"] = time_cuda(graph.graph.replay, iters=10, stream=runner.d_stream) * 1e3
    result["p_alone_ms"] = time_cuda(lambda: p_forward(runner.p_stream), iters=2, warmup=1) * 1e3
    result["priority"] = trial(runner.d_stream, runner.p_stream)
    result["equal_priority"] = trial(torch.cuda.Stream(runner.device, priority=0), runner.p_stream)
    green: dict[str, Any] = {}
    for d_sms in green_sms:  # disjoint partitions from one driver split (two GreenContext.create overlap)
        split = Split(runner.num_sms - d_sms, d_sms)
        try:
            with partitions("driver", split, runner.device) as pair:
                green[f"d{pair.decode.sms}_p{pair.prefill.sms}"] = trial(pair.decode.stream, pair.prefill.stream)
        except Exception as exc:  # a driver without green contexts is a finding, not the end of the stage
            green[f"d{d_sms}"] = {"error": f"{type(exc).__name__}: {exc}"}
    result["green_contexts"] = green
    return result
