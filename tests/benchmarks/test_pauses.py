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
    assert pauses.collections[2] == 2 and pauses.collections[0] >= 1
    assert 0 < pauses.longest_s <= pauses.total_s
    assert pauses not in gc.callbacks
    assert pauses.to_dict() == {"collections": pauses.collections, "total_s": pauses.total_s,
                                "longest_s": pauses.longest_s}


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
    assert inside["total_s"] < pauses.total_s and inside["longest_s"] <= pauses.longest_s
    assert pauses.to_dict(window=(closed + 10, closed + 20))["in_window"] == {
        "collections": [0, 0, 0], "total_s": 0, "longest_s": 0.0}
