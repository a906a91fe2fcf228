"""The `mux` schedule: in-place P/D multiplexing inside the engine (DESIGN.md §6).

An admitted prefill batch is an *epoch*: its forward is the model's generator, which stops at
every safe boundary. Each engine step is one turnstile round: one decode iteration (a matched
no-work call where a rank has no rows), then P resumes for a span of boundaries chosen by the
segment policy. On several ranks the `Turnstile` adds the pre-/post-D rendezvous and routes the
registered conflicting P collective after D; on one process those are no-ops.

A request cancelled mid-epoch cannot give its blocks back at once: the rest of P's forward still
writes them. Its blocks move to a *zombie* owner released when the epoch ends.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megatron_rollout.engine.api import RequestOutput
from megatron_rollout.engine.coordinator import GlobalView
from megatron_rollout.engine.scheduler import StepPlan
from megatron_rollout.model.layers import Forward
from megatron_rollout.multiplex.controller import BoundaryController
from megatron_rollout.multiplex.rendezvous import LocalRendezvous, RendezvousBase
from megatron_rollout.multiplex.policy import FixedSpan, LoadSelected, SegmentLoad, SegmentPolicy
from megatron_rollout.types import Phase

if TYPE_CHECKING:
    from megatron_rollout.engine.engine import RolloutEngine
    from megatron_rollout.engine.request import Request


def make_policy(spec: str) -> SegmentPolicy:
    """"load" -> LoadSelected(), "fixed:K" -> FixedSpan(K) (EngineConfig.mux_span)."""
    return LoadSelected() if spec == "load" else FixedSpan(int(spec.split(":", 1)[1]))


@dataclass
class Epoch:
    number: int
    forward: Forward
    owners: list
    prefill_tokens: int
    boundaries: int = 0
    """Boundaries passed so far."""
    zombies: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None


class MuxDriver:
    def __init__(self, engine: "RolloutEngine", rendezvous: RendezvousBase | None = None) -> None:
        self.engine = engine
        self.policy: SegmentPolicy = make_policy(engine.config.mux_span)
        self.rendezvous = rendezvous or LocalRendezvous()
        self.controller = BoundaryController()
        self.epoch: Epoch | None = None
        self._numbers = itertools.count(1)
        self._zombie_ids = itertools.count(-1, -1)
        self.rounds = 0

    @property
    def busy(self) -> bool:
        return self.epoch is not None

    def round(self, plan: StepPlan, view: GlobalView) -> list[RequestOutput]:
        """One turnstile round: D iteration, then P up to the policy's span."""
        e = self.engine
        if view.any_prefill and self.epoch is None:  # every rank starts the epoch, maybe with no rows
            inputs, owners = e._inputs((), plan.prefill)
            self.epoch = Epoch(next(self._numbers), e.runner.forward(inputs, Phase.P), owners, view.prefill_tokens)
            self.controller.begin_epoch(self.epoch.number)
        if not view.any_decode and self.epoch is None:
            return e._unblock() if e.requests else []
        self.rounds += 1
        outs = e._run_plain(StepPlan(decode=plan.decode), Phase.D) if view.any_decode else []
        if self.epoch is not None:
            # The step's state gather was the pre-D rendezvous; D is enqueued; now the post-D one.
            self.rendezvous.meet(self.epoch.number, self.epoch.boundaries, "post-D")
            self.controller.mark_post_d_complete()
            self.controller.advance(self.policy.span(SegmentLoad(view.max_decode_rows, None, self.epoch.prefill_tokens)))
            outs += self._segment()
        return outs

    def _segment(self) -> list[RequestOutput]:
        """Run P through the segments the controller permits (or to its end)."""
        epoch, e = self.epoch, self.engine
        t0 = time.perf_counter()
        start = epoch.boundaries
        with torch.no_grad():
            try:
                while self.controller.may_run_next_segment():
                    next(epoch.forward)
                    self.controller.publish(epoch.number, epoch.boundaries + 1)
                    epoch.boundaries += 1
            except StopIteration as stop:
                epoch.logits = stop.value
                self.controller.end_epoch()
        if e.timeline is not None:
            e.timeline.record(e.rank, Phase.P.value, f"epoch {epoch.number} segment", t0, time.perf_counter(),
                              boundaries=f"{start + 1}..{epoch.boundaries}")
        if epoch.logits is None:
            return []
        self.epoch = None
        for owner in epoch.zombies:
            e.pool.release(owner)
        return e._complete(epoch.owners, epoch.logits)

    def forget(self, req: "Request") -> None:
        """`req` is finishing early; if P is still writing its blocks, park them until the epoch ends."""
        if self.epoch is None or not any(o[0] is req for o in self.epoch.owners):
            return
        zombie = next(self._zombie_ids)
        self.engine.pool.tables[zombie] = self.engine.pool.tables.pop(req.seq.sid, [])
        self.engine.pool.reserved.discard(req.seq.sid)
        req.seq.reset_kv()
        self.epoch.zombies.append(zombie)
