"""Verifying drafted tokens against the target model: speculative (rejection) sampling.

A drafter (DeepSeek-V3's MTP layers, for one) proposes k tokens after a row's last token, each
drawn from its own distribution q_i; one target forward over the last token and the k drafts gives
the target's distributions p_0..p_k. `verify` then keeps the longest prefix of drafts the target
accepts and adds one token of its own, so every forward yields between 1 and k+1 tokens whose
distribution is *exactly* the target's (Leviathan et al. 2023, Chen et al. 2023):
- draft i is accepted with probability min(1, p_i(x) / q_i(x));
- at the first rejection the token is drawn from the residual norm(max(0, p_i - q_i));
- when all k are accepted a bonus token is drawn from p_k.
At temperature 0 this is greedy: drafts are kept while each equals the target's argmax, and the
token after them is the target's argmax, so the tokens are those of plain greedy decoding.

p_i is the distribution the plain sampler draws from (`sampler.filtered_logprobs`: temperature,
top-k, top-p), and the logprob reported for each emitted token is the target's under it, as the
plain sampler reports: what an RL trainer's importance ratio needs, whatever the drafter proposed.
A drafter that proposes greedily has one-hot q (`draft_logprobs=None`).

This module is the decision on tensors of one row; which rows draft, and the KV positions of
rejected drafts (written by the verifying forward, then simply overwritten), are the engine's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rollout.engine.api import SamplingParams
from megatron_rollout.engine.sampler import filtered_logprobs


@dataclass(frozen=True)
class Verdict:
    """One row's outcome: `accepted` drafts kept, then one target token; `tokens` are all of them."""

    accepted: int
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    """The target's logprob of each emitted token under its sampling distribution."""


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand(1, generator=generator))


def draw_index(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Inverse-CDF draw from `probs` [V] (not necessarily normalised) with one host uniform."""
    cdf = probs.double().cumsum(0)
    index = int(torch.searchsorted(cdf, _uniform(generator) * cdf[-1], right=True))
    last = int(torch.searchsorted(cdf, cdf[-1], right=False))  # never past the last token with mass
    return min(index, last)


def verify(target_logits: torch.Tensor, drafts: list[int], draft_logprobs: torch.Tensor | None,
           params: SamplingParams, generator: torch.Generator | None = None) -> Verdict:
    """target_logits: [k+1, V], row i the target's logits after drafts[:i]; drafts: k tokens;
    draft_logprobs: [k, V] the drafter's log q_i (None: greedy drafts, q_i one-hot)."""
    k = len(drafts)
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows for {k} drafts; expected {k + 1}")
    if draft_logprobs is not None and draft_logprobs.shape[0] != k:
        raise ValueError(f"draft_logprobs has {draft_logprobs.shape[0]} rows for {k} drafts")
    greedy = params.temperature == 0.0
    logp = target_logits.float().log_softmax(-1) if greedy else filtered_logprobs(target_logits, params)
    tokens: list[int] = []
    for i, x in enumerate(drafts):
        if greedy:
            keep = int(logp[i].argmax()) == x
        else:
            q = 1.0 if draft_logprobs is None else float(draft_logprobs[i, x].exp())
            keep = _uniform(generator) * q < float(logp[i, x].exp())  # u < p/q, without dividing by q = 0
        if not keep:
            tokens.append(int(logp[i].argmax()) if greedy else draw_index(_residual(logp[i], draft_logprobs, i, x),
                                                                       generator))
            return _verdict(i, tokens, logp)
        tokens.append(x)
    tokens.append(int(logp[k].argmax()) if greedy else draw_index(logp[k].exp(), generator))
    return _verdict(k, tokens, logp)


def _residual(logp: torch.Tensor, draft_logprobs: torch.Tensor | None, i: int, rejected: int) -> torch.Tensor:
    """max(0, p - q) for the rejected position (unnormalised)."""
    p = logp.double().exp()
    if draft_logprobs is None:  # one-hot q at the rejected draft
        residual = p.index_fill(0, torch.tensor([rejected], device=p.device), 0.0)
    else:
        residual = (p - draft_logprobs[i].double().exp()).clamp_(min=0.0)
    # no mass left only when p <= q everywhere up to rounding, where a rejection has probability ~0
    return residual if float(residual.sum()) > 0 else p


def _verdict(accepted: int, tokens: list[int], logp: torch.Tensor) -> Verdict:
    lps = tuple(float(logp[i, t]) for i, t in enumerate(tokens))
    return Verdict(accepted, tuple(tokens), lps)
