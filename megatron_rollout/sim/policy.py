"""Orderings the simulator can try: which waiting or running request the planner serves first.

The engine's planner (`engine.scheduler.plan_step`) serves requests by their `order` (smaller
first: decode rows, admission, and, reversed, preemption victims). A policy gives each request a
key; the simulator ranks the keys into that order each step. `Fifo` is the engine's own (arrival
order); `Oracle` knows every conversation's future turns and serves the longest remaining chain
first (the critical path first), which no real engine can: it is the yardstick a policy without
that knowledge is compared to.

Left out: the engine side (a policy proven here is wired into the scheduler separately).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestInfo:
    """What a policy may look at for one request (the oracle also reads `remaining_chain_s`)."""

    arrival_order: int
    """Submission order over the whole simulation (the engine's own order)."""
    turn: int
    """Position in its conversation (0-based)."""
    context: int
    """Tokens of its conversation's context, its new input included."""
    attained_s: float
    """Modelled engine time its conversation has received so far (its earlier turns at batch 1)."""
    remaining_chain_s: float
    """Future knowledge: this turn and every later turn of its conversation (tool waits, prefill and
    decode at batch 1). Only an oracle may read it."""


class Policy(abc.ABC):
    name: str = ""

    @abc.abstractmethod
    def key(self, request: RequestInfo) -> float:
        """Smaller keys are served first."""


class Fifo(Policy):
    """The engine's ordering: oldest submission first."""

    name = "fifo"

    def key(self, request: RequestInfo) -> float:
        return request.arrival_order


class Oracle(Policy):
    """Longest remaining chain first, knowing each conversation's future."""

    name = "oracle"

    def key(self, request: RequestInfo) -> float:
        return -request.remaining_chain_s


class MostAttained(Policy):
    """The conversation that has received the most engine time first: where turn counts have a
    heavy tail, one that has run long is likely to run longer (no future knowledge)."""

    name = "most-attained"

    def key(self, request: RequestInfo) -> float:
        return -request.attained_s


class MostTurns(Policy):
    """The conversation with the most turns behind it first."""

    name = "most-turns"

    def key(self, request: RequestInfo) -> float:
        return -request.turn


class LongestContext(Policy):
    """The longest context first: its turns cost the most attention per token."""

    name = "longest-context"

    def key(self, request: RequestInfo) -> float:
        return -request.context


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Fifo, Oracle, MostAttained, MostTurns, LongestContext)}
