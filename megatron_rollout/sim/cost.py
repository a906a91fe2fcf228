"""What one engine forward costs, as a linear function of its sizes, fitted from the engine's own
step records (`engine.records`).

    step_s = decode_base_s   [if decode rows]  + decode_row_s * rows + decode_context_s * context
           + decode_draft_s * drafted positions (a row's positions past its first)
           + prefill_base_s  [if prefill work] + prefill_row_s * chunks + prefill_token_s * new tokens
           + prefill_pair_s * causal attention (query, key) pairs
           + expert_s * distinct experts the step's tokens route to   [if decode rows, and asked for]

A mixed (`chunked`) step pays both bases and both sets of terms. A drafting row (its pending token
and k drafts, verified in one forward) is one row over one context, plus k drafted positions: the
extra positions of a memory-bound decode forward cost far less than rows (they read the row's KV
and the weights the row reads anyway), so the rows term does not count them. `decode_draft_s` is
fitted where records hold drafts, and 0 from records without any: a model fitted to plain decoding
and charging a drafting schedule charges its drafts only the experts they add. Charging each
position as a row instead put the drafting schedules out of sample up to 34% over their measured
makespans (a median 10%); charged this way, a median 5% under (docs/benchmarks.md, the
simulator's section). `gap_s` is the host's time between two forwards (planning, bookkeeping),
added once per step. `submit_token_s` is the host's time per
input token of the turns submitted before the first forward (`startup_token_s`): a replay's
start-up, which no step record covers. `turn_token_s` is the same for a turn submitted later,
between two forwards; where the replay marked its submissions (`trace.replay`'s details), they are
fitted from those marks (`turn_cost`) and taken out of the gaps `gap_s` averages.

Coefficients are fitted by non-negative least squares, so none of them can come out as a saving.
Observations are not weighted: a makespan is a sum of step times, so what must come out right is
the total of the long steps as much as the many short ones (a relative-error weighting fitted the
fastest, quietest steps and under-predicted a loaded host's makespans by a third). A `mux` epoch's
segments are one prefill observation (its sizes over the sum of its segments' durations); the
segments an epoch was cut into are counted in `mux_segments`.

The expert term (`fit(..., num_experts, top_k)`, off by default) is for MoE models: a decode
step reads the weights of every expert one of its tokens routes to, so its cost grows with rows
like the expected number of distinct experts (steep for a few rows, flat once every expert is
read), not linearly; one row reads top_k experts' weights, not a share of all of them. Prefill-only
forwards leave it out: their many tokens read every expert, which their base term already covers.

Left out: anything the records do not show (CUDA graph buckets, the router's real, skewed choices:
the expert term assumes uniform ones, which rows share a prefix); a cost model of another engine
or device is fitted from its own records.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import nnls

from megatron_rollout.engine.records import StepRecord

FEATURES = ("decode_base_s", "decode_row_s", "decode_context_s", "prefill_base_s", "prefill_row_s",
            "prefill_token_s", "prefill_pair_s", "decode_draft_s")


@dataclass(frozen=True)
class Routing:
    """What the expert term counts: a MoE layer's experts and how many of them each token picks."""

    num_experts: int
    top_k: int
    """Experts per token (distinct)."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"Routing.{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"Routing.top_k ({self.top_k}) must be at most num_experts ({self.num_experts})")

    def touched(self, tokens: int) -> float:
        """Expected distinct experts of `tokens` tokens, each picking `top_k` distinct experts
        uniformly: an expert is missed by one token with probability 1 - top_k / num_experts."""
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** tokens)


@dataclass(frozen=True)
class StepSize:
    """The sizes of one forward that its cost depends on."""

    decode_rows: int = 0
    """Decode rows (sequences), each over its own context."""
    decode_context: int = 0
    """Sum of the decode rows' contexts."""
    prefill_rows: int = 0
    prefill_tokens: int = 0
    prefill_pairs: int = 0
    """Causal attention (query, key) pairs of the prefill chunks."""
    decode_drafts: int = 0
    """Drafted positions the decode rows verify: their positions past one per row
    (`StepRecord.positions` - `StepRecord.decode_rows`)."""

    @classmethod
    def of(cls, record: StepRecord) -> StepSize:
        return cls(record.decode_rows, record.decode_context, record.prefill_rows, record.prefill_tokens,
                   record.prefill_pairs, record.positions - record.decode_rows)

    def features(self, routing: Routing | None = None) -> tuple[float, ...]:
        """The row of this size in the fit (order of `FEATURES`, then the expert term's with `routing`)."""
        d, p = self.decode_rows > 0, self.prefill_tokens > 0
        row = (float(d), float(self.decode_rows), float(self.decode_context), float(p), float(self.prefill_rows),
               float(self.prefill_tokens), float(self.prefill_pairs), float(self.decode_drafts))
        if routing is None:
            return row
        tokens = self.decode_rows + self.decode_drafts + self.prefill_tokens
        return (*row, routing.touched(tokens) if d else 0.0)


def chunk_pairs(past: int, new: int) -> int:
    """Causal attention pairs of a chunk of `new` positions after `past` cached ones."""
    return new * past + new * (new + 1) // 2


@dataclass(frozen=True)
class CostModel:
    """Seconds per forward (module docstring); every coefficient >= 0."""

    decode_base_s: float = 0.0
    decode_row_s: float = 0.0
    decode_context_s: float = 0.0
    prefill_base_s: float = 0.0
    prefill_row_s: float = 0.0
    prefill_token_s: float = 0.0
    prefill_pair_s: float = 0.0
    decode_draft_s: float = 0.0
    """Seconds per drafted position a decode row verifies beside its pending token."""
    gap_s: float = 0.0
    """Host time between two forwards."""
    submit_token_s: float = 0.0
    """Host time per input token of a turn submitted before the first forward (its ids checked and
    queued)."""
    turn_token_s: float = 0.0
    """Host time per input token of a turn submitted after the first forward, between two forwards.
    0 where the records did not mark the submissions: `gap_s` then averages their cost in, as far as
    the gaps it keeps hold them."""
    mux_segments: float = 1.0
    """Mean segments a `mux` epoch was cut into while decode rows ran beside it."""
    expert_s: float = 0.0
    """Seconds per distinct expert a step with decode rows reads (`Routing.touched`)."""
    routing: Routing | None = None
    """The model's routing, which the expert term needs; None: no expert term."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name == "routing":
                continue
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"CostModel.{f.name} must be a finite number >= 0, got {value!r}")
        if self.mux_segments < 1:
            raise ValueError(f"CostModel.mux_segments must be >= 1, got {self.mux_segments}")
        if self.expert_s and self.routing is None:
            raise ValueError(f"CostModel.expert_s is {self.expert_s} but routing is None: the expert term counts "
                             f"experts of a Routing; give one")

    def step_s(self, size: StepSize) -> float:
        """Seconds of one forward of `size` (without the host gap)."""
        coef = (self.decode_base_s, self.decode_row_s, self.decode_context_s, self.prefill_base_s,
                self.prefill_row_s, self.prefill_token_s, self.prefill_pair_s, self.decode_draft_s, self.expert_s)
        return sum(c * x for c, x in zip(coef, size.features(self.routing)))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def observations(records: Sequence[StepRecord]) -> list[tuple[StepSize, float]]:
    """(size, seconds) of each forward: whole steps as they are, a `mux` epoch's segments summed."""
    out: list[tuple[StepSize, float]] = []
    epochs: dict[int, list[StepRecord]] = {}
    for r in records:
        if r.epoch is None:
            out.append((StepSize.of(r), r.duration))
        else:
            epochs.setdefault(r.epoch, []).append(r)
    for segments in epochs.values():
        size = StepSize(0, 0, *(sum(getattr(s, f) for s in segments)
                                for f in ("prefill_rows", "prefill_tokens", "prefill_pairs")))
        out.append((size, sum(s.duration for s in segments)))
    return out


def fit(records: Sequence[StepRecord], num_experts: int | None = None, top_k: int | None = None,
        submissions: Sequence[tuple[float, float, int]] = (),
        sleeps: Sequence[tuple[float, float]] | None = None) -> CostModel:
    """The cost model of the engine that produced `records` (one or more replays' worth); with
    `num_experts` and `top_k` (the model's routing), with the expert term; with `submissions` (the
    replays' turns as (start, end, input tokens) on the records' clock), with `turn_token_s` fitted
    to them, their time taken out of the gaps between forwards; with `sleeps` (the spans in which the
    replay had nothing to run), the gaps less those are host time, every one of them (without, a gap
    longer than the forward before it counts as nothing to do). Records of several replays pooled
    with `sleeps` need the time between two replays among the sleeps: nothing of theirs ran then.

    Raises ValueError when the records cannot determine it (no decode-only and no prefill
    forward), or when only one of `num_experts` and `top_k` is given.
    """
    if (num_experts is None) != (top_k is None):
        raise ValueError(f"the expert term needs both num_experts and top_k, got {num_experts=} and {top_k=}")
    routing = None if num_experts is None else Routing(num_experts, top_k)
    obs = [(s, t) for s, t in observations(records) if t > 0]
    if not any(s.decode_rows and not s.prefill_tokens for s, _ in obs) or not any(s.prefill_tokens for s, _ in obs):
        raise ValueError(f"fitting a cost model needs decode-only and prefill forwards; got {len(obs)} forwards "
                         f"({sum(bool(s.prefill_tokens) for s, _ in obs)} with prefill): replay a trace with "
                         f"several turns first")
    x = np.array([s.features(routing) for s, _ in obs])
    y = np.array([t for _, t in obs])
    scale = x.max(axis=0)
    scale[scale == 0] = 1.0  # a feature never seen stays 0
    coef, _ = nnls(x / scale, y)
    coef = coef / scale
    names = FEATURES + (("expert_s",) if routing is not None else ())
    return CostModel(**dict(zip(names, (float(c) for c in coef))), gap_s=_gap(records, submissions, sleeps),
                     turn_token_s=turn_cost(submissions), mux_segments=segments_per_epoch(records), routing=routing)


def turn_cost(submissions: Sequence[tuple[float, float, int]]) -> float:
    """Host seconds per input token of `submissions` ((start, end, input tokens) each): their time over
    their tokens (0 when they have none)."""
    tokens = sum(n for _, _, n in submissions)
    return sum(b - a for a, b, _ in submissions) / tokens if tokens else 0.0


def startup_token_s(first_forward_s: float, tokens: int) -> float:
    """`CostModel.submit_token_s` of a replay whose first forward began `first_forward_s` after its
    start, with `tokens` input tokens submitted by then (0 when none were, or the forward began at once)."""
    if not math.isfinite(first_forward_s):
        raise ValueError(f"first_forward_s must be finite, got {first_forward_s!r}")
    if type(tokens) is not int or tokens < 0:
        raise ValueError(f"tokens must be an int >= 0, got {tokens!r}")
    return max(0.0, first_forward_s) / tokens if tokens else 0.0


def _gap(records: Sequence[StepRecord], submissions: Sequence[tuple[float, float, int]] = (),
         sleeps: Sequence[tuple[float, float]] | None = None) -> float:
    """Mean host time between consecutive forwards (a makespan adds them up: the mean, not the
    median), less the submissions inside each gap (charged apart). Without `sleeps`, gaps longer than
    the forward before them are left out (the engine had nothing to do: tool waits, not host cost);
    with them, each gap less its sleeps counts."""
    ordered = sorted(records, key=lambda r: r.start)
    spans = sorted([(a, b) for a, b, _ in submissions] + list(sleeps or ()))
    starts = [a for a, _ in spans]
    gaps = []
    for a, b in zip(ordered, ordered[1:]):
        gap = b.start - a.end
        i = bisect.bisect_left(starts, a.end)
        while i < len(spans) and spans[i][0] < b.start:
            gap -= min(spans[i][1], b.start) - spans[i][0]
            i += 1
        if 0 <= gap and (sleeps is not None or gap <= max(a.duration, 1e-3)):
            gaps.append(gap)
    return statistics.fmean(gaps) if gaps else 0.0


def segments_per_epoch(records: Sequence[StepRecord]) -> float:
    """Mean segments of the `mux` epochs in `records` that were cut (1.0 when none was): how the
    segment policy that produced them splits an epoch, for a cost model fitted elsewhere.
    `records` of one engine: epoch numbers restart with each engine."""
    counts: dict[int, int] = {}
    for r in records:
        if r.epoch is not None:
            counts[r.epoch] = counts.get(r.epoch, 0) + 1
    split = [n for n in counts.values() if n > 1]
    return statistics.mean(split) if split else 1.0
