"""Top-k logprobs of generated tokens and prompt logprobs, against the model's own full forward."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rollout.engine import SamplingParams

from .common import SCHEDULES, prompts, small


def full_logp(model, ids: list[int]) -> torch.Tensor:
    """[T, V] the model's log-softmax at every position of `ids` (one causal forward, no KV cache)."""
    with torch.no_grad():
        return model.forward(torch.tensor([ids]))[0].float().log_softmax(-1)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_top_logprobs_are_the_model_logprobs(make_engine, qwen, schedule, temperature):
    _, model = qwen
    (prompt,) = prompts([11], seed=21)
    params = SamplingParams(temperature=temperature, top_k=20, max_new_tokens=6, seed=1, logprobs=3)
    (res,) = make_engine(model, small(schedule)).generate([prompt], params)
    logp = full_logp(model, prompt + res.token_ids)
    assert len(res.top_logprobs) == len(res.token_ids)
    for t, (token, top) in enumerate(zip(res.token_ids, res.top_logprobs)):
        row = logp[len(prompt) - 1 + t]  # temperature-free: the raw logits' softmax, whatever the draw used
        best = row.topk(3)
        assert list(top)[:3] == best.indices.tolist()
        assert [top[i] for i in best.indices.tolist()] == pytest.approx(best.values.tolist(), abs=1e-4)
        assert top[token] == pytest.approx(float(row[token]), abs=1e-4)  # the sampled token is always there
        assert len(top) == 3 + (token not in best.indices.tolist())
    if temperature == 0.0:  # greedy: the sampled token's logprob is the raw one too
        assert res.logprobs == pytest.approx([top[t] for t, top in zip(res.token_ids, res.top_logprobs)], abs=1e-6)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_prompt_logprobs_match_token_logprobs(make_engine, qwen, schedule):
    _, model = qwen
    (prompt,) = prompts([14], seed=22)  # several chunks of 8 and blocks of 4
    params = SamplingParams(temperature=0.0, max_new_tokens=4, prompt_logprobs=2)
    engine = make_engine(model, small(schedule))
    engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=2))  # cache the prompt's blocks
    before = engine.stats.prefill_tokens
    (res,) = engine.generate([prompt], params)
    assert engine.stats.prefill_tokens - before == len(prompt)  # computed in full, not from the cached prefix
    expected = model.token_logprobs(torch.tensor([prompt]))[0].tolist()
    logp = full_logp(model, prompt)
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(prompt)
    for t in range(1, len(prompt)):
        entry = res.prompt_logprobs[t]
        assert next(iter(entry)) == prompt[t]  # the prompt token first
        assert entry[prompt[t]] == pytest.approx(expected[t - 1], abs=1e-4)
        best = logp[t - 1].topk(2)
        assert [entry[i] for i in best.indices.tolist()] == pytest.approx(best.values.tolist(), abs=1e-4)
    # scoring the prompt changes no generated token
    (plain,) = make_engine(model, small(schedule)).generate([prompt], dataclasses.replace(params, prompt_logprobs=None))
    assert res.token_ids == plain.token_ids and plain.prompt_logprobs is None and plain.top_logprobs is None


def test_prompt_logprobs_reach_every_sample(make_engine, qwen):
    _, model = qwen
    (prompt,) = prompts([9], seed=23)
    params = SamplingParams(max_new_tokens=3, seed=4, n=3, prompt_logprobs=0, logprobs=1)
    results = make_engine(model, small("mux")).generate([prompt], params)
    expected = model.token_logprobs(torch.tensor([prompt]))[0].tolist()
    for res in results:
        assert all(len(e) == 1 for e in res.prompt_logprobs[1:])
        assert [e[t] for e, t in zip(res.prompt_logprobs[1:], prompt[1:])] == pytest.approx(expected, abs=1e-4)
        assert len(res.top_logprobs) == 3


def test_bad_logprob_values():
    for field, value, message in [("logprobs", -1, "logprobs must be None or in"),
                                  ("prompt_logprobs", 65, "prompt_logprobs must be None or in"),
                                  ("logprobs", 1.5, "logprobs must be an integer"),
                                  ("logprobs", True, "logprobs must be an integer")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**{field: value})
