"""The request table (`engine/bookkeeping.py`) through the engine: preemption, prefix sharing and
aborts change no other request's tokens and leave no block behind."""
from __future__ import annotations

import pytest

from megatron_rollout.engine import FinishReason, KVConfig, SamplingParams, SchedulerConfig
from megatron_rollout.engine.scheduler import Stage

from .common import ABORT_PARAMS, GREEDY, SCHEDULES, SMALL, abort_case, assert_same, prompts, reference, small


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_preemption_gives_the_same_tokens(make_engine, qwen, schedule):
    _, model = qwen
    batch = prompts([6, 9, 7, 8], seed=3)
    params = SamplingParams(temperature=0.0, max_new_tokens=10)  # each needs <= 5 blocks of 4
    tight = make_engine(model, small(schedule, kv=KVConfig(num_blocks=8),
                                     scheduler=SchedulerConfig(schedule, block_size=4, max_batch_tokens=32)))
    results = tight.generate(batch, params)
    assert tight.stats.preemptions > 0
    assert tight.stats.prefill_tokens > sum(len(p) for p in batch)  # preempted rows were recomputed
    assert_same(results, reference(make_engine, model, batch, params))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_grpo_samples_share_their_prompt_blocks(make_engine, qwen, schedule):
    _, model = qwen
    prompt = prompts([13], seed=4)[0]  # 3 full blocks of 4, and 1 token
    params = [SamplingParams(temperature=1.5, max_new_tokens=6, seed=s) for s in range(4)]
    runs = {}
    for caching in (True, False):
        engine = make_engine(model, small(schedule, kv=KVConfig(num_blocks=64, prefix_caching=caching),
                                          scheduler=SchedulerConfig(schedule, block_size=4, max_batch_tokens=64)))
        rids = [engine.add_request(prompt, p) for p in params]
        shared = None
        outs: dict = {}
        while len(outs) < 4:
            for out in engine.step():
                outs[out.request_id] = out
            if engine.stats.steps == 1:
                # Twins wait for the first only when they can reuse its blocks.
                admitted = [r for r in rids if engine.requests[r].stage is not Stage.WAITING]
                assert admitted == (rids[:1] if caching else rids)
            live = [engine.requests.get(r) for r in rids]
            if shared is None and all(r is not None and r.stage is Stage.DECODE for r in live):
                tables = [engine.pool.table(engine.requests[r].seq.sid) for r in rids]
                shared = [engine.pool.refcount[b] for b in tables[0][:3]]
                assert all(t[:3] == tables[0][:3] for t in tables) == caching
        runs[caching] = (engine.stats.prefill_tokens, [outs[r].result for r in rids], shared)
    assert runs[True][0] == 13 + 3 * 1  # the twins computed only their last token
    assert runs[False][0] == 4 * 13
    assert runs[True][2] == [4, 4, 4] and runs[False][2] == [1, 1, 1]
    assert_same(runs[True][1], runs[False][1])
    assert len({tuple(r.token_ids) for r in runs[True][1]}) > 1  # the seeds did sample differently


def test_twins_share_a_prompt_longer_than_the_chunk_budget(make_engine, qwen):
    """`chunked` with a prompt cut into several chunks: the twins wait for all of it, then share."""
    _, model = qwen
    prompt = prompts([21], seed=5)[0]
    engine = make_engine(model, small("chunked"))
    results = engine.generate([prompt] * 3, SamplingParams(temperature=0.0, max_new_tokens=3))
    assert engine.stats.prefill_tokens == 21 + 2 * 1
    assert_same(results, reference(make_engine, model, [prompt] * 3, SamplingParams(temperature=0.0, max_new_tokens=3)))


def test_prefix_cache_revives_freed_blocks(make_engine, qwen):
    """A prompt seen before, whose request finished, still finds its blocks (until reused)."""
    _, model = qwen
    prompt = prompts([17], seed=6)[0]
    engine = make_engine(model, SMALL)
    first = engine.generate([prompt], GREEDY)
    assert engine.pool.num_free == engine.pool.num_blocks
    again = engine.generate([prompt + [5]], GREEDY)  # 16 of its 18 positions are cached
    assert engine.stats.prefill_tokens == 17 + 2
    assert_same(again, reference(make_engine, model, [prompt + [5]], GREEDY))
    assert_same(first, reference(make_engine, model, [prompt], GREEDY))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_abort_while_waiting(make_engine, qwen, schedule):
    _, model = qwen
    abort_case(make_engine, model, schedule, prompts([6, 5, 7], seed=10), victim=1,
                advance=lambda e, rids: True)


def test_abort_mid_chunked_prefill(make_engine, qwen):
    _, model = qwen

    def mid_prefill(engine, rids):
        req = engine.requests[rids[0]]
        return req.stage is Stage.PREFILL and req.seq.computed > 0

    engine, _, progress = abort_case(make_engine, model, "chunked", prompts([20, 5, 6], seed=11), victim=0,
                                      advance=mid_prefill)
    assert progress == []


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_abort_while_decoding(make_engine, qwen, schedule):
    _, model = qwen
    batch = prompts([6, 5, 7], seed=13)

    def decoding(engine, rids):
        return len(engine.requests[rids[2]].output) >= 2

    _, _, progress = abort_case(make_engine, model, schedule, batch, victim=2, advance=decoding)
    full = reference(make_engine, model, batch[2:], ABORT_PARAMS)[0]
    assert len(progress) >= 2 and progress == full.token_ids[:len(progress)]


def test_run_until_an_aborted_request_returns(make_engine, qwen):
    _, model = qwen
    engine = make_engine(model, SMALL)
    rid = engine.add_request(prompts([4])[0], ABORT_PARAMS)
    engine.abort(rid)
    done = engine.run_until([rid])
    assert done[rid].result.finish_reason is FinishReason.ABORT


# ---------------------------------------------------------------- the table alone (no model)

def _table(recording: bool = False):
    from megatron_rollout.engine.bookkeeping import RequestTable
    from megatron_rollout.engine.stats import EngineStats

    return RequestTable(num_blocks=8, block_size=4, prefix_caching=False, max_model_len=32, vocab_size=50,
                        stats=EngineStats(), recording=recording)


def test_the_op_record_is_typed_and_kept_only_when_recording():
    from megatron_rollout.engine.bookkeeping import Abort, AddRequest, OpenSession, Submit

    params = SamplingParams(max_new_tokens=2)
    for recording in (False, True):
        table = _table(recording)
        seq = table.open_seq()
        seq.tokens = [1, 2]
        rid = table.submit(seq, params)
        table.record(Submit(seq.sid, params))
        other = table.add([3, 4, 5], params)
        table.abort(other)
        ops = table.take_ops()
        assert ops == ([OpenSession(), Submit(seq.sid, params), AddRequest([3, 4, 5], params), Abort(other)]
                       if recording else [])
        assert table.take_ops() == [] and rid in table.requests and other not in table.requests
        assert [o.request_id for o in table.undelivered] == [other]
        assert table.undelivered[0].result.finish_reason is FinishReason.ABORT
        table.check_integrity()


def test_a_request_finished_under_a_forward_in_flight_parks_its_blocks():
    from megatron_rollout.engine.scheduler import PrefillChunk

    table = _table()
    rid = table.add(list(range(1, 10)), SamplingParams(max_new_tokens=2))  # 9 tokens: 3 blocks of 4
    (row,), (owner,) = table.prefill_rows(PrefillChunk(rid, 9, True))
    assert row.span.new == 9 and len(row.span.table) == 3 and owner.context == 9
    table.begin_in_flight([owner])
    free = table.pool.num_free
    table.abort(rid)
    assert table.pool.num_free == free and table.parked == [-1]  # still written: not handed out
    assert not table.is_live(owner)
    table.check_integrity()
    table.end_in_flight()
    assert table.parked == [] and table.pool.num_free == table.pool.num_blocks
    table.check_integrity()


def test_prompt_logprobs_split_the_prompt_into_scoring_rows():
    from megatron_rollout.engine.scheduler import PrefillChunk

    table = _table()
    rid = table.add(list(range(1, 10)), SamplingParams(max_new_tokens=2, prompt_logprobs=1))
    rows, owners = table.prefill_rows(PrefillChunk(rid, 5, False))  # a partial chunk: positions 0..4
    assert [(r.span.past, r.span.new, r.sample) for r in rows] == [(p, 1, True) for p in range(5)]
    assert [o.scores for o in owners] == [0, 1, 2, 3, 4]
    rows, owners = table.prefill_rows(PrefillChunk(rid, 4, True))  # the rest: 5..8, position 8 samples
    assert [r.span.past for r in rows] == [5, 6, 7, 8] and all(r.sample for r in rows)
    assert [o.scores for o in owners] == [5, 6, 7, None] and owners[-1].context == 9
    assert table.stats.prefill_tokens == 9


@pytest.mark.parametrize("limit, stop", [(3, ()), (9, ()), (9, (13,))])
def test_a_run_of_tokens_is_accepted_as_one_token_at_a_time(make_engine, qwen, limit, stop):
    """`RequestTable.accept_run` (a verified row's kept drafts and the target's token) leaves the
    request, its sequence, its prefix-cache registrations and the counters as `accept` called once a
    token does, and stops at the token that finishes the request (`limit` new tokens, or a `stop`
    token)."""
    from megatron_rollout.engine.bookkeeping import SampleOwner
    from megatron_rollout.engine.request import Sampled

    _, model = qwen
    prompt = prompts([9], seed=5)[0]
    params = SamplingParams(temperature=0.0, max_new_tokens=limit, ignore_stop=not stop, stop_token_ids=stop)
    drawn = [Sampled(t, -0.5 - t / 100) for t in (11, 12, 13, 14, 15, 16)]
    states = []
    for run in (True, False):
        engine = make_engine(model, small("off", kv=KVConfig(num_blocks=32),
                                          scheduler=SchedulerConfig("off", block_size=4, max_batch_tokens=64)))
        rid = engine.add_request(prompt, params)
        engine.step()  # the prefill and its first token
        table, req = engine.table, engine.requests[rid]
        owner = SampleOwner(req, req.lifetime, req.seq.computed + 1)
        engine.pool.grow(req.seq.sid, owner.context + len(drawn))  # as the verify forward's plan does
        if run:
            outs = table.accept_run(owner, drawn, 0, 1.0)
        else:
            for j, d in enumerate(drawn):
                outs = table.accept(owner._replace(context=owner.context + j), [d], 0, 1.0)
                if outs:
                    break
        seq = req.seq
        states.append((list(req.output), list(req.logprobs), list(seq.tokens), seq.computed, seq.registered,
                       engine.stats.decode_tokens, [(o.request_id, o.result.finish_reason) for o in outs]))
    assert states[0] == states[1]
    output, _, _, computed, registered, _, finished = states[0]
    if limit == 3:  # the first token plus two of the run: the third of the run is never taken
        assert output == [output[0], 11, 12] and finished and finished[0][1] is FinishReason.LENGTH
    elif stop:  # the run's third token stops it
        assert output[1:] == [11, 12, 13] and finished and finished[0][1] is FinishReason.STOP
    else:
        assert output[1:] == [11, 12, 13, 14, 15, 16] and not finished and registered == computed // 4


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_row_key_names_a_table_that_only_grows_by_appending(make_engine, qwen, schedule):
    """The promise the CUDA runner's table caches rest on (`SpanInput.key`): every table a forward
    sees under one key extends the one seen before, across a session's turns, preemptions (tight KV)
    and idle sessions evicted under pressure."""
    _, model = qwen
    engine = make_engine(model, small(schedule, kv=KVConfig(num_blocks=14),
                                      scheduler=SchedulerConfig(schedule, block_size=4, max_batch_tokens=16)))
    seen: dict = {}
    forward = engine.runner.forward

    def spy(inputs, phase):
        for row in inputs:
            if row.key is not None:
                before = seen.get(row.key, ())
                assert row.span.table[:len(before)] == before, (row.key, before, row.span.table)
                seen[row.key] = row.span.table
        return forward(inputs, phase)

    engine.runner.forward = engine.executor.runner.forward = spy
    sessions = [engine.open_session() for _ in range(3)]
    for turn in range(3):
        for i, s in enumerate(sessions):
            s.append(prompts([5 + i + turn], seed=10 * turn + i)[0])
        rids = [s.submit(SamplingParams(temperature=0.0, max_new_tokens=6)) for s in sessions]
        engine.run_until(rids)
    assert {sid for sid, _ in seen} == {s.sid for s in sessions}  # every row keyed by its session's sequence
    assert any(epoch > 0 for _, epoch in seen)  # blocks were dropped and the table built again, under a new key
