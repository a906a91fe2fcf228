"""The `mux` schedule: in-place P/D multiplexing inside the engine (DESIGN.md §6).

An admitted prefill batch is an *epoch*: its forward is the model's generator, which stops at
every safe boundary. Each engine step is one turnstile round (`multiplex.turnstile`): pre-D
rendezvous, one decode iteration (a matched no-work call where a replica has no rows, skipped
only when no replica has any), the post-D rendezvous, then P resumes for the span the segment
policy permits. On one process the rendezvous are local no-ops; the protocol is the same.

`MuxConfig.ordering="naive"` is the unsafe baseline the ordering experiments compare against:
P's forward runs to its end on a host thread of its own while D iterates, with no rendezvous and
no routing, so P and D enqueue their collectives independently. It is correct on one process and
deadlocks crossed ATP/ADP layouts on an in-order device (tests/multiplex).

A request cancelled mid-epoch cannot give its blocks back at once: the rest of P's forward still
writes them. The request table parks them (`RequestTable.begin_in_flight`) until the epoch ends,
and the controller is untouched (the epoch runs to its end for the other requests).
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

import torch

from megatron_rollout.engine.api import RequestOutput
from megatron_rollout.engine.bookkeeping import RequestTable, SampleOwner
from megatron_rollout.engine.config import MuxConfig, build_policy
from megatron_rollout.engine.coordinator import GlobalView
from megatron_rollout.engine.execution import StepExecutor
from megatron_rollout.engine.scheduler import StepPlan
from megatron_rollout.engine.schedules.base import ScheduleDriver
from megatron_rollout.forward import Forward, run_to_end
from megatron_rollout.multiplex.controller import BoundaryController
from megatron_rollout.multiplex.rendezvous import LocalRendezvous, RendezvousBase
from megatron_rollout.multiplex.routing import Router
from megatron_rollout.multiplex.turnstile import Turnstile
from megatron_rollout.types import Phase


@dataclass
class Epoch:
    number: int
    owners: list[SampleOwner]
    """Every row P samples when it finishes."""


class MuxSchedule(ScheduleDriver):
    def __init__(self, config: MuxConfig, table: RequestTable, executor: StepExecutor,
                 rendezvous: RendezvousBase | None = None, router: Router | None = None) -> None:
        self.table, self.executor = table, executor
        self.rendezvous = rendezvous or LocalRendezvous()
        self.turnstile = Turnstile(self.rendezvous, BoundaryController(), build_policy(config.span), router)
        self.epoch: Epoch | None = None
        self.naive = config.ordering == "naive"
        self._p_thread: threading.Thread | None = None
        self._p_outcome: list = []  # [result] or [exception] once the naive P thread ends
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
            self.epoch = Epoch(next(self._numbers), owners)
            self.table.begin_in_flight(owners)
            forward = ex.forward(rows, Phase.P)
            if self.naive:
                self._start_p_thread(forward)
            else:
                self.turnstile.begin(self.epoch.number, forward, prefill_tokens=view.prefill_tokens)
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
            decode_iteration()
            return outs + self._poll_p_thread()
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
        return self.executor.complete(epoch.owners, logits)

    # -- the naive baseline ------------------------------------------------------------------
    def _start_p_thread(self, forward: Forward) -> None:
        def run() -> None:
            try:
                with torch.no_grad():
                    self._p_outcome.append(run_to_end(forward))
            except BaseException as exc:  # noqa: BLE001 - re-raised on the engine's thread
                self._p_outcome.append(exc)

        self._p_outcome = []
        self._p_thread = threading.Thread(target=run, name=f"naive-P-epoch{self.epoch.number}", daemon=True)
        self._p_thread.start()

    def _poll_p_thread(self) -> list[RequestOutput]:
        # Bookkeeping only: ranks agree on the step at which the epoch's requests are promoted,
        # so ATP peers stay mirrors; the device order of P's collectives stays unordered.
        done = self.rendezvous.meet(self.epoch.number, 0, "naive-poll", (int(not self._p_thread.is_alive()),))
        if not all(d[0] for d in done):
            return []
        self._p_thread.join()
        outcome = self._p_outcome[0]
        if isinstance(outcome, BaseException):
            self.epoch = None
            self.table.end_in_flight()
            raise outcome
        return self._finish_epoch(outcome)

    def _record_segment(self) -> None:
        ex, rec = self.executor, self.turnstile.records[-1]
        if ex.timeline is not None:
            ex.timeline.record(ex.rank, Phase.P.value, f"epoch {rec.epoch} segment", rec.t_post_d + self._clock,
                               rec.t_end + self._clock, boundaries=f"{rec.first_boundary}..{rec.last_boundary}",
                               span=rec.span, max_decode_rows=rec.max_decode_rows)
