"""Token sampling with log-probabilities.

The log-probability reported for a token is the fp32 log-probability under the distribution it
was drawn from: the raw logits' softmax at temperature 0 (greedy) and 1; the temperature-scaled,
top-k/top-p-filtered softmax otherwise. That is what an RL trainer's importance ratio needs.
A request with a seed draws from its own generator, so its tokens do not depend on which other
requests share the batch.

Rows are judged one by one: a row whose logits are not finite (NaN weights, a diverging trainer)
comes back as a `Sampled` with `error` set and no token, so its caller can fail that request alone;
argmax over NaN would silently give token 0 and `multinomial` would raise for the whole batch.
-inf entries are allowed (a masked token), as long as some entry is finite.

`PendingGreedy` is the greedy draw of a whole batch split in two: the device work and an
asynchronous copy to pinned host memory are issued at once, the host reads them later. Its
`tokens` stay on the device, where the next decode forward can take them as input before the
host has seen them (`engine.ahead`). Its results equal `sample`'s for greedy rows.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_rollout.engine.api import SamplingParams


@dataclass(frozen=True)
class Sampled:
    """One row's draw: a token and its logprob, or (`error` set) why the row has none."""

    token: int | None
    logprob: float | None
    error: str | None = None
    """e.g. "non-finite logits (nan)"; the caller adds where (position, weight version)."""

    @property
    def ok(self) -> bool:
        return self.error is None


def _non_finite(row_max: float) -> Sampled:
    # A row's max is NaN if any entry is NaN (amax propagates NaN), +inf if any entry is +inf,
    # and -inf only when every entry is -inf: the three ways a softmax over it has no meaning.
    kind = "nan" if math.isnan(row_max) else ("inf" if row_max > 0 else "-inf everywhere")
    return Sampled(None, None, f"non-finite logits ({kind})")


def filtered_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [V] -> fp32 log-probabilities of the sampling distribution (-inf where filtered)."""
    x = logits.float()
    if params.temperature not in (0.0, 1.0):
        # Shift first: the max becomes 0, so a tiny temperature gives -inf for the rest, never inf - inf.
        x = (x - x.max()) / params.temperature
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
    """logits: [V]."""
    return sample(logits[None], [params], [generator])[0]


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Sampled:
    """logits: [V], some entry finite and none NaN or +inf."""
    if params.temperature == 0.0:
        logp = logits.float().log_softmax(-1)
        token = int(torch.argmax(logp))
        return Sampled(token, float(logp[token]))
    logp = filtered_logprobs(logits, params)
    token = int(torch.multinomial(logp.exp().cpu(), 1, generator=generator))
    return Sampled(token, float(logp[token]))


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[Sampled]:
    """logits: [rows, V]; one params and generator per row. Never raises for a row's values: a
    non-finite row gets `Sampled(None, None, error)` and the other rows are sampled as usual."""
    if logits.shape[0] == 0:
        return []
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    row_max = logits.amax(-1).float()  # [rows]
    if greedy:  # greedy rows' tokens travel to the host with the row maxima: one sync for the batch
        logp = logits[greedy].float().log_softmax(-1)
        tokens = logp.argmax(-1)
        host = torch.cat([row_max, tokens.float(), logp.gather(-1, tokens[:, None]).squeeze(-1)]).tolist()
    else:
        host = row_max.tolist()
    rows = len(params)
    out: list[Sampled | None] = [None if math.isfinite(m) else _non_finite(m) for m in host[:rows]]
    for k, i in enumerate(greedy):
        if out[i] is None:  # a token id below 2**24 is exact in fp32
            out[i] = Sampled(int(host[rows + k]), host[rows + len(greedy) + k])
    for i, p in enumerate(params):
        if out[i] is None:
            out[i] = _draw(logits[i], p, generators[i])
    return out  # type: ignore[return-value]


class PendingGreedy:
    """Greedy draws of every row of `logits` [rows, V], issued now and read by `result`."""

    def __init__(self, logits: torch.Tensor) -> None:
        row_max = logits.amax(-1).float()
        logp = logits.float().log_softmax(-1)
        self.tokens = logp.argmax(-1)
        """[rows] int64 on the logits' device: row i's token (garbage for a non-finite row)."""
        packed = torch.cat([row_max, self.tokens.float(), logp.gather(-1, self.tokens[:, None]).squeeze(-1)])
        self._ready: torch.cuda.Event | None = None
        if packed.is_cuda:
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = packed
        self.rows = logits.shape[0]

    def result(self, rows: Sequence[int]) -> list[Sampled]:
        """The draws of `rows` (indices into the logits), waiting for the copy if it is in flight."""
        if self._ready is not None:
            self._ready.synchronize()
        host, n = self._host.tolist(), self.rows
        out = []
        for i in rows:
            m = host[i]
            out.append(Sampled(int(host[n + i]), host[2 * n + i]) if math.isfinite(m) else _non_finite(m))
        return out
