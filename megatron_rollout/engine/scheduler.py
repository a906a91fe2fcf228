"""Step planning: a pure function from the engine's state (Python numbers) to a plan.

Every rank can run `plan_step` on the same gathered state and get the same plan, so plans agree
without a leader (docs/design.md §7). The rules:
1. Decode first: every decode row that fits gets its next position, oldest first; when KV runs
   short the youngest requests younger than the row are preempted (their blocks freed, recomputed
   later), never dropped: decode rows, and under `chunked` half-finished prefills. A request
   mid-prefill in a `mux` epoch is never preempted: its blocks are reserved. A decode row's
   drafted tokens (`SeqView.lookahead`, speculative decoding) are planned with it, and dropped,
   never preempting anyone, where its blocks do not fit them.
2. Then prefill, into what is left: `chunked` packs prefill chunks into the decode step's token
   budget, and a prefill cut short by KV ends the step's admissions (a second half-finished
   prefill beside it would only take the blocks it waits for); `off` and `mux` admit whole prompts
   as one prefill batch (an *epoch*); `off` runs it alone before decode resumes, `mux` interleaves
   it with decode iterations (the engine's job).
3. Requests whose prompt shares its first block with a prompt being prefilled wait, so they can
   reuse its blocks from the prefix cache instead of computing them again (GRPO groups).
"Oldest" is `SeqView.order`: arrival order, or the rank a `priority.Priority` gave the request.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from megatron_rollout.engine.api import Schedule
from megatron_rollout.engine.priority import PRIORITIES


class Stage(enum.Enum):
    WAITING = "waiting"  # nothing computed for the current lifetime, or preempted
    PREFILL = "prefill"  # admitted: its prefill is running or partly done (blocks reserved)
    DECODE = "decode"  # one sampled token pending: its next forward is a decode row


@dataclass(frozen=True)
class SeqView:
    rid: int
    stage: Stage
    tokens: int
    """Positions the sequence must have K/V for before its next sample (context length)."""
    computed: int
    """Positions whose K/V are already cached."""
    blocks: int
    """Blocks held."""
    freeable: int
    """Blocks that preempting it would return to the pool (not shared with others)."""
    order: int
    """Service order (smaller first): arrival, or the request's rank under `SchedulerConfig.priority`."""
    prefix_key: int | None = None
    """Hash of the first full block, for prefix sharing; None if shorter than a block."""
    lookahead: int = 0
    """Drafted tokens a decode row would verify beyond `tokens` (speculative decoding)."""

    def ahead(self, lookahead: int) -> SeqView:
        """This view with `lookahead` drafted positions (`dataclasses.replace`, without its cost per
        row and step)."""
        return SeqView(self.rid, self.stage, self.tokens, self.computed, self.blocks, self.freeable, self.order,
                       self.prefix_key, lookahead)


@dataclass(frozen=True)
class SchedulerConfig:
    schedule: Schedule = Schedule.CHUNKED
    """How prefill and decode share steps."""
    block_size: int = 16
    """Positions per KV block."""
    max_batch_tokens: int = 512
    """`chunked`: tokens per step (decode rows + prefill chunk); `off`/`mux`: tokens per prefill
    epoch (a single longer prompt is still admitted alone)."""
    max_decode_rows: int = 256
    """Decode rows per iteration."""
    priority: str = "fifo"
    """Which requests are served first (`engine.priority`): "fifo" (arrival), "most-turns",
    "longest-context" or "most-generated"."""
    stretch_tokens: int | None = None
    """`chunked`: the most prefill tokens times decode rows one step may carry, so the prefill
    mixed into a decode step stretches many rows only a little (a chunk of at least one block
    still runs); None: the token budget alone decides."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        for name in ("block_size", "max_batch_tokens", "max_decode_rows"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:  # bool, float (2.5, inf) and numpy scalars refused
                raise ValueError(f"SchedulerConfig.{name} must be a positive int, got {value!r}")
        if self.priority not in PRIORITIES:
            raise ValueError(f"SchedulerConfig.priority must be one of {sorted(PRIORITIES)}, got {self.priority!r}")
        if self.stretch_tokens is not None and (type(self.stretch_tokens) is not int or self.stretch_tokens <= 0):
            raise ValueError(f"SchedulerConfig.stretch_tokens must be a positive int or None, "
                             f"got {self.stretch_tokens!r}")


@dataclass(frozen=True)
class SchedulerState:
    seqs: tuple[SeqView, ...]
    free_blocks: int
    epoch_in_flight: bool = False
    """`mux`: an admitted prefill epoch is still running; no new one may start."""


@dataclass(frozen=True)
class PrefillChunk:
    rid: int
    tokens: int
    """Positions to compute, starting at the sequence's `computed`."""
    completes: bool
    """The chunk reaches the end of the context: its last row is sampled."""


@dataclass(frozen=True)
class StepPlan:
    decode: tuple[int, ...] = ()
    prefill: tuple[PrefillChunk, ...] = ()
    preempt: tuple[int, ...] = ()
    lookahead: tuple[int, ...] = ()
    """Per decode row (aligned with `decode`; empty: none), the drafted tokens it verifies."""

    @property
    def empty(self) -> bool:
        return not (self.decode or self.prefill)

    @property
    def decode_part(self) -> StepPlan:
        """The decode rows alone (a `mux` decode iteration), with their lookahead."""
        return StepPlan(decode=self.decode, lookahead=self.lookahead)


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def plan_step(state: SchedulerState, cfg: SchedulerConfig) -> StepPlan:
    bs = cfg.block_size
    free = state.free_blocks
    by_age = sorted(state.seqs, key=lambda s: s.order)
    decoding = [s for s in by_age if s.stage is Stage.DECODE]
    # `chunked` keeps a half-finished prefill's blocks across steps: a decode row may take them.
    chunked = cfg.schedule is Schedule.CHUNKED
    halfway = [s for s in by_age if s.stage is Stage.PREFILL and s.freeable] if chunked else []

    rows: list[SeqView] = []
    lookahead: list[int] = []
    preempt: list[int] = []
    queue = list(decoding)
    while queue and len(rows) < cfg.max_decode_rows:
        seq = queue.pop(0)
        # a row may hold more blocks than it needs (grown for drafts that were rejected): never a credit
        need = max(0, _blocks(seq.tokens + seq.lookahead, bs) - seq.blocks)
        if seq.lookahead and need > free:  # drafts never preempt: the row runs without them
            need, seq = max(0, _blocks(seq.tokens, bs) - seq.blocks), seq.ahead(0)
        while need > free:  # make room by preempting the youngest of those younger than this row
            victim = _youngest(queue, halfway, younger_than=seq.order)
            if victim is None:
                break
            preempt.append(victim.rid)
            free += victim.freeable
        if need <= free:
            rows.append(seq)
            lookahead.append(seq.lookahead)
            free -= need
        else:
            preempt.append(seq.rid)
            free += seq.freeable
    if preempt:
        gone = set(preempt)
        by_age = [s for s in by_age if s.rid not in gone]
    ahead = tuple(lookahead) if any(lookahead) else ()

    if cfg.schedule is Schedule.OFF:
        prefill = _admit_whole(by_age, free, cfg, reserve=0)
        if prefill:  # a whole prefill runs before decode resumes
            return StepPlan(decode=(), prefill=prefill, preempt=tuple(preempt))
        return StepPlan(decode=tuple(s.rid for s in rows), preempt=tuple(preempt), lookahead=ahead)
    if cfg.schedule is Schedule.MUX:
        # Decode rows keep growing while the epoch runs: keep one block per row in hand.
        prefill = () if state.epoch_in_flight else _admit_whole(by_age, free, cfg, reserve=len(rows))
        return StepPlan(decode=tuple(s.rid for s in rows), prefill=prefill, preempt=tuple(preempt), lookahead=ahead)
    budget = cfg.max_batch_tokens - len(rows) - sum(lookahead)
    if cfg.stretch_tokens is not None and rows:
        budget = min(budget, max(cfg.block_size, cfg.stretch_tokens // len(rows)))
    prefill = _admit_chunks(by_age, free, cfg, budget=budget, reserve=len(rows))
    return StepPlan(decode=tuple(s.rid for s in rows), prefill=prefill, preempt=tuple(preempt), lookahead=ahead)


def _youngest(queue: list[SeqView], halfway: list[SeqView], younger_than: int) -> SeqView | None:
    """Pop the youngest preemption victim younger than `younger_than`: the last decode row still
    queued (all of them are younger) or the last half-finished prefill, whichever is younger."""
    last_prefill = halfway[-1] if halfway and halfway[-1].order > younger_than else None
    if queue and (last_prefill is None or queue[-1].order > last_prefill.order):
        return queue.pop()
    return halfway.pop() if last_prefill is not None else None


def _candidates(by_age: list[SeqView]) -> list[SeqView]:
    """Prefills already under way first (they hold blocks), then waiting requests by age."""
    return [s for s in by_age if s.stage is Stage.PREFILL] + [s for s in by_age if s.stage is Stage.WAITING]


def _admit_whole(by_age: list[SeqView], free: int, cfg: SchedulerConfig, reserve: int) -> tuple[PrefillChunk, ...]:
    admitted: list[PrefillChunk] = []
    keys: set[int] = set()
    budget = cfg.max_batch_tokens
    for seq in _candidates(by_age):
        if seq.prefix_key is not None and seq.prefix_key in keys and seq.computed == 0:
            continue  # reuse the blocks the admitted twin is computing, next epoch
        n = seq.tokens - seq.computed
        need = _blocks(seq.tokens, cfg.block_size) - seq.blocks
        if admitted and n > budget or need > free - reserve:
            break
        admitted.append(PrefillChunk(seq.rid, n, completes=True))
        budget -= n
        free -= need
        if seq.prefix_key is not None:
            keys.add(seq.prefix_key)
    return tuple(admitted)


def _admit_chunks(by_age: list[SeqView], free: int, cfg: SchedulerConfig, budget: int,
                  reserve: int) -> tuple[PrefillChunk, ...]:
    admitted: list[PrefillChunk] = []
    keys = {s.prefix_key for s in by_age if s.stage is Stage.PREFILL and s.prefix_key is not None}
    for seq in _candidates(by_age):
        if budget <= 0:
            break
        if seq.stage is Stage.WAITING and seq.prefix_key in keys and seq.computed == 0:
            continue
        fits = (seq.blocks + free - reserve) * cfg.block_size - seq.computed  # positions free KV can hold
        n = min(seq.tokens - seq.computed, budget, fits)
        if n <= 0:
            break  # not even one position fits: wait for decode rows to finish
        need = _blocks(seq.computed + n, cfg.block_size) - seq.blocks
        admitted.append(PrefillChunk(seq.rid, n, completes=seq.computed + n == seq.tokens))
        budget -= n
        free -= need
        if seq.prefix_key is not None:
            keys.add(seq.prefix_key)
        if n == fits < seq.tokens - seq.computed:
            break  # cut short by KV: younger prompts would take the blocks this one waits for
    return tuple(admitted)
