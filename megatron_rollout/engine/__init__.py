"""The rollout engine: paged KV, continuous batching with explicit P/D phases, sessions."""
from megatron_rollout.engine.api import (
                                         FinishReason,
                                         GenerationResult,
                                         RequestError,
                                         RequestOutput,
                                         SamplingParams,
                                         Schedule,
)
from megatron_rollout.engine.config import EngineConfig
from megatron_rollout.engine.engine import RolloutEngine
from megatron_rollout.engine.session import Session, SessionClosed
from megatron_rollout.engine.stats import EngineStats

__all__ = ["EngineConfig", "EngineStats", "FinishReason", "GenerationResult", "RequestError", "RequestOutput",
           "RolloutEngine", "SamplingParams", "Schedule", "Session", "SessionClosed"]
