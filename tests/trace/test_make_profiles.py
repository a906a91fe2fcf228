"""Trace profiles: `current` is today's make_trace unchanged; `prefill` keeps the paper's 5,197 new
input / 174.6 output tokens per request (30:1) over short trajectories with short waits; `decode`
is output-heavy; `input_ids` / `conversation_inputs` give every engine the same ids."""
from __future__ import annotations

import numpy as np
import pytest

from megatron_rollout.trace.make import (
    PROFILES,
    TARGET_INPUT_TOKENS,
    TARGET_OUTPUT_TOKENS,
    Profile,
    conversation_inputs,
    input_ids,
    make_trace,
    max_context,
)
from megatron_rollout.trace.schema import group_conversations


def _many(profile: str):
    return [make_trace(conversations=1000, seed=s, profile=profile) for s in range(4)]


def test_current_is_the_default():
    assert make_trace(30, seed=2, scale=0.3) == make_trace(30, seed=2, scale=0.3, profile="current")
    assert make_trace(30, seed=2, profile=PROFILES["current"]) == make_trace(30, seed=2)


def test_prefill_profile_keeps_the_paper_s_per_request_means_on_short_trajectories():
    traces = _many("prefill")
    reqs = [r for t in traces for r in t]
    inputs = np.array([r.input_tokens for r in reqs])
    outputs = np.array([r.output_tokens for r in reqs])
    assert inputs.mean() == pytest.approx(TARGET_INPUT_TOKENS, rel=0.04)
    assert outputs.mean() == pytest.approx(TARGET_OUTPUT_TOKENS, rel=0.04)
    assert inputs.mean() / outputs.mean() == pytest.approx(29.8, rel=0.06)
    turns = [len(v) for t in traces for v in group_conversations(t).values()]
    assert np.mean(turns) == pytest.approx(3.0, rel=0.05) and max(turns) <= 8
    assert inputs.max() <= 16_384 and outputs.max() <= 1_024
    waits = [r.wait_ms for r in reqs if r.turn > 0]
    assert np.mean(waits) == pytest.approx(300.0, rel=0.1)


def test_decode_profile_is_output_heavy():
    reqs = [r for t in _many("decode") for r in t]
    assert np.mean([r.output_tokens for r in reqs]) == pytest.approx(768.0, rel=0.05)
    assert np.mean([r.input_tokens for r in reqs]) == pytest.approx(256.0, rel=0.05)


def test_unknown_profile_and_bad_profile_values_are_named():
    with pytest.raises(ValueError, match="unknown trace profile 'heavy'"):
        make_trace(2, profile="heavy")
    with pytest.raises(ValueError, match="turns_mean"):
        Profile(9.0, 8, 100.0, 1.0, 1000, 10.0, 100, 10.0)


def test_input_ids_and_max_context():
    trace = make_trace(conversations=4, seed=3, scale=0.01, profile="prefill")
    ids = conversation_inputs(trace, seed=9, vocab_size=50)
    for index, (key, turns) in enumerate(group_conversations(trace).items()):
        assert [len(x) for x in ids[key]] == [t.input_tokens for t in turns]
        assert ids[key][0] == input_ids(9, index, 0, turns[0].input_tokens, 50)
        assert all(0 <= i < 50 for x in ids[key] for i in x)
    assert conversation_inputs(trace, seed=10, vocab_size=50) != ids
    longest = max(sum(t.input_tokens + t.output_tokens for t in turns) for turns in group_conversations(trace).values())
    assert max_context(trace) == longest
