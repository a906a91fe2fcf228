"""`python -m benchmarks.rollout`: the one-GPU rollout benchmark, one command (docs/design.md §9).

A figure counts only warm, repeated, each schedule at its best token budget, next to the peer:

1. a trace (`trace.make_trace`, `--profile current | prefill | decode`, sized by
   `--conversations` and `--scale`; per-profile defaults sized so a full comparison fits two
   9-minute device calls), its lower bound (`benchmarks.bounds`) and, on CUDA, the device ceilings;
2. the budget sweep: every base schedule (`off`, `chunked`, `mux`) replayed once at each
   `--budgets` value (`--max-batch-tokens`: the chunked step budget, the off/mux epoch budget) on
   a short pass (the first `--sweep-fraction` of the conversations); each schedule's best budget
   is the one with the shortest makespan. The sweep is also the warm-up: after it every kernel
   variant a replay uses is compiled (with one budget, one untimed short pass per schedule is run
   instead). Same-budget ratios come from this pass;
3. the timed repeats: `--repeats` rounds, interleaved (off, chunked, mux, mux-epoch, mux-load,
   off, ...), each replay in a fresh engine over the same model and token ids, at the schedule's
   best budget (a `schedule+priority` spec at its schedule's). `mux` runs its default segment
   policy (`--mux-span`, `WaitBudget`); the paper's
   ablation runs beside it at mux's budget: `mux-epoch`, one segment per epoch (whole-epoch
   asynchronous enqueue, `mux_span="fixed:1000000000"`), and `mux-load`, LoadSelected's fine
   segments. Decode graphs and piecewise P graphs are captured when the engine is built, before
   the clock starts; every timed replay runs inside a
   `benchmarks.compiles.CompileCounter`, and its Triton and torch compilations are in the JSON and
   the table (a figure with compilations is marked cold and left out of the medians);
4. per schedule: `repeats` (the reports) and `median` / `min` / `max` of every figure, and of
   where its time went (`breakdown`: `BREAKDOWN_FIGURES`, from each report's `trace.breakdown`);
   ratios from medians (best budget against best budget), and the issue's targets for the profile;
5. the vLLM peer (`benchmarks.vllm_peer`) in its own process after this one has freed the GPU, on
   the same trace file and token ids; its figures join the table and the ratios. With
   `--vllm-interleave` the peer instead stays up beside our engines from the start, and one of its
   timed passes follows each round of our repeats (`benchmarks.interleave`). The peer runs our
   model: its weights are written once for it (`--vllm-weights ours`, `peer-weights` in the JSON),
   or drawn inside it where the file would not fit the disk (`--vllm-weights drawn`). At
   `--temperature` > 0 it samples too, unseeded (its best: one draw for all rows), or each turn
   seeded as ours with `--vllm-turn-seeds` (`trace.replay.turn_seed`); its tokens are then not expected
   to match ours (another sampler), which the agreement line says.

Each timed replay keeps its step records (`engine.step_log`) in the JSON as columns (`steps`,
`trace.steps`; `--no-step-records` drops them), beside the model's routing (`moe`) and KV blocks
(`num_blocks`), and the trace goes to `<out>/trace.jsonl`: what `benchmarks.sim_replay` fits the
simulator's cost model to and simulates again. `--host-profile SPEC,...` then replays each of
those schedules once more, untimed, under cProfile (`host_profile`: the functions that took the
host's time, a read-back's wait for the device included), to tell a step's host work from its
device work, which the records cannot.
Results go to `<out>/rollout.json` after every replay (a killed run keeps what it measured);
`--deadline-s` stops cleanly before a replay that would not fit and leaves time for the peer.
The last lines of stdout are the table. `--device cpu --model tiny-moe` runs steps 1-4 on CPU
(the CI test does). Left out: several GPUs, FP8; the micro-benchmarks (`--micro`) belong to the
kernel work and are off by default.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import datetime
import functools
import gc
import json
import logging
import math
import os
import pstats
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.agreement import agreement, agreement_note, replay_digests, sampled_at
from benchmarks.bounds import model_costs, trace_lower_bound
from benchmarks.compiles import CompileCounter
from benchmarks.interleave import PeerSession
from benchmarks.pauses import GcPauses
from benchmarks.random_weights import random_model
from benchmarks.report import acceptance_note
from benchmarks.specs import engine_config, kernel_build, pdl_launches, split_spec, unpartitioned
from benchmarks.vllm_peer import temperature as _temperature
from megatron_rollout.engine.config import DEFAULT_SPAN
from megatron_rollout.model.config import PRESETS, ModelConfig
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.trace.make import PROFILES, make_trace, max_context
from megatron_rollout.trace.schema import write_trace

log = logging.getLogger("benchmarks")

BASE_SCHEDULES = ("off", "chunked", "mux")
MICRO_PARTS = ("decode", "prefill", "attention", "experts", "overlap", "gap")
"""`benchmarks.micro`'s parts; `gap` times a P forward piecewise, eager and as one whole graph
(`micro.segment_gap`); `overlap` times decode replays while a prefill runs on the other stream
(D at high priority, at equal priority, on green-context SM partitions)."""
ABLATIONS = (("mux-epoch", "mux@fixed:1000000000"), ("mux-load", "mux@load"))
"""The paper's ablation beside `mux` (its default policy): one segment per epoch (whole-epoch
asynchronous enqueue) and LoadSelected's fine segments."""
PROFILE_SIZES = {"current": (16, 0.1), "prefill": (24, 1.0), "decode": (16, 0.25)}
"""Default (conversations, scale) per profile: one timed replay takes ~5-10 s on the H200 (12 layers)."""
SWEEP_SHARE = 0.4
"""Most of our stages' time the budget sweep may take."""
REPORT_FIGURES = ("makespan_s", "p50_request_s", "p99_request_s", "p99_trajectory_s", "mean_ttft_s", "p99_ttft_s",
                  "mean_queue_s", "mean_prefill_s", "mean_decode_wait_ms", "tokens_per_s")
TARGETS = {
    "current": {"best_over_vllm": 1.0},
    "prefill": {"mux_over_best_baseline": 0.85, "mux_over_vllm": 0.8, "mux_p99_request_over_best_baseline": 0.7,
                "mux_ttft_over_off": 1.1, "best_drafts_over_plain": 0.9},
}
"""Targets per profile (ratio <= target). `best_drafts_over_plain` guards what n-gram drafting bought
on the tail (0.83 under `mux` on the H200, 2026-12-04): a change that loses it prints MISSED."""
SAMPLED_TARGETS = {"best_drafts_over_plain": 1.05}
"""In place of the profile's where the replays sample (`--temperature` > 0), where random weights
leave nothing to draft: what drafting may cost then, its undrafted steps decoded ahead (1.037 on the
H200, 1.141 without decode ahead, 2026-12-06)."""


def targets_for(result: dict) -> dict[str, float]:
    """The targets a run's ratios are held to (`TARGETS`, `SAMPLED_TARGETS`)."""
    targets = dict(TARGETS.get(result.get("profile"), {}))
    if sampled_at(result) > 0:
        targets.update(SAMPLED_TARGETS)
    return targets


class ScheduleTimeout(Exception):
    """A replay ran past its time limit."""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.rollout", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b-12l", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--profile", default="current", choices=sorted(PROFILES), help="trace profile (trace.make)")
    ap.add_argument("--conversations", type=int, default=None, help="default: per profile (PROFILE_SIZES)")
    ap.add_argument("--scale", type=float, default=None, help="token-count scale of the trace (default: per profile)")
    ap.add_argument("--wait-scale", type=float, default=None, help="tool-wait scale (default: --scale)")
    ap.add_argument("--trace-seed", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0, help="weights and input token ids")
    ap.add_argument("--weight-std", type=_positive_float, default=0.02,
                    help="standard deviation of the random weights: 0.02 gives nearly flat logits, whose greedy "
                         "near-ties bf16 rounding can flip (what the timed runs use); 0.2 gives clear winners, "
                         "for comparing tokens between replays on the GPU")
    ap.add_argument("--schedules", default="off,chunked,mux",
                    help="comma-separated; 'mux@fixed:K' runs mux with another segment policy, 'off/sync' a schedule "
                         "without decode ahead, 'mux/sms:24' mux with 24 SMs left out of prefill's stream "
                         "('mux/split:24': decode on them alone beside it), "
                         "'mux+most-turns' one under an engine priority; '' runs none")
    ap.add_argument("--ablation", action=argparse.BooleanOptionalAction, default=True,
                    help="add mux-epoch (one segment per epoch) when mux runs")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budgets", default="2048,4096,8192,16384", help="token budgets swept (one value: no sweep)")
    ap.add_argument("--max-batch-tokens", type=int, default=None, help="one budget for all (same as --budgets N)")
    ap.add_argument("--sweep-fraction", type=float, default=0.5, help="share of the conversations in the sweep pass")
    ap.add_argument("--max-decode-rows", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-gb", type=float, default=40.0, help="KV cache size on CUDA (GiB)")
    ap.add_argument("--num-blocks", type=int, default=None, help="KV blocks (overrides --kv-gb)")
    ap.add_argument("--max-model-len", default="auto",
                    help="int, or 'auto': the preset's, raised to cover the trace's longest context (random weights)")
    ap.add_argument("--mux-span", default=DEFAULT_SPAN,
                    help="segment policy of plain 'mux': budget:US | load | fixed:K")
    ap.add_argument("--attention", default="auto", help="auto | triton | varlen | flash | portable")
    ap.add_argument("--temperature", type=_temperature, default=0.0,
                    help="of every turn, ours (each turn seeded) and the peer's (unseeded unless "
                         "--vllm-turn-seeds); > 0 times sampled decoding")
    ap.add_argument("--decode-ahead", default="auto", choices=("auto", "on", "off"),
                    help="issue the next decode forward before reading this one's tokens (engine.ahead)")
    ap.add_argument("--schedule-budget-s", type=float, default=120.0, help="time limit of one replay")
    ap.add_argument("--deadline-s", type=float, default=520.0, help="whole run, the peer included")
    ap.add_argument("--micro", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--micro-parts", default=",".join(MICRO_PARTS),
                    help=f"which micro-benchmarks --micro runs, comma-separated, of {','.join(MICRO_PARTS)}")
    ap.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=None, help="default: on CUDA")
    ap.add_argument("--vllm-site", default="/tmp/pv/site", help="where the vLLM bundle was unpacked")
    ap.add_argument("--vllm-budgets", default="default,best",
                    help="vLLM's max_num_batched_tokens: 'default' (its own) and/or 'best' (our best schedule's)")
    ap.add_argument("--vllm-passes", type=int, default=3)
    ap.add_argument("--vllm-warmups", type=int, default=2, help="untimed vLLM passes before its timed ones")
    ap.add_argument("--vllm-in-process", default="",
                    help="budgets to run again with vLLM's engine core in process (as RL frameworks colocate it), "
                         "after the own-process run; 'best' = the own-process run's best; '' = none")
    ap.add_argument("--vllm-turn-seeds", action="store_true",
                    help="sampled: the peer seeds each turn as our replay does (its per-request draws are slower; "
                         "default: unseeded, its best setting)")
    ap.add_argument("--vllm-speculative", default=None, metavar="ngram:K",
                    help="the peer with its own prompt-lookup speculation (keys '<budget>~ngram:K'), to compare "
                         "with our '~ngram:K' schedules; default: none")
    ap.add_argument("--vllm-weights", default="ours", choices=("ours", "drawn", "dummy"),
                    help="the peer's weights: ours (written once to OUT/peer-weights.safetensors for it to load, "
                         "so both engines run one model and accept drafts alike), drawn (the same weights drawn "
                         "inside the peer and loaded in place: no file, for models larger than the disk) or "
                         "vLLM's own dummy init")
    ap.add_argument("--vllm-reserve-s", type=float, default=250.0, help="time kept for the peer")
    ap.add_argument("--vllm-interleave", default=None, choices=("own", "in-process"),
                    help="keep the peer up beside our engines (its core in its own process, or in the peer's) and "
                         "run one of its timed passes after each round of our repeats, at the one budget of "
                         "--vllm-budgets; default: the peer after ours, on the freed GPU")
    ap.add_argument("--vllm-block-size", type=int, default=None,
                    help="the peer's KV block size in tokens (as our '/bs:N' schedules); default: vLLM's own (16)")
    ap.add_argument("--vllm-kv-gb", type=float, default=None,
                    help="the peer's KV cache in GiB; default: --kv-gb when interleaving (both engines hold their "
                         "memory at once), else what vLLM's memory profile leaves")
    ap.add_argument("--vllm-memory", type=float, default=None,
                    help="the peer's gpu_memory_utilization; default: 0.45 when interleaving, else 0.85")
    ap.add_argument("--hf", action=argparse.BooleanOptionalAction, default=False, help="the transformers peer")
    ap.add_argument("--hf-budget-s", type=float, default=60.0)
    ap.add_argument("--resume", default=None, metavar="DIR",
                    help="run only the peer stage over DIR/rollout.json (our figures from an earlier run of the "
                         "same trace options, e.g. an earlier run on the same machine); results go to DIR")
    ap.add_argument("--host-profile", default="", metavar="SPEC,SPEC",
                    help="after the timed repeats, one more replay of each of these schedules under cProfile, "
                         "untimed: where the host's time went, the read-backs' waits for the device included "
                         "(`host_profile` in the JSON)")
    ap.add_argument("--step-records", action=argparse.BooleanOptionalAction, default=True,
                    help="keep each timed replay's step records in the JSON ('steps', columns of trace.steps)")
    ap.add_argument("--out", default="runs/bench")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def _positive_float(text: str) -> float:
    """`--weight-std`: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"takes a finite number > 0, got {text}")
    return value


def _num_blocks(args: argparse.Namespace, cfg: ModelConfig) -> int:
    if args.num_blocks:
        return args.num_blocks
    if args.device == "cpu":
        return 4096
    from megatron_rollout.kv.paged import PagedKVCache

    return int(args.kv_gb * 2 ** 30 // PagedKVCache.bytes_per_block(cfg, args.block_size, cfg.num_query_groups))


def _write(out: Path, result: dict) -> None:
    tmp = out / "rollout.json.tmp"
    tmp.write_text(_dumps(result))
    tmp.replace(out / "rollout.json")


def _dumps(result: dict) -> str:
    """`result` as indented JSON, each repeat's step records, submissions, sleeps and step starts on
    one line each (one value a line would make them most of the file)."""
    columns: list[str] = []

    def stash(repeat: dict) -> dict:
        out = dict(repeat)
        for key in ("steps", "submissions", "step_starts", "sleeps"):
            if key in repeat:
                columns.append(json.dumps(repeat[key], separators=(",", ":")))
                out[key] = f"@columns:{len(columns) - 1}@"
        return out

    schedules = {name: {**entry, "repeats": [stash(r) for r in entry.get("repeats", [])]}
                 for name, entry in result.get("schedules", {}).items()}
    text = json.dumps({**result, "schedules": schedules}, indent=1, default=str)
    for i, cols in enumerate(columns):
        text = text.replace(f'"@columns:{i}@"', cols, 1)
    return text


def trace_summary(trace: list) -> dict[str, Any]:
    from megatron_rollout.trace.schema import group_conversations

    convs = group_conversations(trace)
    contexts = [sum(t.input_tokens + t.output_tokens for t in turns) for turns in convs.values()]
    return {"requests": len(trace), "conversations": len(convs),
            "input_tokens": sum(t.input_tokens for t in trace), "output_tokens": sum(t.output_tokens for t in trace),
            "mean_turns": len(trace) / len(convs), "max_context": max(contexts),
            "mean_context": float(np.mean(contexts)),
            "total_wait_s": sum(t.wait_ms for t in trace) / 1e3}


@dataclass
class Run:
    """What the stages share (mutable, private to `main`)."""

    args: argparse.Namespace
    cfg: ModelConfig
    model: MoETransformer | None
    max_model_len: int
    num_blocks: int
    deadline: float
    """perf_counter time by which our stages must end (the peer's reserve excluded)."""
    sweep_deadline: float = math.inf
    """The sweep ends by then (`SWEEP_SHARE` of our time left at `start_sweep_clock`), leaving the
    rest to the repeats."""
    expert_choice: str | None = None
    """The small-batch expert kernel the first engine measured; later engines keep it."""
    last_s: dict[str, float] = field(default_factory=dict)
    """Duration of the last replay of each kind (sweep, timed), to keep within the deadline."""
    peer_weights: Path | None = None
    """Our weights written for the peer (`--vllm-weights ours`), removed once it is done."""

    def start_sweep_clock(self) -> None:
        self.sweep_deadline = time.perf_counter() + SWEEP_SHARE * max(0.0, self.deadline - time.perf_counter())

    def fits(self, kind: str) -> bool:
        need = self.last_s.get(kind, 0.0) * 1.25 + 3.0
        return time.perf_counter() + need <= (self.sweep_deadline if kind == "sweep" else self.deadline)


def _micro_parts(spec: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    unknown = [n for n in names if n not in MICRO_PARTS]
    if unknown:
        raise SystemExit(f"--micro-parts: unknown part(s) {unknown}; choose from {list(MICRO_PARTS)}")
    return names


def _expert_small(model) -> str | None:
    exchange = getattr(getattr(model, "comm", None), "device_exchange", None)
    return getattr(exchange, "small", None)


def run_micro(model: MoETransformer, cfg: ModelConfig, args, costs, bandwidth: float, peak: float,
              names: tuple[str, ...] = MICRO_PARTS) -> dict:
    from benchmarks import micro
    from megatron_rollout.engine.config import RunnerConfig
    from megatron_rollout.kv.paged import PagedKVCache
    from megatron_rollout.runner.cuda import CudaRunner

    rng = np.random.default_rng(args.seed)
    cache = PagedKVCache(cfg, 40_000, args.block_size, cfg.num_query_groups, device=args.device)
    cache.k.normal_()
    cache.v.normal_()
    runner = CudaRunner(model, cache, RunnerConfig(attention=args.attention))
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
        ("gap", lambda: micro.segment_gap(runner, rng)),  # last: it captures a graph of its own
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
    timed = [r for name in ("decode", "prefill", "gap") if isinstance(out.get(name), list) for r in out[name]]
    if timed:  # compilations during the timed calls of the decode, prefill and gap parts: must be 0
        out["compiles_in_timed_regions"] = sum(r.get("compiles", 0) for r in timed)
    return out


def run_replay(run: Run, trace: list, spec: str, budget: int, kind: str,
               profiler: cProfile.Profile | None = None) -> dict[str, Any]:
    """One replay of `trace` under `spec` at `budget` in a fresh engine; compilations counted; the
    replay alone (not the engine's set-up) under `profiler` where one is given."""
    with pdl_launches(split_spec(spec)):
        return _replay_in_engine(run, trace, spec, budget, kind, profiler)


def _replay_in_engine(run: Run, trace: list, spec: str, budget: int, kind: str,
                      profiler: cProfile.Profile | None) -> dict[str, Any]:
    from megatron_rollout.engine import RolloutEngine, SamplingParams
    from megatron_rollout.trace.replay import replay
    from megatron_rollout.trace.steps import SLEEP_COLUMNS, SUBMISSION_COLUMNS, marks_to_columns, to_columns
    from megatron_rollout.trace.timeline import Timeline

    args, cfg = run.args, run.cfg
    parts = split_spec(spec)
    schedule = parts.schedule
    t0 = time.perf_counter()
    engine = RolloutEngine(run.model, engine_config(args, run.num_blocks, run.max_model_len, parts, budget,
                                                    run.expert_choice is None), timeline=Timeline())
    runner = engine.runner
    if run.expert_choice is None and _expert_small(run.model) is not None:
        run.expert_choice = _expert_small(run.model)
    engine.capture_graphs(min(len({t.conversation for t in trace}), args.max_decode_rows))  # before timing
    rng = np.random.default_rng(args.seed)
    sizes = (700, 300, 1) if args.device != "cpu" else (24, 9, 1)
    warm = [rng.integers(0, cfg.vocab_size, n).tolist() for n in sizes]
    engine.generate(warm, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_stop=True))
    setup_s = time.perf_counter() - t0
    # reset in place: the engine's parts hold these objects (assigning new ones would detach them)
    for f in dataclasses.fields(engine.stats):
        setattr(engine.stats, f.name, f.default if f.default is not dataclasses.MISSING else f.default_factory())
    first_event = len(engine.timeline.events)
    if hasattr(runner, "stats"):
        runner.stats = {k: 0 for k in runner.stats}
    if args.device != "cpu":
        torch.cuda.synchronize()

    limit = max(1.0, min(args.schedule_budget_s, run.deadline - time.perf_counter()))

    def expire(signum, frame):
        raise ScheduleTimeout(f"replay of {spec} ran past its {limit:.0f} s limit")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit)
    started = time.perf_counter()
    counter, pauses = CompileCounter(), GcPauses()
    allocator = allocator_counts(args.device)
    details: dict[str, Any] = {}
    try:
        with counter, pauses, profiler if profiler is not None else contextlib.nullcontext():
            report, outputs = replay(engine, trace, seed=args.seed, progress=not args.no_progress,
                                     vocab_size=cfg.vocab_size, schedule=schedule, temperature=args.temperature,
                                     details=details if kind == "timed" else None)
            if args.device != "cpu":
                torch.cuda.synchronize()
        result: dict[str, Any] = {"report": report.to_dict(), "finished": True}
        if kind == "timed":  # each turn's generated ids, for `benchmarks.agreement`
            result["digests"] = replay_digests(outputs, details["conversation_of"], details["turn_of"])
    except ScheduleTimeout as exc:
        result = {"finished": False, "error": str(exc)}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    wall = time.perf_counter() - started
    run.last_s[kind] = max(run.last_s.get(kind, 0.0), wall + setup_s)
    if details.get("records") is not None and args.step_records:
        result["steps"] = to_columns(details["records"])
        result["replay_start"] = details["start"]  # the records' clock: the start-up before the first forward
        result["submissions"] = marks_to_columns(details["submissions"], SUBMISSION_COLUMNS)
        result["sleeps"] = marks_to_columns(details["sleeps"], SLEEP_COLUMNS)
        result["step_starts"] = details["step_starts"]
    stats, events = engine.stats, engine.timeline.events[first_event:]
    compiles = counter.counts
    result.update(
        spec=spec, budget=budget, wall_s=wall, setup_s=setup_s, compilations=compiles.to_dict(),
        warm=compiles.total == 0, runner=type(runner).__name__,
        graph_safe=getattr(runner, "graph_safe", None), capture_error=getattr(runner, "capture_error", None),
        prefill_capture_error=getattr(runner, "prefill_capture_error", None),
        beside_capture_error=getattr(runner, "beside_capture_error", None),
        attention_backend=getattr(getattr(runner, "kernels", None), "name", None),
        expert_small_kernel=_expert_small(run.model), runner_stats=dict(getattr(runner, "stats", {})),
        allocator={k: v - allocator[k] for k, v in allocator_counts(args.device).items()},
        gc=_gc(pauses, engine, result.get("report"), details.get("start")),
        engine_stats={"steps": stats.steps, "decode_iterations": stats.decode_iterations,
                      "prefill_tokens": stats.prefill_tokens, "decode_tokens": stats.decode_tokens,
                      "preemptions": stats.preemptions, "mean_decode_wait_ms": stats.mean_decode_wait_ms,
                      "ahead_issued": stats.ahead_issued, "ahead_taken": stats.ahead_taken,
                      "ahead_dropped": stats.ahead_dropped, "drafted_tokens": stats.drafted_tokens,
                      "accepted_tokens": stats.accepted_tokens},
        timeline=_window(events, seconds=3.0) if kind == "timed" else [])
    del engine, runner
    gc.collect()
    if args.device != "cpu":
        torch.cuda.empty_cache()
    return result


def _gc(pauses: GcPauses, engine: Any, report: dict[str, Any] | None, start: float | None) -> dict[str, Any]:
    """The replay's collections, those begun inside its makespan apart (a timed replay's, which
    started at `start`), and how often the engine froze the heap for them (`engine.gc_freeze`)."""
    window = (start, start + report["makespan_s"]) if report and start is not None else None
    freeze = getattr(engine, "gc_freeze", None)
    return pauses.to_dict(window) | ({"freezes": freeze.freezes, "on": freeze.on} if freeze is not None else {})


ALLOCATOR_COUNTS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms")
"""torch's CUDA caching allocator counters kept per replay: its cudaMalloc and cudaFree calls, and
the times it ran out, freed its cached blocks and retried, which waits for the whole device."""


def allocator_counts(device: str) -> dict[str, int]:
    """`ALLOCATOR_COUNTS` as they stand now on `device` (CUDA; {} elsewhere)."""
    if not device.startswith("cuda"):
        return {}
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTS}


def _window(events, seconds: float) -> list[list]:
    """A few seconds of the timeline from the middle of the run, for the plot: [phase, start, end]."""
    if not events:
        return []
    t0 = min(e.start for e in events)
    t1 = max(e.end for e in events)
    lo = t0 + max(0.0, (t1 - t0) / 2 - seconds / 2)
    return [[e.phase, round(e.start - lo, 6), round(e.end - lo, 6)] for e in events
            if e.end >= lo and e.start <= lo + seconds]


def summarize(repeats: list[dict]) -> dict[str, Any]:
    """median / min / max of every figure over the warm, finished repeats (all finished ones when
    none is warm: `median_warm` then says False)."""
    done = [r for r in repeats if r.get("finished")]
    warm = [r for r in done if r.get("warm")]
    use = warm or done
    out: dict[str, Any] = {"n": len(use), "n_cold": len(done) - len(warm), "median_warm": bool(warm) or not done,
                           "compilations": sum(r.get("compilations", {}).get("total", 0) for r in repeats)}
    figures = [breakdown_figures(r["report"].get("breakdown")) for r in use]
    out["breakdown"] = {}
    for stat, fn in (("median", np.median), ("min", np.min), ("max", np.max)):
        out[stat] = {}
        for key in REPORT_FIGURES:
            values = [r["report"][key] for r in use if isinstance(r["report"].get(key), (int, float))]
            out[stat][key] = float(fn(values)) if values else None
        out["breakdown"][stat] = {}
        for key in BREAKDOWN_FIGURES:
            values = [f[key] for f in figures if isinstance(f.get(key), (int, float))]
            out["breakdown"][stat][key] = float(fn(values)) if values else None
    return out


BREAKDOWN_FIGURES = (
    "decode_step_stretch", "mean_decode_wait_ms", "pure_decode_step_ms", "decode_step_ms",
    "busy_prefill", "busy_decode", "busy_mixed", "idle",
    "critical_end_s", "critical_turns", "critical_tool_wait_s", "critical_release_s", "critical_queue_s",
    "critical_prefill_s", "critical_decode_s", "critical_decode_in_mixed_s", "critical_decode_behind_prefill_s",
    "critical_tpot_ms", "all_queue_s", "all_prefill_s", "all_decode_s", "all_decode_in_mixed_s")
"""The figures of a replay's breakdown (`trace.breakdown`) summarised per schedule: decode step
stretch beside decode wait; the engine's shares of the makespan in prefill, decode and mixed
forwards and idle; the critical conversation's path (tool waits, queueing, prefill, decode, and
how much of its decode ran inside mixed steps or waited behind prefill-only forwards); and the
sums over every request."""


def breakdown_figures(b: dict | None) -> dict[str, float | None]:
    """The `BREAKDOWN_FIGURES` of one report's breakdown (empty when it has none)."""
    if not b:
        return {}
    span = b["makespan_s"] or float("nan")
    e, c, a = b["engine"], b.get("critical") or {}, b["all_requests"]

    def total(occupancy):
        return sum(occupancy[f"{k}_s"] for k in ("prefill", "decode", "mixed", "idle"))

    out = {k: b.get(k) for k in ("decode_step_stretch", "mean_decode_wait_ms", "pure_decode_step_ms", "decode_step_ms")}
    out.update(busy_prefill=e["prefill_s"] / span, busy_decode=e["decode_s"] / span, busy_mixed=e["mixed_s"] / span,
               idle=e["idle_s"] / span)
    if c:
        out.update(critical_end_s=c["end_s"], critical_turns=c["requests"], critical_tool_wait_s=c["tool_wait_s"],
                   critical_release_s=c["release_s"], critical_queue_s=total(c["queue"]),
                   critical_prefill_s=total(c["prefill"]), critical_decode_s=total(c["decode"]),
                   critical_decode_in_mixed_s=c["decode"]["mixed_s"],
                   critical_decode_behind_prefill_s=c["decode"]["prefill_s"], critical_tpot_ms=c.get("tpot_ms"))
    out.update(all_queue_s=total(a["queue"]), all_prefill_s=total(a["prefill"]), all_decode_s=total(a["decode"]),
               all_decode_in_mixed_s=a["decode"]["mixed_s"])
    return out


def simulated_oracle(result: dict, trace: list) -> dict[str, Any]:
    """Each timed schedule in arrival order and under the oracle ordering (longest remaining chain
    first, knowing each conversation's future), simulated on the cost model fitted to its own repeat
    0 (`benchmarks.sim_replay.orderings`, in sample): what order alone could give on this trace,
    reported beside the peer and the lower bound. A schedule the simulator cannot represent says why."""
    from benchmarks.sim_replay import orderings

    out: dict[str, Any] = {}
    for label, row in orderings(result, trace, names=("fifo", "oracle"), parts=("in_sample",)).items():
        cells = row.get("in_sample") or {}
        out[label] = ({"fifo_sim_s": cells["fifo"]["sim_s"], "oracle_sim_s": cells["oracle"]["sim_s"],
                       "over_fifo": cells["oracle"]["over_fifo"]} if "oracle" in cells else
                      {"skipped": row.get("skipped") or cells.get("skipped") or "no in-sample fit"})
    return out


def _ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None


def ratios(result: dict) -> dict[str, float | None]:
    """Ratios of medians, each schedule at its best budget; same-budget ratios from the sweep."""
    sched = result.get("schedules", {})

    def med(name, key="makespan_s"):
        return (sched.get(name, {}).get("median") or {}).get(key)

    out: dict[str, float | None] = {}
    baselines = [n for n in ("off", "chunked") if med(n) is not None]
    best_base = min(baselines, key=med) if baselines else None
    ours = [n for n in sched if med(n) is not None]
    vllm = ((result.get("vllm") or {}).get("median") or {}).get("makespan_s")
    out["mux_over_off"] = _ratio(med("mux"), med("off"))
    out["mux_over_chunked"] = _ratio(med("mux"), med("chunked"))
    out["mux_over_best_baseline"] = _ratio(med("mux"), med(best_base)) if best_base else None
    out["mux_p99_request_over_best_baseline"] = _ratio(med("mux", "p99_request_s"), med(best_base, "p99_request_s")) \
        if best_base else None
    out["mux_ttft_over_off"] = _ratio(med("mux", "mean_ttft_s"), med("off", "mean_ttft_s"))
    for half in ("queue", "prefill"):  # which half of TTFT grew (the request's admission splits it)
        out[f"mux_{half}_over_off"] = _ratio(med("mux", f"mean_{half}_s"), med("off", f"mean_{half}_s"))
    out["mux_epoch_over_mux"] = _ratio(med(ABLATIONS[0][0]), med("mux"))
    out["mux_load_over_mux"] = _ratio(med(ABLATIONS[1][0]), med("mux"))
    out["best_over_vllm"] = _ratio(min((med(n) for n in ours), default=None), vllm) if ours else None
    for n in ours:  # decode ahead's effect: a schedule against its '/sync' twin
        if n.endswith("/sync"):
            out[f"{n[:-5]}_over_{n[:-5]}_sync"] = _ratio(med(n[:-5]), med(n))
    for n in ours:  # a kernel choice's effect ('/pdl', '/nopdl', '/bs:N' last): a schedule against its twin without
        twin = re.sub(r"/((no)?pdl|bs:\d+)$", "", n)
        if twin != n and twin in ours:
            out[f"{n}_over_{twin}"] = _ratio(med(n), med(twin))
    for n in ours:  # SMs held back from prefill: a schedule against the same one without
        if (whole := unpartitioned(n)) != n:
            out[f"{n}_over_{whole}"] = _ratio(med(n), med(whole))
    twin = {n: re.sub(r"~[^/]*", "", n) for n in ours if "~" in n}  # the same schedule, no drafts
    twin = {n: t if t in ours else split_spec(n).schedule for n, t in twin.items()}  # else the plain schedule
    drafted = {n: _ratio(med(n), med(t)) for n, t in twin.items()}
    for n, r in drafted.items():  # drafting's effect: a schedule against its plain twin
        out[f"{n}_over_{twin[n]}"] = r
    out["best_drafts_over_plain"] = min((r for r in drafted.values() if r is not None), default=None)
    out["mux_over_vllm"] = _ratio(med("mux"), vllm)
    out["mux_over_lower_bound"] = _ratio(med("mux"), (result.get("lower_bound") or {}).get("bound_s"))
    for budget, row in (result.get("sweep") or {}).items():
        ms = {n: (r.get("report") or {}).get("makespan_s") for n, r in row.items() if r.get("finished")}
        out[f"mux_over_off@{budget}"] = _ratio(ms.get("mux"), ms.get("off"))
        out[f"mux_over_chunked@{budget}"] = _ratio(ms.get("mux"), ms.get("chunked"))
    return out


def _fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)) else "-"


def _breakdown_lines(result: dict) -> list[str]:
    """Where each schedule's time went (medians of `BREAKDOWN_FIGURES`)."""
    lines = []
    for name, s in result.get("schedules", {}).items():
        b = (s.get("breakdown") or {}).get("median") or {}
        if b.get("busy_decode") is None:
            continue
        lines.append(
            f"  {name}: engine busy P {_fmt(100 * b['busy_prefill'], '.0f')}% D {_fmt(100 * b['busy_decode'], '.0f')}% "
            f"mixed {_fmt(100 * b['busy_mixed'], '.0f')}% idle {_fmt(100 * b['idle'], '.0f')}%; decode step "
            f"{_fmt(b.get('decode_step_ms'), '.2f')} ms over pure {_fmt(b.get('pure_decode_step_ms'), '.2f')} ms; "
            f"critical path {_fmt(b.get('critical_end_s'), '.2f')} s ({_fmt(b.get('critical_turns'), '.0f')} turns): "
            f"tool {_fmt(b.get('critical_tool_wait_s'), '.2f')} queue {_fmt(b.get('critical_queue_s'), '.2f')} "
            f"prefill {_fmt(b.get('critical_prefill_s'), '.2f')} decode {_fmt(b.get('critical_decode_s'), '.2f')} s "
            f"(in mixed steps {_fmt(b.get('critical_decode_in_mixed_s'), '.2f')}, behind prefill "
            f"{_fmt(b.get('critical_decode_behind_prefill_s'), '.2f')})")
    return ["where the time went (medians):"] + lines if lines else []


def table(result: dict) -> str:
    """The printed summary: everything the notes need, from the JSON alone."""
    t = result.get("trace", {})
    lines = [f"== {result.get('model')} profile={result.get('profile')} {t.get('conversations')} conversations, "
             f"{t.get('requests')} requests, {t.get('input_tokens')} in / {t.get('output_tokens')} out tokens, "
             f"max context {t.get('max_context')}, max_model_len {result.get('max_model_len')}, "
             f"{result.get('device')}"]
    w = max([11] + [len(n) + 1 for n in result.get("schedules", {})])  # label column
    head = (f"{'schedule':<{w}}{'budget':>7}{'n':>3}{'makespan_s med [min-max]':>26}{'p50_req':>8}{'p99_req':>8}"
            f"{'p99_traj':>9}{'ttft_s':>8}{'dwait_ms':>9}{'stretch':>8}{'tok/s':>7}{'compiles':>9}")
    lines.append(head)
    for name, s in result.get("schedules", {}).items():
        m, lo, hi = s.get("median") or {}, s.get("min") or {}, s.get("max") or {}
        if not m or m.get("makespan_s") is None:
            lines.append(f"{name:<{w}} no finished replay: {s.get('error') or s.get('stopped') or '-'}")
            continue
        span = (f"{_fmt(m['makespan_s'], '.2f')} "
                f"[{_fmt(lo.get('makespan_s'), '.2f')}-{_fmt(hi.get('makespan_s'), '.2f')}]")
        cold = f" cold:{s['n_cold']}" if s.get("n_cold") else ""
        lines.append(f"{name:<{w}}{_fmt(s.get('budget'), '7d')}{s.get('n', 0):>3}{span:>26}"
                     f"{_fmt(m.get('p50_request_s'), '8.2f')}{_fmt(m.get('p99_request_s'), '8.2f')}"
                     f"{_fmt(m.get('p99_trajectory_s'), '9.2f')}{_fmt(m.get('mean_ttft_s'), '8.3f')}"
                     f"{_fmt(m.get('mean_decode_wait_ms'), '9.1f')}"
                     f"{_fmt(((s.get('breakdown') or {}).get('median') or {}).get('decode_step_stretch'), '8.2f')}"
                     f"{_fmt(m.get('tokens_per_s'), '7.0f')}{s.get('compilations', 0):>9d}{cold}")
    lines += _breakdown_lines(result)
    v = result.get("vllm")
    if v:
        m = v.get("median") or {}
        if m.get("makespan_s") is not None:
            passes = [p["makespan_s"] for p in v.get("repeats", [])]
            span = f"{_fmt(m['makespan_s'], '.2f')} [{_fmt(min(passes), '.2f')}-{_fmt(max(passes), '.2f')}]"
            lines.append(f"{'vllm':<{w}}{str(v.get('best_budget')):>7}{len(passes):>3}{span:>26}"
                         f"{_fmt(m.get('p50_request_s'), '8.2f')}{_fmt(m.get('p99_request_s'), '8.2f')}"
                         f"{_fmt(m.get('p99_trajectory_s'), '9.2f')}{_fmt(m.get('mean_ttft_s'), '8.3f')}"
                         f"{'n/a':>9}{'n/a':>8}{_fmt(m.get('tokens_per_s'), '7.0f')}{'-':>9}")
            chosen = {k: e.get("chosen", {}) for k, e in (v.get("budgets") or {}).items()}
            for k, c in chosen.items():
                lines.append(f"  vllm@{k}: budget {c.get('max_num_batched_tokens')}, seqs {c.get('max_num_seqs')}, "
                             f"graphs {c.get('cudagraph_mode')}, compile {c.get('compilation_mode')}, "
                             f"median {_fmt(((v['budgets'][k].get('median') or {}).get('makespan_s')), '.2f')} s")
            for line in (v.get("log_lines") or [])[:4]:
                lines.append(f"  vllm log: {line[:150]}")
            if (accepted := acceptance_note(result)) is not None:
                lines.append(accepted)
        else:
            lines.append(f"{'vllm':<11} not measured: {v.get('error') or v.get('reason') or 'no finished pass'}")
    sweep = result.get("sweep") or {}
    if sweep:
        names = sorted({n for row in sweep.values() for n in row}, key=list(BASE_SCHEDULES).index)
        lines.append("sweep (short pass, makespan s): " + "  ".join(
            f"{b}: " + " ".join(f"{n}={_fmt((row.get(n, {}).get('report') or {}).get('makespan_s'), '.2f')}"
                                for n in names) for b, row in sweep.items()))
    lb = result.get("lower_bound")
    if lb:
        lines.append(f"lower bound {lb['bound_s']:.2f} s (chain {lb['chain_s']:.2f} s, work {lb['work_s']:.2f} s)")
    if (alike := agreement_note(result)) is not None:
        lines.append(alike)
    for name, o in (result.get("oracle") or {}).items():
        lines.append(f"oracle order, simulated on {name}'s own fit: " + (
            f"{o['oracle_sim_s']:.2f} s against {o['fifo_sim_s']:.2f} s in arrival order ({o['over_fifo']:.3f})"
            if "over_fifo" in o else f"skipped ({o['skipped']})"))
    targets = targets_for(result)
    for key, value in result.get("ratios", {}).items():
        if value is None:
            continue
        target = targets.get(key)
        verdict = "" if target is None else (f"  (target <= {target}) " + ("met" if value <= target else "MISSED"))
        lines.append(f"{key:<38}{_fmt(value, '8.3f')}{verdict}")
    if result.get("stopped"):
        lines.append(f"stopped early: {result['stopped']}")
    return "\n".join(lines)


def _specs(args) -> list[tuple[str, str]]:
    """(label, spec) of every schedule to time, the ablation after mux."""
    specs = [(s, s) for s in (x.strip() for x in args.schedules.split(",")) if s]
    if args.ablation and any(label == "mux" for label, _ in specs):
        specs += [a for a in ABLATIONS if a[0] not in dict(specs)]
    return specs


def _budgets(args) -> list[int]:
    if args.max_batch_tokens is not None:
        return [args.max_batch_tokens]
    budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    if not budgets or any(b <= 0 for b in budgets):
        raise SystemExit(f"--budgets must list positive token budgets, got {args.budgets!r}")
    return budgets


def _base(spec: str) -> str:
    return split_spec(spec)[0]


def sweep_stage(run: Run, result: dict, out: Path, trace: list, specs: list[tuple[str, str]],
                budgets: list[int]) -> dict[str, int]:
    """Each base schedule's best budget (the sweep), or the one budget after a warm-up pass each; then
    a warm-up pass of each other kernel build the specs ask for (`kernel_build`) at its base's budget."""
    bases = [s for s in BASE_SCHEDULES if any(_base(spec) == s for _, spec in specs)]
    keep = _first_conversations(trace, run.args.sweep_fraction)
    short = [t for t in trace if t.conversation in keep]
    result["sweep_trace"] = trace_summary(short)
    if len(budgets) == 1:
        best = {s: budgets[0] for s in BASE_SCHEDULES}
        _warm_up(run, result, out, short, bases, best)
    else:
        best = _sweep(run, result, out, short, bases, budgets)
    builds = [b for b in dict.fromkeys(kernel_build(spec) for _, spec in specs) if b not in bases]
    _warm_up(run, result, out, short, builds, best)  # other page sizes, PDL on or off: other kernels
    return best


def _warm_up(run: Run, result: dict, out: Path, short: list, specs: list[str], best: dict[str, int]) -> None:
    """One untimed replay of the short trace per spec, at its base schedule's budget."""
    for spec in specs:
        if not run.fits("sweep"):
            result["stopped"] = "deadline during the warm-up"
            return
        r = run_replay(run, short, spec, best[_base(spec)], "sweep")
        result.setdefault("warmup", {})[spec] = {k: r.get(k) for k in ("finished", "wall_s", "compilations", "report")}
        _write(out, result)


def _sweep(run: Run, result: dict, out: Path, short: list, bases: list[str], budgets: list[int]) -> dict[str, int]:
    """Each base schedule on the short trace at every budget; the best budget of each."""
    result["sweep"] = {}
    for budget in budgets:
        row = result["sweep"].setdefault(str(budget), {})
        for spec in bases:
            if not run.fits("sweep"):
                result["stopped"] = f"deadline during the sweep (budget {budget}, {spec})"
                break
            r = run_replay(run, short, spec, budget, "sweep")
            row[spec] = {k: r.get(k) for k in ("finished", "wall_s", "compilations", "report", "error")}
            _write(out, result)
    best: dict[str, int] = {}
    for spec in bases:
        measured = {int(b): row[spec]["report"]["makespan_s"] for b, row in result["sweep"].items()
                    if row.get(spec, {}).get("finished")}
        best[spec] = min(measured, key=measured.get) if measured else budgets[0]
    result["best_budget"] = best
    return best


def _first_conversations(trace: list, fraction: float) -> set:
    keys = list(dict.fromkeys(t.conversation for t in trace))
    return set(keys[:max(1, min(len(keys), round(len(keys) * fraction)))])


def timed_stage(run: Run, result: dict, out: Path, trace: list, specs: list[tuple[str, str]],
                best: dict[str, int], after_round: Callable[[int], None] | None = None) -> None:
    """`--repeats` rounds of every spec, each round followed by `after_round(round)` (the
    interleaved peer's pass); `result["order"]` lists what ran, in order."""
    scheds = result["schedules"]
    order = result.setdefault("order", [])
    for label, spec in specs:
        budget = best.get(_base(spec), next(iter(best.values())))
        scheds[label] = {"spec": spec, "budget": budget, "repeats": []}
    for rep in range(run.args.repeats):
        for label, spec in specs:
            entry = scheds[label]
            if not run.fits("timed"):
                entry["stopped"] = result["stopped"] = f"deadline before repeat {rep + 1} of {label}"
                continue
            log.info("repeat %d/%d: %s at budget %d", rep + 1, run.args.repeats, label, entry["budget"])
            r = run_replay(run, trace, spec, entry["budget"], "timed")
            r["repeat"] = rep
            if entry["repeats"] and entry["repeats"][0].get("timeline"):
                r["timeline"] = []  # one timeline per schedule is enough for the plot
            entry["repeats"].append(r)
            order.append(f"{label}#{rep}")
            entry.update(summarize(entry["repeats"]))
            result["ratios"] = ratios(result)
            _write(out, result)
        if after_round is not None:
            after_round(rep)


PROFILE_TOP = 40
"""Functions kept per ranking of a host profile."""


def host_profile(profiler: cProfile.Profile, top: int = PROFILE_TOP) -> dict[str, Any]:
    """The `top` functions of `profiler` by own time and by cumulative time: [file:line(function),
    calls, own s, cumulative s]."""
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (primitive calls, calls, own, cumulative, callers)
    rows = [[f"{Path(f).name}:{line}({name})", calls, own, cum] for (f, line, name), (_, calls, own, cum, _)
            in stats.items()]
    return {"total_s": sum(r[2] for r in rows), "columns": ["function", "calls", "own_s", "cumulative_s"],
            "by_own": sorted(rows, key=lambda r: -r[2])[:top], "by_cumulative": sorted(rows, key=lambda r: -r[3])[:top]}


def _profiled(args) -> list[str]:
    """`--host-profile`'s schedules, each one of those the run times (or SystemExit, before any work)."""
    specs, timed = [s.strip() for s in args.host_profile.split(",") if s.strip()], [label for label, _ in _specs(args)]
    unknown = [s for s in specs if s not in timed]
    if unknown or (specs and args.resume):
        raise SystemExit(f"--host-profile {unknown or specs}: not among the timed schedules {timed}"
                         + (" (--resume times none)" if args.resume else ""))
    return specs


def profile_stage(run: Run, result: dict, out: Path, trace: list, specs: list[str]) -> None:
    """One untimed replay of each of `specs` (schedules of the timed stage) under cProfile, at the
    budget the timed stage used; `result["host_profile"][spec]`. Its figures are not comparable
    with a timed replay's: the profiler slows the host's Python several times over."""
    for spec in specs:
        entry = result["schedules"][spec]
        if not run.fits("timed"):
            result.setdefault("host_profile", {})[spec] = {"skipped": "deadline"}
            continue
        profiler = cProfile.Profile()
        replayed = run_replay(run, trace, entry["spec"], entry["budget"], "profile", profiler)
        result.setdefault("host_profile", {})[spec] = {
            "makespan_s": replayed.get("report", {}).get("makespan_s"), "finished": replayed["finished"],
            **host_profile(profiler)}
        _write(out, result)


def vllm_stage(run: Run, result: dict, out: Path, trace: list, deadline_total: float) -> dict[str, Any]:
    """The peer on the trace file the replays used: vLLM's async engine with its core in its own process
    at each of `--vllm-budgets`, then its in-process engine at each of `--vllm-in-process`. Each mode
    runs in a process of its own, after ours has freed the GPU. A resumed run adds to the budgets an
    earlier run measured (`--vllm-budgets ''` runs none of the own-process ones again)."""
    args = run.args
    earlier = result.get("vllm") or {}  # a resumed run keeps the peer's settings measured before
    trace_path = out / "trace.jsonl"  # written by `main`
    budgets = []
    for b in args.vllm_budgets.split(","):
        b = b.strip()
        if b == "best":
            medians = {n: (s.get("median") or {}).get("makespan_s") for n, s in result.get("schedules", {}).items()}
            medians = {n: v for n, v in medians.items() if v is not None}
            if medians:
                budgets.append(str(result["schedules"][min(medians, key=medians.get)]["budget"]))
        elif b:
            budgets.append(b)
    remaining = deadline_total - time.perf_counter() - 10
    if remaining < 90:
        return {**earlier, "reason": f"only {remaining:.0f} s left of --deadline-s for the peer"}
    env = _peer_env(args)
    peer = (_peer_process(args, env, out, trace_path, run.max_model_len, budgets, remaining, in_process=False,
                          weights=run.peer_weights)
            if budgets else {k: v for k, v in earlier.items() if k != "budgets"})
    peer["budgets"] = {**(earlier.get("budgets") or {}), **(peer.get("budgets") or {})}
    own = _best_pass(peer["budgets"], in_process=False)
    inproc = [(own or "default").split("~")[0] if b.strip() == "best" else b.strip()
              for b in args.vllm_in_process.split(",") if b.strip()]
    left = deadline_total - time.perf_counter() - 10
    if inproc and left >= 90:
        colocated = _peer_process(args, env, out, trace_path, run.max_model_len, inproc, left, in_process=True,
                                  weights=run.peer_weights)
        peer["budgets"].update(colocated.get("budgets") or {})
        for key in ("vllm", "weights"):
            peer.setdefault(key, colocated.get(key))
        peer["in_process"] = {k: colocated.get(k) for k in ("command", "exit", "wall_s", "error") if k in colocated}
    elif inproc:
        peer["in_process"] = {"error": f"only {left:.0f} s left of --deadline-s"}
    best = _best_pass(peer["budgets"])
    if best is not None:
        entry = peer["budgets"][best]
        peer.update(ran=True, best_budget=best, median=entry["median"], repeats=entry["passes"])
    return peer


def _no_peer_shape(cfg: ModelConfig) -> str | None:
    """Why the peer cannot build this model (it builds Qwen3-MoE shapes only), or None."""
    from benchmarks.vllm_peer import hf_config

    try:
        hf_config(cfg, cfg.max_position_embeddings)
    except ValueError as exc:
        return str(exc)
    return None


def _interleaved_budget(args) -> str:
    budgets = [b.strip() for b in args.vllm_budgets.split(",") if b.strip()]
    if len(budgets) != 1 or budgets[0] == "best":
        raise SystemExit(f"--vllm-interleave runs the peer at one budget (a number or 'default'), "
                         f"got --vllm-budgets {args.vllm_budgets!r}")
    return budgets[0]


def write_peer_weights(run: Run, device: torch.device, out: Path, result: dict) -> Path:
    """The weights our replays run, written for the peer to load (`--vllm-weights ours`); with no
    schedule of ours to run (`--resume`), the same random draw is made for it alone."""
    from benchmarks.vllm_peer import save_weights

    t0 = time.perf_counter()
    model = run.model if run.model is not None else random_model(run.cfg, device, run.args.seed,
                                                                 run.args.weight_std)
    path = save_weights(model, run.cfg, out / "peer-weights.safetensors")
    result["peer_weights"] = {"weights": "ours", "seed": run.args.seed, "bytes": path.stat().st_size,
                              "write_s": time.perf_counter() - t0}
    return path


def start_interleaved(args, out: Path, trace_path: Path, max_model_len: int, seconds: float,
                      weights: Path | None = None) -> PeerSession:
    """The peer kept up beside our stages (`benchmarks.interleave`), at the one budget asked for."""
    cmd, name = _peer_command(args, out, trace_path, max_model_len, [_interleaved_budget(args)], seconds,
                              in_process=args.vllm_interleave == "in-process", weights=weights)
    log.info("vLLM peer, interleaved: %s --serve", " ".join(cmd))
    return PeerSession(cmd, _peer_env(args), out / f"{name}.log", out / f"{name}.json")


def interleaved_pass(peer: PeerSession, result: dict, passes: int, deadline_total: float, rep: int) -> None:
    """One pass of the peer after round `rep` of ours, while it owes some of its `passes` and the
    deadline leaves room for one."""
    if rep >= passes or not peer.alive:
        return
    left = deadline_total - time.perf_counter() - 30
    if left <= 1.25 * max(peer.pass_s, default=0.0):
        result.setdefault("peer_skipped", []).append(f"vllm#{rep}: {left:.0f} s left")
    elif peer.run_pass(left) is not None:
        result["order"].append(f"vllm#{rep}")


def finish_interleaved(peer: PeerSession, result: dict, args, deadline_total: float) -> dict[str, Any]:
    """The passes still owed (`--vllm-passes` beyond our repeats), then the peer's JSON."""
    for rep in range(args.repeats, args.vllm_passes):
        interleaved_pass(peer, result, args.vllm_passes, deadline_total, rep)
    return peer.close()


def _best_pass(budgets: dict[str, Any], in_process: bool | None = None) -> str | None:
    """The budget key with the shortest median makespan (own-process keys only, in-process only, or any)."""
    timed = {k: e for k, e in budgets.items() if (e.get("median") or {}).get("makespan_s") is not None
             and (in_process is None or k.endswith("/in-process") == in_process)}
    return min(timed, key=lambda k: timed[k]["median"]["makespan_s"]) if timed else None


def _peer_env(args) -> dict[str, str]:
    """The peer's environment: offline vLLM, its bundle and this repository on the path."""
    from benchmarks.vllm_peer import ENV

    env = {**os.environ, **ENV}
    repo = str(Path(__file__).resolve().parents[1])
    site = [args.vllm_site, os.path.join(args.vllm_site, "nvidia_cutlass_dsl", "dsl_packages")]
    env["PYTHONPATH"] = os.pathsep.join([p for p in site if os.path.isdir(p)] + [repo, env.get("PYTHONPATH", "")])
    return env


def _peer_command(args, out: Path, trace_path: Path, max_model_len: int, budgets: list[str], seconds: float,
                  in_process: bool, weights: Path | None = None) -> tuple[list[str], str]:
    """The `benchmarks.vllm_peer` command line over `budgets`, and its output name."""
    name = "vllm-in-process" if in_process else "vllm"
    cmd = [sys.executable, "-m", "benchmarks.vllm_peer", "--trace", str(trace_path),
           "--out", str(out / f"{name}.json"), "--model", args.model, "--seed", str(args.seed),
           "--max-model-len", str(max_model_len), "--budgets", ",".join(dict.fromkeys(budgets)) or "default",
           "--passes", str(args.vllm_passes), "--warmups", str(args.vllm_warmups),
           "--deadline-s", f"{seconds - 15:.0f}", "--log", str(out / f"{name}.log")]
    cmd += ["--in-process"] if in_process else []
    if args.temperature > 0:  # the peer samples too; seeded as ours only if asked (its --seed is ours)
        cmd += ["--temperature", str(args.temperature)] + (["--turn-seeds"] if args.vllm_turn_seeds else [])
    if args.vllm_speculative:
        cmd += ["--speculative", args.vllm_speculative]
    if args.vllm_block_size is not None:
        cmd += ["--block-size", str(args.vllm_block_size)]
    if weights is not None:
        cmd += ["--weights", str(weights)]
    elif args.vllm_weights == "drawn":
        cmd += ["--drawn-weights", f"{args.seed}:{args.weight_std}"]
    interleaved = args.vllm_interleave is not None
    kv_gb = args.vllm_kv_gb if args.vllm_kv_gb is not None else (args.kv_gb if interleaved else None)
    if kv_gb is not None:
        cmd += ["--kv-cache-gb", str(kv_gb)]
    memory = args.vllm_memory if args.vllm_memory is not None else (0.45 if interleaved else None)
    if memory is not None:
        cmd += ["--gpu-memory-utilization", str(memory)]
    return cmd, name


def _peer_process(args, env: dict[str, str], out: Path, trace_path: Path, max_model_len: int, budgets: list[str],
                  seconds: float, in_process: bool, weights: Path | None = None) -> dict[str, Any]:
    """One `benchmarks.vllm_peer` process over `budgets`; its JSON with how it ran."""
    cmd, name = _peer_command(args, out, trace_path, max_model_len, budgets, seconds, in_process, weights)
    log_path = out / f"{name}.log"
    log.info("vLLM peer: %s", " ".join(cmd))
    t0 = time.perf_counter()
    with open(log_path, "w") as logf:
        try:
            proc = subprocess.run(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, timeout=seconds)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    peer = json.loads((out / f"{name}.json").read_text()) if (out / f"{name}.json").exists() else {}
    peer.update(command=" ".join(cmd), exit=code, wall_s=time.perf_counter() - t0)
    if not peer.get("ran"):
        tail = log_path.read_text(errors="replace").splitlines()[-8:] if log_path.exists() else []
        peer.setdefault("error", f"exit {code}; log tail: {' | '.join(tail)[-600:]}")
    return peer


def _resume(path: Path, fresh: dict[str, Any]) -> dict[str, Any]:
    """An earlier run's result, checked to be of the same trace (the peer must replay what we did)."""
    earlier = json.loads((path / "rollout.json").read_text())
    earlier.setdefault("weight_std", 0.02)  # runs before --weight-std drew every weight at 0.02
    for key in ("model", "profile", "conversations", "scale", "max_model_len", "weight_std", "trace"):
        if earlier.get(key) != json.loads(json.dumps(fresh.get(key))):
            raise SystemExit(f"--resume {path}: its {key} is {earlier.get(key)!r}, this run's is {fresh.get(key)!r}; "
                             f"give the same trace options")
    if sampled_at(earlier) != sampled_at(fresh):  # a peer sampling beside greedy replays of ours, or the reverse
        raise SystemExit(f"--resume {path}: its replays ran at temperature {sampled_at(earlier):g}, this run's "
                         f"is {sampled_at(fresh):g}; give the same --temperature")
    earlier.setdefault("resumed", []).append(fresh["command"])
    return earlier


def _max_model_len(args, cfg: ModelConfig, trace: list) -> int:
    if args.max_model_len != "auto":
        return int(args.max_model_len)
    need = max_context(trace) + 16
    return max(cfg.max_position_embeddings, -(-need // 1024) * 1024)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parser().parse_args(argv)
    if args.vllm_turn_seeds and not args.temperature:
        raise SystemExit("--vllm-turn-seeds seeds the peer's sampled turns: give --temperature > 0")
    micro_parts = _micro_parts(args.micro_parts)  # a typo fails here, not after the model is built
    profiled = _profiled(args)  # so does a schedule to profile that will not be timed
    t_start = time.perf_counter()
    deadline_total = t_start + args.deadline_s
    out = Path(os.path.expandvars(args.out))
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    vllm_on = cuda if args.vllm is None else args.vllm
    conversations, scale = PROFILE_SIZES[args.profile]
    conversations = args.conversations or conversations
    scale = args.scale or scale
    trace = make_trace(conversations, args.trace_seed, scale, args.wait_scale, profile=args.profile)
    cfg = PRESETS[args.model]
    max_model_len = _max_model_len(args, cfg, trace)
    if max_model_len > cfg.max_position_embeddings:  # random weights: RoPE is computed from positions
        cfg = cfg.replace(max_position_embeddings=max_model_len)
    result: dict[str, Any] = {
        "command": "python -m benchmarks.rollout " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "model": args.model, "profile": args.profile, "conversations": conversations, "scale": scale,
        "max_model_len": max_model_len, "weight_std": args.weight_std, "args": vars(args),
        "trace": trace_summary(trace),
        "moe": {"num_experts": cfg.num_moe_experts, "top_k": cfg.moe_router_topk} if cfg.num_moe_experts else None,
        "schedules": {}}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    costs = model_costs(cfg)
    bandwidth = peak = None
    if cuda:
        from benchmarks.ceilings import copy_bandwidth, matmul_rate

        bandwidth, peak = copy_bandwidth(device), matmul_rate(device)
        result["ceilings"] = {"copy_bytes_per_s": bandwidth, "bf16_matmul_flops": peak}
        lb = trace_lower_bound(trace, costs, peak, bandwidth, min(conversations, args.max_decode_rows))
        result["lower_bound"] = {"bound_s": lb.bound_s, "chain_s": lb.chain_s,
                                 "chain_conversation": lb.chain_conversation, "work_s": lb.work_s,
                                 "total_flops": lb.total_flops, "total_bytes": lb.total_bytes}
    specs = _specs(args)
    if args.resume:
        out = Path(os.path.expandvars(args.resume))
        result, specs = _resume(out, result), []
    write_trace(out / "trace.jsonl", trace)  # the peer and `benchmarks.sim_replay` replay this file
    if vllm_on and (why := _no_peer_shape(cfg)) is not None:
        if args.vllm:
            raise SystemExit(f"--vllm on {args.model}: {why} (pass --no-vllm)")
        log.info("no vLLM peer for %s: %s", args.model, why)
        vllm_on = False
    if args.vllm_interleave is not None and not (vllm_on and specs):
        raise SystemExit("--vllm-interleave runs the peer between our repeats: it needs --vllm (CUDA: on by "
                         "default) and schedules of ours to time (not --resume, not --schedules '')")
    if args.vllm_interleave is not None:
        _interleaved_budget(args)  # a second budget fails here, before the model is built
    interleaved = args.vllm_interleave is not None
    reserve = 30.0 if interleaved else args.vllm_reserve_s if vllm_on else 0.0  # (an interleaved peer: its close)
    ours = deadline_total - reserve
    run = Run(args, cfg, None, max_model_len, _num_blocks(args, cfg), ours)
    run.start_sweep_clock()
    result["num_blocks"] = run.num_blocks
    if specs or args.micro:
        t0 = time.perf_counter()
        run.model = random_model(cfg, device, args.seed, args.weight_std)
        result["model_build_s"] = time.perf_counter() - t0
    if vllm_on and args.vllm_weights == "ours":
        run.peer_weights = write_peer_weights(run, device, out, result)
    elif vllm_on:  # (a resumed run's earlier record of them no longer holds)
        result["peer_weights"] = ({"weights": "drawn", "seed": args.seed, "std": args.weight_std}
                                  if args.vllm_weights == "drawn" else {"weights": "dummy"})
    peer = None
    if interleaved:  # starts once our weights are written (those it loads)
        peer = start_interleaved(args, out, out / "trace.jsonl", max_model_len, args.deadline_s, run.peer_weights)
    _write(out, result)
    if args.micro and cuda:
        result["micro"] = run_micro(run.model, cfg, args, costs, bandwidth, peak, micro_parts)
        gc.collect()
        torch.cuda.empty_cache()
        _write(out, result)
    if specs:
        after = None
        if peer is not None:  # the sweep times budgets and the first engine its expert kernel: nothing beside them
            peer.wait_ready(max(1.0, deadline_total - time.perf_counter()))
            run.start_sweep_clock()
            after = functools.partial(interleaved_pass, peer, result, args.vllm_passes, deadline_total)
        best = sweep_stage(run, result, out, trace, specs, _budgets(args))
        result["expert_kernel"] = run.expert_choice
        timed_stage(run, result, out, trace, specs, best, after)
        result["oracle"] = simulated_oracle(result, trace)
        result["ratios"] = ratios(result)
        _write(out, result)
        profile_stage(run, result, out, trace, profiled)
    run.model = None
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    if peer is not None:
        result["vllm"] = finish_interleaved(peer, result, args, deadline_total)
        result["ratios"] = ratios(result)
        _write(out, result)
    elif vllm_on:
        result["vllm"] = vllm_stage(run, result, out, trace, deadline_total)
        result["ratios"] = ratios(result)
        _write(out, result)
    if run.peer_weights is not None:
        run.peer_weights.unlink(missing_ok=True)  # the size of the model: the peer has loaded it
    if args.hf and time.perf_counter() + args.hf_budget_s < deadline_total:
        from benchmarks.hf_peer import run_peer

        result["hf_peer"] = run_peer(cfg, trace, args.device, args.seed, args.hf_budget_s)
        _write(out, result)
    result["ratios"] = ratios(result)
    result["agreement"] = agreement(result)
    result["wall_s"] = time.perf_counter() - t_start
    _write(out, result)
    print(table(result), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a peer's background thread must not keep the process alive
