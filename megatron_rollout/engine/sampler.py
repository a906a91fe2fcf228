"""Token sampling with log-probabilities.

The log-probability reported for a token is the fp32 log-probability under the distribution it
was drawn from: the raw logits' softmax at temperature 0 (greedy) and 1; the temperature-scaled,
top-k/top-p-filtered softmax otherwise. That is what an RL trainer's importance ratio needs.
A request with a seed draws from its own generator, so its tokens do not depend on which other
requests share the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rollout.engine.api import SamplingParams


@dataclass(frozen=True)
class Sampled:
    token: int
    logprob: float


def filtered_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [V] -> fp32 log-probabilities of the sampling distribution (-inf where filtered)."""
    x = logits.float()
    if params.temperature not in (0.0, 1.0):
        x = x / params.temperature
    if params.top_k and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = sorted_x.softmax(-1)
        # keep tokens whose preceding mass is below top_p (the first token is always kept)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        x = x.scatter(0, idx, sorted_x.masked_fill(drop, float("-inf")))
    return x.log_softmax(-1)


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Sampled:
    if params.temperature == 0.0:
        logp = logits.float().log_softmax(-1)
        token = int(torch.argmax(logp))
        return Sampled(token, float(logp[token]))
    logp = filtered_logprobs(logits, params)
    token = int(torch.multinomial(logp.exp().cpu(), 1, generator=generator))
    return Sampled(token, float(logp[token]))


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[Sampled]:
    """logits: [rows, V]; one params and generator per row."""
    if logits.shape[0] == 0:
        return []
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    out: list[Sampled | None] = [None] * len(params)
    if greedy:
        logp = logits[greedy].float().log_softmax(-1)
        tokens = logp.argmax(-1)
        lps = logp.gather(-1, tokens[:, None]).squeeze(-1)
        for i, t, lp in zip(greedy, tokens.tolist(), lps.tolist()):
            out[i] = Sampled(t, lp)
    for i, p in enumerate(params):
        if out[i] is None:
            out[i] = sample_row(logits[i], p, generators[i])
    return out  # type: ignore[return-value]
