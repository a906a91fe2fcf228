"""The rollout engine: paged KV, continuous batching with explicit P/D phases, sessions."""
from megatron_rollout.comm.dist import CommConfig
from megatron_rollout.engine.api import (
                                         FinishReason,
                                         GenerationResult,
                                         RequestError,
                                         RequestOutput,
                                         SamplingParams,
                                         Schedule,
)
from megatron_rollout.engine.config import EngineConfig, KVConfig, MuxConfig, SpeculativeConfig
from megatron_rollout.engine.engine import RolloutEngine
from megatron_rollout.engine.memory import EngineAsleep
from megatron_rollout.engine.scheduler import SchedulerConfig
from megatron_rollout.engine.session import Session, SessionClosed
from megatron_rollout.engine.stats import EngineStats
from megatron_rollout.runner.config import RunnerConfig

__all__ = ["CommConfig", "EngineAsleep", "EngineConfig", "EngineStats", "FinishReason", "GenerationResult",
           "KVConfig", "MuxConfig", "RequestError", "RequestOutput", "RolloutEngine", "RunnerConfig", "SamplingParams",
           "Schedule", "SchedulerConfig", "Session", "SessionClosed", "SpeculativeConfig"]
