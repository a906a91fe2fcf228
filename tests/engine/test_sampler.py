"""Sampling and its log-probabilities, checked against values computed by hand."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rollout.engine.api import SamplingParams
from megatron_rollout.engine.sampler import Sampled, filtered_logprobs, sample, sample_row

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
    (dict(temperature=float("nan")), "temperature must be finite, got nan"),
    (dict(temperature=float("inf")), "temperature must be finite, got inf"),
    (dict(temperature="0.7"), r"temperature must be a number, got '0.7' \(str\)"),
    (dict(temperature=True), r"temperature must be a number, got True \(bool\)"),
    (dict(top_p=float("nan")), "top_p must be finite, got nan"),
    (dict(top_k=2.0), r"top_k must be an integer, got 2.0 \(float\)"),
    (dict(top_k=True), r"top_k must be an integer, got True \(bool\)"),
    (dict(max_new_tokens=8.5), r"max_new_tokens must be an integer, got 8.5 \(float\)"),
    (dict(max_new_tokens=False), r"max_new_tokens must be an integer, got False \(bool\)"),
    (dict(seed=1.0), r"seed must be an integer, got 1.0 \(float\)"),
    (dict(seed=True), r"seed must be an integer, got True \(bool\)"),
    (dict(seed=-1), r"seed must be in \[0, 2\*\*64\)"),
    (dict(stop_token_ids=(1, "2")), r"stop_token_ids entry must be an integer, got '2' \(str\)"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids must be >= 0, got -1"),
    (dict(stop_token_ids=7), r"stop_token_ids must be a sequence of token ids, got 7 \(int\)"),
    (dict(ignore_stop=1), r"ignore_stop must be True or False, got 1 \(int\)"),
])
def test_sampling_params_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_integer_like_values_are_normalised_to_python_types():
    np = pytest.importorskip("numpy")
    p = SamplingParams(temperature=1, top_k=np.int64(3), max_new_tokens=np.int32(5), seed=np.uint64(7),
                       stop_token_ids=[np.int64(4), 9])
    assert (p.temperature, p.top_k, p.max_new_tokens, p.seed, p.stop_token_ids) == (1.0, 3, 5, 7, (4, 9))
    assert [type(v) for v in (p.temperature, p.top_k, p.max_new_tokens, p.seed, *p.stop_token_ids)] == \
        [float, int, int, int, int, int]
    hash(p)  # a list given for stop_token_ids is stored as a tuple: still hashable


# ---------------------------------------------------------------- non-finite logits, row by row

NAN, INF = float("nan"), float("inf")
BAD_ROWS = [
    ([0.0, NAN, 1.0], "non-finite logits (nan)"),
    ([0.0, INF, 1.0], "non-finite logits (inf)"),
    ([NAN, INF, NEG], "non-finite logits (nan)"),
    ([NEG, NEG, NEG], "non-finite logits (-inf everywhere)"),
]


@pytest.mark.parametrize("bad, message", BAD_ROWS)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_non_finite_row_fails_alone(bad, message, temperature):
    good = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    logits = torch.stack([good[0], torch.tensor(bad), good[1]])
    params = [SamplingParams(temperature=temperature)] * 3
    out = sample(logits, params, [torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    alone = sample(good, params[:2], [torch.Generator().manual_seed(s) for s in (1, 3)])
    assert out[1] == Sampled(None, None, message) and not out[1].ok
    assert [out[0], out[2]] == alone and all(s.ok and s.error is None for s in alone)
    assert sample_row(torch.tensor(bad), params[0], torch.Generator().manual_seed(0)) == Sampled(None, None, message)


def test_non_finite_rows_in_bfloat16_and_in_a_whole_batch():
    logits = torch.tensor([[NAN, 1.0], [INF, 0.0]], dtype=torch.bfloat16)
    out = sample(logits, [SamplingParams(temperature=0.0), SamplingParams(top_k=1)], [None, None])
    assert [s.error for s in out] == ["non-finite logits (nan)", "non-finite logits (inf)"]
    assert [s.token for s in out] == [None, None]


def test_masked_tokens_are_allowed():
    logits = torch.tensor([[NEG, 1.0, NEG, 0.0]])
    greedy, sampled = (sample(logits, [SamplingParams(temperature=t, seed=0)], [torch.Generator().manual_seed(0)])[0]
                       for t in (0.0, 1.0))
    assert greedy == Sampled(1, pytest.approx(-math.log1p(math.exp(-1.0)), abs=1e-6))
    assert sampled.ok and sampled.token in (1, 3)


def test_a_tiny_temperature_is_greedy_not_nan():
    # 3 / 1e-39 overflows fp32: scaling before shifting by the max gave inf - inf = NaN
    lp = filtered_logprobs(LOGITS, SamplingParams(temperature=1e-39))
    torch.testing.assert_close(lp, _lp([0.0, NEG, NEG, NEG]))
    s = sample_row(LOGITS, SamplingParams(temperature=1e-39), torch.Generator().manual_seed(0))
    assert (s.token, s.logprob, s.error) == (0, 0.0, None)


def test_sampled_tokens_follow_the_filtered_distribution():
    """Inverse-CDF draws: over 20,000 rows the frequencies match the filtered probabilities
    (within 5 standard errors), and a filtered-out token never comes out."""
    logits = torch.tensor([2.0, 0.5, -1.0, 1.0, -9.0, 0.0])
    params = SamplingParams(temperature=0.9, top_k=5)
    p = filtered_logprobs(logits, params).exp()
    n = 20_000
    gen = torch.Generator().manual_seed(11)
    tokens = torch.tensor([s.token for s in sample(logits.expand(n, -1), [params] * n, [gen] * n)])
    freq = torch.bincount(tokens, minlength=6).double() / n
    stderr = (p.double() * (1 - p.double()) / n).sqrt()
    assert freq[4] == 0 and p[4] == 0
    assert torch.all((freq - p.double()).abs() <= 5 * stderr + 1e-12), (freq, p)
