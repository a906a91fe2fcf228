"""The engine's configuration: one frozen config per component, nested in `EngineConfig`.

`EngineConfig` nests the component configs (torchtitan's manner): `scheduler` (the planner),
`kv` (the block pool), `mux` (segment policy and ordering), `runner` (which runner and its
knobs) and `comm` (the communicators a distributed driver builds). Each is frozen and validated
in `__post_init__`, and there is one spelling: `EngineConfig(scheduler=SchedulerConfig(...),
kv=KVConfig(num_blocks=64))` in Python, the same nesting in a YAML mapping (`from_dict`).
Strings from a command line or a file are parsed here only (`parse_span`, `Schedule(...)`,
`RunnerConfig.kind`), so the CLI and a YAML file mean the same thing. What the engine measures
comes back in `engine.stats.EngineStats`: configs are never mutated.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
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
from megatron_rollout.vmm import STABLE_MODES

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
    raise ValueError(f"MuxConfig.span (--mux-span) must be 'load', 'fixed:K' with K > 0 or 'budget:US' with US > 0 "
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
    stable_memory: str = "auto"
    """K and V in address-stable memory (`vmm.StableBuffer`), so `engine.sleep(tags=["kv"])` keeps the
    captured graphs; the engine's weight copy moves there too at its first sleep (`weights.offload`).
    "auto" where the device and driver allow it (CUDA with virtual memory management), "on" (an
    error where they do not), "off" (plain tensors: what sleeps is freed, and the graphs over it
    with it)."""

    def __post_init__(self) -> None:
        if type(self.num_blocks) is not int or self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {self.num_blocks!r}")
        if self.stable_memory not in STABLE_MODES:
            raise ValueError(f"KVConfig.stable_memory must be one of {STABLE_MODES}, got {self.stable_memory!r}")


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
            raise ValueError(f"MuxConfig.ordering must be 'turnstile' or 'naive', got {self.ordering!r}")


SPECULATIVE_METHODS = ("mtp", "ngram")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding inside every schedule's decode iteration (`engine.drafting`)."""

    method: str = "mtp"
    """Who drafts: "mtp", the model's first multi-token-prediction layer (`model.mtp`), or "ngram",
    prompt lookup over the request's own context (`drafts.ngram`: no model, any model)."""
    k: int = 1
    """Drafted tokens per row and decode iteration (the first MTP layer applied k times in a chain,
    or the k tokens after the matched n-gram); an iteration then emits between 1 and k + 1 tokens
    per row."""
    ngram_min: int = 2
    """"ngram": the shortest suffix that is matched (a shorter match drafts nothing)."""
    ngram_max: int = 4
    """"ngram": the longest suffix that is matched (the longest match wins)."""
    tail_rows: int | None = None
    """Draft only in a rollout's tail: while at most this many requests decode on the replica
    (where a decode iteration is memory-bound and extra positions per row come almost free); None:
    always. Every rank of a replica decides alike (from the state its leader plans)."""
    tail_k: int | None = None
    """"ngram" only: drafted tokens per row while at most `tail_k_rows` rows decode, in place of k.
    There an iteration's time is the weights it reads for a row or two, so a longer guess costs
    little and each accepted token shortens the rollout's last trajectory. Up to 7 keeps a row's
    positions one run of the verify kernel (`runner.cuda.MAX_RUN`). None: k throughout."""
    tail_k_rows: int = 4
    """The most decoding rows at which `tail_k` applies."""
    streak_k: int | None = None
    """"ngram" only: drafted tokens for a row whose last draft was kept whole (where k, or `tail_k`, is
    fewer). A row whose text loops keeps whole drafts one iteration after another, and a longer guess
    there takes it through in fewer iterations; a row that missed drafts k again, so the verify
    forward grows only where guesses hold. Up to 7 keeps a row one run of the verify kernel. None: off."""
    group: bool = False
    """"ngram" only: a row whose own context proposes nothing looks its suffix up in the contexts of
    the other samples of its n > 1 request (an RL group: `SamplingParams.n`, the sessions forked from
    it included), open or finished, as Seer's grouped drafts do (`engine.drafting`)."""

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"SpeculativeConfig.method must be one of {list(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        if type(self.k) is not int or not 1 <= self.k <= 8:
            raise ValueError(f"SpeculativeConfig.k must be an int in [1, 8], got {self.k!r}")
        n_min, n_max = self.ngram_min, self.ngram_max
        if type(n_min) is not int or type(n_max) is not int or not 1 <= n_min <= n_max:
            raise ValueError(f"SpeculativeConfig.ngram_min and ngram_max must be ints with 1 <= ngram_min <= "
                             f"ngram_max, got {n_min!r} and {n_max!r}")
        if self.tail_rows is not None and (type(self.tail_rows) is not int or self.tail_rows <= 0):
            raise ValueError(f"SpeculativeConfig.tail_rows must be a positive int or None, got {self.tail_rows!r}")
        for name in ("tail_k", "streak_k"):  # n-gram drafts of another length than k
            value = getattr(self, name)
            if value is None:
                continue
            if type(value) is not int or not 1 <= value <= 8:
                raise ValueError(f"SpeculativeConfig.{name} must be an int in [1, 8] or None, got {value!r}")
            if self.method != "ngram":
                raise ValueError(f"SpeculativeConfig.{name} is for n-gram drafts (method 'ngram'); method "
                                 f"{self.method!r} drafts k tokens through graphs captured for k")
        if type(self.group) is not bool or (self.group and self.method != "ngram"):
            raise ValueError(f"SpeculativeConfig.group (drafts from an RL group's other samples) is True or False "
                             f"and needs method 'ngram', got group={self.group!r} with method {self.method!r}")
        if type(self.tail_k_rows) is not int or self.tail_k_rows <= 0:
            raise ValueError(f"SpeculativeConfig.tail_k_rows must be a positive int, got {self.tail_k_rows!r}")

    def k_at(self, rows: int, streak: bool = False) -> int:
        """Drafted tokens per row while `rows` rows decode (`tail_k` in the tail, k elsewhere), for a
        row whose last draft was kept whole (`streak`) at least `streak_k`."""
        k = self.tail_k if self.tail_k is not None and rows <= self.tail_k_rows else self.k
        return max(k, self.streak_k) if streak and self.streak_k is not None else k

    def graph_rows(self, max_rows: int) -> int:
        """One-token verify rows of an iteration of up to `max_rows` decode rows, at most."""
        rows = max_rows * (1 + max(self.k, self.streak_k or 0))
        if self.tail_k is not None:
            rows = max(rows, min(max_rows, self.tail_k_rows) * (1 + self.tail_k))
        return rows


@dataclass(frozen=True)
class EngineConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Planner: schedule (off | chunked | mux), block size, token budget, decode rows."""
    kv: KVConfig = field(default_factory=KVConfig)
    """KV pool size and prefix caching."""
    mux: MuxConfig = field(default_factory=MuxConfig)
    """`mux` segment policy and ordering."""
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    """Runner kind and CUDA-runner knobs."""
    comm: CommConfig | None = None
    """The communicators of a multi-rank engine: `distributed.Runtime.start` builds the model's
    `DistComm` from them, and the engine refuses a model whose comm was built otherwise. None:
    whatever the model's comm was built with. A one-process model has no communicators to
    configure. P's padded domain must hold a whole prefill epoch, so `comm.p_max_tokens` is raised
    to `scheduler.max_batch_tokens` where it is smaller."""
    speculative: SpeculativeConfig | None = None
    """Draft tokens (the model's MTP layer, or n-gram lookup in the context) and verify them in the
    same decode iteration (`engine.drafting`); None: plain decoding. Tokens at temperature 0 are
    the same either way."""
    max_model_len: int | None = None
    """Longest context; None means the model's max_position_embeddings. Longer than that is
    refused unless `allow_long_context` (see `context_length`)."""
    seed: int = 0
    """Seed of the generator used by sampled requests without their own seed."""
    allow_long_context: bool = False
    """Accept a `max_model_len` beyond the model's positions. For random-weight benchmarking only:
    RoPE extrapolates arithmetically, but a trained model's outputs there are meaningless."""
    gc_freeze: bool = True
    """During a rollout (requests running, or sessions open between turns), Python's garbage
    collector walks only the objects created since it began (`engine.gc_freeze`): a full collection
    of a trainer's heap would hold the host, and the GPU with it, for a fraction of a second. The
    heap is handed back when the last request ends with no session open, the last session closes,
    or the engine sleeps. False: the collector is left as it is."""

    def __post_init__(self) -> None:
        for name, kind in COMPONENTS.items():
            value = getattr(self, name)
            if not isinstance(value, kind) and not (name in OPTIONAL and value is None):
                raise TypeError(f"EngineConfig.{name} must be a {kind.__name__}, got {value!r}: pass "
                                f"{name}={kind.__name__}(...), or mappings to EngineConfig.from_dict")
        if self.comm is not None and self.comm.p_max_tokens < self.scheduler.max_batch_tokens:
            object.__setattr__(self, "comm", dataclasses.replace(self.comm,
                                                                 p_max_tokens=self.scheduler.max_batch_tokens))
        if self.runner.decode_sms and self.scheduler.schedule is not Schedule.MUX:
            raise ValueError(f"RunnerConfig.decode_sms holds SMs back from prefill for the decode iterations that "
                             f"run beside it, which only the mux schedule does; schedule "
                             f"{self.scheduler.schedule.value!r} would only run its prefill on fewer SMs")
        if self.max_model_len is not None and (type(self.max_model_len) is not int or self.max_model_len <= 0):
            raise ValueError(f"max_model_len must be a positive int or None, got {self.max_model_len!r}")
        if type(self.seed) is not int:
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        for name in ("allow_long_context", "gc_freeze"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> EngineConfig:
        """The config a nested mapping describes (a YAML file's `engine:` section): each component's
        fields under its name, e.g. `{"scheduler": {"schedule": "mux"}, "kv": {"num_blocks": 256}}`.
        Lists become tuples; unknown names are refused with the known ones."""
        if not isinstance(raw, Mapping):
            raise TypeError(f"an engine config must be a mapping of EngineConfig fields, got {raw!r}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise TypeError(f"EngineConfig has no field {unknown}; its fields are {known} (the components "
                            f"{list(COMPONENTS)} take mappings of their own fields)")
        return cls(**{name: _component(name, value) if name in COMPONENTS else value for name, value in raw.items()})

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


COMPONENTS: dict[str, type] = {"scheduler": SchedulerConfig, "kv": KVConfig, "mux": MuxConfig,
                               "runner": RunnerConfig, "comm": CommConfig, "speculative": SpeculativeConfig}
"""`EngineConfig`'s component fields and their config types."""
OPTIONAL = ("comm", "speculative")
"""The components that may be None."""


def _component(name: str, value: Any) -> Any:
    kind = COMPONENTS[name]
    if value is None or isinstance(value, kind):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"EngineConfig.{name} takes a mapping of {kind.__name__} fields, got {value!r}")
    known = [f.name for f in dataclasses.fields(kind)]
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise TypeError(f"{kind.__name__} (EngineConfig.{name}) has no field {unknown}; its fields are {known}")
    return kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in value.items()})
