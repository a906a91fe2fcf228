"""ParallelLayout validation, and rank lists read from Megatron's parallel_state (4-rank world)."""
import pytest

from megatron_rollout.comm.groups import ParallelLayout
from tests.comm.worlds import get, world


@pytest.mark.parametrize("atp, adp, ep", [(2, 2, 2), (0, 2, 0), (2, 2, 8), (1, -1, -1)])
def test_layout_rejects_bad_sizes(atp, adp, ep):
    with pytest.raises(ValueError, match="ParallelLayout"):
        ParallelLayout(atp, adp, ep)


def test_layout_world_size():
    assert ParallelLayout(4, 2, 8).world_size == 8


def test_rank_lists_match_megatron_atp2_adp2():
    info = get(world(4), "groups")
    for rank, r in enumerate(info):
        assert r["axes"] == {"ATP": ((0, 1), (2, 3)), "ADP": ((0, 2), (1, 3)), "EP": ((0, 1, 2, 3),),
                             "FULL": ((0, 1, 2, 3),)}
        assert {a: r["mine"][a] for a in ("ATP", "ADP", "EP")} == r["megatron"]
        assert r["rank"] == {"ATP": rank % 2, "ADP": rank // 2, "EP": rank, "FULL": rank}
        assert r["size"] == {"ATP": 2, "ADP": 2, "EP": 4, "FULL": 4}
        assert r["shard"] == (rank % 2, 2, rank, 4)  # atp_rank, atp_size, ep_rank, ep_size


def test_already_initialised_parallel_state_must_match():
    for r in get(world(4), "groups"):
        assert r["mismatch"].startswith("ValueError: Megatron parallel_state is already initialised with TP=2, DP=2")
        assert "needs TP=4, DP=1, EP=4" in r["mismatch"]
