"""The schedules (`engine/schedules/`): off, chunked and mux give the same tokens; a `mux` epoch parks
the blocks of a request aborted mid-epoch and refuses weight updates until it ends."""
from __future__ import annotations

import pytest

from megatron_rollout.engine import FinishReason, SamplingParams

from .common import ABORT_PARAMS, SCHEDULES, SMALL, assert_same, drain, prompts, reference


def test_schedules_give_the_same_tokens_in_one_engine_run(make_engine, qwen):
    """off, chunked and mux at temperature 0 on a mixed batch of short and long prompts."""
    _, model = qwen
    batch = prompts([3, 25, 2, 14, 9], seed=2)
    params = SamplingParams(temperature=0.0, max_new_tokens=7)
    results = {s: make_engine(model, schedule=s, **SMALL).generate(batch, params) for s in SCHEDULES}
    assert_same(results["chunked"], results["off"])
    assert_same(results["mux"], results["off"])
    assert_same(results["off"], reference(make_engine, model, batch, params))


@pytest.mark.parametrize("span", ["budget:1", "budget:100000000", "load"])
def test_mux_span_policies_give_off_tokens(make_engine, qwen, span):
    """Whatever the segment policy cuts, the tokens are off's (budget:1 releases one segment per
    round, a huge budget the whole epoch)."""
    _, model = qwen
    batch = prompts([3, 25, 2, 14, 9], seed=5)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    off = make_engine(model, schedule="off", **SMALL).generate(batch, params)
    engine = make_engine(model, schedule="mux", **{**SMALL, "mux_span": span})
    assert_same(engine.generate(batch, params), off)
    assert engine.mux.rounds > 0


def test_abort_mid_mux_epoch_parks_blocks_until_the_epoch_ends(make_engine, qwen):
    _, model = qwen
    seen = {}

    def mid_epoch(engine, rids):
        mux = engine.mux
        if mux.busy and 0 < mux.turnstile.controller.last_published and \
                any(o[0].rid == rids[1] for o in mux.epoch.owners):
            seen["blocks"] = list(engine.pool.table(engine.requests[rids[1]].seq.sid))
            return True
        return False

    engine = make_engine(model, schedule="mux", **SMALL)
    batch = prompts([5, 9, 6], seed=12)
    rids = [engine.add_request(p, ABORT_PARAMS) for p in batch]
    outs: dict = {}
    while not mid_epoch(engine, rids):
        for out in engine.step():
            outs[out.request_id] = out
    free_before = engine.pool.num_free
    engine.abort(rids[1])
    # P's forward is still writing the victim's blocks: none may be handed out before it ends.
    assert engine.pool.num_free == free_before
    assert all(engine.pool.refcount[b] > 0 for b in seen["blocks"])
    engine.check_integrity()
    epoch = engine.mux.epoch
    assert engine.mux.turnstile.controller.epoch == epoch.number  # the epoch runs on for the others
    while engine.mux.epoch is epoch:
        for out in engine.step():
            outs[out.request_id] = out
    assert not [owner for owner in engine.pool.tables if owner < 0]  # the parked blocks went back
    assert engine.mux.turnstile.controller.epoch is None
    drain(engine, outs)
    assert outs[rids[1]].result.finish_reason is FinishReason.ABORT
    assert_same([outs[rids[0]].result, outs[rids[2]].result],
                reference(make_engine, model, [batch[0], batch[2]], ABORT_PARAMS))
    assert engine.pool.num_free == engine.pool.num_blocks


def test_update_weights_mid_mux_epoch_finishes_the_epoch_then_lands(make_engine, qwen):
    """An update called mid-epoch runs the engine's steps until the epoch ends (its tokens stay
    deliverable by step(), tagged with the version they ran under) and lands after it."""
    _, model = qwen
    engine = make_engine(model, schedule="mux", **SMALL)
    rids = [engine.add_request(p, ABORT_PARAMS) for p in prompts([9, 7], seed=3)]
    outs: dict = {}
    while not engine.mux_busy or engine.mux.turnstile.controller.last_published == 0:
        for out in engine.step():
            outs[out.request_id] = out
    epoch = engine.mux.epoch
    state = {k: v.clone() for k, v in model.state_dict().items()}
    engine.update_weights(state, version=1)
    assert engine.weight_version == 1 and engine.mux.epoch is not epoch
    in_epoch = [o.request.rid for o in epoch.owners]
    assert in_epoch and all(engine.requests[r].versions[0] == 0 for r in in_epoch)  # its P ran under 0
    drain(engine, outs)
    assert sorted(outs) == sorted(rids)
    for rid in in_epoch:
        versions = outs[rid].result.weight_versions
        assert versions[0] == 0 and versions == sorted(versions) and versions[-1] == 1, versions
