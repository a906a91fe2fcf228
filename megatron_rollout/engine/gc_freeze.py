"""Python's cyclic garbage collector kept off the host's critical path while the engine has work.

A full collection walks every tracked object in the process: in a trainer (or a benchmark holding
its trace and records) millions of them, a quarter of a second each time. The engine's host loop
waits for it between forwards, and a step that is not issued ahead of the host waits with the GPU
idle. So when the engine gets work it moves the objects alive then into the collector's permanent
generation (`gc.freeze`): collections during the rollout walk only what the rollout created. When
the engine has no request left it hands them back (`gc.unfreeze`), and the next collection sees
everything again. Both calls are constant-time list splices.

The engine owns the permanent generation only if it finds it empty: a process that froze objects
itself (vLLM's way, once after start-up) manages it, and the engine then leaves it alone for good.
Left out: a process that freezes objects while the engine holds the freeze has them handed back
with the engine's.
"""
from __future__ import annotations

import gc


class GcFreeze:
    """`busy(True)` when the engine has requests, `busy(False)` when it has none; `on=False`
    (`EngineConfig.gc_freeze`) never touches the collector."""

    def __init__(self, on: bool = True) -> None:
        self.on = on
        self.held = False
        """The engine's freeze is in place."""
        self.declined = False
        """Objects were frozen by someone else: the engine leaves the collector alone."""
        self.freezes = 0

    def busy(self, busy: bool) -> None:
        if busy == self.held or not self.on or self.declined:
            return
        if not busy:
            gc.unfreeze()
            self.held = False
        elif gc.get_freeze_count():  # walks the permanent generation: empty, unless someone else froze
            self.declined = True
        else:
            gc.freeze()
            self.held, self.freezes = True, self.freezes + 1
