"""Python's cyclic garbage collector kept off the host's critical path for the length of a rollout.

A full collection walks every tracked object in the process: in a trainer (or a benchmark holding
its trace and records) millions of them, a quarter of a second each time. The engine's host loop
waits for it between forwards, and a step that is not issued ahead of the host waits with the GPU
idle. So when an engine gets work the objects alive then move into the collector's permanent
generation (`gc.freeze`), and each later step of the rollout freezes what the steps before it kept
(its results and records): collections during the rollout walk only what the current step made. The
engine counts itself busy while requests run and, awake, while sessions are open: a conversation
waiting on its tool is mid-rollout, and a full walk then delays its next turn. When no engine of
the process is busy (the last request done with no session open, the last session closed, or the
engine asleep for the trainer's step) the objects are handed back (`gc.unfreeze`), and the next
collection sees everything again. Both calls are constant-time list splices.

The freeze belongs to the process: it is held while any engine that wants it is busy. The engines
own the permanent generation only if they find it empty: a process that froze objects itself
(vLLM's way, once after start-up) manages it, and the engines then leave it alone for good.
Left out: objects that die in a reference cycle while frozen (including cycles a step made and the
next step froze) are freed only after the hand-back, so an engine dropped with requests in flight
or sessions open keeps the heap of its time frozen.
"""
from __future__ import annotations

import gc
import threading


class _Process:
    """The engines' shared hold on the collector's permanent generation."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holders = 0
        self.declined = False
        """Objects were frozen by someone else: the engines leave the collector alone."""
        self.freezes = 0

    def hold(self) -> bool:
        """Whether the heap is frozen for this holder (False: the process manages its freeze)."""
        with self.lock:
            if self.holders == 0 and not self.declined:
                if gc.get_freeze_count():  # walks the permanent generation: empty unless someone else froze
                    self.declined = True
                else:
                    gc.freeze()
                    self.freezes += 1
            if self.declined:
                return False
            self.holders += 1
            return True

    def refresh(self) -> None:
        """Freeze what was made since the last freeze (the holders' step boundaries)."""
        with self.lock:
            if self.holders and not self.declined:
                gc.freeze()

    def release(self) -> None:
        with self.lock:
            self.holders -= 1
            if self.holders == 0:
                gc.unfreeze()


PROCESS = _Process()


class GcFreeze:
    """One engine's side: `busy(True)` while a rollout is under way, `busy(False)` when none is, and
    `step_done()` after each of its steps (what the step kept is frozen too); `on=False`
    (`EngineConfig.gc_freeze`) never touches the collector."""

    def __init__(self, on: bool = True) -> None:
        self.on = on
        self.held = False
        """This engine holds the process's freeze."""
        self.wanted = False
        self.freezes = 0
        """Times this engine's work began with the heap frozen for it."""

    def busy(self, busy: bool) -> None:
        if busy == self.wanted or not self.on:
            return
        self.wanted = busy
        if busy and PROCESS.hold():
            self.held, self.freezes = True, self.freezes + 1
        elif not busy and self.held:
            PROCESS.release()
            self.held = False

    def step_done(self) -> None:
        """A step of the rollout ended: freeze what was made since the last freeze."""
        if self.held:
            PROCESS.refresh()
