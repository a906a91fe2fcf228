"""Schedule specs of the rollout benchmark,
'schedule[@span][+priority][~drafts][/sync][/sms:N|/split:N][/pw:N][/pdl|/nopdl][/bs:N]': what each asks for
(`split_spec`), the schedule it runs on the whole device (`unpartitioned`) and the `EngineConfig` its
replays run under (`engine_config`). `benchmarks.rollout` times them and `benchmarks.sim_replay`
simulates them from the same parse.
"""
from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Iterator
from typing import NamedTuple

from megatron_rollout.engine.config import SpeculativeConfig
from megatron_rollout.engine.priority import PRIORITIES


class Spec(NamedTuple):
    """What a schedule spec 'schedule[@span][+priority][~drafts][/sync][/sms:N|/split:N][/pw:N][/pdl|/nopdl][/bs:N]'
    asks for."""

    schedule: str
    span: str | None
    """mux's segment policy (None: --mux-span)."""
    ahead: str | None
    """"off" for '/sync' (decode ahead off); None: --decode-ahead."""
    priority: str | None
    """The engine's priority (`engine.priority`); None: SchedulerConfig's default."""
    speculative: SpeculativeConfig | None = None
    """'~ngram:K[:R][+T@W][^S]': n-gram drafts of K tokens (`drafts.ngram`), only while at most R rows
    decode, T while at most W do, S for a row whose last draft was kept whole."""
    decode_sms: int = 0
    """'/sms:N' or '/split:N': prefill's stream leaves N SMs out (`RunnerConfig.decode_sms`; mux only)."""
    partition: str = "held"
    """'/split:N': decode beside prefill runs on those N SMs alone (`RunnerConfig.partition`)."""
    prefill_graph_tokens: tuple[int, ...] | None = None
    """'/pw:N': piecewise P graphs up to N tokens (`piecewise_buckets`); None: `RunnerConfig`'s."""
    block_size: int | None = None
    """'/bs:N': KV blocks of N tokens (`SchedulerConfig.block_size`) in as many bytes of KV cache as
    the run's --block-size gives (`engine_config`); None: --block-size."""
    pdl: bool | None = None
    """'/pdl' (True) or '/nopdl' (False): the replay's Triton kernels launched with programmatic
    dependent launch or without (`kernels.pdl`), for the engine's build and replay alone
    (`pdl_launches`); None: the process's setting (on by default since 2026-12-06)."""


PIECEWISE_STEP = 2048
"""'/pw:N' adds piecewise P buckets this many tokens apart past the default largest one."""


def piecewise_buckets(largest: int) -> tuple[int, ...]:
    """`RunnerConfig.prefill_graph_tokens` with buckets every `PIECEWISE_STEP` tokens past its largest,
    up to `largest` (itself the last). Each bucket keeps its q, k and v: about 10 KB a token and layer
    for `qwen3-30b-a3b-12l` (`runner.piecewise`), so 16,384 adds several GB."""
    from megatron_rollout.engine import RunnerConfig

    default = RunnerConfig.prefill_graph_tokens
    more = range(default[-1] + PIECEWISE_STEP, largest, PIECEWISE_STEP)
    return tuple(sorted({*default, *more, largest}))


def _drafts(spec: str, text: str) -> SpeculativeConfig | None:
    """'ngram:K[:R][+T@W][^S]' -> SpeculativeConfig("ngram", K, tail_rows=R, tail_k=T, tail_k_rows=W,
    streak_k=S); '' -> None."""
    if not text:
        return None
    text, caret, streak = text.partition("^")
    text, _, tail = text.partition("+")
    method, *numbers = text.split(":")
    try:
        k, *rows = (int(n) for n in numbers)
        wide = {"streak_k": int(streak)} if caret else {}
        if tail:
            tail_k, at, tail_rows = tail.partition("@")
            wide.update(tail_k=int(tail_k), **({"tail_k_rows": int(tail_rows)} if at else {}))
        return SpeculativeConfig(method, k, tail_rows=rows[0] if rows else None, **wide)
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"schedule {spec!r}: drafts are '~ngram:K', '~ngram:K:R', either with '+T@W', "
                         f"then '^S' ({exc})") from None


def split_spec(spec: str) -> Spec:
    """'schedule[@span][+priority][~ngram:K[:R][+T@W]][/sync][/sms:N|/split:N][/pw:N][/pdl|/nopdl][/bs:N]' -> its
    parts: '/sync' turns decode ahead off, '/sms:24' leaves 24 SMs out of prefill's stream (mux), '/split:24'
    too and runs decode beside prefill on those 24 alone, '/pw:16384' captures piecewise P graphs up to
    16,384 tokens (`piecewise_buckets`), '/pdl' or '/nopdl' launches the Triton kernels with programmatic
    dependent launch or without, '/bs:64' stores KV in blocks of 64 tokens, '+name' picks the engine's
    priority (e.g. 'mux+most-turns'), '~ngram:4' drafts 4 tokens per row by prompt lookup (':16': only
    while at most 16 rows decode; '+7@2': 7 while at most 2 do; '^7': 7 for a row whose last draft was
    kept whole)."""
    core, *flags = spec.split("/")
    launch = [f == "pdl" for f in flags if f in ("pdl", "nopdl")]
    flags = [f for f in flags if f not in ("pdl", "nopdl")]
    held = [f.partition(":") for f in flags if f.startswith(("sms:", "split:"))]
    pw = [f.partition(":")[2] for f in flags if f.startswith("pw:")]
    bs = [f.partition(":")[2] for f in flags if f.startswith("bs:")]
    if any(f != "sync" and not f.startswith(("sms:", "split:", "pw:", "bs:")) for f in flags) \
            or flags.count("sync") > 1 or len(held) > 1 or not all(n.isdigit() and int(n) > 0 for _, _, n in held) \
            or len(pw) > 1 or not all(n.isdigit() and int(n) > 0 for n in pw) or len(launch) > 1 or len(bs) > 1 \
            or not all(n.isdigit() and int(n) > 0 for n in bs):
        raise SystemExit(f"schedule {spec!r}: the suffixes are '/sync' (decode ahead off), '/sms:N' or "
                         f"'/split:N' (N > 0 SMs left out of prefill's stream), and '/pw:N' (piecewise P graphs "
                         f"up to N > 0 tokens), '/pdl' or '/nopdl' (programmatic dependent launch on or off), and "
                         f"'/bs:N' (KV blocks of N > 0 tokens), each at most once")
    flag = "sync" if "sync" in flags else ""
    sms = [n for _, _, n in held]
    core, _, drafts = core.partition("~")
    core, _, priority = core.partition("+")
    if priority and priority not in PRIORITIES:
        raise SystemExit(f"schedule {spec!r}: unknown priority {priority!r}; choose from {sorted(PRIORITIES)}")
    schedule, _, span = core.partition("@")
    if sms and schedule != "mux":
        raise SystemExit(f"schedule {spec!r}: '/sms:N' and '/split:N' are for mux, the one schedule that runs "
                         f"prefill beside decode")
    return Spec(schedule, span or None, "off" if flag else None, priority or None, _drafts(spec, drafts),
                int(sms[0]) if sms else 0, "split" if held and held[0][0] == "split" else "held",
                piecewise_buckets(int(pw[0])) if pw else None, int(bs[0]) if bs else None,
                launch[0] if launch else None)


def kernel_build(spec: str) -> str:
    """The base schedule with the suffixes of `spec` that build other kernels ('/bs:N': another page size;
    '/pdl', '/nopdl'): what a warm-up pass must run before `spec`'s timed replays compile nothing."""
    parts = split_spec(spec)
    return parts.schedule + (f"/bs:{parts.block_size}" if parts.block_size else "") \
        + ("" if parts.pdl is None else "/pdl" if parts.pdl else "/nopdl")


@contextlib.contextmanager
def pdl_launches(spec: Spec) -> Iterator[None]:
    """`kernels.pdl`'s process-wide switch as a '/pdl' or '/nopdl' spec asks while the block runs (the
    engine's build, graph capture and replay), then back as it was; a spec with neither leaves it alone."""
    from megatron_rollout.kernels import pdl

    before = pdl.ENABLED
    pdl.ENABLED = before if spec.pdl is None else spec.pdl
    try:
        yield
    finally:
        pdl.ENABLED = before


def unpartitioned(spec: str) -> str:
    """The spec without its '/sms:N' or '/split:N' (the schedule it runs on the whole device)."""
    return re.sub(r"/(sms|split):\d+", "", spec)


def engine_config(args: argparse.Namespace, num_blocks: int, max_model_len: int, spec: Spec, budget: int,
                  measure_expert_kernels: bool = True):
    """The `EngineConfig` a replay of `spec` at `budget` runs under (also what `benchmarks.sim_replay`
    simulates: `SimConfig.of_engine`)."""
    from megatron_rollout.engine import EngineConfig, KVConfig, MuxConfig, RunnerConfig, SchedulerConfig

    a, priority = args, spec.priority or SchedulerConfig.priority
    block_size = spec.block_size or a.block_size
    return EngineConfig(
        scheduler=SchedulerConfig(spec.schedule, block_size=block_size, max_batch_tokens=budget,
                                  max_decode_rows=a.max_decode_rows, priority=priority),
        kv=KVConfig(num_blocks=num_blocks * a.block_size // block_size),  # the same bytes of KV cache
        mux=MuxConfig(spec.span or a.mux_span),
        runner=RunnerConfig(attention=a.attention, measure_expert_kernels=measure_expert_kernels,
                            decode_ahead=spec.ahead or a.decode_ahead, decode_sms=spec.decode_sms,
                            partition=spec.partition,
                            **({"prefill_graph_tokens": spec.prefill_graph_tokens} if spec.prefill_graph_tokens
                               else {})),
        seed=a.seed, max_model_len=max_model_len, speculative=spec.speculative)
