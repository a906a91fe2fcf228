"""`megatron-rollout`: generate, make-trace, replay. Also `python -m megatron_rollout.cli`.

Under `torchrun` the parallel flags (`--atp/--adp/--ep`) come after the subcommand; every rank
runs the command and only rank 0 prints.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
import warnings

from megatron_rollout.options import add_engine_args, check_writable


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, got {text!r}") from None


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows every option's default, except on required ones (they have none)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.required else super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megatron-rollout", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    command = functools.partial(sub.add_parser, formatter_class=_Defaults)
    g = command("generate", help="generate from token-id prompts (batched)")
    add_engine_args(g)
    g.add_argument("--prompt-ids", type=_ids, action="append", required=True, help="e.g. 1,2,3 (repeatable)")
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 keeps all")
    g.add_argument("--top-p", type=float, default=1.0, help="sample within this probability mass (nucleus)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed; None draws a fresh one")
    t = command("make-trace", help="write a synthetic agentic trace (JSONL)")
    t.add_argument("--conversations", type=int, default=128, help="multi-turn conversations in the trace")
    t.add_argument("--seed", type=int, default=0, help="seed of the trace's random draws")
    t.add_argument("--scale", type=float, default=1.0, help="shrink token counts (e.g. 0.01 for CPU)")
    t.add_argument("--profile", default="current", choices=("current", "prefill", "decode"),
                   help="trace profile (trace.make.PROFILES): current, prefill (paper-like, ~30:1) or decode")
    t.add_argument("--wait-scale", type=float, default=None, help="tool-wait scale; None takes --scale")
    t.add_argument("--out", required=True, help="the JSONL file to write")
    r = command("replay", help="replay a trace and report makespan, latencies, decode wait")
    add_engine_args(r)
    r.add_argument("--trace", required=True, help="JSONL trace to replay (see make-trace)")
    r.add_argument("--seed", type=int, default=0, help="seed of the replayed input token ids")
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return ap


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # megatron-core announces on import that it falls back from Transformer Engine/Apex: expected here.
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    args = parser().parse_args(argv)
    if args.command == "make-trace":
        from megatron_rollout.trace.make import make_trace
        from megatron_rollout.trace.schema import write_trace

        try:
            check_writable(args.out, "--out")
            trace = make_trace(args.conversations, args.seed, args.scale, args.wait_scale, profile=args.profile)
            write_trace(args.out, trace)
        except (ValueError, OSError) as exc:
            print(f"megatron-rollout make-trace: error: {exc}", file=sys.stderr)
            return 2
        print(_trace_summary(args.out, trace))
        return 0
    from megatron_rollout.launch import run_generate, run_replay
    from megatron_rollout.model.te_layers import TEUnavailable

    if args.command == "generate" and "," in args.schedule:
        print("megatron-rollout generate: error: --schedule takes one schedule", file=sys.stderr)
        return 2
    try:
        report = run_generate(args) if args.command == "generate" else run_replay(args)
    except (ValueError, FileNotFoundError, TEUnavailable) as exc:
        print(f"megatron-rollout {args.command}: error: {exc}", file=sys.stderr)
        return 2
    if report is not None:  # rank 0
        print(json.dumps(report, allow_nan=False) if args.json else _human(report))  # NaN is not JSON
    return 0


def _trace_summary(path: str, trace: list) -> str:
    """One line: what `make-trace` wrote, and where."""
    conversations = len({r.conversation for r in trace})
    inputs, outputs = sum(r.input_tokens for r in trace), sum(r.output_tokens for r in trace)
    return (f"wrote {path}: {len(trace)} requests in {conversations} conversations, {inputs} input and "
            f"{outputs} output tokens")


def _human(report: dict) -> str:
    if "outputs" in report:
        return "\n".join(f"[{i}] {o['finish_reason']}: {o['token_ids']}" for i, o in enumerate(report["outputs"]))
    return "\n".join(f"{k:>20}: {v}" for k, v in report.items())


if __name__ == "__main__":
    sys.exit(main())
