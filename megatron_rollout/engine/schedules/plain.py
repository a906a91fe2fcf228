"""`off` and `chunked`: one forward per step, in the phase every rank agreed on.

The planner already made the difference between the two (`off` admits a whole prefill batch and
no decode rows beside it; `chunked` packs prefill chunks into the decode step's token budget), so
running a step is the same: the step's single forward, or, when nothing fits anywhere, the local
KV-pressure relief of the request table.
"""
from __future__ import annotations

from megatron_rollout.engine.api import RequestOutput
from megatron_rollout.engine.bookkeeping import RequestTable
from megatron_rollout.engine.coordinator import GlobalView
from megatron_rollout.engine.execution import StepExecutor
from megatron_rollout.engine.scheduler import StepPlan
from megatron_rollout.engine.schedules.base import ScheduleDriver


class PlainSchedule(ScheduleDriver):
    def __init__(self, table: RequestTable, executor: StepExecutor) -> None:
        self.table, self.executor = table, executor

    def step(self, plan: StepPlan, view: GlobalView) -> list[RequestOutput]:
        if view.phase is None:
            return self.table.unblock() if self.table.requests else []
        return self.executor.run(plan, view.phase)
