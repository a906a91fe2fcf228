"""A two-turn tool task the tiny byte model learns on CPU and cannot game: call, then copy.

Turn 1 is the tool call: whatever the model writes is sent to a lookup tool, which answers after
`await asyncio.sleep(latency_s)` with a code drawn from the episode's seed (`"\\ncode 7"`); an
empty call (only special tokens) gets `"\\nno call"` and no code. Turn 2 is the
answer. Reward (in [0, 1]) is the share of answer bytes equal to the code's digits, position i
graded against digit c = `code[i % len(code)]`: 1 for c itself, 1/2 for a byte of c's residue
class (value - ord("0") = c mod 10, 26 bytes each), 0 otherwise, so the best answer is the code repeated.

Why it cannot be gamed: the code is uniform over `10 ** code_len` values and appears nowhere but in
the tool's reply, so a policy that ignores the reply scores at most 1/10 in expectation (always
writing one digit); a uniform random policy scores about 0.05. A reward above 0.1 therefore means
the policy reads what the environment returned. Why it is learnable from a random init: the
reply ends with the code, so the first answer byte is a copy of the last input token (the
embedding -> unembedding path, no attention needed) and later bytes copy their predecessor; the
half credit for the residue class gives GRPO a signal in most groups from the first step (a
random byte earns something 1 time in 10; the exact digit alone only 1 in 260). Left out: several tool calls per
episode, tools whose answer depends on the call's content, and free-form answer parsing.
"""
from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

from rl.envs.base import Env, Observation, StepResult

PROMPT = "Look up the code.\n"


def code_match(answer_ids: Sequence[int], code: str) -> float:
    """Mean credit of the answer's bytes (special tokens dropped; 0 if none): byte i graded against
    digit c = code[i % len(code)] earns 1 if it is c, 1/2 if it is in c's residue class (byte value
    - ord("0") = c mod 10, e.g. "A" for 7), else 0."""
    answer = [i for i in answer_ids if 0 <= i < 256]
    if not answer:
        return 0.0
    want = code.encode("ascii")
    score = 0.0
    for i, b in enumerate(answer):
        c = want[i % len(want)]
        score += 1.0 if b == c else 0.5 if (b - c) % 10 == 0 else 0.0
    return score / len(answer)


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
            reply = f"\ncode {self.code}" if called else "\nno call"
            return StepResult(tuple(self.tok.encode(reply)), 0.0, False)
        return StepResult((), code_match(generated_ids, self.code), True)
