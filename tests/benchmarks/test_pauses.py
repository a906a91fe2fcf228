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
