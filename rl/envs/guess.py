"""A multi-turn tool task: guess a hidden digit; the "tool" answers higher/lower after a delay.

It exists to exercise what single-turn tasks cannot: continuation prefills of environment tokens
into a live session, and tool latency during which other trajectories keep decoding. Each turn
the model's first generated digit is its guess; the environment replies, after
`await asyncio.sleep(latency_s)`, with "higher", "lower" or "no digit". Reward (in [0, 1]) is
only paid on a correct guess: 1 at the first turn, decreasing by 1/max_turns per extra turn; an
episode that runs out of turns scores 0. Left out: richer tools (a calculator, code execution).
"""
from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

from rl.envs.base import Env, Observation, StepResult

PROMPT = "Guess my digit 0-9. Reply with one digit.\n"


class GuessDigitEnv(Env):
    def __init__(self, tokenizer: Any, latency_s: float = 0.01, max_turns: int = 4) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.tok, self.latency_s, self.max_turns = tokenizer, latency_s, max_turns
        self.secret: int | None = None
        self.turn = 0

    async def reset(self, seed: int) -> Observation:
        self.secret = random.Random(seed).randrange(10)
        self.turn = 0
        return Observation(tuple([self.tok.bos_id, *self.tok.encode(PROMPT)]))

    async def step(self, generated_ids: Sequence[int]) -> StepResult:
        if self.secret is None:
            raise RuntimeError("GuessDigitEnv.step called before reset")
        self.turn += 1
        await asyncio.sleep(self.latency_s)  # the tool call
        text = self.tok.decode([i for i in generated_ids if i < 256])
        guess = next((int(c) for c in text if c in "0123456789"), None)
        if guess == self.secret:
            return StepResult((), 1.0 - (self.turn - 1) / self.max_turns, True)
        if self.turn >= self.max_turns:
            return StepResult((), 0.0, True)
        reply = "no digit" if guess is None else ("higher" if guess < self.secret else "lower")
        return StepResult(tuple(self.tok.encode(f"\n{reply}\n")), 0.0, False)
