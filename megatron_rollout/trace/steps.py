"""Step records as JSON columns: one list per `StepRecord` field, so a benchmark result can keep
every forward of a replay (`engine.step_log`) at a few tens of bytes a step and a reader can fit a
cost model to them later (`sim.cost.fit`, `benchmarks.sim_replay`). The replay's own marks between
forwards (`trace.replay`'s "submissions" and "sleeps") go the same way (`marks_to_columns`).

The round trip is lossless: ints stay ints, times are the host-clock floats as measured (JSON
writes a float's shortest repr, which reads back to the same float), a whole step's `epoch` is null.
Left out: any rebasing or rounding of the times (a reader subtracts what it needs).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_rollout.engine.records import StepRecord

FIELDS = tuple(f.name for f in dataclasses.fields(StepRecord))
"""The columns, in `StepRecord`'s field order."""
LATER = ("decode_positions",)
"""Columns added after results were first written: a result without one reads None there."""


def to_columns(records: Sequence[StepRecord]) -> dict[str, list]:
    """{field: [value of each record]} in record order."""
    return {name: [getattr(r, name) for r in records] for name in FIELDS}


def from_columns(cols: Mapping[str, Sequence[Any]]) -> list[StepRecord]:
    """The records `to_columns` made `cols` from.

    Raises ValueError when a column is missing (other than one of `LATER`), unknown, or of another
    length than the others.
    """
    n = len(next(iter(cols.values()), ()))
    cols = {**{name: [None] * n for name in LATER if name not in cols}, **cols}
    if set(cols) != set(FIELDS):
        raise ValueError(f"step columns must be exactly {list(FIELDS)}; missing {sorted(set(FIELDS) - set(cols))}, "
                         f"unknown {sorted(set(cols) - set(FIELDS))}")
    lengths = {name: len(cols[name]) for name in FIELDS}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"step columns differ in length: {lengths}")
    return [StepRecord(*row) for row in zip(*(cols[name] for name in FIELDS))]


SUBMISSION_COLUMNS = ("start", "end", "tokens")
"""A turn's submission in `trace.replay`'s details: (start, end, input tokens)."""
SLEEP_COLUMNS = ("start", "end")
"""A span the replay slept with nothing to run."""


def marks_to_columns(marks: Sequence[Sequence[Any]], names: Sequence[str]) -> dict[str, list]:
    """{name: [that field of each mark]}, every column present even where there are no marks."""
    return {name: [m[i] for m in marks] for i, name in enumerate(names)}


def marks_from_columns(cols: Mapping[str, Sequence[Any]], names: Sequence[str]) -> list[tuple]:
    """The marks `marks_to_columns` made `cols` from; ValueError when the columns differ in length."""
    return list(zip(*(cols.get(name, ()) for name in names), strict=True))
