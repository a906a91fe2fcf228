"""The profiler bench's host-side pieces: phase clocks and the busy-time union (CPU)."""
import time
import types

import pytest

pytest.importorskip("torch.profiler")

from megatron_rollout.bench.profile import PhaseClock, _busy_us  # noqa: E402


def test_busy_time_is_the_union_of_overlapping_intervals():
    assert _busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert _busy_us([]) == 0


def test_phase_clock_times_wrapped_calls_and_restores_them():
    owner = types.SimpleNamespace(work=lambda s: time.sleep(s) or s)
    original = owner.work
    with PhaseClock({"work": (owner, "work")}) as clock:
        assert owner.work(0.02) == 0.02
        assert owner.work is not original
    assert owner.work is original
    assert 0.015 < clock.seconds["work"] < 0.5
