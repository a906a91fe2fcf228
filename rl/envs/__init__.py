"""Environments in token space: the async `Env` interface, reward functions and the toy tasks."""
from rl.envs.base import Env, Observation, RewardFn, Rubric, StepResult
from rl.envs.guess import GuessDigitEnv
from rl.envs.lookup import LookupEnv, code_match
from rl.envs.single_turn import (
                                 PromptTask,
                                 SingleTurnEnv,
                                 digit_fraction,
                                 digits_task,
                                 target_byte_fraction,
                                 target_byte_task,
)

__all__ = ["Env", "Observation", "StepResult", "RewardFn", "Rubric", "SingleTurnEnv", "PromptTask", "GuessDigitEnv",
           "digit_fraction", "target_byte_fraction", "digits_task", "target_byte_task", "LookupEnv", "code_match"]
