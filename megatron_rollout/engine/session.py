"""Multi-turn sessions: a trajectory that keeps its tokens and KV blocks between turns.

Appending tool output and generating again prefills only the new tokens (and the last sampled
token, whose K/V is computed with them). A session whose KV was evicted under pressure recomputes
it transparently on its next turn. A session talks to the engine's `RequestTable` (which records
its calls for ATP peers) and steps the engine only through the `run_until` it was given.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

from megatron_rollout.engine.api import GenerationResult, RequestError, RequestOutput, SamplingParams
from megatron_rollout.engine.bookkeeping import Append, Close, RequestTable, Submit, TakeForks
from megatron_rollout.engine.request import Seq


class SessionClosed(ValueError):
    pass


class Session:
    def __init__(self, table: RequestTable, seq: Seq, run_until: Callable[[list[int]], dict[int, RequestOutput]],
                 lock: AbstractContextManager | None = None, on_close: Callable[[], None] | None = None) -> None:
        """`lock`: the engine's, held while the session changes the table (engine.engine's threads);
        `on_close`: called under it once the session and its forks are dropped."""
        self._table, self._seq, self._run_until, self.closed = table, seq, run_until, False
        self._lock = lock if lock is not None else nullcontext()
        self._on_close = on_close

    @property
    def sid(self) -> int:
        return self._seq.sid

    @property
    def token_ids(self) -> list[int]:
        return list(self._seq.tokens)

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosed(f"session {self._seq.sid} is closed")
        if self._table.seqs.get(self._seq.sid) is not self._seq:
            raise RequestError(f"unknown session {self._seq.sid}: this engine did not open it, or dropped it")

    def append(self, token_ids: list[int]) -> None:
        with self._lock:
            self._check_open()
            if self._seq.request is not None:
                raise RequestError(f"session {self._seq.sid} is generating (request {self._seq.request.rid}); "
                                   f"append after it finishes")
            token_ids = self._table.validate_tokens(token_ids, allow_empty=True)
            self._table.record(Append(self.sid, token_ids))
            self._seq.tokens.extend(token_ids)

    def submit(self, params: SamplingParams | None = None) -> int:
        """Start generating after everything appended so far; returns the request id."""
        with self._lock:
            self._check_open()
            params = params or SamplingParams()
            rid = self._table.submit(self._seq, params)
            self._table.record(Submit(self.sid, params))
            return rid

    def generate(self, params: SamplingParams | None = None) -> GenerationResult:
        """One turn (with `params.n` > 1: sample 0's result; `forks()` holds the others)."""
        rid = self.submit(params)
        return self._run_until([rid])[rid].result

    def forks(self) -> list["Session"]:
        """The sessions of samples 1..n-1 of this session's turns with `n` > 1 (it continues sample 0),
        taken once; the caller closes them (forks not taken are closed with this session)."""
        with self._lock:
            self._check_open()
            seqs, self._seq.forks = self._seq.forks, []
            self._table.record(TakeForks(self.sid))
            return [Session(self._table, seq, self._run_until, self._lock, self._on_close) for seq in seqs]

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            table, seq = self._table, self._seq
            table.record(Close(seq.sid))
            for fork in [seq, *seq.forks]:
                table.drop_seq(fork)
            seq.forks = []
            if self._on_close is not None:
                self._on_close()
