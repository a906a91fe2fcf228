"""Orderings the simulator can try: the engine's priorities (`engine.priority`), and an oracle.

The engine's planner serves requests by a rank its priority gives them at submission
(`engine.priority`); the simulator ranks them the same way, with the very same priority objects,
so a priority's simulated makespan is the engine's under that priority. `Oracle` also knows every
conversation's future turns and serves the longest remaining chain first (the critical path
first), which no real engine can: it is the yardstick the priorities without that knowledge are
compared to.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_rollout.engine.priority import PRIORITIES, Fifo, Priority, RequestInfo

__all__ = ["POLICIES", "Fifo", "Foresight", "Oracle", "Priority", "RequestInfo", "make_policy"]


@dataclass(frozen=True)
class Foresight(RequestInfo):
    """A request as the simulator knows it: what the engine knows, and its future."""

    remaining_chain_s: float = 0.0
    """This turn and every later turn of its conversation (tool waits, prefill and decode at
    batch 1). Only an oracle may read it."""


class Oracle(Priority):
    """Longest remaining chain first, knowing each conversation's future."""

    name = "oracle"

    def key(self, request: RequestInfo) -> float:
        if not isinstance(request, Foresight):
            raise TypeError(f"the oracle needs the future (a sim.policy.Foresight), got {type(request).__name__}: "
                            f"it runs in the simulator only")
        return -request.remaining_chain_s


POLICIES: dict[str, type[Priority]] = {**PRIORITIES, Oracle.name: Oracle}
"""Every ordering the simulator tries: the engine's priorities, then the oracle."""


def make_policy(name: str) -> Priority:
    """The ordering called `name`, or ValueError naming the known ones."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; the simulator knows {list(POLICIES)}")
    return POLICIES[name]()
