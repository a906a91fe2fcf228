"""The rollout engine: wiring, the public API, and `step()` (gather state -> plan -> run -> finish).

The constructor wires the parts: the request table (bookkeeping, `engine.bookkeeping`), the
runner over the paged KV, the step executor (`engine.execution`; `engine.drafting` with speculative
decoding), the coordinator that plans a
step on every rank alike, and the schedule that runs the planned forwards (`engine.schedules`:
`off`/`chunked` or `mux`). Prefill (P) and decode (D) are explicit phases in every forward.
What a step does lives in those parts; this file only says in which order they are called.

Threads: a trainer thread may call `update_weights` while another thread steps the engine (an
asynchronous RL loop). One re-entrant lock serialises the calls that change the engine: a step
holds it for its whole duration (plan, forwards, draws, bookkeeping), so an update waits for the
step in flight and never overlaps a forward. Submissions (`add_request`, `abort`, sessions) take it
too, because an update may run steps itself (below).

A weight update is decided by every rank of the model (`weights.vote`): each rank's offer
rides the step gather, so `update_weights` steps the engine until every rank's offer has been
seen, and the update lands at the start of a step, before its first forward, on every rank alike.
On one rank that is at once, except mid-epoch under `mux`: then the update runs the engine's steps
until the epoch has finished (its tokens stay deliverable by `step` and `run_until`) and lands
after it, so no forward ever mixes two versions.

Between rollouts the engine hands memory back to the trainer (`sleep`, `wake_up`; `engine.memory`):
only while no request is in flight (an `AsyncEngine` drains first), and nothing is generated until
every tag is awake again.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

import torch

from megatron_rollout.comm.dist import CommConfig
from megatron_rollout.comm.errors import CrossRankTimeout
from megatron_rollout.comm.facade import LocalComm
from megatron_rollout.engine.ahead import DecodeAhead
from megatron_rollout.engine.api import FinishReason, GenerationResult, RequestError, RequestOutput, SamplingParams
from megatron_rollout.engine.bookkeeping import (
    Abort,
    AddRequest,
    Append,
    Close,
    Op,
    OpenSession,
    RequestTable,
    Submit,
    TakeForks,
)
from megatron_rollout.engine.config import EngineConfig
from megatron_rollout.engine.coordinator import GlobalView, LocalCoordinator, RankSharedCoordinator
from megatron_rollout.engine.drafting import SpeculativeExecutor
from megatron_rollout.engine.execution import StepExecutor
from megatron_rollout.engine.gc_freeze import GcFreeze
from megatron_rollout.engine.memory import EngineAsleep, EngineMemory, Tag
from megatron_rollout.engine.prefix import PrefixCache
from megatron_rollout.engine.priority import make_priority
from megatron_rollout.engine.records import StepLog
from megatron_rollout.engine.request import Request, Seq
from megatron_rollout.engine.scheduler import SchedulerState
from megatron_rollout.engine.schedules import ScheduleDriver, make_schedule
from megatron_rollout.engine.session import Session
from megatron_rollout.engine.stats import EngineStats
from megatron_rollout.kv.block_pool import BlockPool
from megatron_rollout.kv.paged import PagedKVCache
from megatron_rollout.model import fp8, te_layers
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.runner.config import FP8_MODES, TE_FP8_MODES
from megatron_rollout.runner.cuda import make_runner
from megatron_rollout.types import Axis
from megatron_rollout.vmm import stable_wanted
from megatron_rollout.weights.store import WeightStore, WeightVersionError
from megatron_rollout.weights.vote import Decision, UpdateGate, Verdict, Vote, WeightVoteTimeout, decide


def comm_config_of(config: EngineConfig, built: CommConfig | None) -> CommConfig | None:
    """The communicators the engine runs on: the model's comm must have been built from
    `EngineConfig.comm` where both are given, and P's padded domain must hold a prefill epoch."""
    if config.comm is not None and built is not None and config.comm != built:
        raise ValueError(f"EngineConfig.comm is {config.comm} but the model's comm was built with {built}: build "
                         f"it from the engine's config (distributed.Runtime.start(comm=config.comm)), or leave "
                         f"EngineConfig.comm None to run on the model's comm as built")
    comm = config.comm or built
    if comm is not None and comm.p_max_tokens < config.scheduler.max_batch_tokens:
        raise ValueError(f"the model's comm holds {comm.p_max_tokens} tokens per P exchange (CommConfig.p_max_tokens) "
                         f"but a prefill epoch may have scheduler.max_batch_tokens = "
                         f"{config.scheduler.max_batch_tokens}: build the comm with p_max_tokens >= that, or lower "
                         f"max_batch_tokens")
    return comm


class RolloutEngine:
    def __init__(self, model: MoETransformer, config: EngineConfig | None = None, timeline=None, rank: int = 0,
                 coordinator: LocalCoordinator | RankSharedCoordinator | None = None, rendezvous=None,
                 router=None) -> None:
        self.model, self.config = model, config or EngineConfig()
        cfg, c = model.cfg, self.config
        self.max_model_len = c.context_length(cfg.max_position_embeddings)
        self.coordinator = coordinator or LocalCoordinator()
        self.distributed = not isinstance(self.coordinator, LocalCoordinator)
        self.stats = EngineStats()
        self.weights = WeightStore(model)
        self.comm_config = comm_config_of(c, model.comm.config)
        self.table = RequestTable(c.kv.num_blocks, c.scheduler.block_size, c.kv.prefix_caching, self.max_model_len,
                                  cfg.vocab_size, self.stats, recording=self.distributed and self.coordinator.leader,
                                  priority=make_priority(c.scheduler.priority))
        kv_heads = cfg.num_query_groups // model.comm.size(Axis.ATP)
        self._kv_shape = (cfg, c.kv.num_blocks, c.scheduler.block_size, kv_heads)
        if c.runner.fp8 in TE_FP8_MODES:  # before the runner: its graphs capture the TE modules
            te_layers.apply_te(model, te_layers.TEConfig(recipe=TE_FP8_MODES[c.runner.fp8]))
        elif c.runner.fp8 != "off":  # before the runner: it stacks the FP8 experts for its graphs
            fp8.quantize_model_fp8(model, block=FP8_MODES[c.runner.fp8])
        one_rank = isinstance(model.comm, LocalComm)
        runner = c.runner if c.speculative is None or c.runner.kind != "auto" or one_rank else \
            dataclasses.replace(c.runner, kind="eager")  # on many ranks drafting runs eagerly (engine.drafting)
        stable = stable_wanted(c.kv.stable_memory, model.device)  # KV that sleeps without dropping graphs
        self.runner = make_runner(model, PagedKVCache(*self._kv_shape, device=model.device, stable=stable), runner)
        if c.speculative is None:
            self.executor = StepExecutor(self.table, self.runner, self.weights, self.stats, c.seed, timeline, rank)
        else:
            self.executor = SpeculativeExecutor(self.table, self.runner, self.weights, self.stats, c.seed,
                                                c.speculative, timeline, rank)
            self.table.unserved = self.executor.unserved
        self.schedule: ScheduleDriver = make_schedule(c, self.table, self.executor, model, rendezvous, router)
        if self._decode_ahead(c.runner.decode_ahead):
            self.executor.ahead = DecodeAhead(self.table, self.runner, self.stats)
        self.timeline, self.rank = timeline, rank
        self.done = False
        """Distributed drivers set this when they will submit nothing more (see `GlobalView.all_done`)."""
        self.last_view: GlobalView | None = None
        self._mirrors: dict[int, Session] = {}  # a peer's sessions, opened by replayed ops
        self._gate = UpdateGate()
        self._lock = self._gate.lock  # held by every step and every change (module docstring)
        self._vote: Vote | None = None  # this rank's side of the weight update in progress
        self.gc_freeze = GcFreeze(c.gc_freeze)  # the collector skips what existed before the work came
        self.memory = EngineMemory(self.runner, self.table, self.weights,
                                   lambda: PagedKVCache(*self._kv_shape, device=model.device, stable=stable),
                                   self._stop_ahead, stable)

    @classmethod
    def from_megatron(cls, gpt, config: EngineConfig | None = None, share_storage: bool | None = None
                      ) -> "RolloutEngine":
        """A single-rank engine over an in-process Megatron-core `GPTModel` (local or Transformer Engine
        spec), its architecture read from the GPTModel's `TransformerConfig`. Where the layouts match
        (TP = EP = 1) the engine's parameters are the trainer's tensors (`share_storage`, the default
        there; the trainer's routed experts are moved into the stacks the CUDA runner's kernels read):
        in-place optimizer steps are served with no `update_weights`, by decode graphs too. Otherwise
        (or with `share_storage=False`) the weights are copied, gathered over the trainer's groups
        where it is sharded (a collective). `engine.weights.shared` says which. See
        `weights.megatron_bridge`."""
        from megatron_rollout.weights.megatron_bridge import native_from_megatron, shares_storage

        model = native_from_megatron(gpt, share_storage)
        sharing = shares_storage(model, gpt)
        engine = cls(model, config)
        if sharing and not shares_storage(engine.model, gpt):  # a runner that re-lays the weights: a copy
            raise ValueError(f"runner {type(engine.runner).__name__} re-laid the weights out of the trainer's "
                             "storage; pass share_storage=False to copy them, or RunnerConfig(kind='eager')")
        engine.weights.shared = sharing  # sleep(tags=["weights"]) must not free the trainer's own tensors
        return engine

    def _decode_ahead(self, mode: str) -> bool:
        drafting = self.config.speculative
        if drafting is not None and drafting.method != "ngram":  # MTP drafts come from the step before
            if mode == "on":
                raise ValueError("decode_ahead='on' and MTP drafting (EngineConfig.speculative) exclude each other: "
                                 "a forward issued ahead runs one token per row, before the drafts it would verify "
                                 "exist (n-gram drafting decodes its undrafted steps ahead)")
            return False
        one_rank = not self.distributed and isinstance(self.model.comm, LocalComm)
        if mode == "on" and not one_rank:
            raise ValueError("decode_ahead='on' needs a single-rank engine: on many ranks every rank plans "
                             "every step from the gathered state, which a forward issued ahead would pre-empt")
        return one_rank and (mode == "on" or (mode == "auto" and self.runner.overlaps_host))

    # -- read-only views of the parts --------------------------------------------------------
    @property
    def pool(self) -> BlockPool:
        return self.table.pool

    @property
    def prefix(self) -> PrefixCache:
        return self.table.prefix

    @property
    def seqs(self) -> Mapping[int, Seq]:
        return MappingProxyType(self.table.seqs)

    @property
    def requests(self) -> Mapping[int, Request]:
        return MappingProxyType(self.table.requests)

    def capture_graphs(self, max_rows: int) -> bool:
        """Capture now every CUDA graph a rollout of up to `max_rows` decode rows replays: the decode
        buckets and the piecewise P graphs or, drafting, the verify (and MTP draft) graphs of each
        row's one-token rows and the hidden-state P graphs, and no plain graph but the decode buckets
        of up to `max_rows` rows where n-gram drafting decodes its undrafted steps ahead. Otherwise
        each is captured on first use, inside the first rollout. On many ranks every rank calls it at
        the same point. False: this runner has no graphs, or capture failed
        (`runner.capture`)."""
        if max_rows <= 0:
            raise ValueError(f"capture_graphs: max_rows must be positive, got {max_rows}")
        capture = getattr(self.runner, "capture", None)
        if capture is None:
            return False
        top = self.runner.bucket(self.executor.graph_rows(max_rows))
        sizes = [b for b in self.runner.config.graph_batch_sizes if top is None or b <= top]
        outputs = self.executor.graph_outputs
        if not outputs:
            return capture(sizes)
        rows = self.runner.bucket(max_rows)
        undrafted = [b for b in sizes if rows is None or b <= rows] if self.executor.ahead is not None else []
        return capture(sizes, speculative=outputs, plain=False, plain_decode=undrafted)

    @property
    def step_log(self) -> StepLog:
        """One record per forward run so far (`engine.records`)."""
        return self.executor.log

    @property
    def weight_version(self) -> int:
        return self.weights.version

    @property
    def mux_busy(self) -> bool:
        return self.schedule.busy

    # -- public API ------------------------------------------------------------------------
    def open_session(self) -> Session:
        with self._lock:
            return Session(self.table, self.table.open_seq(), self.run_until, self._lock, self._sync_gc)

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None) -> int:
        """Raises `EngineAsleep` while any memory tag sleeps (nothing is added)."""
        with self._lock:
            self._check_awake("adding a request")
            return self.table.add(prompt_ids, params)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[GenerationResult]:
        """Run all prompts together; a refused prompt gets an ERROR result, the rest run. A prompt
        whose params ask for n samples has n results, one after the other."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        rids: list[int | GenerationResult] = []
        for prompt, p in zip(prompts, plist):
            try:
                rids.append(self.add_request(prompt, p))
            except RequestError as exc:
                rids.append(GenerationResult([], [], FinishReason.ERROR, [], str(exc)))
        done = self.run_until([r for r in rids if isinstance(r, int)])
        return [res for r, p in zip(rids, plist) for res in
                ((r,) * (p or SamplingParams()).n if isinstance(r, GenerationResult) else done[r].results)]

    def abort(self, rid: int) -> None:
        with self._lock:
            self.table.abort(rid)

    def has_work(self) -> bool:
        return bool(self.table.requests)

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       version: int, final: bool = True) -> None:
        """Copy full-named tensors into the engine's weights (see `WeightStore.update`), as one
        decision of every rank: on many ranks, every rank calls this with its tensors, and all
        apply the update, at the same step, or none does (module docstring). Safe to call from a
        thread other than the one stepping the engine: it waits for the step in flight, and under
        `mux` for the prefill epoch in flight (by stepping the engine until it ends).

        Raises, on every rank alike, what `WeightStore.update` raises: this rank's own error where
        it refused, WeightVersionError where another rank refused or the ranks were given different
        versions or chunks, and `WeightVoteTimeout` when a rank did not take part in time."""
        if Tag.WEIGHTS in self.memory.asleep:
            raise EngineAsleep("the engine's weights are offloaded to host memory (engine.sleep): call "
                               "engine.wake_up(tags=['weights']) before update_weights")
        with self._gate.update():
            vote = self._vote = Vote(self.weights.prepare(named_tensors, version, final), time.monotonic())
            try:
                while vote.decision is None:
                    if not self.distributed:  # one rank: the offer needs no gather
                        self._settle(decide((vote.prepared.offer,), self.schedule.busy))
                    if vote.decision is None:
                        if self.distributed and self.last_view is not None:
                            vote.check_deadline(self.last_view.offers, self.coordinator.timeout_s, self.rank)
                        self.table.undelivered.extend(self._vote_step(vote))
            finally:
                self._vote = None
                if vote.decision is None:  # the vote failed: this rank drops what it staged
                    self.weights.abandon()
        verdict, reason = vote.decision
        if verdict is Verdict.REFUSE:
            if vote.prepared.error is not None:
                raise vote.prepared.error
            raise WeightVersionError(f"weight update refused on every rank: {reason}; version {self.weights.version} "
                                     f"keeps serving on every rank (and nothing staged is kept): send it again")

    def _vote_step(self, vote: Vote) -> list[RequestOutput]:
        """One step that carries this rank's offer (its gather fails: say which update waited)."""
        try:
            return self._step()
        except CrossRankTimeout as exc:
            raise WeightVoteTimeout(f"weight update to {vote.prepared.offer.describe()} on rank {self.rank}: the "
                                    f"step gather that carries every rank's vote failed: {exc}", missing=exc.missing,
                                    where=exc.where, elapsed_s=exc.elapsed_s, rank=self.rank, states=exc.states
                                    ) from exc

    def _settle(self, decision: Decision | None) -> None:
        """Carry out the verdict every rank reached (None: not yet); before the step's forwards."""
        vote = self._vote
        if decision is None or vote is None:
            return
        if decision.verdict is Verdict.REFUSE:
            self.weights.abandon()
        else:
            if decision.verdict is Verdict.APPLY:
                if self.executor.ahead is not None:
                    self.executor.ahead.drop(wait=True)  # it reads the weights being copied; it ran on the old ones
                self.table.weights_replaced(self.weights.version)
            self.weights.commit(vote.prepared)
        vote.decision = decision

    # -- memory handed back between rollouts (`engine.memory`) -----------------------------
    def sleep(self, tags: str | Iterable[str] | None = None) -> dict:
        """Free memory for the trainer: tags "kv", "graphs", "weights" (None: all of them; sleeping
        "kv" or "weights" sleeps "graphs" too). Refused (RuntimeError) while requests are in flight:
        finish or abort them first, or sleep through `AsyncEngine.sleep`, which drains. Sleeping a
        tag that sleeps already is a no-op. Returns the report of `EngineMemory`: per tag whether it
        changed, tensor bytes freed and, on CUDA, the fall of allocated and reserved bytes."""
        with self._lock:
            if self.table.requests or self.schedule.busy:
                raise RuntimeError(f"cannot sleep with {len(self.table.requests)} requests in flight: let them "
                                   f"finish (run_until, or AsyncEngine.sleep, which drains first) or abort them")
            report = self.memory.sleep(tags)
            self._sync_gc()  # the trainer's step: its garbage is the collector's again
            return report

    def wake_up(self, tags: str | Iterable[str] | None = None) -> dict:
        """Take the memory back (None: every tag); "graphs" wake with the call that leaves "kv" and
        "weights" both awake. Waking an awake tag is a no-op. Returns the same report as `sleep`,
        with bytes re-taken."""
        with self._lock:
            return self.memory.wake_up(tags)

    @property
    def asleep(self) -> frozenset[str]:
        """The memory tags asleep now (empty: the engine can generate)."""
        return frozenset(t.value for t in self.memory.asleep)

    def _check_awake(self, doing: str) -> None:
        if self.memory.asleep:
            raise EngineAsleep(f"the engine is asleep ({', '.join(sorted(self.asleep))}): call engine.wake_up() "
                               f"before {doing}")

    def _stop_ahead(self) -> None:
        if self.executor.ahead is not None:
            self.executor.ahead.drop(wait=True)  # it reads and writes the memory being freed

    def run_until(self, rids: list[int]) -> dict[int, RequestOutput]:
        """Step until these requests finish; other finished requests stay deliverable by `step`."""
        want, done = set(rids), {}
        while True:
            with self._gate.step():
                undelivered = self.table.undelivered  # aborted, or finished in a step an update ran
                for out in [o for o in undelivered if o.request_id in want]:
                    undelivered.remove(out)
                    done[out.request_id] = out
                if not want - done.keys():
                    return done
                lost = {rid for rid in want - done.keys() if not self.table.running(rid)}
                if lost:
                    raise KeyError(f"requests {sorted(lost)} are not running (unknown, or already returned by step())")
                for out in self._step():
                    (done.__setitem__(out.request_id, out) if out.request_id in want else undelivered.append(out))

    def step(self) -> list[RequestOutput]:
        """One scheduling step; returns the requests that finished (or were aborted) since the last call."""
        with self._gate.step():
            outs = self._step()
            if self.table.undelivered:
                outs, self.table.undelivered = self.table.undelivered + outs, []
            return outs

    def check_integrity(self) -> None:
        """KV bookkeeping is consistent and every block is owned by a live sequence."""
        with self._lock:
            self.table.check_integrity()

    # -- one step --------------------------------------------------------------------------
    def _step(self) -> list[RequestOutput]:
        self._sync_gc()
        try:
            return self._planned_step()
        finally:
            self._sync_gc()
            self.gc_freeze.step_done()

    @property
    def _busy(self) -> bool:
        return bool(self.table.requests) or self.schedule.busy

    @property
    def _in_rollout(self) -> bool:
        """Requests run, or awake with sessions open between turns (a tool call's wait is part of
        the rollout): the collector's freeze is held (`engine.gc_freeze`)."""
        return self._busy or (not self.memory.asleep and self.table.sessions_open())

    def _sync_gc(self) -> None:
        """In a rollout, the collector's freeze taken; out of one (the last request done with no
        session open, the last session closed, or asleep), handed back."""
        self.gc_freeze.busy(self._in_rollout)

    def _planned_step(self) -> list[RequestOutput]:
        if not self._busy and not self.distributed:
            return []
        if self.table.requests or self._vote is None:  # a vote's step runs no forward: it may run asleep
            self._check_awake("generating")
        self.stats.steps += 1
        self.step_log.step_began()
        offer = self._vote.prepared.offer if self._vote is not None else None
        plan, view = self.coordinator.plan(self._planning_state, self.config.scheduler, self.stats.steps,
                                           self.table.take_ops(), self._apply_ops, self.done, offer)
        self.last_view = view
        if self.distributed:
            self._settle(decide(view.offers, view.epoch_in_flight))  # every rank alike, before any forward
        self.table.preempt(plan.preempt)
        try:
            return self.schedule.step(plan, view)
        except CrossRankTimeout as exc:  # a peer is gone: say where this rank was
            where = self.schedule.position()
            exc.locate(f"engine step {self.stats.steps}" + (f", {where}" if where else ""))
            raise

    def _planning_state(self) -> SchedulerState:
        state = self.table.planning_state(self.weights.version, epoch_in_flight=self.schedule.busy,
                                          max_batch_tokens=self.config.scheduler.max_batch_tokens)
        return self.executor.planning_view(state)

    # -- mirroring (distributed) -----------------------------------------------------------
    def _apply_ops(self, ops: list[Op]) -> None:
        """Replay the replica leader's submissions on an ATP peer, in order (same ids result)."""
        for op in ops:
            try:
                self._REPLAY[type(op)](self, op)
            except RequestError:
                pass  # the leader's call was refused the same way, and its caller told

    def _open_mirror(self, op: OpenSession) -> None:
        session = self.open_session()
        self._mirrors[session.sid] = session

    def _close_mirror(self, op: Close) -> None:
        self._mirrors.pop(op.sid).close()

    _REPLAY: dict[type, Callable[["RolloutEngine", Op], None]] = {
        OpenSession: _open_mirror,
        AddRequest: lambda e, op: e.add_request(op.prompt, op.params),
        Abort: lambda e, op: e.abort(op.rid),
        Append: lambda e, op: e._mirrors[op.sid].append(op.token_ids),
        Submit: lambda e, op: e._mirrors[op.sid].submit(op.params),
        Close: _close_mirror,
        TakeForks: lambda e, op: e._mirrors.update((f.sid, f) for f in e._mirrors[op.sid].forks()),
    }
    """How an ATP peer replays each op: through the same public calls its leader made."""
