"""Decode ahead (`engine.ahead`): the next decode forward issued before the host reads this one's
tokens. On CPU it is forced on (`decode_ahead="on"`; the portable runner runs it at once, which is
what makes its bookkeeping testable here); every test compares it with the same engine run without."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from megatron_rollout.engine import EngineConfig, FinishReason, KVConfig, MuxConfig, RunnerConfig, SamplingParams
from megatron_rollout.engine.sampler import PendingDraw, sample

from .common import SCHEDULES, SMALL, assert_same, drain, prompts, small


def test_pending_draw_is_sample_and_its_device_tokens_are_the_results():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=gen) * 3
    logits[1, 5] = float("nan")
    logits[3] = float("-inf")
    logits[4, 7] = float("inf")
    logits[5, :20] = float("-inf")
    params = [SamplingParams(temperature=t, top_k=k) for t, k in ((0.0, 0), (1.0, 0), (0.7, 5), (0.0, 0),
                                                                    (1.0, 3), (0.7, 5))]
    gens = lambda: [torch.Generator().manual_seed(s) for s in range(6)]  # noqa: E731
    want = sample(logits, params, gens())
    draw = PendingDraw(logits, params, gens())
    assert draw.result(range(6)) == want
    assert draw.result([5, 2]) == [want[5], want[2]]
    assert [s.error is None for s in want] == [True, False, True, False, False, True]
    assert [int(t) for t, s in zip(draw.tokens, want) if s.ok] == [s.token for s in want if s.ok]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tokens_are_the_same_with_and_without_decode_ahead(make_engine, qwen, schedule):
    _, model = qwen
    batch = prompts([3, 25, 2, 14, 9, 5], seed=3)
    params = [SamplingParams(temperature=0.0, max_new_tokens=n) for n in (9, 4, 12, 7, 1, 10)]
    off = make_engine(model, small(schedule, runner=RunnerConfig(decode_ahead="off")))
    on = make_engine(model, small(schedule, runner=RunnerConfig(decode_ahead="on")))
    assert_same(on.generate(batch, params), off.generate(batch, params))
    assert on.stats.ahead_taken > 0 and off.stats.ahead_issued == 0
    pending = on.executor.ahead.issued is not None
    assert on.stats.ahead_issued == on.stats.ahead_taken + on.stats.ahead_dropped + pending
    assert on.stats.steps == off.stats.steps


def _stop_token(make_engine, model, prompt, at):
    """The token greedy decoding of `prompt` produces at output position `at`."""
    engine = make_engine(model, small(runner=RunnerConfig(decode_ahead="off")))
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=at + 1))
    return out[0].token_ids[at]


def test_a_row_that_stops_early_leaves_the_others_on_the_forward_issued_ahead(make_engine, qwen):
    """A stop token is only seen after the next forward was issued with that row in it: the next
    step takes the other rows out of it."""
    _, model = qwen
    batch = prompts([4, 6, 5], seed=8)
    stop = _stop_token(make_engine, model, batch[1], 3)
    params = [SamplingParams(temperature=0.0, max_new_tokens=10),
              SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=(stop,)),
              SamplingParams(temperature=0.0, max_new_tokens=10)]
    off = make_engine(model, small(runner=RunnerConfig(decode_ahead="off"))).generate(batch, params)
    on_engine = make_engine(model, small(runner=RunnerConfig(decode_ahead="on")))
    on = on_engine.generate(batch, params)
    assert_same(on, off)
    assert on[1].finish_reason is FinishReason.STOP and len(on[1].token_ids) <= 4
    assert on_engine.stats.ahead_taken > 0


def test_sampled_requests_are_decoded_ahead_with_the_same_tokens(make_engine, qwen):
    """A sampled row's draw leaves its token on the device too; its uniforms come from its own
    generator in the same order either way."""
    _, model = qwen
    batch = prompts([4, 6, 5], seed=9)
    params = [SamplingParams(temperature=0.0, max_new_tokens=8),
              SamplingParams(temperature=1.0, seed=5, max_new_tokens=8),
              SamplingParams(temperature=0.8, top_k=10, top_p=0.9, max_new_tokens=8)]  # the engine's generator
    on = make_engine(model, small(runner=RunnerConfig(decode_ahead="on"), seed=3))
    off = make_engine(model, small(runner=RunnerConfig(decode_ahead="off"), seed=3))
    assert_same(on.generate(batch, params), off.generate(batch, params))
    assert on.stats.ahead_taken > 0


def _start(engine, batch, params, until) -> tuple[list[int], dict]:
    """Submit `batch`, then step until `until(rids)`; the request ids and the outputs so far."""
    rids = [engine.add_request(p, params) for p in batch]
    outs: dict = {}
    while not until(rids):
        for out in engine.step():
            outs[out.request_id] = out
    return rids, outs


def test_abort_between_steps_keeps_the_other_rows(make_engine, qwen):
    _, model = qwen
    batch = prompts([5, 3, 7], seed=10)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    results = {}
    for mode in ("off", "on"):
        engine = make_engine(model, small(runner=RunnerConfig(decode_ahead=mode)))
        rids, outs = _start(engine, batch, params, until=lambda rids: len(engine.requests[rids[1]].output) >= 3)
        engine.abort(rids[1])
        engine.check_integrity()
        drain(engine, outs)
        results[mode] = [outs[r].result for r in rids]
        if mode == "on":
            assert engine.stats.ahead_taken > 0
    assert_same(results["on"], results["off"])
    assert results["on"][1].finish_reason is FinishReason.ABORT


def test_weight_update_between_steps_waits_and_recomputes(make_engine, qwen):
    """The forward issued before an update ran on the old weights: it is dropped, and the tokens
    after the update are the new weights' (as without decode ahead)."""
    _, model = qwen
    batch = prompts([5, 8], seed=11)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    new = {k: (v * 1.05 if v.dim() > 1 else v) for k, v in state.items()}
    results = {}
    try:
        for mode in ("off", "on"):
            model.load_state_dict(state)
            engine = make_engine(model, small(runner=RunnerConfig(decode_ahead=mode)))
            rids, outs = _start(engine, batch, params, until=lambda rids: len(engine.requests[rids[0]].output) >= 4)
            if mode == "on":
                assert engine.executor.ahead.issued is not None
            engine.update_weights(new, version=1)
            assert engine.executor.ahead is None or engine.executor.ahead.issued is None
            drain(engine, outs)
            results[mode] = [outs[r].result for r in rids]
    finally:
        model.load_state_dict(state)
    assert_same(results["on"], results["off"])
    assert 0 in results["on"][0].weight_versions and 1 in results["on"][0].weight_versions


def test_kv_pressure_preemption_gives_the_same_tokens(make_engine, qwen):
    _, model = qwen
    batch = prompts([9, 11, 10, 8], seed=12)
    params = SamplingParams(temperature=0.0, max_new_tokens=14)
    tight = dataclasses.replace(SMALL, kv=KVConfig(num_blocks=14))
    off_engine = make_engine(model, dataclasses.replace(tight, runner=RunnerConfig(decode_ahead="off")))
    on_engine = make_engine(model, dataclasses.replace(tight, runner=RunnerConfig(decode_ahead="on")))
    assert_same(on_engine.generate(batch, params), off_engine.generate(batch, params))
    assert off_engine.stats.preemptions > 0 and on_engine.stats.preemptions > 0


def test_no_forward_is_issued_ahead_when_its_kv_blocks_are_not_free(make_engine, qwen):
    """Two 3-token prompts in a 4-block pool of 4-token blocks: after the first decode step both
    rows need a block for the step after the next one and none is free, so nothing is issued then
    (growing for it would raise); the tokens are decode ahead off's."""
    _, model = qwen
    batch = prompts([3, 3], seed=13)
    params = SamplingParams(temperature=0.0, max_new_tokens=9, ignore_stop=True)
    tight = dataclasses.replace(SMALL, kv=KVConfig(num_blocks=4), mux=MuxConfig())
    on = make_engine(model, dataclasses.replace(tight, runner=RunnerConfig(decode_ahead="on")))
    off = make_engine(model, dataclasses.replace(tight, runner=RunnerConfig(decode_ahead="off")))
    assert_same(on.generate(batch, params), off.generate(batch, params))
    assert on.stats.ahead_taken > 0


@pytest.mark.parametrize("seed", range(4))
def test_random_multi_turn_sessions_with_aborts_and_stops(make_engine, qwen, seed):
    """Sessions whose turns start whenever the previous one ends, random stop tokens and lengths,
    an abort now and then: every turn's tokens are the same with and without decode ahead."""
    _, model = qwen
    results = {}
    for mode in ("off", "on"):
        rng = random.Random(seed)
        engine = make_engine(model, small(rng.choice(SCHEDULES), runner=RunnerConfig(decode_ahead=mode)))
        sessions = [engine.open_session() for _ in range(3)]
        turns = {i: 3 for i in range(3)}
        live: dict[int, int] = {}
        log = []

        def start(i):
            sessions[i].append(prompts([rng.randint(1, 6)], seed=rng.randint(0, 10**6))[0])
            stop = (rng.randrange(96),) if rng.random() < 0.5 else ()
            rid = sessions[i].submit(SamplingParams(temperature=0.0, max_new_tokens=rng.randint(1, 9),
                                                    stop_token_ids=stop))
            live[rid] = i

        for i in range(3):
            start(i)
        step = 0
        while live:
            step += 1
            if step % 7 == 0 and rng.random() < 0.5:
                engine.abort(rng.choice(sorted(live)))
            for out in engine.step():
                i = live.pop(out.request_id)
                log.append((i, out.result.token_ids, out.result.finish_reason))
                turns[i] -= 1
                if turns[i] > 0:
                    start(i)
            assert step < 500
        engine.check_integrity()
        results[mode] = (sorted(log, key=repr), engine.stats)
    assert results["on"][0] == results["off"][0]
    assert results["on"][1].ahead_taken > 0


def test_decode_ahead_setting_is_checked():
    with pytest.raises(ValueError, match="decode_ahead must be auto, on or off"):
        RunnerConfig(decode_ahead="yes")
    assert EngineConfig(runner=RunnerConfig(decode_ahead="off")).runner.decode_ahead == "off"


def test_decode_ahead_on_is_refused_on_many_ranks(qwen):
    """A rank-shared coordinator plans from the gathered state: a forward issued ahead on one rank
    would run collectives the others do not, so 'on' is refused there (and 'auto' stays off)."""
    from megatron_rollout.engine import RolloutEngine
    from megatron_rollout.engine.coordinator import RankSharedCoordinator

    _, model = qwen
    shared = RankSharedCoordinator.__new__(RankSharedCoordinator)  # the engine reads its type and `leader`
    shared.leader = True
    with pytest.raises(ValueError, match="single-rank engine"):
        RolloutEngine(model, EngineConfig(runner=RunnerConfig(decode_ahead="on")), coordinator=shared)
    auto = RolloutEngine(model, EngineConfig(runner=RunnerConfig(decode_ahead="auto")), coordinator=shared)
    assert auto.executor.ahead is None
