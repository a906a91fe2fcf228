"""Non-finite logits fail their own request only, under every schedule, and leave no trace.

A NaN in one embedding row is a NaN weight that only prompts containing that token id see: their
logits are NaN, everybody else's are not. The request whose row is NaN finishes as ERROR with the
sampler's reason, the position and the weight version; co-batched requests produce the tokens
they produce alone; the engine keeps serving, and the freed blocks that held NaN K/V poison no
later request.
"""
from __future__ import annotations

import copy

import pytest
import torch

from megatron_rollout.engine import EngineConfig, FinishReason, KVConfig, SamplingParams, SchedulerConfig

BAD = 77  # the token id whose embedding row is NaN
PROMPTS = [[5, 6, 7, 8, 9], [11, BAD, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
PARAMS = [SamplingParams(temperature=0.0, max_new_tokens=6), SamplingParams(temperature=0.0, max_new_tokens=6),
          SamplingParams(temperature=0.8, top_k=20, max_new_tokens=6, seed=3)]
def config(schedule: str) -> EngineConfig:
    return EngineConfig(scheduler=SchedulerConfig(schedule, block_size=4, max_batch_tokens=8),
                        kv=KVConfig(num_blocks=24))


@pytest.fixture(scope="module")
def nan_model(qwen):
    model = copy.deepcopy(qwen[1])
    with torch.no_grad():
        model.embedding.word_embeddings.weight[BAD] = float("nan")
    return model


@pytest.mark.parametrize("schedule", ["off", "chunked", "mux"])
def test_a_nan_row_fails_its_request_alone(make_engine, qwen, nan_model, schedule):
    engine = make_engine(nan_model, config(schedule))
    results = engine.generate(PROMPTS, PARAMS)
    bad = results[1]
    assert bad.finish_reason is FinishReason.ERROR and bad.token_ids == [] and bad.logprobs == []
    assert bad.error == f"request 3: non-finite logits (nan) at position {len(PROMPTS[1])} under weight version 0"
    clean = make_engine(qwen[1], config(schedule))
    for got, want in zip([results[0], results[2]], clean.generate([PROMPTS[0], PROMPTS[2]], [PARAMS[0], PARAMS[2]])):
        assert got.finish_reason is FinishReason.LENGTH and got.token_ids == want.token_ids
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    # The failed request's blocks held NaN K/V; they are reused now, and nobody sees it.
    engine.check_integrity()
    again = engine.generate([PROMPTS[2], PROMPTS[0], PROMPTS[0][:3]], [PARAMS[2], PARAMS[0], PARAMS[0]])
    want = clean.generate([PROMPTS[2], PROMPTS[0], PROMPTS[0][:3]], [PARAMS[2], PARAMS[0], PARAMS[0]])
    assert [r.token_ids for r in again] == [r.token_ids for r in want]
    assert all(r.finish_reason is FinishReason.LENGTH for r in again)


@pytest.mark.parametrize("greedy", [False, True])
def test_under_lookup_drafts_a_nan_row_fails_alone(make_engine, qwen, nan_model, greedy):
    """Under n-gram drafting, every row sampled (the verifier decides them together and checks them
    itself, with no separate read of every row's argmax) or the NaN row greedy (found in that read):
    the NaN row fails alone, with the plain sampler's reason."""
    from megatron_rollout.engine import SpeculativeConfig

    def drafting() -> EngineConfig:
        return EngineConfig(scheduler=SchedulerConfig("chunked", block_size=4, max_batch_tokens=8),
                            kv=KVConfig(num_blocks=24), speculative=SpeculativeConfig("ngram", 2, ngram_min=1))

    params = PARAMS if greedy else [SamplingParams(temperature=0.8, top_k=20, max_new_tokens=6, seed=i)
                                    for i in range(3)]
    results = make_engine(nan_model, drafting()).generate(PROMPTS, params)
    bad = results[1]
    assert bad.finish_reason is FinishReason.ERROR and bad.token_ids == []
    assert bad.error == f"request 3: non-finite logits (nan) at position {len(PROMPTS[1])} under weight version 0"
    want = make_engine(qwen[1], drafting()).generate([PROMPTS[0], PROMPTS[2]], [params[0], params[2]])
    for got, ref in zip([results[0], results[2]], want):
        assert got.finish_reason is FinishReason.LENGTH and got.token_ids == ref.token_ids


def test_a_session_turn_that_turns_nan_fails_and_the_session_goes_on(make_engine, qwen, nan_model):
    engine = make_engine(nan_model, config("chunked"))
    session = engine.open_session()
    session.append(PROMPTS[0])
    first = session.generate(PARAMS[0])
    assert first.finish_reason is FinishReason.LENGTH
    session.append([BAD])  # the tool answered with the poisoned token
    second = session.generate(PARAMS[0])
    context = len(PROMPTS[0]) + len(first.token_ids) + 1
    assert second.finish_reason is FinishReason.ERROR and second.token_ids == []
    assert f"non-finite logits (nan) at position {context} under weight version 0" in second.error
    assert engine.requests == {} and engine.seqs[session.sid].request is None
    session.close()
    engine.check_integrity()
