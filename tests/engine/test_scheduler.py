"""plan_step: a pure function of Python numbers. Decode first, youngest preempted under KV
pressure, `off` prefills alone, `chunked` within its token budget, `mux` one epoch at a time,
prefix twins wait for the blocks their twin computes."""
from __future__ import annotations

import copy
import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rollout.engine.api import Schedule
from megatron_rollout.engine.scheduler import (
    PrefillChunk,
    SchedulerConfig,
    SchedulerState,
    SeqView,
    Stage,
    StepPlan,
    plan_step,
)

BS = 4
D, P, W = Stage.DECODE, Stage.PREFILL, Stage.WAITING


def cfg(schedule: Schedule, budget: int = 64, rows: int = 256) -> SchedulerConfig:
    return SchedulerConfig(schedule, block_size=BS, max_batch_tokens=budget, max_decode_rows=rows)


def decoding(rid: int, tokens: int, order: int | None = None, blocks: int | None = None, freeable: int | None = None):
    """A decode row holding the blocks of tokens - 1 positions (its pending token may need a new block)."""
    held = -(-(tokens - 1) // BS) if blocks is None else blocks
    return SeqView(rid, D, tokens, tokens - 1, held, held if freeable is None else freeable,
                   rid if order is None else order)


def waiting(rid: int, tokens: int, order: int | None = None, key: int | None = None, computed: int = 0,
            blocks: int = 0):
    return SeqView(rid, W, tokens, computed, blocks, blocks, rid if order is None else order, key)


def test_plan_is_pure_and_deterministic():
    seqs = (decoding(0, 9), decoding(1, 5), waiting(2, 30, key=7), waiting(3, 30, key=7), waiting(4, 3))
    state = SchedulerState(seqs, free_blocks=6)
    snapshot = copy.deepcopy(state)
    for schedule in Schedule:
        plans = {plan_step(state, cfg(schedule, budget=16)) for _ in range(3)}
        assert len(plans) == 1
        shuffled = list(seqs)
        random.Random(schedule.value).shuffle(shuffled)
        # The order of the views does not matter: only their `order` field does.
        assert plan_step(SchedulerState(tuple(shuffled), 6), cfg(schedule, budget=16)) == plans.pop()
    assert state == snapshot


def test_chunked_decodes_first_and_fills_the_budget_with_prefill():
    state = SchedulerState((waiting(0, 20), decoding(1, 6), decoding(2, 4), waiting(3, 10)), free_blocks=20)
    plan = plan_step(state, cfg(Schedule.CHUNKED, budget=16))
    assert plan.decode == (1, 2)  # decode rows first, even though request 0 is older
    # 16 tokens - 2 decode rows = 14 for prefill: the oldest waiting request gets a partial chunk.
    assert plan.prefill == (PrefillChunk(0, 14, completes=False),)
    assert plan.preempt == ()


def test_chunked_shrinks_a_chunk_to_the_kv_that_is_free():
    # 3 free blocks: the decode row's next position takes 1, 1 stays in hand for decode growth,
    # so one block's worth of the long prompt is prefilled rather than none of it.
    state = SchedulerState((decoding(0, BS + 1, blocks=1), waiting(1, 10 * BS)), free_blocks=3)
    plan = plan_step(state, cfg(Schedule.CHUNKED, budget=512))
    assert plan.decode == (0,)
    assert plan.prefill == (PrefillChunk(1, BS, completes=False),)
    # nothing free beyond that: no chunk at all (never a zero-token chunk)
    state = SchedulerState((decoding(0, BS + 1, blocks=1), waiting(1, 10 * BS)), free_blocks=2)
    assert plan_step(state, cfg(Schedule.CHUNKED, budget=512)).prefill == ()


def test_chunked_packs_several_prompts_and_continues_a_partial_prefill_first():
    state = SchedulerState((waiting(0, 5), SeqView(1, P, 20, 8, 2, 2, order=1), waiting(2, 4), waiting(3, 9)),
                           free_blocks=20)
    plan = plan_step(state, cfg(Schedule.CHUNKED, budget=24))
    # The prefill under way first (12 left), then by age: 0 (5), 2 (4), and 3 gets the last 3 tokens.
    assert plan.prefill == (PrefillChunk(1, 12, True), PrefillChunk(0, 5, True), PrefillChunk(2, 4, True),
                            PrefillChunk(3, 3, False))
    assert sum(c.tokens for c in plan.prefill) + len(plan.decode) == 24


@pytest.mark.parametrize("schedule", list(Schedule))
def test_preempts_the_youngest_decode_rows_under_kv_pressure(schedule):
    # Every row's pending token opens a new block; one block is free.
    rows = (decoding(0, 9, order=5), decoding(1, 5, order=1), decoding(2, 13, order=9), decoding(3, 9, order=3))
    plan = plan_step(SchedulerState(rows, free_blocks=1), cfg(schedule))
    # Oldest first: 1 (order 1) takes the free block; 3 (order 3) needs one: the youngest (2,
    # order 9) is preempted and frees 3; 0 (order 5) fits in what is left.
    assert plan.decode == (1, 3, 0)
    assert plan.preempt == (2,)
    assert plan.prefill == ()


def test_a_row_that_cannot_fit_preempts_itself_rather_than_older_rows():
    # 0 takes the free block. 1 needs one: preempting 2 frees nothing (its blocks are shared), and
    # with nobody younger left, 1 gives way itself; it never takes 0's place.
    rows = (decoding(0, 5), decoding(1, 9, freeable=2), decoding(2, 9, freeable=0))
    plan = plan_step(SchedulerState(rows, free_blocks=1), cfg(Schedule.CHUNKED))
    assert plan.decode == (0,) and plan.preempt == (2, 1)


def test_decode_rows_are_capped():
    rows = tuple(decoding(i, 6) for i in range(5))
    plan = plan_step(SchedulerState(rows, free_blocks=10), cfg(Schedule.CHUNKED, rows=3))
    assert plan.decode == (0, 1, 2) and plan.preempt == ()  # the rest wait, nobody is preempted


def test_off_runs_a_whole_prefill_alone():
    state = SchedulerState((decoding(0, 6), waiting(1, 40), waiting(2, 8)), free_blocks=30)
    plan = plan_step(state, cfg(Schedule.OFF, budget=16))
    # A prompt longer than the budget is still admitted whole when it is first; nothing joins it
    # past the budget, and decode waits for it.
    assert plan.prefill == (PrefillChunk(1, 40, completes=True),)
    assert plan.decode == ()
    plan = plan_step(SchedulerState((decoding(0, 6), waiting(1, 6), waiting(2, 8)), 30), cfg(Schedule.OFF, budget=16))
    assert plan.prefill == (PrefillChunk(1, 6, True), PrefillChunk(2, 8, True)) and plan.decode == ()
    # Nothing to prefill: decode runs.
    assert plan_step(SchedulerState((decoding(0, 6),), 30), cfg(Schedule.OFF)) == StepPlan(decode=(0,))


def test_whole_prefill_needs_its_blocks():
    state = SchedulerState((waiting(0, 17),), free_blocks=4)  # needs 5 blocks
    assert plan_step(state, cfg(Schedule.OFF)).empty
    assert plan_step(SchedulerState(state.seqs, 5), cfg(Schedule.OFF)).prefill == (PrefillChunk(0, 17, True),)


def test_mux_admits_no_new_epoch_while_one_is_in_flight():
    seqs = (decoding(0, 6), waiting(1, 8), waiting(2, 8))
    idle = plan_step(SchedulerState(seqs, 30), cfg(Schedule.MUX))
    # Unlike `off`, decode keeps running next to the admitted epoch.
    assert idle.decode == (0,) and idle.prefill == (PrefillChunk(1, 8, True), PrefillChunk(2, 8, True))
    busy = plan_step(SchedulerState(seqs, 30, epoch_in_flight=True), cfg(Schedule.MUX))
    assert busy.decode == (0,) and busy.prefill == ()


def test_mux_keeps_a_block_per_decode_row_in_hand():
    # Two decode rows whose pending tokens fit their blocks; the prompt needs 2 blocks, 3 are free:
    # admitted only if one block per decode row stays free (rows grow while the epoch runs).
    seqs = (decoding(0, 3), decoding(1, 3), waiting(2, 8))
    assert plan_step(SchedulerState(seqs, 3), cfg(Schedule.MUX)).prefill == ()
    assert plan_step(SchedulerState(seqs, 4), cfg(Schedule.MUX)).prefill == (PrefillChunk(2, 8, True),)


@pytest.mark.parametrize("schedule", list(Schedule))
def test_prefix_twins_wait_for_the_first(schedule):
    seqs = (waiting(0, 9, key=42), waiting(1, 9, key=42), waiting(2, 9, key=43), waiting(3, 9, key=42))
    plan = plan_step(SchedulerState(seqs, 30), cfg(schedule))
    assert [c.rid for c in plan.prefill] == [0, 2]
    # A twin that already found its prefix in the cache (computed > 0) does not wait.
    attached = waiting(1, 9, key=42, computed=8, blocks=2)
    plan = plan_step(SchedulerState((seqs[0], attached), 30), cfg(schedule))
    assert [c.rid for c in plan.prefill] == [0, 1]


def test_chunked_twins_wait_while_their_first_is_mid_prefill():
    first = SeqView(0, P, 40, 16, 4, 4, order=0, prefix_key=42)
    plan = plan_step(SchedulerState((first, waiting(1, 40, key=42), waiting(2, 5)), 30), cfg(Schedule.CHUNKED, 64))
    assert [c.rid for c in plan.prefill] == [0, 2]


def test_config_validation():
    with pytest.raises(ValueError, match=r"SchedulerConfig.block_size must be a positive int, got 0"):
        SchedulerConfig(Schedule.OFF, block_size=0)
    with pytest.raises(ValueError, match=r"SchedulerConfig.max_batch_tokens must be a positive int, got 0"):
        SchedulerConfig(Schedule.CHUNKED, max_batch_tokens=0)


# ---------------------------------------------------------------- properties over random states

@st.composite
def states(draw):
    n = draw(st.integers(0, 8))
    orders = draw(st.permutations(range(n)))
    seqs = []
    for rid in range(n):
        stage = draw(st.sampled_from([D, P, W]))
        tokens = draw(st.integers(1 if stage is W else 2, 40))
        if stage is D:
            held = draw(st.integers(-(-(tokens - 1) // BS), -(-tokens // BS)))
            computed = tokens - 1
        elif stage is P:
            computed = draw(st.integers(1, tokens - 1))  # a chunk ran; the last one promotes to decode
            held = -(-computed // BS)
        else:
            computed, held = 0, 0
        freeable = draw(st.integers(0, held))
        key = draw(st.sampled_from([None, 1, 2])) if computed == 0 else None
        seqs.append(SeqView(rid, stage, tokens, computed, held, freeable, orders[rid], key))
    return SchedulerState(tuple(seqs), draw(st.integers(0, 20)), draw(st.booleans()))


@settings(max_examples=300, deadline=None)
@given(state=states(), schedule=st.sampled_from(list(Schedule)), budget=st.integers(1, 48),
       rows=st.integers(1, 4))
def test_plans_respect_their_invariants(state, schedule, budget, rows):
    c = cfg(schedule, budget=budget, rows=rows)
    plan = plan_step(state, c)
    assert plan == plan_step(state, c)
    by_rid = {s.rid: s for s in state.seqs}
    prefill = [ch.rid for ch in plan.prefill]
    # Each request appears at most once, in a role its stage allows.
    roles = len(plan.decode) + len(prefill) + len(plan.preempt)
    assert len(set(plan.decode) | set(prefill) | set(plan.preempt)) == roles
    assert all(by_rid[r].stage is D for r in plan.decode)
    # Preempted: decode rows, and under `chunked` half-finished prefills (which then get no chunk).
    assert all(by_rid[r].stage is D or (schedule is Schedule.CHUNKED and by_rid[r].stage is P) for r in plan.preempt)
    assert not set(plan.preempt) & set(prefill)
    assert all(by_rid[r].stage is not D for r in prefill)
    assert len(plan.decode) <= rows
    # Decode rows go oldest first; every preempted row is younger than every row kept, except a
    # row that preempted itself after failing to fit.
    orders = [by_rid[r].order for r in plan.decode]
    assert orders == sorted(orders)
    # KV: what the plan grows fits in what is free plus what preemption frees.
    grow = sum(-(-by_rid[r].tokens // BS) - by_rid[r].blocks for r in plan.decode)
    grow += sum(max(0, -(-(by_rid[ch.rid].computed + ch.tokens) // BS) - by_rid[ch.rid].blocks) for ch in plan.prefill)
    assert grow <= state.free_blocks + sum(by_rid[r].freeable for r in plan.preempt)
    for ch in plan.prefill:
        s = by_rid[ch.rid]
        assert 0 < ch.tokens <= s.tokens - s.computed
        assert ch.completes == (s.computed + ch.tokens == s.tokens)
    if schedule is Schedule.CHUNKED:
        assert len(plan.decode) + sum(ch.tokens for ch in plan.prefill) <= max(budget, len(plan.decode))
    else:
        assert all(ch.completes for ch in plan.prefill)
        assert sum(ch.tokens for ch in plan.prefill[1:]) <= budget
    if schedule is Schedule.OFF and plan.prefill:
        assert plan.decode == ()
    if schedule is Schedule.MUX and state.epoch_in_flight:
        assert plan.prefill == ()
    keys = [by_rid[r].prefix_key for r in prefill if by_rid[r].prefix_key is not None and by_rid[r].computed == 0]
    assert len(keys) == len(set(keys))  # no two twins computed side by side


@pytest.mark.parametrize("schedule", list(Schedule))
def test_drafts_are_planned_with_their_row_and_dropped_rather_than_preempting(schedule):
    # Both rows' pending tokens fit their blocks; their drafts (lookahead) each need one more block.
    rows = (dataclasses.replace(decoding(0, 8), lookahead=2), dataclasses.replace(decoding(1, 8, order=1), lookahead=1))
    assert plan_step(SchedulerState(rows, free_blocks=2), cfg(schedule)).lookahead == (2, 1)
    plan = plan_step(SchedulerState(rows, free_blocks=1), cfg(schedule))  # the younger row runs without its draft
    assert (plan.decode, plan.lookahead, plan.preempt) == ((0, 1), (2, 0), ())
    plan = plan_step(SchedulerState(rows, free_blocks=0), cfg(schedule))
    assert (plan.decode, plan.lookahead, plan.preempt) == ((0, 1), (), ())
    assert plan.decode_part == StepPlan(decode=(0, 1))


@pytest.mark.parametrize("schedule", list(Schedule))
def test_blocks_a_row_holds_beyond_its_need_are_no_credit_for_another_rows_drafts(schedule):
    # row 0 kept the blocks of rejected drafts (3 held, 1 needed): they are its own, not free
    rows = (decoding(0, 4, blocks=3), dataclasses.replace(decoding(1, 8, order=1), lookahead=1))
    plan = plan_step(SchedulerState(rows, free_blocks=0), cfg(schedule))
    assert (plan.decode, plan.lookahead, plan.preempt) == ((0, 1), (), ())


def test_chunked_counts_drafted_tokens_in_the_step_budget():
    rows = (dataclasses.replace(decoding(0, 8), lookahead=3), waiting(1, 20))
    plan = plan_step(SchedulerState(rows, free_blocks=20), cfg(Schedule.CHUNKED, budget=16))
    assert plan.lookahead == (3,) and plan.prefill == (PrefillChunk(1, 12, completes=False),)
