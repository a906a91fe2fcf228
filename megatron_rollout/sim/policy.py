"""Orderings the simulator can try: the engine's priorities (`engine.priority`), and an oracle.

The engine's planner serves requests by a rank its priority gives them at submission
(`engine.priority`); the simulator ranks them the same way, with the very same priority objects,
so a priority's simulated makespan is the engine's under that priority. `Oracle` also knows every
conversation's future turns and serves the longest remaining chain first (the critical path
first), which no real engine can: it is the yardstick the priorities without that knowledge are
compared to. Two orderings read what an RL framework knows and the engine does not (issue 33,
lever d): `GroupStragglers` serves first the conversation whose RL group peers are mostly done
(the group's step waits for it alone), `LeastGenerated` the session with the least attained
service (decode tokens so far). They stay here unless they pay (`benchmarks.policy_sim --levers`).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_rollout.engine.priority import PRIORITIES, Fifo, Priority, RequestInfo

__all__ = ["GROUP_POLICIES", "POLICIES", "Fifo", "Foresight", "GroupStragglers", "LeastGenerated", "Oracle",
           "Priority", "RequestInfo", "make_policy"]


@dataclass(frozen=True)
class Foresight(RequestInfo):
    """A request as the simulator knows it: what the engine knows, and its future."""

    remaining_chain_s: float = 0.0
    """This turn and every later turn of its conversation (tool waits, prefill and decode at
    batch 1). Only an oracle may read it."""
    peers_done: float = 0.0
    """The fraction of the other conversations of its RL group (`SimConfig.group_size`) already
    finished: known to the RL framework, not to the engine."""


class Oracle(Priority):
    """Longest remaining chain first, knowing each conversation's future."""

    name = "oracle"

    def key(self, request: RequestInfo) -> float:
        if not isinstance(request, Foresight):
            raise TypeError(f"the oracle needs the future (a sim.policy.Foresight), got {type(request).__name__}: "
                            f"it runs in the simulator only")
        return -request.remaining_chain_s


class GroupStragglers(Priority):
    """The conversation whose group peers are the most done first (ties: arrival)."""

    name = "group-stragglers"

    def key(self, request: RequestInfo) -> float:
        return -request.peers_done if isinstance(request, Foresight) else 0.0


class LeastGenerated(Priority):
    """Least attained service first: the session that has generated the fewest tokens."""

    name = "least-generated"

    def key(self, request: RequestInfo) -> float:
        return request.generated


POLICIES: dict[str, type[Priority]] = {**PRIORITIES, Oracle.name: Oracle}
"""Every ordering the simulator tries: the engine's priorities, then the oracle."""
GROUP_POLICIES: dict[str, type[Priority]] = {p.name: p for p in (GroupStragglers, LeastGenerated)}
"""Orderings from RL group statistics (lever d), tried by `benchmarks.policy_sim --levers`."""


def make_policy(name: str) -> Priority:
    """The ordering called `name`, or ValueError naming the known ones."""
    known = {**POLICIES, **GROUP_POLICIES}
    if name not in known:
        raise ValueError(f"unknown policy {name!r}; the simulator knows {list(known)}")
    return known[name]()
