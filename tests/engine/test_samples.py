"""n samples of one prompt (`request.SampleGroup`, `RequestTable.accept`): one prefill, shared blocks,
the seeds' streams."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_rollout.engine import FinishReason, RequestError, SamplingParams
from megatron_rollout.engine.api import sample_seed

from .common import SCHEDULES, drain, prompts, small

SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=6, seed=7)


def separately(make_engine, model, schedule, prompt, params):
    """What n separate requests with the derived seeds give (each its own engine: nothing shared)."""
    out = []
    for i in range(params.n):
        engine = make_engine(model, small(schedule))
        out += engine.generate([prompt], dataclasses.replace(params, n=1, seed=sample_seed(params.seed, i)))
    return out


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("length", [10, 12])  # a partial last block (copied per sample), and only full blocks
def test_n_samples_prefill_once_and_equal_separate_requests(make_engine, qwen, schedule, length):
    _, model = qwen
    (prompt,) = prompts([length], seed=3)
    params = dataclasses.replace(SAMPLED, n=8)
    engine = make_engine(model, small(schedule))
    results = engine.generate([prompt], params)
    assert len(results) == 8
    assert engine.stats.prefill_tokens == length  # the prompt once, for all 8 samples
    expected = separately(make_engine, model, schedule, prompt, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    flat = [x for r in expected for x in r.logprobs]
    assert [x for r in results for x in r.logprobs] == pytest.approx(flat, abs=1e-5)
    assert len({tuple(r.token_ids) for r in results}) > 1  # the samples differ: independent draws
    assert engine.pool.num_free == engine.pool.num_blocks


def test_n_samples_share_the_prompt_blocks(make_engine, qwen):
    _, model = qwen
    (prompt,) = prompts([10], seed=4)  # blocks of 4: two full blocks shared, the third copied
    engine = make_engine(model, small("chunked"))
    rid = engine.add_request(prompt, dataclasses.replace(SAMPLED, n=4, max_new_tokens=20))
    while len(engine.requests) < 4:
        assert engine.step() == []
    tables = [engine.pool.table(r.seq.sid) for r in engine.requests.values()]
    assert len({tuple(t[:2]) for t in tables}) == 1  # one copy of the full blocks
    assert all(engine.pool.refcount[b] == 4 for b in tables[0][:2])
    assert len({t[2] for t in tables}) == 4  # each sample its own partial block
    engine.check_integrity()
    out = engine.run_until([rid])[rid]
    assert len(out.results) == 4 and out.result is out.results[0]
    assert all(r.finish_reason is FinishReason.LENGTH and len(r.token_ids) == 20 for r in out.results)


def test_greedy_samples_agree_and_a_group_mixes_with_other_requests(make_engine, qwen):
    _, model = qwen
    a, b = prompts([9, 7], seed=5)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=5)
    engine = make_engine(model, small("mux"))
    both = engine.generate([a, b], [dataclasses.replace(greedy, n=3), greedy])
    alone = make_engine(model, small("mux")).generate([a, b], greedy)
    assert [r.token_ids for r in both] == [alone[0].token_ids] * 3 + [alone[1].token_ids]


def test_abort_ends_every_sample_and_stop_ends_one(make_engine, qwen):
    _, model = qwen
    (prompt,) = prompts([6], seed=6)
    engine = make_engine(model, small("chunked"))
    rid = engine.add_request(prompt, dataclasses.replace(SAMPLED, n=3, max_new_tokens=30))
    for _ in range(4):
        engine.step()
    engine.abort(rid)
    outs = drain(engine)
    assert list(outs) == [rid]
    assert [r.finish_reason for r in outs[rid].results] == [FinishReason.ABORT] * 3
    # a stop token ends the sample that drew it; the request ends when the last sample does
    first = engine.generate([prompt], dataclasses.replace(SAMPLED, n=4, max_new_tokens=8))
    stop = first[1].token_ids[2]
    again = engine.generate([prompt], dataclasses.replace(SAMPLED, n=4, max_new_tokens=8, stop_token_ids=(stop,)))
    for full, cut in zip(first, again):
        end = full.token_ids.index(stop) + 1 if stop in full.token_ids else 8
        assert cut.token_ids == full.token_ids[:end]


def test_bad_n_and_a_group_too_large_for_the_pool(make_engine, qwen):
    _, model = qwen
    with pytest.raises(ValueError, match="n must be in"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="n must be an integer"):
        SamplingParams(n=2.0)
    engine = make_engine(model, small("chunked"))  # 64 blocks of 4
    with pytest.raises(RequestError, match="for its n=40 samples"):
        engine.add_request(prompts([8])[0], SamplingParams(n=40, max_new_tokens=8))


def test_unseeded_samples_draw_from_the_engine_stream(make_engine, qwen):
    _, model = qwen
    (prompt,) = prompts([8], seed=8)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=6)
    first = make_engine(model, small("chunked", seed=3)).generate([prompt], params)
    second = make_engine(model, small("chunked", seed=3)).generate([prompt], params)
    assert [r.token_ids for r in first] == [r.token_ids for r in second]
    assert len({tuple(r.token_ids) for r in first}) > 1


def test_sample_seed_rule():
    assert sample_seed(5, 0) == 5
    seeds = {sample_seed(s, i) for s in range(50) for i in range(1, 9)}
    assert len(seeds) == 50 * 8 and not seeds & set(range(50))  # nearby seeds never share a stream
    assert all(0 <= s < 2**64 for s in seeds)


def test_samples_over_a_latent_cache(make_engine):
    """MLA caches one row per position for both K and V: a fork copies that row's block."""
    from megatron_rollout.model.config import preset
    from megatron_rollout.model.transformer import MoETransformer

    model = MoETransformer(preset("tiny-deepseek")).init_weights(0)
    (prompt,) = prompts([10], seed=9)
    params = dataclasses.replace(SAMPLED, n=3)
    got = make_engine(model, small("chunked")).generate([prompt], params)
    want = separately(make_engine, model, "chunked", prompt, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
