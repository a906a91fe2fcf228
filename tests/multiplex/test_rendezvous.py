"""Store-backed rendezvous on four gloo ranks (the shared `mux_world`, see conftest.py): payloads,
mismatch, and timeouts that name the missing rank on every rank that arrived."""
from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from megatron_rollout.comm import dist as comm_dist
from megatron_rollout.multiplex.rendezvous import LocalRendezvous, Rendezvous, RendezvousMismatch, RendezvousTimeout


def test_errors_are_comm_errors():
    exc = RendezvousTimeout([3], 9, 13, "post-D", 1.5, 0)
    assert isinstance(exc, comm_dist.RendezvousTimeout) and isinstance(exc, TimeoutError)
    assert exc.missing == (3,) and (exc.epoch, exc.boundary, exc.tag) == (9, 13, "post-D")
    assert issubclass(RendezvousMismatch, comm_dist.RendezvousMismatch)


def test_local_rendezvous():
    rdv = LocalRendezvous()
    assert rdv.meet(1, 0, "pre-D", (3, 4)) == [(3, 4)] and rdv.size == 1
    with pytest.raises(ValueError, match="rendezvous tag 'mid'"):
        rdv.meet(1, 0, "mid")
    with pytest.raises(TypeError, match="payload\\[0\\] must be a Python int"):
        rdv.meet(1, 0, "post-D", (1.5,))


def rank_checks(rank: int) -> dict:
    out: dict = {}
    rdv = Rendezvous(timeout_s=30, name="payloads")
    assert rdv.ranks == (0, 1, 2, 3) and rdv.rank == rank
    seen = [rdv.meet(5, b, "pre-D" if b % 2 else "post-D", (rank, b * rank)) for b in range(20)]
    out["payloads"] = seen[7]
    out["all_consistent"] = all(s == [(r, b * r) for r in range(4)] for b, s in enumerate(seen))
    # Keys of finished meetings are deleted by their owner (all but the last are gone).
    assert rdv.prefix == "megatron_rollout/rendezvous/payloads.0/0-1-2-3/"
    store = dist.PrefixStore(rdv.prefix, dist.distributed_c10d._get_default_store())
    out["old_key_gone"] = not store.check([f"3/{rank}"])
    # A subgroup meets without the others.
    sub = dist.new_group([0, 1])
    if rank < 2:
        out["sub"] = Rendezvous(sub, timeout_s=30, name="sub").meet(0, 0, "pre-D", (rank + 10,))
    # Ranks at different points of the protocol: every rank learns who is where.
    mism = Rendezvous(timeout_s=30, name="mismatch")
    try:
        mism.meet(2, 4, "post-D" if rank == 2 else "pre-D")
    except RendezvousMismatch as exc:
        out["mismatch"] = str(exc)
    # Rank 3 never comes: ranks 0..2 raise, naming rank 3, the epoch and the boundary.
    late = Rendezvous(timeout_s=1.5, name="timeout")
    if rank < 3:
        t0 = time.monotonic()
        try:
            late.meet(9, 13, "post-D")
        except RendezvousTimeout as exc:
            out["timeout"] = (exc.missing, exc.epoch, exc.boundary, exc.tag, str(exc), time.monotonic() - t0)
        try:
            late.meet(9, 14, "pre-D")
        except RuntimeError as exc:
            out["poisoned"] = str(exc)
    # Everyone still meets on a fresh rendezvous afterwards (the world is intact); rebuilding one
    # with the failed one's name starts a new generation that ignores the stale keys.
    out["after"] = Rendezvous(timeout_s=30, name="after").meet(10, 0, "pre-D", (1,))
    again = Rendezvous(timeout_s=30, name="timeout")
    out["rebuilt"] = (again.prefix, again.meet(9, 13, "post-D", (rank,)))
    return out


def test_four_ranks(mux_world):
    res = [r["rendezvous"] for r in mux_world]
    for r in res:
        assert isinstance(r, dict), r  # a str is the rank's traceback
    for rank, r in enumerate(res):
        assert r["payloads"] == [(0, 0), (1, 7), (2, 14), (3, 21)] and r["all_consistent"] and r["old_key_gone"]
        assert r["after"] == [(1,)] * 4
        assert r["rebuilt"] == ("megatron_rollout/rendezvous/timeout.1/0-1-2-3/", [(0,), (1,), (2,), (3,)])
        assert "rank 2 is at epoch 2, boundary 4, post-D" in r["mismatch"] or rank == 2
        assert "plans or P boundary sequences diverged" in r["mismatch"]
    assert res[0]["sub"] == res[1]["sub"] == [(10,), (11,)] and "sub" not in res[2]
    for r in res[:3]:
        missing, epoch, boundary, tag, msg, waited = r["timeout"]
        assert (missing, epoch, boundary, tag) == ((3,), 9, 13, "post-D")
        assert "rank(s) [3] did not arrive at the post-D rendezvous of epoch 9, boundary 13" in msg
        assert 1.4 < waited < 10
        assert "used after a failure" in r["poisoned"]
    assert "timeout" not in res[3]
