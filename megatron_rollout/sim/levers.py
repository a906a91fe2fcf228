"""Levers on the critical chain that an ordering cannot pull (issue 33), as simulator options.

Every ordering gives the critical conversation about the same service on the `prefill` traces: it
is admitted early anyway, and each of its decode steps carries every other row and the prefill
mixed in. What changes the chain's own time is what its steps cost and how many there are:

- `critical_first` (decode priority): while one of the best-ranked requests decodes, prefill gets
  at most `critical_share` of the device (`mux`: each decode iteration is followed by a prefill
  segment at most share / (1 - share) of its time; share 0, any schedule: no prefill at all, it
  runs only in the gaps of those chains, their tool waits and prefills).
- `Overlap` (spatial P/D multiplexing, `mux` only): a decode iteration runs beside the prefill
  segment issued with it, each on its own SM partition; each runs slower than alone, by
  `decode_factor` and `prefill_factor`, instead of one after the other. As in the engine, one
  segment is issued a round: prefill does not run ahead of the host into the next.
- `TailLane`: after each step with more than `rows` decode rows, `steps` more decode-only steps of
  the `rows` decoding requests ranked first (by the tokens their conversation has generated, by
  its context, or by the oracle's remaining chain): the trajectories likely to finish last get
  more tokens a second, at the cost of the steps' base and host gap.
- `Speculation`: decode iterations of at most `max_rows` rows verify `draft_tokens` drafted
  tokens per row and keep `1 + acceptance * draft_tokens` tokens per row on average, at the cost
  of a forward of the same rows with `draft_tokens` drafted positions each (`CostModel.decode_draft_s`
  and the experts they add; each row's KV read once), times `overhead`;
  `tail_tokens` drafted instead while at most `tail_rows` rows decode (`SpeculativeConfig.tail_k`).

Left out: what a real implementation costs beyond these factors (graph captures per partition,
the drafter's own forward), and any lower bound under them (`sim.bounds` assumes serial
execution, one token a step; overlap and speculation change the machine it bounds).
"""
from __future__ import annotations

from dataclasses import dataclass


def _positive(owner: str, name: str, value: float, least: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= least:
        raise ValueError(f"{owner}.{name} must be a number >= {least}, got {value!r}")


@dataclass(frozen=True)
class Overlap:
    """Decode and prefill side by side on one device, each on a partition of its SMs."""

    decode_factor: float
    """A decode iteration's time beside prefill over its time alone on the whole device (>= 1).
    `benchmarks.pd_overlap` measures it, under this name, for each SM split."""
    prefill_factor: float
    """Prefill's time beside decode over its time alone on the whole device (>= 1); measured
    there too."""
    alone_factor: float = 1.0
    """Prefill's time with no decode beside it over its time alone on the whole device (>= 1): with
    SMs held back from prefill (`RunnerConfig.decode_sms`) it still runs on its partition
    (`benchmarks.pd_overlap`'s `prefill_partition_factor`). 1: it has the whole device."""
    decode_alone_factor: float = 1.0
    """A decode iteration's time on its partition with no prefill beside it over its time alone on
    the whole device (>= 1): an iteration issued beside prefill stays on the SMs it was issued to
    when prefill ends first (`RunnerConfig.partition` "split": its graph was captured there;
    `benchmarks.pd_overlap`'s `decode_partition_factor`). 1: it finishes at full speed."""

    def __post_init__(self) -> None:
        _positive("Overlap", "decode_factor", self.decode_factor, 1.0)
        _positive("Overlap", "prefill_factor", self.prefill_factor, 1.0)
        _positive("Overlap", "alone_factor", self.alone_factor, 1.0)
        _positive("Overlap", "decode_alone_factor", self.decode_alone_factor, 1.0)

    def step_s(self, decode_s: float, prefill_left_s: float) -> tuple[float, float]:
        """(seconds the step takes, prefill seconds-alone it completes) for a decode iteration of
        `decode_s` alone beside `prefill_left_s` alone of prefill (the segment issued with it).
        When prefill ends first, the rest of the iteration runs alone, `decode_alone_factor` slower
        than on the whole device."""
        beside = decode_s * self.decode_factor
        if prefill_left_s * self.prefill_factor >= beside:
            return beside, beside / self.prefill_factor
        shared = prefill_left_s * self.prefill_factor
        return shared + decode_s * (1.0 - shared / beside) * self.decode_alone_factor, prefill_left_s


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding of the tail: drafted tokens verified in the decode iteration."""

    max_rows: int
    """Decode iterations with at most this many rows speculate (the tail of the rollout)."""
    draft_tokens: int
    """k: tokens drafted per row and iteration."""
    acceptance: float
    """a: the fraction of drafted tokens accepted; a row keeps 1 + a * k tokens an iteration on
    average (kept deterministically: fractions carry over to the row's next iteration)."""
    overhead: float = 1.0
    """The verifying iteration's time over a plain iteration of rows * (1 + k) rows over the same
    context (>= 1: the drafter, verification on the host)."""
    tail_tokens: int | None = None
    """k while at most `tail_rows` rows decode (None: `draft_tokens` throughout); accepted at the
    same rate."""
    tail_rows: int = 4

    def __post_init__(self) -> None:
        tail = ("tail_tokens",) if self.tail_tokens is not None else ()
        for name in ("max_rows", "draft_tokens", "tail_rows", *tail):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"Speculation.{name} must be a positive int, got {value!r}")
        if isinstance(self.acceptance, bool) or not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"Speculation.acceptance must be in [0, 1], got {self.acceptance!r}")
        _positive("Speculation", "overhead", self.overhead, 1.0)

    @property
    def tokens_per_row(self) -> float:
        return 1.0 + self.acceptance * self.draft_tokens

    def tokens_at(self, rows: int) -> int:
        """Drafted tokens per row in an iteration of `rows` decode rows."""
        return self.tail_tokens if self.tail_tokens is not None and rows <= self.tail_rows else self.draft_tokens


LANE_RANKS = ("generated", "context", "oracle")
"""How `TailLane` ranks the decoding requests, most first: the output tokens their conversation has
generated (this turn's so far included: attained service), its tokens, or the remaining chain of
turns and waits at batch 1 (the oracle: knowing the future)."""


@dataclass(frozen=True)
class TailLane:
    """Extra decode-only steps for the requests ranked first."""

    rows: int
    """Requests in the lane; a step with at most this many decode rows adds none."""
    steps: int
    """Decode-only steps of the lane after each engine step."""
    rank: str = "generated"
    """One of `LANE_RANKS`."""

    def __post_init__(self) -> None:
        for name in ("rows", "steps"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"TailLane.{name} must be a positive int, got {value!r}")
        if self.rank not in LANE_RANKS:
            raise ValueError(f"TailLane.rank must be one of {LANE_RANKS}, got {self.rank!r}")


@dataclass(frozen=True)
class Levers:
    """The simulated engine's levers; the default pulls none (the engine as it runs today)."""

    critical_first: int = 0
    """Decode priority: while any of this many best-ranked active requests has a decode row, a
    step carries no prefill (0: off). Under the oracle ordering the best-ranked is the critical
    chain; under FIFO the oldest request."""
    critical_share: float = 0.0
    """The share of the device prefill keeps while held (`mux` only; 0: none)."""
    overlap: Overlap | None = None
    """Spatial P/D overlap (`mux` only); None: decode and prefill serial on one stream."""
    speculation: Speculation | None = None
    """Speculative decoding of small decode batches; None: one token a row and iteration."""
    tail_lane: TailLane | None = None
    """Extra decode-only steps for the requests ranked first (`off`/`chunked`); None: none."""

    def __post_init__(self) -> None:
        if type(self.critical_first) is not int or self.critical_first < 0:
            raise ValueError(f"Levers.critical_first must be an int >= 0, got {self.critical_first!r}")
        if isinstance(self.critical_share, bool) or not 0.0 <= self.critical_share < 1.0:
            raise ValueError(f"Levers.critical_share must be in [0, 1), got {self.critical_share!r}")

    def segment_cap_s(self, decode_s: float) -> float:
        """The longest prefill segment after a held decode iteration of `decode_s`."""
        return decode_s * self.critical_share / (1.0 - self.critical_share)

    @property
    def label(self) -> str:
        """A short name of the levers pulled ('' when none)."""
        parts = []
        if self.critical_first:
            parts.append(f"critical-first:{self.critical_first}"
                         + (f"/share:{self.critical_share:g}" if self.critical_share else ""))
        if self.overlap:
            parts.append(f"overlap:{self.overlap.decode_factor:g}x{self.overlap.prefill_factor:g}")
        if s := self.speculation:
            parts.append(f"spec:{s.max_rows}r/k{s.draft_tokens}/a{s.acceptance:g}/c{s.overhead:g}"
                         + (f"/tail:{s.tail_tokens}@{s.tail_rows}" if s.tail_tokens is not None else ""))
        if lane := self.tail_lane:
            parts.append(f"lane:{lane.rows}r/{lane.steps}s/{lane.rank}")
        return "+".join(parts)
