"""What the engine measured while it ran (`RolloutEngine.stats`): counters, never configuration.

Kept apart from the configs (run-time values come back in their own record, configs are never
mutated) and free of imports, so the CPU request table can count into it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    steps: int = 0
    decode_iterations: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    decode_wait_s: float = 0.0
    decode_waits: int = 0
    ahead_issued: int = 0
    """Decode forwards issued before the host read the previous one's tokens (`engine.ahead`)."""
    ahead_taken: int = 0
    """Of those, the ones a step's plan took (in whole or in part)."""
    ahead_dropped: int = 0
    """The ones dropped (the next plan was not among their rows; weights or KV changed first)."""
    drafted_tokens: int = 0
    """Speculative decoding (`engine.drafting`): drafted tokens verified by a decode iteration."""
    accepted_tokens: int = 0
    """Of those, the ones the target accepted."""
    copied_drafts: int = 0
    """Tokens an n-gram lookup proposed from a sibling sample's context (`SpeculativeConfig.group`),
    before the plan cut them to the room it gave."""

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted tokens (0.0 before any draft was verified)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_decode_wait_ms(self) -> float:
        """Mean time a ready decode row waited for its next iteration (ms)."""
        return 1e3 * self.decode_wait_s / self.decode_waits if self.decode_waits else 0.0
