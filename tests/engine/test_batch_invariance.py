"""A seeded request's tokens and logprobs do not depend on what it shares the engine with.

On CPU every row's numerics are independent of the batch (`model.layers.linear`,
`model.attention.row_invariant_attention`): the same request alone, beside other requests,
chunked, after a cached prefix, or continued from a session gives bit-identical logprobs, under
every schedule. That is what makes a seeded GRPO run reproducible whatever the timing of its
tool calls (tests/rl/test_learning.py checks the run).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_rollout.engine import SamplingParams
from megatron_rollout.model.attention import row_invariant_attention
from megatron_rollout.model.layers import linear

from .common import SCHEDULES, SMALL, drain, prompts


def test_linear_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 32, generator=gen), torch.randn(300, 32, generator=gen)
    full = linear(x, w)
    for rows in [*range(1, 41), 99, 256, 257]:
        for start in (0, 3, 17):
            assert torch.equal(linear(x[start:start + rows], w), full[start:start + rows]), (start, rows)
    assert torch.allclose(full, F.linear(x, w), atol=1e-5)


def test_attention_rows_do_not_depend_on_how_they_are_computed():
    gen = torch.Generator().manual_seed(1)
    n, hq, hkv, d = 150, 4, 2, 8  # 150 positions: three key buckets
    q, k, v = (torch.randn(n, h, d, generator=gen) for h in (hq, hkv, hkv))
    whole = row_invariant_attention(q, k, v, 0)
    rep = hq // hkv
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(rep, 0),
                                         v.transpose(0, 1).repeat_interleave(rep, 0), is_causal=True,
                                         scale=1 / math.sqrt(d)).transpose(0, 1)
    assert torch.allclose(whole, ref, atol=1e-5)
    for p in (0, 1, 63, 64, 65, 149):  # one query at a time, as a decode step computes it
        assert torch.equal(row_invariant_attention(q[p:p + 1], k[:p + 1], v[:p + 1], p), whole[p:p + 1]), p
    for past, new in ((10, 7), (60, 9), (64, 70)):  # a continuation prefill after `past` cached positions
        got = row_invariant_attention(q[past:past + new], k[:past + new], v[:past + new], past)
        assert torch.equal(got, whole[past:past + new]), (past, new)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_seeded_request_is_the_same_alone_and_in_company(qwen, make_engine, schedule):
    _, model = qwen
    sampled = SamplingParams(temperature=1.0, max_new_tokens=8, seed=7)
    prompt = prompts([13])[0]
    alone = make_engine(model, schedule=schedule, **SMALL).generate([prompt], sampled)[0]

    others = prompts([5, 21, 9, 30, 2], seed=3)
    params = [sampled] + [SamplingParams(temperature=1.0, max_new_tokens=11, seed=i) for i in range(5)] + [sampled]
    crowd = make_engine(model, schedule=schedule, **SMALL).generate([prompt, *others, prompt], params)
    for out in (crowd[0], crowd[-1]):  # the last one's prompt is a cached prefix of the first's
        assert out.token_ids == alone.token_ids
        assert out.logprobs == alone.logprobs  # bit for bit

    # The same context as a two-turn session: its second turn continues from cached KV.
    engine = make_engine(model, schedule=schedule, **SMALL)
    session = engine.open_session()
    session.append(prompt)
    rid = session.submit(sampled)
    first = drain(engine)[rid].result
    reply = prompts([6], seed=9)[0]
    session.append(reply)
    rid = session.submit(SamplingParams(temperature=1.0, max_new_tokens=5, seed=11))
    second = drain(engine)[rid].result
    whole = make_engine(model, schedule=schedule, **SMALL).generate(
        [prompt + list(first.token_ids) + reply], SamplingParams(temperature=1.0, max_new_tokens=5, seed=11))[0]
    assert second.token_ids == whole.token_ids and second.logprobs == whole.logprobs
