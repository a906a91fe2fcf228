"""A rollout over several processes: start-up, lockstep drivers, and gathering results.

Every rank steps its engine the same number of times: each step's state gather (the rank-shared
plan) is a collective, so a rank may only stop when the gathered view says every rank is done and
no request or epoch is left anywhere. Submissions go to each replica's leader (ATP rank 0); its
ATP peers mirror them through the step gather (see `engine.coordinator`). Prompts and trace
conversations are spread over the ADP replicas round-robin.

Left out: pipeline parallelism, and clocks across nodes (replay times are aligned through each
rank's wall-clock offset, which assumes synchronised host clocks between nodes).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_rollout.comm.dist import CommConfig
from megatron_rollout.engine import EngineConfig, GenerationResult, RequestError, RolloutEngine, SamplingParams
from megatron_rollout.engine.api import FinishReason, Schedule
from megatron_rollout.engine.coordinator import RankSharedCoordinator
from megatron_rollout.engine.records import wall_minus_perf
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.types import Axis

log = logging.getLogger(__name__)


class ReplayShare(NamedTuple):
    """One replica leader's part of a distributed replay, gathered at rank 0."""

    outputs: list
    """RequestOutputs, times on this rank's perf_counter clock."""
    details: dict
    """`trace.replay.replay`'s details (conversation_of, start, skipped, refused)."""
    clock_offset: float
    """time.time() - time.perf_counter() on this rank."""
    decode_wait_s: float
    decode_waits: int


def _finished(engine: RolloutEngine) -> bool:
    view = engine.last_view
    return view is not None and view.all_done and view.requests == 0 and not view.epoch_in_flight


class _Lockstep:
    """The engine as a replay driver sees it, on a rank that must keep stepping for its peers."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine, self.stats = engine, engine.stats

    def open_session(self):
        return self.engine.open_session()

    def has_work(self) -> bool:
        return True  # other replicas may need this rank's collectives

    def step(self):
        outs = self.engine.step()
        view = self.engine.last_view
        if view is not None and view.phase is None and not view.epoch_in_flight:
            time.sleep(0.001)  # nobody has work: every rank idles the same way
        return outs


class _Counted(_Lockstep):
    """A replica leader's lockstep driver that adds the requests it finishes to a counter in the
    process group's store, so that rank 0's bar (`bar`, None on other ranks) counts every
    replica's requests, not its own share."""

    READ_EVERY_S = 0.5  # rank 0 reads the counter at most this often: a store round trip, not every step

    def __init__(self, engine: RolloutEngine, key: str, bar=None) -> None:
        super().__init__(engine)
        self.key, self.bar = key, bar
        self._store = dist.distributed_c10d._get_default_store()
        self._read_at = 0.0

    def step(self):
        outs = super().step()
        if outs:
            self._store.add(self.key, len(outs))
        if time.monotonic() - self._read_at >= self.READ_EVERY_S:
            self.refresh()
        return outs

    def refresh(self) -> None:
        """Show every replica's finished requests so far on the bar (rank 0; a no-op elsewhere)."""
        if self.bar is not None:
            self._read_at = time.monotonic()
            self.bar.update(self._store.add(self.key, 0) - self.bar.n)


class Runtime:
    def __init__(self, comm, device: torch.device, timeout_s: float) -> None:
        self.comm, self.device, self.timeout_s = comm, device, timeout_s
        self.rank = dist.get_rank()
        self.replica, self.replicas = comm.rank(Axis.ADP), comm.size(Axis.ADP)
        self.leader = comm.rank(Axis.ATP) == 0
        self._engines = 0
        self._replays = 0  # each replay's progress counter has its own store key

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def start(cls, atp: int, adp: int, device: str = "cpu", timeout_s: float = 120.0,
              comm: CommConfig | None = None) -> "Runtime":
        """Join (or reuse) the process group torchrun set up, and build the rollout's groups. `comm`
        (`EngineConfig.comm`) configures the communicators; its timeout is `timeout_s`. The comm's
        router (the topology's conflict registry, CUDA phase streams on GPU) is built here, once."""
        from megatron_rollout.comm.dist import DistComm
        from megatron_rollout.comm.groups import ParallelLayout
        from megatron_rollout.multiplex.routing import PhaseStreams, Router, derive_for_exchanges

        if not 0 < timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
        if dist.is_initialized() and dist.get_world_size() != atp * adp:
            raise ValueError(f"the process group has {dist.get_world_size()} ranks but ATP {atp} x ADP {adp} = "
                             f"{atp * adp}: the layout must cover every rank exactly once")
        dev = torch.device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(dev)
        if not dist.is_initialized():
            if "WORLD_SIZE" not in os.environ:
                raise ValueError(f"--atp {atp} --adp {adp} needs {atp * adp} processes: launch with "
                                 f"torchrun --nproc_per_node {atp * adp}")
            if int(os.environ["WORLD_SIZE"]) != atp * adp:
                raise ValueError(f"WORLD_SIZE is {os.environ['WORLD_SIZE']} but ATP {atp} x ADP {adp} = {atp * adp}: "
                                 f"launch {atp * adp} processes or change the layout")
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
        config = dataclasses.replace(comm or CommConfig(), timeout_s=timeout_s)
        streams = PhaseStreams.create(dev) if dev.type == "cuda" else None  # the CUDA runner rebinds its own
        # Conflicts from what each phase's configured exchange really issues on this layout (not a
        # fixed pair): what D issues is what P's registered collective is ordered after.
        router = Router(derive_for_exchanges(atp, adp, config.p_exchange, config.d_exchange), streams)
        return cls(DistComm(ParallelLayout(atp, adp, atp * adp), config, device=dev, router=router), dev, timeout_s)

    def engine(self, model: MoETransformer, config: EngineConfig, timeline=None) -> RolloutEngine:
        """An engine whose steps are planned rank-shared; under `mux` its turnstile meets over the
        CPU group and the comm's router puts the registered conflicting P collective after D (the
        comm routes only while a turnstile engine uses it: one engine at a time per runtime)."""
        from megatron_rollout.multiplex.native_rendezvous import make_rendezvous

        self._engines += 1  # each engine's rendezvous keys live in their own namespace
        # Shared memory when every rank is on this host and the extension builds, else the store.
        rendezvous = make_rendezvous(self.comm.cpu_group, self.timeout_s, self.rank, name=f"turnstile{self._engines}")
        turnstile = config.scheduler.schedule is Schedule.MUX and config.mux.ordering == "turnstile"
        self.comm.route_collectives(turnstile)
        return RolloutEngine(model, config, timeline=timeline, rank=self.rank,
                             coordinator=RankSharedCoordinator(self.comm), rendezvous=rendezvous,
                             router=self.comm.router)

    def drain(self, engine: RolloutEngine, driver: _Lockstep | None = None) -> list:
        """Declare this rank done and step until every rank is; returns what finished meanwhile."""
        driver = driver or _Lockstep(engine)
        engine.done = True
        outs = driver.step()  # step first: the last view may be an earlier rollout's "all done"
        while not _finished(engine):
            outs += driver.step()
        return outs

    def generate(self, engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams
                 ) -> list[GenerationResult] | None:
        """Results in prompt order at rank 0 (None elsewhere); n per prompt with `params.n` samples."""
        mine: dict[int, int | tuple[GenerationResult, ...]] = {}
        for i in range(self.replica, len(prompts), self.replicas):
            if not self.leader:
                continue
            try:
                mine[i] = engine.add_request(prompts[i], params)
            except RequestError as exc:
                mine[i] = (GenerationResult([], [], FinishReason.ERROR, [], str(exc)),) * params.n
        by_rid = {out.request_id: out.results for out in self.drain(engine)}
        local = {i: r if isinstance(r, tuple) else by_rid[r] for i, r in mine.items()}
        gathered = self.comm.all_gather_object(local, context="generate results")
        if not self.is_main:
            return None
        merged = {i: r for part in gathered for i, r in part.items()}
        return [r for i in range(len(prompts)) for r in merged[i]]

    def replay(self, engine: RolloutEngine, requests, *, seed: int, progress: bool, vocab_size: int,
               schedule: str) -> dict | None:
        """Each replica leader replays its share of the conversations; the report covers all."""
        from tqdm import tqdm

        from megatron_rollout.trace.metrics import build_report
        from megatron_rollout.trace.replay import replay
        from megatron_rollout.trace.schema import group_conversations

        convs = list(group_conversations(requests).items())
        share = [t for k, (_, turns) in enumerate(convs) if k % self.replicas == self.replica for t in turns]
        details: dict = {}
        outputs = []
        self._replays += 1
        bar = tqdm(total=len(requests), desc="replay", unit="req", file=sys.stderr, dynamic_ncols=True,
                   disable=not (progress and self.is_main))
        driver = _Counted(engine, f"megatron_rollout/replay_progress/{self._replays}", bar if self.is_main else None) \
            if self.leader else _Lockstep(engine)
        try:
            if self.leader and share:
                _, outputs = replay(driver, share, seed=seed, progress=False, vocab_size=vocab_size,
                                    schedule=schedule, details=details)
            self.drain(engine, driver)
            if isinstance(driver, _Counted):
                driver.refresh()  # all of them now (turns skipped after a failure never ran: not counted)
        finally:
            bar.close()
        offset = wall_minus_perf()
        mine = ReplayShare(outputs, details, offset, engine.stats.decode_wait_s, engine.stats.decode_waits) \
            if self.leader else None
        gathered: list[ReplayShare | None] = self.comm.all_gather_object(mine, context="replay results")
        if not self.is_main:
            return None
        parts = [g for g in gathered if g is not None and g.details]
        base = parts[0].clock_offset if parts else offset
        all_outs, conversation_of, turn_of, starts, skipped, refused = [], {}, {}, [], 0, []
        for outs, det, off, _, _ in parts:
            shift = off - base  # express every rank's perf_counter times on rank 0's clock
            for out in outs:
                new_id = len(all_outs)
                times = dataclasses.replace(out.times, arrival=out.times.arrival + shift,
                                            first_token=None if out.times.first_token is None
                                            else out.times.first_token + shift, finish=out.times.finish + shift)
                all_outs.append(dataclasses.replace(out, request_id=new_id, times=times))
                conversation_of[new_id] = det["conversation_of"][out.request_id]
                turn_of[new_id] = det["turn_of"][out.request_id]
            starts.append(det["start"] + shift)
            skipped += det["skipped"]
            refused += list(det["refused"])
        waits = [g for g in gathered if g is not None]
        wait_ms = 1e3 * sum(g.decode_wait_s for g in waits) / max(1, sum(g.decode_waits for g in waits))
        report = build_report(all_outs, conversation_of, start=min(starts, default=time.perf_counter()),
                              mean_decode_wait_ms=wait_ms, schedule=schedule, skipped=skipped, refused=refused,
                              turn_of=turn_of)
        return report.to_dict()

    def gather_timeline(self, timeline):
        """Every rank's timeline merged at rank 0 (None elsewhere)."""
        from megatron_rollout.trace.timeline import merge

        gathered = self.comm.all_gather_object(timeline, context="timeline")
        return merge(gathered) if self.is_main else None
