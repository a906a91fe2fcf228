"""The makespan breakdown: occupancy of hand-made records, the critical conversation's path, the
decode step stretch, busy bins, the plot, and a real replay's report carrying it."""
import json
import math

import pytest
import torch

from megatron_rollout.engine import EngineConfig, KVConfig, RolloutEngine, SchedulerConfig
from megatron_rollout.engine.api import FinishReason, GenerationResult, RequestOutput, RequestTimes
from megatron_rollout.engine.records import StepRecord
from megatron_rollout.model.checkpoint import load_model
from megatron_rollout.trace.breakdown import build_breakdown, plot_breakdown
from megatron_rollout.trace.make import make_trace
from megatron_rollout.trace.replay import replay
from megatron_rollout.trace.schema import TraceRequest


def rec(start, end, rows=0, tokens=0):
    return StepRecord("P" if tokens else "D", rows, rows * 10, int(bool(tokens)), tokens, tokens, start, end)


def out(rid, arrival, admitted, first, finish, tokens=3):
    result = GenerationResult([1] * tokens, [0.0] * tokens, FinishReason.LENGTH, [0] * tokens)
    return RequestOutput(rid, result, RequestTimes(arrival, first, finish, admitted), 5)


START = 100.0
# prefill [0, 1), decode [1, 1.5), idle [1.5, 2), mixed [2, 3), decode [3, 3.25) (from START)
RECORDS = [rec(100.0, 101.0, tokens=20), rec(101.0, 101.5, rows=1), rec(102.0, 103.0, rows=1, tokens=10),
           rec(103.0, 103.25, rows=1)]


def test_critical_path_adds_up_to_its_end_and_says_what_shared_its_steps():
    outputs = [out(0, 100.0, 100.0, 101.0, 101.5, tokens=2),  # a, turn 0
               out(1, 101.75, 102.0, 103.0, 103.25, tokens=2),  # a, turn 1 (tool wait 0.25 s)
               out(2, 100.0, 102.0, 103.0, 103.0, tokens=1)]  # b: queued behind a's prefill
    turn_of = {0: TraceRequest("a", 0, 5, 2, 0.0), 1: TraceRequest("a", 1, 5, 2, 200.0),
               2: TraceRequest("b", 0, 5, 1, 0.0)}
    b = build_breakdown(RECORDS, outputs, {0: "a", 1: "a", 2: "b"}, start=START, mean_decode_wait_ms=2.0, bins=13,
                        turn_of=turn_of)
    assert b.makespan_s == pytest.approx(3.25)
    assert (b.engine.prefill_s, b.engine.decode_s, b.engine.mixed_s, b.engine.idle_s) == pytest.approx(
        (1.0, 0.75, 1.0, 0.5))
    assert b.forwards == {"prefill": 1, "decode": 2, "mixed": 1}
    assert b.shared["mixed"] == {"decode_rows": 1.0, "decode_context": 10.0, "prefill_tokens": 10.0}
    assert b.shared["prefill"]["prefill_tokens"] == 20.0 and b.shared["decode"]["decode_rows"] == 1.0
    c = b.critical
    assert c.conversation == "a" and c.requests == 2 and c.end_s == pytest.approx(3.25)
    assert c.tool_wait_s == pytest.approx(0.25) and c.release_s == pytest.approx(0.05)  # 0.2 s was the tool's
    assert c.queue.total_s == pytest.approx(0.25) and c.queue.idle_s == pytest.approx(0.25)
    assert (c.prefill.prefill_s, c.prefill.mixed_s) == pytest.approx((1.0, 1.0))
    assert (c.decode.decode_s, c.decode.total_s) == pytest.approx((0.75, 0.75))
    assert c.tool_wait_s + c.queue.total_s + c.prefill.total_s + c.decode.total_s == pytest.approx(c.end_s)
    assert c.tpot_ms == pytest.approx(1e3 * 0.75 / 2)
    # Row-weighted: decode rows ran in steps of 0.5, 1.0 (mixed) and 0.25 s; pure ones 0.5 and 0.25.
    assert b.pure_decode_step_ms == pytest.approx(375.0)
    assert b.decode_step_ms == pytest.approx(1e3 * 1.75 / 3)
    assert b.decode_step_stretch == pytest.approx(1.75 / 3 / 0.375)
    assert b.all_requests.queue.total_s == pytest.approx(0.25 + 2.0) and math.isnan(b.all_requests.tool_wait_s)
    assert len(b.busy) == 13 and b.bin_s == pytest.approx(0.25)
    assert b.busy[0] == {"prefill": 1.0, "decode": 0.0, "mixed": 0.0}
    assert b.busy[6] == {"prefill": 0.0, "decode": 0.0, "mixed": 0.0}  # [1.5, 1.75): idle
    assert sum(sum(x.values()) for x in b.busy) * b.bin_s == pytest.approx(2.75)
    d = b.to_dict()
    json.dumps(d, allow_nan=False)
    assert d["all_requests"]["tool_wait_s"] is None and d["all_requests"]["release_s"] is None
    assert d["critical"]["tpot_ms"] == pytest.approx(375.0)


def test_no_decode_shared_a_step_means_no_stretch_and_bad_input_is_refused():
    b = build_breakdown([rec(100.0, 101.0, tokens=5), rec(101.0, 101.1, rows=2)], [out(0, 100.0, 100.0, 101.0, 101.1)],
                        {0: 7}, start=START)
    assert b.decode_step_stretch == pytest.approx(1.0) and b.critical.conversation == 7
    with pytest.raises(ValueError, match="bins must be a positive int"):
        build_breakdown([], [], {}, start=START, bins=0)
    with pytest.raises(ValueError, match=r"no conversation id for request\(s\) \[0\]"):
        build_breakdown([], [out(0, 100.0, 100.0, 101.0, 101.1)], {}, start=START)


def test_records_that_seem_to_overlap_are_counted_once():
    """A `mux` segment's stamps are converted from another clock; where that makes it start 0.1 s
    before the decode iteration ahead of it ends, the overlap is counted once, so the critical
    path still adds up to its end."""
    records = [rec(100.0, 101.0, rows=1), rec(100.9, 102.0, tokens=20), rec(102.0, 103.0, rows=1)]
    b = build_breakdown(records, [out(0, 100.0, 100.0, 102.0, 103.0)], {0: "a"}, start=START)
    assert (b.engine.decode_s, b.engine.prefill_s, b.engine.idle_s) == pytest.approx((2.0, 1.0, 0.0))
    c = b.critical
    assert c.tool_wait_s + c.queue.total_s + c.prefill.total_s + c.decode.total_s == pytest.approx(c.end_s)
    assert c.prefill.total_s == pytest.approx(2.0) and c.prefill.prefill_s == pytest.approx(1.0)


def test_plot_writes_a_figure(tmp_path):
    pytest.importorskip("matplotlib")
    b = build_breakdown(RECORDS, [out(0, 100.0, 100.0, 101.0, 103.25)], {0: "a"}, start=START)
    plot_breakdown(b, str(tmp_path / "breakdown.png"))
    assert (tmp_path / "breakdown.png").read_bytes()[:4] == b"\x89PNG"
    plot_breakdown(json.loads(json.dumps(b.to_dict())), str(tmp_path / "from_json.png"))  # a report's JSON form
    assert (tmp_path / "from_json.png").stat().st_size > 1000


@pytest.mark.parametrize("schedule", ["chunked", "mux"])
def test_a_real_replay_reports_its_breakdown(schedule):
    torch.manual_seed(0)
    model = load_model("tiny-moe", device="cpu")
    trace = make_trace(conversations=2, seed=0, scale=0.01)
    engine = RolloutEngine(model,
                           EngineConfig(scheduler=SchedulerConfig(schedule=schedule), kv=KVConfig(num_blocks=256)))
    details = {}
    report, outputs = replay(engine, trace, progress=False, vocab_size=model.cfg.vocab_size, details=details)
    b = report.breakdown
    json.loads(report.to_json())
    assert b["makespan_s"] == pytest.approx(report.makespan_s)
    assert b["critical"]["end_s"] == pytest.approx(report.makespan_s)
    c = b["critical"]
    waits = sum(t.wait_ms for t in trace if t.conversation == c["conversation"]) / 1e3
    assert c["tool_wait_s"] - c["release_s"] == pytest.approx(waits, abs=1e-6)
    parts = c["tool_wait_s"] + sum(sum(c[k].values()) for k in ("queue", "prefill", "decode"))
    assert parts == pytest.approx(report.makespan_s, rel=1e-6)
    assert b["all_requests"]["requests"] == len(trace) and b["all_requests"]["output_tokens"] == report.output_tokens
    records = details["records"]
    assert sum(r.prefill_tokens for r in records) == report.prefill_tokens
    assert sum(r.decode_rows for r in records) == report.output_tokens - len(trace)
    assert sum(b["forwards"].values()) == len(records) > 0
