"""Turnstile rounds as Chrome/Perfetto trace events (DESIGN.md §9).

Each `RoundRecord` becomes four complete ("X") events on its rank's row: the pre-D rendezvous,
the D enqueue, the post-D rendezvous and the P segment enqueue, so a trace viewer shows where the
host driver spent its time and how ranks lined up. Times are host enqueue times: device
execution is not visible here (that needs a profiler trace next to this one).

Deliberately left out: writing files and merging ranks (the caller gathers records from all
ranks and dumps `{"traceEvents": events}` as JSON).
"""
from __future__ import annotations

from collections.abc import Iterable

from megatron_rollout.multiplex.turnstile import RoundRecord


def chrome_events(records: Iterable[RoundRecord]) -> list[dict]:
    """Trace events (microsecond timestamps) for the given rounds; pid = rank."""
    events: list[dict] = []
    for r in records:
        args = {"epoch": r.epoch, "round": r.round, "boundaries": f"{r.first_boundary}..{r.last_boundary}",
                "span": r.span, "decode_rows": r.decode_rows, "max_decode_rows": r.max_decode_rows,
                "p_finished": r.p_finished}
        phases = (("pre-D rendezvous", r.t_start, r.t_pre_d, "rendezvous"),
                  ("D iteration", r.t_pre_d, r.t_decode, "D"),
                  ("post-D rendezvous", r.t_decode, r.t_post_d, "rendezvous"),
                  (f"P segment {r.first_boundary}..{r.last_boundary}", r.t_post_d, r.t_end, "P"))
        for name, t0, t1, cat in phases:
            events.append({"name": name, "cat": cat, "ph": "X", "pid": r.rank, "tid": 0,
                           "ts": t0 * 1e6, "dur": max(t1 - t0, 0.0) * 1e6, "args": args})
    return events
