"""The rollout engine: wiring, the public API, and `step()` (gather state -> plan -> run -> finish).

The constructor wires the parts: the request table (bookkeeping, `engine.bookkeeping`), the
runner over the paged KV, the step executor (`engine.execution`), the coordinator that plans a
step on every rank alike, and the schedule that runs the planned forwards (`engine.schedules`:
`off`/`chunked` or `mux`). Prefill (P) and decode (D) are explicit phases in every forward.
What a step does lives in those parts; this file only says in which order they are called.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

import torch

from megatron_rollout.comm.errors import CrossRankTimeout
from megatron_rollout.comm.facade import LocalComm
from megatron_rollout.engine.ahead import DecodeAhead
from megatron_rollout.engine.api import FinishReason, GenerationResult, RequestError, RequestOutput, SamplingParams
from megatron_rollout.engine.bookkeeping import Abort, AddRequest, Append, Close, Op, OpenSession, RequestTable, Submit
from megatron_rollout.engine.config import FP8_MODES, TE_FP8_MODES, EngineConfig, EngineStats
from megatron_rollout.engine.coordinator import GlobalView, LocalCoordinator, RankSharedCoordinator
from megatron_rollout.engine.cuda_runner import make_runner
from megatron_rollout.engine.execution import StepExecutor
from megatron_rollout.engine.prefix import PrefixCache
from megatron_rollout.engine.records import StepLog
from megatron_rollout.engine.request import Request, Seq
from megatron_rollout.engine.scheduler import SchedulerState
from megatron_rollout.engine.schedules import ScheduleDriver, make_schedule
from megatron_rollout.engine.session import Session
from megatron_rollout.engine.weights import WeightStore, WeightVersionError
from megatron_rollout.kv.block_pool import BlockPool
from megatron_rollout.kv.paged import PagedKVCache
from megatron_rollout.model import fp8, te_layers
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.types import Axis


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
        self.table = RequestTable(c.num_blocks, c.block_size, c.prefix_caching, self.max_model_len, cfg.vocab_size,
                                  self.stats, recording=self.distributed and self.coordinator.leader)
        self._kv_shape = (cfg, c.num_blocks, c.block_size, cfg.num_query_groups // model.comm.size(Axis.ATP))
        if c.runner.fp8 in TE_FP8_MODES:  # before the runner: its graphs capture the TE modules
            te_layers.apply_te(model, te_layers.TEConfig(recipe=TE_FP8_MODES[c.runner.fp8]))
        elif c.runner.fp8 != "off":  # before the runner: it stacks the FP8 experts for its graphs
            fp8.quantize_model_fp8(model, block=FP8_MODES[c.runner.fp8])
        self.runner = make_runner(model, PagedKVCache(*self._kv_shape, device=model.device), c.runner)
        self.executor = StepExecutor(self.table, self.runner, self.weights, self.stats, c.seed, timeline, rank)
        self.schedule: ScheduleDriver = make_schedule(c, self.table, self.executor, rendezvous, router)
        if self._decode_ahead(c.runner.decode_ahead):
            self.executor.ahead = DecodeAhead(self.table, self.runner, self.stats)
        self.timeline, self.rank = timeline, rank
        self.done = False
        """Distributed drivers set this when they will submit nothing more (see `GlobalView.all_done`)."""
        self.last_view: GlobalView | None = None
        self._mirrors: dict[int, Session] = {}  # a peer's sessions, opened by replayed ops

    def _decode_ahead(self, mode: str) -> bool:
        one_rank = not self.distributed and isinstance(self.model.comm, LocalComm)
        if mode == "on" and not one_rank:
            raise ValueError("decode_ahead='on' needs a single-rank engine: on many ranks every rank plans "
                             "every step from the gathered state, which a forward issued ahead would pre-empt")
        return one_rank and (mode == "on" or (mode == "auto" and getattr(self.runner, "overlaps_host", False)))

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

    @property
    def mux(self):
        """The `mux` schedule's driver (turnstile, epoch), or None under `off`/`chunked`."""
        from megatron_rollout.engine.schedules.mux import MuxSchedule

        return self.schedule if isinstance(self.schedule, MuxSchedule) else None

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
        return Session(self.table, self.table.open_seq(), self.run_until)

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None) -> int:
        return self.table.add(prompt_ids, params)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[GenerationResult]:
        """Run all prompts together; a refused prompt gets an ERROR result, the rest run."""
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
        return [r if isinstance(r, GenerationResult) else done[r].result for r in rids]

    def abort(self, rid: int) -> None:
        self.table.abort(rid)

    def has_work(self) -> bool:
        return bool(self.table.requests)

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       version: int, final: bool = True) -> None:
        """Copy full-named tensors into the engine's weights (see `WeightStore.update`). Refused
        while a `mux` prefill epoch is half-way through its layers."""
        if self.schedule.busy:
            raise WeightVersionError("a mux prefill epoch is in flight; update weights between steps once "
                                     "it has finished (engine.step() until not engine.mux_busy)")
        if self.executor.ahead is not None:
            self.executor.ahead.drop(wait=True)  # it reads the weights being copied; it ran on the old ones
        self.weights.update(named_tensors, version, final)

    def release_kv(self) -> None:
        """Free the KV tensors (e.g. while the trainer runs). Sessions keep their tokens and
        recompute their KV on their next turn."""
        if self.table.requests:
            raise RuntimeError(f"cannot release KV with {len(self.table.requests)} requests in flight")
        if self.executor.ahead is not None:
            self.executor.ahead.drop(wait=True)  # it writes the K/V being freed
        self.table.evict_all()
        self.table.new_pool()  # cached prefixes point into the K/V being freed
        self.runner.cache = None
        if torch.cuda.is_available() and self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    def reclaim_kv(self) -> None:
        if self.runner.cache is None:
            self.runner.cache = PagedKVCache(*self._kv_shape, device=self.model.device)

    def run_until(self, rids: list[int]) -> dict[int, RequestOutput]:
        """Step until these requests finish; other finished requests stay deliverable by `step`."""
        want, done, undelivered = set(rids), {}, self.table.undelivered
        for out in [o for o in undelivered if o.request_id in want]:  # aborted in the meantime
            undelivered.remove(out)
            done[out.request_id] = out
        while want - done.keys():
            lost = want - done.keys() - self.table.requests.keys()
            if lost:
                raise KeyError(f"requests {sorted(lost)} are not running (unknown, or already returned by step())")
            for out in self._step():
                (done.__setitem__(out.request_id, out) if out.request_id in want else undelivered.append(out))
        return done

    def step(self) -> list[RequestOutput]:
        """One scheduling step; returns the requests that finished (or were aborted) since the last call."""
        outs = self._step()
        if self.table.undelivered:
            outs, self.table.undelivered = self.table.undelivered + outs, []
        return outs

    def check_integrity(self) -> None:
        """KV bookkeeping is consistent and every block is owned by a live sequence."""
        self.table.check_integrity()

    # -- one step --------------------------------------------------------------------------
    def _step(self) -> list[RequestOutput]:
        if not self.table.requests and not self.distributed:
            return []
        self.weights.check_ready()
        if self.runner.cache is None:
            raise RuntimeError("KV memory was released: call engine.reclaim_kv() before generating")
        self.stats.steps += 1
        plan, view = self.coordinator.plan(self._planning_state, self.config.scheduler, self.stats.steps,
                                           self.table.take_ops(), self._apply_ops, self.done)
        self.last_view = view
        self.table.preempt(plan.preempt)
        try:
            return self.schedule.step(plan, view)
        except CrossRankTimeout as exc:  # a peer is gone: say where this rank was
            epoch = getattr(getattr(self.schedule, "epoch", None), "number", None)
            exc.locate(f"engine step {self.stats.steps}" + (f", mux epoch {epoch}" if epoch else ""))
            raise

    def _planning_state(self) -> SchedulerState:
        return self.table.planning_state(self.weights.version, epoch_in_flight=self.schedule.busy,
                                         max_batch_tokens=self.config.scheduler.max_batch_tokens)

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
    }
    """How an ATP peer replays each op: through the same public calls its leader made."""

