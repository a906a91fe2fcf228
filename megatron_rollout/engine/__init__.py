"""The rollout engine: paged KV, continuous batching with explicit P/D phases, sessions."""
from megatron_rollout.engine.api import (FinishReason, GenerationResult, RequestOutput, SamplingParams,
                                         Schedule)
from megatron_rollout.engine.engine import EngineConfig, RequestError, RolloutEngine
from megatron_rollout.engine.session import Session, SessionClosed

__all__ = ["EngineConfig", "FinishReason", "GenerationResult", "RequestError", "RequestOutput", "RolloutEngine",
           "SamplingParams", "Schedule", "Session", "SessionClosed"]
