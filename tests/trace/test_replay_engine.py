"""Replay against the real engine (tiny-moe on CPU): every schedule serves the whole trace, a turn
the engine refuses is counted, and the engine's spans reach a Chrome trace."""
import json
from collections import Counter

import pytest
import torch

from megatron_rollout.engine import EngineConfig, KVConfig, RolloutEngine, SchedulerConfig
from megatron_rollout.model.checkpoint import load_model
from megatron_rollout.trace.make import make_trace
from megatron_rollout.trace.replay import replay
from megatron_rollout.trace.schema import TraceRequest
from megatron_rollout.trace.timeline import Timeline


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_model("tiny-moe", device="cpu")


@pytest.fixture(scope="module")
def trace():
    return make_trace(conversations=3, seed=0, scale=0.01)


@pytest.mark.parametrize("schedule", ["off", "chunked", "mux"])
def test_every_schedule_serves_the_trace_with_forced_lengths(model, trace, schedule, tmp_path):
    timeline = Timeline()
    engine = RolloutEngine(model,
                           EngineConfig(scheduler=SchedulerConfig(schedule=schedule), kv=KVConfig(num_blocks=256)),
                           timeline=timeline)
    report, outputs = replay(engine, trace, seed=0, progress=False, vocab_size=model.cfg.vocab_size,
                             schedule=schedule)
    assert (report.requests, report.failed, report.skipped) == (len(trace), 0, 0)
    assert Counter(len(o.result.token_ids) for o in outputs) == Counter(r.output_tokens for r in trace)
    assert report.output_tokens == sum(r.output_tokens for r in trace)
    # input_tokens are the trace's; a later turn also prefills the last sampled token, whose K/V is not
    # cached yet (and nothing is recomputed with this many blocks).
    new_tokens = sum(r.input_tokens for r in trace)
    assert report.input_tokens == new_tokens
    assert new_tokens <= report.prefill_tokens <= new_tokens + sum(r.turn > 0 for r in trace)
    assert report.truncated == 0
    assert report.schedule == schedule and report.makespan_s > 0 and report.tokens_per_s > 0
    assert not engine.has_work() and engine.seqs == {}  # every session closed

    timeline.write_chrome_trace(tmp_path / "timeline.json")
    spans = [e for e in json.loads((tmp_path / "timeline.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(timeline) > 0
    assert {e["cat"] for e in spans} == {"P", "D"}


def test_refused_turn_ends_its_conversation(model):
    trace = [TraceRequest("long", 0, 30, 2, 0.0), TraceRequest("short", 0, 5, 2, 0.0),
             TraceRequest("long", 1, 40, 2, 1.0),  # 72 tokens of context > max_model_len 64: refused
             TraceRequest("short", 1, 5, 2, 1.0), TraceRequest("long", 2, 1, 1, 1.0)]
    engine = RolloutEngine(model, EngineConfig(scheduler=SchedulerConfig(schedule="chunked"),
                                               kv=KVConfig(num_blocks=64), max_model_len=64))
    report, outputs = replay(engine, trace, progress=False, vocab_size=model.cfg.vocab_size)
    assert (report.requests, report.failed, report.skipped) == (3, 1, 1)
    assert len(outputs) == 3 and engine.seqs == {}
    short = [o for o in outputs if o.prompt_tokens < 30]  # "long" turn 0 prefilled 30 tokens
    assert len(short) == 2  # the trajectory figure covers only the uncut conversation
    span = max(o.times.finish for o in short) - min(o.times.arrival for o in short)
    assert report.p99_trajectory_s == pytest.approx(span)


@pytest.mark.parametrize("schedule", ["off", "chunked"])
def test_turn_cut_by_a_full_context_counts_as_truncated(model, schedule):
    # 20 + 10 = 30 tokens after turn 0; turn 1 adds 10 and asks 50, but max_model_len 64 leaves room for 24.
    trace = [TraceRequest("t", 0, 20, 10, 0.0), TraceRequest("u", 0, 5, 3, 0.0), TraceRequest("t", 1, 10, 50, 1.0),
             TraceRequest("t", 2, 2, 2, 1.0)]
    engine = RolloutEngine(model, EngineConfig(scheduler=SchedulerConfig(schedule=schedule), kv=KVConfig(num_blocks=64),
                                               max_model_len=64))
    report, outputs = replay(engine, trace, progress=False, vocab_size=model.cfg.vocab_size)
    assert (report.requests, report.truncated, report.failed, report.skipped) == (2, 1, 0, 1)
    assert sorted(len(o.result.token_ids) for o in outputs) == [3, 10, 24]
    assert report.output_tokens == 13 and report.input_tokens == 25
    assert engine.seqs == {}


def test_a_line_longer_than_the_context_is_refused_with_its_line_before_any_allocation(model, tmp_path):
    import time

    from megatron_rollout.trace.schema import TraceError, load_trace

    path = tmp_path / "t.jsonl"
    path.write_text('{"conversation": 0, "turn": 0, "input_tokens": 5, "output_tokens": 2, "wait_ms": 0}\n'
                    '{"conversation": 1, "turn": 0, "input_tokens": 10000000, "output_tokens": 2, "wait_ms": 0}\n')
    engine = RolloutEngine(model, EngineConfig(kv=KVConfig(num_blocks=64), max_model_len=64))
    start = time.process_time()  # CPU time: what preparing 10M tokens would cost, whatever the machine's load
    with pytest.raises(TraceError, match=r"t\.jsonl:2: input_tokens 10000000 does not fit the context"):
        replay(engine, load_trace(path), progress=False, vocab_size=model.cfg.vocab_size)
    assert time.process_time() - start < 0.5 and engine.seqs == {}


def test_sampled_replay_repeats_its_tokens_and_the_seed_changes_them(model, trace):
    """temperature > 0: each turn draws from a seed of (seed, conversation, turn), not from the
    engine's shared generator, so an engine seeded otherwise gives the same tokens; another replay
    seed gives other tokens; the lengths stay forced."""
    def tokens(seed, engine_seed):
        engine = RolloutEngine(model, EngineConfig(scheduler=SchedulerConfig(schedule="off"),
                                                   kv=KVConfig(num_blocks=256), seed=engine_seed))
        report, outputs = replay(engine, trace, seed=seed, progress=False, vocab_size=model.cfg.vocab_size,
                                 temperature=1.0)
        assert report.output_tokens == sum(r.output_tokens for r in trace) and report.failed == 0
        return sorted((o.prompt_tokens, tuple(o.result.token_ids)) for o in outputs)

    first = tokens(0, engine_seed=0)
    assert tokens(0, engine_seed=5) == first
    assert tokens(1, engine_seed=0) != first
    with pytest.raises(ValueError, match="temperature"):
        replay(RolloutEngine(model, EngineConfig(kv=KVConfig(num_blocks=64))), trace, progress=False,
               vocab_size=model.cfg.vocab_size, temperature=-1.0)
