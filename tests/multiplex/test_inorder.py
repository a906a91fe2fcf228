"""The in-order device model on one process: order, futures, watchdog, poisoning."""
from __future__ import annotations

import threading

import pytest
import torch

from megatron_rollout.multiplex.inorder import DeviceError, InOrderComm, InOrderDevice
from megatron_rollout.multiplex.routing import ConflictRegistry, Router, RoutingError
from megatron_rollout.types import Axis, Phase


def test_runs_in_submission_order_and_returns_futures():
    dev = InOrderDevice(0)
    gate = threading.Event()
    a = dev.submit("a", lambda: gate.wait(5) and torch.tensor([1, 2]))
    b = dev.submit("b", lambda t: t * 10, a)
    c = dev.submit("c", lambda t, u: t + u, a, b)
    assert not c.done  # the host did not wait
    gate.set()
    assert c.result(5).tolist() == [11, 22]
    assert dev.watch(stall_after_s=5) is None and dev.log == ["a", "b", "c"]
    assert dev.close()


def test_watchdog_reports_the_stuck_head_and_failures_poison_the_device():
    dev = InOrderDevice(3)
    gate = threading.Event()
    dev.submit("stuck collective", lambda: gate.wait(10))
    after = dev.submit("after", lambda: 1)
    stall = dev.watch(stall_after_s=0.2, deadline_s=5)
    assert stall is not None and (stall.rank, stall.op, stall.queued, stall.executed) == (3, "stuck collective", 1, 0)
    assert stall.running_s >= 0.2
    gate.set()
    assert after.result(5) == 1
    boom = dev.submit("boom", lambda: 1 / 0)
    later = dev.submit("later", lambda: 2)
    with pytest.raises(DeviceError, match="boom: division by zero"):
        boom.result(5)
    with pytest.raises(DeviceError, match="not run: device poisoned by boom: ZeroDivisionError"):
        later.result(5)
    assert dev.log == ["stuck collective", "after"] and dev.close()


def test_inorder_comm_routes_through_the_router():
    dev = InOrderDevice(0)
    router = Router(ConflictRegistry.for_topology(2, 2))
    comm = InOrderComm(dev, {(Axis.FULL, Phase.P): None}, router)
    x = comm.constant("x", torch.ones(2))
    with pytest.raises(RoutingError, match="outside a turnstile round"):
        comm.all_reduce(x, Axis.FULL, Phase.P)  # refused before anything is enqueued
    with pytest.raises(KeyError, match="no communicator for"):
        comm.all_reduce(x, Axis.ATP, Phase.P)
    assert dev.watch(stall_after_s=5) is None and dev.log == ["x"] and dev.close()
