"""Rollout figures from finished requests: the numbers docs/design.md §9 compares between schedules.

A `ReplayReport` is computed from the engine's `RequestOutput`s (their `times` are
`time.perf_counter` marks), which conversation each request belongs to, the replay's start time
and the engine's mean decode wait. Definitions:

- request completion = finish - arrival (arrival = when the turn was submitted, after its tool
  wait; the wait itself is not counted);
- trajectory completion = last finish - first arrival of a conversation, over conversations none
  of whose requests failed (a cut trajectory would look short);
- makespan = last finish of any request - replay start; tokens/s = output tokens / makespan;
- TTFT = first_token - arrival, split in its means into the queue (admitted - arrival, admitted
  = when the scheduler first planned the request's prefill) and the prefill (first_token -
  admitted); percentiles are numpy's default (linear interpolation between the two closest
  ranks, `np.percentile(..., method="linear")`).

Latency and token figures count completed requests only: those that generated every token the
trace asked for. A request that stopped short (finish `length` because the context was full:
the trace asked 100, the model had room for 54) counts in `truncated`, not as a success; failed
ones (finished with an error, or refused by the engine at submission) in `failed`; turns never
submitted after either in `skipped`. `input_tokens` counts the trace's new tokens of completed
requests; `prefill_tokens` what the engine actually prefilled for them, which is more when a
preempted or evicted context was recomputed. A figure with no data is NaN (null in JSON).
Left out: comparing reports (ratios are taken within one run by the caller) and anything
per rank or per phase (that is the timeline's job).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from megatron_rollout.engine.api import FinishReason, RequestOutput, Schedule
from megatron_rollout.trace.schema import ConversationId, TraceRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplayReport:
    """Figures of one replay of one trace under one schedule."""

    schedule: str
    """'off', 'chunked', 'mux' (Schedule values), or '' when not given."""
    requests: int
    """Requests that completed: every output token the trace asked for was generated."""
    truncated: int
    """Requests that finished with fewer output tokens than the trace asked (context full)."""
    failed: int
    """Requests the engine finished with an error or refused at submission."""
    skipped: int
    """Turns never submitted because an earlier turn of their conversation failed or was truncated."""
    input_tokens: int
    """The trace's new input tokens of completed requests."""
    prefill_tokens: int
    """Tokens the engine prefilled for completed requests: input_tokens plus recomputation (a
    preempted or evicted context prefilled again) and each continuation's last sampled token."""
    output_tokens: int
    """Generated tokens of completed requests."""
    makespan_s: float
    """Replay start to the last finish."""
    p50_request_s: float
    p99_request_s: float
    """Request completion (finish - arrival) percentiles."""
    p99_trajectory_s: float
    """Trajectory completion (last finish - first arrival) p99, over unfailed conversations."""
    mean_ttft_s: float
    p99_ttft_s: float
    mean_queue_s: float
    """Mean admitted - arrival: how long a request waited for the scheduler to admit its prefill
    (under `off` and `mux` for the epoch in flight to end). NaN where admission was not recorded."""
    mean_prefill_s: float
    """Mean first_token - admitted: the rest of TTFT, its prefill (stretched under `mux` by the
    decode iterations between its segments)."""
    mean_decode_wait_ms: float
    """As the engine measured it (time a ready decode row waited for its iteration)."""
    tokens_per_s: float
    """output_tokens / makespan_s."""
    breakdown: dict[str, Any] | None = None
    """Where the makespan went (`trace.breakdown.Breakdown.to_dict`), where the engine keeps step
    records; None otherwise."""

    def to_dict(self) -> dict[str, Any]:
        """Plain values; NaN becomes None so the result is strict JSON."""
        return {k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in dataclasses.asdict(self).items()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), allow_nan=False)

    def summary(self) -> str:
        """A few human-readable lines for logs and the CLI."""
        return (f"schedule={self.schedule or '-'} requests={self.requests} truncated={self.truncated} "
                f"failed={self.failed} skipped={self.skipped} input_tokens={self.input_tokens} "
                f"prefill_tokens={self.prefill_tokens} output_tokens={self.output_tokens}\n"
                f"makespan {self.makespan_s:.3f} s, {self.tokens_per_s:.1f} tok/s; request p50 "
                f"{self.p50_request_s:.3f} s p99 {self.p99_request_s:.3f} s; trajectory p99 "
                f"{self.p99_trajectory_s:.3f} s; TTFT mean {self.mean_ttft_s:.3f} s p99 "
                f"{self.p99_ttft_s:.3f} s (queue {self.mean_queue_s:.3f} s, prefill {self.mean_prefill_s:.3f} s); "
                f"decode wait {self.mean_decode_wait_ms:.2f} ms")


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q, method="linear")) if len(values) else math.nan


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else math.nan


def build_report(outputs: Sequence[RequestOutput], conversation_of: Mapping[int, ConversationId], *,
                 start: float, mean_decode_wait_ms: float, schedule: Schedule | str | None = None,
                 skipped: int = 0, refused: Sequence[ConversationId] = (),
                 turn_of: Mapping[int, TraceRequest] | None = None) -> ReplayReport:
    """Compute a `ReplayReport`.

    Args:
        outputs: every finished request of the replay (completed and failed).
        conversation_of: request_id -> conversation id, for every request in `outputs`.
        start: the replay's start (time.perf_counter, the clock of `RequestTimes`).
        mean_decode_wait_ms: the engine's `stats.mean_decode_wait_ms`.
        schedule: the engine's schedule, for the record.
        skipped: turns not submitted because their conversation had failed.
        refused: the conversation of each request the engine refused at submission (it has no
            output; each counts as failed and cuts its conversation).
        turn_of: request_id -> the trace line it served, for every request in `outputs`: what it
            asked for. Without it (a caller that has not passed it yet) truncation goes
            undetected and input_tokens falls back to prefilled tokens; a warning says so.
    """
    missing = [o.request_id for o in outputs if o.request_id not in conversation_of]
    if missing:
        raise ValueError(f"no conversation id for request(s) {missing[:10]}")
    if skipped < 0:
        raise ValueError(f"skipped must be >= 0, got {skipped}")
    if turn_of is None:
        logger.warning("build_report without turn_of: truncated turns are not detected and input_tokens "
                       "counts prefilled tokens (recomputation included)")
    elif missing := [o.request_id for o in outputs if o.request_id not in turn_of]:
        raise ValueError(f"no trace line for request(s) {missing[:10]}")
    ended = [o for o in outputs if o.result.finish_reason is not FinishReason.ERROR]
    short = {o.request_id for o in ended
             if turn_of is not None and len(o.result.token_ids) < turn_of[o.request_id].output_tokens}
    done = [o for o in ended if o.request_id not in short]
    failed = len(outputs) - len(ended) + len(refused)

    failed_conversations = {conversation_of[o.request_id] for o in outputs
                            if o.result.finish_reason is FinishReason.ERROR or o.request_id in short} | set(refused)
    spans: dict[ConversationId, tuple[float, float]] = {}
    for o in done:
        key = conversation_of[o.request_id]
        if key in failed_conversations:
            continue
        first, last = spans.get(key, (o.times.arrival, o.times.finish))
        spans[key] = (min(first, o.times.arrival), max(last, o.times.finish))

    makespan = max((o.times.finish for o in outputs), default=start) - start
    output_tokens = sum(len(o.result.token_ids) for o in done)
    ttfts = [o.times.first_token - o.times.arrival for o in done if o.times.first_token is not None]
    admitted = [o.times for o in done if o.times.first_token is not None and o.times.admitted is not None]
    completions = [o.times.finish - o.times.arrival for o in done]
    sched = schedule.value if isinstance(schedule, Schedule) else (schedule or "")
    return ReplayReport(
        schedule=sched,
        requests=len(done),
        truncated=len(short),
        failed=failed,
        skipped=skipped,
        input_tokens=sum(o.prompt_tokens if turn_of is None else turn_of[o.request_id].input_tokens for o in done),
        prefill_tokens=sum(o.prompt_tokens for o in done),
        output_tokens=output_tokens,
        makespan_s=makespan,
        p50_request_s=_percentile(completions, 50),
        p99_request_s=_percentile(completions, 99),
        p99_trajectory_s=_percentile([last - first for first, last in spans.values()], 99),
        mean_ttft_s=_mean(ttfts),
        p99_ttft_s=_percentile(ttfts, 99),
        mean_queue_s=_mean([t.admitted - t.arrival for t in admitted]),
        mean_prefill_s=_mean([t.first_token - t.admitted for t in admitted]),
        mean_decode_wait_ms=float(mean_decode_wait_ms),
        tokens_per_s=output_tokens / makespan if makespan > 0 else math.nan,
    )
