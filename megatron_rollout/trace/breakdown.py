"""Where a replay's makespan went: the critical conversation's path and the engine's time, from its
own records (issue 33: the makespan is the tail, so show what the tail waited for).

Inputs are what a replay already has: the engine's `StepRecord`s (one per forward: phase, decode
rows, prefill tokens, context, host-clock start and end), each finished request's `RequestTimes`
(arrival, admitted, first token, finish) and which conversation each request served. Definitions:

- A forward is *prefill* (prefill work, no decode rows: an `off` prefill batch, a `mux` segment),
  *decode* (decode rows only) or *mixed* (both: a `chunked` step). The engine is *idle* (the
  host's scheduling, sampling, waiting for tool answers) whenever no forward runs.
- A conversation's path from the replay start to its last finish is cut into tool waits (before
  each turn's arrival: the trace's wait and the replay's release latency, told apart where the
  trace lines are given), queueing (arrival ->
  admitted), prefill (admitted -> first token) and decode (first token -> finish). Each engine
  part of the path is split further by what the engine ran meanwhile (prefill / decode / mixed
  forwards, idle), so "decode 3 s, of which 2 s inside mixed steps" says the prefill mixed into
  its decode steps stretched them.
- The *critical* conversation is the one that finished last: its path is the makespan.
- Decode step stretch: the mean duration of the forwards a decode row ran in (weighted by rows)
  over that of pure decode forwards; 1.0 when nothing ever shared a decode step. It is reported
  beside the engine's mean decode wait (time a ready row waited for its forward), which does not
  show a step made long by the prefill inside it.
- Busy over time: the makespan cut into `bins` equal intervals, each with the fraction of it
  spent in prefill, decode and mixed forwards.

Times are host marks: on a device that runs ahead of the host a forward "runs" from its issue to
its samples' read-back. Left out: per-rank views (one engine's records), FLOP or byte rooflines
(`benchmarks.bounds`), and anything about requests that never ran (refused, skipped).
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_rollout.engine.api import RequestOutput
from megatron_rollout.engine.records import StepRecord
from megatron_rollout.trace.schema import ConversationId, TraceRequest

KINDS = ("prefill", "decode", "mixed")


def kind(record: StepRecord) -> str:
    """'prefill', 'decode' or 'mixed' (module docstring)."""
    if record.mixed:
        return "mixed"
    return "decode" if record.decode_rows else "prefill"


@dataclass(frozen=True)
class Occupancy:
    """How an interval of wall time was spent by the engine."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    mixed_s: float = 0.0
    idle_s: float = 0.0
    """No forward running."""

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s + self.mixed_s + self.idle_s

    def __add__(self, other: Occupancy) -> Occupancy:
        return Occupancy(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


@dataclass(frozen=True)
class PathBreakdown:
    """One conversation's path, or the sum over all requests of a replay."""

    conversation: ConversationId | None
    """The conversation (None for a sum over all of them)."""
    requests: int
    end_s: float
    """Its last finish, from the replay start."""
    tool_wait_s: float
    """Before each turn's arrival: the trace's tool wait, and the replay's release latency (a turn
    released while a forward runs is submitted when it ends) unless `turn_of` was given."""
    release_s: float
    """Of `tool_wait_s`, what was not the trace's wait (0 without `turn_of`)."""
    queue: Occupancy
    prefill: Occupancy
    decode: Occupancy
    output_tokens: int

    @property
    def tpot_ms(self) -> float:
        """Decode time per generated token after the first."""
        steps = self.output_tokens - self.requests
        return 1e3 * self.decode.total_s / steps if steps > 0 else math.nan


@dataclass(frozen=True)
class Breakdown:
    """Where one replay's time went (module docstring)."""

    makespan_s: float
    engine: Occupancy
    """The whole replay, start to last finish."""
    forwards: dict[str, int]
    """Forwards of each kind."""
    mean_forward_ms: dict[str, float]
    """Mean duration of each kind of forward."""
    shared: dict[str, dict[str, float]]
    """What shared each kind of forward, on average: its decode rows, their context, its prefill
    tokens."""
    pure_decode_step_ms: float
    """Row-weighted mean duration of decode-only forwards."""
    decode_step_ms: float
    """Row-weighted mean duration of every forward that carried decode rows."""
    decode_step_stretch: float
    """decode_step_ms / pure_decode_step_ms."""
    mean_decode_wait_ms: float
    """The engine's figure, copied here to sit beside the stretch."""
    critical: PathBreakdown | None
    """The conversation that finished last."""
    all_requests: PathBreakdown
    """Sums over every finished request of the replay."""
    bin_s: float
    busy: tuple[dict[str, float], ...]
    """Per bin of `bin_s` seconds from the start: fraction spent in prefill, decode, mixed forwards."""

    def to_dict(self) -> dict[str, Any]:
        """Plain values (NaN becomes None, strict JSON); paths with their tpot_ms."""
        out = dataclasses.asdict(self)
        for name in ("critical", "all_requests"):
            path = getattr(self, name)
            if path is not None:
                out[name]["tpot_ms"] = path.tpot_ms
        return _json_safe(out)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


class _Occupier:
    """Answers "what ran during [a, b]" over records sorted by start. The engine's records do not
    overlap; where clocks make two seem to (a `mux` segment's stamps come from another clock,
    converted), the later one starts where the earlier ends, so no time is counted twice."""

    def __init__(self, records: Sequence[StepRecord]) -> None:
        self.records = sorted(records, key=lambda r: r.start)
        self.kinds = [kind(r) for r in self.records]
        self.spans: list[tuple[float, float, str]] = []
        end = -math.inf
        for r, what in zip(self.records, self.kinds):
            start = max(r.start, end)
            end = max(end, r.end)
            self.spans.append((start, max(start, r.end), what))
        self.starts = [s[0] for s in self.spans]

    def during(self, a: float, b: float) -> Occupancy:
        if b <= a:
            return Occupancy()
        spent = dict.fromkeys(KINDS, 0.0)
        i = max(0, bisect.bisect_right(self.starts, a) - 1)
        while i < len(self.spans) and self.spans[i][0] < b:
            start, stop, what = self.spans[i]
            spent[what] += max(0.0, min(b, stop) - max(a, start))
            i += 1
        busy = sum(spent.values())
        return Occupancy(spent["prefill"], spent["decode"], spent["mixed"], max(0.0, (b - a) - busy))


def _path(occupier: _Occupier, outputs: Sequence[RequestOutput], start: float,
          conversation: ConversationId | None, turn_of: Mapping[int, TraceRequest] | None) -> PathBreakdown:
    """The path of `outputs` (one conversation's, in turn order; or all requests, summed)."""
    queue = prefill = decode = Occupancy()
    tool_wait, release, previous = 0.0, 0.0, start
    for o in outputs:
        t = o.times
        if conversation is not None:
            gap = max(0.0, t.arrival - previous)
            tool_wait += gap
            if turn_of is not None:
                release += max(0.0, gap - turn_of[o.request_id].wait_ms / 1e3)
            previous = t.finish
        admitted = t.admitted if t.admitted is not None else t.arrival
        first = t.first_token if t.first_token is not None else t.finish
        queue += occupier.during(t.arrival, admitted)
        prefill += occupier.during(admitted, first)
        decode += occupier.during(first, t.finish)
    if conversation is None:  # summed over requests: tool waits are the gaps within conversations
        tool_wait = release = math.nan
    return PathBreakdown(conversation, len(outputs), max((o.times.finish for o in outputs), default=start) - start,
                         tool_wait, release, queue, prefill, decode, sum(len(o.result.token_ids) for o in outputs))


def _row_weighted_ms(records: Sequence[StepRecord]) -> float:
    rows = sum(r.decode_rows for r in records)
    return 1e3 * sum(r.duration * r.decode_rows for r in records) / rows if rows else math.nan


def build_breakdown(records: Sequence[StepRecord], outputs: Sequence[RequestOutput],
                    conversation_of: Mapping[int, ConversationId], *, start: float,
                    mean_decode_wait_ms: float = math.nan, bins: int = 50,
                    turn_of: Mapping[int, TraceRequest] | None = None) -> Breakdown:
    """The breakdown of one replay.

    Args:
        records: the engine's step records of this replay (`engine.step_log.since(start)`).
        outputs: every finished request of the replay.
        conversation_of: request id -> conversation, for every output.
        start: the replay's start (time.perf_counter, the records' clock).
        mean_decode_wait_ms: the engine's `stats.mean_decode_wait_ms`.
        bins: intervals of the busy-over-time series.
        turn_of: request id -> its trace line, to split tool waits from release latency.
    """
    if isinstance(bins, bool) or not isinstance(bins, int) or bins <= 0:
        raise ValueError(f"bins must be a positive int, got {bins!r}")
    missing = [o.request_id for o in outputs if o.request_id not in conversation_of]
    if missing:
        raise ValueError(f"no conversation id for request(s) {missing[:10]}")
    end = max((o.times.finish for o in outputs), default=start)
    makespan = end - start
    occupier = _Occupier([r for r in records if r.end > start])
    by_kind = {k: [r for r, rk in zip(occupier.records, occupier.kinds) if rk == k] for k in KINDS}

    by_conversation: dict[ConversationId, list[RequestOutput]] = {}
    for o in sorted(outputs, key=lambda o: o.times.arrival):
        by_conversation.setdefault(conversation_of[o.request_id], []).append(o)
    critical = max(by_conversation.items(), key=lambda kv: kv[1][-1].times.finish, default=None)

    pure = _row_weighted_ms(by_kind["decode"])
    carrying = _row_weighted_ms([r for r in occupier.records if r.decode_rows])
    bin_s = makespan / bins if makespan > 0 else 0.0
    busy = []
    for i in range(bins if bin_s > 0 else 0):
        occ = occupier.during(start + i * bin_s, start + (i + 1) * bin_s)
        busy.append({"prefill": occ.prefill_s / bin_s, "decode": occ.decode_s / bin_s, "mixed": occ.mixed_s / bin_s})
    return Breakdown(
        makespan_s=makespan,
        engine=occupier.during(start, end),
        forwards={k: len(v) for k, v in by_kind.items()},
        mean_forward_ms={k: 1e3 * sum(r.duration for r in v) / len(v) if v else math.nan for k, v in by_kind.items()},
        shared={k: {f: sum(getattr(r, f) for r in v) / len(v) if v else math.nan
                    for f in ("decode_rows", "decode_context", "prefill_tokens")} for k, v in by_kind.items()},
        pure_decode_step_ms=pure,
        decode_step_ms=carrying,
        decode_step_stretch=carrying / pure if pure > 0 else math.nan,
        mean_decode_wait_ms=float(mean_decode_wait_ms),
        critical=_path(occupier, critical[1], start, critical[0], turn_of) if critical else None,
        all_requests=_path(occupier, outputs, start, None, None),
        bin_s=bin_s,
        busy=tuple(busy),
    )


def plot_breakdown(breakdown: Breakdown | Mapping[str, Any], path: str) -> None:
    """Write a two-panel figure to `path`: the engine's busy fractions over time (stacked), and
    the critical conversation's path by component. `breakdown` may be the JSON form (a report's
    "breakdown"). Needs matplotlib (imported here only)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plot_breakdown needs matplotlib: pip install matplotlib") from exc
    b = breakdown.to_dict() if isinstance(breakdown, Breakdown) else breakdown
    colors = {"prefill": "tab:orange", "decode": "tab:blue", "mixed": "tab:purple", "idle": "lightgray",
              "tool wait": "tab:green"}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), gridspec_kw={"height_ratios": [2, 1]})
    times = [(i + 0.5) * b["bin_s"] for i in range(len(b["busy"]))]
    top.stackplot(times, *([bin_[k] for bin_ in b["busy"]] for k in KINDS), labels=KINDS,
                  colors=[colors[k] for k in KINDS])
    stretch, wait = b["decode_step_stretch"], b["mean_decode_wait_ms"]
    top.set(xlim=(0, b["makespan_s"]), ylim=(0, 1), xlabel="time since replay start (s)", ylabel="fraction busy",
            title=f"engine busy over time; decode step stretch {_fmt(stretch, '.2f')}x, "
                  f"decode wait {_fmt(wait, '.1f')} ms")
    top.legend(loc="upper right")
    c = b["critical"]
    if c is not None:
        left = 0.0
        parts = [("tool wait", "tool wait", c["tool_wait_s"] - c["release_s"]), ("release", "idle", c["release_s"])]
        for stage in ("queue", "prefill", "decode"):
            parts += [(f"{stage}: {k}", k, c[stage][f"{k}_s"]) for k in (*KINDS, "idle")]
        for label, color, width in parts:
            if width > 0:
                bottom.barh(0, width, left=left, color=colors[color], edgecolor="black", linewidth=0.3)
                if width > 0.04 * c["end_s"]:
                    bottom.text(left + width / 2, 0, label, ha="center", va="center", fontsize=7, rotation=90)
                left += width
        bottom.set(xlim=(0, b["makespan_s"]), yticks=[], xlabel="seconds",
                   title=f"critical conversation {c['conversation']!r}: {c['requests']} turns, "
                         f"ends at {c['end_s']:.2f} s")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)
