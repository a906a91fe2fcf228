"""Step execution (`engine/execution.py`): sampling with seeds in any batch and schedule, stop tokens,
max_new_tokens and the context limit."""
from __future__ import annotations

import pytest

from megatron_rollout.engine import FinishReason, SamplingParams

from .common import SMALL, assert_same, prompts, reference, small
from .conftest import V


def test_same_seed_same_tokens_in_any_batch_and_schedule(make_engine, qwen):
    _, model = qwen
    batch = prompts([5, 12, 8], seed=7)
    seeded = [SamplingParams(temperature=2.0, max_new_tokens=8, seed=s) for s in (11, 12, 13)]
    base = make_engine(model, small("chunked")).generate(batch, seeded)
    # Reversed order, with an unseeded neighbour, under mux.
    mixed = make_engine(model, small("mux")).generate(
        batch[::-1] + [batch[0]], seeded[::-1] + [SamplingParams(temperature=2.0, max_new_tokens=8)])
    assert_same(mixed[:3][::-1], base)
    alone = make_engine(model, small("off")).generate([batch[1]], [seeded[1]])
    assert_same(alone, base[1:2])
    other = make_engine(model, SMALL).generate(batch, [SamplingParams(temperature=2.0, max_new_tokens=8, seed=s)
                                                        for s in (21, 22, 23)])
    assert all(o.token_ids != b.token_ids for o, b in zip(other, base))
    greedy = make_engine(model, SMALL).generate(batch, SamplingParams(temperature=0.0, max_new_tokens=8))
    assert any(g.token_ids != b.token_ids for g, b in zip(greedy, base))


def test_stop_tokens_end_a_request_and_are_kept(make_engine, qwen):
    _, model = qwen
    batch = prompts([7, 4], seed=8)
    full = reference(make_engine, model, batch, SamplingParams(temperature=0.0, max_new_tokens=8))
    stop = full[0].token_ids[3]
    cut = full[0].token_ids.index(stop) + 1
    engine = make_engine(model, SMALL)
    res = engine.generate(batch, [SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop, V - 1)),
                                  SamplingParams(temperature=0.0, max_new_tokens=8)])
    assert res[0].token_ids == full[0].token_ids[:cut] and res[0].finish_reason is FinishReason.STOP
    assert res[0].logprobs == pytest.approx(full[0].logprobs[:cut], abs=1e-4)
    assert_same(res[1:], full[1:])  # its neighbour runs on
    forced = engine.generate(batch[:1], SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,),
                                                       ignore_stop=True))
    assert_same(forced, full[:1])


def test_max_new_tokens_and_the_context_limit(make_engine, qwen):
    _, model = qwen
    batch = prompts([3, 10], seed=9)
    full = reference(make_engine, model, batch, SamplingParams(temperature=0.0, max_new_tokens=8))
    engine = make_engine(model, small(max_model_len=12))
    res = engine.generate(batch, [SamplingParams(temperature=0.0, max_new_tokens=n) for n in (1, 8)])
    assert res[0].token_ids == full[0].token_ids[:1] and res[0].finish_reason is FinishReason.LENGTH
    # 10 prompt tokens in a 12-token context: 2 tokens, then the context is full.
    assert res[1].token_ids == full[1].token_ids[:2] and res[1].finish_reason is FinishReason.LENGTH
