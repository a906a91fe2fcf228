"""Selective device ordering: which P collective runs on D's route (docs/design.md §6 step 3).

In crossed topologies (ATP > 1 and ADP > 1) D's DP-attention all-gather over ADP and P's
full-group all-reduce involve intersecting rank sets. The turnstile makes every rank enqueue D's
iteration at the same point of P; this module makes the *device* keep that order on each rank:
the registered conflicting P collective is enqueued on the D stream right after the D iteration
(D→P order locally), and an event makes the P stream wait for it. Every other collective keeps
its own phase's route, so unrelated P work still overlaps with D.

`Router.run(route, fn)` executes a collective on its route:
- GPU (`PhaseStreams` given, the runner's own: `bind_streams`): a collective runs on its route's
  stream after an event recorded on the stream that produced its input (the stream current when
  it was issued, which the CUDA runner makes the phase's own); if that is another stream, the
  producer waits for the collective's completion event before going on. So an unrouted
  collective issued on its phase's stream runs right there, and the routed P collective runs on
  the D stream after this round's D iteration and after P's producing kernels, with P's stream
  waiting on its completion (docs/design.md §6 rule 3). Tensors crossing streams are recorded on the
  consuming stream so the caching allocator does not reuse them early.
- CPU (no streams): routes are labels and execution is program order; the ordering still holds
  because the caller (the turnstile, or the in-order device model in `inorder.py`) enqueues in
  the right host order.

A routed P collective must be issued inside a turnstile window (after this round's D iteration,
before the next round's); `Router.run` enforces that unless `require_window=False`.

`CollectiveSite` (what a collective is: operation and axis) belongs to comm, which issues them;
this module decides where they run. `Router` implements comm's `CollectiveRouter` protocol.

Deliberately left out: which ranks form a group (comm's business) and when windows open (the
turnstile's). The registry is explicit rather than inferred from rank sets: a conflict is a
property of the phase paths chosen for a topology, and registering it is a deliberate decision.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

import torch

from megatron_rollout.comm.facade import COLLECTIVE_OPS as OPS  # noqa: F401 (re-exported)
from megatron_rollout.comm.facade import CollectiveSite
from megatron_rollout.forward import Site
from megatron_rollout.types import Axis, Phase

logger = logging.getLogger(__name__)

T = TypeVar("T")

class RoutingError(RuntimeError):
    """A routed collective issued where its order against D is not guaranteed."""


@dataclass(frozen=True)
class Conflict:
    """P's `p_site` and D's `d_site` run on intersecting groups and must not be reordered."""

    p_site: CollectiveSite
    d_site: CollectiveSite
    why: str = ""


P_FULL_ALL_REDUCE = CollectiveSite("all_reduce", Axis.FULL)
D_ADP_ALL_GATHER = CollectiveSite("all_gather", Axis.ADP)


class ConflictRegistry:
    """The registered (P collective, D path) pairs."""

    def __init__(self, conflicts: Iterable[Conflict] = ()) -> None:
        self._by_p: dict[CollectiveSite, list[Conflict]] = {}
        for c in conflicts:
            self.register(c.p_site, c.d_site, c.why)

    @classmethod
    def for_topology(cls, atp_size: int, adp_size: int) -> "ConflictRegistry":
        """docs/design.md §5's default paths: the pair crosses only when both axes exceed 1."""
        if atp_size < 1 or adp_size < 1:
            raise ValueError(f"bad topology ATP{atp_size}/ADP{adp_size}")
        reg = cls()
        if atp_size > 1 and adp_size > 1:
            reg.register(P_FULL_ALL_REDUCE, D_ADP_ALL_GATHER,
                         f"ATP{atp_size}/ADP{adp_size}: D's ADP all-gather and P's full-group all-reduce "
                         f"share ranks in crossed groups")
        return reg

    def register(self, p_site: CollectiveSite, d_site: CollectiveSite, why: str = "") -> None:
        pairs = self._by_p.setdefault(p_site, [])
        if any(c.d_site == d_site for c in pairs):
            raise ValueError(f"conflict ({p_site} of P, {d_site} of D) is already registered")
        pairs.append(Conflict(p_site, d_site, why))

    def conflicts_of(self, p_site: CollectiveSite) -> tuple[Conflict, ...]:
        return tuple(self._by_p.get(p_site, ()))

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_p.values())


# -- the registry derived from the layout and the phases' real paths ------------------------------
# (`derive_conflicts`; `ConflictRegistry.for_topology` above is docs/design.md §5's hand-written default.)

EXCHANGE_PATHS: dict[str, dict[Site, tuple[CollectiveSite, ...]]] = {
    # comm.allgather: ADP all-gathers (counts, rows, routing), then the FULL all-reduce.
    "allgather": {Site.MOE_EXCHANGE: (CollectiveSite("all_gather", Axis.ADP),),
                  Site.MOE_DATA: (CollectiveSite("all_reduce", Axis.FULL),)},
    # comm.alltoall: the domain's count notify, then dispatch and combine on the domain's EP
    # communicator, then the ATP all-gather of the replica's rows.
    "alltoall": {Site.MOE_EXCHANGE: (CollectiveSite("all_to_all", Axis.EP),),
                 Site.MOE_DATA: (CollectiveSite("all_to_all", Axis.EP), CollectiveSite("all_gather", Axis.ATP))},
}
"""The collectives an MoE layer's expert exchange issues after each of its boundaries, by
`CommConfig.p_exchange` / `d_exchange` kind (tests/multiplex/test_conflicts.py records them)."""


def phase_path(exchange: str) -> dict[Site, tuple[CollectiveSite, ...]]:
    """The collectives a phase issues right after each boundary site (the model yields right
    before each), for a phase whose expert exchange is `exchange`. Axes of one rank issue nothing."""
    if exchange not in EXCHANGE_PATHS:
        raise ValueError(f"unknown expert exchange {exchange!r}; known: {sorted(EXCHANGE_PATHS)}")
    dense = CollectiveSite("all_reduce", Axis.ATP)
    return {Site.ATTN_REDUCE: (dense,), Site.MLP_REDUCE: (dense,), **EXCHANGE_PATHS[exchange]}


def megatron_groups(atp: int, adp: int) -> dict[Axis, tuple[tuple[int, ...], ...]]:
    """Every group of every axis as Megatron lays out TP=`atp`, DP=`adp` (comm.groups reads the
    same from parallel_state): ATP groups contiguous, ADP strided, EP and FULL every rank."""
    if atp < 1 or adp < 1:
        raise ValueError(f"bad topology ATP{atp}/ADP{adp}")
    world = tuple(range(atp * adp))
    return {Axis.ATP: tuple(world[i * atp:(i + 1) * atp] for i in range(adp)),
            Axis.ADP: tuple(world[j::atp] for j in range(atp)), Axis.EP: (world,), Axis.FULL: (world,)}


def derive_conflicts(groups: Mapping[Axis, Sequence[Sequence[int]]], p_sites: Iterable[CollectiveSite],
                     d_sites: Iterable[CollectiveSite]) -> ConflictRegistry:
    """The (P collective, D collective) pairs that can close a cycle, from the rank sets they run on.

    A pair conflicts when, on some rank, the two groups are different rank sets that share two
    ranks of different ATP groups (different ADP replicas). Why those: the ranks of one replica
    are mirrors (same plan, same host decisions), so they never enqueue P and D in opposite
    orders; collectives over one rank set are ordered alike by all its members; what nothing
    orders is a P and a D collective over *crossed* groups, and two replicas that enqueue such a
    pair in opposite orders wait for each other forever (the derivation is in multiplex.inorder).
    `p_sites` / `d_sites`: the collectives each phase really issues (`phase_path(...).values()`)."""
    sets = {axis: [frozenset(g) for g in gs] for axis, gs in groups.items()}
    replica = {r: i for i, g in enumerate(sets[Axis.ATP]) for r in g}
    world = sorted(replica)

    def group_of(axis: Axis, rank: int) -> frozenset:
        return next((g for g in sets[axis] if rank in g), frozenset((rank,)))

    reg = ConflictRegistry()
    p_sites, d_sites = list(dict.fromkeys(p_sites)), list(dict.fromkeys(d_sites))
    for p in p_sites:
        for d in d_sites:
            for r in world:
                gp, gd = group_of(p.axis, r), group_of(d.axis, r)
                if gp != gd and len({replica[x] for x in gp & gd}) > 1:
                    shared = sorted(gp & gd)
                    reg.register(p, d, f"P's {p} over {sorted(gp)} and D's {d} over {sorted(gd)} share ranks "
                                       f"{shared} of different replicas")
                    break
    return reg


def derive_for_exchanges(atp: int, adp: int, p_exchange: str, d_exchange: str) -> ConflictRegistry:
    """`derive_conflicts` for Megatron's layout and the phases' configured expert exchanges."""
    paths = [[site for sites in phase_path(kind).values() for site in sites] for kind in (p_exchange, d_exchange)]
    return derive_conflicts(megatron_groups(atp, adp), *paths)


@dataclass(frozen=True)
class Route:
    """Where a collective of `phase` at `site` executes: on `stream`'s route."""

    phase: Phase
    site: CollectiveSite
    stream: Phase

    @property
    def routed(self) -> bool:
        """A P collective moved onto D's route."""
        return self.phase is Phase.P and self.stream is Phase.D

    @property
    def label(self) -> str:
        return f"{self.phase.value}:{self.site}@{self.stream.value}"


@dataclass(frozen=True)
class PhaseStreams:
    """The two CUDA streams of a rank (owned by the runner; the router only borrows them)."""

    p: Any  # torch.cuda.Stream
    d: Any  # torch.cuda.Stream

    @classmethod
    def create(cls, device: torch.device | str | int | None = None) -> "PhaseStreams":
        if not torch.cuda.is_available():
            raise RuntimeError("PhaseStreams need CUDA; on CPU give the Router no streams")
        return cls(torch.cuda.Stream(device), torch.cuda.Stream(device))

    def of(self, phase: Phase) -> Any:
        return self.p if phase is Phase.P else self.d


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class Router:
    """Decides and executes routes. One per rank; called from the host driver thread only.

    `streams` are borrowed from the runner that runs the phases (`bind_streams`): a router whose
    streams are not the ones the forwards run on would order nothing."""

    def __init__(self, registry: ConflictRegistry | None = None, streams: PhaseStreams | None = None,
                 require_window: bool = True) -> None:
        self.registry = registry or ConflictRegistry()
        self.streams = streams
        self.require_window = require_window
        self._window: tuple[int, int] | None = None  # (epoch, round) while routed P may be issued
        self.routed_count = 0  # routed P collectives issued so far (for records and tests)

    def bind_streams(self, streams: PhaseStreams | None) -> None:
        """Use the runner's phase streams (the CUDA runner calls this with its P and D streams)."""
        self.streams = streams

    def route(self, phase: Phase, site: CollectiveSite) -> Route:
        if phase is Phase.P and self.registry.conflicts_of(site):
            return Route(phase, site, Phase.D)
        return Route(phase, site, phase)

    # -- turnstile windows ------------------------------------------------------------------
    def open_window(self, epoch: int, round_: int) -> None:
        """This round's D iteration is enqueued: routed P collectives may follow it."""
        self._window = (epoch, round_)

    def close_window(self) -> None:
        self._window = None

    @property
    def window(self) -> tuple[int, int] | None:
        return self._window

    # -- execution ----------------------------------------------------------------------------
    def run(self, route: Route, fn: Callable[[], T], inputs: Iterable[torch.Tensor] = ()) -> T:
        """Run `fn` (which issues one collective) on `route`; `inputs` are the tensors it reads."""
        if route.routed:
            if self._window is None and self.require_window:
                d_sites = ", ".join(str(c.d_site) for c in self.registry.conflicts_of(route.site))
                raise RoutingError(f"{route.label} issued outside a turnstile round: it would not be "
                                   f"ordered after D's {d_sites} "
                                   f"on every rank; run P through Turnstile.run_epoch or use an empty registry "
                                   f"when multiplexing is off")
            self.routed_count += 1
        if self.streams is None:
            return fn()
        return self._run_cuda(route, fn, list(inputs))

    def _run_cuda(self, route: Route, fn: Callable[[], T], inputs: list[torch.Tensor]) -> T:
        producer = torch.cuda.current_stream()  # where the collective's input was produced
        target = self.streams.of(route.stream)
        if target == producer:
            return fn()
        ready = torch.cuda.Event()
        ready.record(producer)
        target.wait_event(ready)
        with torch.cuda.stream(target):
            out = fn()
        for t in inputs:
            t.record_stream(target)
        done = torch.cuda.Event()
        done.record(target)
        producer.wait_event(done)  # the issuing phase continues only after the collective
        for t in _tensors(out):
            t.record_stream(producer)
        return out
