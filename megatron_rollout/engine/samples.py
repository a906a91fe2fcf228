"""The n samples of one request: one prefill of the prompt, n decode rows over its shared blocks.

A request with `SamplingParams.n` > 1 runs as one request until its prompt's last position has
logits. That row is drawn n times, sample i with its own generator (`api.sample_seed`); samples
1..n-1 then become requests of their own on new sequences that share the prompt's full KV blocks
(reference counted) and get a copy of its last, partial block, so the prompt is computed once.
`SampleGroup` is what the n requests share: their seeds, the results of the finished ones, and the
request id the caller holds; its `RequestOutput` is returned once the last sample finishes.

Left out: beam search and any other cross-sample scoring: the samples never see each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_rollout.engine.api import GenerationResult, SamplingParams, sample_seed


@dataclass
class SampleGroup:
    rid: int
    """The request id the caller holds (sample 0's request)."""
    n: int
    generators: list[torch.Generator | None]
    """Sample i's generator; None: the engine's shared one (an unseeded request)."""
    results: list[GenerationResult | None] = field(default_factory=list)
    """Sample i's result once it finished."""
    forked: bool = False
    """Samples 1..n-1 exist (the prompt's logits were drawn n times)."""
    live: int = 1
    """Samples still running."""

    @classmethod
    def of(cls, rid: int, params: SamplingParams) -> "SampleGroup":
        gens = [None if params.seed is None else torch.Generator().manual_seed(sample_seed(params.seed, i))
                for i in range(params.n)]
        return cls(rid, params.n, gens, [None] * params.n)

    def draws(self) -> int:
        """Tokens the request's next sampled row draws: n until the samples are forked, then 1."""
        return 1 if self.forked else self.n

    def done(self, index: int, result: GenerationResult) -> bool:
        """Record sample `index`'s result; True once every sample has one. A request that ends
        before its samples were forked (refused, aborted, non-finite logits) ends all n alike."""
        if not self.forked:
            self.results = [result] * self.n
            self.live = 0
            return True
        self.results[index] = result
        self.live -= 1
        return self.live == 0
