"""Which request the planner serves first: priorities for the critical path (docs/design.md §11).

An RL step waits for its slowest trajectory, so a rollout ends when its longest chain of turns
ends. The planner (`scheduler.plan_step`) serves requests by their `SeqView.order`, smallest
first: which decode rows run when there are more than a step holds, which waiting prefills are
admitted, and, from the other end, which requests are preempted under KV pressure. A `Priority`
gives each request a key when it is submitted; the request table ranks the keys into `order`
(ties: arrival). `fifo`, the arrival order, is the engine's historical behaviour.

The other priorities guess which trajectories will finish last from what the engine has already
seen, never from the future: the turn a request is in, its context, the tokens its session has
generated so far. Where turn counts have a heavy tail, a conversation that has run long is likely
to run longer, so serving it first shortens the tail (the simulator, `sim.policy`, tries each on a
trace; `benchmarks.policy_sim` reports which wins). A key is fixed at submission from numbers
every rank of a replica holds alike (its peers replay the same submissions), so ranks plan alike.

A priority changes who goes first, never what a request computes: its tokens depend only on its
own context (the forward is batch-invariant), so greedy tokens do not change with it.

Left out: wall-clock service (not the same on every rank), the future (`sim.policy.Oracle`), and
RL group statistics (the engine does not know which requests form a group).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestInfo:
    """What a priority may look at for one request, as it was when it was submitted."""

    arrival_order: int
    """Submission order (smaller is older)."""
    turn: int
    """Requests its session ran before this one (0: a one-shot request, or a session's first turn)."""
    context: int
    """Tokens of its context, its new input included."""
    generated: int
    """Tokens its session generated in its earlier turns."""


class Priority(abc.ABC):
    """A request's key: smaller keys are served first (ties by arrival)."""

    name: str = ""

    @abc.abstractmethod
    def key(self, request: RequestInfo) -> float:
        """The request's key (called once, at submission)."""


class Fifo(Priority):
    """Oldest submission first: the engine's default."""

    name = "fifo"

    def key(self, request: RequestInfo) -> float:
        return request.arrival_order


class MostTurns(Priority):
    """The conversation with the most turns behind it first (its expected remaining chain is the
    longest where turn counts have a decreasing hazard, as agentic traces do)."""

    name = "most-turns"

    def key(self, request: RequestInfo) -> float:
        return -request.turn


class LongestContext(Priority):
    """The longest context first: its turns cost the most per token, and it has come furthest."""

    name = "longest-context"

    def key(self, request: RequestInfo) -> float:
        return -request.context


class MostGenerated(Priority):
    """The session that has generated the most first: least-attained service inverted, with
    service counted in decode tokens (the part of a turn that runs at a step per token)."""

    name = "most-generated"

    def key(self, request: RequestInfo) -> float:
        return -request.generated


PRIORITIES: dict[str, type[Priority]] = {p.name: p for p in (Fifo, MostTurns, LongestContext, MostGenerated)}
"""The engine's priorities by name (`SchedulerConfig.priority`)."""


def make_priority(name: str) -> Priority:
    """The priority called `name`, or ValueError naming the known ones."""
    if name not in PRIORITIES:
        raise ValueError(f"SchedulerConfig.priority must be one of {sorted(PRIORITIES)}, got {name!r}")
    return PRIORITIES[name]()
