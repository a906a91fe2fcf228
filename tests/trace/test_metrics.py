import json
import math

import pytest

from megatron_rollout.engine.api import FinishReason, GenerationResult, RequestOutput, RequestTimes, Schedule
from megatron_rollout.trace.metrics import build_report


def _out(rid, arrival, first, finish, n_out=2, prompt=10, error=False, admitted=None):
    reason = FinishReason.ERROR if error else FinishReason.LENGTH
    tokens = [] if error else [1] * n_out
    result = GenerationResult(tokens, [0.0] * len(tokens), reason, [0] * len(tokens),
                              error="too long" if error else None)
    return RequestOutput(rid, result, RequestTimes(arrival, first, finish, admitted), prompt)


def test_ttft_splits_into_queue_and_prefill_where_admission_was_recorded():
    outputs = [_out(0, 10.0, 10.5, 11.0, admitted=10.2),  # queue 0.2, prefill 0.3
               _out(1, 10.0, 11.0, 12.0, admitted=10.6),  # queue 0.6, prefill 0.4
               _out(2, 10.0, 10.4, 12.0)]  # no admission mark (a peer's request): TTFT only
    report = build_report(outputs, {0: "a", 1: "b", 2: "c"}, start=10.0, mean_decode_wait_ms=0.0)
    assert report.mean_ttft_s == pytest.approx((0.5 + 1.0 + 0.4) / 3)
    assert report.mean_queue_s == pytest.approx(0.4)
    assert report.mean_prefill_s == pytest.approx(0.35)
    none = build_report(outputs[2:], {2: "c"}, start=10.0, mean_decode_wait_ms=0.0).to_dict()
    assert none["mean_queue_s"] is None and none["mean_prefill_s"] is None


def test_report_values_by_hand():
    start = 100.0
    outputs = [
        # conversation "a": 3 turns
        _out(0, 100.0, 100.5, 101.0, n_out=3, prompt=20),  # completion 1.0, ttft 0.5
        _out(1, 102.0, 102.5, 104.0, n_out=5, prompt=4),   # completion 2.0
        _out(2, 105.0, 105.5, 108.0, n_out=2, prompt=6),   # completion 3.0
        # conversation 7: 1 turn
        _out(3, 100.0, 101.5, 104.0, n_out=10, prompt=30),  # completion 4.0, ttft 1.5
    ]
    report = build_report(outputs, {0: "a", 1: "a", 2: "a", 3: 7}, start=start, mean_decode_wait_ms=12.5,
                          schedule=Schedule.MUX)
    assert report.schedule == "mux"
    assert (report.requests, report.failed, report.skipped) == (4, 0, 0)
    assert report.output_tokens == 20 and report.input_tokens == 60
    assert report.makespan_s == pytest.approx(8.0)
    assert report.tokens_per_s == pytest.approx(20 / 8.0)
    # completions [1, 2, 3, 4]: linear interpolation, p50 = 2.5, p99 = 3 + 0.97 * (4 - 3)
    assert report.p50_request_s == pytest.approx(2.5)
    assert report.p99_request_s == pytest.approx(3.97)
    # trajectories: a = 108 - 100 = 8, 7 = 4; p99 = 4 + 0.99 * 4
    assert report.p99_trajectory_s == pytest.approx(7.96)
    assert report.mean_ttft_s == pytest.approx((0.5 + 0.5 + 0.5 + 1.5) / 4)
    assert report.p99_ttft_s == pytest.approx(0.5 + 0.97 * 1.0)
    assert report.mean_decode_wait_ms == 12.5


def test_failed_request_counts_in_makespan_only():
    outputs = [
        _out(0, 0.0, 0.5, 1.0, n_out=4),
        _out(1, 2.0, None, 9.0, error=True),  # conversation "a" is cut: no trajectory figure for it
        _out(2, 0.0, 1.0, 3.0, n_out=6),
    ]
    report = build_report(outputs, {0: "a", 1: "a", 2: "b"}, start=0.0, mean_decode_wait_ms=0.0,
                          skipped=2)
    assert (report.requests, report.failed, report.skipped) == (2, 1, 2)
    assert report.output_tokens == 10
    assert report.makespan_s == pytest.approx(9.0)
    assert report.p50_request_s == pytest.approx(2.0)  # completions [1, 3]
    assert report.p99_trajectory_s == pytest.approx(3.0)  # only "b"
    assert report.mean_ttft_s == pytest.approx(0.75)


def test_json_is_strict_and_empty_figures_are_null():
    report = build_report([_out(0, 1.0, None, 2.0, error=True)], {0: "a"}, start=0.0,
                          mean_decode_wait_ms=3.0, schedule="off")
    data = json.loads(report.to_json())
    assert data["schedule"] == "off" and data["failed"] == 1 and data["requests"] == 0
    assert data["p99_request_s"] is None and data["mean_ttft_s"] is None
    assert data["makespan_s"] == pytest.approx(2.0)
    assert math.isnan(report.p50_request_s)
    assert set(data) >= {"requests", "output_tokens", "makespan_s", "p50_request_s", "p99_request_s",
                         "p99_trajectory_s", "mean_ttft_s", "mean_decode_wait_ms", "tokens_per_s", "schedule"}
    assert "failed=1" in report.summary()


def test_missing_conversation_id_is_an_error():
    with pytest.raises(ValueError, match=r"no conversation id for request\(s\) \[5\]"):
        build_report([_out(5, 0.0, 0.1, 0.2)], {}, start=0.0, mean_decode_wait_ms=0.0)


def test_short_outputs_are_truncated_and_input_tokens_come_from_the_trace(caplog):
    from megatron_rollout.trace.schema import TraceRequest

    outputs = [
        _out(0, 0.0, 0.5, 1.0, n_out=3, prompt=12),  # asked 3: complete; prefilled 12 for 10 new (recomputed)
        _out(1, 2.0, 2.5, 4.0, n_out=54, prompt=6),  # asked 100, got 54: truncated, "a" is cut
        _out(2, 0.0, 1.0, 3.0, n_out=2, prompt=5),  # asked 2: complete
    ]
    turn_of = {0: TraceRequest("a", 0, 10, 3, 0.0), 1: TraceRequest("a", 1, 6, 100, 1.0),
               2: TraceRequest("b", 0, 5, 2, 0.0)}
    report = build_report(outputs, {0: "a", 1: "a", 2: "b"}, start=0.0, mean_decode_wait_ms=0.0, skipped=1,
                          turn_of=turn_of)
    assert (report.requests, report.truncated, report.failed, report.skipped) == (2, 1, 0, 1)
    assert (report.input_tokens, report.prefill_tokens, report.output_tokens) == (15, 17, 5)
    assert report.p50_request_s == pytest.approx(2.0)  # completions [1, 3]: the truncated one is left out
    assert report.p99_trajectory_s == pytest.approx(3.0)  # only "b"
    data = json.loads(report.to_json())
    assert (data["truncated"], data["input_tokens"], data["prefill_tokens"]) == (1, 15, 17)
    with pytest.raises(ValueError, match=r"no trace line for request\(s\) \[2\]"):
        build_report(outputs, {0: "a", 1: "a", 2: "b"}, start=0.0, mean_decode_wait_ms=0.0,
                     turn_of={0: turn_of[0], 1: turn_of[1]})
    # Without the trace lines the report says what it cannot tell.
    old = build_report(outputs, {0: "a", 1: "a", 2: "b"}, start=0.0, mean_decode_wait_ms=0.0)
    assert (old.requests, old.truncated, old.input_tokens) == (3, 0, 23)
    assert "without turn_of: truncated turns are not detected" in caplog.text
