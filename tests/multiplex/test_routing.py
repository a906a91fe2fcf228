"""Routing decisions, turnstile windows, and the CUDA stream path (GPU only)."""
from __future__ import annotations

import pytest
import torch

from megatron_rollout.multiplex.routing import (
    D_ADP_ALL_GATHER,
    P_FULL_ALL_REDUCE,
    CollectiveSite,
    ConflictRegistry,
    PhaseStreams,
    Router,
    RoutingError,
)
from megatron_rollout.types import Axis, Phase

P_ATP = CollectiveSite("all_reduce", Axis.ATP)


def test_registry_for_topology():
    crossed = ConflictRegistry.for_topology(atp_size=2, adp_size=2)
    assert len(crossed) == 1
    (c,) = crossed.conflicts_of(P_FULL_ALL_REDUCE)
    assert c.d_site == D_ADP_ALL_GATHER and "ATP2/ADP2" in c.why
    assert crossed.conflicts_of(P_ATP) == ()
    # Reducing either axis removes the crossing (the paper's observation): nothing is routed.
    assert len(ConflictRegistry.for_topology(4, 1)) == 0 and len(ConflictRegistry.for_topology(1, 8)) == 0
    with pytest.raises(ValueError, match="already registered"):
        crossed.register(P_FULL_ALL_REDUCE, D_ADP_ALL_GATHER)
    with pytest.raises(ValueError, match="unknown collective op"):
        CollectiveSite("broadcast", Axis.FULL)


def test_routes():
    router = Router(ConflictRegistry.for_topology(2, 2))
    full = router.route(Phase.P, P_FULL_ALL_REDUCE)
    assert full.routed and full.stream is Phase.D and full.label == "P:all_reduce/FULL@D"
    atp = router.route(Phase.P, P_ATP)
    assert not atp.routed and atp.stream is Phase.P
    d_full = router.route(Phase.D, P_FULL_ALL_REDUCE)  # D's own collectives never move
    assert not d_full.routed and d_full.stream is Phase.D
    assert not Router().route(Phase.P, P_FULL_ALL_REDUCE).routed  # empty registry: multiplexing off


def test_routed_collective_needs_a_window():
    router = Router(ConflictRegistry.for_topology(2, 2))
    order: list[str] = []
    full = router.route(Phase.P, P_FULL_ALL_REDUCE)
    with pytest.raises(RoutingError, match=r"P:all_reduce/FULL@D issued outside a turnstile round.*all_gather/ADP"):
        router.run(full, lambda: order.append("full"))
    assert order == [] and router.routed_count == 0
    # Unrouted collectives run anywhere, in program order on CPU.
    router.run(router.route(Phase.P, P_ATP), lambda: order.append("atp"))
    router.open_window(epoch=3, round_=1)
    assert router.window == (3, 1)
    assert router.run(full, lambda: order.append("full") or 7) == 7
    router.close_window()
    assert order == ["atp", "full"] and router.routed_count == 1
    relaxed = Router(ConflictRegistry.for_topology(2, 2), require_window=False)
    relaxed.run(full, lambda: order.append("relaxed"))
    assert order[-1] == "relaxed"


@pytest.mark.gpu
def test_cuda_routes_run_on_d_stream_with_event_order():
    streams = PhaseStreams.create("cuda")
    router = Router(ConflictRegistry.for_topology(2, 2), streams)
    seen: dict[str, object] = {}
    with torch.cuda.stream(streams.p):
        x = torch.randn(256, 256, device="cuda")
        for _ in range(20):  # keep the P stream busy so a missing wait would read stale data
            x = x @ x.T / 256
        expected = (x * 2).clone()

    def collective():
        seen["stream"] = torch.cuda.current_stream()
        return x * 2  # stands in for the all-reduce

    router.open_window(0, 1)
    with torch.cuda.stream(streams.p):
        y = router.run(router.route(Phase.P, P_FULL_ALL_REDUCE), collective, inputs=[x])
        z = y + 1  # P continues after the routed collective
    router.close_window()
    assert seen["stream"] == streams.d
    torch.cuda.synchronize()
    torch.testing.assert_close(z, expected + 1)
    own = router.run(router.route(Phase.P, P_ATP), lambda: torch.cuda.current_stream())
    assert own == streams.p
