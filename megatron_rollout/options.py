"""Engine options on a command line: the arguments, and the one place they become an `EngineConfig`.

Kept below both `cli` (which declares the arguments) and `launch` (which builds the engine from
them), so that neither imports the other. Strings are parsed by the config's own parsers
(`engine.config.parse_span`, `Schedule`, `RunnerConfig.kind`), never here.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from megatron_rollout.comm.dist import CommConfig
from megatron_rollout.engine.api import Schedule
from megatron_rollout.engine.config import (
    DEFAULT_NUM_BLOCKS,
    DEFAULT_SPAN,
    EngineConfig,
    KVConfig,
    MuxConfig,
    SpeculativeConfig,
    parse_span,
)
from megatron_rollout.engine.priority import PRIORITIES
from megatron_rollout.engine.scheduler import SchedulerConfig
from megatron_rollout.runner.config import RUNNER_ENV, RUNNER_KINDS, RunnerConfig, runner_kind_from_env


def schedules(text: str) -> str:
    """`--schedule`: one schedule, or a comma list (replay compares them in one run)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    known = [s.value for s in Schedule]
    if not names or any(n not in known for n in names):
        raise argparse.ArgumentTypeError(f"--schedule takes {', '.join(known)} (or a comma list for replay), "
                                         f"got {text!r}")
    return ",".join(names)


def positive_int(text: str) -> int:
    """`--atp`, `--adp`, `--ep`: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes an integer >= 1, got {value}")
    return value


def positive_seconds(text: str) -> float:
    """`--timeout`: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number of seconds > 0, got {text!r}") from None
    if not 0 < value <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"takes a number of seconds > 0 and at most {MAX_TIMEOUT_S:.0f} (a week), "
                                         f"got {text}")
    return value


MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""`--timeout`'s bound: longer waits overflow the clocks of the waits below (threading's, gloo's)."""


def check_writable(path: str, flag: str) -> None:
    """Refuse (ValueError naming `flag`) an output file that cannot be written, before any work is
    done: a run that only finds out when it writes its results loses them. Leaves no file behind
    (an existing one is opened for appending, not truncated; a FIFO without a reader is refused)."""
    file = Path(path)
    if file.is_dir():
        raise ValueError(f"{flag} {path} is a directory: give a file name")
    existed = file.exists()
    try:
        os.close(os.open(file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o666))
    except OSError as exc:
        raise ValueError(f"{flag} {path} cannot be written ({exc.strerror}): give a path in a writable "
                         f"directory") from None
    if not existed:
        file.unlink(missing_ok=True)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-moe", help="preset name or Hugging Face checkpoint directory")
    p.add_argument("--schedule", default="chunked", type=schedules,
                   help="off | chunked | mux; replay also takes a list (off,chunked,mux) to compare in one run")
    p.add_argument("--mux-span", default=DEFAULT_SPAN, help="mux segment policy: load | fixed:K | budget:US")
    p.add_argument("--num-blocks", type=int, default=DEFAULT_NUM_BLOCKS, help="KV blocks per rank")
    p.add_argument("--block-size", type=int, default=16, help="token positions per KV block")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="tokens one engine step may run (P and D)")
    p.add_argument("--priority", default="fifo", choices=sorted(PRIORITIES),
                   help="which requests are served first: fifo (arrival) or a critical-path guess (docs/design.md)")
    p.add_argument("--runner", default=None, choices=RUNNER_KINDS,
                   help=f"auto | eager | cuda; where not given, ${RUNNER_ENV}, else auto")
    p.add_argument("--attention", default="auto",
                   help="CUDA runner attention kernels: auto | triton | varlen | flash | portable")
    p.add_argument("--decode-ahead", default="auto", choices=("auto", "on", "off"),
                   help="issue the next decode step before reading this one's tokens (auto: CUDA runner, one rank)")
    p.add_argument("--decode-sms", type=int, default=0, metavar="N",
                   help="mux only: SMs the prefill stream leaves out, so decode beside it always finds them free "
                        "(a green context; the driver rounds up to 8 on Hopper; 0: none). Schedules of a list "
                        "other than mux run without")
    p.add_argument("--decode-partition", default="held", choices=("held", "split"),
                   help="with --decode-sms: held (decode keeps the whole device) or split (beside prefill, decode "
                        "runs on the held-back SMs alone, from graphs captured there)")
    p.add_argument("--fp8", default="off", choices=("off", "tensor", "block", "te-delayed", "te-current", "te-block"),
                   help="FP8 weights for the linears and experts: off | tensor (per-tensor scales) | block (128x128) "
                        "| te-<recipe> (Transformer Engine's FP8 layers, where TE is installed)")
    p.add_argument("--mtp", type=int, default=0, metavar="K",
                   help="speculative decoding: the model's MTP layer drafts K tokens per decode iteration (0: off)")
    p.add_argument("--ngram", type=int, default=0, metavar="K",
                   help="speculative decoding: K tokens per decode iteration looked up in the row's own context "
                        "(n-gram of 2 to 4 tokens; 0: off)")
    p.add_argument("--draft-tail-rows", type=positive_int, default=None, metavar="R",
                   help="with --mtp or --ngram: draft only while at most R rows decode (the rollout's tail)")
    p.add_argument("--draft-tail-k", type=positive_int, default=None, metavar="T",
                   help="with --ngram: draft T tokens per row while at most --draft-tail-k-rows rows decode")
    p.add_argument("--draft-tail-k-rows", type=positive_int, default=None, metavar="W",
                   help="with --draft-tail-k: the most decoding rows at which it applies (default 4)")
    p.add_argument("--draft-streak-k", type=positive_int, default=None, metavar="S",
                   help="with --ngram: draft S tokens for a row whose last draft was kept whole")
    p.add_argument("--draft-group", action="store_true",
                   help="with --ngram: a row whose own context proposes nothing drafts from the other samples of "
                        "its n > 1 request (an RL group)")
    p.add_argument("--device", default=None, help="cpu | cuda; None takes cuda when available")
    p.add_argument("--timeline", default=None, help="write a Chrome/Perfetto trace of P and D work here")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--atp", type=positive_int, default=1, help="attention tensor parallel size")
    p.add_argument("--adp", type=positive_int, default=1, help="attention data parallel size")
    p.add_argument("--ep", type=positive_int, default=None, help="expert parallel size; must equal atp * adp")
    p.add_argument("--comm-backend", default="alltoall", help="dispatch domains: alltoall | deepep")
    p.add_argument("--p-exchange", default="allgather", help="P's expert exchange: allgather | alltoall")
    p.add_argument("--d-exchange", default="alltoall", help="D's expert exchange: alltoall | allgather")
    p.add_argument("--timeout", type=positive_seconds, default=120.0, help="seconds before a missing rank is an error")


def engine_config(args: argparse.Namespace, schedule: str | None = None) -> EngineConfig:
    """The `EngineConfig` these arguments describe (`schedule` overrides `--schedule`)."""
    name = Schedule(schedule or args.schedule)
    return EngineConfig(
        scheduler=SchedulerConfig(name, args.block_size, args.max_batch_tokens, priority=args.priority),
        kv=KVConfig(num_blocks=args.num_blocks),
        mux=MuxConfig(span=parse_span(args.mux_span)),
        runner=RunnerConfig(kind=args.runner or runner_kind_from_env(), attention=args.attention,
                            decode_ahead=args.decode_ahead, fp8=args.fp8,
                            decode_sms=args.decode_sms if name is Schedule.MUX else 0,
                            partition=args.decode_partition),
        comm=CommConfig(backend=args.comm_backend, timeout_s=args.timeout, p_exchange=args.p_exchange,
                        d_exchange=args.d_exchange),
        speculative=speculative_config(args))


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """`--mtp K` or `--ngram K` (not both), with `--draft-tail-rows`, `--draft-tail-k`, `--draft-streak-k`
    and `--draft-group`;
    None: plain decoding."""
    if args.mtp and args.ngram:
        raise ValueError(f"--mtp {args.mtp} and --ngram {args.ngram} are two draft sources: pass one of them")
    if args.draft_tail_rows is not None and not (args.mtp or args.ngram):
        raise ValueError("--draft-tail-rows needs --mtp K or --ngram K (it says when drafts are made)")
    if args.draft_tail_k is not None and not args.ngram:
        raise ValueError("--draft-tail-k needs --ngram K (longer n-gram drafts in the tail)")
    if args.draft_tail_k_rows is not None and args.draft_tail_k is None:
        raise ValueError("--draft-tail-k-rows needs --draft-tail-k T (it says while how few rows T applies)")
    if args.draft_group and not args.ngram:
        raise ValueError("--draft-group needs --ngram K (a group's samples are looked up as a row's own context is)")
    if args.draft_streak_k is not None and not args.ngram:
        raise ValueError("--draft-streak-k needs --ngram K (longer n-gram drafts for rows whose guesses hold)")
    if not (args.mtp or args.ngram):
        return None
    method, k = ("mtp", args.mtp) if args.mtp else ("ngram", args.ngram)
    return SpeculativeConfig(method, k, tail_rows=args.draft_tail_rows, tail_k=args.draft_tail_k,
                             tail_k_rows=args.draft_tail_k_rows or SpeculativeConfig.tail_k_rows,
                             streak_k=args.draft_streak_k, group=args.draft_group)
