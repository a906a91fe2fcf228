"""`python -m megatron_rollout.bench.rollout`: the one-GPU rollout benchmark (issue 8), one command.

One run measures, on the device it runs on:
1. the ceilings: copy bandwidth and bf16 matmul rate;
2. micro-benchmarks of the CUDA runner (decode step vs its memory roofline at several batch sizes,
   prefill FLOP/s vs the matmul rate, attention and expert kernels, D latency under a concurrent P
   with stream priorities and green contexts): `bench.micro`;
3. a synthetic agentic trace (`trace.make_trace`, the paper's statistics, sized by
   `--conversations` and `--scale`) replayed by the engine under each schedule (`off`, `chunked`,
   `mux` by default), each in a fresh engine over the same model, with the same token ids;
4. lower bounds on the makespan from the trace (`bench.bounds`) and the ratios the issue targets;
5. the Hugging Face transformers continuous-batching peer on the same shape and trace
   (`bench.hf_peer`), bounded in time.

Results go to `<out>/rollout.json` after every stage (a killed run keeps what it measured); a
short table is printed last. `--device cpu --model tiny-moe` runs steps 3-4 on CPU (the CPU test
uses this). Left out: several GPUs, FP8 (the FP8 backend is benchmarked by `model.fp8`'s owner).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_rollout.bench.bounds import model_costs, trace_lower_bound
from megatron_rollout.model.config import PRESETS, ModelConfig
from megatron_rollout.model.transformer import MoETransformer

log = logging.getLogger("megatron_rollout.bench")

TARGETS = {"mux_over_off": 0.75, "mux_over_chunked": 0.9, "mux_decode_wait_ms": 15.0,
           "decode64_over_roofline": 1.3, "mux_over_lower_bound": 1.5}


class ScheduleTimeout(Exception):
    """A schedule ran past its time budget."""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m megatron_rollout.bench.rollout", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b-12l", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--scale", type=float, default=0.3, help="token-count scale of the trace")
    ap.add_argument("--wait-scale", type=float, default=None, help="tool-wait scale (default: --scale)")
    ap.add_argument("--trace-seed", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0, help="weights and input token ids")
    ap.add_argument("--schedules", default="off,chunked,mux",
                    help="comma-separated; 'mux@fixed:K' runs mux with another segment policy")
    ap.add_argument("--max-batch-tokens", type=int, default=4096)
    ap.add_argument("--max-decode-rows", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-gb", type=float, default=40.0, help="KV cache size on CUDA (GiB)")
    ap.add_argument("--num-blocks", type=int, default=None, help="KV blocks (overrides --kv-gb)")
    ap.add_argument("--mux-span", default="load", help="segment policy of plain 'mux': load | fixed:K")
    ap.add_argument("--attention", default="auto", help="auto | triton | varlen | portable")
    ap.add_argument("--schedule-budget-s", type=float, default=150.0)
    ap.add_argument("--micro", action=argparse.BooleanOptionalAction, default=None, help="default: on CUDA")
    ap.add_argument("--hf", action=argparse.BooleanOptionalAction, default=None, help="default: on CUDA")
    ap.add_argument("--hf-budget-s", type=float, default=120.0)
    ap.add_argument("--out", default="runs/bench")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def random_model(cfg: ModelConfig, device: torch.device, seed: int) -> MoETransformer:
    """Random bf16 weights drawn on the device (init_weights draws 8B values on CPU: too slow)."""
    model = MoETransformer(cfg, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.requires_grad_(False)


def _num_blocks(args: argparse.Namespace, cfg: ModelConfig) -> int:
    if args.num_blocks:
        return args.num_blocks
    if args.device == "cpu":
        return 4096
    from megatron_rollout.kv.paged import PagedKVCache

    return int(args.kv_gb * 2 ** 30 // PagedKVCache.bytes_per_block(cfg, args.block_size, cfg.num_query_groups))


def _write(out: Path, result: dict) -> None:
    tmp = out / "rollout.json.tmp"
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(out / "rollout.json")


def trace_summary(trace: list, block_size: int) -> dict[str, Any]:
    from megatron_rollout.trace.schema import group_conversations

    convs = group_conversations(trace)
    contexts = [sum(t.input_tokens + t.output_tokens for t in turns) for turns in convs.values()]
    return {"requests": len(trace), "conversations": len(convs),
            "input_tokens": sum(t.input_tokens for t in trace), "output_tokens": sum(t.output_tokens for t in trace),
            "mean_turns": len(trace) / len(convs), "max_context": max(contexts), "mean_context": float(np.mean(contexts)),
            "total_wait_s": sum(t.wait_ms for t in trace) / 1e3}


def run_micro(model: MoETransformer, cfg: ModelConfig, args, costs, bandwidth: float, peak: float,
              names: tuple[str, ...] = ("decode", "prefill", "attention", "experts")) -> dict:
    from megatron_rollout.bench import micro
    from megatron_rollout.engine.cuda_runner import CudaRunner, CudaRunnerConfig
    from megatron_rollout.kv.paged import PagedKVCache

    rng = np.random.default_rng(args.seed)
    cache = PagedKVCache(cfg, 40_000, args.block_size, cfg.num_query_groups, device=args.device)
    cache.k.normal_()
    cache.v.normal_()
    runner = CudaRunner(model, cache, CudaRunnerConfig(attention=args.attention))
    # the expert-kernel choice is measured per runner: record it next to the stages it served
    out: dict[str, Any] = {"attention_backend": runner.kernels.name,
                           f"expert_kernels_{'+'.join(names)}": runner.expert_kernels}
    stages = [
        ("decode", lambda: micro.decode_steps(runner, costs, bandwidth, [(1, 2048), (16, 2048), (64, 512),
                                                                         (64, 2048), (64, 8192), (128, 2048)], rng)),
        ("prefill", lambda: micro.prefill(runner, costs, peak, [[(0, 4096)], [(0, 2048)] * 4,
                                                                [(2048, 512)] * 8, [(0, 256)]], rng)),
        ("attention", lambda: micro.attention(runner, rng)),
        ("experts", lambda: micro.experts(runner, rng)),
        ("overlap", lambda: micro.overlap(runner, rng)),
    ]
    for name, fn in stages:
        if name not in names:
            continue
        t0 = time.perf_counter()
        try:
            out[name] = fn()
        except Exception as exc:  # one failed micro-benchmark must not cost the rest of the run
            log.exception("micro-benchmark %s failed", name)
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        out[f"{name}_wall_s"] = time.perf_counter() - t0
    stages.clear()  # the closures hold the runner and its cache
    return out


def run_schedule(model: MoETransformer, cfg: ModelConfig, trace: list, spec: str, args) -> dict[str, Any]:
    from megatron_rollout.engine import EngineConfig, RolloutEngine, SamplingParams
    from megatron_rollout.engine.config import EngineStats
    from megatron_rollout.trace.replay import replay
    from megatron_rollout.trace.timeline import Timeline

    schedule, _, span = spec.partition("@")
    config = EngineConfig(schedule=schedule, block_size=args.block_size, num_blocks=_num_blocks(args, cfg),
                          max_batch_tokens=args.max_batch_tokens, max_decode_rows=args.max_decode_rows,
                          mux_span=span or args.mux_span, seed=args.seed)
    engine = RolloutEngine(model, config, timeline=Timeline())
    runner = engine.runner
    t0 = time.perf_counter()
    if hasattr(runner, "capture"):
        runner.capture()
    rng = np.random.default_rng(args.seed)
    warm = [rng.integers(0, cfg.vocab_size, n).tolist() for n in ((700, 300, 1) if args.device != "cpu" else (24, 9, 1))]
    engine.generate(warm, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_stop=True))
    warmup_s = time.perf_counter() - t0
    engine.stats = EngineStats()
    engine.timeline = Timeline()
    if hasattr(runner, "stats"):
        runner.stats = {k: 0 for k in runner.stats}
    if args.device != "cpu":
        torch.cuda.synchronize()

    def expire(signum, frame):
        raise ScheduleTimeout(f"schedule {spec} ran past {args.schedule_budget_s:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, args.schedule_budget_s)
    started = time.perf_counter()
    try:
        report, _ = replay(engine, trace, seed=args.seed, progress=not args.no_progress, vocab_size=cfg.vocab_size,
                           schedule=schedule)
        result: dict[str, Any] = {"report": report.to_dict(), "finished": True}
    except ScheduleTimeout as exc:
        result = {"finished": False, "error": str(exc), "elapsed_s": time.perf_counter() - started}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    stats = engine.stats
    events = engine.timeline.events
    d_starts = sorted(e.start for e in events if e.phase == "D")
    gaps = np.diff(d_starts) if len(d_starts) > 1 else np.zeros(0)
    result.update(
        spec=spec, warmup_s=warmup_s, runner=type(runner).__name__,
        graph_safe=getattr(runner, "graph_safe", None), capture_error=getattr(runner, "capture_error", None),
        attention_backend=getattr(getattr(runner, "kernels", None), "name", None),
        expert_kernels=getattr(runner, "expert_kernels", None),
        runner_stats=dict(getattr(runner, "stats", {})),
        engine_stats={"steps": stats.steps, "decode_iterations": stats.decode_iterations,
                      "prefill_tokens": stats.prefill_tokens, "decode_tokens": stats.decode_tokens,
                      "preemptions": stats.preemptions, "mean_decode_wait_ms": stats.mean_decode_wait_ms},
        decode_interval_ms={"mean": float(gaps.mean() * 1e3) if gaps.size else None,
                            "p50": float(np.median(gaps) * 1e3) if gaps.size else None},
        timeline=_window(events, seconds=3.0))
    del engine, runner
    gc.collect()
    if args.device != "cpu":
        torch.cuda.empty_cache()
    return result


def _window(events, seconds: float) -> list[list]:
    """A few seconds of the timeline from the middle of the run, for the plot: [phase, start, end]."""
    if not events:
        return []
    t0 = min(e.start for e in events)
    t1 = max(e.end for e in events)
    lo = t0 + max(0.0, (t1 - t0) / 2 - seconds / 2)
    return [[e.phase, round(e.start - lo, 6), round(e.end - lo, 6)] for e in events
            if e.end >= lo and e.start <= lo + seconds]


def ratios(result: dict) -> dict[str, float | None]:
    sched = result.get("schedules", {})

    def makespan(name):
        s = sched.get(name, {})
        return s.get("report", {}).get("makespan_s") if s.get("finished") else None

    off, chunked, mux = makespan("off"), makespan("chunked"), makespan("mux")
    out: dict[str, float | None] = {
        "mux_over_off": mux / off if mux and off else None,
        "mux_over_chunked": mux / chunked if mux and chunked else None,
        "mux_decode_wait_ms": sched.get("mux", {}).get("report", {}).get("mean_decode_wait_ms"),
    }
    decode = result.get("micro", {}).get("decode")
    if isinstance(decode, list):
        point = next((p for p in decode if p["rows"] == 64 and p["context"] == 2048), None)
        out["decode64_over_roofline"] = point["graph_over_roofline"] if point else None
    bound = result.get("lower_bound", {}).get("bound_s")
    out["mux_over_lower_bound"] = mux / bound if mux and bound else None
    return out


def table(result: dict) -> str:
    lines = [f"{'schedule':<16}{'makespan_s':>11}{'p99_req_s':>10}{'p99_traj_s':>11}{'ttft_s':>8}"
             f"{'dwait_ms':>9}{'tok/s':>8}"]

    def fmt(v, spec):
        return format(v, spec) if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)) else "-"

    for name, s in result.get("schedules", {}).items():
        r = s.get("report", {})
        if not s.get("finished"):
            lines.append(f"{name:<16} {s.get('error', 'did not finish')}")
            continue
        lines.append(f"{name:<16}{fmt(r.get('makespan_s'), '11.2f')}{fmt(r.get('p99_request_s'), '10.2f')}"
                     f"{fmt(r.get('p99_trajectory_s'), '11.2f')}{fmt(r.get('mean_ttft_s'), '8.3f')}"
                     f"{fmt(r.get('mean_decode_wait_ms'), '9.1f')}{fmt(r.get('tokens_per_s'), '8.0f')}")
    hf = result.get("hf_peer")
    if hf:
        if hf.get("ran") and hf.get("requests_done"):
            lines.append(f"{'hf-cb':<16}{fmt(hf.get('makespan_s'), '11.2f')}{fmt(hf.get('p99_request_s'), '10.2f')}"
                         f"{fmt(hf.get('p99_trajectory_s'), '11.2f')}{'-':>8}{'-':>9}{fmt(hf.get('tokens_per_s'), '8.0f')}"
                         f"  ({hf['requests_done']}/{hf['requests_total']} requests"
                         f"{'' if hf.get('finished') else ', not finished in budget'})")
        else:
            lines.append(f"{'hf-cb':<16} not run: {hf.get('reason') or hf.get('error')}")
    lb = result.get("lower_bound")
    if lb:
        lines.append(f"lower bound {lb['bound_s']:.2f} s (chain {lb['chain_s']:.2f} s, work {lb['work_s']:.2f} s)")
    for key, value in result.get("ratios", {}).items():
        target = TARGETS.get(key)
        verdict = "" if value is None or target is None else ("  ok" if value <= target else "  MISSED")
        lines.append(f"{key:<24}{fmt(value, '8.3f')}  (target <= {target}){verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parser().parse_args(argv)
    out = Path(os.path.expandvars(args.out))
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    micro_on = cuda if args.micro is None else args.micro
    hf_on = cuda if args.hf is None else args.hf
    cfg = PRESETS[args.model]
    result: dict[str, Any] = {
        "command": "python -m megatron_rollout.bench.rollout " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "model": args.model, "args": vars(args)}
    from megatron_rollout.trace.make import make_trace

    trace = make_trace(args.conversations, args.trace_seed, args.scale, args.wait_scale)
    result["trace"] = trace_summary(trace, args.block_size)
    costs = model_costs(cfg)
    bandwidth = peak = None
    if cuda:
        from megatron_rollout.bench.ceilings import copy_bandwidth, matmul_rate

        bandwidth, peak = copy_bandwidth(device), matmul_rate(device)
        result["ceilings"] = {"copy_bytes_per_s": bandwidth, "bf16_matmul_flops": peak}
        log.info("ceilings: copy %.2f TB/s, bf16 matmul %.0f TFLOP/s", bandwidth / 1e12, peak / 1e12)
        max_batch = min(args.conversations, args.max_decode_rows)
        lb = trace_lower_bound(trace, costs, peak, bandwidth, max_batch)
        result["lower_bound"] = {"bound_s": lb.bound_s, "chain_s": lb.chain_s, "chain_conversation": lb.chain_conversation,
                                 "work_s": lb.work_s, "total_flops": lb.total_flops, "total_bytes": lb.total_bytes}
    t0 = time.perf_counter()
    model = random_model(cfg, device, args.seed)
    result["model_build_s"] = time.perf_counter() - t0
    _write(out, result)
    if micro_on:
        result["micro"] = run_micro(model, cfg, args, costs, bandwidth, peak)
        gc.collect()
        torch.cuda.empty_cache()
        _write(out, result)
    result["schedules"] = {}
    for spec in [s.strip() for s in args.schedules.split(",") if s.strip()]:
        log.info("schedule %s", spec)
        result["schedules"][spec] = run_schedule(model, cfg, trace, spec, args)
        result["ratios"] = ratios(result)
        _write(out, result)
    if micro_on:  # last before the peer: green contexts are beta, a failure must not cost the replays
        result["micro"].update(run_micro(model, cfg, args, costs, bandwidth, peak, names=("overlap",)))
        _write(out, result)
    if hf_on:
        from megatron_rollout.bench.hf_peer import run_peer

        del model
        gc.collect()
        torch.cuda.empty_cache()
        result["hf_peer"] = run_peer(cfg, trace, args.device, args.seed, args.hf_budget_s)
        _write(out, result)
    result["ratios"] = ratios(result)
    _write(out, result)
    print(table(result), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a peer's background thread must not keep the process alive
