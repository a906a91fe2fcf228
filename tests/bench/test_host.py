"""bench.host times the engine's host work and the static layout's fill without a GPU."""
from megatron_rollout.bench.host import engine_step_ms, fill_ms


def test_engine_step_and_fill_are_timed():
    step = engine_step_ms(rows=2, steps=5, repeats=2)
    assert 0 < step["min"] <= step["median"] <= step["max"]
    fills = fill_ms(rows=4, blocks=50, steps=4, repeats=2)
    assert set(fills) == {"full", "keyed"}
    assert all(0 < f["min"] <= f["median"] <= f["max"] for f in fills.values())
