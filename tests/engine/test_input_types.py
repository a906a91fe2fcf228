"""Prompt ids given as numpy arrays or torch tensors are token ids like a list of ints.

`RequestTable.validate_tokens` (engine/bookkeeping.py) reads a 1-D array as its `.tolist()` before
checking: `if not ids` on an array would raise numpy's / torch's "truth value ... is ambiguous",
and iterating a tensor gives 0-d tensors, which are not `numbers.Integral`.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rollout.engine import FinishReason, KVConfig, RequestError, SamplingParams, SchedulerConfig

PARAMS = SamplingParams(temperature=0.0, max_new_tokens=4)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13]]


@pytest.fixture
def engine(make_engine, qwen):
    return make_engine(qwen[1], scheduler=SchedulerConfig(block_size=4, max_batch_tokens=16),
                       kv=KVConfig(num_blocks=16), max_model_len=32)


@pytest.fixture
def want(engine):
    return [r.token_ids for r in engine.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("as_array", [
    lambda p: np.array(p, dtype=np.int64),
    lambda p: np.array(p, dtype=np.int32),
    lambda p: torch.tensor(p),
    lambda p: torch.tensor(p, dtype=torch.int32),
], ids=["numpy-int64", "numpy-int32", "torch-int64", "torch-int32"])
def test_array_prompts_generate_the_same_tokens(engine, want, as_array):
    results = engine.generate([as_array(p) for p in PROMPTS], PARAMS)
    assert [r.token_ids for r in results] == want
    rid = engine.add_request(as_array(PROMPTS[0]), PARAMS)
    assert engine.run_until([rid])[rid].result.token_ids == want[0]


def test_array_session_appends(engine, want):
    session = engine.open_session()
    session.append(np.array(PROMPTS[0][:2]))
    session.append(torch.tensor(PROMPTS[0][2:] + [1]))
    assert session.token_ids == PROMPTS[0] + [1] and all(type(t) is int for t in session.token_ids)
    session.close()


def test_float_array_prompt_is_refused_for_its_request_alone(engine, want):
    results = engine.generate([PROMPTS[0], np.array([1.0, 2.0]), PROMPTS[1]], PARAMS)
    assert results[1].finish_reason is FinishReason.ERROR and "token ids must be integers" in results[1].error
    assert [results[0].token_ids, results[2].token_ids] == want
    with pytest.raises(RequestError, match="token ids must be integers"):
        engine.add_request(torch.tensor([1.0, 2.0]), PARAMS)


def _reference_check(ids: list, vocab: int) -> list[int] | str:
    """The rule token by token: the first non-integer (bools too) is named, then the first id outside."""
    import numbers

    for t in ids:
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            return f"token ids must be integers, got {t!r} ({type(t).__name__})"
    for t in ids:
        if not 0 <= t < vocab:
            return f"token id {t} is outside the vocabulary [0, {vocab})"
    return [int(t) for t in ids]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(-2, 12), st.booleans(), st.integers(0, 9).map(np.int64),
                          st.sampled_from([2.0, "3"])), max_size=12))
def test_validation_names_the_first_wrong_id_as_the_token_by_token_rule_does(ids):
    from types import SimpleNamespace

    from megatron_rollout.engine.bookkeeping import RequestTable

    table = SimpleNamespace(vocab_size=10)  # validate_tokens reads the vocabulary size alone
    want = _reference_check(ids, 10)
    try:
        got = RequestTable.validate_tokens(table, ids, allow_empty=True)
    except RequestError as e:
        got = str(e)
    assert got == want and (isinstance(got, str) or all(type(t) is int for t in got))
    if not isinstance(got, str):
        assert got is not ids  # a copy: the caller's list stays the caller's
