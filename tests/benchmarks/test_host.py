"""benchmarks.host times the engine's host work, the static layout's fill and sampling without a GPU."""
from benchmarks.host import engine_step_ms, fill_ms, sample_ms


def test_engine_step_and_fill_are_timed():
    step = engine_step_ms(rows=2, steps=5, repeats=2)
    assert 0 < step["min"] <= step["median"] <= step["max"]
    fills = fill_ms(rows=4, blocks=50, steps=4, repeats=2)
    assert set(fills) == {"full", "keyed"}
    assert all(0 < f["min"] <= f["median"] <= f["max"] for f in fills.values())


def test_sample_is_timed_greedy_and_sampled():
    timed = sample_ms(rows=2, vocab=64, repeats=2)
    assert set(timed) == {"t0", "t1"}
    assert all(0 < t["min"] <= t["median"] <= t["max"] for t in timed.values())
