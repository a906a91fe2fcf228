"""Synthetic agentic traces shaped like the paper's workload (AInfer-PD §7, DESIGN.md §9).

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

Left out: the paper's real per-request joint distribution (e.g. long outputs before long tool
answers) and any model limit: a deep conversation can exceed a small model's context, and the
engine then refuses that turn (replay counts it as failed).
"""
from __future__ import annotations

import math

import numpy as np

from megatron_rollout.trace.schema import TraceRequest, write_trace

__all__ = ["make_trace", "write_trace", "TARGET_TURNS", "TARGET_INPUT_TOKENS", "TARGET_OUTPUT_TOKENS"]

TARGET_TURNS = 1265 / 128
"""Mean turns per conversation in the paper's trace (9.88)."""
TARGET_INPUT_TOKENS = 6_574_104 / 1265
"""Mean new input tokens per request (5,197)."""
TARGET_OUTPUT_TOKENS = 220_862 / 1265
"""Mean output tokens per request (174.6)."""

FIRST_TURN_RATIO = 2.0
"""Mean input of turn 0 (system prompt + task) over the mean input of a later turn."""
MAX_TURNS = 64
MAX_INPUT_TOKENS = 65_536
MAX_OUTPUT_TOKENS = 4_096
FIRST_INPUT_SIGMA = 0.5  # system prompts are alike; tasks vary
LATER_INPUT_SIGMA = 1.0  # tool answers range from a status line to a whole file
OUTPUT_SIGMA = 0.9
WAIT_MEAN_MS = 1_500.0
WAIT_SIGMA = 1.0
MAX_WAIT_MS = 60_000.0


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


# Turn 0's mean is FIRST_TURN_RATIO x a later turn's, and the per-request mean over all turns
# is TARGET_INPUT_TOKENS: (ratio * L + (T - 1) * L) / T = target, T = mean turns.
_TURNS_P = _geometric_p(TARGET_TURNS, MAX_TURNS)
_LATER_INPUT_MEAN = TARGET_INPUT_TOKENS * TARGET_TURNS / (FIRST_TURN_RATIO + TARGET_TURNS - 1)
_FIRST_INPUT_MU = _lognormal_mu(FIRST_TURN_RATIO * _LATER_INPUT_MEAN, FIRST_INPUT_SIGMA, MAX_INPUT_TOKENS)
_LATER_INPUT_MU = _lognormal_mu(_LATER_INPUT_MEAN, LATER_INPUT_SIGMA, MAX_INPUT_TOKENS)
_OUTPUT_MU = _lognormal_mu(TARGET_OUTPUT_TOKENS, OUTPUT_SIGMA, MAX_OUTPUT_TOKENS)
_WAIT_MU = _lognormal_mu(WAIT_MEAN_MS, WAIT_SIGMA, MAX_WAIT_MS)


def _tokens(raw: np.ndarray, cap: int, scale: float) -> list[int]:
    return [max(1, round(scale * x)) for x in np.minimum(raw, cap).tolist()]


def make_trace(conversations: int = 128, seed: int = 0, scale: float = 1.0,
               wait_scale: float | None = None) -> list[TraceRequest]:
    """A synthetic agentic trace: `conversations` trajectories, conversation-major order.

    Args:
        conversations: number of trajectories (ids 0..conversations-1).
        seed: the same seed gives the same trace.
        scale: multiplies token counts (rounded, at least 1): 0.01 gives a CPU-sized trace.
        wait_scale: multiplies tool waits; None means "same as scale".
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

    requests: list[TraceRequest] = []
    for conv in range(conversations):
        rng = np.random.default_rng([seed, conv])
        turns = min(int(rng.geometric(_TURNS_P)), MAX_TURNS)
        first = rng.lognormal(_FIRST_INPUT_MU, FIRST_INPUT_SIGMA, size=1)
        later = rng.lognormal(_LATER_INPUT_MU, LATER_INPUT_SIGMA, size=turns - 1)
        inputs = _tokens(np.concatenate([first, later]), MAX_INPUT_TOKENS, scale)
        outputs = _tokens(rng.lognormal(_OUTPUT_MU, OUTPUT_SIGMA, size=turns), MAX_OUTPUT_TOKENS, scale)
        waits = np.minimum(rng.lognormal(_WAIT_MU, WAIT_SIGMA, size=turns), MAX_WAIT_MS) * wait_scale
        for turn in range(turns):
            wait_ms = 0.0 if turn == 0 else round(float(waits[turn]), 3)
            requests.append(TraceRequest(conv, turn, inputs[turn], outputs[turn], wait_ms))
    return requests
