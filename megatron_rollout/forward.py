"""The forward primitives that model, comm, multiplex and the runners share (docs/design.md §3, ground floor).

A forward that may cross ranks is a generator: it yields a `BoundaryPoint` right before each
collective, so a caller can run P's forward segment by segment (docs/design.md §6); `run_to_end` is
the plain forward. `Experts` is the protocol an expert exchange computes with: comm needs only
that shape, never the model's module. Kept below both model and comm so that neither imports the
other's internals; nothing here holds state or issues a collective.
"""
from __future__ import annotations

import enum
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class Site(enum.Enum):
    """Where in a layer a boundary sits."""

    ATTN_REDUCE = "attn_reduce"  # before attention's ATP all-reduce
    MLP_REDUCE = "mlp_reduce"  # before a dense MLP's ATP all-reduce
    MOE_EXCHANGE = "moe_exchange"  # before MoE's token exchange (count notify / full-group gather)
    MOE_DATA = "moe_data"  # split-phase dispatch: counts exchanged, data not yet submitted


@dataclass(frozen=True)
class BoundaryPoint:
    layer: int
    site: Site


Forward = Generator[BoundaryPoint, None, torch.Tensor]
"""A resumable forward: yields at every safe boundary, returns its result (e.g. logits)."""


def run_to_end(gen: Forward) -> torch.Tensor:
    """Drive a forward generator through all its boundaries; return its result."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


class Experts(Protocol):
    """This rank's routed experts, as an expert exchange uses them (`model.layers.Experts` is one).

    `local_experts[K]` is global expert `first + K`; each is a callable MLP `[n, H] -> [n, H]`."""

    num_local: int
    first: int

    @property
    def local_experts(self) -> Sequence[torch.nn.Module]: ...

    def grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: [n, H] sorted by local expert, `counts[K]` rows for expert K. Returns [n, H]."""
        ...
