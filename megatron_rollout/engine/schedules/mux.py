"""The `mux` schedule: in-place P/D multiplexing inside the engine (DESIGN.md §6).

An admitted prefill batch is an *epoch*: its forward is the model's generator, which stops at
every safe boundary. Each engine step is one turnstile round (`multiplex.turnstile`): pre-D
rendezvous, one decode iteration (a matched no-work call where a replica has no rows, skipped
only when no replica has any), the post-D rendezvous, then P resumes for the span the segment
policy permits. On one process the rendezvous are local no-ops; the protocol is the same.

P's boundary ids come from the model's actual yields: `boundary_plan` lists the points the
model's P forward yields (per layer: attention's ATP all-reduce, then the MoE exchange and its
data step, or a dense MLP's all-reduce), and the turnstile publishes each yielded point as its
position in that plan, so every rank's controller checks the real sequence (a skipped or repeated
boundary fails every rank with the controller's `BoundaryError`).

`MuxConfig.ordering="naive"` is the unsafe baseline the ordering experiments compare against
(DESIGN.md §8): no rendezvous, no routing, P and D progress independently. One host thread per
rank drives both forwards boundary by boundary, and each step enqueues D's iteration and P's next
segment in an order that depends on the rank's ADP replica (odd replicas P first, even replicas
D first: replicas progress independently), except that collectives over one rank set keep one
order on all its members (P's segment goes before D's first collective over the same ranks). So
the order is consistent within every group, and across replicas only between *crossed* groups.
Why ATP4/ADP1 and ATP1/ADP4 complete and ATP2/ADP2 deadlocks is derived in `multiplex.inorder`.

A request cancelled mid-epoch cannot give its blocks back at once: the rest of P's forward still
writes them. The request table parks them (`RequestTable.begin_in_flight`) until the epoch ends,
and the controller is untouched (the epoch runs to its end for the other requests).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from megatron_rollout.engine.api import RequestOutput
from megatron_rollout.engine.bookkeeping import RequestTable, SampleOwner
from megatron_rollout.engine.config import MuxConfig, build_policy
from megatron_rollout.engine.coordinator import GlobalView
from megatron_rollout.engine.execution import StepExecutor
from megatron_rollout.engine.records import step_record
from megatron_rollout.engine.scheduler import StepPlan
from megatron_rollout.engine.schedules.base import ScheduleDriver
from megatron_rollout.forward import BoundaryPoint, Forward, Site
from megatron_rollout.multiplex.controller import BoundaryController
from megatron_rollout.multiplex.rendezvous import LocalRendezvous, RendezvousBase
from megatron_rollout.multiplex.routing import Router, phase_path
from megatron_rollout.multiplex.turnstile import Turnstile
from megatron_rollout.types import Axis, Phase


def boundary_plan(model, phase: Phase) -> tuple[BoundaryPoint, ...] | None:
    """The points `model.step(..., phase)` yields, in order (None for a runner without a model of
    this shape: the turnstile then numbers yields by position). Mirrors `model.layers`; the test
    tests/multiplex/test_boundary_faults.py checks it against real yields."""
    cfg, comm = getattr(model, "cfg", None), getattr(model, "comm", None)
    if cfg is None or comm is None or not hasattr(cfg, "is_moe_layer"):
        return None
    tp, split = comm.size(Axis.ATP) > 1, comm.exchange(phase).data_boundary
    points: list[BoundaryPoint] = []
    for layer in range(cfg.num_layers):
        if tp:
            points.append(BoundaryPoint(layer, Site.ATTN_REDUCE))
        if cfg.is_moe_layer(layer):
            points.append(BoundaryPoint(layer, Site.MOE_EXCHANGE))
            if split:
                points.append(BoundaryPoint(layer, Site.MOE_DATA))
        elif tp:
            points.append(BoundaryPoint(layer, Site.MLP_REDUCE))
    return tuple(points)


@dataclass
class Epoch:
    number: int
    owners: list[SampleOwner]
    """Every row P samples when it finishes."""
    version: int
    """The weight version P's forward runs under (no update lands while an epoch is in flight)."""
    rows: list = field(default_factory=list)
    """P's rows, until its first segment is recorded (`engine.records`: sizes go on that one)."""


class MuxSchedule(ScheduleDriver):
    def __init__(self, config: MuxConfig, table: RequestTable, executor: StepExecutor,
                 rendezvous: RendezvousBase | None = None, router: Router | None = None) -> None:
        self.table, self.executor = table, executor
        self.rendezvous = rendezvous or LocalRendezvous()
        self.turnstile = Turnstile(self.rendezvous, BoundaryController(), build_policy(config.span), router)
        self.epoch: Epoch | None = None
        self.naive = config.ordering == "naive"
        model = getattr(executor.runner, "model", None)
        self.comm = getattr(model, "comm", None)
        self.plan = boundary_plan(model, Phase.P)
        self.replica = self.comm.rank(Axis.ADP) if self.comm is not None else 0
        exchanges = getattr(getattr(self.comm, "config", None), "p_exchange", None), \
            getattr(getattr(self.comm, "config", None), "d_exchange", None)
        self._paths = {phase: phase_path(kind) if kind else {} for phase, kind in zip((Phase.P, Phase.D), exchanges)}
        self._p: Forward | None = None  # naive: P's forward, paused at `_p_at` (None: not started)
        self._p_at: BoundaryPoint | None = None
        self._p_done: list = []  # naive: [P's result] once its forward returned
        self._numbers = itertools.count(1)
        self._clock = time.perf_counter() - time.time()  # turnstile records use time.time()

    @property
    def rounds(self) -> int:
        """Turnstile rounds run so far (all epochs)."""
        return len(self.turnstile.records)

    @property
    def busy(self) -> bool:
        return self.epoch is not None

    def step(self, plan: StepPlan, view: GlobalView) -> list[RequestOutput]:
        ex = self.executor
        if view.any_prefill and self.epoch is None:  # every rank starts the epoch, maybe with no rows
            rows, owners = ex.inputs((), plan.prefill)
            self.epoch = Epoch(next(self._numbers), owners, ex.weights.version, rows)
            self.table.begin_in_flight(owners)
            forward = ex.forward(rows, Phase.P)
            if self.naive:
                self._p, self._p_at, self._p_done = forward, None, []
            else:
                self.turnstile.begin(self.epoch.number, forward, prefill_tokens=view.prefill_tokens,
                                     boundaries=self.plan)
        outs: list[RequestOutput] = []

        def decode_iteration() -> None:
            if view.any_decode:
                outs.extend(ex.run(StepPlan(decode=plan.decode), Phase.D))

        if self.epoch is None:
            if not view.any_decode:
                return self.table.unblock() if self.table.requests else []
            decode_iteration()
            return outs
        if self.naive:
            with torch.no_grad():
                return self._naive_step(plan, view)
        rows = lambda: len(plan.decode)  # noqa: E731
        with torch.no_grad():  # grad mode is read each time P's generator resumes
            finished = self.turnstile.round(decode_iteration, rows)
            if finished:  # this round ran no D (every rank's P had already returned): run it now
                decode_iteration()
            else:
                self._record_segment()
                # P returned in this round: close the epoch now (a pre-D rendezvous that confirms
                # it on every rank and runs no D) rather than one step later.
                finished = self.turnstile.p_finished and self.turnstile.round(decode_iteration, rows)
        if finished:
            outs.extend(self._finish_epoch(self.turnstile.result))
        return outs

    def _finish_epoch(self, logits: torch.Tensor) -> list[RequestOutput]:
        epoch, self.epoch = self.epoch, None
        self.table.end_in_flight()  # first: the requests it completes may finish now, unparked
        if self.executor.weights.version != epoch.version:
            raise RuntimeError(f"mux epoch {epoch.number} ran under weight version {epoch.version} but the engine "
                               f"is at {self.executor.weights.version}: a weight update landed mid-epoch")
        return self.executor.complete(epoch.owners, logits, version=epoch.version)

    # -- the naive baseline ------------------------------------------------------------------
    def _next_ranks(self, phase: Phase, point: BoundaryPoint | None) -> tuple[int, ...]:
        """The ranks of the first multi-rank collective a forward paused at `point` issues when
        resumed (the model yields right before each); () when it issues none."""
        if point is None or point.layer < 0 or self.comm is None:
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

    def _naive_step(self, plan: StepPlan, view: GlobalView) -> list[RequestOutput]:
        """D's iteration and P's next segment, in this replica's order (module docstring)."""
        ex, outs = self.executor, []
        p_pending, p_first = not self._p_done, self.replica % 2 == 1
        if view.any_decode:
            step = ex.inputs(plan.decode, ())
            self.table.note_decode_wait(plan.decode, time.perf_counter())
            d, d_at = ex.forward(step.rows, Phase.D), None
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

    def _record_segment(self) -> None:
        ex, rec = self.executor, self.turnstile.records[-1]
        rows, self.epoch.rows = self.epoch.rows, []
        ex.log.add(step_record(Phase.P.value, rows, 0, rec.t_post_d + self._clock, rec.t_end + self._clock,
                               epoch=rec.epoch))
        if ex.timeline is not None:
            ex.timeline.record(ex.rank, Phase.P.value, f"epoch {rec.epoch} segment", rec.t_post_d + self._clock,
                               rec.t_end + self._clock, boundaries=f"{rec.first_boundary}..{rec.last_boundary}",
                               span=rec.span, max_decode_rows=rec.max_decode_rows)
