"""DeepSeek-V3 in the engine on CPU: a seeded request's tokens and logprobs are bit-identical alone
and in company under every schedule (MLA's absorbed projections and the scored router keep each
row's numerics independent of its batch, as the rest of the model does)."""
from __future__ import annotations

import pytest
import torch

from megatron_rollout.engine import SamplingParams
from megatron_rollout.model import checkpoint as ckpt
from tests.model.test_deepseek import make_checkpoint

from .common import SCHEDULES, SMALL


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek")
    make_checkpoint("yarn-grouped", path)
    return ckpt.load_pretrained(path)


def _prompts(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 96, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_seeded_request_is_the_same_alone_and_in_company(deepseek, make_engine, schedule):
    sampled = SamplingParams(temperature=1.0, max_new_tokens=8, seed=7)
    prompt = _prompts([13], seed=1)[0]
    alone = make_engine(deepseek, schedule=schedule, **SMALL).generate([prompt], sampled)[0]
    others = _prompts([5, 21, 9, 2], seed=3)
    params = [sampled] + [SamplingParams(temperature=1.0, max_new_tokens=11, seed=i) for i in range(4)] + [sampled]
    crowd = make_engine(deepseek, schedule=schedule, **SMALL).generate([prompt, *others, prompt], params)
    for out in (crowd[0], crowd[-1]):
        assert out.token_ids == alone.token_ids
        assert out.logprobs == alone.logprobs  # bit for bit
