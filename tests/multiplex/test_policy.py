"""Segment policies pick positive spans; LoadSelected and WaitBudget shorten spans under load."""
from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rollout.multiplex.policy import (
    UNBOUNDED_SPAN,
    FixedSpan,
    FixedSpanConfig,
    LoadSelected,
    LoadSelectedConfig,
    SegmentLoad,
    WaitBudget,
    WaitBudgetConfig,
)


def test_fixed_span():
    assert FixedSpan(3).span(SegmentLoad(100, 7, 4096)) == 3
    assert FixedSpan(FixedSpanConfig(2)).span(SegmentLoad(0, None)) == 2
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive int"):
            FixedSpan(bad)
    with pytest.raises(dataclasses.FrozenInstanceError):
        FixedSpanConfig(2).span = 3  # frozen


def test_load_selected_values():
    cfg = LoadSelectedConfig(round_overhead_us=400.0, segment_us_per_token=0.05)
    pol = LoadSelected(cfg)
    # No decode rows anywhere: P runs whole (all remaining segments, or unbounded if unknown).
    assert pol.span(SegmentLoad(0, 97, 8192)) == 97
    assert pol.span(SegmentLoad(0, None, 8192)) == UNBOUNDED_SPAN
    # s* = sqrt(2 * 400 / (rows * tokens * 0.05)): rows=1, tokens=100 -> sqrt(160) = 12.6 -> 13
    assert pol.span(SegmentLoad(1, 1000, 100)) == 13
    assert pol.span(SegmentLoad(1, 5, 100)) == 5  # never past the end
    # rows=64, tokens=8192 -> sqrt(800 / 26214.4) = 0.17 -> clamped to min_span
    assert pol.span(SegmentLoad(64, 1000, 8192)) == 1
    assert LoadSelected(LoadSelectedConfig(min_span=4)).span(SegmentLoad(64, 1000, 8192)) == 4
    assert LoadSelected(LoadSelectedConfig(max_span=6)).span(SegmentLoad(1, 1000, 1)) == 6
    assert round(math.sqrt(2 * 400 / (4 * 100 * 0.05))) == pol.span(SegmentLoad(4, 1000, 100)) == 6


def test_configs_validate():
    with pytest.raises(ValueError, match="must be positive"):
        LoadSelectedConfig(round_overhead_us=0)
    with pytest.raises(ValueError, match="max_span"):
        LoadSelectedConfig(min_span=4, max_span=2)
    with pytest.raises(ValueError, match="negative load"):
        SegmentLoad(-1, 3)
    with pytest.raises(ValueError, match="remaining_segments=0"):
        SegmentLoad(1, 0)


loads = st.builds(SegmentLoad, st.integers(0, 512), st.one_of(st.none(), st.integers(1, 400)),
                  st.integers(0, 65536))


@settings(max_examples=300, deadline=None)
@given(loads, st.integers(1, 64), st.integers(1, 4096))
def test_spans_positive_bounded_and_monotone(load, more_rows, more_tokens):
    pol = LoadSelected()
    s = pol.span(load)
    assert type(s) is int and s >= 1
    if load.remaining_segments is not None:
        assert s <= load.remaining_segments
    # More decode rows or a bigger prefill never lengthen the span.
    if load.decode_rows > 0:
        busier = SegmentLoad(load.decode_rows + more_rows, load.remaining_segments, load.prefill_tokens)
        bigger = SegmentLoad(load.decode_rows, load.remaining_segments, load.prefill_tokens + more_tokens)
        assert pol.span(busier) <= s and pol.span(bigger) <= s
    else:
        assert s == (load.remaining_segments or UNBOUNDED_SPAN)


def test_wait_budget_values():
    pol = WaitBudget(WaitBudgetConfig(budget_us=8000.0, segment_us_per_token=0.3))
    assert pol.span(SegmentLoad(0, 25, 5000)) == 25  # nothing waits: P runs whole
    assert pol.span(SegmentLoad(16, 25, 500)) == 25  # 150 us segments: 53 fit, the epoch runs whole
    assert pol.span(SegmentLoad(16, 25, 5000)) == 5  # 1,500 us segments: 5 per round
    assert pol.span(SegmentLoad(1, 25, 100_000)) == 1  # one segment already over budget
    assert pol.span(SegmentLoad(64, None, 5000)) == 5
    with pytest.raises(ValueError, match="must be positive"):
        WaitBudgetConfig(budget_us=0)


@settings(max_examples=200, deadline=None)
@given(loads, st.integers(1, 4096))
def test_wait_budget_spans_positive_bounded_and_monotone(load, more_tokens):
    pol = WaitBudget()
    s = pol.span(load)
    assert type(s) is int and 1 <= s <= (load.remaining_segments or UNBOUNDED_SPAN)
    if load.decode_rows > 0:
        bigger = SegmentLoad(load.decode_rows, load.remaining_segments, load.prefill_tokens + more_tokens)
        assert pol.span(bigger) <= s
