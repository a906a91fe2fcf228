"""One sequence decoded with MTP drafting and same-forward verification: the reference loop.

Each iteration is one target forward over the last token and one MTP draft (positions n, n+1),
`speculative.verify` on its two rows, and one MTP-layer forward over the positions just confirmed,
which also drafts the next token. So an iteration emits one or two tokens whose distribution is
the target's, and the logprobs are the target's. KV of a rejected draft is not rolled back: the
next forward starts at the first unconfirmed position and overwrites it.

This is the algorithm the engine's decode iteration runs per row (`engine.drafting`, batched,
inside every schedule), kept as the plain one-sequence reference the engine is tested against.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_rollout.engine.api import SamplingParams
from megatron_rollout.engine.sampler import filtered_logprobs, sample_row
from megatron_rollout.engine.speculative import verify
from megatron_rollout.forward import run_to_end
from megatron_rollout.kv.paged import PagedBatch, PagedKVCache, SeqSpan
from megatron_rollout.model.rope import rope_for
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.types import Axis, Phase


@dataclass(frozen=True)
class MTPGeneration:
    token_ids: list[int]
    logprobs: list[float]
    """The target model's logprob of each token under its sampling distribution."""
    drafted: int
    accepted: int

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class _Sequence:
    """One sequence's paged KV (decoder layers, then the MTP layer) and its two forwards."""

    def __init__(self, model: MoETransformer, length: int, block_size: int) -> None:
        cfg = model.cfg
        blocks = math.ceil(length / block_size)
        kv_heads = max(1, cfg.num_query_groups // model.comm.size(Axis.ATP))
        self.model, self.table = model, tuple(range(blocks))
        self.cache = PagedKVCache(cfg, blocks, block_size, kv_heads, device=model.device)

    def _batch(self, past: int, new: int) -> PagedBatch:
        return PagedBatch(self.cache, [SeqSpan(self.table, past, new)])

    def target(self, tokens: list[int], past: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [n, H] and logits [n, V] of `tokens` at positions past.."""
        batch = self._batch(past, len(tokens))
        ids = torch.tensor(tokens, device=self.model.device)
        h = run_to_end(self.model.hidden_step(ids, batch.positions, batch, Phase.D))
        return h, self.model.logits(h)

    def draft_logits(self, hidden: torch.Tensor, next_tokens: list[int], past: int) -> torch.Tensor:
        """MTP layer 0 over positions past..: hidden h_i and token t_{i+1}; logits [V] for the token
        after the last of `next_tokens`."""
        model, mtp = self.model, self.model.mtp.layers[0]
        batch = self._batch(past, len(next_tokens))
        embedded = model.embedding.word_embeddings(torch.tensor(next_tokens, device=model.device))
        rope = rope_for(model.cfg, batch.positions, hidden.dtype)
        x = run_to_end(mtp(embedded, hidden, rope, batch, model.comm, Phase.D))
        return model.logits(x[-1:], mtp.final_layernorm)[0]


def _pick_draft(logits: torch.Tensor, params: SamplingParams, generator) -> tuple[int, torch.Tensor | None]:
    if params.temperature == 0.0:
        return int(logits.argmax()), None
    logq = filtered_logprobs(logits[None], params)  # [1, V]
    token = int(torch.multinomial(logq[0].exp(), 1, generator=generator))
    return token, logq


@torch.no_grad()
def generate_with_mtp(model: MoETransformer, prompt: list[int], params: SamplingParams, max_new_tokens: int,
                      generator: torch.Generator | None = None, block_size: int = 16) -> MTPGeneration:
    """`max_new_tokens` tokens after `prompt` (no stop tokens), drafting one token ahead with MTP."""
    if not model.cfg.mtp_num_layers:
        raise ValueError("the model has no MTP layer (mtp_num_layers=0); load or build one with mtp_num_layers >= 1")
    if not prompt or max_new_tokens <= 0:
        raise ValueError(f"need a non-empty prompt and max_new_tokens > 0, got {len(prompt)} and {max_new_tokens}")
    seq = _Sequence(model, len(prompt) + max_new_tokens + 2, block_size)
    h, logits = seq.target(list(prompt), 0)
    first = sample_row(logits[-1], params, generator)
    tokens, logprobs = [first.token], [first.logprob]
    q_logits = seq.draft_logits(h, list(prompt[1:]) + tokens, 0)
    n, drafted, accepted = len(prompt), 0, 0  # positions < n are cached; tokens[-1] sits at n
    while len(tokens) < max_new_tokens:
        draft, logq = _pick_draft(q_logits, params, generator)
        h, logits = seq.target([tokens[-1], draft], n)
        verdict = verify(logits, [draft], logq, params, generator)
        drafted, accepted = drafted + 1, accepted + verdict.accepted
        tokens += verdict.tokens
        logprobs += verdict.logprobs
        q_logits = seq.draft_logits(h[: verdict.accepted + 1], list(verdict.tokens), n)
        n += verdict.accepted + 1
    return MTPGeneration(tokens[:max_new_tokens], logprobs[:max_new_tokens], drafted, accepted)
