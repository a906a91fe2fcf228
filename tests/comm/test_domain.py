"""The dispatch-domain state machine, stale objects, and rank-order checks (2-rank world)."""
from tests.comm.worlds import SHORT_TIMEOUT_S, SLACK_S, TIMEOUT_S, get, world


def test_normal_domain_transitions():
    for r in get(world(2), "normal_transitions"):
        assert r["log"] == [
            ("start", "idle"),
            ("notify while notified", "IllegalTransition"),
            ("after dispatch", "dispatched"),
            ("dispatch again", "StaleDispatch"),
            ("cancel dispatched", "StaleDispatch"),
            ("notify while dispatched", "IllegalTransition"),  # one result outstanding at most
            ("combine again", "StaleDispatch"),
            ("after cancel", "idle"),
            ("dispatch cancelled", "StaleDispatch"),
            ("after abandon", "retired"),
            ("notify retired", "DomainRetired"),
            ("combine retired", "DomainRetired"),
            ("after reset", "idle"),
            ("combine pre-reset handle", "StaleDispatch"),
            ("dispatch pre-reset pending", "StaleDispatch"),
        ]
        assert r["generations"] == [0, 2] and r["final"] == "idle"
        assert len(r["errors"]) == 2 and max(r["errors"]) < 1e-5  # before and after the resets


def test_low_latency_domain_double_buffer():
    for r in get(world(2), "low_latency_transitions"):
        assert r["log"] == [("two outstanding", "dispatched"), ("third notify", "IllegalTransition"),
                            ("combine out of order", "IllegalTransition"), ("over capacity", "ValueError"),
                            ("after refusal", "idle")]
        assert r["slots"] == [0, 1]  # the two outstanding results live in different buffers
        assert r["static_rows"] == 2 * 16  # EP ranks x d_max_tokens, allocated once
        assert len(r["errors"]) == 2 and max(r["errors"]) < 1e-5


def test_rank_order_mismatch_raises_on_every_rank():
    results = get(world(2), "sequence_mismatch")
    for rank, r in enumerate(results):
        assert r["before"] == [0.0] and r["after"] == [0.0]
        assert r["error"].startswith(f"D/low_latency on EP rank {rank}: count exchange out of order")
        assert r["elapsed"] < TIMEOUT_S / 3  # detected from the counts, not by waiting for the timeout
        assert r["state"] == "retired" and r["refused"].startswith("DomainRetired")
    # rank 1 reset alone after dispatch #7: it is at #0 while rank 0 is at #8
    assert "this rank is at dispatch #8 but EP rank(s) [1] sent #[0]" in results[0]["error"]
    assert "this rank is at dispatch #0 but EP rank(s) [0] sent #[8]" in results[1]["error"]


def test_peer_that_never_notifies_times_out():
    r0, r1 = get(world(2), "peer_never_notifies")
    assert r1 == {"role": "absent"}
    assert r0["error"].startswith(f"P/normal on EP rank 0: count exchange #0 did not complete within "
                                  f"{SHORT_TIMEOUT_S}s")
    assert SHORT_TIMEOUT_S <= r0["elapsed"] < SHORT_TIMEOUT_S + SLACK_S
    assert r0["state"] == "retired"
    assert r0["reset"].startswith("DomainError: P/normal: cannot reset: its communicator failed")
