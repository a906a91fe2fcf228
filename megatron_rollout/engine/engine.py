"""The rollout engine: one step = gather state -> plan -> run -> sample -> finish.

The constructor wires the parts (KV pool and tensors, runner, scheduler config); `step()` runs
one scheduling step and returns the requests that finished in it. Prefill (P) and decode (D)
are explicit phases in every forward. The `mux` schedule runs an admitted prefill as an epoch
of segments with a decode iteration before each segment (`megatron_rollout.engine.mux`).
"""
from __future__ import annotations

import itertools
import logging
import numbers
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from megatron_rollout.engine.api import (FinishReason, GenerationResult, RequestError, RequestOutput, SamplingParams,
                                         Schedule)
from megatron_rollout.engine.config import EngineConfig, EngineStats
from megatron_rollout.engine.prefix import PrefixCache
from megatron_rollout.engine.coordinator import GlobalView, LocalCoordinator, RankSharedCoordinator
from megatron_rollout.engine.request import Request, Seq
from megatron_rollout.engine.runner import SpanInput
from megatron_rollout.engine.sampler import sample
from megatron_rollout.engine.scheduler import (PrefillChunk, SchedulerState, SeqView, Stage,
                                               StepPlan)
from megatron_rollout.engine.weights import WeightStore, WeightVersionError
from megatron_rollout.kv.block_pool import BlockPool
from megatron_rollout.kv.paged import PagedKVCache, SeqSpan
from megatron_rollout.model.layers import run_to_end
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.types import Axis, Phase

if TYPE_CHECKING:
    from megatron_rollout.engine.session import Session

log = logging.getLogger(__name__)


class RolloutEngine:
    def __init__(self, model: MoETransformer, config: EngineConfig | None = None, timeline=None, rank: int = 0,
                 coordinator: LocalCoordinator | RankSharedCoordinator | None = None, rendezvous=None,
                 router=None) -> None:
        self.model, self.config = model, config or EngineConfig()
        cfg = model.cfg
        self.max_model_len = self.config.max_model_len or cfg.max_position_embeddings
        self._new_pool()
        kv_heads = cfg.num_query_groups // model.comm.size(Axis.ATP)
        self._kv_shape = (cfg, self.config.num_blocks, self.config.block_size, kv_heads)
        from megatron_rollout.engine.cuda_runner import make_runner  # CudaRunner on one GPU, else ModelRunner
        self.runner = make_runner(model, PagedKVCache(*self._kv_shape, device=model.device))
        self.weights = WeightStore(model)
        self.stats = EngineStats()
        self.timeline, self.rank = timeline, rank
        self.coordinator = coordinator or LocalCoordinator()
        self.done = False
        """Distributed drivers set this when they will submit nothing more (see `GlobalView.all_done`)."""
        self.last_view: GlobalView | None = None
        self._ops: list[tuple] = []  # submissions a distributed leader ships to its ATP peers
        self._mirrors: dict[int, "Session"] = {}  # a peer's sessions, opened by replayed ops
        self.seqs: dict[int, Seq] = {}
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._order = itertools.count()
        self._generator = torch.Generator().manual_seed(self.config.seed)
        self._undelivered: list[RequestOutput] = []
        self._mux = None
        if self.config.schedule is Schedule.MUX:
            from megatron_rollout.engine.mux import MuxDriver
            self._mux = MuxDriver(self, rendezvous, router)

    # -- public API ------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self.weights.version

    def open_session(self) -> "Session":
        from megatron_rollout.engine.session import Session

        seq = Seq(next(self._ids), session=True, last_used=time.perf_counter())
        self.seqs[seq.sid] = seq
        self._record("open")
        return Session(self, seq)

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None) -> int:
        self._record("add", list(prompt_ids), params)
        seq = Seq(next(self._ids))
        seq.tokens = self._validate_tokens(prompt_ids, allow_empty=False)
        self.seqs[seq.sid] = seq
        try:
            return self._submit(seq, params or SamplingParams())
        except RequestError:
            del self.seqs[seq.sid]
            raise

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
        self._record("abort", rid)
        req = self.requests.get(rid)
        if req is None:
            return
        self._undelivered.append(self._finish(req, FinishReason.ABORT))

    def has_work(self) -> bool:
        return bool(self.requests)

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       version: int, final: bool = True) -> None:
        """Copy full-named tensors into the engine's weights (see `WeightStore.update`). Refused
        while a `mux` prefill epoch is half-way through its layers."""
        if self._mux is not None and self._mux.busy:
            raise WeightVersionError("a mux prefill epoch is in flight; update weights between steps once "
                                     "it has finished (engine.step() until not engine.mux_busy)")
        self.weights.update(named_tensors, version, final)

    @property
    def mux_busy(self) -> bool:
        return self._mux is not None and self._mux.busy

    def release_kv(self) -> None:
        """Free the KV tensors (e.g. while the trainer runs). Sessions keep their tokens and
        recompute their KV on their next turn."""
        if self.requests:
            raise RuntimeError(f"cannot release KV with {len(self.requests)} requests in flight")
        for seq in self.seqs.values():
            self._evict(seq)
        self._new_pool()  # cached prefixes point into the K/V being freed
        self.runner.cache = None
        if torch.cuda.is_available() and self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    def _new_pool(self) -> None:
        self.pool = BlockPool(self.config.num_blocks, self.config.block_size)
        self.prefix = PrefixCache(self.pool, self.config.prefix_caching)

    def reclaim_kv(self) -> None:
        if self.runner.cache is None:
            self.runner.cache = PagedKVCache(*self._kv_shape, device=self.model.device)

    def run_until(self, rids: list[int]) -> dict[int, RequestOutput]:
        """Step until these requests finish; other finished requests stay deliverable by `step`."""
        want, done = set(rids), {}
        for out in [o for o in self._undelivered if o.request_id in want]:  # aborted in the meantime
            self._undelivered.remove(out)
            done[out.request_id] = out
        while want - done.keys():
            lost = want - done.keys() - self.requests.keys()
            if lost:
                raise KeyError(f"requests {sorted(lost)} are not running (unknown, or already returned by step())")
            for out in self._step():
                (done.__setitem__(out.request_id, out) if out.request_id in want else self._undelivered.append(out))
        return done

    def step(self) -> list[RequestOutput]:
        """One scheduling step; returns the requests that finished (or were aborted) since the last call."""
        outs = self._step()
        if self._undelivered:
            outs, self._undelivered = self._undelivered + outs, []
        return outs

    # -- mirroring (distributed) -----------------------------------------------------------
    def _record(self, *op) -> None:
        if not isinstance(self.coordinator, LocalCoordinator) and self.coordinator.leader:
            self._ops.append(op)

    def _apply_ops(self, ops: list[tuple]) -> None:
        """Replay the replica leader's submissions on an ATP peer, in order (same ids result)."""
        for kind, *args in ops:
            try:
                self._apply_op(kind, args)
            except RequestError:
                pass  # the leader's call was refused the same way, and its caller told

    def _apply_op(self, kind: str, args: list) -> None:
        if kind == "open":
            session = self.open_session()
            self._mirrors[session.sid] = session
        elif kind == "add":
            self.add_request(*args)
        elif kind == "abort":
            self.abort(*args)
        else:  # append / submit / close on a session
            sid, *rest = args
            session = self._mirrors[sid] if kind != "close" else self._mirrors.pop(sid)
            getattr(session, kind)(*rest)

    # -- submission ------------------------------------------------------------------------
    def _validate_tokens(self, ids: list[int], allow_empty: bool) -> list[int]:
        """The ids as Python ints, or RequestError saying which one is wrong."""
        if not ids and not allow_empty:
            raise RequestError("empty prompt: give at least one token id")
        vocab = self.model.cfg.vocab_size
        wrong = [t for t in ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if wrong:
            raise RequestError(f"token ids must be integers, got {wrong[0]!r} ({type(wrong[0]).__name__})")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return [int(t) for t in ids]

    def _submit(self, seq: Seq, params: SamplingParams) -> int:
        if seq.request is not None:
            raise RequestError(f"sequence {seq.sid} already has request {seq.request.rid} running")
        if not seq.tokens:
            raise RequestError("nothing to generate from: append tokens first")
        if len(seq.tokens) >= self.max_model_len:
            raise RequestError(f"context of {len(seq.tokens)} tokens leaves no room to generate "
                               f"(max_model_len {self.max_model_len})")
        need = self.pool.blocks_for(min(len(seq.tokens) + params.max_new_tokens, self.max_model_len))
        if need > self.pool.num_blocks:
            raise RequestError(f"request needs {need} KV blocks, the pool holds {self.pool.num_blocks}; "
                               f"raise EngineConfig.num_blocks or shorten it")
        rid = next(self._ids)
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        req = Request(rid, seq, params, next(self._order), len(seq.tokens) - seq.computed, generator=gen)
        seq.request = req
        self.requests[rid] = req
        return rid

    # -- one step --------------------------------------------------------------------------
    def _step(self) -> list[RequestOutput]:
        distributed = not isinstance(self.coordinator, LocalCoordinator)
        if not self.requests and not distributed:
            return []
        self.weights.check_ready()
        if self.runner.cache is None:
            raise RuntimeError("KV memory was released: call engine.reclaim_kv() before generating")
        self.stats.steps += 1
        ops, self._ops = self._ops, []
        plan, view = self.coordinator.plan(self._planning_state, self.config.scheduler, self.stats.steps, ops,
                                           self._apply_ops, self.done)
        self.last_view = view
        self._preempt(plan.preempt)
        if self._mux is not None:
            return self._mux.round(plan, view)
        if view.phase is None:
            return self._unblock() if self.requests else []
        return self._run_plain(plan, view.phase)

    def _planning_state(self) -> SchedulerState:
        self.prefix.attach(self.requests.values(), self.weights.version)
        return self._state()

    def _state(self) -> SchedulerState:
        views = []
        for req in self.requests.values():
            seq = req.seq
            table = self.pool.table(seq.sid)
            twin = self.config.prefix_caching and (seq.computed == 0 or req.stage is Stage.PREFILL)
            views.append(SeqView(
                rid=req.rid, stage=req.stage, tokens=len(seq.tokens), computed=seq.computed, blocks=len(table),
                freeable=self.pool.exclusive(seq.sid), order=req.order,
                prefix_key=(seq.block_hashes(self.pool.block_size) or [None])[0] if twin else None))
        return SchedulerState(tuple(views), self.pool.num_free, epoch_in_flight=bool(self._mux and self._mux.busy))

    def _preempt(self, rids: Iterable[int]) -> None:
        for rid in rids:
            req = self.requests[rid]
            self._evict(req.seq)
            req.stage, req.lifetime = Stage.WAITING, req.lifetime + 1
            self.stats.preemptions += 1

    def _evict(self, seq: Seq) -> None:
        self.pool.release(seq.sid)
        seq.reset_kv()

    def _unblock(self) -> list[RequestOutput]:  # local only: changes no collective
        """Nothing fits: evict idle sessions' KV, or refuse the oldest request if even an empty
        pool cannot hold it."""
        idle = sorted((s for s in self.seqs.values() if s.request is None and self.pool.table(s.sid)),
                      key=lambda s: s.last_used)
        if idle:
            self._evict(idle[0])
            return []
        # Waiting requests that picked up cached prefixes hold blocks that starve everyone else: let
        # them go, and forget those prefixes so that the next step does not pick them up again.
        holders = [r.seq for r in self.requests.values() if r.stage is Stage.WAITING and self.pool.table(r.seq.sid)]
        for seq in holders:
            blocks = self.pool.table(seq.sid)
            self._evict(seq)
            self.pool.uncache(b for b in blocks if self.pool.refcount[b] == 0)
        if holders:
            return []
        oldest = min(self.requests.values(), key=lambda r: r.order)
        return [self._finish(oldest, FinishReason.ERROR, f"request {oldest.rid} does not fit in the KV pool")]

    def _run_plain(self, plan: StepPlan, phase: Phase) -> list[RequestOutput]:
        """One forward in `phase` over the plan's rows (none: a matched no-work forward)."""
        inputs, owners = self._inputs(plan.decode, plan.prefill)
        t0 = time.perf_counter()
        self._note_decode_wait(plan.decode, t0)
        with torch.no_grad():
            logits = run_to_end(self.runner.forward(inputs, phase))
        t1 = time.perf_counter()
        if self.timeline is not None:
            self.timeline.record(self.rank, phase.value, "prefill" if phase is Phase.P else "decode", t0, t1,
                                 rows=len(plan.decode), prefill=len(plan.prefill))
        return self._complete(owners, logits)

    def _inputs(self, decode: Iterable[int], prefill: Iterable[PrefillChunk]):
        """Grow/reserve KV for the rows and build runner inputs; returns (inputs, sampled owners)."""
        inputs, owners = [], []
        for rid in decode:
            req = self.requests[rid]
            seq = req.seq
            self.pool.grow(seq.sid, len(seq.tokens))
            span = SeqSpan(tuple(self.pool.table(seq.sid)), seq.computed, 1)
            inputs.append(SpanInput(span, seq.tokens[seq.computed:], sample=True))
            owners.append((req, req.lifetime, len(seq.tokens)))
        for chunk in prefill:
            req = self.requests[chunk.rid]
            seq = req.seq
            req.stage = Stage.PREFILL
            self.pool.reserve(seq.sid, seq.computed + chunk.tokens)
            span = SeqSpan(tuple(self.pool.table(seq.sid)), seq.computed, chunk.tokens)
            inputs.append(SpanInput(span, seq.tokens[seq.computed:seq.computed + chunk.tokens], chunk.completes))
            self.stats.prefill_tokens += chunk.tokens
            if chunk.completes:
                owners.append((req, req.lifetime, len(seq.tokens)))
            else:
                req.seq.computed += chunk.tokens  # partial chunk: nothing to sample
        return inputs, owners

    def _note_decode_wait(self, decode: Iterable[int], start: float) -> None:
        for rid in decode:
            req = self.requests[rid]
            if req.ready_at is not None:
                self.stats.decode_wait_s += start - req.ready_at
                self.stats.decode_waits += 1
        if decode:
            self.stats.decode_iterations += 1

    def _complete(self, owners: list[tuple[Request, int, int]], logits: torch.Tensor) -> list[RequestOutput]:
        """Sample one token per owner row and advance; drop rows of stale lifetimes."""
        live = [(i, o) for i, o in enumerate(owners) if self.requests.get(o[0].rid) is o[0] and o[0].lifetime == o[1]]
        picked = sample(logits[[i for i, _ in live]], [o[0].params for _, o in live],
                        [o[0].generator or self._generator for _, o in live])
        now, outs = time.perf_counter(), []
        version = self.weights.version
        for (_, (req, _, computed_to)), s in zip(live, picked):
            seq = req.seq
            seq.computed = computed_to
            if req.stage is Stage.PREFILL:
                self.pool.promote(seq.sid)
            else:
                self.stats.decode_tokens += 1
            self.prefix.offer(seq, version)
            req.stage, req.ready_at = Stage.DECODE, now
            req.first_token = req.first_token or now
            req.output.append(s.token)
            req.logprobs.append(s.logprob)
            req.versions.append(version)
            seq.tokens.append(s.token)
            reason = self._stop_reason(req, s.token)
            if reason is not None:
                outs.append(self._finish(req, reason))
        return outs

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        p = req.params
        if token in p.stop_token_ids and not p.ignore_stop:
            return FinishReason.STOP
        if len(req.output) >= p.max_new_tokens or len(req.seq.tokens) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, reason: FinishReason, error: str | None = None) -> RequestOutput:
        seq = req.seq
        del self.requests[req.rid]
        req.lifetime += 1
        seq.request = None
        seq.last_used = time.perf_counter()
        if self._mux is not None:  # first: blocks a running epoch still writes must not be freed
            self._mux.forget(req)
        if reason in (FinishReason.ABORT, FinishReason.ERROR) and req.stage is not Stage.DECODE:
            self._evict(seq)  # a half-computed prefill must not look cached
        if not seq.session:
            self._evict(seq)
            del self.seqs[seq.sid]
        else:
            self.pool.promote(seq.sid)
        return req.finish(reason, error)

    def check_integrity(self) -> None:
        """KV bookkeeping is consistent and every block is owned by a live sequence."""
        self.pool.check_integrity()
        zombies = set(self._mux.epoch.zombies) if self._mux is not None and self._mux.epoch else set()
        unknown = set(self.pool.tables) - set(self.seqs) - zombies
        if unknown:
            raise AssertionError(f"blocks held by unknown sequences {sorted(unknown)}")
        for seq in self.seqs.values():
            if seq.computed > len(self.pool.table(seq.sid)) * self.pool.block_size:
                raise AssertionError(f"sequence {seq.sid} claims {seq.computed} computed positions "
                                     f"with {len(self.pool.table(seq.sid))} blocks")
