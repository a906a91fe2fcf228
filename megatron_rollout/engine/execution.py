"""Step execution: a plan's rows -> span inputs -> the runner's forward -> samples -> bookkeeping.

`StepExecutor` is the device side of a step. It asks the `RequestTable` for each row's span (the
table grows or reserves the row's KV blocks), hands the rows to the runner, samples the logits,
and gives each sample back to the table, which advances or finishes its request. Schedules
(`engine.schedules`) decide *when* forwards run and in which phase; this module only runs them.

Left out: planning (the pure `scheduler.plan_step`) and anything that changes which requests exist.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from typing import NamedTuple

import torch

from megatron_rollout.engine.ahead import DecodeAhead
from megatron_rollout.engine.api import FinishReason, RequestOutput
from megatron_rollout.engine.bookkeeping import RequestTable, SampleOwner
from megatron_rollout.engine.records import StepLog, step_record
from megatron_rollout.engine.sampler import PendingDraw
from megatron_rollout.engine.scheduler import PrefillChunk, SchedulerState, StepPlan
from megatron_rollout.engine.stats import EngineStats
from megatron_rollout.forward import Forward, run_to_end
from megatron_rollout.runner.base import Runner
from megatron_rollout.runner.speculative import VerifyRow
from megatron_rollout.types import Phase, SpanInput
from megatron_rollout.weights.store import WeightStore


class StepInputs(NamedTuple):
    """One forward's rows and, in logits-row order, the owner of every row it samples."""

    rows: list[SpanInput]
    owners: list[SampleOwner]
    verify: list[VerifyRow] | None = None
    """Speculative decoding (`engine.drafting`): what the forward returns for each row."""


class StepExecutor:
    def __init__(self, table: RequestTable, runner: Runner, weights: WeightStore, stats: EngineStats, seed: int,
                 timeline=None, rank: int = 0) -> None:
        self.table, self.runner, self.weights, self.stats = table, runner, weights, stats
        self.timeline, self.rank = timeline, rank
        self.generator = torch.Generator().manual_seed(seed)
        """Draws for sampled requests without their own seed."""
        self.ahead: DecodeAhead | None = None
        """Set by the engine where decode ahead is on (`engine.ahead`)."""
        self.log = StepLog()
        """One record per forward run (`engine.records`)."""

    def inputs(self, decode: Iterable[int], prefill: Iterable[PrefillChunk]) -> StepInputs:
        """Grow/reserve KV for the rows and build the runner's inputs: decode rows first."""
        rows, owners = [], []
        for rid in decode:
            row, owner = self.table.decode_row(rid)
            rows.append(row)
            owners.append(owner)
        for chunk in prefill:
            row, owner = self.table.prefill_row(chunk)
            rows.append(row)
            if owner is not None:
                owners.append(owner)
        return StepInputs(rows, owners)

    def forward(self, step: StepInputs, phase: Phase) -> Forward:
        """The runner's resumable forward over the step's rows (a `mux` epoch drives it segment by
        segment)."""
        if phase is Phase.D and self.ahead is not None:
            self.ahead.drop()  # a decode forward outside `run` moves the rows past it
        return self.runner.forward(step.rows, phase)

    def planning_view(self, state: SchedulerState) -> SchedulerState:
        """What the planner sees of the table's state (a speculative executor adds its drafts)."""
        return state

    def run(self, plan: StepPlan, phase: Phase) -> list[RequestOutput]:
        """One forward in `phase` over the plan's rows (none: a matched no-work forward), run to its
        end, sampled and completed; a pure decode step takes the forward issued ahead for it, if
        any, and issues the next one before reading its own tokens (`engine.ahead`)."""
        taken = self.ahead.take(plan) if self.ahead is not None else None
        t0 = time.perf_counter()
        rows, owners, logits = taken or (*self.inputs(plan.decode, plan.prefill)[:2], None)
        self.table.note_decode_wait(plan.decode, t0)
        with torch.no_grad():
            if logits is None:
                logits = run_to_end(self.runner.forward(rows, phase))
            draw = self.draw(owners, logits)
            if self.ahead is not None and phase is Phase.D and plan.decode and not plan.prefill:
                self.ahead.issue(owners, draw)  # before this step's tokens reach the host
        self._record_time(plan, phase, t0)
        outs = self.complete(owners, logits, draw)
        self._record_step(plan, phase, rows, t0)
        return outs

    def _record_time(self, plan: StepPlan, phase: Phase, t0: float) -> None:
        if self.timeline is not None:
            self.timeline.record(self.rank, phase.value, "prefill" if phase is Phase.P else "decode", t0,
                                 time.perf_counter(), rows=len(plan.decode), prefill=len(plan.prefill))

    def _record_step(self, plan: StepPlan, phase: Phase, rows: list[SpanInput], t0: float) -> None:
        if self.log.enabled:
            self.log.add(step_record(phase.value, rows, len(plan.decode), t0, time.perf_counter()))

    def draw(self, owners: list[SampleOwner], logits: torch.Tensor) -> PendingDraw:
        """Every row's token, issued now (`sampler.PendingDraw`); each request's own generator."""
        return PendingDraw(logits, [o.request.params for o in owners],
                           [o.request.generator or self.generator for o in owners])

    def complete(self, owners: list[SampleOwner], logits: torch.Tensor, draw: PendingDraw | None = None,
                 version: int | None = None) -> list[RequestOutput]:
        """Sample one token per owner row and advance its request; rows of stale lifetimes are
        dropped (and draw nothing). A row whose logits are not finite fails its own request only.
        `draw`: every row's draw, issued already (`logits` may be overwritten by a later forward).
        `version`: the weight version the forward ran under, the tokens' tag (default: the current
        one; a forward that spans steps passes the one it started under)."""
        live = [(i, o) for i, o in enumerate(owners) if self.table.is_live(o)]
        if draw is None:
            rows = logits if len(live) == len(owners) else logits[[i for i, _ in live]]
            picked = self.draw([o for _, o in live], rows).result(range(len(live)))
        else:
            picked = draw.result([i for i, _ in live])
        now, outs = time.perf_counter(), []
        version = self.weights.version if version is None else version
        for (_, owner), s in zip(live, picked):
            if s.error is not None:
                req = owner.request
                outs.append(self.table.finish(req, FinishReason.ERROR,
                                              f"request {req.rid}: {s.error} at position {owner.context} "
                                              f"under weight version {version}"))
                continue
            out = self.table.accept(owner, s.token, s.logprob, version, now)
            if out is not None:
                outs.append(out)
        return outs
