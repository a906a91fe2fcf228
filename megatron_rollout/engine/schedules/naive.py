"""The naive ordering baseline of `mux` (`MuxConfig.ordering="naive"`): the unsafe schedule the
ordering experiments compare the turnstile against (docs/design.md §8). Never use it across ranks.

No rendezvous, no routing: P and D progress independently. One host thread per rank drives both
forwards boundary by boundary, and each step enqueues D's iteration and P's next segment in an
order that depends on the rank's ADP replica (odd replicas P first, even replicas D first:
replicas progress independently), except that collectives over one rank set keep one order on
all its members (P's segment goes before D's first collective over the same ranks). So the order
is consistent within every group, and across replicas only between *crossed* groups. Why
ATP4/ADP1 and ATP1/ADP4 complete and ATP2/ADP2 deadlocks is derived in `multiplex.inorder`.

Which collectives a paused forward issues next comes from the model's comm: each phase's expert
exchange names its kind (`ExpertExchange.kind`), whose collectives `multiplex.routing` lists.
"""
from __future__ import annotations

import time

from megatron_rollout.comm.facade import Comm
from megatron_rollout.engine.api import RequestOutput
from megatron_rollout.engine.bookkeeping import RequestTable
from megatron_rollout.engine.coordinator import GlobalView
from megatron_rollout.engine.execution import StepExecutor
from megatron_rollout.engine.scheduler import StepPlan
from megatron_rollout.engine.schedules.mux import EpochSchedule
from megatron_rollout.forward import BoundaryPoint, Forward
from megatron_rollout.multiplex.rendezvous import LocalRendezvous, RendezvousBase
from megatron_rollout.multiplex.routing import phase_path
from megatron_rollout.types import Axis, Phase


class NaiveSchedule(EpochSchedule):
    def __init__(self, table: RequestTable, executor: StepExecutor, comm: Comm,
                 rendezvous: RendezvousBase | None = None) -> None:
        super().__init__(table, executor)
        self.comm = comm
        self.rendezvous = rendezvous or LocalRendezvous()
        self.replica = comm.rank(Axis.ADP)
        self._paths = {phase: phase_path(kind) if (kind := comm.exchange(phase).kind) else {} for phase in Phase}
        self._p: Forward | None = None  # P's forward, paused at `_p_at` (None: not started)
        self._p_at: BoundaryPoint | None = None
        self._p_done: list = []  # [P's result] once its forward returned

    def _begin(self, forward: Forward, view: GlobalView) -> None:
        self._p, self._p_at, self._p_done = forward, None, []

    def _next_ranks(self, phase: Phase, point: BoundaryPoint | None) -> tuple[int, ...]:
        """The ranks of the first multi-rank collective a forward paused at `point` issues when
        resumed (the model yields right before each); () when it issues none."""
        if point is None or point.layer < 0:
            return ()
        for site in self._paths[phase].get(point.site, ()):
            if self.comm.size(site.axis) > 1:
                return tuple(self.comm.groups.ranks(site.axis))
        return ()

    def _p_resume(self) -> None:
        try:
            self._p_at = next(self._p)
        except StopIteration as stop:
            self._p_done = [stop.value]

    def _advance(self, plan: StepPlan, view: GlobalView) -> list[RequestOutput]:
        """D's iteration and P's next segment, in this replica's order (module docstring)."""
        ex, outs = self.executor, []
        p_pending, p_first = not self._p_done, self.replica % 2 == 1
        if view.any_decode:
            step = ex.inputs(plan.decode, ())
            self.table.note_decode_wait(plan.decode, time.perf_counter())
            d, d_at = ex.forward(step, Phase.D), None
            while d is not None:
                if p_pending and (p_first or self._next_ranks(Phase.P, self._p_at) and
                                  self._next_ranks(Phase.P, self._p_at) == self._next_ranks(Phase.D, d_at)):
                    self._p_resume()
                    p_pending = False
                try:
                    d_at = next(d)
                except StopIteration as stop:
                    outs.extend(ex.complete(step.owners, stop.value))
                    d = None
        if p_pending:
            self._p_resume()
        # Bookkeeping only: ranks agree on the step at which the epoch's requests are promoted,
        # so ATP peers stay mirrors; the device order of P's collectives stays unordered.
        done = self.rendezvous.meet(self.epoch.number, 0, "naive-poll", (int(bool(self._p_done)),))
        if all(d[0] for d in done):
            outs.extend(self._finish_epoch(self._p_done[0]))
            self._p = None
        return outs
