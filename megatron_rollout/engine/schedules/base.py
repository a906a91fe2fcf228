"""The interface every schedule implements (see `engine.schedules`)."""
from __future__ import annotations

import abc

from megatron_rollout.engine.api import RequestOutput
from megatron_rollout.engine.coordinator import GlobalView
from megatron_rollout.engine.scheduler import StepPlan


class ScheduleDriver(abc.ABC):
    """Runs the forwards of one planned step. Holds no tensors beyond a forward in flight."""

    @property
    def busy(self) -> bool:
        """A forward is in flight across steps (weights may not change, no new epoch may start)."""
        return False

    def position(self) -> str | None:
        """Where the schedule is beyond the engine's step count (e.g. "mux epoch 3"), for errors."""
        return None

    @abc.abstractmethod
    def step(self, plan: StepPlan, view: GlobalView) -> list[RequestOutput]:
        """Run this step's forwards; the requests that finished in it."""
