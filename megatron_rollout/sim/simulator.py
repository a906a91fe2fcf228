"""The engine on a trace, simulated: its own planner on modelled state, each step's time from a cost
model fitted to its measured steps (`sim.cost`). Fast enough to try a policy in seconds on a CPU.

What is modelled as the engine does it: every conversation is a session (its KV kept between
turns; a turn prefills its new tokens and the last sampled token); turn 0 is released at its wait,
turn k at turn k-1's finish plus its wait, checked between steps like the replay loop does; each
step the planner (`engine.scheduler.plan_step`, the engine's own function) plans on the modelled
state; preempted requests lose their KV and recompute; when nothing fits, KV is freed the way
`RequestTable.unblock` frees it. A step costs its forward (`CostModel.step_s`) plus the host gap; a
turn's submission costs `CostModel.submit_token_s` per input token before the first step (a
replay's start-up) and `turn_token_s` after it, serially, as in the replay's loop. `off` and
`chunked` run one forward per step; `mux` runs one decode iteration and one prefill segment per
step, an epoch being cut into `CostModel.mux_segments` segments while decode rows run (whole
otherwise), the two serial on one device as on the engine's one stream.

Levers the engine does not have (yet) are options (`sim.levers`: decode priority for the
critical chain, P/D side by side on one device under `mux`, speculative decoding of the tail, a
lane of extra decode steps for the likely-last trajectories);
without them a simulated `mux` is the engine as it runs today. The simulated forwards come out as
the engine's `StepRecord`s on the simulated clock, so `trace.breakdown` tells where a simulated
makespan went with the definitions it uses for real replays (`SimResult.breakdown`).

What is not modelled: prefix sharing between conversations (replayed inputs are random), the
context length limit (a trace that does not fit is refused by the replay before it runs), stop
tokens (turns generate exactly their output tokens) and several ranks.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from megatron_rollout.engine.api import FinishReason, GenerationResult, RequestOutput, RequestTimes, Schedule
from megatron_rollout.engine.records import StepRecord
from megatron_rollout.engine.scheduler import PrefillChunk, SchedulerConfig, SchedulerState, SeqView, Stage, plan_step
from megatron_rollout.sim.cost import CostModel, StepSize, chunk_pairs
from megatron_rollout.sim.levers import Levers, Speculation, TailLane
from megatron_rollout.sim.policy import Foresight, Priority, make_policy
from megatron_rollout.trace.breakdown import Breakdown, build_breakdown
from megatron_rollout.trace.schema import ConversationId, TraceRequest, group_conversations


class SimulationError(RuntimeError):
    """The simulated engine cannot go on (a request that no free KV can ever hold)."""


@dataclass(frozen=True)
class SimConfig:
    """The simulated engine: its planner's settings and KV pool."""

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Schedule, block size, token budget and decode rows, as the engine's `EngineConfig.scheduler`."""
    num_blocks: int = 4096
    """KV blocks in the pool (`EngineConfig.kv.num_blocks`)."""
    levers: Levers = field(default_factory=Levers)
    """Levers the engine does not have (`sim.levers`); the default pulls none."""
    group_size: int = 1
    """Conversations per RL group, consecutive in the trace (what `Foresight.peers_done` counts)."""

    def __post_init__(self) -> None:
        for name in ("num_blocks", "group_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"SimConfig.{name} must be a positive int, got {value!r}")
        if self.levers.tail_lane is not None and self.scheduler.schedule is Schedule.MUX:
            raise ValueError("Levers.tail_lane adds decode-only steps between whole steps: it needs the off or "
                             "chunked schedule, got 'mux'")
        if (self.levers.overlap is not None or self.levers.critical_share) \
                and self.scheduler.schedule is not Schedule.MUX:
            raise ValueError(f"Levers.overlap and Levers.critical_share act on a prefill epoch beside decode: they "
                             f"need the mux schedule, got {self.scheduler.schedule.value!r}")

    @classmethod
    def of_engine(cls, config) -> SimConfig:
        """The simulated twin of an `EngineConfig`."""
        return cls(config.scheduler, config.kv.num_blocks)


@dataclass(frozen=True)
class SimRequest:
    """One simulated turn's marks (seconds from the start)."""

    conversation: ConversationId
    turn: int
    arrival: float
    admitted: float
    first_token: float
    finish: float
    output_tokens: int
    wait_s: float
    """The trace's tool wait before it (its release latency is arrival - previous finish - wait)."""


@dataclass(frozen=True)
class SimResult:
    schedule: str
    policy: str
    levers: str
    """`Levers.label` of the levers pulled ('' when none)."""
    makespan_s: float
    requests: tuple[SimRequest, ...]
    """Every turn, in finish order."""
    steps: int
    sizes: tuple[StepSize, ...]
    """Every forward's sizes, in order (a `mux` epoch: one prefill entry, when it starts)."""
    preemptions: int
    evictions: int
    records: tuple[StepRecord, ...] = ()
    """Every forward as the engine records it (`engine.records`), on the simulated clock from 0: an
    `off`/`chunked` step, a `mux` decode iteration and prefill segment (one record beside decode
    under `Levers.overlap`)."""

    def breakdown(self, bins: int = 50) -> Breakdown:
        """Where the simulated makespan went (`trace.breakdown`, the real replays' definitions)."""
        outputs = [RequestOutput(i, GenerationResult([0] * r.output_tokens, [], FinishReason.LENGTH, []),
                                 RequestTimes(r.arrival, r.first_token, r.finish, r.admitted), 0)
                   for i, r in enumerate(self.requests)]
        waits = {i: TraceRequest(r.conversation, r.turn, 1, r.output_tokens, r.wait_s * 1e3)
                 for i, r in enumerate(self.requests)}
        return build_breakdown(self.records, outputs, {i: r.conversation for i, r in enumerate(self.requests)},
                               start=0.0, bins=bins, turn_of=waits)

    def finish_of(self) -> dict[ConversationId, float]:
        """Each conversation's last finish."""
        out: dict[ConversationId, float] = {}
        for r in self.requests:
            out[r.conversation] = max(out.get(r.conversation, 0.0), r.finish)
        return out


def turn_cost_s(cost: CostModel, context: int, new: int, output: int) -> float:
    """One turn alone on the engine (batch 1): its prefill of `new` tokens after `context` cached
    ones, then `output - 1` decode steps; each step with its host gap."""
    prefill = cost.step_s(StepSize(prefill_rows=1, prefill_tokens=new, prefill_pairs=chunk_pairs(context, new)))
    first = context + new  # context of the first decode row (the first sampled token's position included)
    decode = (output - 1) * (cost.step_s(StepSize(decode_rows=1)) + cost.gap_s) \
        + cost.decode_context_s * sum(range(first + 1, first + output))
    return prefill + cost.gap_s + decode


@dataclass
class _Conv:
    index: int
    key: ConversationId
    turns: list[TraceRequest]
    chain_after: list[float]
    """Seconds of each turn's own cost plus every later turn's wait and cost (batch 1)."""
    turn_s: list[float]
    next_turn: int = 0
    tokens: int = 0
    computed: int = 0
    blocks: int = 0
    last_used: float = 0.0
    generated: int = 0
    """Output tokens of its finished turns."""
    request: _Req | None = None


@dataclass
class _Req:
    rid: int
    conv: _Conv
    order: int
    turn: TraceRequest
    arrival: float
    output_left: int
    rank_key: tuple[float, int]
    """(policy key at submission, order), as the engine's `Request.rank_key`."""
    stage: Stage = Stage.WAITING
    admitted: float | None = None
    first_token: float | None = None
    credit: float = 0.0
    """Accepted drafted tokens not yet kept (`Speculation`: fractions carry over)."""


@dataclass
class _Epoch:
    index: int
    chunks: tuple[PrefillChunk, ...]
    size: StepSize
    total_s: float
    left_s: float
    segment_s: float

    def part(self, seconds: float) -> StepSize:
        """The prefill sizes of `seconds` of this epoch (its share of tokens and pairs, at least one
        token; its chunks counted on its first part, as the engine records segments)."""
        share = seconds / self.total_s if self.total_s > 0 else 1.0
        first = self.left_s + seconds >= self.total_s - 1e-12
        return StepSize(prefill_rows=self.size.prefill_rows if first else 0,
                        prefill_tokens=max(1, round(share * self.size.prefill_tokens)),
                        prefill_pairs=round(share * self.size.prefill_pairs))


_LANE_KEYS: dict[str, Callable[[_Req], float]] = {
    "generated": lambda r: r.conv.generated + r.turn.output_tokens - r.output_left,
    "context": lambda r: r.conv.tokens,
    "oracle": lambda r: r.conv.chain_after[r.conv.next_turn]}
"""`TailLane.rank`'s keys on a request, larger first (`sim.levers.LANE_RANKS`)."""


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class Simulator:
    """One simulation run (`simulate` is the entry point)."""

    def __init__(self, trace: Sequence[TraceRequest], cost: CostModel, config: SimConfig, policy: Priority) -> None:
        self.cost, self.config, self.policy = cost, config, policy
        self.bs = config.scheduler.block_size
        self.convs = [self._conv(i, key, turns) for i, (key, turns) in enumerate(group_conversations(trace).items())]
        self.now, self.steps, self.preemptions, self.evictions = 0.0, 0, 0, 0
        self.used_blocks = 0
        self.active: dict[int, _Req] = {}
        self.done: list[SimRequest] = []
        self.sizes: list[StepSize] = []
        self.records: list[StepRecord] = []
        self.levers = config.levers
        self.group_done = [0] * (-(-len(self.convs) // config.group_size))
        self.releases = [(c.turns[0].wait_ms / 1e3, c.index) for c in self.convs]
        heapq.heapify(self.releases)
        self.epoch: _Epoch | None = None
        self._ids, self._order, self._epochs = itertools.count(), itertools.count(), itertools.count()

    def _conv(self, index: int, key: ConversationId, turns: list[TraceRequest]) -> _Conv:
        turn_s, context = [], 0
        for t in turns:
            new = t.input_tokens + (1 if context else 0)
            turn_s.append(turn_cost_s(self.cost, context - (1 if context else 0), new, t.output_tokens))
            context += t.input_tokens + t.output_tokens
        chain, after = [0.0] * len(turns), 0.0
        for k in range(len(turns) - 1, -1, -1):
            chain[k] = turn_s[k] + after
            after = chain[k] + turns[k].wait_ms / 1e3
        return _Conv(index, key, turns, chain, turn_s)

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> SimResult:
        while self.releases or self.active:
            while self.releases and self.releases[0][0] <= self.now:
                conv = self.convs[heapq.heappop(self.releases)[1]]
                # the host submits a turn between forwards; before the first, that is the start-up
                per_token = self.cost.turn_token_s if self.steps else self.cost.submit_token_s
                self.now += per_token * conv.turns[conv.next_turn].input_tokens
                self._submit(conv)
            if not self.active:
                self.now = self.releases[0][0]
                continue
            self._step()
        sched = self.config.scheduler.schedule
        return SimResult(sched.value, self.policy.name, self.levers.label, self.now, tuple(self.done), self.steps,
                         tuple(self.sizes), self.preemptions, self.evictions, tuple(self.records))

    def _submit(self, conv: _Conv) -> None:
        turn = conv.turns[conv.next_turn]
        conv.tokens += turn.input_tokens
        need = _blocks(conv.tokens + turn.output_tokens, self.bs)
        if need > self.config.num_blocks:  # the engine refuses it at submission (`RequestTable.submit`)
            raise SimulationError(f"conversation {conv.key!r} turn {turn.turn} needs {need} KV blocks, the pool "
                                  f"holds {self.config.num_blocks}; raise SimConfig.num_blocks")
        order = next(self._order)
        key = self.policy.key(Foresight(order, conv.next_turn, conv.tokens, conv.generated,
                                        conv.chain_after[conv.next_turn], self._peers_done(conv)))
        req = _Req(next(self._ids), conv, order, turn, self.now, turn.output_tokens, (key, order))
        conv.request = req
        self.active[req.rid] = req

    def _peers_done(self, conv: _Conv) -> float:
        size = self.config.group_size
        group = conv.index // size
        peers = min(size, len(self.convs) - group * size) - 1
        return self.group_done[group] / peers if peers else 0.0

    def _state(self, decode_only: bool = False) -> SchedulerState:
        """The planner's view; with `decode_only`, requests not decoding are hidden (no prefill)."""
        reqs = list(self.active.values())
        rank = {r.rid: i for i, r in enumerate(sorted(reqs, key=lambda r: r.rank_key))}
        views = tuple(SeqView(r.rid, r.stage, r.conv.tokens, r.conv.computed, r.conv.blocks, r.conv.blocks,
                              rank[r.rid]) for r in reqs if not decode_only or r.stage is Stage.DECODE)
        return SchedulerState(views, self.config.num_blocks - self.used_blocks, self.epoch is not None)

    def _holding(self) -> bool:
        """`Levers.critical_first`: one of the best-ranked requests decodes, so prefill waits."""
        best = sorted(self.active.values(), key=lambda r: r.rank_key)[:self.levers.critical_first]
        return any(r.stage is Stage.DECODE for r in best)

    def _speculation(self, rows: int) -> Speculation | None:
        spec = self.levers.speculation
        return spec if spec is not None and 0 < rows <= spec.max_rows else None

    def _decode_s(self, size: StepSize, spec: Speculation | None) -> float:
        """A decode iteration's forward; speculating, the same rows over the same contexts with k
        drafted positions each (`CostModel.decode_draft_s`, and the experts they add)."""
        if spec is None:
            return self.cost.step_s(size)
        drafts = size.decode_rows * spec.tokens_at(size.decode_rows)
        return spec.overhead * self.cost.step_s(replace(size, decode_drafts=drafts))

    def _step(self) -> None:
        hold = bool(self.levers.critical_first) and self._holding()
        plan = plan_step(self._state(decode_only=hold and not self.levers.critical_share), self.config.scheduler)
        for rid in plan.preempt:
            req = self.active[rid]
            self._set_blocks(req.conv, 0)
            req.conv.computed, req.stage = 0, Stage.WAITING
            self.preemptions += 1
        spec = self._speculation(len(plan.decode))
        if self.config.scheduler.schedule is Schedule.MUX:
            self._mux_step(plan.decode, plan.prefill, spec, hold)
        elif plan.empty:
            self._unblock()
        else:
            decode = self._decode_size(plan.decode)
            size = StepSize(decode.decode_rows, decode.decode_context, *self._prefill_size(plan.prefill))
            seconds = self.cost.step_s(size)
            if spec is not None:
                seconds += self._decode_s(decode, spec) - self.cost.step_s(decode)
            self._record(seconds, size)
            self._advance(seconds, size)
            self._finish_decode(plan.decode, spec)
            self._finish_prefill(plan.prefill)
            if self.levers.tail_lane is not None:
                self._lane(self.levers.tail_lane)

    def _lane(self, lane: TailLane) -> None:
        """`Levers.tail_lane`: decode-only steps of the requests ranked first, while more decode."""
        decoding = [r for r in self.active.values() if r.stage is Stage.DECODE]
        if len(decoding) <= lane.rows:
            return
        rows = tuple(r.rid for r in sorted(decoding, key=_LANE_KEYS[lane.rank], reverse=True)[:lane.rows])
        for _ in range(lane.steps):
            if not (rows := tuple(rid for rid in rows if rid in self.active)):
                return
            size = self._decode_size(rows)
            seconds = self.cost.step_s(size)
            self._record(seconds, size)
            self._advance(seconds, size)
            self._finish_decode(rows)

    def _mux_step(self, decode: tuple[int, ...], prefill: tuple[PrefillChunk, ...], spec: Speculation | None,
                  hold: bool) -> None:
        if prefill and self.epoch is None:
            size = StepSize(0, 0, *self._prefill_size(prefill))
            self.sizes.append(size)
            total = self.cost.step_s(size)
            self.epoch = _Epoch(next(self._epochs), prefill, size, total, total, total / self.cost.mux_segments)
        if self.epoch is None and not decode:
            self._unblock()
            return
        d_size = self._decode_size(decode) if decode else StepSize()
        decode_s = self._decode_s(d_size, spec) if decode else 0.0
        if decode:
            self.sizes.append(d_size)
        # decode priority: the epoch waits, or runs short segments, while the critical row decodes
        ep = None if hold and not self.levers.critical_share else self.epoch
        overlap = self.levers.overlap
        if ep is not None and decode and overlap is not None:
            segment = min(ep.left_s, ep.segment_s)  # the engine issues the next segment after this round
            seconds, done = overlap.step_s(decode_s, segment)
            ep.left_s -= done
            part = ep.part(done)
            self._record(seconds, StepSize(d_size.decode_rows, d_size.decode_context, part.prefill_rows,
                                           part.prefill_tokens, part.prefill_pairs), ep.index)
            # through the host's gap after the iteration the segment runs on, on its own stream, alone on its SMs
            if (more := min(segment - done, self.cost.gap_s / overlap.alone_factor)) > 0:
                ep.left_s -= more
                self._record(more * overlap.alone_factor, ep.part(more), ep.index, start=self.now + seconds)
        else:
            seconds = decode_s
            if decode:
                self._record(decode_s, d_size)
            if ep is not None:
                segment = min(ep.left_s, ep.segment_s) if decode else ep.left_s
                if hold:
                    segment = min(segment, self.levers.segment_cap_s(decode_s))
                ep.left_s -= segment
                took = segment * (overlap.alone_factor if overlap is not None else 1.0)  # on its partition
                self._record(took, ep.part(segment), ep.index, start=self.now + decode_s)
                seconds += took
        self._advance(seconds, None)
        self._finish_decode(decode, spec)
        if ep is not None and ep.left_s <= 1e-12:
            self.epoch = None
            self._finish_prefill(ep.chunks)

    # -- sizes and bookkeeping ---------------------------------------------------------------
    def _decode_size(self, decode: tuple[int, ...]) -> StepSize:
        context = 0
        for rid in decode:
            conv = self.active[rid].conv
            self._set_blocks(conv, max(conv.blocks, _blocks(conv.computed + 1, self.bs)))
            context += conv.computed + 1
        return StepSize(decode_rows=len(decode), decode_context=context)

    def _prefill_size(self, prefill: tuple[PrefillChunk, ...]) -> tuple[int, int, int]:
        """Reserve the chunks' KV and admit them; (rows, tokens, pairs)."""
        tokens = pairs = 0
        for chunk in prefill:
            req = self.active[chunk.rid]
            conv = req.conv
            req.stage = Stage.PREFILL
            req.admitted = self.now if req.admitted is None else req.admitted
            self._set_blocks(conv, max(conv.blocks, _blocks(conv.computed + chunk.tokens, self.bs)))
            tokens += chunk.tokens
            pairs += chunk_pairs(conv.computed, chunk.tokens)
            if not chunk.completes:
                conv.computed += chunk.tokens
        return len(prefill), tokens, pairs

    def _record(self, seconds: float, size: StepSize, epoch: int | None = None, start: float | None = None) -> None:
        start = self.now if start is None else start
        self.records.append(StepRecord("P" if size.prefill_tokens else "D", size.decode_rows, size.decode_context,
                                       size.prefill_rows, size.prefill_tokens, size.prefill_pairs, start,
                                       start + seconds, epoch))

    def _advance(self, seconds: float, size: StepSize | None) -> None:
        self.now += seconds + self.cost.gap_s
        self.steps += 1
        if size is not None:
            self.sizes.append(size)

    def _finish_decode(self, decode: tuple[int, ...], spec: Speculation | None = None) -> None:
        k = spec.tokens_at(len(decode)) if spec is not None else 0
        for rid in decode:
            req = self.active[rid]
            kept = 1
            if spec is not None:  # accepted drafts, whole tokens only; never past the turn's end
                req.credit += spec.acceptance * k
                extra = int(req.credit + 1e-9)
                req.credit -= extra
                kept += min(extra, req.output_left - 1)
            for _ in range(kept):
                req.conv.computed += 1
                self._sample(req)

    def _finish_prefill(self, prefill: tuple[PrefillChunk, ...]) -> None:
        for chunk in prefill:
            req = self.active.get(chunk.rid)
            if chunk.completes and req is not None:
                req.conv.computed = req.conv.tokens
                req.first_token = self.now
                req.stage = Stage.DECODE
                self._sample(req)

    def _sample(self, req: _Req) -> None:
        conv = req.conv
        conv.tokens += 1
        req.output_left -= 1
        if req.output_left:
            return
        del self.active[req.rid]
        conv.request, conv.last_used = None, self.now
        conv.generated += req.turn.output_tokens
        admitted = req.admitted if req.admitted is not None else req.arrival
        first = req.first_token if req.first_token is not None else self.now
        self.done.append(SimRequest(conv.key, req.turn.turn, req.arrival, admitted, first, self.now,
                                    req.turn.output_tokens, req.turn.wait_ms / 1e3))
        conv.next_turn += 1
        if conv.next_turn < len(conv.turns):
            heapq.heappush(self.releases, (self.now + conv.turns[conv.next_turn].wait_ms / 1e3, conv.index))
        else:
            self._set_blocks(conv, 0)  # the session closes: its KV goes back
            conv.computed = 0
            self.group_done[conv.index // self.config.group_size] += 1

    def _set_blocks(self, conv: _Conv, blocks: int) -> None:
        self.used_blocks += blocks - conv.blocks
        conv.blocks = blocks

    def _unblock(self) -> None:
        """Nothing fits: free KV as the engine does (`RequestTable.unblock`), the least costly first:
        the least recently used idle session's, else every waiting request's earlier turns', else
        the youngest half-finished prefill's (preempted)."""
        idle = [c for c in self.convs if c.request is None and c.blocks]
        holders = [r.conv for r in self.active.values() if r.stage is Stage.WAITING and r.conv.blocks]
        halfway = [r for r in self.active.values() if r.stage is Stage.PREFILL and r.conv.blocks]
        if idle:
            victims = [min(idle, key=lambda c: c.last_used)]
        elif holders:
            victims = holders
        elif halfway:
            req = max(halfway, key=lambda r: r.order)
            req.stage = Stage.WAITING
            self.preemptions += 1
            victims = [req.conv]
        else:
            waiting = min(self.active.values(), key=lambda r: r.order)
            raise SimulationError(f"request of conversation {waiting.conv.key!r} turn {waiting.turn.turn} needs "
                                  f"{_blocks(waiting.conv.tokens, self.bs)} KV blocks and nothing can be freed "
                                  f"({self.config.num_blocks - self.used_blocks} of {self.config.num_blocks} free); "
                                  f"raise SimConfig.num_blocks")
        for conv in victims:
            self._set_blocks(conv, 0)
            conv.computed = 0
        self.evictions += len(victims)
        self.now += self.cost.gap_s


def simulate(trace: Sequence[TraceRequest], cost: CostModel, config: SimConfig | None = None,
             policy: Priority | None = None) -> SimResult:
    """Simulate the engine of `config` with step costs `cost` on `trace` under `policy` (default:
    the priority `config.scheduler.priority` names, as the engine would run)."""
    config = config or SimConfig()
    return Simulator(trace, cost, config, policy or make_policy(config.scheduler.priority)).run()
