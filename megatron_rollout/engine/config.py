"""The engine's configuration, one frozen config per component, and the counters it reports.

`EngineConfig` nests the component configs (torchtitan's manner): `scheduler` (the planner),
`kv` (the block pool), `mux` (segment policy and ordering), `runner` (which runner and its
knobs) and `comm` (the communicators a distributed driver builds). Each is frozen and validated
in `__post_init__`. `EngineConfig(schedule="mux", num_blocks=64, mux_span="fixed:1", ...)` is
shorthand: each flat keyword (`FLAT`) sets one field of one component, and the flat names stay
readable as properties. Strings from a command line are parsed here only (`parse_span`,
`Schedule(...)`, `RunnerConfig.kind`), so the CLI and a YAML file mean the same thing.

`EngineStats` is what the engine measured (STYLE rule 4: configs are never mutated, run-time
values come back in their own record).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_rollout.comm.dist import CommConfig
from megatron_rollout.engine.api import Schedule
from megatron_rollout.engine.scheduler import SchedulerConfig
from megatron_rollout.multiplex.policy import (
    FixedSpan,
    FixedSpanConfig,
    LoadSelected,
    LoadSelectedConfig,
    SegmentPolicy,
    WaitBudget,
    WaitBudgetConfig,
)
from megatron_rollout.runner.config import RunnerConfig

DEFAULT_NUM_BLOCKS = 1024
"""KV blocks per rank when nobody says otherwise (the CLI's `--num-blocks` default too)."""

SpanConfig = FixedSpanConfig | LoadSelectedConfig | WaitBudgetConfig
"""A `mux` segment policy, as a typed config (see `multiplex.policy`)."""
DEFAULT_SPAN = "budget:8000"
"""`mux`'s default segment policy (`WaitBudget`, 8 ms): LoadSelected's fine segments cost a decode
iteration per round inside every epoch, 3.6-4.1x off's mean TTFT on the H200 (docs/benchmarks.md)."""

ORDERINGS = ("turnstile", "naive")


def parse_span(spec: str | SpanConfig) -> SpanConfig:
    """The one parser of segment-policy strings: "load" -> LoadSelectedConfig(), "fixed:K" ->
    FixedSpanConfig(K), "budget:US" -> WaitBudgetConfig(budget_us=US). A config passes through."""
    if isinstance(spec, (FixedSpanConfig, LoadSelectedConfig, WaitBudgetConfig)):
        return spec
    if spec == "load":
        return LoadSelectedConfig()
    kind, _, value = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if kind == "fixed" and value.isdigit() and int(value) > 0:
        return FixedSpanConfig(int(value))
    if kind == "budget" and value.replace(".", "", 1).isdigit() and float(value) > 0:
        return WaitBudgetConfig(budget_us=float(value))
    raise ValueError(f"mux_span must be 'load', 'fixed:K' with K > 0 or 'budget:US' with US > 0 "
                     f"(microseconds), got {spec!r}")


def span_spec(span: SpanConfig) -> str:
    """The string `parse_span` reads back ("load" for any LoadSelectedConfig)."""
    if isinstance(span, FixedSpanConfig):
        return f"fixed:{span.span}"
    if isinstance(span, WaitBudgetConfig):
        return f"budget:{span.budget_us:g}"
    return "load"


def build_policy(span: SpanConfig) -> SegmentPolicy:
    if isinstance(span, FixedSpanConfig):
        return FixedSpan(span)
    return WaitBudget(span) if isinstance(span, WaitBudgetConfig) else LoadSelected(span)


@dataclass(frozen=True)
class KVConfig:
    """The paged KV pool (positions per block: `SchedulerConfig.block_size`, shared with the planner)."""

    num_blocks: int = DEFAULT_NUM_BLOCKS
    """KV blocks in the pool (per rank)."""
    prefix_caching: bool = True
    """Reuse computed full blocks of identical prefixes (GRPO groups share their prompt)."""

    def __post_init__(self) -> None:
        if type(self.num_blocks) is not int or self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {self.num_blocks!r}")


@dataclass(frozen=True)
class MuxConfig:
    """The `mux` schedule (ignored by `off` and `chunked`)."""

    span: SpanConfig = field(default_factory=lambda: parse_span(DEFAULT_SPAN))
    """Segment policy: LoadSelectedConfig (span from decode load), FixedSpanConfig(K) or
    WaitBudgetConfig (span from a decode-wait budget). A string ("load", "fixed:K", "budget:US")
    is parsed by `parse_span`."""
    ordering: str = "turnstile"
    """"turnstile" (the protocol) or "naive" (P on its own host thread, no cross-rank order: the
    unsafe baseline of the ordering experiments; never use it across ranks)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "span", parse_span(self.span))
        if self.ordering not in ORDERINGS:
            raise ValueError(f"mux_ordering must be 'turnstile' or 'naive', got {self.ordering!r}")


FLAT: dict[str, tuple[str, str]] = {
    "schedule": ("scheduler", "schedule"),
    "block_size": ("scheduler", "block_size"),
    "max_batch_tokens": ("scheduler", "max_batch_tokens"),
    "max_decode_rows": ("scheduler", "max_decode_rows"),
    "num_blocks": ("kv", "num_blocks"),
    "prefix_caching": ("kv", "prefix_caching"),
    "mux_span": ("mux", "span"),
    "mux_ordering": ("mux", "ordering"),
    "runner_kind": ("runner", "kind"),
    "decode_ahead": ("runner", "decode_ahead"),
    "fp8": ("runner", "fp8"),
}
"""Flat keyword -> (component, field): the shorthand `EngineConfig(**flat)` accepts."""


@dataclass(frozen=True, init=False)
class EngineConfig:
    scheduler: SchedulerConfig
    """Planner: schedule (off | chunked | mux), block size, token budget, decode rows."""
    kv: KVConfig
    """KV pool size and prefix caching."""
    mux: MuxConfig
    """`mux` segment policy and ordering."""
    runner: RunnerConfig
    """Runner kind and CUDA-runner knobs."""
    comm: CommConfig
    """Communicators, read by whoever builds the DistComm (`distributed.Runtime.start`); the engine
    itself uses the model's comm as built."""
    max_model_len: int | None
    """Longest context; None means the model's max_position_embeddings. Longer than that is
    refused unless `allow_long_context` (see `context_length`)."""
    seed: int
    """Seed of the generator used by sampled requests without their own seed."""
    allow_long_context: bool
    """Accept a `max_model_len` beyond the model's positions. For random-weight benchmarking only:
    RoPE extrapolates arithmetically, but a trained model's outputs there are meaningless."""

    def __init__(self, scheduler: SchedulerConfig | None = None, kv: KVConfig | None = None,
                 mux: MuxConfig | None = None, runner: RunnerConfig | None = None, comm: CommConfig | None = None,
                 max_model_len: int | None = None, seed: int = 0, allow_long_context: bool = False,
                 **flat: Any) -> None:
        unknown = sorted(set(flat) - set(FLAT))
        if unknown:
            raise TypeError(f"EngineConfig got unknown keywords {unknown}; known: components "
                            f"scheduler/kv/mux/runner/comm, max_model_len, seed, and {sorted(FLAT)}")
        parts: dict[str, Any] = {"scheduler": scheduler or SchedulerConfig(), "kv": kv or KVConfig(),
                                 "mux": mux or MuxConfig(), "runner": runner or RunnerConfig(),
                                 "comm": comm or CommConfig()}
        updates: dict[str, dict[str, Any]] = {}
        for name, value in flat.items():
            component, attr = FLAT[name]
            updates.setdefault(component, {})[attr] = value
        if "schedule" in updates.get("scheduler", {}):
            updates["scheduler"]["schedule"] = Schedule(updates["scheduler"]["schedule"])
        for component, values in updates.items():
            parts[component] = dataclasses.replace(parts[component], **values)
        for name, value in {**parts, "max_model_len": max_model_len, "seed": seed,
                            "allow_long_context": allow_long_context}.items():
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        object.__setattr__(self, "scheduler", dataclasses.replace(self.scheduler,
                                                                  schedule=Schedule(self.scheduler.schedule)))
        if self.max_model_len is not None and (type(self.max_model_len) is not int or self.max_model_len <= 0):
            raise ValueError(f"max_model_len must be a positive int or None, got {self.max_model_len!r}")
        if not isinstance(self.allow_long_context, bool):
            raise ValueError(f"allow_long_context must be True or False, got {self.allow_long_context!r}")

    def context_length(self, model_positions: int) -> int:
        """The engine's longest context for a model with `model_positions` positions: max_model_len,
        or the model's positions when it is None; beyond them only with `allow_long_context`."""
        if self.max_model_len is None:
            return model_positions
        if self.max_model_len > model_positions and not self.allow_long_context:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's {model_positions} positions "
                             f"(max_position_embeddings); lower it, or pass allow_long_context=True for "
                             f"random-weight benchmarking")
        return self.max_model_len

    # -- the flat names, read-only ----------------------------------------------------------
    @property
    def schedule(self) -> Schedule:
        return self.scheduler.schedule

    @property
    def block_size(self) -> int:
        return self.scheduler.block_size

    @property
    def max_batch_tokens(self) -> int:
        return self.scheduler.max_batch_tokens

    @property
    def max_decode_rows(self) -> int:
        return self.scheduler.max_decode_rows

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def prefix_caching(self) -> bool:
        return self.kv.prefix_caching

    @property
    def mux_span(self) -> str:
        return span_spec(self.mux.span)

    @property
    def mux_ordering(self) -> str:
        return self.mux.ordering
