"""The ordering proof of docs/design.md §8 on four gloo ranks with in-order devices (ATP2/ADP2),
run inside the shared `mux_world` (conftest.py).

Layout as Megatron builds it for TP=2, DP=2 (docs/design.md §5): ATP groups {0,1},{2,3}; ADP groups
{0,2},{1,3}; FULL {0,1,2,3}. An ATP group is one ADP replica (replica = rank // 2). Each rank has
one in-order device (a single stream): collectives run strictly in the order the host enqueued
them. P's forward (2 layers) issues per layer an ATP all-reduce and a FULL all-reduce; every D
iteration issues an ATP all-reduce and an ADP all-gather. Timing is made deterministic with host
events: replica 0's D is ready first (its decode rows arrive first), replica 1's P is ahead.
(Splitting by replica, not by rank parity: with Megatron's layout the ADP groups {0,2},{1,3} hold
ranks of equal parity, so "even ranks D first, odd ranks P first" orders every ADP group the same
way and cannot close a cycle.)

(a) naive (P and D host threads enqueue independently, one communicator per axis shared by both
    phases): replica 0 enqueues D_1 before P, replica 1 enqueues P (with its FULL all-reduce)
    before D_1. Rank 0 blocks in D's ADP all-gather waiting for rank 2; rank 2 blocks in P's FULL
    all-reduce waiting for rank 0 (and 1, which waits for 3 the same way): a cycle. DEADLOCK.
(b) per-phase communicators (separate gloo groups for P and D), same enqueue: the devices still
    execute in enqueue order, and the cycle is between *operations*, not communicators: rank 0's
    device cannot reach its FULL all-reduce before its ADP all-gather completes, whatever group
    each uses. DEADLOCK, at the same two operations.
(c) routing alone (per-phase groups; each rank enqueues the conflicting FULL all-reduce right
    after the next D iteration it enqueues, i.e. D→P order locally) without the cross-rank
    rendezvous: "the next D iteration" is a different iteration on different ranks. Replica 0
    had already enqueued D_1 when P reached FULL_1, so FULL_1 follows D_2 there; on replica 1
    FULL_1 follows D_1. Rank 0 then blocks in D_2's ADP all-gather while rank 2 blocks in FULL_1.
    DEADLOCK: local D→P order is not a cross-rank order.
(d) turnstile (per-phase groups + routing + pre-/post-D rendezvous + controller): every rank
    enqueues D_k and then P's segment k at the same boundary, so all devices see the same
    sequence. COMPLETES, and P's output and every D iteration's output equal the `off`
    schedule (P whole, then the same number of D iterations).
(e) turnstile rounds without cross-rank agreement (the real `Turnstile` with routing, but a
    `LocalRendezvous` per rank and `LoadSelected` fed each rank's *local* decode rows): replica 0
    (many rows) releases one segment per round, replica 1 (no rows) runs P whole in round 1. The
    host order is D_1, P seg 1, D_2, ... on rank 0 but D_1, all of P on rank 2: rank 0 blocks in
    D_2's ADP all-gather, rank 2 in FULL_1. DEADLOCK: the rendezvous is what makes the spans (and
    so the boundary each D lands on) agree.

Deadlocks are detected by each rank's own watchdog (the head of its device queue has not finished
within STALL_S), then unblocked by the hazard groups' short gloo timeout so no thread or process
is left hanging.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_rollout.model.layers import BoundaryPoint, Site, run_to_end
from megatron_rollout.multiplex.controller import BoundaryController
from megatron_rollout.multiplex.inorder import DeviceValue, InOrderComm, InOrderDevice
from megatron_rollout.multiplex.policy import FixedSpan, LoadSelected
from megatron_rollout.multiplex.rendezvous import LocalRendezvous, Rendezvous
from megatron_rollout.multiplex.routing import ConflictRegistry, Route, Router
from megatron_rollout.multiplex.turnstile import Turnstile
from megatron_rollout.types import Axis, Phase

LAYOUT = {Axis.ATP: ([0, 1], [2, 3]), Axis.ADP: ([0, 2], [1, 3]), Axis.FULL: ([0, 1, 2, 3],)}
LAYERS = 2
D_ITERS = LAYERS + 2  # enough D iterations for routing-alone to place every routed collective
HAZARDS = ("naive", "per-phase", "routing", "unagreed")
STALL_S = 2.0  # watchdog: a head-of-queue op running this long is stuck
HAZARD_GLOO_TIMEOUT_S = 4.0  # then gloo gives up and the device drains with errors


def make_groups(rank: int, per_phase: bool, timeout_s: float) -> dict:
    """Communicators of this rank by (axis, phase); new_group is called in the same order everywhere."""
    groups: dict = {}
    for phase in ((Phase.P, Phase.D) if per_phase else (None,)):
        for axis, rank_lists in LAYOUT.items():
            for ranks in rank_lists:
                g = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
                if rank in ranks:
                    for ph in ((phase,) if phase else (Phase.P, Phase.D)):
                        groups[(axis, ph)] = g
    return groups


def p_forward(comm: InOrderComm, rank: int):
    x = comm.constant("P input", torch.arange(4, dtype=torch.int64) + 10 * rank)
    for layer in range(LAYERS):
        x = comm.compute(f"P attn {layer}", lambda t: (t * 3 + 1) % 1009, x)
        yield BoundaryPoint(layer, Site.ATTN_REDUCE)
        x = comm.all_reduce(x, Axis.ATP, Phase.P)
        x = comm.compute(f"P moe {layer}", lambda t: (t * 5 + 2) % 1009, x)
        yield BoundaryPoint(layer, Site.MOE_EXCHANGE)
        x = comm.all_reduce(x, Axis.FULL, Phase.P)
    return x


class Decode:
    """D's state machine: each iteration reads the previous state (graph-replay-like, fixed shape)."""

    def __init__(self, comm: InOrderComm, rank: int) -> None:
        self.comm = comm
        self.state = comm.constant("D state", torch.full((2,), rank + 1, dtype=torch.int64))
        self.outputs: list[DeviceValue] = []

    def iteration(self) -> None:
        y = self.comm.compute("D attn", lambda t: (t * 7 + 3) % 1009, self.state)
        y = self.comm.all_reduce(y, Axis.ATP, Phase.D)
        g = self.comm.all_gather(y, Axis.ADP, Phase.D)
        self.state = self.comm.compute("D next", lambda t: t.view(2, -1).sum(0) % 1009, g)
        self.outputs.append(self.state)


class AfterNextDecode:
    """Routing without a turnstile: a routed P collective is enqueued right after the next D
    iteration this rank enqueues (the P host thread waits for that enqueue, not for the device)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.pending: list = []
        self.closed = False

    def hook(self, route: Route, enqueue) -> DeviceValue:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.cond:
            if self.closed:
                return enqueue()
            self.pending.append((enqueue, fut))
            self.cond.notify_all()
        return fut.result(timeout=30)

    def wait_pending(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.pending, timeout=30)

    def after_decode(self, close: bool = False) -> None:
        with self.cond:
            items, self.pending, self.closed = self.pending, [], self.closed or close
        for enqueue, fut in items:
            fut.set_result(enqueue())


def run_hazard(rank: int, variant: str) -> dict:
    """P and D host threads enqueue onto one in-order device with replica-dependent timing."""
    groups = make_groups(rank, per_phase=variant != "naive", timeout_s=HAZARD_GLOO_TIMEOUT_S)
    dev = InOrderDevice(rank, variant)
    routing = AfterNextDecode() if variant == "routing" else None
    router = Router(ConflictRegistry.for_topology(2, 2), require_window=False) if routing else Router()
    comm = InOrderComm(dev, groups, router, routing.hook if routing else None)
    decode = Decode(comm, rank)
    d_first = rank // 2 == 0
    d1, p_done = threading.Event(), threading.Event()

    def d_thread() -> None:
        for i in range(D_ITERS):
            if i == 0 and not d_first:
                routing.wait_pending() if routing else p_done.wait(30)
            if i == 1 and d_first and routing:
                routing.wait_pending()  # P reached FULL_1 after D_1 was already enqueued here
            decode.iteration()
            if routing:
                routing.after_decode(close=i == D_ITERS - 1)
            d1.set()

    def p_thread() -> None:
        if d_first:
            d1.wait(30)
        run_to_end(p_forward(comm, rank))
        p_done.set()

    threads = [threading.Thread(target=f, daemon=True) for f in (d_thread, p_thread)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    host_done = not any(t.is_alive() for t in threads)  # the host never waits on the device
    stall = dev.watch(stall_after_s=STALL_S, deadline_s=60)
    drained = dev.watch(stall_after_s=60, deadline_s=HAZARD_GLOO_TIMEOUT_S + 20) is None
    report = {"host_done": host_done, "stall": stall and stall.op, "drained": drained,
              "error": dev.first_error or "", "closed": dev.close(timeout=5)}
    return report


def run_unagreed(rank: int) -> dict:
    """Variant (e): turnstile rounds whose spans are chosen from local state only."""
    groups = make_groups(rank, per_phase=True, timeout_s=HAZARD_GLOO_TIMEOUT_S)
    dev = InOrderDevice(rank, "unagreed")
    router = Router(ConflictRegistry.for_topology(2, 2))
    comm = InOrderComm(dev, groups, router)
    decode = Decode(comm, rank)
    rows = 64 if rank // 2 == 0 else 0
    ts = Turnstile(LocalRendezvous(rank), BoundaryController(), LoadSelected(), router)
    ts.run_epoch(1, p_forward(comm, rank), decode.iteration, lambda: rows, total_boundaries=2 * LAYERS,
                 prefill_tokens=8192)
    stall = dev.watch(stall_after_s=STALL_S, deadline_s=60)
    drained = dev.watch(stall_after_s=60, deadline_s=HAZARD_GLOO_TIMEOUT_S + 20) is None
    return {"host_done": True, "stall": stall and stall.op, "drained": drained, "error": dev.first_error or "",
            "rounds": len(ts.records), "closed": dev.close(timeout=5)}


def run_turnstile(rank: int, groups: dict, span: int) -> dict:
    dev = InOrderDevice(rank, f"turnstile-{span}")
    router = Router(ConflictRegistry.for_topology(2, 2))
    comm = InOrderComm(dev, groups, router)
    decode = Decode(comm, rank)
    replica = rank // 2

    def decode_iteration() -> None:
        if replica == 0:
            time.sleep(0.01)  # replica-dependent timing, absorbed by the rendezvous
        decode.iteration()

    ts = Turnstile(Rendezvous(timeout_s=30, name=f"ordering-{span}"), BoundaryController(), FixedSpan(span), router)
    out = ts.run_epoch(1, p_forward(comm, rank), decode_iteration, lambda: 2 if replica == 0 else 0,
                       total_boundaries=2 * LAYERS)
    stall = dev.watch(stall_after_s=20, deadline_s=60)
    result = {"stall": stall, "p": out.result(1).tolist(), "d": [v.result(1).tolist() for v in decode.outputs],
              "log": list(dev.log), "rounds": len(ts.records), "routed": router.routed_count}
    dev.close()
    # `off`: the same work with P whole, then as many D iterations, on a fresh device.
    off_dev = InOrderDevice(rank, "off")
    off = InOrderComm(off_dev, groups, Router())
    off_decode = Decode(off, rank)
    off_p = run_to_end(p_forward(off, rank))
    for _ in range(result["rounds"]):
        off_decode.iteration()
    result["off_p"] = off_p.result(30).tolist()
    result["off_d"] = [v.result(30).tolist() for v in off_decode.outputs]
    off_dev.close()
    return result


def rank_checks(rank: int) -> dict:
    out = {v: run_hazard(rank, v) for v in ("naive", "per-phase", "routing")}
    out["unagreed"] = run_unagreed(rank)
    groups = make_groups(rank, per_phase=True, timeout_s=30)
    out["turnstile-1"] = run_turnstile(rank, groups, span=1)
    out["turnstile-3"] = run_turnstile(rank, groups, span=3)
    # A worker thread still stuck in gloo would block interpreter exit: the result is queued by
    # now, so make sure the process ends (tests.world kills it later anyway).
    if not all(out[v]["closed"] for v in HAZARDS):
        logging.getLogger(__name__).error("rank %d: a device worker is still stuck; exiting in 5 s", rank)
        threading.Timer(5.0, os._exit, (0,)).start()
    return out


def collective_labels(log: list[str]) -> list[str]:
    return [entry for entry in log if "/" in entry]


def test_ordering_model_deadlocks_without_turnstile_and_completes_with_it(mux_world):
    res = [r["ordering"] for r in mux_world]
    for r in res:
        assert isinstance(r, dict), r  # a str is the rank's traceback
    # (a), (b): rank 0/1 stuck in D_1's ADP all-gather, rank 2/3 in P's first FULL all-reduce.
    for variant in ("naive", "per-phase"):
        stalls = [r[variant]["stall"] for r in res]
        assert stalls == ["D:all_gather/ADP@D #2"] * 2 + ["P:all_reduce/FULL@P #2"] * 2, (variant, stalls)
    # (c): routed FULL_1 follows D_2 on replica 0 but D_1 on replica 1.
    # (c) and (e): rank 0/1 stuck in D_2's all-gather, rank 2/3 in the routed FULL_1.
    for variant in ("routing", "unagreed"):
        stalls = [r[variant]["stall"] for r in res]
        assert stalls == ["D:all_gather/ADP@D #4"] * 2 + ["P:all_reduce/FULL@D #2"] * 2, (variant, stalls)
    assert [r["unagreed"]["rounds"] for r in res] == [5, 5, 1, 1]
    for r in res:
        for variant in HAZARDS:
            rep = r[variant]
            assert rep["host_done"], "host threads never wait on the device"
            assert rep["drained"] and rep["closed"] and "Timed out" in rep["error"], rep
    # (d): completes, with results equal to the off schedule, for span 1 and span 3.
    for key, rounds in (("turnstile-1", 2 * LAYERS + 1), ("turnstile-3", 2)):
        for r in res:
            t = r[key]
            assert t["stall"] is None and t["rounds"] == rounds and t["routed"] == LAYERS
            assert t["p"] == t["off_p"] and t["d"] == t["off_d"] and len(t["d"]) == rounds
            labels = collective_labels(t["log"])
            # D→P order on every rank: each routed FULL all-reduce follows a D iteration's
            # all-gather (span 1) or at least comes after this round's D (span 3).
            for i, label in enumerate(labels):
                if label.startswith("P:all_reduce/FULL@D") and key == "turnstile-1":
                    assert labels[i - 1].startswith("D:all_gather/ADP@D"), labels
        # Same collective sequence on every rank: the cross-rank order the turnstile establishes.
        assert len({tuple(collective_labels(r[key]["log"])) for r in res}) == 1
        # P's FULL all-reduce sums over all ranks, so every rank's P output is the same.
        assert len({tuple(r[key]["p"]) for r in res}) == 1
