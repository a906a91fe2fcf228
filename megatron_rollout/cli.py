"""`megatron-rollout`: generate, make-trace, replay. Also `python -m megatron_rollout.cli`.

Under `torchrun` the parallel flags (`--atp/--adp/--ep`) come after the subcommand; every rank
runs the command and only rank 0 prints.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings

from megatron_rollout.engine import EngineConfig, Schedule


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, got {text!r}") from None


def _schedules(text: str) -> str:
    names = [s.strip() for s in text.split(",") if s.strip()]
    known = [s.value for s in Schedule]
    if not names or any(n not in known for n in names):
        raise argparse.ArgumentTypeError(f"--schedule takes {', '.join(known)} (or a comma list for replay), "
                                         f"got {text!r}")
    return ",".join(names)


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-moe", help="preset name or Hugging Face checkpoint directory")
    p.add_argument("--schedule", default="chunked", type=_schedules,
                   help="off | chunked | mux; replay also takes a list (off,chunked,mux) to compare in one run")
    p.add_argument("--mux-span", default="load", help="mux segment policy: load | fixed:K")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per rank")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--timeline", default=None, help="write a Chrome/Perfetto trace of P and D work here")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--atp", type=int, default=1, help="attention tensor parallel size")
    p.add_argument("--adp", type=int, default=1, help="attention data parallel size")
    p.add_argument("--ep", type=int, default=None, help="expert parallel size (= atp * adp)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a missing rank is an error")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megatron-rollout", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate from token-id prompts (batched)")
    _engine_args(g)
    g.add_argument("--prompt-ids", type=_ids, action="append", required=True, help="e.g. 1,2,3 (repeatable)")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    t = sub.add_parser("make-trace", help="write a synthetic agentic trace (JSONL)")
    t.add_argument("--conversations", type=int, default=128)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--scale", type=float, default=1.0, help="shrink token counts (e.g. 0.01 for CPU)")
    t.add_argument("--out", required=True)
    r = sub.add_parser("replay", help="replay a trace and report makespan, latencies, decode wait")
    _engine_args(r)
    r.add_argument("--trace", required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--no-progress", action="store_true")
    return ap


def engine_config(args: argparse.Namespace, schedule: str | None = None) -> EngineConfig:
    return EngineConfig(schedule=schedule or args.schedule, block_size=args.block_size, num_blocks=args.num_blocks,
                        max_batch_tokens=args.max_batch_tokens, mux_span=args.mux_span)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # megatron-core announces on import that it falls back from Transformer Engine/Apex: expected here.
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    args = parser().parse_args(argv)
    if args.command == "make-trace":
        from megatron_rollout.trace.make import make_trace
        from megatron_rollout.trace.schema import write_trace

        write_trace(args.out, make_trace(args.conversations, args.seed, args.scale))
        return 0
    from megatron_rollout.launch import run_generate, run_replay

    if args.command == "generate" and "," in args.schedule:
        print("megatron-rollout generate: error: --schedule takes one schedule", file=sys.stderr)
        return 2
    try:
        report = run_generate(args) if args.command == "generate" else run_replay(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"megatron-rollout {args.command}: error: {exc}", file=sys.stderr)
        return 2
    if report is not None:  # rank 0
        print(json.dumps(report) if args.json else _human(report))
    return 0


def _human(report: dict) -> str:
    if "outputs" in report:
        return "\n".join(f"[{i}] {o['finish_reason']}: {o['token_ids']}" for i, o in enumerate(report["outputs"]))
    return "\n".join(f"{k:>20}: {v}" for k, v in report.items())


if __name__ == "__main__":
    sys.exit(main())
