"""The `mux` schedule: in-place P/D multiplexing inside the engine (docs/design.md §6).

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

The naive ordering baseline (`MuxConfig.ordering="naive"`) is a schedule of its own beside this
one (`schedules.naive`); both share `EpochSchedule`, the part of an epoch that is not ordering.

A request cancelled mid-epoch cannot give its blocks back at once: the rest of P's forward still
writes them. The request table parks them (`RequestTable.begin_in_flight`) until the epoch ends,
and the controller is untouched (the epoch runs to its end for the other requests).
"""
from __future__ import annotations

import abc
import itertools
from dataclasses import dataclass, field

import torch

from megatron_rollout.engine.api import RequestOutput
from megatron_rollout.engine.bookkeeping import RequestTable, SampleOwner
from megatron_rollout.engine.config import MuxConfig, build_policy
from megatron_rollout.engine.coordinator import GlobalView
from megatron_rollout.engine.execution import StepExecutor
from megatron_rollout.engine.records import step_record, wall_minus_perf
from megatron_rollout.engine.scheduler import StepPlan
from megatron_rollout.engine.schedules.base import ScheduleDriver
from megatron_rollout.forward import BoundaryPoint, Forward, Site
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.multiplex.controller import BoundaryController
from megatron_rollout.multiplex.rendezvous import LocalRendezvous, RendezvousBase
from megatron_rollout.multiplex.routing import Router
from megatron_rollout.multiplex.turnstile import Turnstile
from megatron_rollout.types import Axis, Phase


def boundary_plan(model, phase: Phase, mtp_layers: int = 0) -> tuple[BoundaryPoint, ...] | None:
    """The points `model.step(..., phase)` yields, in order (None for a runner without a model of
    this shape: the turnstile then numbers yields by position), then those of `mtp_layers` MTP
    layers run after it (speculative decoding's P forward, `engine.drafting`). Mirrors
    `model.layers`; the test tests/multiplex/test_boundary_faults.py checks it against real yields."""
    cfg, comm = getattr(model, "cfg", None), getattr(model, "comm", None)
    if cfg is None or comm is None or not hasattr(cfg, "is_moe_layer"):
        return None
    tp, split = comm.size(Axis.ATP) > 1, comm.exchange(phase).data_boundary
    points: list[BoundaryPoint] = []
    for layer in range(cfg.num_layers + mtp_layers):
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


class EpochSchedule(ScheduleDriver):
    """A prefill batch as an epoch resumed across steps, with a decode iteration per step: what
    `MuxSchedule` and `NaiveSchedule` share. Subclasses say how an epoch starts (`_begin`) and how
    one step advances it beside D (`_advance`)."""

    def __init__(self, table: RequestTable, executor: StepExecutor) -> None:
        self.table, self.executor = table, executor
        self.epoch: Epoch | None = None
        self._numbers = itertools.count(1)

    @property
    def busy(self) -> bool:
        return self.epoch is not None

    def position(self) -> str | None:
        return f"mux epoch {self.epoch.number}" if self.epoch is not None else None

    def step(self, plan: StepPlan, view: GlobalView) -> list[RequestOutput]:
        ex = self.executor
        if view.any_prefill and self.epoch is None:  # every rank starts the epoch, maybe with no rows
            step = ex.inputs((), plan.prefill)
            self.epoch = Epoch(next(self._numbers), step.owners, ex.weights.version, step.rows)
            self.table.begin_in_flight(step.owners)
            self._begin(ex.forward(step, Phase.P), view)
        if self.epoch is None:
            if not view.any_decode:
                return self.table.unblock() if self.table.requests else []
            return ex.run(plan.decode_part, Phase.D)
        with torch.no_grad():  # grad mode is read each time P's generator resumes
            return self._advance(plan, view)

    @abc.abstractmethod
    def _begin(self, forward: Forward, view: GlobalView) -> None:
        """Take over P's forward of the epoch just started (`self.epoch`)."""

    @abc.abstractmethod
    def _advance(self, plan: StepPlan, view: GlobalView) -> list[RequestOutput]:
        """One step of an epoch in flight: D's iteration and P's next segment, in some order."""

    def _finish_epoch(self, logits: torch.Tensor) -> list[RequestOutput]:
        epoch, self.epoch = self.epoch, None
        self.table.end_in_flight()  # first: the requests it completes may finish now, unparked
        if self.executor.weights.version != epoch.version:
            raise RuntimeError(f"mux epoch {epoch.number} ran under weight version {epoch.version} but the engine "
                               f"is at {self.executor.weights.version}: a weight update landed mid-epoch")
        return self.executor.complete(epoch.owners, logits, version=epoch.version)


class MuxSchedule(EpochSchedule):
    """The turnstile: each step is one round (pre-D rendezvous, D, post-D rendezvous, P's segment)."""

    def __init__(self, config: MuxConfig, table: RequestTable, executor: StepExecutor, model: MoETransformer,
                 rendezvous: RendezvousBase | None = None, router: Router | None = None,
                 speculative: bool = False) -> None:
        super().__init__(table, executor)
        self.rendezvous = rendezvous or LocalRendezvous()
        self.turnstile = Turnstile(self.rendezvous, BoundaryController(), build_policy(config.span), router)
        self.plan = boundary_plan(model, Phase.P, mtp_layers=1 if speculative else 0)
        self._clock = -wall_minus_perf()  # turnstile records use time.time()

    @property
    def rounds(self) -> int:
        """Turnstile rounds run so far (all epochs)."""
        return len(self.turnstile.records)

    def _begin(self, forward: Forward, view: GlobalView) -> None:
        self.turnstile.begin(self.epoch.number, forward, prefill_tokens=view.prefill_tokens, boundaries=self.plan)

    def _advance(self, plan: StepPlan, view: GlobalView) -> list[RequestOutput]:
        outs: list[RequestOutput] = []

        def decode_iteration() -> None:
            if view.any_decode:
                outs.extend(self.executor.run(plan.decode_part, Phase.D))

        rows = lambda: len(plan.decode)  # noqa: E731
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

    def _record_segment(self) -> None:
        ex, rec = self.executor, self.turnstile.records[-1]
        if rec.round > 1 and rec.last_boundary < rec.first_boundary and rec.max_decode_rows == 0:
            return  # a completion poll with no decode anywhere: the round ran neither a segment nor D
            # (`sim.cost.segments_per_epoch` counts an epoch's records as its rounds)
        rows, self.epoch.rows = self.epoch.rows, []
        if ex.log.enabled:
            ex.log.add(step_record(Phase.P.value, rows, 0, rec.t_post_d + self._clock, rec.t_end + self._clock,
                                   epoch=rec.epoch))
        if ex.timeline is not None:
            ex.timeline.record(ex.rank, Phase.P.value, f"epoch {rec.epoch} segment", rec.t_post_d + self._clock,
                               rec.t_end + self._clock, boundaries=f"{rec.first_boundary}..{rec.last_boundary}",
                               span=rec.span, max_decode_rows=rec.max_decode_rows)
