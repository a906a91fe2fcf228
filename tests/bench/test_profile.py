"""The profiler bench's host-side pieces: phase clocks and the busy-time union (CPU)."""
import time
import types

import pytest

pytest.importorskip("torch.profiler")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from megatron_rollout.bench.profile import PhaseClock, _busy_us, op_table  # noqa: E402


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


def test_op_table_counts_per_call_and_keeps_the_labelled_segments():
    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with record_function("seg00 embed"):
                x @ x
            with record_function("seg01 L0.moe_exchange"):
                x + x
    table = op_table(prof, calls=2)
    assert table["launches"] == 0  # no GPU: no kernel launches
    assert [s["name"] for s in table["sections"]] == ["seg00 embed", "seg01 L0.moe_exchange"]
    assert all(s["count"] == 2 for s in table["sections"])
    assert any(r["name"] == "aten::mm" and r["count"] == 2 for r in table["by_host"])
