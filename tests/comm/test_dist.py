"""DistComm: per-phase communicators, uneven collectives, and the store rendezvous (4-rank world)."""
import pytest

from megatron_rollout.comm.dist import CommConfig
from megatron_rollout.comm.facade import LocalComm
from tests.comm.worlds import SHORT_TIMEOUT_S, SLACK_S, get, world

GROUPS = {"ATP": [(0, 1), (2, 3)], "ADP": [(0, 2), (1, 3)], "FULL": [(0, 1, 2, 3)]}
GATHER_ROWS = [2, 0, 3, 1]  # rows rank r contributes to all_gather (see programs.collectives)


def _group_of(axis, rank):
    return next(g for g in GROUPS[axis] if rank in g)


@pytest.mark.parametrize("field, value", [("backend", "nccl"), ("p_exchange", "ring"), ("d_exchange", ""),
                                          ("timeout_s", 0), ("d_max_tokens", 0)])
def test_config_rejects(field, value):
    with pytest.raises(ValueError, match=f"CommConfig.{field}"):
        CommConfig(**{field: value})


def test_local_comm_gathers_one_object():
    assert LocalComm().all_gather_object({"a": 1}, "step 0") == [{"a": 1}]


def test_each_phase_owns_its_communicators():
    for r in get(world(4), "groups"):
        assert r["phases_apart"]  # P and D never share a communicator on any axis
        assert r["ep_shares_full"]  # within a phase, EP and FULL (same ranks) share one
        assert r["domain_apart"]  # a dispatch domain has its own


@pytest.mark.parametrize("phase", ["P", "D"])
@pytest.mark.parametrize("axis", ["ATP", "ADP", "FULL"])
def test_collectives_with_uneven_sizes(axis, phase):
    results = get(world(4), "collectives")
    for rank, r in enumerate(results):
        got = r[f"{phase}/{axis}"]
        group = _group_of(axis, rank)
        me = group.index(rank)
        assert got["all_reduce"] == [[float(sum(g + 1 for g in group))] * 3] * 2
        assert got["all_gather"] == [[[2.0 * i + 10 * g, 2.0 * i + 1 + 10 * g] for i in range(GATHER_ROWS[g])]
                                     for g in group]
        assert got["all_to_all"] == [[[100.0 * g + me] * 2] * ((g + me) % 3) for g in group]


def test_all_gather_object():
    for r in get(world(4), "all_gather_object"):
        assert r == [{"rank": k, "square": k * k} for k in range(4)]


def test_rendezvous_names_missing_ranks_and_context_within_timeout():
    results = get(world(4), "rendezvous_failure")
    assert [r.get("role") for r in results[2:]] == ["late", "left"]
    for rank in (0, 1):
        r = results[rank]
        assert r["missing"] == [2, 3] and r["context"] == "step 12"
        assert f"on rank {rank}: rank(s) [2, 3] did not arrive within {SHORT_TIMEOUT_S}s" in r["error"]
        assert "'step 12'" in r["error"]
        assert SHORT_TIMEOUT_S <= r["elapsed"] < SHORT_TIMEOUT_S + SLACK_S


def test_rendezvous_context_mismatch_raises_on_every_rank():
    for rank, r in enumerate(get(world(4), "rendezvous_failure")):
        assert r["mismatch"].startswith(f"RendezvousMismatch: rendezvous round 0 on rank {rank}")
        assert "{0: 'step 1', 1: 'step 1', 2: 'step 2', 3: 'step 2'}" in r["mismatch"]
