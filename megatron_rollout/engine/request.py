"""Engine-internal mutable state of sequences and requests (the public records are in api.py).

A `Seq` is one token context with its KV: a multi-turn session, or the private context of a
one-shot request. A `Request` is one generation on a sequence. A request's `lifetime` grows each
time it is preempted or cancelled, and results computed under an older lifetime are discarded.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from megatron_rollout.engine.api import FinishReason, GenerationResult, RequestOutput, RequestTimes, SamplingParams
from megatron_rollout.engine.scheduler import Stage


@dataclass
class Seq:
    sid: int
    tokens: list[int] = field(default_factory=list)
    computed: int = 0
    """Positions with K/V in the cache."""
    hashes: list[int] = field(default_factory=list)
    """Prefix hash of each full block of `tokens`."""
    request: "Request | None" = None
    """The generation running on this sequence, if any."""
    session: bool = False
    last_used: float = 0.0
    registered: int = 0
    """Leading full blocks already offered to the prefix cache."""
    kv_version: int | None = None
    """Weight version every cached position was computed under; None when nothing is cached, -1
    when versions are mixed (such K/V is never offered for reuse)."""
    turns: int = 0
    """Requests that finished on this sequence (a session's earlier turns)."""
    generated: int = 0
    """Tokens those requests generated."""
    forks: list["Seq"] = field(default_factory=list)  # a session's samples 1..n-1 not yet taken (`Session.forks`)
    family: int | None = None
    """The sequence id of sample 0 where this sequence holds a sample of an n > 1 request (it or one
    forked from it, and the session going on there): the RL group whose text its drafts may copy."""

    kv_epoch: int = 0
    """Counts the times its blocks were dropped (`reset_kv`): between two drops its block table
    only grows by appending, across a session's turns too, so (sid, kv_epoch) is its rows'
    `SpanInput.key` (`table_key`)."""

    def reset_kv(self) -> None:
        self.computed, self.registered, self.kv_version = 0, 0, None
        self.kv_epoch += 1

    @property
    def table_key(self) -> tuple[int, int]:
        """Names its block table as it grows (`SpanInput.key`): a new one after each drop."""
        return self.sid, self.kv_epoch

    def block_hashes(self, block_size: int, start: int = 0, stop: int | None = None) -> list[int]:
        """The hash chain of its full blocks `start` to `stop` (None: the last full one), each hashed
        once, when first asked for."""
        full = len(self.tokens) // block_size
        stop = full if stop is None else min(stop, full)
        while len(self.hashes) < stop:
            i = len(self.hashes)
            prev = self.hashes[-1] if self.hashes else 0
            self.hashes.append(hash((prev, tuple(self.tokens[i * block_size:(i + 1) * block_size]))))
        return self.hashes[start:stop]


@dataclass(frozen=True)
class Sampled:
    """One row's draw (`engine.sampler`): a token and its logprob, or (`error` set) why the row has none."""

    token: int | None
    logprob: float | None
    error: str | None = None
    """e.g. "non-finite logits (nan)"; the caller adds where (position, weight version)."""
    top: dict[int, float] | None = None
    """`params.logprobs=k`: id -> model logprob of the k most likely tokens (first) and the sampled one."""

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class SampleGroup:
    """The n samples of one request (`SamplingParams.n` > 1), as their requests share them. The
    request runs as one until its prompt's logits are drawn n times (one generator per sample,
    `api.sample_seed`); then samples 1..n-1 become requests of their own, on sequences sharing the
    prompt's KV blocks (`RequestTable.accept`). Its output is returned once the last sample ends."""

    rid: int  # the request id the caller holds (sample 0's request)
    generators: list[torch.Generator | None]  # sample i's; None: the engine's shared one (unseeded)
    results: list[GenerationResult | None]  # sample i's once it finished
    forked: bool = False  # samples 1..n-1 exist (the prompt's logits were drawn n times)
    live: int = 1  # samples still running

    @property
    def n(self) -> int:
        return len(self.generators)

    def draws(self) -> int:
        """Tokens the request's next sampled row draws: n until the samples are forked, then 1."""
        return 1 if self.forked else self.n

    def done(self, index: int, result: GenerationResult) -> bool:
        """Record sample `index`'s result; True once every sample has one. A request that ends
        before its samples were forked (refused, aborted, non-finite logits) ends all n alike."""
        if self.forked:
            self.results[index], self.live = result, self.live - 1
        else:
            self.results, self.live = [result] * self.n, 0
        return self.live == 0


@dataclass
class Request:
    rid: int
    seq: Seq
    params: SamplingParams
    order: int
    prompt_tokens: int
    rank_key: tuple[float, int] = (0.0, 0)
    """(priority key, order): the planner serves smaller first (`engine.priority`)."""
    stage: Stage = Stage.WAITING
    lifetime: int = 0
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    admitted: float | None = None
    """When its first prefill row was built (admission); TTFT = queue (admitted - arrival) + the rest."""
    ready_at: float | None = None
    """When its pending token was sampled (decode wait is measured from here)."""
    group: SampleGroup | None = None  # the n samples it is one of (`SamplingParams.n` > 1)
    index: int = 0  # its sample index in `group`
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # with `params.logprobs`
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)  # filled as its prefill runs

    def result(self, reason: FinishReason, error: str | None = None) -> GenerationResult:
        p = self.params
        return GenerationResult(list(self.output), list(self.logprobs), reason, list(self.versions), error,
                                list(self.top_logprobs) if p.logprobs is not None else None,
                                list(self.prompt_logprobs) if p.prompt_logprobs is not None else None)

    def finish(self, reason: FinishReason, error: str | None = None) -> RequestOutput | None:
        """Its output, or None while other samples of its group still run."""
        result = self.result(reason, error)
        group = self.group
        if group is not None and not group.done(self.index, result):
            return None
        times = RequestTimes(self.arrival, self.first_token, time.perf_counter(), self.admitted)
        if group is None:
            return RequestOutput(self.rid, result, times, self.prompt_tokens)
        results = tuple(r for r in group.results if r is not None)
        return RequestOutput(group.rid, results[0], times, self.prompt_tokens, results)
