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

`verify` decides one row on the host. `verify_lookup` decides every sampled row of a step whose
drafts have no law (one-hot q: n-gram lookup), and every sampled row without drafts, on the logits'
device with one host read: per row, its acceptance tests and its last draw come from k + 1 uniforms
of its own generator (a row without drafts draws exactly as the plain sampler does). Which rows
draft, and the KV positions of rejected drafts (written by the verifying forward, then simply
overwritten), are the engine's.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_rollout.engine.api import SamplingParams
from megatron_rollout.engine.sampler import by_law, filtered_logprobs, inverse_cdf, non_finite
from megatron_rollout.kernels.layout import to_device


@dataclass(frozen=True)
class Verdict:
    """One row's outcome: `accepted` drafts kept, then one target token; `tokens` are all of them."""

    accepted: int
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    """The target's logprob of each emitted token under its sampling distribution."""
    error: str | None = None
    """Why the row has no tokens (`verify_lookup`: one of its logits rows was not finite)."""


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


@dataclass(frozen=True)
class LookupRow:
    """One sampled row for `verify_lookup`: its k drafts (one-hot q, maybe none) and the k + 1 rows of
    the step's logits that score them, from `start`."""

    start: int
    drafts: tuple[int, ...]
    params: SamplingParams
    generator: torch.Generator | None


CPU_PASS_BYTES = 1 << 21
"""On the CPU, `verify_lookup` decides rows in passes of about this many bytes of fp32 logits: rows
that stay in cache go faster than one pass through memory, and a pass costs no device wait there."""


def verify_lookup(logits: torch.Tensor, rows: Sequence[LookupRow]) -> list[Verdict]:
    """`verify`'s rule for sampled rows with one-hot drafts, every row at once: draft i is kept with
    probability p_i(x_i); at the first rejection the token is drawn from p_i without x_i, after k kept
    drafts from p_k. logits: [positions, V]; one verdict per row, in order, a row with a non-finite
    logits row failing alone (`Verdict.error`, the plain sampler's reason). On a GPU one pass and one
    host read decide them all; on the CPU, passes of `CPU_PASS_BYTES` (the same draws)."""
    if any(r.params.temperature == 0.0 for r in rows):
        raise ValueError("verify_lookup decides sampled rows; a greedy row keeps the drafts equal to its argmax")
    if logits.is_cuda:
        return _verify_pass(logits, rows)
    out: list[Verdict] = []
    per_position = 4 * logits.shape[-1]
    while len(out) < len(rows):
        take, positions = 0, 0
        for r in rows[len(out):]:
            positions += len(r.drafts) + 1
            if take and positions * per_position > CPU_PASS_BYTES:
                break
            take += 1
        out += _verify_pass(logits, rows[len(out):len(out) + take])
    return out


def _verify_pass(logits: torch.Tensor, rows: Sequence[LookupRow]) -> list[Verdict]:
    if not rows:
        return []
    device, n, k = logits.device, len(rows), max(len(r.drafts) for r in rows)
    sizes = [len(r.drafts) + 1 for r in rows]
    starts = list(itertools.accumulate(sizes[:-1], initial=0))  # each row's first position in logp
    logp = _filtered(logits, rows, sizes, starts)  # [sum(sizes), V], each row's positions in turn
    # a [rows, k + 1] grid of each row's positions (into logp), padded with its last one (never a draft
    # there), with its drafts and which are drafts: one copy to the device, the uniforms another
    grid, ids, is_draft = to_device(torch.tensor([
        [[s + min(j, size - 1) for j in range(k + 1)] for s, size in zip(starts, sizes)],
        [[*r.drafts, *[0] * (k + 1 - len(r.drafts))] for r in rows],
        [[int(j < len(r.drafts)) for j in range(k + 1)] for r in rows]]), device)
    is_draft = is_draft.bool()
    # each row's k + 1 uniforms: its tests (1 where it has no draft: never kept), then its last draw
    u = to_device(torch.stack([torch.cat([x[:-1], x.new_ones(k + 1 - len(x[:-1])), x[-1:]]) for x in (
        torch.rand(size, generator=r.generator) for r, size in zip(rows, sizes))]), device)
    u_test, u_last = u[:, :-1], u[:, -1]
    draft_lp = logp[grid, ids]  # [rows, k + 1]; NaN at a position whose logits were not finite (its whole row is)
    accepted = (is_draft & (u_test < draft_lp.exp())).long().cumprod(-1).sum(-1)  # kept before the first rejection
    # the law of each row's last token [rows, V], less a rejected draft: p_i(x_i) < 1 then, so mass is
    # left (a draft holding all of it is always kept: u < 1)
    if k:
        last = logp.index_select(0, grid.gather(-1, accepted[:, None])[:, 0])
        banned, rejected = ids.gather(-1, accepted[:, None]), is_draft.gather(-1, accepted[:, None])
        last.scatter_(-1, banned, last.gather(-1, banned).masked_fill_(rejected, float("-inf")))
    else:  # no row drafted: each row's one position, the plain sampler's draw
        last = logp
    token = inverse_cdf(last, u_last)  # the token's logprob is p's: only the banned id was masked
    host = torch.cat([accepted.double(), token.double(), last.gather(-1, token[:, None])[:, 0].double(),
                      draft_lp.double().flatten()]).tolist()
    out = []
    for i, (r, size) in enumerate(zip(rows, sizes)):
        a, kept = int(host[i]), 3 * n + i * (k + 1)
        bad = next((j for j in range(size) if math.isnan(host[kept + j])), None)
        if bad is not None:  # the plain sampler's reason, from that position's largest logit (read once more)
            out.append(Verdict(0, (), (), non_finite(float(logits[r.start + bad].float().amax())).error))
            continue
        out.append(Verdict(a, (*r.drafts[:a], int(host[n + i])), (*host[kept:kept + a], host[2 * n + i])))
    return out


def _filtered(logits: torch.Tensor, rows: Sequence[LookupRow], sizes: list[int], starts: list[int]) -> torch.Tensor:
    """`filtered_logprobs` of each row's `size` positions from its `start`, placed from its `starts`
    entry on, rows of one law (`sampler.by_law`) filtered together."""
    groups = by_law([r.params for r in rows])
    if len(groups) == 1:
        return filtered_logprobs(_select(logits, [i for r, n in zip(rows, sizes) for i in range(r.start, r.start + n)]),
                                 rows[0].params)
    out = torch.empty(sum(sizes), logits.shape[-1], dtype=torch.float32, device=logits.device)
    for members in groups:
        mine = [starts[m] + j for m in members for j in range(sizes[m])]
        source = [rows[m].start + j for m in members for j in range(sizes[m])]
        out[to_device(torch.tensor(mine), logits.device)] = filtered_logprobs(_select(logits, source),
                                                                              rows[members[0]].params)
    return out


def _select(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows]: a view where `rows` run in order without a gap (a step whose rows all sample, a
    CPU pass of one row), else a copy."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return logits.narrow(0, rows[0], len(rows))
    return logits.index_select(0, to_device(torch.tensor(rows, dtype=torch.long), logits.device))


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
