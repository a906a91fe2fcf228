"""The comm facade: the only code that issues collectives (docs/design.md §3, §5).

Every collective names an axis and a phase. The model never sees a process group; it calls
`comm.all_reduce(x, Axis.ATP, Phase.P)` and the facade picks the communicator that phase owns on
that axis. `LocalComm` is the single-process facade: every axis has one rank and every
collective is the identity, so the same model code runs unchanged on one process.
`CollectiveSite` names a kind of collective (operation, axis); a `CollectiveRouter` decides the
stream it runs on (implemented by `multiplex.routing.Router` for the `mux` schedule).
"""
from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from megatron_rollout.comm.exchange import ExpertExchange, LocalExchange
from megatron_rollout.types import Axis, Phase

T = TypeVar("T")

COLLECTIVE_OPS = ("all_reduce", "all_gather", "all_to_all")


@dataclass(frozen=True)
class CollectiveSite:
    """A kind of collective as the comm facade issues it: operation and axis."""

    op: str
    axis: Axis

    def __post_init__(self) -> None:
        if self.op not in COLLECTIVE_OPS:
            raise ValueError(f"unknown collective op {self.op!r}; known: {COLLECTIVE_OPS}")

    def __str__(self) -> str:
        return f"{self.op}/{self.axis.value}"


class CollectiveRouter(Protocol):
    """Where a collective runs (`multiplex.routing.Router` is the implementation): comm asks for a
    route for (phase, site) and runs the collective's closure on it."""

    def route(self, phase: Phase, site: CollectiveSite) -> Any: ...

    def run(self, route: Any, fn: Callable[[], T], inputs: Iterable[torch.Tensor] = ()) -> T: ...


@dataclass(frozen=True)
class Shard:
    """Which slice of the model this rank holds."""

    atp_rank: int = 0
    atp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    def __post_init__(self) -> None:
        for rank, size, name in ((self.atp_rank, self.atp_size, "atp"), (self.ep_rank, self.ep_size, "ep")):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"bad {name} shard: rank {rank} of {size}")


class Comm(abc.ABC):
    """Collectives by (axis, phase). Implementations: `LocalComm`, `DistComm`."""

    config = None
    """The `dist.CommConfig` the communicators were built from; None where there are none (one
    process)."""

    @abc.abstractmethod
    def size(self, axis: Axis) -> int: ...

    @abc.abstractmethod
    def rank(self, axis: Axis) -> int: ...

    @abc.abstractmethod
    def all_reduce(self, x: torch.Tensor, axis: Axis, phase: Phase) -> torch.Tensor:
        """Sum of `x` over the axis (returns a tensor; may reuse `x`)."""

    @abc.abstractmethod
    def all_gather(self, x: torch.Tensor, axis: Axis, phase: Phase) -> list[torch.Tensor]:
        """`x` from every rank of the axis, in rank order; first dims may differ between ranks."""

    def all_gather_into(self, x: torch.Tensor, axis: Axis, phase: Phase) -> torch.Tensor:
        """`x` from every rank of the axis, stacked: [size, *x.shape]; every rank passes the same shape
        (so an implementation needs no count exchange: `DistComm` reads nothing back)."""
        return torch.stack(self.all_gather(x, axis, phase))

    @abc.abstractmethod
    def all_to_all(self, chunks: list[torch.Tensor], axis: Axis, phase: Phase) -> list[torch.Tensor]:
        """Send `chunks[r]` to rank r of the axis; return what each rank sent here.

        Chunks may have different first dims; trailing dims and dtype must agree."""

    @abc.abstractmethod
    def exchange(self, phase: Phase) -> "ExpertExchange":
        """The expert exchange (dispatch domain) that `phase` owns."""

    def all_gather_object(self, obj: object, context: str = "") -> list:
        """A picklable `obj` from every rank of the full group, in rank order (CPU rendezvous; raises
        on a timeout, naming the ranks that did not arrive and `context`)."""
        raise NotImplementedError(f"{type(self).__name__} has no all_gather_object")

    @property
    def shard(self) -> Shard:
        return Shard(self.rank(Axis.ATP), self.size(Axis.ATP), self.rank(Axis.EP), self.size(Axis.EP))


class LocalComm(Comm):
    """One process: every axis has one rank."""

    def __init__(self) -> None:
        self._exchange = LocalExchange()

    def exchange(self, phase: Phase) -> ExpertExchange:
        return self._exchange

    def size(self, axis: Axis) -> int:
        return 1

    def rank(self, axis: Axis) -> int:
        return 0

    def all_reduce(self, x: torch.Tensor, axis: Axis, phase: Phase) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, axis: Axis, phase: Phase) -> list[torch.Tensor]:
        return [x]

    def all_gather_object(self, obj: object, context: str = "") -> list:
        return [obj]

    def all_to_all(self, chunks: list[torch.Tensor], axis: Axis, phase: Phase) -> list[torch.Tensor]:
        if len(chunks) != 1:
            raise ValueError(f"all_to_all on one rank takes 1 chunk, got {len(chunks)}")
        return list(chunks)
