"""What an RL environment is to the rollout driver: an async reset/step pair in token space.

Environments speak token ids, not text, because the rollout appends their observations to an
engine session verbatim; an environment that thinks in text owns a tokenizer. `reset` and `step`
are coroutines so a tool that takes time (a sandbox, a web call, here `asyncio.sleep`) lets the
driver keep decoding other trajectories meanwhile. One `Env` instance serves one episode.

Reward functions use TRL's signature, `f(prompts, completions, completion_ids, **kwargs) ->
list[float | None]` (None: the function does not apply to that sample), so functions written for
TRL plug in; `Rubric` sums weighted functions. Left out: batched env stepping, vectorised envs,
and per-token rewards.
"""
from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Observation:
    token_ids: tuple[int, ...]
    """The episode's opening context (the prompt), BOS included if the model expects one."""


@dataclass(frozen=True)
class StepResult:
    observation_ids: tuple[int, ...]
    """Tokens the environment answers with (appended to the context unless `done`)."""
    reward: float
    """Reward of this step; the episode reward is the sum over steps."""
    done: bool
    """The episode is over; `observation_ids` is then ignored."""


class Env(abc.ABC):
    """One episode of an environment. Call `reset` once, then `step` after each generated turn."""

    @abc.abstractmethod
    async def reset(self, seed: int) -> Observation:
        """Start an episode; the same seed gives the same episode (prompt, hidden state)."""

    @abc.abstractmethod
    async def step(self, generated_ids: Sequence[int]) -> StepResult:
        """React to the tokens the model generated this turn."""


class RewardFn(Protocol):
    __name__: str

    def __call__(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                 **kwargs: Any) -> list[float | None]: ...


class Rubric:
    """A weighted sum of reward functions. A function returning None for a sample is left out of
    that sample's sum; a sample where every function returns None scores 0. With weights summing
    to 1 and each function in [0, 1], the score stays in [0, 1]."""

    def __init__(self, funcs: Sequence[RewardFn], weights: Sequence[float] | None = None) -> None:
        if not funcs:
            raise ValueError("Rubric needs at least one reward function")
        weights = [1.0] * len(funcs) if weights is None else list(weights)
        if len(weights) != len(funcs):
            raise ValueError(f"Rubric got {len(weights)} weights for {len(funcs)} reward functions")
        self.funcs, self.weights = list(funcs), weights

    def score_each(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                   **kwargs: Any) -> dict[str, list[float | None]]:
        """Each function's raw scores, keyed by function name."""
        out: dict[str, list[float | None]] = {}
        for f in self.funcs:
            scores = list(f(prompts, completions, completion_ids, **kwargs))
            if len(scores) != len(prompts):
                raise ValueError(f"reward function {f.__name__} returned {len(scores)} scores for "
                                 f"{len(prompts)} samples")
            out[getattr(f, "__name__", repr(f))] = scores
        return out

    def __call__(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                 **kwargs: Any) -> list[float]:
        each = self.score_each(prompts, completions, completion_ids, **kwargs)
        totals = [0.0] * len(prompts)
        for w, scores in zip(self.weights, each.values()):
            for i, s in enumerate(scores):
                if s is not None:
                    totals[i] += w * float(s)
        return totals
