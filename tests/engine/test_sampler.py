"""Sampling and its log-probabilities, checked against values computed by hand."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rollout.engine.api import SamplingParams
from megatron_rollout.engine.sampler import filtered_logprobs, sample, sample_row

# Probabilities 0.5, 0.25, 0.15, 0.1 (logits = log p + 3, a shift softmax ignores).
PROBS = [0.5, 0.25, 0.15, 0.1]
LOGITS = torch.tensor([math.log(p) + 3.0 for p in PROBS])
NEG = float("-inf")


def _lp(values):
    return torch.tensor(values, dtype=torch.float32)


def test_greedy_takes_the_argmax_with_the_raw_logprob():
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, -1.0, 4.0]])
    params = SamplingParams(temperature=0.0, top_k=1, top_p=0.1)  # filters do not change greedy's logprob
    out = sample(logits, [params, params], [None, None])
    assert [s.token for s in out] == [1, 0]
    lse0 = math.log(1 + math.exp(2) + math.exp(1))
    lse1 = math.log(math.exp(5) + math.exp(-1) + math.exp(4))
    assert out[0].logprob == pytest.approx(2 - lse0, abs=1e-6)
    assert out[1].logprob == pytest.approx(5 - lse1, abs=1e-6)
    single = sample_row(logits[1], params, None)
    assert (single.token, single.logprob) == (0, pytest.approx(5 - lse1, abs=1e-6))


def test_temperature_scales_the_logits():
    lp = filtered_logprobs(LOGITS, SamplingParams(temperature=0.5))
    # p_i ** 2 / sum p_j ** 2
    z = sum(p * p for p in PROBS)
    torch.testing.assert_close(lp, _lp([math.log(p * p / z) for p in PROBS]))
    # temperature 1 is the raw distribution
    torch.testing.assert_close(filtered_logprobs(LOGITS, SamplingParams()), _lp([math.log(p) for p in PROBS]))


def test_top_k_keeps_the_k_most_likely():
    lp = filtered_logprobs(LOGITS, SamplingParams(top_k=2))
    torch.testing.assert_close(lp, _lp([math.log(0.5 / 0.75), math.log(0.25 / 0.75), NEG, NEG]))
    # k at or above the vocabulary keeps everything
    torch.testing.assert_close(filtered_logprobs(LOGITS, SamplingParams(top_k=4)), _lp([math.log(p) for p in PROBS]))


@pytest.mark.parametrize("top_p, kept", [
    (0.45, 1),  # 0.5 already reaches 0.45
    (0.6, 2),  # 0.5 < 0.6, then 0.75 >= 0.6
    (0.7, 2),
    (0.8, 3),
    (0.95, 4),
    (1e-6, 1),  # the most likely token is always kept
])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    lp = filtered_logprobs(LOGITS, SamplingParams(top_p=top_p))
    mass = sum(PROBS[:kept])
    torch.testing.assert_close(lp, _lp([math.log(p / mass) if i < kept else NEG for i, p in enumerate(PROBS)]))


def test_top_p_keeps_the_first_token_even_when_it_is_not_first_in_the_vocabulary():
    logits = torch.tensor([0.0, 0.0, 9.0, 0.0])
    for params in (SamplingParams(top_p=1e-3), SamplingParams(top_p=1e-3, temperature=0.3)):
        lp = filtered_logprobs(logits, params)
        torch.testing.assert_close(lp, _lp([NEG, NEG, 0.0, NEG]))
        s = sample_row(logits, params, torch.Generator().manual_seed(0))
        assert (s.token, s.logprob) == (2, 0.0)


def test_temperature_then_top_k_then_top_p():
    # T = 0.5 gives p^2 / z: 0.25, 0.0625, 0.0225, 0.01 over z = 0.345 -> 0.7246, 0.1812, 0.0652, 0.0290.
    # top_k = 3 drops the last; renormalised: 0.25, 0.0625, 0.0225 over 0.335 -> 0.7463, 0.1866, 0.0672.
    # top_p = 0.8: 0.7463 < 0.8 keeps the second, 0.9328 >= 0.8 drops the third.
    lp = filtered_logprobs(LOGITS, SamplingParams(temperature=0.5, top_k=3, top_p=0.8))
    torch.testing.assert_close(lp, _lp([math.log(0.25 / 0.3125), math.log(0.0625 / 0.3125), NEG, NEG]))


def test_sampled_logprob_is_that_of_the_filtered_distribution():
    params = SamplingParams(temperature=0.7, top_k=3, seed=1)
    expected = filtered_logprobs(LOGITS, params)
    gen = torch.Generator().manual_seed(1)
    seen = set()
    for _ in range(200):
        s = sample_row(LOGITS, params, gen)
        assert s.logprob == pytest.approx(float(expected[s.token]), abs=1e-6)
        seen.add(s.token)
    assert seen == {0, 1, 2}  # the filtered token never comes out; the others all do


def test_same_seed_same_tokens_different_seed_different_tokens():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0)] * 3

    def draw(seeds):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        return [[s.token for s in sample(logits, params, gens)] for _ in range(20)]

    assert draw([1, 2, 3]) == draw([1, 2, 3])
    assert draw([1, 2, 3]) != draw([4, 5, 6])
    # Rows draw from their own generators: a row's tokens do not depend on its neighbours' seeds.
    assert [r[0] for r in draw([1, 2, 3])] == [r[0] for r in draw([1, 7, 8])]


def test_greedy_and_sampled_rows_mix_in_one_batch():
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 0.0, 50.0], [2.0, 1.0, 0.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    out = sample(logits, params, [None, torch.Generator().manual_seed(0), None])
    assert [s.token for s in out] == [1, 2, 0]
    assert sample(logits[:0], [], []) == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(max_new_tokens=0), "max_new_tokens must be positive, got 0"),
    (dict(max_new_tokens=-3), "max_new_tokens must be positive, got -3"),
])
def test_sampling_params_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
