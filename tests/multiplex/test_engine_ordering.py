"""The ordering proof with the real engine (DESIGN.md §8): ATP2/ADP2 on 4 gloo processes, every
collective of the model executed by one in-order worker per rank (a single stream).

Both phases take the full-group path (ADP all-gather, then FULL all-reduce) so D's ADP all-gather
and P's FULL all-reduce intersect. A hazard hook makes the two replicas reach the conflicting pair
in opposite orders the first time it comes up (replica 0: D first; replica 1: P first), as timing
can on a real deployment; it waits a bounded time, so a schedule that never issues the pair
concurrently only pays that wait once.

- naive multiplexing (P's forward on its own host thread, no rendezvous, per-phase communicators):
  the devices stall in a cycle between a P and a D collective; every rank fails within the
  timeouts, naming the collective it is stuck in or the peers that never arrived;
- the turnstile: the same workload completes, with the tokens of `off`.
"""
from __future__ import annotations

import threading
import time

from megatron_rollout.engine import EngineConfig, SamplingParams
from megatron_rollout.model.config import preset
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.types import Axis, Phase
from tests.world import run_world

CFG = preset("tiny-moe")
FIRST = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]  # decoding while the second wave prefills
SECOND = [[20 + i for i in range(30)], [60 + i for i in range(25)], [100 + i for i in range(28)], [140] * 22]
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=12)


class Hazard:
    """Replica 0 holds P's FULL all-reduce until D's ADP all-gather was enqueued; replica 1 holds
    D's ADP all-gather until P's FULL all-reduce was. Once each, at most `wait_s`."""

    def __init__(self, replica: int, wait_s: float) -> None:
        self.replica, self.wait_s = replica, wait_s
        self.seen = {"P": threading.Event(), "D": threading.Event()}
        self.armed = {"P": False, "D": False}

    def arm(self) -> None:
        self.armed = {"P": True, "D": True}

    def __call__(self, phase: Phase, op: str, axis: Axis) -> None:
        conflicting = (phase is Phase.P and op == "all_reduce" and axis is Axis.FULL) or \
                      (phase is Phase.D and op == "all_gather" and axis is Axis.ADP)
        if not conflicting:
            return
        me, other = phase.value, "D" if phase is Phase.P else "P"
        holds = (self.replica == 0 and me == "P") or (self.replica == 1 and me == "D")
        if holds and self.armed[me]:
            self.armed[me] = False
            self.seen[other].wait(self.wait_s)
        self.seen[me].set()


def _run(rank: int, schedule: str, ordering: str) -> dict:
    from megatron_rollout.comm.dist import CommConfig
    from megatron_rollout.comm.groups import ParallelLayout
    from megatron_rollout.distributed import Runtime
    from megatron_rollout.multiplex.inorder import DeviceStall, in_order_dist_comm

    config = CommConfig(timeout_s=20, p_exchange="allgather", d_exchange="allgather")
    comm = in_order_dist_comm(ParallelLayout(2, 2, 4), config, stall_s=6.0)
    replica = comm.rank(Axis.ADP)
    comm.hazard = hazard = Hazard(replica, wait_s=1.0)
    runtime = Runtime(comm, comm.device, timeout_s=30)
    model = MoETransformer(CFG, comm=comm).init_weights(seed=5)
    engine = runtime.engine(model, EngineConfig(schedule=schedule, block_size=4, mux_ordering=ordering,
                                                mux_span="fixed:1"))
    t0 = time.monotonic()
    try:
        first = [engine.add_request(p, PARAMS) for p in FIRST] if runtime.leader else []
        for _ in range(3):  # the first wave is decoding before the second arrives
            engine.step()
        hazard.arm()  # from here P and D both have work
        second = [engine.add_request(p, PARAMS) for p in SECOND] if runtime.leader else []
        done = {o.request_id: o.result.token_ids for o in runtime.drain(engine)}
    except DeviceStall as exc:
        return {"stalled": str(exc), "after_s": time.monotonic() - t0}
    return {"tokens": [done[r] for r in first + second] if runtime.leader else None, "replica": replica,
            "stalled": None}


def test_naive_multiplexing_deadlocks_and_the_turnstile_completes_with_off_tokens() -> None:
    off = run_world(_run, 4, "off", "turnstile", timeout=200)
    naive = run_world(_run, 4, "mux", "naive", timeout=200, allow_errors=True)
    turnstile = run_world(_run, 4, "mux", "turnstile", timeout=200)

    assert all(r["stalled"] is None for r in off)
    # Naive: no rank completes. Ranks whose device is in the cycle report the stall; a rank whose
    # host is waiting for them at the next step's rendezvous reports the peers that never came.
    stalled = [r for r in naive if isinstance(r, dict) and r["stalled"]]
    waiting = [r for r in naive if isinstance(r, str) and r.startswith("RendezvousTimeout")]
    assert len(stalled) + len(waiting) == 4, naive
    assert len(stalled) >= 2 and all(r["after_s"] < 60 for r in stalled), naive
    # A cycle between phases: some device is stuck in a P collective and another in a D one, each
    # waiting for a peer that enqueued the other phase's collective first (with per-phase
    # communicators; on this workload it closes on the ATP axis, or on FULL/ADP as hooked).
    heads = {r["stalled"].split("stuck in ", 1)[1][:1] for r in stalled}
    assert heads == {"P", "D"}, naive
    assert all(r["stalled"] is None for r in turnstile)
    for ranks in (off, turnstile):
        leaders = [r for r in ranks if r["tokens"] is not None]
        assert len(leaders) == 2  # one leader per replica
    want = {r["replica"]: r["tokens"] for r in off if r["tokens"] is not None}
    got = {r["replica"]: r["tokens"] for r in turnstile if r["tokens"] is not None}
    assert got == want
    assert all(len(t) == PARAMS.max_new_tokens for tokens in want.values() for t in tokens)
