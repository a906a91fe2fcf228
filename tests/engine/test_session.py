"""Multi-turn sessions (`engine/session.py`): turns prefill only what is new, closed sessions refuse
everything, idle sessions lose their KV under pressure and recompute it."""
from __future__ import annotations

import pytest

from megatron_rollout.engine import FinishReason, KVConfig, RequestError, SamplingParams, SchedulerConfig, SessionClosed

from .common import ABORT_PARAMS, SCHEDULES, SMALL, assert_same, drain, prompts, reference, small


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_session_turns_prefill_only_new_tokens(make_engine, qwen, schedule):
    _, model = qwen
    system, tool = prompts([10, 5], seed=14)
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    engine = make_engine(model, small(schedule))
    session = engine.open_session()
    session.append(system)
    first = session.generate(params)
    assert engine.stats.prefill_tokens == 10
    # Another request between the turns must not disturb the session's KV.
    other = engine.generate(prompts([9], seed=15), params)
    before = engine.stats.prefill_tokens
    session.append(tool)
    rid = session.submit(params)
    out = engine.run_until([rid])[rid]
    # The new tokens and the last sampled token (whose K/V was never computed) are prefilled.
    assert out.prompt_tokens == len(tool) + 1
    assert engine.stats.prefill_tokens - before == len(tool) + 1
    context = system + first.token_ids + tool
    assert session.token_ids == context + out.result.token_ids
    assert_same([out.result], reference(make_engine, model, [context], params))
    assert_same(other, reference(make_engine, model, prompts([9], seed=15), params))
    held = len(engine.pool.table(session.sid))
    assert held == engine.pool.blocks_for(len(session.token_ids) - 1) and engine.pool.num_free == 64 - held
    session.close()
    assert engine.pool.num_free == engine.pool.num_blocks


def test_closed_session_refuses_everything(make_engine, qwen):
    _, model = qwen
    engine = make_engine(model, SMALL)
    session = engine.open_session()
    session.append([1, 2, 3])
    rid = session.submit(ABORT_PARAMS)
    engine.step()
    session.close()  # closing a generating session aborts its request
    assert engine.step()[0].result.finish_reason is FinishReason.ABORT and rid not in engine.requests
    session.close()  # idempotent
    for call in (lambda: session.append([4]), lambda: session.submit(), lambda: session.generate()):
        with pytest.raises(SessionClosed, match=f"session {session.sid} is closed"):
            call()
    assert engine.pool.num_free == engine.pool.num_blocks and session.sid not in engine.seqs


def test_session_rules(make_engine, qwen):
    _, model = qwen
    engine = make_engine(model, SMALL)
    session = engine.open_session()
    with pytest.raises(RequestError, match="append tokens first"):
        session.submit()
    session.append([1, 2])
    session.submit(ABORT_PARAMS)
    with pytest.raises(RequestError, match="is generating"):
        session.append([3])
    with pytest.raises(RequestError, match="already has request"):
        session.submit(ABORT_PARAMS)
    drain(engine)
    session.append([3])  # after it finished: fine
    assert session.generate(ABORT_PARAMS).finish_reason is FinishReason.LENGTH


def test_idle_sessions_lose_their_kv_under_pressure_and_recompute_it(make_engine, qwen):
    _, model = qwen
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    engine = make_engine(model, scheduler=SchedulerConfig(block_size=4, max_batch_tokens=32), kv=KVConfig(num_blocks=8))
    session = engine.open_session()
    context = prompts([14], seed=16)[0]
    session.append(context)
    first = session.generate(params)
    assert len(engine.pool.table(session.sid)) == 5
    big = engine.generate(prompts([20], seed=17), params)  # needs 6 of the 8 blocks
    assert big[0].finish_reason is FinishReason.LENGTH
    assert engine.pool.table(session.sid) == []  # evicted for it
    before = engine.stats.prefill_tokens
    second = session.generate(params)
    assert engine.stats.prefill_tokens - before == len(context) + len(first.token_ids)
    assert_same([second], reference(make_engine, model, [context + first.token_ids], params))
    session.close()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_turn_with_n_samples_forks_the_session(make_engine, qwen, schedule):
    _, model = qwen
    system, tool = prompts([10, 3], seed=31)
    engine = make_engine(model, small(schedule))
    session = engine.open_session()
    session.append(system)
    rid = session.submit(SamplingParams(max_new_tokens=4, seed=2, n=3))
    out = engine.run_until([rid])[rid]
    forks = session.forks()
    assert session.forks() == []  # taken once
    assert [s.token_ids for s in [session, *forks]] == [system + r.token_ids for r in out.results]
    # a fork closed while its turn runs ends that turn alone
    for s in [session, *forks]:
        s.append(tool)
    rids = [s.submit(SamplingParams(max_new_tokens=30, seed=3)) for s in (session, forks[0])]
    engine.step()
    forks[0].close()
    done = engine.run_until([rids[0]])
    assert done[rids[0]].result.finish_reason is FinishReason.LENGTH
    assert [o.result.finish_reason for o in drain(engine).values()] == [FinishReason.ABORT]
    # forks never taken are closed with their session
    session.append(tool)
    session.generate(SamplingParams(max_new_tokens=2, seed=4, n=4))
    session.close()
    forks[1].close()
    assert engine.pool.num_free == engine.pool.num_blocks and not engine.seqs
