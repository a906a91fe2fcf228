"""Synthetic agentic traces shaped like the paper's workload (AInfer-PD §7, docs/design.md §9).

The paper replays 1,265 requests from 128 conversations that consume 6,574,104 input and 220,862
output tokens: 9.88 turns per conversation, 5,197 input and 174.6 output tokens per request
(about 30:1). We cannot ship that trace, so `make_trace` draws one with the same averages and
heavy tails:

- turns per conversation: geometric (many short trajectories, a long tail), capped at 64;
- input tokens (new tokens of the turn): turn 0 carries the system prompt and the task and is on
  average `FIRST_TURN_RATIO` times a later turn; later turns are tool answers, lognormal with a
  wide spread (a short status line or a whole file); capped at 64k tokens;
- output tokens: lognormal, capped at 4,096;
- wait_ms: 0 before turn 0 (every trajectory starts with the rollout); before later turns, tool
  time drawn lognormal (median about 0.9 s, mean 1.5 s), capped at 60 s.

Each distribution's location is solved from its target mean *after* the cap, so the averages hold
by construction (tests check them over many seeds). Conversation i is drawn from its own generator
seeded by (seed, i): the same seed gives the same trace, and a trace of 256 conversations starts
with the trace of 128.

`scale` multiplies token counts (then rounds, keeping at least 1 token), so `scale=0.01` gives a
CPU-sized trace of ~52 input and ~2 output tokens per request. Tool waits are multiplied by
`wait_scale`, which defaults to `scale`: shrinking the work but not the waits would turn a
P/D-interference benchmark into a tool-latency benchmark. Pass `wait_scale=1.0` to keep real waits.

Profiles (`PROFILES`, `make_trace(..., profile=...)`, `--profile` of the benchmark). In every
profile a trace line's `input_tokens` keeps the schema's meaning, the *new* tokens of the turn
(history is never repeated), and the token counts below are per request before `scale`:

- `current`: the distributions above, the paper's averages (5,197 new input and 174.6 output
  tokens per request, 9.88 turns, 1.5 s mean tool time). Deep conversations grow past 40k tokens
  and are bound by their chain of turns and tool waits.
- `prefill`: prefill-intensive, shaped like the paper's requests: the same 5,197 *new* input and
  174.6 output tokens per request (30:1, computed prefill against decode, not counting cache
  hits), but short trajectories (geometric turns, mean 3, at most 8) with short tool waits (mean
  0.3 s), turn 0 no larger than a later turn, inputs capped at 16,384 and outputs at 1,024 tokens.
  The GPU's work, not one conversation's chain, then bounds the makespan, which is where P/D
  scheduling matters. We chose "new tokens of the turn" over "whole prompt including history"
  because with the paper's 9.88 heavy-tailed turns the whole-prompt reading leaves ~340 new
  tokens per later turn: a decode-bound trace under prefix caching, the opposite of the intent.
  The cost: contexts reach ~3 x 5.4k tokens on average and, in the tail, more than the preset's
  40,960 positions; random-weight runs raise the model length to cover the trace (RoPE is
  computed from positions, so no table limits it; `bench.rollout --max-model-len auto`).
- `decode`: the decode-heavy control: 256 new input and 768 output tokens per request (1:3),
  the same short trajectories and waits as `prefill`.

`input_ids` draws the token ids of one turn from (seed, conversation index, turn); the replay and
the vLLM peer both use it, so a trace gets the same ids in every engine and schedule.

Left out: the paper's real per-request joint distribution (e.g. long outputs before long tool
answers) and any model limit: a deep conversation can exceed a small model's context, and the
engine then refuses that turn (replay counts it as failed).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_rollout.trace.schema import MAX_TOKENS, ConversationId, TraceRequest, group_conversations, write_trace
from megatron_rollout.trace.schema import MAX_WAIT_MS as TRACE_MAX_WAIT_MS

__all__ = ["make_trace", "write_trace", "input_ids", "conversation_inputs", "max_context", "Profile", "PROFILES",
           "TARGET_TURNS", "TARGET_INPUT_TOKENS", "TARGET_OUTPUT_TOKENS"]

TARGET_TURNS = 1265 / 128
"""Mean turns per conversation in the paper's trace (9.88)."""
TARGET_INPUT_TOKENS = 6_574_104 / 1265
"""Mean new input tokens per request (5,197)."""
TARGET_OUTPUT_TOKENS = 220_862 / 1265
"""Mean output tokens per request (174.6)."""


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _capped_lognormal_mean(mu: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for X = exp(mu + sigma * Z), Z standard normal."""
    z = (math.log(cap) - mu) / sigma
    return math.exp(mu + sigma * sigma / 2) * _normal_cdf(z - sigma) + cap * (1.0 - _normal_cdf(z))


def _bisect(f, lo: float, hi: float, target: float) -> float:
    """x in [lo, hi] with f(x) = target, for f increasing."""
    for _ in range(200):
        mid = (lo + hi) / 2
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _lognormal_mu(mean: float, sigma: float, cap: float) -> float:
    """mu such that min(lognormal(mu, sigma), cap) has the given mean."""
    if not 0 < mean < cap:
        raise ValueError(f"target mean {mean} must lie in (0, cap={cap})")
    return _bisect(lambda mu: _capped_lognormal_mean(mu, sigma, cap), -50.0, math.log(cap) + 50.0, mean)


def _geometric_p(mean: float, cap: int) -> float:
    """p such that min(Geometric(p), cap) (support 1, 2, ...) has the given mean.

    E[min(G, cap)] = sum_{k<cap} P(G > k) = (1 - (1-p)^cap) / p, decreasing in p."""
    return _bisect(lambda p: -(1.0 - (1.0 - p) ** cap) / p, 1e-9, 1.0, -mean)


FIRST_TURN_RATIO = 2.0
"""Mean input of turn 0 (system prompt + task) over the mean input of a later turn (`current`)."""
MAX_TURNS = 64
MAX_INPUT_TOKENS = 65_536
MAX_OUTPUT_TOKENS = 4_096
FIRST_INPUT_SIGMA = 0.5  # system prompts are alike; tasks vary
LATER_INPUT_SIGMA = 1.0  # tool answers range from a status line to a whole file
OUTPUT_SIGMA = 0.9
WAIT_MEAN_MS = 1_500.0
WAIT_SIGMA = 1.0
MAX_WAIT_MS = 60_000.0


@dataclass(frozen=True)
class Profile:
    """The distributions of one kind of trace (token counts per request, before `scale`)."""

    turns_mean: float
    """Mean turns per conversation (geometric, capped at `max_turns`)."""
    max_turns: int
    input_mean: float
    """Mean new input tokens per request, over all turns."""
    first_turn_ratio: float
    """Mean input of turn 0 over the mean input of a later turn."""
    max_input: int
    output_mean: float
    """Mean output tokens per request."""
    max_output: int
    wait_mean_ms: float
    """Mean tool time before a later turn."""
    first_sigma: float = FIRST_INPUT_SIGMA
    later_sigma: float = LATER_INPUT_SIGMA
    output_sigma: float = OUTPUT_SIGMA
    wait_sigma: float = WAIT_SIGMA
    max_wait_ms: float = MAX_WAIT_MS

    def __post_init__(self) -> None:
        if not 1.0 <= self.turns_mean < self.max_turns:
            raise ValueError(f"turns_mean must lie in [1, max_turns={self.max_turns}), got {self.turns_mean}")
        for name in ("input_mean", "output_mean", "wait_mean_ms", "first_turn_ratio"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Profile.{name} must be positive, got {getattr(self, name)}")


PROFILES: dict[str, Profile] = {
    "current": Profile(TARGET_TURNS, MAX_TURNS, TARGET_INPUT_TOKENS, FIRST_TURN_RATIO, MAX_INPUT_TOKENS,
                       TARGET_OUTPUT_TOKENS, MAX_OUTPUT_TOKENS, WAIT_MEAN_MS),
    "prefill": Profile(3.0, 8, TARGET_INPUT_TOKENS, 1.0, 16_384, TARGET_OUTPUT_TOKENS, 1_024, 300.0),
    "decode": Profile(3.0, 8, 256.0, 2.0, 4_096, 768.0, 4_096, 300.0),
}
"""The trace profiles (see the module docstring)."""


@dataclass(frozen=True)
class _Solved:
    """Distribution parameters solved from a profile's means (after the caps)."""

    turns_p: float
    first_mu: float
    later_mu: float
    output_mu: float
    wait_mu: float


@functools.lru_cache(maxsize=None)
def _solve(profile: Profile) -> _Solved:
    # Turn 0's mean is first_turn_ratio x a later turn's, and the per-request mean over all turns
    # is input_mean: (ratio * L + (T - 1) * L) / T = input_mean, T = mean turns.
    t = profile.turns_mean
    later_mean = profile.input_mean * t / (profile.first_turn_ratio + t - 1)
    return _Solved(
        turns_p=_geometric_p(t, profile.max_turns),
        first_mu=_lognormal_mu(profile.first_turn_ratio * later_mean, profile.first_sigma, profile.max_input),
        later_mu=_lognormal_mu(later_mean, profile.later_sigma, profile.max_input),
        output_mu=_lognormal_mu(profile.output_mean, profile.output_sigma, profile.max_output),
        wait_mu=_lognormal_mu(profile.wait_mean_ms, profile.wait_sigma, profile.max_wait_ms))


def _tokens(raw: np.ndarray, cap: int, scale: float) -> list[int]:
    return [max(1, round(scale * x)) for x in np.minimum(raw, cap).tolist()]


def make_trace(conversations: int = 128, seed: int = 0, scale: float = 1.0,
               wait_scale: float | None = None, profile: str | Profile = "current") -> list[TraceRequest]:
    """A synthetic agentic trace: `conversations` trajectories, conversation-major order.

    Args:
        conversations: number of trajectories (ids 0..conversations-1).
        seed: the same seed gives the same trace.
        scale: multiplies token counts (rounded, at least 1): 0.01 gives a CPU-sized trace.
        wait_scale: multiplies tool waits; None means "same as scale".
        profile: a name in `PROFILES` (current | prefill | decode) or a `Profile`.
    """
    if conversations <= 0:
        raise ValueError(f"conversations must be positive, got {conversations}")
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a positive number, got {scale}")
    wait_scale = scale if wait_scale is None else wait_scale
    if not (wait_scale >= 0 and math.isfinite(wait_scale)):
        raise ValueError(f"wait_scale must be a number >= 0, got {wait_scale}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if isinstance(profile, str):
        if profile not in PROFILES:
            raise ValueError(f"unknown trace profile {profile!r}; choose one of {sorted(PROFILES)}")
        profile = PROFILES[profile]
    longest = max(profile.max_input, profile.max_output)
    if scale * longest > MAX_TOKENS:
        raise ValueError(f"scale {scale} would make requests of up to {scale * longest:.3g} tokens, above a trace's "
                         f"limit of {MAX_TOKENS}: use a scale of at most {MAX_TOKENS / longest:g}")
    if wait_scale * profile.max_wait_ms > TRACE_MAX_WAIT_MS:
        raise ValueError(f"wait_scale {wait_scale} would make tool waits of up to "
                         f"{wait_scale * profile.max_wait_ms:.3g} ms, above a trace's limit of {TRACE_MAX_WAIT_MS:g} "
                         f"ms: use a wait_scale of at most {TRACE_MAX_WAIT_MS / profile.max_wait_ms:g}")
    solved = _solve(profile)

    requests: list[TraceRequest] = []
    for conv in range(conversations):
        rng = np.random.default_rng([seed, conv])
        turns = min(int(rng.geometric(solved.turns_p)), profile.max_turns)
        first = rng.lognormal(solved.first_mu, profile.first_sigma, size=1)
        later = rng.lognormal(solved.later_mu, profile.later_sigma, size=turns - 1)
        inputs = _tokens(np.concatenate([first, later]), profile.max_input, scale)
        outputs = _tokens(rng.lognormal(solved.output_mu, profile.output_sigma, size=turns), profile.max_output, scale)
        waits = np.minimum(rng.lognormal(solved.wait_mu, profile.wait_sigma, size=turns), profile.max_wait_ms)
        waits = waits * wait_scale
        for turn in range(turns):
            wait_ms = 0.0 if turn == 0 else round(float(waits[turn]), 3)
            requests.append(TraceRequest(conv, turn, inputs[turn], outputs[turn], wait_ms))
    return requests


def input_ids(seed: int, conversation_index: int, turn: int, count: int, vocab_size: int) -> list[int]:
    """The `count` new token ids of `turn` of the `conversation_index`-th conversation (in the
    trace's order of first appearance), drawn from [0, vocab_size): the same in every engine."""
    rng = np.random.default_rng([seed, conversation_index, turn])
    return rng.integers(0, vocab_size, size=count).tolist()


def conversation_inputs(requests: Sequence[TraceRequest], seed: int,
                        vocab_size: int) -> dict[ConversationId, list[list[int]]]:
    """Every conversation's new token ids, turn by turn (`input_ids` for each line)."""
    out: dict[ConversationId, list[list[int]]] = {}
    for index, (key, turns) in enumerate(group_conversations(requests).items()):
        out[key] = [input_ids(seed, index, t.turn, t.input_tokens, vocab_size) for t in turns]
    return out


def max_context(requests: Sequence[TraceRequest]) -> int:
    """The longest context any conversation of the trace reaches (all its inputs and outputs)."""
    return max((sum(t.input_tokens + t.output_tokens for t in turns)
                for turns in group_conversations(requests).values()), default=0)
