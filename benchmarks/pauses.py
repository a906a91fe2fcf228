"""Python's garbage collections during a timed region: how many of each generation ran, how long
they held the host (`gc.callbacks`), and how many of them fell inside a window of it (a replay's
makespan: a collection after the last request finished costs the rollout nothing). The engine's host
loop waits for them between forwards, and a drafting step, which is not issued ahead of the host,
waits with the device idle.

    with GcPauses() as pauses:
        ...
    pauses.to_dict()  # {"collections": [gen0, gen1, gen2], "total_s": ..., "longest_s": ...}
    pauses.to_dict(window=(start, end))  # and "in_window": the same three of those begun in it

Left out: the objects a collection found (`gc.get_stats` has them per generation).
"""
from __future__ import annotations

import gc
import time
from typing import Any


class GcPauses:
    """Counts and times the collections between `__enter__` and `__exit__`."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, float, int]] = []
        """Each collection's (start on the perf_counter clock, seconds, generation)."""
        self._began: float | None = None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.marks.append((self._began, time.perf_counter() - self._began, info["generation"]))
            self._began = None

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)

    def to_dict(self, window: tuple[float, float] | None = None) -> dict[str, Any]:
        out = _summary(self.marks)
        if window is not None:
            out["in_window"] = _summary([m for m in self.marks if window[0] <= m[0] <= window[1]])
        return out


def _summary(marks: list[tuple[float, float, int]]) -> dict[str, Any]:
    counts = [0, 0, 0]
    for _, _, generation in marks:
        counts[generation] += 1
    return {"collections": counts, "total_s": sum(s for _, s, _ in marks),
            "longest_s": max((s for _, s, _ in marks), default=0.0)}
