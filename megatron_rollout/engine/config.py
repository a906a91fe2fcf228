"""The engine's configuration and the counters it reports.

`EngineConfig` is what a user sets; `EngineStats` is what the engine measured (STYLE rule 4:
configs are never mutated, run-time values come back in their own record).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_rollout.engine.api import Schedule
from megatron_rollout.engine.scheduler import SchedulerConfig


@dataclass(frozen=True)
class EngineConfig:
    schedule: Schedule | str = Schedule.CHUNKED
    """off | chunked | mux (see `Schedule`)."""
    block_size: int = 16
    """Positions per KV block."""
    num_blocks: int = 512
    """KV blocks in the pool (per rank)."""
    max_batch_tokens: int = 512
    """Token budget of a step (`chunked`) or of a prefill epoch (`off`, `mux`)."""
    max_decode_rows: int = 256
    """Decode rows per iteration."""
    max_model_len: int | None = None
    """Longest context; defaults to the model's max_position_embeddings."""
    prefix_caching: bool = True
    """Reuse computed full blocks of identical prefixes (GRPO groups share their prompt)."""
    mux_span: str = "load"
    """`mux` segment policy: "load" (LoadSelected) or "fixed:K" (FixedSpan(K))."""
    seed: int = 0
    """Seed of the generator used by sampled requests without their own seed."""
    mux_ordering: str = "turnstile"
    """`mux` only: "turnstile" (the protocol) or "naive" (P on its own host thread, no cross-rank
    order: the unsafe baseline of the ordering experiments; never use it across ranks)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        if self.block_size <= 0 or self.num_blocks <= 0:
            raise ValueError(f"block_size and num_blocks must be positive, got {self.block_size}, {self.num_blocks}")
        if self.mux_ordering not in ("turnstile", "naive"):
            raise ValueError(f"mux_ordering must be 'turnstile' or 'naive', got {self.mux_ordering!r}")
        if not (self.mux_span == "load" or self.mux_span.startswith("fixed:") and self.mux_span[6:].isdigit()
                and int(self.mux_span[6:]) > 0):
            raise ValueError(f"mux_span must be 'load' or 'fixed:K' with K > 0, got {self.mux_span!r}")

    @property
    def scheduler(self) -> SchedulerConfig:
        return SchedulerConfig(self.schedule, self.block_size, self.max_batch_tokens, self.max_decode_rows)


@dataclass
class EngineStats:
    steps: int = 0
    decode_iterations: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    decode_wait_s: float = 0.0
    decode_waits: int = 0

    @property
    def mean_decode_wait_ms(self) -> float:
        """Mean time a ready decode row waited for its next iteration (ms)."""
        return 1e3 * self.decode_wait_s / self.decode_waits if self.decode_waits else 0.0
