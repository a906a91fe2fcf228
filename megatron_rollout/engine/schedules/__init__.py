"""How prefill (P) and decode (D) share the engine's steps: the schedules, peers behind one interface.

A schedule turns one step's plan (already agreed by every rank, `engine.coordinator`) into
forwards: `plain.PlainSchedule` runs one forward per step (`off`, `chunked`), `mux.MuxSchedule`
runs a turnstile round (`mux`). Both use only the request table's and the step executor's public
methods; the engine calls `step(plan, view)` and asks `busy` (a forward in flight across steps).
"""
from __future__ import annotations

from megatron_rollout.engine.api import Schedule
from megatron_rollout.engine.bookkeeping import RequestTable
from megatron_rollout.engine.config import EngineConfig
from megatron_rollout.engine.execution import StepExecutor
from megatron_rollout.engine.schedules.base import ScheduleDriver
from megatron_rollout.engine.schedules.mux import MuxSchedule
from megatron_rollout.engine.schedules.plain import PlainSchedule

__all__ = ["MuxSchedule", "PlainSchedule", "ScheduleDriver", "make_schedule"]


def make_schedule(config: EngineConfig, table: RequestTable, executor: StepExecutor, rendezvous=None,
                  router=None) -> ScheduleDriver:
    """The driver of `config.schedule`; `rendezvous` and `router` serve `mux` across ranks."""
    if config.schedule is Schedule.MUX:
        return MuxSchedule(config.mux, table, executor, rendezvous, router)
    return PlainSchedule(table, executor)
