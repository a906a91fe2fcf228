"""The engine's step records: one per forward, sizes from its rows, marks around it."""
import time

import pytest
import torch

from megatron_rollout.engine import EngineConfig, KVConfig, MuxConfig, RolloutEngine, SamplingParams, SchedulerConfig
from megatron_rollout.engine.records import step_record
from megatron_rollout.kv.paged import SeqSpan
from megatron_rollout.model.checkpoint import load_model
from megatron_rollout.types import SpanInput


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_model("tiny-moe", device="cpu")


def test_sizes_come_from_the_rows_spans():
    rows = [SpanInput(SeqSpan((0,), 9, 1), [1], True), SpanInput(SeqSpan((1,), 4, 1), [1], True),
            SpanInput(SeqSpan((2,), 3, 5), [1] * 5, True), SpanInput(SeqSpan((3,), 0, 2), [1, 2], False)]
    r = step_record("P", rows, 2, 1.0, 1.5)
    assert (r.decode_rows, r.decode_context) == (2, 10 + 5)
    assert (r.prefill_rows, r.prefill_tokens) == (2, 7)
    assert r.prefill_pairs == (5 * 3 + 15) + (0 + 3)  # new * past + new * (new + 1) / 2 per chunk
    assert r.mixed and r.duration == 0.5 and r.epoch is None
    assert r.decode_positions == r.positions == 2
    verify = step_record("D", [SpanInput(SeqSpan((0,), 9, 4), [1] * 4, True), rows[1]], 2, 2.0, 2.1)
    assert (verify.decode_rows, verify.positions, verify.decode_context) == (2, 5, 13 + 5)  # a row and 3 drafts


@pytest.mark.parametrize("schedule", ["off", "chunked"])
def test_one_record_per_forward_with_its_sizes(model, schedule):
    engine = RolloutEngine(model, EngineConfig(scheduler=SchedulerConfig(schedule), kv=KVConfig(num_blocks=64)))
    engine.generate([[0] * 4], SamplingParams(max_new_tokens=2))
    assert len(engine.step_log) == 0  # off by default: a rollout outside a replay pays nothing
    with engine.step_log.recording():
        engine.generate([[1] * 10, [2] * 7], SamplingParams(max_new_tokens=3))
    engine.generate([[0] * 4], SamplingParams(max_new_tokens=2))
    recs = engine.step_log.records
    # One prefill of both prompts (10 + 7 tokens), then two decode steps over both rows.
    assert [(r.phase, r.decode_rows, r.prefill_rows, r.prefill_tokens) for r in recs] == [
        ("P", 0, 2, 17), ("D", 2, 0, 0), ("D", 2, 0, 0)]
    assert recs[0].prefill_pairs == 55 + 28
    assert [r.decode_context for r in recs[1:]] == [11 + 8, 12 + 9]
    assert all(a.end <= b.start for a, b in zip(recs, recs[1:])) and all(r.duration > 0 for r in recs)
    # one engine step a forward here, each begun before its forward (its planning between them)
    starts = engine.step_log.step_starts
    assert len(starts) == len(recs) and all(s <= r.start for s, r in zip(starts, recs))
    assert all(r.end <= s for r, s in zip(recs, starts[1:]))
    engine.step_log.clear()
    assert engine.step_log.step_starts == [] and len(engine.step_log) == 0


def test_mux_segments_carry_their_epoch_and_its_sizes_once(model):
    engine = RolloutEngine(model, EngineConfig(scheduler=SchedulerConfig(schedule="mux"), kv=KVConfig(num_blocks=64),
                                               mux=MuxConfig(span="fixed:1")))
    with engine.step_log.recording():
        engine.add_request([3] * 12, SamplingParams(max_new_tokens=8))
        engine.step()
        engine.step()  # the first request decodes while the second one's epoch runs segment by segment
        engine.add_request([4] * 9, SamplingParams(max_new_tokens=2))
        while engine.has_work():
            engine.step()
    segments = [r for r in engine.step_log.records if r.epoch is not None]
    second = [r for r in segments if r.epoch == 2]
    assert len(second) > 1  # one segment per round while decode rows ran
    assert [r.prefill_tokens for r in second] == [9] + [0] * (len(second) - 1)
    assert all(r.decode_rows == 0 and r.phase == "P" for r in segments)
    decode = [r for r in engine.step_log.records if r.epoch is None]
    assert decode and all(r.phase == "D" and r.prefill_rows == 0 for r in decode)


def test_completion_polls_without_decode_are_not_recorded_as_segments(model, monkeypatch):
    """An asynchronous runner's P yields completion polls (negative layer) after its last boundary
    while the device finishes it. A round that polls with no decode row runs nothing, so it has no
    P record (`sim.cost` counts a `mux` epoch's records as its rounds); one with decode rows ran a
    decode iteration and keeps its record."""
    from megatron_rollout.model.layers import BoundaryPoint, Site
    from megatron_rollout.types import Phase

    engine = RolloutEngine(model, EngineConfig(scheduler=SchedulerConfig(schedule="mux"), kv=KVConfig(num_blocks=64),
                                               mux=MuxConfig(span="fixed:1")))
    forward, polls = engine.executor.forward, []

    def polling(step, phase):
        inner = forward(step, phase)
        if phase is not Phase.P:
            return inner

        def gen():
            result = yield from inner
            for _ in range(3):
                polls.append(1)
                yield BoundaryPoint(-1, Site.MOE_DATA)
            return result
        return gen()

    monkeypatch.setattr(engine.executor, "forward", polling)
    want = RolloutEngine(model, EngineConfig(scheduler=SchedulerConfig(schedule="mux"), kv=KVConfig(num_blocks=64),
                                             mux=MuxConfig(span="fixed:1")))
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    with engine.step_log.recording(), want.step_log.recording():
        got = engine.generate([[3] * 12, [4] * 9], params)  # one epoch, no decode row beside it
        ref = want.generate([[3] * 12, [4] * 9], params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref] and polls
    segments = lambda e: [r for r in e.step_log.records if r.epoch is not None]  # noqa: E731
    assert len(segments(engine)) == len(segments(want)) >= 1
    with engine.step_log.recording(), want.step_log.recording():  # the second epoch beside a decoding row
        for e in (engine, want):
            e.add_request([3] * 12, SamplingParams(max_new_tokens=12))
            e.step()
            e.step()
            e.add_request([4] * 9, SamplingParams(max_new_tokens=2))
            while e.has_work():
                e.step()
    polled = [r for r in segments(engine) if r.epoch == segments(engine)[-1].epoch]
    plain = [r for r in segments(want) if r.epoch == segments(want)[-1].epoch]
    assert len(polled) == len(plain) + 3  # each poll round ran a decode iteration: recorded


def test_the_wall_clock_offset_comes_from_the_tightest_read():
    """A read pre-empted between the two clocks (here the first: 30 ms between its perf_counter
    reads) must not set the offset that every `mux` segment's stamps are converted with."""
    from megatron_rollout.engine.records import wall_minus_perf

    perf = iter([10.000, 10.030, 11.000, 11.0001, 12.000, 12.001])
    wall = iter([1000.029, 1001.00005, 1002.0009])  # true offset 990 (the second read is tight)
    assert wall_minus_perf(3, lambda: next(perf), lambda: next(wall)) == pytest.approx(990.0, abs=1e-4)
    assert abs(wall_minus_perf() - (time.time() - time.perf_counter())) < 1.0  # the real clocks (a loaded host)
