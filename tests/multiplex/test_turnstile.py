"""The turnstile on one process (order of D and P, results, errors) and on four gloo ranks of the
shared `mux_world` (agreement on spans and rounds, divergence and cancellation on every rank)."""
from __future__ import annotations

import pytest
import torch

from megatron_rollout.model.attention import CausalBatch
from megatron_rollout.model.config import preset
from megatron_rollout.model.layers import BoundaryPoint, Site, run_to_end
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.multiplex.controller import BoundaryController
from megatron_rollout.multiplex.policy import FixedSpan, LoadSelected, LoadSelectedConfig
from megatron_rollout.multiplex.rendezvous import LocalRendezvous, Rendezvous
from megatron_rollout.multiplex.routing import P_FULL_ALL_REDUCE, ConflictRegistry, Router
from megatron_rollout.multiplex.turnstile import EpochCancelled, Turnstile, TurnstileDivergence
from megatron_rollout.types import Phase


def scripted_p(n: int, log: list[str], closed: list[bool] | None = None, router: Router | None = None):
    """A P forward with n boundaries that logs its work; returns n * 10."""
    try:
        for b in range(1, n + 1):
            log.append(f"P{b}")
            yield BoundaryPoint(b, Site.MOE_EXCHANGE)
            if router is not None:  # the collective after the boundary, routed after D
                router.run(router.route(Phase.P, P_FULL_ALL_REDUCE), lambda: log.append(f"full{b}"))
        log.append("Pend")
        return n * 10
    finally:
        if closed is not None:
            closed.append(True)


def local_turnstile(policy, router=None) -> Turnstile:
    return Turnstile(LocalRendezvous(), BoundaryController(), policy, router)


def test_rounds_interleave_d_before_each_segment():
    log: list[str] = []
    ts = local_turnstile(FixedSpan(2))
    out = ts.run_epoch(7, scripted_p(5, log), lambda: log.append("D"), lambda: 3)
    assert out == 50
    # 5 boundaries = 6 segments; span 2 -> 3 rounds, each D first, then P up to the endpoint.
    assert log == ["D", "P1", "P2", "D", "P3", "P4", "D", "P5", "Pend"]
    recs = list(ts.records)
    assert [(r.round, r.first_boundary, r.last_boundary, r.permitted, r.p_finished) for r in recs] == \
        [(1, 1, 2, 2, False), (2, 3, 4, 4, False), (3, 5, 5, 6, True)]
    assert all(r.epoch == 7 and r.decode_rows == r.max_decode_rows == 3 and r.span == 2 for r in recs)
    assert all(r.t_start <= r.t_pre_d <= r.t_decode <= r.t_post_d <= r.t_end for r in recs)
    assert ts.controller.epoch is None and ts.running is None


def polling_p(n: int, polls: int, log: list[str]):
    """Like an asynchronous CUDA runner's P: n boundaries, then `polls` completion polls (negative
    layer) while the device finishes, then the result."""
    for b in range(1, n + 1):
        log.append(f"P{b}")
        yield BoundaryPoint(b, Site.MOE_EXCHANGE)
    for _ in range(polls):
        log.append("poll")
        yield BoundaryPoint(-1, Site.MOE_DATA)
    return n * 10


@pytest.mark.parametrize("policy", [LoadSelected(), FixedSpan(1), FixedSpan(3)])
def test_completion_polls_after_the_last_boundary_keep_rounds_going(policy):
    # Seen on the H200: with total_boundaries known, a round after every boundary had been
    # permitted asked the policy for a span with remaining_segments=0 and raised.
    log: list[str] = []
    ts = local_turnstile(policy)
    out = ts.run_epoch(3, polling_p(4, 3, log), lambda: log.append("D"), lambda: 64, total_boundaries=4,
                       prefill_tokens=4096)
    assert out == 40
    assert log.count("poll") == 3
    assert all(log.index(f"P{b}") < log.index("poll") for b in range(1, 5))
    polls = [i for i, e in enumerate(log) if e == "poll"]
    assert all("D" in log[a:b] for a, b in zip(polls, polls[1:]))  # D keeps running while P's device work ends
    assert ts.controller.epoch is None and ts.running is None


def test_load_selected_runs_p_whole_without_decode_rows_and_splits_with_them():
    log: list[str] = []
    ts = local_turnstile(LoadSelected())
    assert ts.run_epoch(1, scripted_p(6, log), lambda: log.append("D"), lambda: 0, total_boundaries=6) == 60
    assert log.count("D") == 1 and len(ts.records) == 1 and ts.records[0].span == 7
    log.clear()
    assert ts.run_epoch(2, scripted_p(6, log), lambda: log.append("D"), lambda: 256, total_boundaries=6,
                        prefill_tokens=8192) == 60
    assert log.count("D") == 7  # heavy decode load: one segment per round


def test_model_forward_through_turnstile_equals_plain_forward():
    torch.manual_seed(0)
    model = MoETransformer(preset("tiny-moe")).init_weights(seed=3, std=0.2)
    ids = torch.randint(0, 256, (2, 9))
    pos = torch.arange(9).repeat(2)
    with torch.no_grad():
        ref = run_to_end(model.step(ids.reshape(-1), pos, CausalBatch(2, 9), Phase.P))
        d_ids = torch.randint(0, 256, (1, 4))
        d_ref = model(d_ids, Phase.D)
        d_out: list[torch.Tensor] = []
        ts = local_turnstile(FixedSpan(1))
        out = ts.run_epoch(0, model.step(ids.reshape(-1), pos, CausalBatch(2, 9), Phase.P),
                           lambda: d_out.append(model(d_ids, Phase.D)), lambda: 1)
    moe_layers = sum(model.cfg.is_moe_layer(i) for i in range(model.cfg.num_layers))
    assert len(ts.records) == moe_layers + 1  # one boundary per MoE layer at ATP1, span 1
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert len(d_out) == len(ts.records)
    for d in d_out:
        torch.testing.assert_close(d, d_ref, rtol=0, atol=0)


def test_cancel_ends_epoch_consistently_and_next_epoch_runs():
    log: list[str] = []
    closed: list[bool] = []
    ts = local_turnstile(FixedSpan(1))
    assert ts.cancel("nothing running") is False

    def decode():
        log.append("D")
        if log.count("D") == 2:
            assert ts.cancel("request 17 aborted") is True

    with pytest.raises(EpochCancelled, match=r"epoch 4 cancelled by rank\(s\) \[0\] before round 3, after boundary 2"):
        ts.run_epoch(4, scripted_p(5, log, closed), decode, lambda: 1)
    assert log == ["D", "P1", "D", "P2"] and closed == [True]  # P2's segment ran; P was then closed
    assert ts.controller.epoch is None and ts.running is None
    log.clear()
    assert ts.run_epoch(5, scripted_p(2, log), lambda: log.append("D"), lambda: 1) == 20


def test_bad_forwards_and_callbacks_cancel_the_epoch():
    ts = local_turnstile(FixedSpan(3))
    with pytest.raises(TurnstileDivergence, match="yielded boundary 3.*total_boundaries is 2"):
        ts.run_epoch(1, scripted_p(4, []), lambda: None, lambda: 0, total_boundaries=2)
    with pytest.raises(TurnstileDivergence, match="P yielded 1 boundaries, total_boundaries said 2"):
        ts.run_epoch(2, scripted_p(1, []), lambda: None, lambda: 0, total_boundaries=2)

    def not_boundaries():
        yield "layer 0"
        return 0

    with pytest.raises(TypeError, match="it must yield BoundaryPoint"):
        ts.run_epoch(3, not_boundaries(), lambda: None, lambda: 0)
    with pytest.raises(ValueError, match=r"decode_rows\(\) returned -1"):
        ts.run_epoch(4, scripted_p(1, []), lambda: None, lambda: -1)
    assert ts.controller.epoch is None
    assert ts.run_epoch(9, scripted_p(1, []), lambda: None, lambda: 0) == 10


def test_routed_collective_lands_after_this_rounds_d():
    log: list[str] = []
    router = Router(ConflictRegistry.for_topology(2, 2))
    ts = local_turnstile(FixedSpan(2), router)
    assert ts.run_epoch(0, scripted_p(3, log, router=router), lambda: log.append("D"), lambda: 1) == 30
    assert log == ["D", "P1", "full1", "P2", "D", "full2", "P3", "full3", "Pend"]
    assert router.routed_count == 3 and router.window is None


# -- four ranks -----------------------------------------------------------------------------

def rank_checks(rank: int) -> dict:
    out: dict = {}
    rows = [0, 5, 1, 2][rank]
    ts = Turnstile(Rendezvous(timeout_s=30, name="ts-test"), BoundaryController(),
                   LoadSelected(LoadSelectedConfig(round_overhead_us=400.0)))  # the spans below assume 400
    log: list[str] = []
    out["result"] = ts.run_epoch(1, scripted_p(8, log), lambda: log.append("D"), lambda: rows,
                                 total_boundaries=8, prefill_tokens=64)
    out["spans"] = [(r.span, r.max_decode_rows, r.last_boundary) for r in ts.records]
    out["log"] = log
    # Rank 2's forward yields one boundary more: every rank must notice at the same rendezvous.
    try:
        ts.run_epoch(2, scripted_p(4 + (rank == 2), []), lambda: None, lambda: 0)
    except TurnstileDivergence as exc:
        out["divergence"] = str(exc)
    # Rank 1 cancels during its second D iteration: all ranks stop before round 3.
    ts.policy = FixedSpan(1)
    count = [0]

    def decode():
        count[0] += 1
        if rank == 1 and count[0] == 2:
            ts.cancel("abort")

    try:
        ts.run_epoch(3, scripted_p(6, []), decode, lambda: 1)
    except EpochCancelled as exc:
        out["cancel"] = (exc.epoch, exc.round, exc.boundary, exc.by_ranks)
    out["after"] = ts.run_epoch(4, scripted_p(2, []), lambda: None, lambda: rows)
    return out


def test_four_ranks_agree_on_spans_and_fail_together(mux_world):
    res = [r["turnstile"] for r in mux_world]
    for r in res:
        assert isinstance(r, dict), r  # a str is the rank's traceback
    assert [r["result"] for r in res] == [80] * 4
    # LoadSelected saw max rows 5 everywhere: sqrt(800 / (5 * 64 * 0.05)) = 7.07 -> span 7, then 2.
    assert all(r["spans"] == [(7, 5, 7), (2, 5, 8)] for r in res)
    assert all(r["log"] == ["D", *[f"P{i}" for i in range(1, 8)], "D", "P8", "Pend"] for r in res)
    for r in res:
        assert "ranks disagree on P's progress" in r["divergence"]
        assert "2: {'boundaries': 5, 'finished': 1}" in r["divergence"]
        assert "0: {'boundaries': 4, 'finished': 1}" in r["divergence"]
        assert r["cancel"] == (3, 2, 2, [1])
        assert r["after"] == 20
