"""Rank-shared planning: every rank plans every replica from the same gathered state.

Each step, every rank contributes its scheduler state over the CPU group; every rank then runs
the pure `plan_step` on each ADP replica's state and derives the same *global* decisions: which
phase the step's forwards run in, whether a `mux` epoch starts, the spans' inputs. Collectives
line up because every rank runs the same sequence of forwards in the same phases; a replica with
nothing to do runs a matched no-work forward (zero tokens through every collective).

The ATP ranks of one replica serve the same requests. Only the replica's *leader* (ATP rank 0)
takes submissions from a driver; it ships them as ops in the same gather and its ATP peers replay
them before planning, so their engines are exact mirrors. Each peer then checks that its state
equals the leader's, which is how every ATP rank confirms that it owns a request before it is
promoted (docs/design.md §7).

The same gather carries every rank's offer of a pending weight update (`weights.vote`), so
every rank decides an update from the same offers at the same step.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from megatron_rollout.engine.api import Schedule
from megatron_rollout.engine.scheduler import SchedulerConfig, SchedulerState, StepPlan, plan_step
from megatron_rollout.types import Axis, Phase
from megatron_rollout.weights.vote import WeightOffer


@dataclass(frozen=True)
class GlobalView:
    """What every rank agrees on for one step."""

    phase: Phase | None
    """Phase of a plain (`off`/`chunked`) step's single forward; None when nothing runs anywhere."""
    any_decode: bool
    any_prefill: bool
    max_decode_rows: int
    """Largest decode batch of any replica (the rows that wait on P)."""
    prefill_tokens: int
    """Prefill tokens admitted this step over all replicas."""
    requests: int = 0
    """Requests in flight on all replicas."""
    epoch_in_flight: bool = False
    """A `mux` prefill epoch is running (on every rank alike)."""
    all_done: bool = False
    """Every rank has said it will submit nothing more (distributed drivers stop stepping)."""
    offers: tuple = ()
    """Per global rank, its `weights.vote.WeightOffer` for an update in progress, or None."""


class ReplicaReport(NamedTuple):
    """What one rank contributes to a step's gather. Only a replica's leader sends ops and state."""

    replica: int
    ops: list
    """The leader's submissions since the last step (`bookkeeping.Op` records), for its ATP peers."""
    state: SchedulerState | None
    done: bool
    """This rank's driver will submit nothing more."""
    offer: WeightOffer | None = None
    """This rank's side of a weight update in progress (`weights.vote`)."""


def _view(plans: list[StepPlan], states: list[SchedulerState], all_done: bool = False, offers: tuple = ()
          ) -> GlobalView:
    any_prefill = any(p.prefill for p in plans)
    any_decode = any(p.decode for p in plans)
    phase = Phase.P if any_prefill else Phase.D if any_decode else None
    return GlobalView(phase, any_decode, any_prefill, max((len(p.decode) for p in plans), default=0),
                      sum(c.tokens for p in plans for c in p.prefill), sum(len(s.seqs) for s in states),
                      any(s.epoch_in_flight for s in states), all_done, offers)


def _align(plan: StepPlan, view: GlobalView, schedule: Schedule) -> StepPlan:
    """`off`: while any replica prefills, no replica decodes (its P forward may be empty)."""
    if schedule is Schedule.OFF and view.any_prefill:
        return StepPlan(decode=(), prefill=plan.prefill, preempt=plan.preempt)
    return plan


class LocalCoordinator:
    """One replica: the plan is the local plan."""

    leader = True

    def plan(self, state_fn: Callable[[], SchedulerState], cfg: SchedulerConfig, step: int, ops: list,
             apply_ops: Callable[[list], None], done: bool = False, offer: WeightOffer | None = None
             ) -> tuple[StepPlan, GlobalView]:
        state = state_fn()
        plan = plan_step(state, cfg)
        return plan, _view([plan], [state], done, (offer,))


class RankSharedCoordinator:
    """All ranks gather their states over the CPU group and plan every replica identically."""

    def __init__(self, comm) -> None:
        self.comm = comm
        self.replica = comm.rank(Axis.ADP)
        self.atp_rank = comm.rank(Axis.ATP)
        self.leader = self.atp_rank == 0
        self.timeout_s: float = comm.config.timeout_s
        """How long a rank waits for its peers (here: for their side of a weight update)."""

    def plan(self, state_fn: Callable[[], SchedulerState], cfg: SchedulerConfig, step: int, ops: list,
             apply_ops: Callable[[list], None], done: bool = False, offer: WeightOffer | None = None
             ) -> tuple[StepPlan, GlobalView]:
        mine = ReplicaReport(self.replica, ops, state_fn(), done, offer) if self.leader else \
            ReplicaReport(self.replica, [], None, done, offer)
        entries: list[ReplicaReport] = self.comm.all_gather_object(mine, context=f"step {step}")
        leaders = {e.replica: (e.ops, e.state) for e in entries if e.state is not None}
        if not self.leader:
            leader_ops, leader_state = leaders[self.replica]
            apply_ops(leader_ops)
            own = state_fn()
            if own != leader_state:
                raise RuntimeError(f"step {step}: ATP rank {self.atp_rank} of replica {self.replica} does not own "
                                   f"the requests its leader plans ({own} != {leader_state})")
        plans = {r: plan_step(st, cfg) for r, (_, st) in sorted(leaders.items())}
        view = _view(list(plans.values()), [st for _, st in leaders.values()], all(e.done for e in entries),
                     tuple(e.offer for e in entries))
        return _align(plans[self.replica], view, cfg.schedule), view
