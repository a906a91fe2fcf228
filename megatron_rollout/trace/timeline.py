"""A timeline of P segments and D iterations per rank, exported as a Chrome/Perfetto trace.

The engine records one span per P segment and per D iteration (`Timeline.record`); rank 0
gathers every rank's `Timeline` (they pickle) and `merge`s them; `write_chrome_trace` writes the
JSON that chrome://tracing and ui.perfetto.dev open. Each rank is a process row ("rank N") with
two thread rows, "P" above "D", so a D iteration squeezed between two P segments is visible.

Times are seconds on a clock the caller picks (time.perf_counter by default, which is shared by
the processes of one host). Ranks on different hosts do not share a clock: give each rank's
Timeline an `origin` taken right after a common barrier, and events are stored relative to it.
The written trace starts at the earliest event (ts = 0).

Left out: recording itself (the engine decides what a span is), flow arrows between ranks,
counters, and any gathering over torch.distributed (the caller moves the objects).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterable

from megatron_rollout.types import Phase

# Chrome's JSON format wants integer thread ids; the rows are named by metadata events.
_TID = {"P": 0, "D": 1}


@dataclass(frozen=True)
class TimelineEvent:
    """One span: a P segment or a D iteration on one rank."""

    rank: int
    phase: str
    """'P' or 'D'."""
    name: str
    start: float
    """Seconds since the recording timeline's origin."""
    end: float
    args: tuple[tuple[str, Any], ...] = ()
    """Extra key/values shown on the span (epoch, boundary, batch size, ...)."""


class Timeline:
    """Collects spans; appends are atomic under the GIL, so P and D threads may share one."""

    def __init__(self, origin: float = 0.0) -> None:
        """`origin`: subtracted from every recorded time (a per-rank time taken after a barrier
        aligns ranks that do not share a clock)."""
        self.origin = origin
        self._events: list[TimelineEvent] = []

    def record(self, rank: int, phase: str | Phase, name: str, start: float, end: float,
               **args: Any) -> None:
        """Add one span of `phase` ('P'/'D' or Phase) on `rank` from `start` to `end` (seconds)."""
        phase_name = phase.value if isinstance(phase, Phase) else phase
        if phase_name not in _TID:
            raise ValueError(f"phase must be 'P' or 'D', got {phase!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an integer >= 0, got {rank!r}")
        if end < start:
            raise ValueError(f"span {name!r} on rank {rank} ends ({end}) before it starts ({start})")
        self._events.append(TimelineEvent(rank, phase_name, name, start - self.origin,
                                          end - self.origin, tuple(args.items())))

    @property
    def events(self) -> tuple[TimelineEvent, ...]:
        return tuple(self._events)

    def __len__(self) -> int:
        return len(self._events)

    def to_chrome_trace(self) -> dict[str, Any]:
        """The trace as a dict: {"traceEvents": [...], "displayTimeUnit": "ms"}."""
        events = sorted(self._events, key=lambda e: (e.start, e.rank, e.phase))
        t0 = events[0].start if events else 0.0
        out: list[dict[str, Any]] = []
        for rank in sorted({e.rank for e in events}):
            out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                        "args": {"name": f"rank {rank}"}})
            out.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                        "args": {"sort_index": rank}})
            for phase, tid in _TID.items():
                out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                            "args": {"name": phase}})
                out.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid,
                            "args": {"sort_index": tid}})
        for e in events:
            out.append({"name": e.name, "cat": e.phase, "ph": "X", "pid": e.rank, "tid": _TID[e.phase],
                        "ts": (e.start - t0) * 1e6, "dur": (e.end - e.start) * 1e6,
                        "args": dict(e.args)})
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def write_chrome_trace(self, path: str | os.PathLike) -> None:
        """Write the Chrome/Perfetto JSON; span args that JSON cannot hold are written as str."""
        with open(os.fspath(path), "w", encoding="utf-8") as f:
            json.dump(self.to_chrome_trace(), f, default=str)


def merge(timelines: Iterable[Timeline]) -> Timeline:
    """One timeline holding every event of `timelines` (e.g. each rank's, gathered at rank 0).
    Events keep their times relative to their own timeline's origin."""
    merged = Timeline()
    for timeline in timelines:
        merged._events.extend(timeline._events)
    return merged
