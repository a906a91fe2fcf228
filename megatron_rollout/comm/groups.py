"""Which ranks form ATP, ADP, EP and FULL, read from Megatron's `parallel_state` (docs/design.md §5).

The rollout never invents its own rank arithmetic: the trainer (or, when it has not, this module)
calls Megatron's `initialize_model_parallel(tensor_model_parallel_size=ATP,
expert_model_parallel_size=EP, expert_tensor_parallel_size=1)`, and the rank lists of every axis
are read back from Megatron's process groups. Every rank then learns *every* group of each axis
(one all-gather), so that later `new_group` calls can be issued for all groups in one order on
all ranks, which `torch.distributed.new_group` requires.

Left out: pipeline and context parallelism (the rollout runs PP = CP = 1 and refuses anything
else), expert tensor parallelism (ETP = 1, so EP spans every rank and equals the full group), and
creating communicators (that is `dist.DistComm`'s job; this module only says who is in which group).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from megatron_rollout.types import Axis

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelLayout:
    """How the rollout splits one model over the world: ATP x ADP ranks, experts over all of them."""

    atp: int
    """Attention tensor parallel size: heads split over this many ranks (Megatron TP)."""
    adp: int
    """Attention data parallel size: independent attention replicas (Megatron DP)."""
    ep: int
    """Expert parallel size; with ETP = 1 it must equal atp * adp (every rank holds experts)."""

    def __post_init__(self) -> None:
        for name in ("atp", "adp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelLayout.{name} must be a positive int, got {value!r}")
        if self.ep != self.atp * self.adp:
            raise ValueError(f"ParallelLayout: EP ({self.ep}) must equal ATP x ADP ({self.atp} x {self.adp} = "
                             f"{self.atp * self.adp}); expert tensor parallelism (ETP > 1) is not supported")

    @property
    def world_size(self) -> int:
        return self.atp * self.adp


@dataclass(frozen=True)
class AxisGroups:
    """Every group of one axis (each a sorted rank tuple, the list sorted), and this rank's."""

    groups: tuple[tuple[int, ...], ...]
    mine: int
    """Index into `groups` of the group holding this rank."""

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.groups[self.mine]


@dataclass(frozen=True)
class ParallelGroups:
    """Rank lists per axis, identical on every rank except for `rank` and each axis's `mine`."""

    layout: ParallelLayout
    rank: int
    """This process's global rank."""
    axes: Mapping[Axis, AxisGroups]
    owns_parallel_state: bool
    """True when `init_parallel` initialised Megatron's parallel_state (and may destroy it)."""

    def ranks(self, axis: Axis) -> tuple[int, ...]:
        return self.axes[axis].ranks

    def size(self, axis: Axis) -> int:
        return len(self.ranks(axis))

    def rank_in(self, axis: Axis) -> int:
        """This rank's position in its group of `axis` (its group rank: groups are sorted)."""
        return self.ranks(axis).index(self.rank)


def _megatron_sizes(ps) -> dict[str, int]:
    return {"TP": ps.get_tensor_model_parallel_world_size(), "DP": ps.get_data_parallel_world_size(),
            "EP": ps.get_expert_model_parallel_world_size(), "ETP": ps.get_expert_tensor_parallel_world_size(),
            "PP": ps.get_pipeline_model_parallel_world_size(), "CP": ps.get_context_parallel_world_size()}


def _check_megatron_matches(ps, layout: ParallelLayout) -> None:
    have = _megatron_sizes(ps)
    want = {"TP": layout.atp, "DP": layout.adp, "EP": layout.ep, "ETP": 1, "PP": 1, "CP": 1}
    if have != want:
        got = ", ".join(f"{k}={v}" for k, v in have.items())
        asked = ", ".join(f"{k}={v}" for k, v in want.items())
        raise ValueError(f"Megatron parallel_state is already initialised with {got}, but the rollout layout "
                         f"needs {asked} (ATP={layout.atp}, ADP={layout.adp}, EP={layout.ep}). Initialise the "
                         f"trainer with these sizes, or pass a ParallelLayout that matches the trainer's.")


def init_parallel(layout: ParallelLayout, gather_group: dist.ProcessGroup | None = None,
                  timeout_s: float = 60.0) -> ParallelGroups:
    """Initialise (or read and check) Megatron's parallel_state; return every axis's rank lists.

    Collective over the world: every rank must call it. `gather_group` carries the rank-list
    all-gather (a CPU gloo group; default: the world group)."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_process_group (torchrun does it "
                           "through the trainer) before building the rollout's communicators")
    world = dist.get_world_size()
    if world != layout.world_size:
        raise ValueError(f"world size is {world} but layout ATP={layout.atp} x ADP={layout.adp} needs "
                         f"{layout.world_size} ranks")
    owns = not ps.model_parallel_is_initialized()
    if owns:
        ps.initialize_model_parallel(tensor_model_parallel_size=layout.atp, expert_model_parallel_size=layout.ep,
                                     expert_tensor_parallel_size=1,
                                     distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)))
        logger.info("initialised Megatron parallel_state: TP=%d EP=%d ETP=1", layout.atp, layout.ep)
    else:
        _check_megatron_matches(ps, layout)

    ranks = dist.get_process_group_ranks
    local = {Axis.ATP: tuple(sorted(ranks(ps.get_tensor_model_parallel_group()))),
             Axis.ADP: tuple(sorted(ranks(ps.get_data_parallel_group()))),
             Axis.EP: tuple(sorted(ranks(ps.get_expert_model_parallel_group()))),
             Axis.FULL: tuple(range(world))}
    gathered: list[dict[Axis, tuple[int, ...]] | None] = [None] * world
    dist.all_gather_object(gathered, local, group=gather_group)

    me = dist.get_rank()
    axes = {}
    for axis in Axis:
        groups = tuple(sorted({g[axis] for g in gathered}))  # type: ignore[index]
        _check_partition(axis, groups, world)
        axes[axis] = AxisGroups(groups, groups.index(local[axis]))
    want = {Axis.ATP: layout.atp, Axis.ADP: layout.adp, Axis.EP: layout.ep, Axis.FULL: world}
    for axis, size in want.items():
        if len(axes[axis].ranks) != size:
            raise ValueError(f"Megatron's {axis.value} group {axes[axis].ranks} has {len(axes[axis].ranks)} ranks, "
                             f"expected {size} for layout {layout}")
    _check_replicas(axes)
    return ParallelGroups(layout, me, axes, owns)


def _check_partition(axis: Axis, groups: tuple[tuple[int, ...], ...], world: int) -> None:
    """Each rank in exactly one group of the axis (else new_group calls would not line up)."""
    members = sorted(r for g in groups for r in g)
    if members != list(range(world)):
        raise ValueError(f"the {axis.value} groups {groups} do not partition ranks 0..{world - 1}: ranks "
                         f"disagree about Megatron's process groups")


def _check_replicas(axes: Mapping[Axis, AxisGroups]) -> None:
    """Position k of every ADP group must be in replica (ATP group) k: the exchanges line rows up
    by ADP rank across ATP ranks."""
    atp_of = {r: i for i, g in enumerate(axes[Axis.ATP].groups) for r in g}
    for group in axes[Axis.ADP].groups:
        replicas = [atp_of[r] for r in group]
        if replicas != list(range(len(group))):
            raise ValueError(f"ADP group {group} is not ordered by replica (ATP groups {axes[Axis.ATP].groups})")
