"""How prefill (P) and decode (D) share the engine's steps: the schedules, peers behind one interface.

A schedule turns one step's plan (already agreed by every rank, `engine.coordinator`) into
forwards: `plain.PlainSchedule` runs one forward per step (`off`, `chunked`), `mux.MuxSchedule`
runs a turnstile round (`mux`), `naive.NaiveSchedule` the unordered baseline the turnstile is
measured against (`mux` with `MuxConfig.ordering="naive"`). They use only the request table's and
the step executor's public methods; the engine calls `step(plan, view)` and asks `busy` (a
forward in flight across steps) and `position()` (where a step stopped, for error reports).
"""
from __future__ import annotations

from megatron_rollout.engine.api import Schedule
from megatron_rollout.engine.bookkeeping import RequestTable
from megatron_rollout.engine.config import EngineConfig
from megatron_rollout.engine.execution import StepExecutor
from megatron_rollout.engine.schedules.base import ScheduleDriver
from megatron_rollout.engine.schedules.mux import MuxSchedule
from megatron_rollout.engine.schedules.naive import NaiveSchedule
from megatron_rollout.engine.schedules.plain import PlainSchedule
from megatron_rollout.model.transformer import MoETransformer

__all__ = ["MuxSchedule", "NaiveSchedule", "PlainSchedule", "ScheduleDriver", "make_schedule"]


def make_schedule(config: EngineConfig, table: RequestTable, executor: StepExecutor, model: MoETransformer,
                  rendezvous=None, router=None) -> ScheduleDriver:
    """The driver of `config.scheduler.schedule` over `model` (its boundaries, its comm's
    collectives); `rendezvous` and `router` serve `mux` across ranks."""
    if config.scheduler.schedule is not Schedule.MUX:
        return PlainSchedule(table, executor)
    if config.mux.ordering == "naive":
        if config.speculative is not None:
            raise ValueError("the naive ordering baseline (MuxConfig.ordering='naive') has no speculative decoding: "
                             "leave EngineConfig.speculative None, or use ordering 'turnstile'")
        return NaiveSchedule(table, executor, model.comm, rendezvous)
    mtp = config.speculative is not None and config.speculative.method == "mtp"  # its layer runs inside P
    return MuxSchedule(config.mux, table, executor, model, rendezvous, router, speculative=mtp)
