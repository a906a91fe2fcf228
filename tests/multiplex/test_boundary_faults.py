"""The boundary controller inside the engine (docs/design.md §6): under `mux`, P's boundary ids come
from the points the model's forward really yields, and a rank whose P skips or repeats a
boundary makes every rank fail with the controller's `BoundaryError`, on 2 and 4 gloo ranks.

The fault is injected by a test-only wrapper around one rank's first P forward
(`engine_world.relabel`): at one yield it reports the next (skip) or previous (repeat) boundary.
That rank's controller rejects the publish; the rank reports it in the next pre-D rendezvous
payload and every rank raises the same error, naming it.
"""
from __future__ import annotations

import pytest

from megatron_rollout.engine.schedules.mux import boundary_plan
from megatron_rollout.forward import BoundaryPoint, Site, run_to_end
from megatron_rollout.multiplex.controller import BoundaryController, BoundaryError
from megatron_rollout.multiplex.policy import FixedSpan
from megatron_rollout.multiplex.rendezvous import LocalRendezvous
from megatron_rollout.multiplex.turnstile import Turnstile
from tests.multiplex.engine_world import FAULTS


def _plan_of(atp: int) -> list[BoundaryPoint]:
    """tiny-moe (layer 0 dense, layers 1-2 MoE) with ATP `atp`, P's all-gather exchange."""
    points = [BoundaryPoint(0, Site.ATTN_REDUCE), BoundaryPoint(0, Site.MLP_REDUCE)] if atp > 1 else []
    for layer in (1, 2):
        points += [BoundaryPoint(layer, Site.ATTN_REDUCE)] if atp > 1 else []
        points += [BoundaryPoint(layer, Site.MOE_EXCHANGE), BoundaryPoint(layer, Site.MOE_DATA)]
    return points


@pytest.mark.parametrize("world", [2, 4])
def test_boundary_plan_is_what_the_model_yields_and_the_controller_sees_it(engine_worlds, world):
    res = [r["none"] for r in engine_worlds[world]]
    for r in res:
        assert isinstance(r, dict) and "error" not in r, r
        assert list(r["plan"]) == _plan_of(2) and r["seen"] == _plan_of(2)
        assert r["published"] == len(_plan_of(2))  # the controller's last id: the plan's last point
    leaders = [r["tokens"] for r in res if r["tokens"]]
    assert len(leaders) == world // 2 and all(len(t) == 4 for ts in leaders for t in ts)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind, reason, boundary, detail", [
    ("skip", "missing", None, "expected {at}; boundaries {at}..{at} were skipped"),
    ("repeat", "duplicate", -1, "boundary {prev} was already published"),
])
def test_a_skipped_or_repeated_boundary_on_one_rank_fails_every_rank(engine_worlds, world, kind, reason, boundary,
                                                                    detail):
    faulty, at = FAULTS[world]
    got = (at + 1) if boundary is None else at - 1  # the id the faulty rank published
    want = (f"boundary {got} of epoch 1 rejected ({reason}): rank {faulty}'s P forward: "
            + detail.format(at=at, prev=at - 1))
    res = [r[kind] for r in engine_worlds[world]]
    for r in res:
        assert isinstance(r, dict) and "error" in r, r
        assert (r["error"], r["reason"], r["rank"]) == (want, reason, faulty)
    assert len(res) == world


def test_turnstile_publishes_the_plan_position_of_each_yield():
    plan = _plan_of(2)

    def forward(points):
        for p in points:
            yield p
        return 7

    ts = Turnstile(LocalRendezvous(), BoundaryController(), FixedSpan(2))
    assert ts.run_epoch(1, forward(plan), lambda: None, lambda: 0, boundaries=plan) == 7
    assert [r.last_boundary for r in ts.records] == [2, 4, 6, 8, 8]
    with pytest.raises(BoundaryError, match=r"boundary 3 of epoch 2 rejected \(missing\): rank 0's P forward: "
                                            r"expected 2; boundaries 2..2 were skipped"):
        ts.run_epoch(2, forward([plan[0], plan[2], *plan[3:]]), lambda: None, lambda: 0, boundaries=plan)
    with pytest.raises(BoundaryError, match=r"\(duplicate\).*boundary 1 was already published"):
        ts.run_epoch(3, forward([plan[0], plan[0], *plan[1:]]), lambda: None, lambda: 0, boundaries=plan)
    with pytest.raises(ValueError, match="names a point twice"):
        ts.begin(4, forward(plan), boundaries=[plan[0], plan[0]])
    # Without a model of the native shape there is no plan: yields are numbered by position.
    assert boundary_plan(object(), None) is None
    assert run_to_end(forward([])) == 7


def test_boundary_plan_matches_single_rank_yields():
    """One process: the portable exchange and the CUDA runner's sync-free one yield no MOE_DATA."""
    import torch

    from megatron_rollout.comm.facade import LocalComm
    from megatron_rollout.kernels.moe import DeviceLocalComm
    from megatron_rollout.model.attention import CausalBatch
    from megatron_rollout.model.config import preset
    from megatron_rollout.model.transformer import MoETransformer
    from megatron_rollout.types import Phase

    for comm in (LocalComm(), DeviceLocalComm()):
        model = MoETransformer(preset("tiny-moe"), comm=comm).init_weights(seed=1)
        gen, seen = model.step(torch.arange(6), torch.arange(6), CausalBatch(1, 6), Phase.P), []
        with torch.no_grad():
            while True:
                try:
                    seen.append(next(gen))
                except StopIteration:
                    break
        assert list(boundary_plan(model, Phase.P)) == seen == [BoundaryPoint(1, Site.MOE_EXCHANGE),
                                                               BoundaryPoint(2, Site.MOE_EXCHANGE)]
