"""Where the rollout and the trainer live in the loop's processes, and how they talk.

Three placements, one interface (`Placement.create(atp, adp)`):
- one process: one engine, one trainer;
- data parallel (torchrun, ATP = ADP = 1): every rank a full engine and a full trainer replica;
- sharded rollout (torchrun, ATP x ADP = world): one engine sharded over all ranks through
  `megatron_rollout.distributed.Runtime` (ATP groups, ADP replicas, experts over EP = world),
  each replica's leader (ATP rank 0) driving its own episodes while its ATP peers mirror them,
  next to trainer replicas of the native, unsharded model on every rank. The trainer is laid out
  differently on purpose: `engine.update_weights` reshards its full tensors into the rollout's
  ATP/EP shards every step.

The trainer's collectives (gradient all-reduce, trajectory and metric gathers) go through one
`new_group` over all ranks made here, never through the rollout's communicators (which the engine
builds from Megatron's parallel_state): two users of one communicator would share its sequence.
Left out: trainers with their own TP/EP (see `rl.megatron_trainer`), and pipeline parallelism.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_rollout.engine import EngineConfig, RolloutEngine
from megatron_rollout.model.sharding import full_name, shard_tensor
from megatron_rollout.model.transformer import MoETransformer
from rl.rollout import Episode, RolloutConfig, RolloutResult, rollout

log = logging.getLogger(__name__)


class _Lockstep:
    """The engine as the rollout's pump sees it on a sharded rank: always stepping, because the
    step's state gather is a collective that the other replicas need."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine

    def open_session(self):
        return self.engine.open_session()

    def add_request(self, prompt_ids: list[int], params=None) -> int:
        return self.engine.add_request(prompt_ids, params)

    def abort(self, rid: int) -> None:
        self.engine.abort(rid)

    def has_work(self) -> bool:
        return True

    def step(self):
        outs = self.engine.step()
        view = getattr(self.engine, "last_view", None)
        if view is not None and view.phase is None and not view.epoch_in_flight:
            time.sleep(0.001)  # no rank has work (every episode is in a tool call): idle alike
        return outs


@dataclass(frozen=True)
class LocalRollout:
    """What one rank's rollout produced (nothing on an ATP peer, which only mirrors its leader)."""

    result: RolloutResult | None
    driver: bool
    """This rank drove episodes (a leader, or any rank when the engine is not sharded)."""


class Placement:
    def __init__(self, atp: int, adp: int, runtime: Any = None) -> None:
        self.atp, self.adp, self.runtime = atp, adp, runtime
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        # The trainer's own communicator, made in the same order on every rank (after the rollout's).
        self.group = dist.new_group(list(range(self.world)), backend="gloo") if self.distributed else None

    @classmethod
    def create(cls, atp: int = 1, adp: int = 1, timeout_s: float = 120.0) -> "Placement":
        """`timeout_s` bounds every cross-rank wait of the sharded rollout."""
        sharded = atp * adp > 1
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        cls.check_world(atp, adp, world)
        runtime = None
        if sharded:
            from megatron_rollout.distributed import Runtime

            runtime = Runtime.start(atp, adp, device="cpu", timeout_s=timeout_s)
        return cls(atp, adp, runtime)

    @staticmethod
    def check_world(atp: int, adp: int, world: int) -> None:
        """Raise ValueError unless `world` processes can hold a rollout sharded ATP x ADP."""
        if atp * adp > 1 and world != atp * adp:
            raise ValueError(f"a rollout sharded ATP {atp} x ADP {adp} needs {atp * adp} processes, got {world}: "
                             f"launch with torchrun --nproc_per_node {atp * adp}, or set atp = adp = 1 for "
                             f"data-parallel replicas")

    @property
    def sharded(self) -> bool:
        return self.runtime is not None

    @property
    def rollout_index(self) -> int:
        """Which share of the step's prompts this rank drives (its ADP replica, or its rank)."""
        return self.runtime.replica if self.sharded else self.rank

    @property
    def rollout_replicas(self) -> int:
        return self.runtime.replicas if self.sharded else self.world

    def make_engine(self, policy: MoETransformer, config: EngineConfig) -> RolloutEngine:
        """An engine holding this rank's shard of `policy`'s weights, in a model of its own."""
        if not self.sharded:
            model = MoETransformer(policy.cfg, device=policy.device)
            model.load_state_dict(policy.state_dict())
            return RolloutEngine(model, config)
        model = MoETransformer(policy.cfg, comm=self.runtime.comm)
        full, cfg, shard = policy.state_dict(), policy.cfg, self.runtime.comm.shard
        with torch.no_grad():
            for local, p in model.named_parameters():
                name = full_name(local, cfg, shard)
                p.copy_(shard_tensor(name, full[name], cfg, shard))
        return self.runtime.engine(model, config)

    def rollout(self, engine: RolloutEngine, episodes: list[Episode], cfg: RolloutConfig) -> LocalRollout:
        if not self.sharded:
            return LocalRollout(rollout(engine, episodes, cfg), True)
        lockstep = _Lockstep(engine)
        engine.done = False  # the last rollout's drain declared this rank done
        result = rollout(lockstep, episodes, cfg) if self.runtime.leader else None
        # Declare this rank done and step with the others until the gathered view says every rank
        # is. Step first, then look: the view left from the last rollout says "all done" already.
        engine.done = True
        while True:
            lockstep.step()
            view = engine.last_view
            if view.all_done and view.requests == 0 and not view.epoch_in_flight:
                break
        return LocalRollout(result, self.runtime.leader)

    def all_gather(self, obj: Any) -> list[Any]:
        """`obj` of every rank, in rank order, over the trainer's group."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
