"""Drive an engine through a trace in real wall time and measure it (docs/design.md §9).

Every conversation becomes one engine session. Turn 0 is released at replay start + its wait;
turn k > 0 is released `wait_ms` after turn k-1 finished (the engine's own `times.finish` mark,
so the gap between a finish and the next arrival is the trace's tool time plus at most one
engine step). A released turn appends `input_tokens` random ids to its session and submits a
greedy request forced to `output_tokens` tokens (`ignore_stop`). The generated tokens stay in the
session, so the next turn is a continuation prefill of only its new tokens.

Input ids come from a generator seeded by (seed, conversation index, turn), not from one stream
shared by all turns: submission order depends on timing, and the same trace must get the same
tokens under every schedule for their figures to be comparable.

The trace is checked against the model's context (`validate_trace`) before anything is allocated:
a line asking for more tokens than any context holds is refused with its line number. A turn that
fails (the engine refuses it at submission with `RequestError`, e.g. a context longer than the
model's, or finishes it with an error) ends its conversation: the turn counts as failed, its later
turns as skipped, nothing is lost silently. So does a turn that comes back with fewer tokens than
the trace asked (the context filled up): it counts as truncated, not as a success, and its later
turns, which would extend a full context, as skipped. The loop steps the engine while it has work
and otherwise sleeps until the next release (no busy spin). The tqdm bar is here rather than in the CLI because
only this loop knows when a request is done; `progress=False` silences it. Left out: the engine
itself, tool execution (waits are sleeps) and multi-rank driving (the distributed runtime's job).
"""
from __future__ import annotations

import contextlib
import dataclasses
import heapq
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from tqdm import tqdm

from megatron_rollout.engine.api import FinishReason, RequestError, RequestOutput, SamplingParams, Schedule
from megatron_rollout.trace.breakdown import build_breakdown
from megatron_rollout.trace.metrics import ReplayReport, build_report
from megatron_rollout.trace.schema import ConversationId, TraceRequest, group_conversations, validate_trace

logger = logging.getLogger(__name__)


@dataclass
class _Conversation:
    """Replay state of one conversation (mutable, private to the loop)."""

    index: int
    key: ConversationId
    turns: list[TraceRequest]
    next_turn: int = 0
    session: Any = None


def input_ids(seed: int, conversation: int, turn: TraceRequest, vocab_size: int) -> list[int]:
    """The ids a replay appends for `turn` of the conversation at index `conversation` of its trace."""
    rng = np.random.default_rng([seed, conversation, turn.turn])
    return rng.integers(0, vocab_size, size=turn.input_tokens).tolist()


def replay(engine: Any, requests: Sequence[TraceRequest], *, seed: int = 0, progress: bool = True,
           vocab_size: int | None = None,
           schedule: Schedule | str | None = None,
           details: dict | None = None,
           max_model_len: int | None = None,
           temperature: float = 0.0) -> tuple[ReplayReport, list[RequestOutput]]:
    """Replay `requests` on `engine`; return the report and every finished request (finish order).

    Args:
        engine: has `open_session()`, `step() -> list[RequestOutput]`, `has_work()` and
            `stats.mean_decode_wait_ms`; a session has `append(ids)`, `submit(params) -> id`
            and `close()`.
        requests: the trace; each conversation's turns numbered 0..n-1 in order.
        seed: seeds the random input token ids.
        progress: show a tqdm bar (requests done) on stderr.
        vocab_size: input ids are drawn from [0, vocab_size); required.
        schedule: the engine's schedule, copied into the report.
        details: if given, receives "conversation_of" (request id -> conversation), "turn_of"
            (request id -> its trace line), "start", "skipped", "refused", "submissions" (each
            turn's (start, end, input tokens) on the host clock: its ids drawn, appended and
            submitted, which no step record covers) and "sleeps" (each (start, end) the loop slept
            with nothing to run until the next release), so that replicas' replays can be merged
            into one report; and, where the engine keeps step records
            (`engine.step_log`), "records" (this replay's), "step_starts" (when each engine step
            began) and "breakdown" (`trace.breakdown`, also in the report as a dict).
        max_model_len: the engine's context length, to refuse lines that cannot fit before
            anything runs; None reads `engine.max_model_len` where the engine has one.
        temperature: of every turn (0: greedy). A sampled turn's seed comes from (seed,
            conversation index, turn), like its input ids, so a replay repeats its tokens.
    """
    SamplingParams(temperature=temperature)  # the engine's own check of it, before anything runs
    if vocab_size is None or isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size must be the model's vocabulary size (a positive int), got "
                         f"{vocab_size!r}; input ids are drawn from [0, vocab_size)")
    max_model_len = max_model_len if max_model_len is not None else getattr(engine, "max_model_len", None)
    if max_model_len is not None:
        validate_trace(requests, max_model_len)
    conversations = [_Conversation(i, key, turns)
                     for i, (key, turns) in enumerate(group_conversations(requests).items())]
    total = sum(len(c.turns) for c in conversations)
    outputs: list[RequestOutput] = []
    conversation_of: dict[int, ConversationId] = {}
    turn_of: dict[int, TraceRequest] = {}
    owner: dict[int, _Conversation] = {}  # in-flight request id -> its conversation
    skipped = 0
    refused: list[ConversationId] = []
    submissions: list[tuple[float, float, int]] = []
    sleeps: list[tuple[float, float]] = []

    log = getattr(engine, "step_log", None)
    first_record = len(log) if log is not None else 0
    first_start = len(log.step_starts) if log is not None else 0
    start = time.perf_counter()
    # (release time, conversation index): the index breaks ties deterministically.
    releases = [(start + c.turns[0].wait_ms / 1e3, c.index) for c in conversations]
    heapq.heapify(releases)
    bar = tqdm(total=total, desc="replay", unit="req", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    with log.recording() if log is not None else contextlib.nullcontext():
        try:
            while releases or owner:
                now = time.perf_counter()
                while releases and releases[0][0] <= now:
                    _, index = heapq.heappop(releases)
                    conv = conversations[index]
                    tokens, began = conv.turns[conv.next_turn].input_tokens, time.perf_counter()
                    submitted = _submit(engine, conv, seed, vocab_size, owner, conversation_of, turn_of, temperature)
                    submissions.append((began, time.perf_counter(), tokens))
                    if not submitted:
                        refused.append(conv.key)
                        skipped_now = _end_after_failure(conv)
                        skipped += skipped_now
                        bar.update(1 + skipped_now)
                if owner or engine.has_work():
                    for out in engine.step():
                        conv = owner.pop(out.request_id, None)
                        if conv is None:
                            logger.warning("engine finished request %d, which this replay did not submit",
                                           out.request_id)
                            continue
                        outputs.append(out)
                        bar.update(1)
                        skipped_now = _finish_turn(conv, out, turn_of[out.request_id], releases)
                        skipped += skipped_now
                        bar.update(skipped_now)
                    if owner and not engine.has_work():
                        raise RuntimeError(f"engine has no work but request(s) {sorted(owner)[:10]} never "
                                           f"finished; the engine lost them")
                elif releases:
                    began = time.perf_counter()
                    time.sleep(max(0.0, releases[0][0] - began))
                    sleeps.append((began, time.perf_counter()))
        finally:
            bar.close()
            for conv in conversations:
                _close(conv)

    if details is not None:
        details.update(conversation_of=conversation_of, turn_of=turn_of, start=start, skipped=skipped,
                       refused=refused, submissions=submissions, sleeps=sleeps)
    report = build_report(outputs, conversation_of, start=start,
                          mean_decode_wait_ms=engine.stats.mean_decode_wait_ms,
                          schedule=schedule, skipped=skipped, refused=refused, turn_of=turn_of)
    if log is not None:
        records = log.records[first_record:]
        breakdown = build_breakdown(records, outputs, conversation_of, start=start,
                                    mean_decode_wait_ms=engine.stats.mean_decode_wait_ms, turn_of=turn_of)
        report = dataclasses.replace(report, breakdown=breakdown.to_dict())
        if details is not None:
            details.update(records=records, breakdown=breakdown, step_starts=log.step_starts[first_start:])
    accounted = report.requests + report.truncated + report.failed + report.skipped
    if accounted != total:
        raise RuntimeError(f"replay accounted for {accounted} of {total} requests")
    return report, outputs


def turn_seed(seed: int, conversation: int, turn: int) -> int:
    """The seed a sampled turn draws with: from the replay's seed, the conversation's index and the
    turn, in [0, 2**63) (it fits an int64, as vLLM's seeds must: `benchmarks.vllm_peer --turn-seeds`)."""
    return int(np.random.default_rng([seed, conversation, turn, 1]).integers(2**63))


def _submit(engine: Any, conv: _Conversation, seed: int, vocab_size: int,
            owner: dict[int, _Conversation], conversation_of: dict[int, ConversationId],
            turn_of: dict[int, TraceRequest], temperature: float = 0.0) -> bool:
    """Append the next turn's input and submit it; False when the engine refuses it."""
    turn = conv.turns[conv.next_turn]
    if conv.session is None:
        conv.session = engine.open_session()
    conv.session.append(input_ids(seed, conv.index, turn, vocab_size))
    draw_seed = turn_seed(seed, conv.index, turn.turn) if temperature else None
    params = SamplingParams(temperature=temperature, max_new_tokens=turn.output_tokens, ignore_stop=True,
                            seed=draw_seed)
    try:
        request_id = conv.session.submit(params)
    except RequestError as exc:
        logger.warning("conversation %r turn %d refused: %s", conv.key, turn.turn, exc)
        conv.next_turn += 1
        return False
    owner[request_id] = conv
    conversation_of[request_id] = conv.key
    turn_of[request_id] = turn
    return True


def _finish_turn(conv: _Conversation, out: RequestOutput, turn: TraceRequest,
                 releases: list[tuple[float, int]]) -> int:
    """Record a finished turn; release the next one or end the conversation. Returns the number
    of turns skipped because this one failed or was truncated."""
    conv.next_turn += 1
    if out.result.finish_reason is FinishReason.ERROR:
        logger.warning("conversation %r turn %d (request %d) failed: %s", conv.key, turn.turn,
                       out.request_id, out.result.error)
        return _end_after_failure(conv)
    if len(out.result.token_ids) < turn.output_tokens:
        logger.warning("conversation %r turn %d (request %d) truncated: %d of %d output tokens (%s; the "
                       "context is full)", conv.key, turn.turn, out.request_id, len(out.result.token_ids),
                       turn.output_tokens, out.result.finish_reason.value)
        return _end_after_failure(conv)
    if conv.next_turn < len(conv.turns):
        wait_s = conv.turns[conv.next_turn].wait_ms / 1e3
        heapq.heappush(releases, (out.times.finish + wait_s, conv.index))
    else:
        _close(conv)
    return 0


def _end_after_failure(conv: _Conversation) -> int:
    """End a conversation whose last submitted turn failed or was truncated; returns how many
    turns it skips."""
    remaining = len(conv.turns) - conv.next_turn
    if remaining:
        logger.warning("conversation %r ends: %d later turn(s) skipped", conv.key, remaining)
    _close(conv)
    return remaining


def _close(conv: _Conversation) -> None:
    """Close the session as soon as its conversation ends, freeing its KV for the others."""
    if conv.session is not None:
        session, conv.session = conv.session, None
        session.close()
