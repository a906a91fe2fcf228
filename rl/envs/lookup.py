"""A two-turn tool task the tiny byte model learns on CPU and cannot game: call, then copy.

Turn 1 is the tool call: whatever the model writes is sent to a lookup tool, which answers after
`await asyncio.sleep(latency_s)` with a code drawn from the episode's seed (`"\\ncode 7\\nanswer: "`);
an empty call (only special tokens) gets `"\\nno call\\nanswer: "` and no code. Turn 2 is the
answer. Reward (in [0, 1]) is the share of answer bytes equal to the code's digits, position i
graded against `code[i % len(code)]`, so the right answer is the code, repeated.

Why it cannot be gamed: the code is uniform over `10 ** code_len` values and appears nowhere but in
the tool's reply, so a policy that ignores the reply scores at most 1/10 in expectation (always
writing one digit); a random policy scores about 1/260 per byte. A reward above 0.1 therefore
means the policy reads what the environment returned. Why it is learnable from a random init:
copying a digit from the context into the output is one attention pattern, and the dense
per-byte grading gives GRPO a signal in most groups early on. Left out: several tool calls per
episode, tools whose answer depends on the call's content, and free-form answer parsing.
"""
from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

from rl.envs.base import Env, Observation, StepResult

PROMPT = "Call the tool, then answer with its code.\n"


def code_match(answer_ids: Sequence[int], code: str) -> float:
    """Share of the answer's bytes (special tokens dropped) with byte i equal to code[i % len(code)]; 0 if empty."""
    answer = [i for i in answer_ids if 0 <= i < 256]
    if not answer:
        return 0.0
    want = code.encode("ascii")
    return sum(b == want[i % len(want)] for i, b in enumerate(answer)) / len(answer)


class LookupEnv(Env):
    """One episode: prompt -> call -> tool reply (the code) -> answer -> reward."""

    TURNS = 2

    def __init__(self, tokenizer: Any, latency_s: float = 0.01, code_len: int = 1) -> None:
        if code_len < 1:
            raise ValueError(f"code_len must be >= 1, got {code_len}")
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s}")
        self.tok, self.latency_s, self.code_len = tokenizer, latency_s, code_len
        self.code: str | None = None
        self.turn = 0

    async def reset(self, seed: int) -> Observation:
        rng = random.Random(seed)
        self.code = "".join(rng.choice("0123456789") for _ in range(self.code_len))
        self.turn = 0
        return Observation(tuple([self.tok.bos_id, *self.tok.encode(PROMPT)]))

    async def step(self, generated_ids: Sequence[int]) -> StepResult:
        if self.code is None:
            raise RuntimeError("LookupEnv.step called before reset")
        self.turn += 1
        if self.turn == 1:  # the tool call
            await asyncio.sleep(self.latency_s)
            called = any(0 <= i < 256 for i in generated_ids)
            reply = f"\ncode {self.code}\n" if called else "\nno call\n"
            return StepResult(tuple(self.tok.encode(reply)), 0.0, False)
        return StepResult((), code_match(generated_ids, self.code), True)
