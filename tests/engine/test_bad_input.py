"""Bad input gets a clear error for that request (or trace line) alone: the engine keeps serving
the others, with the tokens they would have had anyway, and its KV bookkeeping stays sound."""
from __future__ import annotations

import json
import re

import pytest

from megatron_rollout.engine import (
    FinishReason,
    KVConfig,
    RequestError,
    SamplingParams,
    SchedulerConfig,
    Session,
    SessionClosed,
)
from megatron_rollout.engine.request import Seq
from megatron_rollout.trace.schema import TraceError, load_trace, load_trace_lenient

from .conftest import V

PARAMS = SamplingParams(temperature=0.0, max_new_tokens=4)
GOOD = [[5, 6, 7], [9, 10, 11, 12, 13]]


@pytest.fixture
def engine(make_engine, qwen):
    return make_engine(qwen[1], scheduler=SchedulerConfig(block_size=4, max_batch_tokens=16),
                       kv=KVConfig(num_blocks=16), max_model_len=32)


def test_one_bad_prompt_among_good_ones(engine, make_engine, qwen):
    bad = {
        "empty": ([], "empty prompt"),
        "over vocab": ([1, V, 2], f"token id {V} is outside the vocabulary \\[0, {V}\\)"),
        "negative": ([-1], "token id -1 is outside the vocabulary"),
        "not an int": ([1, "7"], "token ids must be integers, got '7' \\(str\\)"),
        "float": ([1, 2.0], "token ids must be integers, got 2.0 \\(float\\)"),
        "bool": ([1, True], "token ids must be integers, got True \\(bool\\)"),
        "too long": (list(range(1, 33)), "context of 32 tokens leaves no room to generate \\(max_model_len 32\\)"),
    }
    roomy = make_engine(qwen[1], scheduler=SchedulerConfig(block_size=4), kv=KVConfig(num_blocks=16))
    alone = roomy.generate(GOOD, PARAMS)
    for name, (prompt, message) in bad.items():
        results = engine.generate([GOOD[0], prompt, GOOD[1]], PARAMS)
        assert results[1].finish_reason is FinishReason.ERROR, name
        assert results[1].token_ids == [] and results[1].logprobs == [] and results[1].weight_version == -1
        assert results[1].error is not None
        assert re.search(message, results[1].error), (name, results[1].error)
        assert [r.token_ids for r in (results[0], results[2])] == [r.token_ids for r in alone], name
        assert all(r.finish_reason is FinishReason.LENGTH for r in (results[0], results[2]))
        engine.check_integrity()
    assert engine.pool.num_free == engine.pool.num_blocks and not engine.seqs and not engine.requests


def test_request_larger_than_the_kv_pool(make_engine, qwen):
    engine = make_engine(qwen[1], scheduler=SchedulerConfig(block_size=4), kv=KVConfig(num_blocks=4))
    results = engine.generate([[1] * 10, [2, 3]], [SamplingParams(max_new_tokens=7), SamplingParams(max_new_tokens=3)])
    assert results[0].finish_reason is FinishReason.ERROR
    assert "request needs 5 KV blocks, the pool holds 4" in results[0].error
    assert results[1].finish_reason is FinishReason.LENGTH and len(results[1].token_ids) == 3


def test_add_request_raises_request_error(engine):
    with pytest.raises(RequestError, match="empty prompt"):
        engine.add_request([], PARAMS)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request([V + 5], PARAMS)
    assert not engine.seqs and not engine.requests  # nothing half-registered
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        engine.generate(GOOD, [PARAMS])


@pytest.mark.parametrize("kwargs", [dict(max_new_tokens=0), dict(max_new_tokens=-1)])
def test_non_positive_max_new_tokens(kwargs):
    with pytest.raises(ValueError, match=f"max_new_tokens must be positive, got {kwargs['max_new_tokens']}"):
        SamplingParams(**kwargs)


def test_bad_session_input_keeps_the_session_usable(engine):
    session = engine.open_session()
    with pytest.raises(RequestError, match="outside the vocabulary"):
        session.append([1, V])
    assert session.token_ids == []  # a refused append adds nothing
    session.append([3, 4])
    assert session.generate(PARAMS).finish_reason is FinishReason.LENGTH
    session.append(list(range(1, 27)))  # 2 + 4 + 26 = 32 tokens: no room left
    with pytest.raises(RequestError, match="leaves no room to generate"):
        session.submit(PARAMS)
    assert not engine.requests
    session.close()


def test_closed_and_unknown_sessions(engine):
    session = engine.open_session()
    session.append([1, 2])
    session.close()
    with pytest.raises(SessionClosed, match="is closed"):
        session.generate(PARAMS)
    with pytest.raises(SessionClosed):
        session.append([3])
    # A session object for a sequence this engine never opened (or already dropped).
    stranger = Session(engine.table, Seq(12345, tokens=[1, 2], session=True), engine.run_until)
    with pytest.raises(RequestError, match="unknown session 12345"):
        stranger.submit(PARAMS)
    assert not engine.requests
    assert engine.generate(GOOD, PARAMS)[0].finish_reason is FinishReason.LENGTH  # still serving


# ---------------------------------------------------------------- trace files

def _write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _req(conversation, turn, **kw):
    return {"conversation": conversation, "turn": turn, "input_tokens": 5, "output_tokens": 2, "wait_ms": 0.0, **kw}


@pytest.mark.parametrize("line, message", [
    ('{"conversation": 1, "turn": 0,', "malformed JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"conversation": 1, "turn": 0, "input_tokens": 5, "output_tokens": 2}, "missing field.*'wait_ms'"),
    (_req(1, 0, wait=3), "unexpected field.*'wait'"),
    (_req(1, 0, input_tokens=0), "'input_tokens' must be a positive integer, got 0"),
    (_req(1, 0, output_tokens=2.0), "'output_tokens' must be a positive integer, got 2.0"),
    (_req(1, 0, wait_ms=-1), "'wait_ms' must be a finite number >= 0"),
    (_req(0, 2), "conversation 0: turn 2 where turn 1 was expected"),
])
def test_malformed_trace_line_is_named_by_line_number(tmp_path, line, message):
    path = _write(tmp_path / "t.jsonl", [_req(0, 0), "", _req(2, 0), line, _req(2, 1)])
    with pytest.raises(TraceError, match=f"t.jsonl:4: .*{message}") as info:
        load_trace(path)
    assert info.value.line == 4
    lenient = load_trace_lenient(path)
    assert [e.line for e in lenient.errors] == [4]
    assert [(r.conversation, r.turn) for r in lenient.requests] == [(0, 0), (2, 0), (2, 1)]


def test_empty_trace(tmp_path):
    with pytest.raises(TraceError, match="no requests"):
        load_trace(_write(tmp_path / "empty.jsonl", [""]))


def test_numpy_and_torch_integer_ids_are_accepted_as_ints(engine):
    import numpy as np
    import torch

    want = [r.token_ids for r in engine.generate(GOOD, PARAMS)]
    as_numpy = [list(np.array(p, dtype=np.int64)) for p in GOOD]
    assert [r.token_ids for r in engine.generate(as_numpy, PARAMS)] == want
    session = engine.open_session()
    session.append([torch.tensor(t).item() for t in GOOD[0]])
    session.append([np.int32(GOOD[1][0])])
    assert all(type(t) is int for t in session.token_ids)
    session.close()
