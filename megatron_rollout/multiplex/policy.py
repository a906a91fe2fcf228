"""Segment policies: how many P segments each turnstile round releases (docs/design.md §6).

A span is the only thing a policy decides. Short spans let D iterate often during a long prefill
(low decode wait) but pay two CPU rendezvous per round; long spans amortise the rendezvous but
make decode rows wait. Policies see a `SegmentLoad` that every rank agrees on (the turnstile
builds it from values exchanged in the post-D rendezvous), so every rank picks the same span and
runs the same number of rounds.

Deliberately left out: policies never change the controller's checks, the rendezvous order or
phase-state isolation; they hold Python numbers only; online adaptation (learning constants from
measured round times) is future work, the constants here are configuration.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass

UNBOUNDED_SPAN = 1 << 40  # "run the rest of P" when the number of remaining segments is unknown


@dataclass(frozen=True)
class SegmentLoad:
    """What a policy may look at, identical on every rank."""

    decode_rows: int
    """Decode rows of the busiest rank (max over ranks), i.e. the rows that wait while P runs."""
    remaining_segments: int | None
    """Segments of the epoch not yet permitted (B + 1 - permitted for B boundaries), or None when
    the caller did not say how many boundaries the P forward has."""
    prefill_tokens: int = 0
    """Tokens in the epoch's prefill batch; every segment pushes all of them through one
    sub-layer, so a segment's device time grows with them. 0 when unknown."""

    def __post_init__(self) -> None:
        if self.decode_rows < 0 or self.prefill_tokens < 0:
            raise ValueError(f"negative load: decode_rows={self.decode_rows}, "
                             f"prefill_tokens={self.prefill_tokens}")
        if self.remaining_segments is not None and self.remaining_segments < 1:
            raise ValueError(f"remaining_segments={self.remaining_segments}: a round is only run while "
                             f"at least one segment remains")


class SegmentPolicy(abc.ABC):
    """Picks the span of each turnstile round."""

    @abc.abstractmethod
    def span(self, load: SegmentLoad) -> int:
        """A positive number of segments to permit this round."""


@dataclass(frozen=True)
class FixedSpanConfig:
    span: int = 1
    """Segments released per round; 1 is the finest interleaving."""

    def __post_init__(self) -> None:
        if type(self.span) is not int or self.span < 1:
            raise ValueError(f"FixedSpan span must be a positive int, got {self.span!r}")


class FixedSpan(SegmentPolicy):
    """The same span every round."""

    def __init__(self, k: int | FixedSpanConfig = 1) -> None:
        self.config = k if isinstance(k, FixedSpanConfig) else FixedSpanConfig(k)

    def span(self, load: SegmentLoad) -> int:
        return self.config.span

    def __repr__(self) -> str:
        return f"FixedSpan({self.config.span})"


@dataclass(frozen=True)
class LoadSelectedConfig:
    """Constants of the cost model in `LoadSelected` (calibrate `segment_us_per_token` per model and GPU)."""

    round_overhead_us: float = 210.0
    """Host cost that splitting P adds per turnstile round, in microseconds: its two CPU rendezvous
    (pre-D, post-D). The D enqueue is not counted: D iterates whether or not P is split. 210 =
    2 x 104 us, the native (shared-memory) rendezvous median at 8 unpinned ranks measured with
    `python -m benchmarks.rendezvous --ranks 8 --json` on the 2-core CPU VM (103.7 us
    quiet, 104.5 us loaded; pinned ranks: 31-38 us; docs/multi-gpu.md). Groups that span hosts use
    the store rendezvous (1.4-2.4 ms per meeting at 8 ranks there): raise it to ~5000."""
    segment_us_per_token: float = 0.05
    """P device time of one segment per prefill token, in microseconds (one sub-layer of the
    model for one token)."""
    min_span: int = 1
    """Never release fewer segments than this per round while decode rows exist."""
    max_span: int | None = None
    """Cap on the span while decode rows exist; None = no cap."""

    def __post_init__(self) -> None:
        if not self.round_overhead_us > 0 or not self.segment_us_per_token > 0:
            raise ValueError(f"round_overhead_us ({self.round_overhead_us}) and segment_us_per_token "
                             f"({self.segment_us_per_token}) must be positive")
        if type(self.min_span) is not int or self.min_span < 1:
            raise ValueError(f"min_span must be a positive int, got {self.min_span!r}")
        if self.max_span is not None and (type(self.max_span) is not int or self.max_span < self.min_span):
            raise ValueError(f"max_span must be an int >= min_span ({self.min_span}), got {self.max_span!r}")


class LoadSelected(SegmentPolicy):
    """Span from decode occupancy and prefill size.

    With no decode rows anywhere nothing waits for D, so P runs whole: the span covers every
    remaining segment. Otherwise a round of span s costs `round_overhead_us` once and makes `rows`
    decode rows wait about `s * seg_us` each (seg_us = prefill_tokens * segment_us_per_token), so
    per segment the cost is `overhead / s + rows * seg_us * s / 2`, smallest at
    `s* = sqrt(2 * overhead / (rows * seg_us))`: many decode rows or a large prefill give short
    spans. s* is rounded and clamped to [min_span, max_span] and to the remaining segments.
    """

    def __init__(self, config: LoadSelectedConfig | None = None) -> None:
        self.config = config or LoadSelectedConfig()

    def span(self, load: SegmentLoad) -> int:
        cfg = self.config
        remaining = load.remaining_segments if load.remaining_segments is not None else UNBOUNDED_SPAN
        if load.decode_rows == 0:
            return remaining
        # Unknown prefill size: assume one token, which favours long spans only mildly because the
        # clamp to max_span still applies.
        seg_us = max(load.prefill_tokens, 1) * cfg.segment_us_per_token
        best = math.sqrt(2.0 * cfg.round_overhead_us / (load.decode_rows * seg_us))
        span = max(cfg.min_span, int(round(best)))
        if cfg.max_span is not None:
            span = min(span, cfg.max_span)
        return max(1, min(span, remaining))

    def __repr__(self) -> str:
        return f"LoadSelected({self.config})"


@dataclass(frozen=True)
class WaitBudgetConfig:
    """`WaitBudget`'s constants."""

    budget_us: float = 8000.0
    """Longest a decode row should wait for one round's P work, in microseconds (a per-token
    latency bound, like a TPOT target)."""
    segment_us_per_token: float = 0.3
    """P device time of one segment per prefill token, in microseconds: ~0.3 on the H200 for
    `qwen3-30b-a3b-12l` at 2,048 tokens (a 14.4 ms piecewise forward over 24 segments,
    `python -m benchmarks.profile`); small batches cost more per token."""

    def __post_init__(self) -> None:
        if not self.budget_us > 0 or not self.segment_us_per_token > 0:
            raise ValueError(f"budget_us ({self.budget_us}) and segment_us_per_token "
                             f"({self.segment_us_per_token}) must be positive")


class WaitBudget(SegmentPolicy):
    """As many segments per round as fit a decode-wait budget.

    `LoadSelected` prices a round at its rendezvous only; on one GPU the larger price of a round
    is the decode iteration it inserts, which every request of the epoch waits for: its TTFT
    grows by one D iteration per round. Bounding what decode rows wait instead (span =
    budget / segment time) keeps few rounds for small prefills (a short epoch runs whole: its
    TTFT stays off's) and splits only the long ones, so that D still iterates every `budget_us`.
    """

    def __init__(self, config: WaitBudgetConfig | None = None) -> None:
        self.config = config or WaitBudgetConfig()

    def span(self, load: SegmentLoad) -> int:
        remaining = load.remaining_segments if load.remaining_segments is not None else UNBOUNDED_SPAN
        if load.decode_rows == 0:
            return remaining
        seg_us = max(load.prefill_tokens, 1) * self.config.segment_us_per_token
        return max(1, min(remaining, int(self.config.budget_us // seg_us)))

    def __repr__(self) -> str:
        return f"WaitBudget({self.config})"

