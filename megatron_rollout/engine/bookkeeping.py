"""Request bookkeeping: sequences, requests, lifetimes, KV blocks and the op record (Python numbers only).

`RequestTable` is everything the engine knows about its requests between forwards: it submits,
finishes, evicts and preempts; it turns a plan's rows into runner inputs (growing or reserving
their KV blocks) and advances a request by one sampled token; it relieves KV pressure the pure
planner cannot (`unblock`); and on a distributed replica leader it records every submission as a
typed `Op`, which the step gather ships to the ATP peers (`engine.coordinator`). It never touches a
tensor: sampling and forwards are `engine.execution`'s.

A request with n samples is forked by `accept` once its prompt's logits are drawn n times
(`request.SampleGroup`); the executor copies the partial blocks forks ask for (`copies`).

A forward in flight across steps (a `mux` prefill epoch) still writes the blocks of the requests
it will sample. `begin_in_flight` names them; one of them finishing early has its blocks *parked*
under a negative owner id until `end_in_flight`, so no block is handed out while it is written.
"""
from __future__ import annotations

import dataclasses
import itertools
import numbers
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from megatron_rollout.engine.api import FinishReason, RequestError, RequestOutput, SamplingParams, sample_seed
from megatron_rollout.engine.prefix import PrefixCache
from megatron_rollout.engine.priority import Fifo, Priority, RequestInfo
from megatron_rollout.engine.request import Request, Sampled, SampleGroup, Seq
from megatron_rollout.engine.scheduler import PrefillChunk, SchedulerState, SeqView, Stage
from megatron_rollout.engine.stats import EngineStats
from megatron_rollout.kv.block_pool import BlockPool
from megatron_rollout.types import SeqSpan, SpanInput


class SampleOwner(NamedTuple):
    """The request a sampled logits row belongs to, as it was when its forward was built."""

    request: Request
    lifetime: int
    """The request's lifetime then; a sample for an older lifetime is dropped."""
    context: int
    """Context length the sample completes (the sequence's `computed` once it lands)."""
    scores: int | None = None
    """None: the row samples. Else its logits score the prompt token after position `scores` (no draw)."""


# -- the op record: what an ATP peer replays, in order, to mirror its leader ---------------------
@dataclass(frozen=True)
class OpenSession:
    pass


@dataclass(frozen=True)
class AddRequest:
    prompt: list[int]
    params: SamplingParams | None


@dataclass(frozen=True)
class Abort:
    rid: int


@dataclass(frozen=True)
class Append:
    sid: int
    token_ids: list[int]


@dataclass(frozen=True)
class Submit:
    sid: int
    params: SamplingParams


@dataclass(frozen=True)
class Close:
    sid: int


@dataclass(frozen=True)
class TakeForks:
    sid: int


Op = OpenSession | AddRequest | Abort | Append | Submit | Close | TakeForks


class BlockCopy(NamedTuple):
    """A KV block to copy on the device before the next forward (a forked sample's partial block)."""

    src: int
    dst: int


def _by_order(req: Request) -> int:
    return req.order


def _by_rank(req: Request) -> tuple[float, int]:
    return req.rank_key


class RequestTable:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool, max_model_len: int,
                 vocab_size: int, stats: EngineStats, recording: bool = False,
                 priority: Priority | None = None) -> None:
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.priority = priority or Fifo()
        """Keys the planner's service order (`engine.priority`)."""
        self._fifo = isinstance(self.priority, Fifo)
        self.max_model_len, self.vocab_size, self.stats = max_model_len, vocab_size, stats
        self.recording = recording
        """Record submissions as ops (a distributed replica's leader)."""
        self.unserved: dict[str, str] = {}
        """What a request may not ask for here, by `SamplingParams` field ("n" for n > 1 samples,
        "logprobs", "prompt_logprobs"), and why: set where the executor verifies tokens instead of
        drawing them (speculative decoding, `engine.drafting`)."""
        self.seqs: dict[int, Seq] = {}
        self.requests: dict[int, Request] = {}
        self.undelivered: list[RequestOutput] = []
        """Requests finished outside a step (aborts), handed out by the next `engine.step()`."""
        self.groups: dict[int, SampleGroup] = {}
        """Requests with n > 1 samples, by the id their caller holds, until the last sample ends."""
        self.copies: list[BlockCopy] = []
        """KV blocks forks asked for, copied by the executor before the next forward."""
        self._ops: list[Op] = []
        self._ids = itertools.count()
        self._order = itertools.count()
        self._zombie_ids = itertools.count(-1, -1)
        self._in_flight: set[int] = set()  # rids whose blocks a forward in flight still writes
        self._active: dict[int, Request] = {}  # requests admitted (prefill or decode): not waiting
        self.parked: list[int] = []
        """Block owners parked until the forward in flight ends (requests that finished early)."""
        self.new_pool()

    def new_pool(self) -> None:
        """A fresh, empty block pool (cached prefixes point into K/V that is being freed)."""
        self.pool = BlockPool(self.num_blocks, self.block_size)
        self.prefix = PrefixCache(self.pool, self.prefix_caching)

    # -- the op record -----------------------------------------------------------------------
    def record(self, op: Op) -> None:
        if self.recording:
            self._ops.append(op)

    def take_ops(self) -> list[Op]:
        ops, self._ops = self._ops, []
        return ops

    # -- submission ----------------------------------------------------------------------------
    def validate_tokens(self, ids: list[int], allow_empty: bool) -> list[int]:
        """The ids as Python ints, or RequestError saying which one is wrong. A 1-D numpy array or
        torch tensor is read as its list of values (an integer dtype passes, a float one is refused)."""
        if hasattr(ids, "tolist") and hasattr(ids, "ndim"):  # np.ndarray, torch.Tensor
            if ids.ndim != 1:
                raise RequestError(f"token ids must be a flat sequence, got an array of shape {tuple(ids.shape)}")
            ids = ids.tolist()
        if len(ids) == 0 and not allow_empty:
            raise RequestError("empty prompt: give at least one token id")
        if set(map(type, ids)) <= {int} and (not ids or 0 <= min(ids) <= max(ids) < self.vocab_size):
            return list(ids)  # plain ints in range (the usual case), checked in C; the rest token by token
        wrong = [t for t in ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if wrong:
            raise RequestError(f"token ids must be integers, got {wrong[0]!r} ({type(wrong[0]).__name__})")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return [int(t) for t in ids]

    def open_seq(self) -> Seq:
        """A new session's sequence."""
        seq = Seq(next(self._ids), session=True, last_used=time.perf_counter())
        self.seqs[seq.sid] = seq
        self.record(OpenSession())
        return seq

    def add(self, prompt_ids: list[int], params: SamplingParams | None) -> int:
        """A one-shot request on a private sequence; its request id."""
        self.record(AddRequest(list(prompt_ids), params))
        seq = Seq(next(self._ids))
        seq.tokens = self.validate_tokens(prompt_ids, allow_empty=False)
        self.seqs[seq.sid] = seq
        try:
            return self.submit(seq, params or SamplingParams())
        except RequestError:
            del self.seqs[seq.sid]
            raise

    def submit(self, seq: Seq, params: SamplingParams) -> int:
        """Start a request on `seq` (its tokens so far); its request id."""
        if seq.request is not None:
            raise RequestError(f"sequence {seq.sid} already has request {seq.request.rid} running")
        if not seq.tokens:
            raise RequestError("nothing to generate from: append tokens first")
        if len(seq.tokens) >= self.max_model_len:
            raise RequestError(f"context of {len(seq.tokens)} tokens leaves no room to generate "
                               f"(max_model_len {self.max_model_len})")
        shared = len(seq.tokens) // self.block_size  # the prompt's full blocks, shared by n samples
        each = self.pool.blocks_for(min(len(seq.tokens) + params.max_new_tokens, self.max_model_len)) - shared
        need = shared + params.n * each
        if need > self.pool.num_blocks:
            samples = f" for its n={params.n} samples" if params.n > 1 else ""
            raise RequestError(f"request needs {need} KV blocks{samples}, the pool holds {self.pool.num_blocks}; "
                               f"raise EngineConfig.kv.num_blocks or shorten it")
        asked = [f for f in self.unserved if (params.n > 1 if f == "n" else getattr(params, f) is not None)]
        if asked:
            raise RequestError(f"{' and '.join('n > 1' if f == 'n' else f for f in asked)} not served here: "
                               f"{self.unserved[asked[0]]}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.vocab_size:
                raise RequestError(f"{name}={k} asks for more tokens than the vocabulary's {self.vocab_size}")
        rid = next(self._ids)
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        order = next(self._order)
        key = self.priority.key(RequestInfo(order, seq.turns, len(seq.tokens), seq.generated))
        req = Request(rid, seq, params, order, len(seq.tokens) - seq.computed, (key, order), generator=gen)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * req.prompt_tokens
        if params.n > 1:  # sample i draws from its own stream (`api.sample_seed`)
            gens = [gen] + [None if params.seed is None else torch.Generator().manual_seed(sample_seed(params.seed, i))
                            for i in range(1, params.n)]
            req.group = self.groups[rid] = SampleGroup(rid, gens, [None] * params.n)
        seq.request = req
        self.requests[rid] = req
        return rid

    def sessions_open(self) -> bool:
        """Some session is open: a conversation that may submit again (waiting on a tool, say)."""
        return any(seq.session for seq in self.seqs.values())

    def running(self, rid: int) -> bool:
        """The request (for n > 1: any of its samples) has not finished."""
        return rid in self.requests or rid in self.groups

    def abort(self, rid: int) -> None:
        """Cancel a request (unknown or finished: nothing happens); its output is undelivered."""
        self.record(Abort(rid))
        group = self.groups.get(rid)
        members = [r for r in self.requests.values() if r.group is group] if group is not None else \
            [self.requests[rid]] if rid in self.requests else []
        for req in members:
            self._abort(req)

    def _abort(self, req: Request) -> None:
        out = self.finish(req, FinishReason.ABORT)
        if out is not None:
            self.undelivered.append(out)

    def drop_seq(self, seq: Seq) -> None:
        """Forget a closed session's sequence and free its KV; a request running on it (one sample
        of a group: the group's others run on) is aborted."""
        if seq.request is not None:
            self._abort(seq.request)
        self.evict(seq)
        self.seqs.pop(seq.sid, None)

    # -- lifetimes -----------------------------------------------------------------------------
    def evict(self, seq: Seq) -> None:
        self.pool.release(seq.sid)
        seq.reset_kv()

    def evict_all(self) -> None:
        for seq in self.seqs.values():
            self.evict(seq)

    def preempt(self, rids: Iterable[int]) -> None:
        for rid in rids:
            req = self.requests[rid]
            self.evict(req.seq)
            req.stage, req.lifetime = Stage.WAITING, req.lifetime + 1
            self._active.pop(rid, None)
            self.stats.preemptions += 1

    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> RequestOutput | None:
        """End `req`; its output, or None while other samples of its group still run."""
        seq = req.seq
        del self.requests[req.rid]
        self._active.pop(req.rid, None)
        req.lifetime += 1
        seq.request = None
        seq.last_used = time.perf_counter()
        seq.turns += 1
        seq.generated += len(req.output)
        self._park(req)  # first: blocks a forward in flight still writes must not be freed
        if reason in (FinishReason.ABORT, FinishReason.ERROR) and req.stage is not Stage.DECODE:
            self.evict(seq)  # a half-computed prefill must not look cached
        if not seq.session:
            self.evict(seq)
            del self.seqs[seq.sid]
        else:
            self.pool.promote(seq.sid)
        out = req.finish(reason, error)
        if out is not None and req.group is not None:
            del self.groups[req.group.rid]
        return out

    def unblock(self) -> list[RequestOutput]:  # local only: changes no collective
        """Nothing fits: free KV, the least costly first: an idle session's (least recently used),
        then cached prefixes that waiting requests picked up, then the youngest half-finished
        prefill's (preempted: it recomputes later). A request is refused only when nothing else
        holds a block and it still does not fit, which `submit` already rules out."""
        idle = sorted((s for s in self.seqs.values() if s.request is None and self.pool.table(s.sid)),
                      key=lambda s: s.last_used)
        if idle:
            self.evict(idle[0])
            return []
        # Waiting requests that picked up cached prefixes hold blocks that starve everyone else: let
        # them go, and forget those prefixes so that the next step does not pick them up again.
        holders = [r.seq for r in self.requests.values() if r.stage is Stage.WAITING and self.pool.table(r.seq.sid)]
        for seq in holders:
            blocks = self.pool.table(seq.sid)
            self.evict(seq)
            self.pool.uncache(b for b in blocks if self.pool.refcount[b] == 0)
        if holders:
            return []
        halfway = [r for r in self.requests.values() if r.stage is Stage.PREFILL and self.pool.table(r.seq.sid)]
        if halfway:
            self.preempt([max(halfway, key=lambda r: r.order).rid])
            return []
        oldest = min(self.requests.values(), key=lambda r: r.order)
        need = self.pool.blocks_for(len(oldest.seq.tokens))
        out = self.finish(oldest, FinishReason.ERROR,
                          f"request {oldest.rid} does not fit in the KV pool: its {len(oldest.seq.tokens)}-token "
                          f"context needs {need} blocks and {self.pool.num_free} of {self.pool.num_blocks} are "
                          f"free with no other request or session holding any; raise EngineConfig.kv.num_blocks")
        return [out] if out is not None else []

    # -- a forward in flight across steps --------------------------------------------------------
    def begin_in_flight(self, owners: Iterable[SampleOwner]) -> None:
        self._in_flight = {o.request.rid for o in owners}

    def end_in_flight(self) -> None:
        """The forward in flight finished: parked blocks go back to the pool."""
        for owner in self.parked:
            self.pool.release(owner)
        self.parked, self._in_flight = [], set()

    def _park(self, req: Request) -> None:
        if req.rid not in self._in_flight:
            return
        self._in_flight.discard(req.rid)
        zombie = next(self._zombie_ids)
        self.pool.transfer(req.seq.sid, zombie)
        self.pool.promote(zombie)  # parked, not a reservation any more
        req.seq.reset_kv()
        self.parked.append(zombie)

    def weights_replaced(self, old_version: int) -> None:
        """New weights are about to serve: K/V computed so far is `old_version`'s, also where no
        token has been sampled over it yet (a prefill part-way through its chunks), so such a
        sequence's blocks count as mixed once it continues and are never cached for reuse."""
        for seq in self.seqs.values():
            if seq.computed and seq.kv_version is None:
                seq.kv_version = old_version

    # -- planning --------------------------------------------------------------------------------
    def planning_state(self, version: int, epoch_in_flight: bool, max_batch_tokens: int) -> SchedulerState:
        """What the planner sees: every admitted request, and the waiting ones oldest first only as
        far as one step of `max_batch_tokens` could admit them (after giving each its cached prefix
        blocks). The planner admits waiting requests in age order until that budget is spent and
        never looks further, so younger ones are left out: viewing the whole queue every step made a
        long queue cost quadratic time. A waiting request that shares its first block with one
        already in view counts nothing: the planner skips it (its twin's blocks are reused later).
        Under a priority other than FIFO "oldest first" is "highest priority first", and each
        view's `order` is its request's rank among all requests."""
        if self._fifo:
            active = sorted(self._active.values(), key=_by_order)
            queue: Iterable[Request] = self.requests.values()  # insertion order is age order
            order = {}
        else:  # every request's rank: the views' order, and the waiting ones' queue
            ranked = sorted(self.requests.values(), key=_by_rank)
            order = {r.rid: i for i, r in enumerate(ranked)}
            active = [r for r in ranked if r.rid in self._active]
            queue = [r for r in ranked if r.stage is Stage.WAITING]
        views = [self._view(req, order.get(req.rid, req.order)) for req in active]
        keys = {v.prefix_key for v in views if v.stage is Stage.PREFILL and v.prefix_key is not None}
        headroom = self.pool.num_free - sum(r.stage is Stage.DECODE for r in active)
        left = max_batch_tokens
        for req in queue:
            if left <= 0:
                break
            if req.stage is not Stage.WAITING:
                continue
            headroom = self.prefix.attach(req, version, headroom)
            view = self._view(req, order.get(req.rid, req.order))
            views.append(view)
            if not (view.computed == 0 and view.prefix_key in keys):
                left -= view.tokens - view.computed
            if view.prefix_key is not None:
                keys.add(view.prefix_key)
        views.sort(key=lambda v: v.order)
        return SchedulerState(tuple(views), self.pool.num_free, epoch_in_flight=epoch_in_flight)

    def _prefix_key(self, req: Request) -> int | None:
        """The hash of its first full block, where it may share it with a twin (`SeqView.prefix_key`)."""
        seq = req.seq
        twin = self.prefix_caching and (seq.computed == 0 or req.stage is Stage.PREFILL)
        return (seq.block_hashes(self.pool.block_size, stop=1) or [None])[0] if twin else None

    def _view(self, req: Request, order: int) -> SeqView:
        seq = req.seq
        return SeqView(rid=req.rid, stage=req.stage, tokens=len(seq.tokens), computed=seq.computed,
                       blocks=len(self.pool.table(seq.sid)), freeable=self.pool.exclusive(seq.sid), order=order,
                       prefix_key=self._prefix_key(req))

    # -- rows of a forward and their samples -----------------------------------------------------
    def decode_row(self, rid: int, drafts: tuple[int, ...] = ()) -> tuple[SpanInput, SampleOwner]:
        """Grow the request's KV by its pending token and the `drafts` after it (verified by the same
        forward, `engine.drafting`); its input row and the sample owner of its pending token."""
        req = self.requests[rid]
        return self._decode_row(req, req.seq.computed, req.seq.tokens[req.seq.computed:] + list(drafts))

    def ahead_row(self, req: Request) -> tuple[SpanInput, SampleOwner]:
        """The decode row `req` runs next, one position past the token being drawn now (its KV
        grown for it); the token is a placeholder the device fills (`engine.ahead`)."""
        return self._decode_row(req, len(req.seq.tokens), [0])

    def _decode_row(self, req: Request, past: int, token: list[int]) -> tuple[SpanInput, SampleOwner]:
        self.pool.grow(req.seq.sid, past + len(token))
        span = SeqSpan(tuple(self.pool.table(req.seq.sid)), past, len(token))
        row = SpanInput(span, token, sample=True, key=req.seq.table_key)
        return row, SampleOwner(req, req.lifetime, past + 1)

    def prefill_rows(self, chunk: PrefillChunk) -> tuple[list[SpanInput], list[SampleOwner]]:
        """Reserve KV for the chunk; its input rows, and the owners of their logits rows: the sample
        owner if the chunk completes the context (a partial chunk counts as computed at once), and with
        `prompt_logprobs` one scoring owner per prompt position, each run as a one-token row."""
        req = self.requests[chunk.rid]
        seq = req.seq
        req.stage = Stage.PREFILL
        self._active[req.rid] = req
        req.admitted = req.admitted or time.perf_counter()
        self.pool.reserve(seq.sid, seq.computed + chunk.tokens)
        table, start, end = tuple(self.pool.table(seq.sid)), seq.computed, seq.computed + chunk.tokens
        self.stats.prefill_tokens += chunk.tokens
        # positions from `first` score the prompt token after them (the last position samples)
        first = len(seq.tokens) - req.prompt_tokens if req.params.prompt_logprobs is not None and not req.output \
            else len(seq.tokens)
        split = min(max(start, first), end)
        key = seq.table_key  # its decode rows' key too: the same table, grown by appending
        rows = [SpanInput(SeqSpan(table, start, split - start), seq.tokens[start:split],
                          chunk.completes and split == end, key)] if split > start else []
        owners = []
        for p in range(split, end):
            rows.append(SpanInput(SeqSpan(table, p, 1), [seq.tokens[p]], True, key))
            if p + 1 < len(seq.tokens):
                owners.append(SampleOwner(req, req.lifetime, p + 1, scores=p))
        if chunk.completes:
            return rows, owners + [SampleOwner(req, req.lifetime, len(seq.tokens))]
        seq.computed = end
        return rows, owners

    def score(self, owner: SampleOwner, entry: dict[int, float]) -> None:
        """Record a live scoring owner's prompt logprobs (token id -> logprob, the prompt token first)."""
        req = owner.request
        req.prompt_logprobs[owner.scores + 1 - (len(req.seq.tokens) - req.prompt_tokens)] = entry

    def is_live(self, owner: SampleOwner) -> bool:
        """The owner's request still runs, in the lifetime its row was built for."""
        req = owner.request
        return self.requests.get(req.rid) is req and req.lifetime == owner.lifetime

    def note_decode_wait(self, decode: Iterable[int], start: float) -> None:
        for rid in decode:
            req = self.requests[rid]
            if req.ready_at is not None:
                self.stats.decode_wait_s += start - req.ready_at
                self.stats.decode_waits += 1
        if decode:
            self.stats.decode_iterations += 1

    def draws(self, owner: SampleOwner) -> int:
        """Tokens to draw from the owner's logits row: n where it forks a request's samples."""
        group = owner.request.group
        return 1 if group is None else group.draws()

    def accept(self, owner: SampleOwner, drawn: list[Sampled], version: int, now: float) -> list[RequestOutput]:
        """Advance a live owner's request by its sampled token (`draws(owner)` of them: the first
        is its own, the others fork its samples); the outputs of the requests that finished."""
        req = owner.request
        self._land(req, owner.context, version)
        children = self._fork(req, len(drawn), now) if len(drawn) > 1 else []
        outs = []
        for r, d in zip([req, *children], drawn, strict=True):
            reason = self._run_end(r, (d,))[1]
            r.seq.tokens.append(d.token)
            outs.append(self._advance(r, (d,), version, now, reason))
        return [out for out in outs if out is not None]

    def accept_run(self, owner: SampleOwner, drawn: Sequence[Sampled], version: int, now: float
                   ) -> list[RequestOutput]:
        """Advance a live owner's request by `drawn`, at positions `owner.context`, + 1, ... (a
        verified row's kept drafts and the target's token), up to the first that finishes it: what
        `accept` of one token at a time does (one token forks nothing), landed once. Nothing after
        that token lands, whether or not its group still runs."""
        req = owner.request
        kept, reason = self._run_end(req, drawn)
        run = drawn[:kept]
        req.seq.tokens += [d.token for d in run]  # before landing: the prefix cache keys its blocks by them
        self._land(req, owner.context + kept - 1, version, kept)
        out = self._advance(req, run, version, now, reason)
        return [] if out is None else [out]

    def _run_end(self, req: Request, drawn: Sequence[Sampled]) -> tuple[int, FinishReason | None]:
        """How many of `drawn` the request keeps, and why it finishes at the last of them (None: it
        goes on): a stop token, or its length (`at_length`) reached."""
        p = req.params
        stops = () if p.ignore_stop else p.stop_token_ids
        room = min(p.max_new_tokens - len(req.output), self.max_model_len - len(req.seq.tokens))
        for j, d in enumerate(drawn):
            if d.token in stops:
                return j + 1, FinishReason.STOP
            if j + 1 >= room:
                return j + 1, FinishReason.LENGTH
        return len(drawn), None

    def _land(self, req: Request, context: int, version: int, tokens: int = 1) -> None:
        """`tokens` samples of `req` complete `context` positions: they are computed (a prompt's last
        one promotes its blocks; every other sample is a decoded token), and its newly full blocks
        are offered to the prefix cache."""
        seq = req.seq
        seq.computed = context
        if req.stage is Stage.PREFILL:
            self.pool.promote(seq.sid)
            tokens -= 1
        self.stats.decode_tokens += tokens
        self.prefix.offer(seq, version)

    def _advance(self, req: Request, run: Sequence[Sampled], version: int, now: float,
                 reason: FinishReason | None) -> RequestOutput | None:
        """Give the request `run` (what `_run_end` kept, already in its sequence's tokens) as output;
        finish it for `reason`, if any."""
        if req.stage is not Stage.WAITING:
            req.stage, req.ready_at = Stage.DECODE, now
        req.first_token = req.first_token or now
        for d in run:  # appends: a plain decode step's one token each row, on its host path
            req.output.append(d.token)
            req.logprobs.append(d.logprob)
            req.versions.append(version)
            if d.top is not None:
                req.top_logprobs.append(d.top)
        return None if reason is None else self.finish(req, reason)

    def _fork(self, req: Request, n: int, now: float) -> list[Request]:
        """Samples 1..n-1 of `req`, whose prompt is computed: each on a new sequence (`BlockPool.fork`;
        with no block free for the partial one, it waits and recomputes that block's positions)."""
        group, seq, bs = req.group, req.seq, self.block_size
        assert group is not None and not group.forked and n == group.n, "only an unforked group draws n tokens"
        group.forked, group.live = True, n
        full, partial = seq.computed // bs, seq.computed % bs != 0
        seq.family = seq.sid if seq.family is None else seq.family
        children = []
        for i in range(1, n):
            child = Seq(next(self._ids), list(seq.tokens), session=seq.session, last_used=now,
                        hashes=list(seq.hashes[:full]), kv_version=seq.kv_version, registered=min(seq.registered, full),
                        family=seq.family)
            self.seqs[child.sid] = child
            copy = self.pool.fork(seq.sid, child.sid, seq.computed)
            child.computed = seq.computed if copy is not None or not partial else full * bs
            self.copies += [BlockCopy(*copy)] if copy is not None else []
            if seq.session:
                seq.forks.append(child)
            seed = req.params.seed
            params = dataclasses.replace(req.params, n=1, seed=None if seed is None else sample_seed(seed, i))
            order = next(self._order)  # served like its parent (its priority key), after it
            r = Request(next(self._ids), child, params, order, req.prompt_tokens, (req.rank_key[0], order),
                        stage=Stage.DECODE if child.computed == seq.computed else Stage.WAITING,
                        generator=group.generators[i], arrival=req.arrival, admitted=req.admitted,
                        group=group, index=i, prompt_logprobs=list(req.prompt_logprobs))
            child.request = r
            self.requests[r.rid] = r
            if r.stage is Stage.DECODE:
                self._active[r.rid] = r
            children.append(r)
        return children

    def at_length(self, req: Request, more: int = 0) -> bool:
        """The request has its last token by length once `more` further tokens are accepted."""
        return len(req.output) + more >= req.params.max_new_tokens or len(req.seq.tokens) + more >= self.max_model_len

    def check_integrity(self) -> None:
        """KV bookkeeping is consistent and every block is owned by a live sequence (or parked)."""
        self.pool.check_integrity()
        unknown = set(self.pool.tables) - set(self.seqs) - set(self.parked)
        if unknown:
            raise AssertionError(f"blocks held by unknown sequences {sorted(unknown)}")
        for seq in self.seqs.values():
            if seq.computed > len(self.pool.table(seq.sid)) * self.pool.block_size:
                raise AssertionError(f"sequence {seq.sid} claims {seq.computed} computed positions "
                                     f"with {len(self.pool.table(seq.sid))} blocks")
