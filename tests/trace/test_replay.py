"""Replay driver against a test double of the engine API (sleep-based steps).

The double follows the engine's session API closely enough to exercise the driver's logic
(release times, forced lengths, failures, sessions, idling); a test against the real engine
belongs with the engine.
"""
import time
from types import SimpleNamespace

import pytest

from megatron_rollout.engine.api import FinishReason, GenerationResult, RequestOutput, RequestTimes, Schedule
from megatron_rollout.trace.replay import replay
from megatron_rollout.trace.schema import TraceRequest

VOCAB = 50


class FakeSession:
    def __init__(self, engine):
        self.engine = engine
        self.context: list[int] = []
        self.appended: list[list[int]] = []
        self.params = []
        self.closed = False
        self.busy = False
        self.prefilled = 0
        self.request_ids: list[int] = []

    def append(self, token_ids):
        assert not self.closed and not self.busy
        self.context.extend(token_ids)
        self.appended.append(list(token_ids))

    def submit(self, params):
        assert not self.closed and not self.busy, "a session runs one request at a time"
        self.busy = True
        self.params.append(params)
        rid = self.engine.next_id
        self.engine.next_id += 1
        self.request_ids.append(rid)
        self.engine.waiting.append(SimpleNamespace(
            rid=rid, session=self, params=params, arrival=time.perf_counter(), first=None, tokens=[],
            prompt=len(self.context) - (0 if self.engine.recompute else self.prefilled)))
        self.prefilled = len(self.context)
        return rid

    def close(self):
        self.closed = True


class FakeEngine:
    """One step = sleep, prefill waiting requests (first token), one token per running request."""

    def __init__(self, step_s=0.001, max_context=None, lose_request=None, full_at=None, recompute=False):
        self.step_s = step_s
        self.max_context = max_context  # a request that cannot fit is finished with an error
        self.full_at = full_at  # generation stops (length) when the context reaches this
        self.recompute = recompute  # every turn prefills its whole context (as after an eviction)
        self.lose_request = lose_request
        self.next_id = 100
        self.waiting, self.running, self.sessions = [], [], []
        self.steps = self.has_work_calls = 0
        self.stats = SimpleNamespace(mean_decode_wait_ms=2.5)

    def open_session(self):
        self.sessions.append(FakeSession(self))
        return self.sessions[-1]

    def has_work(self):
        self.has_work_calls += 1
        return bool(self.waiting or self.running)

    def _done(self, req, reason, error=None):
        req.session.busy = False
        req.session.prefilled = len(req.session.context)  # generated tokens are cached, not re-prefilled
        result = GenerationResult(list(req.tokens), [0.0] * len(req.tokens), reason, [0] * len(req.tokens), error)
        return RequestOutput(req.rid, result, RequestTimes(req.arrival, req.first, time.perf_counter()), req.prompt)

    def step(self):
        self.steps += 1
        time.sleep(self.step_s)
        finished = []
        for req in self.waiting:
            if req.rid == self.lose_request:
                continue
            if self.max_context and len(req.session.context) + req.params.max_new_tokens > self.max_context:
                finished.append(self._done(req, FinishReason.ERROR, "context too long"))
            else:
                self.running.append(req)
        self.waiting = []
        now = time.perf_counter()
        for req in list(self.running):
            token = len(req.session.context) % VOCAB
            req.tokens.append(token)
            req.session.context.append(token)
            req.first = req.first or now
            if len(req.tokens) == req.params.max_new_tokens or len(req.session.context) == self.full_at:
                self.running.remove(req)
                finished.append(self._done(req, FinishReason.LENGTH))
        return finished


def _trace(spec):
    """spec: {conversation: [(input, output, wait_ms), ...]} -> interleaved-by-turn trace."""
    out = []
    for turn in range(max(len(t) for t in spec.values())):
        for conv, turns in spec.items():
            if turn < len(turns):
                out.append(TraceRequest(conv, turn, *turns[turn]))
    return out


SPEC = {"a": [(8, 3, 0.0), (5, 2, 4.0), (6, 1, 2.0)], 1: [(4, 2, 1.0)], "c": [(3, 4, 0.0), (2, 2, 3.0)]}


def _by_conv(engine, trace):
    """Map the double's sessions (opened in release order) to conversations via appended sizes."""
    sizes = {}
    for req in trace:
        sizes.setdefault(req.conversation, []).append(req.input_tokens)
    found = {}
    for s in engine.sessions:
        key = [k for k, v in sizes.items() if v == [len(a) for a in s.appended]]
        assert len(key) == 1
        found[key[0]] = s
    return found


def test_every_turn_served_with_forced_lengths_and_random_inputs():
    trace = _trace(SPEC)
    engine = FakeEngine()
    report, outputs = replay(engine, trace, seed=1, progress=False, vocab_size=VOCAB, schedule=Schedule.OFF)
    assert (report.requests, report.failed, report.skipped) == (6, 0, 0)
    assert report.output_tokens == sum(r.output_tokens for r in trace) == 14
    assert report.input_tokens == sum(r.input_tokens for r in trace) == 28
    assert report.schedule == "off" and report.mean_decode_wait_ms == 2.5
    assert sorted(len(o.result.token_ids) for o in outputs) == sorted(r.output_tokens for r in trace)
    sessions = _by_conv(engine, trace)
    assert len(engine.sessions) == 3 and all(s.closed for s in engine.sessions)
    for key, turns in SPEC.items():
        s = sessions[key]
        assert [p.max_new_tokens for p in s.params] == [t[1] for t in turns]
        assert all(p.temperature == 0 and p.ignore_stop for p in s.params)
        # context = input_0, output_0, input_1, output_1, ... (outputs stay in the session)
        assert len(s.context) == sum(t[0] + t[1] for t in turns)
        assert all(0 <= t < VOCAB for chunk in s.appended for t in chunk)
    assert len({tuple(c) for s in engine.sessions for c in s.appended}) == 6  # not one constant chunk


def test_each_turns_submission_is_marked_on_the_host_clock():
    trace = _trace(SPEC)
    details: dict = {}
    _, outputs = replay(FakeEngine(), trace, seed=1, progress=False, vocab_size=VOCAB, details=details)
    marks = details["submissions"]
    assert sorted(n for _, _, n in marks) == sorted(r.input_tokens for r in trace)
    assert all(details["start"] <= a <= b for a, b, _ in marks)
    assert [a for a, _, _ in marks] == sorted(a for a, _, _ in marks)  # in the order they were submitted
    arrivals = sorted(o.times.arrival for o in outputs)
    assert all(a <= arrival <= b for (a, b, _), arrival in zip(marks, arrivals))  # the request is made inside it


def test_tool_wait_separates_a_finish_from_the_next_arrival():
    # Slack 50 ms: well under any wait, so a doubled or skipped wait fails.
    trace = [TraceRequest("w", 0, 4, 2, 60.0), TraceRequest("w", 1, 4, 2, 80.0), TraceRequest("w", 2, 4, 1, 60.0)]
    before = time.perf_counter()
    _, outputs = replay(FakeEngine(), trace, progress=False, vocab_size=VOCAB)
    outputs.sort(key=lambda o: o.times.arrival)
    assert 0.060 <= outputs[0].times.arrival - before < 0.060 + 0.05
    for prev, nxt, req in zip(outputs, outputs[1:], trace[1:]):
        gap = nxt.times.arrival - prev.times.finish
        assert req.wait_ms / 1e3 <= gap < req.wait_ms / 1e3 + 0.05, (req, gap)


def test_idle_replay_sleeps_until_the_next_release():
    engine = FakeEngine()
    t0 = time.perf_counter()
    details: dict = {}
    report, outputs = replay(engine, [TraceRequest(0, 0, 2, 1, 150.0), TraceRequest(0, 1, 2, 1, 150.0)],
                             progress=False, vocab_size=VOCAB, details=details)
    assert time.perf_counter() - t0 >= 0.3
    assert report.requests == 2
    # the sleeps are marked: before turn 0 and between turn 0's finish and turn 1's release
    slept = details["sleeps"]
    assert sum(b - a for a, b in slept) >= 0.3 - 0.01 and all(a <= b for a, b in slept)
    first = min(o.times.arrival for o in outputs)
    assert any(b <= first for _, b in slept)
    # A busy loop would call the engine thousands of times in 0.3 s.
    assert engine.steps <= 6 and engine.has_work_calls <= 12


def test_failed_turn_ends_its_conversation_and_is_counted():
    # "a" reaches 8+3+5 = 16 tokens before its turn 1 would add 2 -> refused above 17.
    trace = _trace({"a": [(8, 3, 0.0), (5, 2, 1.0), (1, 1, 1.0), (1, 1, 1.0)], "b": [(4, 2, 0.0), (3, 3, 1.0)]})
    engine = FakeEngine(max_context=17)
    report, outputs = replay(engine, trace, progress=False, vocab_size=VOCAB)
    assert (report.requests, report.failed, report.skipped) == (3, 1, 2)
    assert len(outputs) == 4
    assert sum(o.result.finish_reason is FinishReason.ERROR for o in outputs) == 1
    sessions = _by_conv(engine, [r for r in trace if r.conversation == "b" or r.turn < 2])
    assert len(sessions["a"].params) == 2 and sessions["a"].closed  # nothing submitted after the failure
    assert len(sessions["b"].params) == 2 and sessions["b"].closed
    b = [o for o in outputs if o.request_id in sessions["b"].request_ids]
    assert len(b) == 2
    assert report.p99_trajectory_s == pytest.approx(max(o.times.finish for o in b) - min(o.times.arrival for o in b))


def test_input_tokens_depend_on_seed_not_on_timing():
    def contexts(seed, spec):
        engine = FakeEngine()
        trace = _trace(spec)
        replay(engine, trace, seed=seed, progress=False, vocab_size=VOCAB)
        return {k: s.appended for k, s in _by_conv(engine, trace).items()}

    # Same turns, waits that reverse the order in which "a" and "c" submit their later turns.
    early_a = {"a": [(8, 3, 0.0), (5, 2, 0.0), (6, 1, 0.0)], 1: [(4, 2, 20.0)], "c": [(3, 4, 30.0), (2, 2, 30.0)]}
    early_c = {"a": [(8, 3, 30.0), (5, 2, 30.0), (6, 1, 30.0)], 1: [(4, 2, 0.0)], "c": [(3, 4, 0.0), (2, 2, 0.0)]}
    reference = contexts(3, early_a)
    assert contexts(3, early_c) == reference
    assert contexts(4, early_a) != reference
    # Each turn draws fresh ids: turn 1 does not repeat turn 0's opening tokens.
    assert reference["a"][1][:4] != reference["a"][0][:4]


def test_progress_bar_goes_to_stderr_only_when_asked(capsys):
    trace = _trace(SPEC)
    replay(FakeEngine(), trace, progress=True, vocab_size=VOCAB)
    captured = capsys.readouterr()
    assert "6/6" in captured.err and captured.out == ""
    replay(FakeEngine(), trace, progress=False, vocab_size=VOCAB)
    assert capsys.readouterr().err == ""


def test_lost_request_raises_instead_of_hanging():
    with pytest.raises(RuntimeError, match=r"request\(s\) \[100\] never finished"):
        replay(FakeEngine(lose_request=100), _trace(SPEC), progress=False, vocab_size=VOCAB)


@pytest.mark.parametrize("vocab_size", [None, 0, 2.5])
def test_vocab_size_is_required(vocab_size):
    with pytest.raises(ValueError, match="vocab_size must be the model's vocabulary size"):
        replay(FakeEngine(), _trace(SPEC), progress=False, vocab_size=vocab_size)


def test_bad_turn_sequence_is_refused_before_anything_runs():
    engine = FakeEngine()
    with pytest.raises(ValueError, match="turn 2 where turn 1 was expected"):
        replay(engine, [TraceRequest("a", 0, 1, 1, 0.0), TraceRequest("a", 2, 1, 1, 0.0)],
               progress=False, vocab_size=VOCAB)
    assert engine.sessions == []


def test_turn_cut_short_by_a_full_context_counts_as_truncated_not_completed():
    # "a": 8 + 3 = 11 tokens, then turn 1 adds 5 and asks 6 more, but the context is full at 20: 4 of 6.
    trace = _trace({"a": [(8, 3, 0.0), (5, 6, 1.0), (1, 1, 1.0)], "b": [(4, 2, 0.0), (3, 3, 1.0)]})
    report, outputs = replay(FakeEngine(full_at=20), trace, progress=False, vocab_size=VOCAB)
    assert (report.requests, report.truncated, report.failed, report.skipped) == (3, 1, 0, 1)
    cut = [o for o in outputs if o.result.finish_reason is FinishReason.LENGTH and len(o.result.token_ids) == 4]
    assert len(cut) == 1 and len(outputs) == 4  # nothing submitted after the cut turn
    assert report.output_tokens == 3 + 2 + 3  # the cut turn's 4 tokens are not a success's
    assert report.input_tokens == 8 + 4 + 3
    # only "b" is a whole trajectory
    b = [o for o in outputs if o.prompt_tokens in (4, 3)]
    assert report.p99_trajectory_s == pytest.approx(max(o.times.finish for o in b) - min(o.times.arrival for o in b))
    assert "truncated=1" in report.summary()


def test_input_tokens_count_the_trace_and_prefill_tokens_the_recomputation():
    trace = _trace(SPEC)
    report, _ = replay(FakeEngine(recompute=True), trace, progress=False, vocab_size=VOCAB)
    assert report.requests == 6 and report.truncated == 0
    assert report.input_tokens == sum(r.input_tokens for r in trace) == 28
    # a: 8, 8+3+5, 16+2+6; 1: 4; c: 3, 3+4+2
    assert report.prefill_tokens == 8 + 16 + 24 + 4 + 3 + 9


def test_lines_that_cannot_fit_the_context_are_refused_before_anything_is_allocated():
    engine = FakeEngine()
    engine.max_model_len = 64
    trace = [TraceRequest("a", 0, 10, 2, 0.0), TraceRequest("b", 0, 10_000_000, 2, 0.0)]
    start = time.process_time()  # CPU time: what preparing 10M tokens would cost, whatever the machine's load
    with pytest.raises(ValueError, match=r"<trace>:2: request 1 .*input_tokens 10000000 does not fit the context"):
        replay(engine, trace, progress=False, vocab_size=VOCAB)
    assert time.process_time() - start < 0.5 and engine.sessions == []
    with pytest.raises(ValueError, match="output_tokens 64 does not fit the context"):
        replay(FakeEngine(), [TraceRequest("a", 0, 1, 64, 0.0)], progress=False, vocab_size=VOCAB, max_model_len=64)
