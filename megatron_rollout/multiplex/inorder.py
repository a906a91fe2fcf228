"""The ordering model of docs/design.md §8: an *in-order device* per rank, on CPU.

A GPU stream (or several streams starved of SMs) executes what the host enqueued strictly in
enqueue order, and a collective blocks its stream until every member rank reaches it. That is the
whole hazard: two ranks that enqueue intersecting P and D collectives in opposite orders wait for
each other forever. `InOrderDevice` reproduces it with one worker thread per rank that runs
enqueued operations (compute "kernels" and gloo collectives, synchronously) one after another;
`InOrderComm` is the comm facade over it: each collective is enqueued, not run, and the caller
gets a `DeviceValue` future back, exactly like launching a kernel. The host never waits unless it
asks for a value.

`InOrderDevice.watch` is the watchdog: it reports a `Stall` when the operation at the head of the
queue has not finished within a deadline (a deadlock, if every rank reports one). After the
first failed operation the device is *poisoned*, like a CUDA context after a fault: later
operations fail without running, so a timed-out collective cannot pair with a later one.

**Why naive multiplexing deadlocks at ATP2/ADP2 and completes at ATP4/ADP1 and ATP1/ADP4.** The
naive baseline (`MuxConfig.ordering="naive"`, engine.schedules.mux) enqueues P's and D's
collectives with two properties: (i) ranks of one ADP replica (an ATP group) are mirrors and make
the same choices; (ii) collectives over one rank set are enqueued in one order by all its members.
Replicas otherwise choose independently (odd ones P first, even ones D first). A single-stream
cycle needs two ranks r, s and two collectives, P's `x` and D's `y`, both containing r and s,
with r enqueueing y before x and s x before y. By (i), r and s sit in different replicas; by (ii),
x and y run over different rank sets. So the pair must be *crossed*: different groups sharing
ranks of two replicas (`routing.derive_conflicts` registers exactly those pairs).
- ATP4/ADP1: one replica; every rank enqueues the same sequence (i). No cycle: completes.
- ATP1/ADP4: every multi-rank collective of either phase (ADP all-gathers, FULL all-reduce, EP
  exchanges) runs over the one rank set {0..3}, so (ii) orders them alike everywhere; replicas
  differ only in where P lands among D's *compute*. No cycle: completes.
- ATP2/ADP2 (ATP {0,1},{2,3}; ADP {0,2},{1,3}): with the all-gather exchange, P's FULL all-reduce
  over {0,1,2,3} and D's ADP all-gather over {0,2} share ranks 0 and 2 of replicas 0 and 1. Replica
  0 (D first) enqueues D's ADP all-gather before P's FULL all-reduce; replica 1 (P first) the
  reverse. Rank 0 waits in D's ADP all-gather for rank 2, rank 2 in P's FULL all-reduce for rank 0
  (ranks 1 and 3 likewise): DEADLOCK, at that pair. Only one crossing axis (one non-trivial axis)
  leaves nothing crossed, which is why the two other layouts complete.

Deliberately left out: multiple streams, SM capacity, real kernels. The model is the single-
stream limit, which is the case the turnstile must make safe.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_rollout.comm.facade import CollectiveSite
from megatron_rollout.multiplex.routing import Route, Router, derive_for_exchanges
from megatron_rollout.types import Axis, Phase

logger = logging.getLogger(__name__)


class DeviceError(RuntimeError):
    """An operation on the in-order device failed or was skipped after an earlier failure."""


class DeviceValue:
    """The future output of one device operation."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError(f"device value {self.label!r} not ready after {timeout}s")
        if self._error is not None:
            raise DeviceError(f"{self.label}: {self._error}") from self._error
        return self._value


@dataclass(frozen=True)
class Stall:
    """The head of a rank's device queue did not finish in time."""

    rank: int
    op: str  # label of the operation running
    running_s: float
    queued: int  # operations waiting behind it
    executed: int  # operations that completed before it


class InOrderDevice:
    """One worker thread executing submitted operations strictly in submission order."""

    def __init__(self, rank: int, name: str = "device") -> None:
        self.rank, self.name = rank, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending = 0
        self._current: tuple[str, float] | None = None
        self.log: list[str] = []  # labels of operations that completed, in execution order
        self.first_error: str | None = None
        self._worker = threading.Thread(target=self._loop, name=f"{name}-rank{rank}", daemon=True)
        self._worker.start()

    def submit(self, label: str, fn: Callable[..., Any], *inputs: DeviceValue) -> DeviceValue:
        """Enqueue `fn(*input values)`; returns at once."""
        out = DeviceValue(label)
        with self._cond:
            self._pending += 1
        self._queue.put((label, fn, inputs, out))
        return out

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            label, fn, inputs, out = item
            with self._cond:
                self._current = (label, time.monotonic())
            try:
                if self.first_error is not None:
                    raise DeviceError(f"not run: device poisoned by {self.first_error}")
                # In-order execution: every input was produced by an earlier operation.
                out._value = fn(*(v.result(0) for v in inputs))
                self.log.append(label)
            except BaseException as exc:  # noqa: BLE001 - stored in the future, like a CUDA error
                out._error = exc
                if self.first_error is None:
                    self.first_error = f"{label}: {type(exc).__name__}: {exc}"
                    logger.warning("rank %d device op %s failed: %s", self.rank, label, exc)
            with self._cond:
                self._current = None
                self._pending -= 1
                out._done.set()
                self._cond.notify_all()

    def watch(self, stall_after_s: float, deadline_s: float | None = None) -> Stall | None:
        """Wait until the queue drains (None) or its head has run for `stall_after_s` (a Stall).
        `deadline_s` bounds the total wait (a Stall of the head at that point)."""
        start = time.monotonic()
        with self._cond:
            while self._pending:
                now = time.monotonic()
                if self._current is not None and now - self._current[1] >= stall_after_s:
                    return Stall(self.rank, self._current[0], now - self._current[1], self._pending - 1, len(self.log))
                if deadline_s is not None and now - start >= deadline_s:
                    head = self._current[0] if self._current else "<idle worker>"
                    run = now - self._current[1] if self._current else 0.0
                    return Stall(self.rank, head, run, self._pending - 1, len(self.log))
                self._cond.wait(0.05)
        return None

    def close(self, timeout: float = 5.0) -> bool:
        """Stop the worker once the queue drains; True if it stopped within `timeout`."""
        self._queue.put(None)
        self._worker.join(timeout)
        return not self._worker.is_alive()


class InOrderComm:
    """Comm-facade-shaped collectives that enqueue on an `InOrderDevice` and return futures.

    Mirrors `Comm.all_reduce` / `all_gather` (same axis and phase arguments) but takes and returns
    `DeviceValue`s, so it is not a `Comm` subclass. `groups[(axis, phase)]` is this rank's
    communicator; map both phases to one group to model shared communicators. Every collective goes
    through `router.run(route, enqueue)`; `route_hook(route, enqueue)`, when given, takes over
    routed collectives (the ordering test uses it to model routing without a turnstile)."""

    def __init__(self, device: InOrderDevice, groups: Mapping[tuple[Axis, Phase], Any], router: Router,
                 route_hook: Callable[[Route, Callable[[], DeviceValue]], DeviceValue] | None = None) -> None:
        self.device, self.groups, self.router, self.route_hook = device, dict(groups), router, route_hook
        self._issued = {Phase.P: 0, Phase.D: 0}  # per phase: each phase is driven by one host thread

    def compute(self, label: str, fn: Callable[..., torch.Tensor], *inputs: DeviceValue) -> DeviceValue:
        return self.device.submit(label, fn, *inputs)

    def constant(self, label: str, value: torch.Tensor) -> DeviceValue:
        return self.device.submit(label, lambda: value.clone())

    def all_reduce(self, x: DeviceValue, axis: Axis, phase: Phase) -> DeviceValue:
        group = self._group(axis, phase)

        def op(t: torch.Tensor) -> torch.Tensor:
            t = t.clone()
            dist.all_reduce(t, group=group)
            return t

        return self._issue(CollectiveSite("all_reduce", axis), phase, op, x)

    def all_gather(self, x: DeviceValue, axis: Axis, phase: Phase) -> DeviceValue:
        """Rows of every rank of the axis, concatenated in rank order (equal shapes only)."""
        group = self._group(axis, phase)

        def op(t: torch.Tensor) -> torch.Tensor:
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, t.contiguous(), group=group)
            return torch.cat(parts)

        return self._issue(CollectiveSite("all_gather", axis), phase, op, x)

    def _group(self, axis: Axis, phase: Phase) -> Any:
        try:
            return self.groups[(axis, phase)]
        except KeyError:
            raise KeyError(f"no communicator for ({axis}, {phase}); have {sorted(map(str, self.groups))}") from None

    def _issue(self, site: CollectiveSite, phase: Phase, op: Callable, x: DeviceValue) -> DeviceValue:
        route = self.router.route(phase, site)
        self._issued[phase] += 1
        label = f"{route.label} #{self._issued[phase]}"

        def enqueue() -> DeviceValue:
            return self.device.submit(label, op, x)

        if route.routed and self.route_hook is not None:
            return self.route_hook(route, enqueue)
        return self.router.run(route, enqueue)


class DeviceStall(TimeoutError):
    """A collective on a rank's in-order device did not complete in time (a distributed cycle)."""


class InOrderDistComm:
    """Mixin for `comm.dist.DistComm`: every collective the model issues runs on this rank's
    `InOrderDevice`, in the order host threads enqueue it, and the caller waits for its value.

    This is the engine-level ordering model: P's and D's host drivers share one in-order queue per
    rank, as they would share a stream. `hazard(phase, op, axis)`, when given, runs on the host
    thread before each enqueue (a test uses it to make replicas reach their collectives in
    opposite orders, as timing would on a real deployment). A value not ready within `stall_s`
    raises `DeviceStall` naming the rank and the operations the device was stuck on."""

    def attach_device(self, rank: int, stall_s: float,
                      hazard: Callable[[Phase, str, Axis], None] | None = None) -> None:
        self.inorder = InOrderDevice(rank)
        self.stall_s, self.hazard = stall_s, hazard
        self._count = 0

    def _on_device(self, phase: Phase, op: str, axis: Axis, fn: Callable[[], Any]) -> Any:
        if self.hazard is not None:
            self.hazard(phase, op, axis)
        self._count += 1
        label = f"{phase.value}:{op}/{axis.value} #{self._count}"
        value = self.inorder.submit(label, fn)
        try:
            return value.result(self.stall_s)
        except TimeoutError:
            stall = self.inorder.watch(0.0, 0.0)
            head = stall.op if stall else "?"
            err = DeviceStall(f"rank {self.inorder.rank}: {label} not done after {self.stall_s}s; the device is "
                              f"stuck in {head} with {stall.queued if stall else '?'} queued behind it")
            err.head = head  # the collective the device is stuck in (`stuck_pair` names the cycle from these)
            raise err from None

    def all_reduce(self, x, axis, phase):
        return self._on_device(phase, "all_reduce", axis,
                               lambda: super(InOrderDistComm, self).all_reduce(x, axis, phase))

    def all_gather(self, x, axis, phase):
        return self._on_device(phase, "all_gather", axis,
                               lambda: super(InOrderDistComm, self).all_gather(x, axis, phase))

    def all_to_all(self, chunks, axis, phase):
        return self._on_device(phase, "all_to_all", axis,
                               lambda: super(InOrderDistComm, self).all_to_all(chunks, axis, phase))


def stuck_pair(heads: Mapping[int, str]) -> str:
    """Name a cycle from the collective each stalled rank's device is stuck in, by rank (labels as
    `InOrderDistComm` writes them, "P:all_reduce/FULL #7"): "P's all_reduce over FULL (ranks [2, 3])
    against D's all_gather over ADP (ranks [0, 1])"."""
    by_op: dict[str, list[int]] = {}
    for rank, label in sorted(heads.items()):
        phase, _, rest = label.partition(":")
        op, _, axis = rest.split(" ")[0].split("@")[0].partition("/")
        by_op.setdefault(f"{phase}'s {op} over {axis}", []).append(rank)
    if len(by_op) < 2:
        return f"no cycle between phases: every stalled rank is in {sorted(by_op)}"
    ordered = sorted(by_op.items(), key=lambda kv: kv[0][0] != "P")  # P's side first
    return " against ".join(f"{what} (ranks {ranks})" for what, ranks in ordered)


def in_order_dist_comm(layout, config, stall_s: float, hazard=None, router: Router | None = None):
    """A `DistComm` (built collectively, like one) whose collectives run on an in-order device; its
    router (default: the conflicts derived from the layout and the configured exchanges, no
    streams) serves turnstile engines."""
    from megatron_rollout.comm.dist import DistComm

    router = router or Router(derive_for_exchanges(layout.atp, layout.adp, config.p_exchange, config.d_exchange))
    comm = type("InOrderDistComm", (InOrderDistComm, DistComm), {})(layout, config, torch.device("cpu"), router)
    comm.attach_device(dist.get_rank(), stall_s, hazard)
    return comm
