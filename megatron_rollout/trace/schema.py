"""The rollout trace format: one JSON object per line, one line per request (docs/design.md §9).

    {"conversation": "c7", "turn": 2, "input_tokens": 4810, "output_tokens": 131, "wait_ms": 640.5}

- `conversation` (str or int): the trajectory the request belongs to. `"7"` and `7` are different
  conversations, as they are different JSON values.
- `turn` (int): position in the conversation, numbered **from 0**. The lines of one conversation
  appear in turn order (0, 1, 2, ...; other conversations' lines may be interleaved), so a reader
  can check each line against the previous ones and name the offending line.
- `input_tokens` (int > 0): the tokens this turn *adds* to the context (turn 0: system prompt and
  task; later turns: the tool's answer). Earlier turns' inputs and outputs are not repeated.
- `output_tokens` (int > 0): tokens the model generates for this turn (replay forces this length).
- `wait_ms` (number >= 0, finite): tool time before this turn is released: after the previous
  turn finished, or after the replay start for turn 0.

Exactly these five fields; anything else is an error, so a typo (`"wait"`) is not silently read as
a default. Booleans are not numbers here, and `5.0` (or `1e11`, which JSON reads as a float) is not
an integer token count. Limits hold at parse time, before anything is allocated or slept on: token
counts at most `MAX_TOKENS`, `wait_ms` at most `MAX_WAIT_MS` (one hour), turns below `MAX_TURNS`,
integer conversation ids within 64 bits and string ids at most `MAX_ID_CHARS` characters; and
`validate_trace` bounds token counts by a model's context (`replay` calls it before the first turn).

`load_trace` is strict (first bad line raises `TraceError`); `load_trace_lenient` skips bad lines,
logs a warning for each and returns them, so a replay can serve the rest. What this module leaves
out: generating traces (`make.py`), replaying them (`replay.py`), and a conversation's cumulative
context: a turn that no longer fits is the engine's to refuse, and the replay's to report.
"""
from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import os
import stat
from dataclasses import dataclass
from typing import Any, Iterable, Union

logger = logging.getLogger(__name__)

ConversationId = Union[str, int]

FIELDS = ("conversation", "turn", "input_tokens", "output_tokens", "wait_ms")
MAX_TOKENS = 1 << 24
"""Token counts above this (16.7M) are refused whatever the model: no context holds them."""
MAX_WAIT_MS = 3_600_000.0
"""One hour: a longer tool wait is a unit mistake (seconds for ms) or a corrupt line."""
MAX_TURNS = 1 << 20
MAX_ID_CHARS = 256


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


@dataclass(frozen=True)
class TraceRequest:
    """One line of a trace: one turn of one conversation."""

    conversation: ConversationId
    """Trajectory id (str or int)."""
    turn: int
    """0-based position in the conversation."""
    input_tokens: int
    """New tokens this turn appends to the conversation's context (> 0)."""
    output_tokens: int
    """Tokens generated for this turn (> 0)."""
    wait_ms: float
    """Tool time before the turn is released, in milliseconds (0 to MAX_WAIT_MS)."""
    where: str = dataclasses.field(default="", compare=False, repr=False)
    """Where the line came from ("path:line"), for errors found after parsing; not a trace field."""

    def __post_init__(self) -> None:
        c = self.conversation
        if not (isinstance(c, str) or _is_int(c)):
            raise ValueError(f"'conversation' must be a string or an integer, got {_describe(c)}")
        if isinstance(c, str) and not c:
            raise ValueError("'conversation' must not be the empty string")
        if isinstance(c, str) and len(c) > MAX_ID_CHARS:
            raise ValueError(f"'conversation' must be at most {MAX_ID_CHARS} characters, got {len(c)}")
        if _is_int(c) and not -2**63 <= c < 2**63:
            raise ValueError(f"'conversation' must fit in 64 bits, got {c}")
        if not _is_int(self.turn) or self.turn < 0:
            raise ValueError(f"'turn' must be an integer >= 0, got {_describe(self.turn)}")
        if self.turn >= MAX_TURNS:
            raise ValueError(f"'turn' must be below {MAX_TURNS}, got {self.turn}")
        for name in ("input_tokens", "output_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"'{name}' must be a positive integer, got {_describe(value)}")
            if value > MAX_TOKENS:
                raise ValueError(f"'{name}' must be at most {MAX_TOKENS} (no context holds more), got {value}")
        w = self.wait_ms
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ValueError(f"'wait_ms' must be a finite number >= 0, got {_describe(w)}")
        if w > MAX_WAIT_MS:
            raise ValueError(f"'wait_ms' must be at most {MAX_WAIT_MS:.0f} (one hour), got {w}; "
                             f"is it in seconds or microseconds?")
        object.__setattr__(self, "wait_ms", float(w))  # JSON `0` and `0.0` read the same

    @classmethod
    def from_dict(cls, obj: Any, where: str = "") -> TraceRequest:
        """Build from a parsed JSON line; `ValueError` says which field is wrong and how."""
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object with fields {', '.join(FIELDS)}, "
                             f"got {type(obj).__name__}")
        missing = [f for f in FIELDS if f not in obj]
        if missing:
            raise ValueError(f"missing field(s) {', '.join(map(repr, missing))}")
        extra = sorted(k for k in obj if k not in FIELDS)
        if extra:
            raise ValueError(f"unexpected field(s) {', '.join(map(repr, extra))}; "
                             f"the fields are {', '.join(FIELDS)}")
        return cls(**obj, where=where)

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in FIELDS}


class TraceError(ValueError):
    """A trace line that cannot be served, located by file and 1-based line number."""

    def __init__(self, path: str, line: int, message: str) -> None:
        self.path = path
        self.line = line
        self.message = message
        super().__init__(f"{path}:{line}: {message}")


@dataclass(frozen=True)
class LenientLoad:
    """What `load_trace_lenient` kept and what it skipped."""

    requests: list[TraceRequest]
    """Valid requests, in file order; every kept conversation is numbered 0..n-1."""
    errors: list[TraceError]
    """One per skipped line, in file order."""


class _TurnOrder:
    """Checks that each conversation's turns arrive as 0, 1, 2, ... and remembers where each
    conversation stopped being valid (lenient mode drops the rest of such a conversation)."""

    def __init__(self) -> None:
        self.next_turn: dict[ConversationId, int] = {}
        self.broken_at: dict[ConversationId, str] = {}

    def check(self, req: TraceRequest) -> None:
        key = req.conversation
        if key in self.broken_at:
            raise ValueError(f"conversation {key!r} skipped from here on: {self.broken_at[key]}")
        expected = self.next_turn.get(key, 0)
        if req.turn != expected:
            what = "duplicate" if req.turn < expected else "out-of-order or missing"
            raise ValueError(f"conversation {key!r}: turn {req.turn} where turn {expected} was "
                             f"expected ({what}; turns are numbered from 0, in file order)")
        self.next_turn[key] = expected + 1

    def break_conversation(self, key: ConversationId, reason: str) -> None:
        self.broken_at.setdefault(key, reason)


def group_conversations(requests: Iterable[TraceRequest]) -> dict[ConversationId, list[TraceRequest]]:
    """Requests per conversation (first-appearance order), checking turns run 0..n-1 in order.

    For in-memory traces (e.g. from `make_trace`); raises `ValueError` on a bad turn sequence.
    """
    order = _TurnOrder()
    groups: dict[ConversationId, list[TraceRequest]] = {}
    for index, req in enumerate(requests):
        try:
            order.check(req)
        except ValueError as exc:
            raise ValueError(f"request {index}: {exc}") from None
        groups.setdefault(req.conversation, []).append(req)
    return groups


def validate_trace(requests: Iterable[TraceRequest], max_model_len: int, *,
                   max_wait_ms: float = MAX_WAIT_MS) -> None:
    """Refuse, before anything is allocated, a request no engine with `max_model_len` positions
    can serve: a turn's new input or its output alone must leave room in the context (a
    conversation outgrowing it later is refused per turn by the engine). `TraceError` names the
    line (or, for a trace built in code, the request's index)."""
    if not _is_int(max_model_len) or max_model_len < 2:
        raise ValueError(f"max_model_len must be an integer >= 2, got {_describe(max_model_len)}")
    for index, req in enumerate(requests):
        problem = None
        if req.input_tokens >= max_model_len:
            problem = (f"input_tokens {req.input_tokens} does not fit the context: max_model_len "
                       f"{max_model_len} leaves room for at most {max_model_len - 1} new tokens and one output")
        elif req.output_tokens >= max_model_len:
            problem = (f"output_tokens {req.output_tokens} does not fit the context: max_model_len is "
                       f"{max_model_len}, so at most {max_model_len - 1} tokens can be generated")
        elif req.wait_ms > max_wait_ms:
            problem = f"wait_ms {req.wait_ms} is above the limit of {max_wait_ms} ms"
        if problem is not None:
            path, _, line = req.where.rpartition(":")
            if path and line.isdigit():
                raise TraceError(path, int(line), problem)
            raise TraceError("<trace>", index + 1, f"request {index} (conversation {req.conversation!r} "
                                                  f"turn {req.turn}): {problem}")


def _open_trace(name: str) -> io.BufferedReader:
    """The trace file opened for reading; a regular file only (a FIFO or a device such as /dev/zero
    would block or never end), and a directory or unreadable file is a ValueError saying so."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK)  # non-blocking: opening a FIFO must not wait for a writer
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ValueError(f"trace {name} cannot be read ({exc.strerror}): give a readable JSONL file") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, socket or device)"
        raise ValueError(f"trace {name} is {kind}: give a JSONL trace file")
    os.set_blocking(fd, True)
    return open(fd, "rb")  # lines decoded one by one, so that a bad byte is reported with its line


def _read(path: str | os.PathLike, strict: bool) -> LenientLoad:
    name = os.fspath(path)
    order = _TurnOrder()
    kept: list[TraceRequest] = []
    errors: list[TraceError] = []
    with _open_trace(name) as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            conversation = None
            try:
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"malformed JSON: {exc.msg} at column {exc.colno}") from None
                except RecursionError:
                    raise ValueError("malformed JSON: nested too deeply (a request is one flat object)") from None
                if isinstance(obj, dict):
                    conversation = obj.get("conversation")
                req = TraceRequest.from_dict(obj, where=f"{name}:{lineno}")
                order.check(req)
            except (ValueError, TypeError) as exc:
                error = TraceError(name, lineno, str(exc))
                if strict:
                    raise error from None
                logger.warning("skipping trace line: %s", error)
                errors.append(error)
                # Later turns of this conversation would continue a context that is not there.
                if isinstance(conversation, (str, int)) and not isinstance(conversation, bool):
                    order.break_conversation(conversation, f"line {lineno} was invalid")
                continue
            kept.append(req)
    if strict and not kept:
        raise TraceError(name, 0, "the trace has no requests")
    return LenientLoad(kept, errors)


def load_trace(path: str | os.PathLike) -> list[TraceRequest]:
    """Every request of a trace file, in file order; the first invalid line raises `TraceError`
    naming the file, the line and what is wrong. An empty trace is an error too."""
    return _read(path, strict=True).requests


def load_trace_lenient(path: str | os.PathLike) -> LenientLoad:
    """Valid requests of a trace file; each invalid line is skipped with a logged warning and
    returned as a `TraceError`. A conversation with an invalid line keeps only the turns before
    it (the later turns would extend a context that was never built); those later lines are
    reported as errors too."""
    return _read(path, strict=False)


def write_trace(path: str | os.PathLike, requests: Iterable[TraceRequest]) -> None:
    """Write requests as JSON lines, in the given order (which must keep each conversation's turns
    in order for `load_trace` to accept the file)."""
    with open(os.fspath(path), "w", encoding="utf-8") as f:
        for req in requests:
            f.write(json.dumps(req.to_dict()) + "\n")
