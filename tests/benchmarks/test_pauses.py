"""`benchmarks.pauses.GcPauses`: the collections inside its block, by generation, and nothing outside."""
from __future__ import annotations

import gc

import pytest

from benchmarks.pauses import GcPauses


@pytest.mark.timeout(30)
def test_collections_inside_the_block_are_counted_and_timed():
    gc.collect()  # outside: not counted
    with GcPauses() as pauses:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    gc.collect()
    seen = pauses.to_dict()
    assert seen["collections"][2] == 2 and seen["collections"][0] >= 1 and len(pauses.marks) == sum(seen["collections"])
    assert 0 < seen["longest_s"] <= seen["total_s"] == pytest.approx(sum(s for _, s, _ in pauses.marks))
    assert pauses not in gc.callbacks


@pytest.mark.timeout(30)
def test_the_window_keeps_the_collections_begun_in_it():
    import time

    with GcPauses() as pauses:
        gc.collect(2)
        opened = time.perf_counter()
        gc.collect(1)
        gc.collect(2)
        closed = time.perf_counter()
        gc.collect(0)
    inside = pauses.to_dict(window=(opened, closed))["in_window"]
    assert inside["collections"][1:] == [1, 1] and inside["collections"][0] <= 1
    assert inside["total_s"] < pauses.to_dict()["total_s"] and inside["longest_s"] <= pauses.to_dict()["longest_s"]
    assert pauses.to_dict(window=(closed + 10, closed + 20))["in_window"] == {
        "collections": [0, 0, 0], "total_s": 0, "longest_s": 0.0}
