import numpy as np
import pytest

from megatron_rollout.trace.make import (
    MAX_INPUT_TOKENS,
    MAX_OUTPUT_TOKENS,
    MAX_TURNS,
    TARGET_INPUT_TOKENS,
    TARGET_OUTPUT_TOKENS,
    TARGET_TURNS,
    make_trace,
    write_trace,
)
from megatron_rollout.trace.schema import group_conversations, load_trace


@pytest.fixture(scope="module")
def large():
    """8 seeds x 1,000 conversations (~80k requests): averages within a few percent."""
    return [r for seed in range(8) for r in make_trace(conversations=1000, seed=seed)]


def test_paper_averages_hold_over_many_seeds(large):
    inputs = np.array([r.input_tokens for r in large])
    outputs = np.array([r.output_tokens for r in large])
    assert len(large) / 8000 == pytest.approx(TARGET_TURNS, rel=0.03)  # 9.88 turns
    assert inputs.mean() == pytest.approx(TARGET_INPUT_TOKENS, rel=0.03)  # 5,197 tokens
    assert outputs.mean() == pytest.approx(TARGET_OUTPUT_TOKENS, rel=0.03)  # 174.6 tokens
    assert inputs.sum() / outputs.sum() == pytest.approx(29.8, rel=0.05)


def test_shape_first_turn_larger_heavy_tails_and_caps(large):
    first = np.array([r.input_tokens for r in large if r.turn == 0])
    later = np.array([r.input_tokens for r in large if r.turn > 0])
    outputs = np.array([r.output_tokens for r in large])
    assert first.mean() == pytest.approx(2.0 * later.mean(), rel=0.05)
    # Heavy tails: p99 far above the median.
    assert np.percentile(later, 99) > 6 * np.median(later)
    assert np.percentile(outputs, 99) > 5 * np.median(outputs)
    assert later.max() <= MAX_INPUT_TOKENS and outputs.max() <= MAX_OUTPUT_TOKENS
    turns = [len(t) for t in group_conversations(make_trace(conversations=1000, seed=0)).values()]
    assert min(turns) == 1 and max(turns) <= MAX_TURNS and max(turns) > 40


def test_waits_zero_before_turn0_heavy_tailed_after(large):
    assert all(r.wait_ms == 0.0 for r in large if r.turn == 0)
    waits = np.array([r.wait_ms for r in large if r.turn > 0])
    assert waits.min() > 0
    assert 700 < np.median(waits) < 1100  # ~0.9 s
    assert waits.mean() == pytest.approx(1500, rel=0.05)
    assert np.percentile(waits, 99) > 8 * np.median(waits)


def test_deterministic_per_seed_and_prefix_stable():
    a = make_trace(conversations=20, seed=3)
    assert a == make_trace(conversations=20, seed=3)
    assert a != make_trace(conversations=20, seed=4)
    small = make_trace(conversations=5, seed=3)
    assert a[:len(small)] == small
    assert [r.conversation for r in small] == sorted(r.conversation for r in small)


def test_scale_shrinks_tokens_and_waits_keeping_at_least_one():
    reqs = [r for seed in range(4) for r in make_trace(conversations=500, seed=seed, scale=0.01)]
    inputs = np.array([r.input_tokens for r in reqs])
    outputs = np.array([r.output_tokens for r in reqs])
    assert inputs.min() >= 1 and outputs.min() >= 1
    assert inputs.mean() == pytest.approx(52, rel=0.05)
    assert 1.6 < outputs.mean() < 2.3
    waits = np.array([r.wait_ms for r in reqs if r.turn > 0])
    assert waits.mean() == pytest.approx(15, rel=0.1)


def test_wait_scale_overrides_and_structure_is_kept():
    full = make_trace(conversations=10, seed=1)
    tiny = make_trace(conversations=10, seed=1, scale=0.01, wait_scale=1.0)
    assert [(r.conversation, r.turn, r.wait_ms) for r in tiny] == [(r.conversation, r.turn, r.wait_ms) for r in full]
    assert [r.input_tokens for r in tiny] != [r.input_tokens for r in full]


def test_written_trace_loads_back(tmp_path):
    reqs = make_trace(conversations=6, seed=2, scale=0.1)
    write_trace(tmp_path / "t.jsonl", reqs)
    assert load_trace(tmp_path / "t.jsonl") == reqs


@pytest.mark.parametrize("kwargs, message", [
    (dict(conversations=0), "conversations must be positive"),
    (dict(scale=0.0), "scale must be a positive number"),
    (dict(wait_scale=-1.0), "wait_scale must be a number >= 0"),
    (dict(seed=-1), "seed must be >= 0"),
    (dict(scale=1e308), "scale 1e\\+308 would make requests of up to inf tokens, above a trace's limit of 16777216: "
                        "use a scale of at most 256"),  # OverflowError from round() before
    (dict(scale=1.0, wait_scale=61.0), "wait_scale 61.0 would make tool waits of up to 3.66e\\+06 ms, above a "
                                       "trace's limit of 3.6e\\+06 ms: use a wait_scale of at most 60"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_trace(**kwargs)
