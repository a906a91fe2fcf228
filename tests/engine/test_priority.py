"""Priorities in the engine: they reorder who is served first, never what a request computes
(greedy tokens equal FIFO's under every schedule), and every accepted request still finishes or
fails with a reason, also under KV pressure."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rollout.engine import EngineConfig, FinishReason, KVConfig, RolloutEngine, SamplingParams, SchedulerConfig
from megatron_rollout.engine.priority import PRIORITIES, MostTurns, RequestInfo, make_priority
from megatron_rollout.engine.scheduler import Stage
from megatron_rollout.model.checkpoint import load_model
from megatron_rollout.trace.make import make_trace
from megatron_rollout.trace.replay import replay

SCHEDULES = ["off", "chunked", "mux"]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_model("tiny-moe", device="cpu")


def config(schedule: str, priority: str = "fifo", num_blocks: int = 512, stretch: int | None = None) -> EngineConfig:
    return EngineConfig(scheduler=SchedulerConfig(schedule=schedule, max_batch_tokens=48, max_decode_rows=3,
                                                  priority=priority, stretch_tokens=stretch),
                        kv=KVConfig(num_blocks=num_blocks))


def tokens_by_turn(model, cfg: EngineConfig, trace) -> tuple[dict, list, object]:
    """Each turn's tokens, the forwards' shapes (decode rows, prefill chunks, prefill tokens), the report."""
    engine = RolloutEngine(model, cfg)
    details: dict = {}
    report, outputs = replay(engine, trace, seed=0, progress=False, vocab_size=model.cfg.vocab_size, details=details)
    engine.check_integrity()
    turn_of = details["turn_of"]
    shapes = [(r.decode_rows, r.prefill_rows, r.prefill_tokens) for r in details["records"]]
    return {(turn_of[o.request_id].conversation, turn_of[o.request_id].turn): o.result.token_ids
            for o in outputs}, shapes, report


def test_keys_and_names():
    info = RequestInfo(arrival_order=5, turn=2, context=300, generated=40)
    assert {name: make_priority(name).key(info) for name in PRIORITIES} == {
        "fifo": 5, "most-turns": -2, "longest-context": -300, "most-generated": -40}
    with pytest.raises(ValueError, match="priority must be one of"):
        make_priority("random")


def test_a_session_with_more_turns_is_admitted_first(model):
    """Under most-turns a second turn submitted after a first one is served before it: its view
    comes first in the planner's order, and its prefill is admitted alone when one fits."""
    engine = RolloutEngine(model, config("off", "most-turns"))
    old = engine.open_session()
    old.append(list(range(1, 20)))
    old.generate(SamplingParams(temperature=0.0, max_new_tokens=2, ignore_stop=True))
    new = engine.open_session()
    new.append(list(range(30, 70)))  # 40 tokens: the 48-token budget holds one of the two
    first = new.submit(SamplingParams(temperature=0.0, max_new_tokens=2, ignore_stop=True))
    old.append(list(range(20, 50)))
    second = old.submit(SamplingParams(temperature=0.0, max_new_tokens=2, ignore_stop=True))
    assert engine.requests[second].rank_key < engine.requests[first].rank_key
    state = engine._planning_state()
    assert [v.rid for v in sorted(state.seqs, key=lambda v: v.order)] == [second, first]
    engine.step()
    assert engine.requests[second].stage is Stage.DECODE and engine.requests[first].stage is Stage.WAITING
    fifo = RolloutEngine(model, config("off"))
    assert isinstance(engine.table.priority, MostTurns) and fifo.table.priority.name == "fifo"


@pytest.fixture(scope="module")
def trace():
    return make_trace(conversations=4, seed=3, scale=0.01)


@pytest.fixture(scope="module")
def fifo_tokens(model, trace):
    return {s: tokens_by_turn(model, config(s), trace)[:2] for s in SCHEDULES}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("priority", sorted(set(PRIORITIES) - {"fifo"}) + ["fifo+stretch"])
def test_greedy_tokens_do_not_depend_on_the_priority(model, trace, fifo_tokens, schedule, priority):
    name, _, stretch = priority.partition("+")
    tokens, shapes, report = tokens_by_turn(model, config(schedule, name, stretch=24 if stretch else None), trace)
    assert report.requests == len(trace) and report.failed == 0
    want, fifo_shapes = fifo_tokens[schedule]
    assert tokens == want
    if not stretch:  # the priority did reorder the work: other batches, the same tokens
        assert shapes != fifo_shapes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("priority", sorted(PRIORITIES))
def test_every_request_finishes_or_fails_with_a_reason_under_kv_pressure(model, schedule, priority):
    trace = make_trace(conversations=5, seed=7, scale=0.012)
    engine = RolloutEngine(model, config(schedule, priority, num_blocks=24))
    details: dict = {}
    report, outputs = replay(engine, trace, seed=0, progress=False, vocab_size=model.cfg.vocab_size, details=details)
    engine.check_integrity()
    assert report.requests + report.truncated + report.failed + report.skipped == len(trace)
    assert len(details["refused"]) + len(outputs) + report.skipped == len(trace)
    for o in outputs:
        if o.result.finish_reason is FinishReason.ERROR:
            assert o.result.error  # a reason, not a silent loss
        else:
            assert o.result.finish_reason is FinishReason.LENGTH
    assert report.requests > 0 and details["refused"]  # some ran, some were refused (with a reason, logged)


def test_stretch_tokens_shrinks_chunks_with_decode_rows():
    from megatron_rollout.engine.scheduler import SchedulerState, SeqView, plan_step

    seqs = tuple(SeqView(i, Stage.DECODE, 9, 8, 3, 3, i) for i in range(4))
    seqs += (SeqView(9, Stage.WAITING, 200, 0, 0, 0, 9),)
    state = SchedulerState(seqs, free_blocks=100)
    plain = SchedulerConfig(schedule="chunked", block_size=4, max_batch_tokens=128)
    assert plan_step(state, plain).prefill[0].tokens == 124
    stretched = dataclasses.replace(plain, stretch_tokens=200)  # 4 rows: 50 tokens each may stretch
    assert plan_step(state, stretched).prefill[0].tokens == 50
    assert plan_step(SchedulerState(seqs[:1] + seqs[4:], 100), stretched).prefill[0].tokens == 127
    tiny = dataclasses.replace(plain, stretch_tokens=8)  # at least one block still runs
    assert plan_step(state, tiny).prefill[0].tokens == 4
    with pytest.raises(ValueError, match="stretch_tokens must be a positive int"):
        SchedulerConfig(stretch_tokens=0)
