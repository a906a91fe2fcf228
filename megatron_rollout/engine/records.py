"""What each engine step did and how long it took: the records a makespan breakdown and the
simulator's cost model are computed from (`trace.breakdown`, `sim.cost`).

One `StepRecord` per forward the engine runs: an `off`/`chunked` step, a `mux` decode iteration,
or one segment of a `mux` prefill epoch. Its sizes are Python numbers the step already has (its
rows' spans); its times are two host clock reads around the step (`time.perf_counter`), taken
where the engine already reads its samples back, so recording adds no device synchronisation.
On a device that runs ahead of the host, a step's end is when its tokens reached the host; a
`mux` prefill segment is only enqueued there, so its device time shows up in the decode iteration
that waits for it, and a fit from such records (`sim.cost`) should come from `off`/`chunked`.

Left out: per-request marks (`RequestTimes` has arrival, admission, first token and finish) and
tool waits (the replay knows when it released each turn).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from megatron_rollout.types import SpanInput


@dataclass(frozen=True)
class StepRecord:
    """One forward of the engine: its rows, sizes and host-clock span."""

    phase: str
    """'P' or 'D': the phase the forward ran in (a `chunked` step with prefill rows runs in P)."""
    decode_rows: int
    """One-token rows continuing a generation."""
    decode_context: int
    """Sum over the decode rows of their context (positions attended, the new one included)."""
    prefill_rows: int
    """Prefill chunks in the forward (a `mux` segment: the epoch's, on its first segment only)."""
    prefill_tokens: int
    """New positions the prefill chunks compute."""
    prefill_pairs: int
    """(query, key) pairs of the chunks' causal attention: sum of new * past + new * (new + 1) / 2."""
    start: float
    end: float
    """time.perf_counter marks around the forward and the read-back of its samples."""
    epoch: int | None = None
    """The `mux` epoch a prefill segment belongs to; None for a whole step."""
    decode_positions: int | None = None
    """New positions of the decode rows: a row's pending token and its drafts when drafting, else
    one a row. None in results recorded before this field: as many as `decode_rows`."""

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def positions(self) -> int:
        """`decode_positions`, or `decode_rows` where a record predates it."""
        return self.decode_rows if self.decode_positions is None else self.decode_positions

    @property
    def mixed(self) -> bool:
        """Decode rows and prefill work shared this forward (a `chunked` step)."""
        return self.decode_rows > 0 and self.prefill_tokens > 0


def step_record(phase: str, rows: Sequence[SpanInput], decode_rows: int, start: float, end: float,
                epoch: int | None = None) -> StepRecord:
    """The record of a forward over `rows`, the first `decode_rows` of which are decode rows."""
    decode, prefill = rows[:decode_rows], rows[decode_rows:]
    return StepRecord(
        phase=phase, decode_rows=decode_rows,
        decode_context=sum(r.span.past + r.span.new for r in decode),
        prefill_rows=len(prefill), prefill_tokens=sum(r.span.new for r in prefill),
        prefill_pairs=sum(r.span.new * r.span.past + r.span.new * (r.span.new + 1) // 2 for r in prefill),
        start=start, end=end, epoch=epoch, decode_positions=sum(r.span.new for r in decode))


class StepLog:
    """The engine's step records, in the order the forwards ran, taken only while `enabled` (a replay
    turns it on for its duration): an RL job's rollouts pay nothing for them, per step or in memory.
    Beside them, `step_starts`: when each engine step began (its planning comes before its first
    forward's record), so that a gap between two records splits into the caller's time between
    steps and the step's own before its forward."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.step_starts: list[float] = []
        self.enabled = False

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the forwards run inside the block (nested blocks keep recording until the outer ends)."""
        before, self.enabled = self.enabled, True
        try:
            yield
        finally:
            self.enabled = before

    def add(self, record: StepRecord) -> None:
        self.records.append(record)

    def step_began(self) -> None:
        if self.enabled:
            self.step_starts.append(time.perf_counter())

    def since(self, start: float) -> list[StepRecord]:
        """Records of forwards that began at or after `start` (one replay's, on a reused engine)."""
        return [r for r in self.records if r.start >= start]

    def clear(self) -> None:
        self.records.clear()
        self.step_starts.clear()

    def __len__(self) -> int:
        return len(self.records)


def wall_minus_perf(samples: int = 5, perf: Callable[[], float] = time.perf_counter,
                    wall: Callable[[], float] = time.time) -> float:
    """time.time() - time.perf_counter(), to put wall-clock stamps (the turnstile's) on the records'
    clock. Each sample reads the wall clock between two perf_counter reads and the tightest pair
    wins: a read pre-empted between the two clocks (a loaded host) would shift every converted
    stamp by the pause, so that a `mux` segment's record overlapped the decode iteration before it."""
    best = (float("inf"), 0.0)
    for _ in range(samples):
        before, at, after = perf(), wall(), perf()
        best = min(best, (after - before, at - (before + after) / 2))
    return best[1]
