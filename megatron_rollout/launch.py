"""What the CLI runs: build the model and engine from arguments, run, and report at rank 0.

Kept apart from `cli.py` so that the CLI stays an argument list and this stays testable.
"""
from __future__ import annotations

import argparse
import logging

import torch

from megatron_rollout.engine import RolloutEngine, SamplingParams
from megatron_rollout.model.checkpoint import load_model

log = logging.getLogger(__name__)


def _device(args: argparse.Namespace) -> str:
    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def build_engine(args: argparse.Namespace, timeline=None):
    """(engine, runtime) for these arguments; runtime is None on one process."""
    from megatron_rollout.cli import engine_config

    world = args.atp * args.adp
    if args.ep is not None and args.ep != world:
        raise ValueError(f"--ep must equal --atp x --adp ({world}) with expert tensor parallel 1, got {args.ep}")
    if world == 1:
        model = load_model(args.model, device=_device(args))
        return RolloutEngine(model, engine_config(args), timeline=timeline), None
    from megatron_rollout.distributed import Runtime

    runtime = Runtime.start(args.atp, args.adp, device=_device(args), timeout_s=args.timeout)
    model = load_model(args.model, comm=runtime.comm, device=runtime.device)
    return runtime.engine(model, engine_config(args), timeline=timeline), runtime


def _output(result) -> dict:
    return {"token_ids": result.token_ids, "logprobs": result.logprobs, "finish_reason": result.finish_reason.value,
            "weight_version": result.weight_version, **({"error": result.error} if result.error else {})}


def run_generate(args: argparse.Namespace) -> dict | None:
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    timeline = _timeline(args)
    engine, runtime = build_engine(args, timeline)
    if runtime is None:
        results = engine.generate(args.prompt_ids, params)
    else:
        results = runtime.generate(engine, args.prompt_ids, params)
    _write_timeline(args, timeline, runtime)
    if runtime is not None and not runtime.is_main:
        return None
    return {"outputs": [_output(r) for r in results]}


def run_replay(args: argparse.Namespace) -> dict | None:
    from megatron_rollout.trace.replay import replay
    from megatron_rollout.trace.schema import load_trace

    requests = load_trace(args.trace)
    timeline = _timeline(args)
    engine, runtime = build_engine(args, timeline)
    vocab = engine.model.cfg.vocab_size
    if runtime is None:
        report, _ = replay(engine, requests, seed=args.seed, progress=not args.no_progress, vocab_size=vocab,
                           schedule=args.schedule)
        report = report.to_dict()
    else:
        report = runtime.replay(engine, requests, seed=args.seed, progress=not args.no_progress, vocab_size=vocab,
                                schedule=args.schedule)
    _write_timeline(args, timeline, runtime)
    return report


def _timeline(args: argparse.Namespace):
    if not args.timeline:
        return None
    from megatron_rollout.trace.timeline import Timeline

    return Timeline()


def _write_timeline(args: argparse.Namespace, timeline, runtime) -> None:
    if timeline is None:
        return
    if runtime is not None:
        timeline = runtime.gather_timeline(timeline)
        if timeline is None:
            return
    timeline.write_chrome_trace(args.timeline)
