"""Python's garbage collections during a timed region: how many of each generation ran and how long
they held the host (`gc.callbacks`). The engine's host loop waits for them between forwards, and a
drafting step, which is not issued ahead of the host, waits with the device idle.

    with GcPauses() as pauses:
        ...
    pauses.to_dict()  # {"collections": [gen0, gen1, gen2], "total_s": ..., "longest_s": ...}

Left out: the objects a collection found (`gc.get_stats` has them per generation).
"""
from __future__ import annotations

import gc
import time
from typing import Any


class GcPauses:
    """Counts and times the collections between `__enter__` and `__exit__`."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.total_s = 0.0
        self.longest_s = 0.0
        self._began: float | None = None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            took, self._began = time.perf_counter() - self._began, None
            self.collections[info["generation"]] += 1
            self.total_s += took
            self.longest_s = max(self.longest_s, took)

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)

    def to_dict(self) -> dict[str, Any]:
        return {"collections": list(self.collections), "total_s": self.total_s, "longest_s": self.longest_s}
